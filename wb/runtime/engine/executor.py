"""Runs one worker's part of a plan: pack, send, receive, unpack, forward.

Each message of the plan is one tagged send from its source rank to its destination rank (tag =
``tag_base + message index``, the same on every rank; checksums' digests take ``tag_base +
2**26`` on, below ``2**27``: updates over one transport need tag bases ``2**27`` apart). A message whose single region is contiguous
in both buffers moves zero-copy (sent from and received into the buffers themselves); others are
packed into contiguous staging on the sender (strided views, no index arrays) and unpacked at the
receiver. A message whose source and destination are the same rank is a local copy. A forwarded
message (stage 2 or 3) leaves as soon as the message that brought its data has landed.

Staging is bounded (``staging_bytes``, split between receives and sends). Receives and packed
sends are issued in plan order, which is topological: the lowest unfinished message of the whole
plan always has its parent done, its receive posted and staging free at its sender, so every plan
makes progress whatever the budget. Zero-copy messages and local copies use no staging and go as
soon as they are ready.

A peer that dies or hangs stops completions: after ``timeout`` seconds without any progress the
worker raises :class:`wb.TransferError` naming the peers and plan steps it is still waiting for.

The pieces: :func:`connect` checks with every peer that it runs the same plan (once per
transport); a :class:`~wb.runtime.engine.program.Program` is a rank's part of a plan, worked out once;
its :meth:`~wb.runtime.engine.program.Program.run` is one update (:mod:`wb.runtime.engine.update`, the loop).
A :class:`wb.Sender` / :class:`wb.Receiver` connects and makes its program once, then runs one
update per version. :func:`execute` does all three once, for a single transfer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from wb.data.layout import Layout
from wb.data.plan import RankPlan
from wb.errors import TransferError
from wb.runtime.engine.digests import checksumming
from wb.runtime.engine.frames import framing
from wb.runtime.engine.inflight import abort
from wb.runtime.engine.program import Program
from wb.runtime.engine.update import ExecStats

__all__ = ["connect", "execute"]


def connect(part: RankPlan, transport) -> list[int]:
    """Connects ``transport`` to the peers of the rank whose part ``part`` is.

    A hello round through the store in which every peer must show the same plan (fingerprint),
    then every endpoint, created while each peer is known to be alive (UCX cannot create one to a
    peer that has died since: with error handling off it aborts). A :class:`wb.Sender` /
    :class:`wb.Receiver` does this once at set-up, then runs one
    :meth:`~wb.runtime.engine.program.Program.run` per version.

    Args:
        part: this rank's part of the plan (it carries the whole plan's fingerprint).
        transport: this rank's :class:`wb.Transport`.

    Returns:
        The peers (sorted ranks).

    Raises:
        TransferError: a peer runs another plan (refused before any byte moves; the transport is
            aborted).
    """
    peers = list(part.peers)
    # the plan, whether this rank frames small messages and checks sums: peers must do as it does
    fp = (f"{part.fingerprint}:frames={int(framing(transport))}"
          f":checksums={int(checksumming(transport))}").encode()
    wrong = sorted(p for p, h in transport.connect(peers, hello=fp).items() if h != fp)
    if wrong:
        abort(transport)
        raise TransferError(f"rank {part.rank}: peers {wrong} run a different plan (fingerprint "
                            f"mismatch), or frame small messages or take checksums otherwise (a "
                            f"transport of another kind or setting); refusing before sending "
                            f"anything; give every worker the same plan and the same kind of "
                            f"transport")
    prepare = getattr(transport, "prepare", None)
    if prepare is not None:
        try:
            prepare(peers)  # endpoints; with a job key, the peers' challenge
        except TransferError:
            abort(transport)
            raise
    return peers


def execute(part: RankPlan, buffers: Mapping[str, Any], transport, *,
            layout: Layout | None = None, staging_bytes: int | None = None,
            timeout: float = 60.0, tag_base: int = 0, trace: list | None = None) -> ExecStats:
    """Runs one rank's part of a plan once: connects, runs one update, closes the transport.

    For a single transfer. To run a plan many times over one transport, :func:`connect` once and
    call :meth:`Program.run <wb.runtime.engine.program.Program.run>` per update (as :class:`wb.Sender`
    and :class:`wb.Receiver` do).

    Args:
        part: this rank's part of the plan (:class:`wb.RankPlan`; ``RankPlan.of(plan, rank)``
            cuts it out of a whole plan), checked by fingerprint with every peer.
        buffers: ``{buffer name: array}`` of this worker's layout: numpy or DLPack host arrays, or
            CUDA arrays (packing then runs on the device, with CuPy). Filled in place on rollouts.
        transport: a connected-on-demand :class:`wb.Transport` for this rank;
            closed (with a barrier) when done, aborted on failure.
        layout: this worker's own layout (as it probed it); refused if the plan's differs.
        staging_bytes: bound on packing/unpacking memory in flight (split receive/send);
            default: 256 MiB on the host, 1 GiB with CUDA buffers.
        timeout: seconds without any progress before raising :class:`wb.TransferError`.
        tag_base: added to every tag.
        trace: a list to append one :class:`~wb.runtime.engine.update.TraceEntry` ``(message, stage,
            peer, outgoing, nbytes, ready, posted, done)`` per message of this rank to, times as
            ``time.time()`` (comparable across the processes of one host): ``ready`` when its
            data was here (a forward: its parent landed), ``posted`` when handed to the transport
            (after packing), ``done`` when it completed (a receive: after unpacking). For finding
            where an update's time goes.

    Returns:
        :class:`ExecStats`.

    Raises:
        TransferError: bad buffers or a plan for other layouts (before any byte moves), a peer running another plan (before sending), a failed or stalled transfer
            (naming the peer and plan step).
    """
    program = Program(part, frames=framing(transport), checksums=checksumming(transport))
    program.check(buffers, layout=layout)  # refuse bad buffers before connecting to anyone
    connect(part, transport)
    stats = program.run(buffers, transport, tag_base=tag_base, staging_bytes=staging_bytes,
                        timeout=timeout, trace=trace, layout=layout)
    transport.close()
    return stats
