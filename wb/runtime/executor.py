"""Runs one worker's part of a plan: pack, send, receive, unpack, forward.

Each message of the plan is one tagged send from its source rank to its destination rank (tag =
``tag_base + message index``, the same on every rank). A message whose single region is contiguous
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
transport); a :class:`~wb.runtime.program.Program` is a rank's part of a plan, worked out once;
its :meth:`~wb.runtime.program.Program.run` is one update (:mod:`wb.runtime.update`, the loop).
A :class:`wb.Sender` / :class:`wb.Receiver` connects and makes its program once, then runs one
update per version. :func:`execute` does all three once, for a single transfer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from wb.data.layout import Layout
from wb.data.plan import Plan
from wb.data.rankplan import RankPlan, RankPlans, fingerprint, part_of
from wb.errors import TransferError
from wb.runtime.program import Program
from wb.runtime.update import DEFAULT_STAGING_BYTES, ExecStats, abort

# DEFAULT_STAGING_BYTES and ExecStats are defined by the update loop; re-exported here, where
# callers of execute() have always found them
__all__ = ["DEFAULT_STAGING_BYTES", "ExecStats", "connect", "execute", "plan_fingerprint",
           "plan_peers"]


def plan_fingerprint(plan: Plan | RankPlan) -> str:
    """A hash of everything that decides which bytes go where (hex sha256); a rank's part carries
    the hash of its whole plan."""
    return plan.fingerprint if isinstance(plan, RankPlan) else fingerprint(plan)


def plan_peers(plan: Plan | RankPlan | RankPlans, rank: int) -> list[int]:
    """The ranks ``rank`` exchanges messages with in ``plan`` (a whole plan or ``rank``'s part)."""
    if isinstance(plan, (RankPlan, RankPlans)):
        return list(part_of(plan, rank).peers)
    M = plan.messages
    mine = (M.src_rank == rank) | (M.dst_rank == rank)
    return sorted((set(M.src_rank[mine].tolist()) | set(M.dst_rank[mine].tolist())) - {rank})


def connect(plan: Plan | RankPlan, rank: int, transport) -> list[int]:
    """Connects ``transport`` to ``rank``'s peers in ``plan``.

    A hello round through the store in which every peer must show the same plan (fingerprint),
    then every endpoint, created while each peer is known to be alive (UCX cannot create one to a
    peer that has died since: with error handling off it aborts). A :class:`wb.Sender` /
    :class:`wb.Receiver` does this once at set-up, then runs one
    :meth:`~wb.runtime.program.Program.run` per version.

    Args:
        plan: the plan every worker runs, or this rank's part of it (which carries the whole
            plan's fingerprint).
        rank: this worker's rank.
        transport: this rank's :class:`wb.runtime.transport.Transport`.

    Returns:
        The peers (sorted ranks).

    Raises:
        TransferError: a peer runs another plan (refused before any byte moves; the transport is
            aborted).
    """
    if isinstance(plan, RankPlans):
        plan = part_of(plan, rank)
    peers = plan_peers(plan, rank)
    fp = plan_fingerprint(plan).encode()
    wrong = sorted(p for p, h in transport.connect(peers, hello=fp).items() if h != fp)
    if wrong:
        abort(transport)
        raise TransferError(f"rank {rank}: peers {wrong} run a different plan (fingerprint "
                            f"mismatch); refusing before sending anything; give every worker the "
                            f"same plan")
    prepare = getattr(transport, "prepare", None)
    if prepare is not None:
        prepare(peers)
    return peers


def execute(plan: Plan | RankPlan, rank: int, buffers: Mapping[str, Any], transport, *,
            layout: Layout | None = None, staging_bytes: int = DEFAULT_STAGING_BYTES,
            timeout: float = 60.0, tag_base: int = 0, trace: list | None = None) -> ExecStats:
    """Runs ``rank``'s part of ``plan`` once: connects, runs one update, closes the transport.

    For a single transfer. To run a plan many times over one transport, :func:`connect` once and
    call :meth:`Program.run <wb.runtime.program.Program.run>` per update (as :class:`wb.Sender`
    and :class:`wb.Receiver` do).

    Args:
        plan: the plan every worker runs, or this rank's part of it (checked by fingerprint with
            every peer).
        rank: this worker's rank.
        buffers: ``{buffer name: array}`` of this worker's layout: numpy or DLPack host arrays, or
            CUDA arrays (packing then runs on the device, with CuPy). Filled in place on rollouts.
        transport: a connected-on-demand :class:`wb.runtime.transport.Transport` for this rank;
            closed (with a barrier) when done, aborted on failure.
        layout: this worker's own layout (as it probed it); refused if the plan's differs.
        staging_bytes: bound on packing/unpacking memory in flight (split receive/send).
        timeout: seconds without any progress before raising :class:`wb.TransferError`.
        tag_base: added to every tag.
        trace: a list to append one :class:`~wb.runtime.update.TraceEntry` ``(message, stage,
            peer, outgoing, nbytes, ready, posted, done)`` per message of this rank to, times as
            ``time.time()`` (comparable across the processes of one host): ``ready`` when its
            data was here (a forward: its parent landed), ``posted`` when handed to the transport
            (after packing), ``done`` when it completed (a receive: after unpacking). For finding
            where an update's time goes.

    Returns:
        :class:`ExecStats`.

    Raises:
        TransferError: an unknown rank, bad buffers or a plan for other layouts (before any byte
            moves), a peer running another plan (before sending), a failed or stalled transfer
            (naming the peer and plan step).
    """
    program = Program(plan, rank)
    program.check(buffers, layout=layout)  # refuse bad buffers before connecting to anyone
    connect(program.part, rank, transport)
    stats = program.run(buffers, transport, tag_base=tag_base, staging_bytes=staging_bytes,
                        timeout=timeout, trace=trace, layout=layout)
    transport.close()
    return stats
