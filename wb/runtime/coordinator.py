"""Versions and sync modes on top of the executor: :class:`Sender` (trainer) and :class:`Receiver`
(rollout), one per worker (GPU), and the stall accounting behind EWTT and AGST.

Two switches give the four sync modes (:data:`MODES`, each a :class:`SyncMode`):

- sender staging off: :meth:`Sender.push` blocks until this trainer's bytes are sent; on: it blocks
  only for a local copy of the weights into a staging buffer, then the copy is sent by a background
  thread while training goes on (the next ``push`` first waits for that send to finish).
- receiver staging off: :meth:`Receiver.apply` receives the new version straight into the live
  buffers, so the rollout stops generating for the whole transfer; on: the version lands in a
  staging buffer in the background while the rollout generates, and ``apply`` is one device copy
  into the live buffers (same addresses, as CUDA graphs need). A rollout never sees half a version,
  and a failed transfer leaves the previous version in place and raises from ``apply``.

Each switch picks, once at set-up, the object that moves a version (:mod:`wb.runtime.sender`,
:mod:`wb.runtime.receiver`); what a Sender and a Receiver share is an
:class:`~wb.runtime.endpoint.Endpoint`. Per update, every worker of the plan *joins* version ``v``
(a key in the rendezvous store) and waits for the peers it exchanges bytes with; then the
executor runs with tags ``v << 32``. A trainer *announces* ``v`` when ``push`` is called, which is
what :meth:`Receiver.ready` looks for without staging. Each call records the seconds it blocked
its caller (:class:`UpdateStats`); :func:`summarize` turns every worker's records into EWTT and
AGST.
"""

from __future__ import annotations

import io
from typing import NamedTuple

from wb.algorithms.planner import plan as make_plan
from wb.data.layout import Role, layouts_from_bytes, layouts_to_bytes
from wb.data.plan import Plan
from wb.errors import TransferError
from wb.runtime.buffers import aligned_empty
from wb.runtime.receiver import Receiver
from wb.runtime.sender import Sender
from wb.runtime.stats import Summary, UpdateStats, summarize

__all__ = ["Sender", "Receiver", "SyncMode", "MODES", "UpdateStats", "Summary", "summarize",
           "aligned_empty", "agree_plan"]


class SyncMode(NamedTuple):
    """Which sides stage (see the module doc): one of the four sync modes of :data:`MODES`."""

    sender_staging: bool  # push returns after a local copy; a thread sends the copy
    receiver_staging: bool  # versions land in staging while the rollout generates


#: The four sync modes by name.
MODES: dict[str, SyncMode] = {
    "sync": SyncMode(False, False),  # both sides block for the whole transfer
    "sender": SyncMode(True, False),  # trainer copies, trains on; rollouts block while bytes land
    "receiver": SyncMode(False, True),  # trainer blocks; rollouts generate while bytes land
    "both": SyncMode(True, True),  # each side blocks only for one local copy
}


def agree_plan(store, layouts, *, world: int, name: str = "wb", timeout: float = 600.0,
               **plan_kwargs) -> Plan:
    """Every process publishes its workers' layouts; the one holding rank 0 plans; all get the plan.

    Layouts and the plan travel through ``store`` as ``.npz`` bytes (no pickle). Ranks must be
    ``0 .. world - 1`` across all processes.

    Args:
        store: the rendezvous store every process shares.
        layouts: this process's workers' layouts (as each probed its own load path).
        world: the number of workers (trainers + rollouts) of the plan.
        name: keeps the keys of concurrent sessions apart.
        timeout: seconds to wait for the other processes.
        plan_kwargs: passed to :func:`wb.plan` (``cluster=``, ``chunk_bytes=``).

    Returns:
        The :class:`wb.Plan`, the same in every process.

    Raises:
        TransferError: a rank outside ``0 .. world - 1``, or another process did not publish its
            layouts (or the plan) within ``timeout``.
    """
    layouts = list(layouts)
    for lay in layouts:
        if not 0 <= lay.worker.rank < world:
            raise TransferError(f"rank {lay.worker.rank} is outside 0..{world - 1} (world={world})")
        store.set(f"{name}/layout/{lay.worker.rank}", layouts_to_bytes([lay]))
    if any(lay.worker.rank == 0 for lay in layouts):
        everyone = [layouts_from_bytes(store.get(f"{name}/layout/{r}", timeout))[0]
                    for r in range(world)]
        p = make_plan([x for x in everyone if x.worker.role == Role.TRAINER],
                      [x for x in everyone if x.worker.role == Role.ROLLOUT], **plan_kwargs)
        f = io.BytesIO()
        p.save(f)
        store.set(f"{name}/plan", f.getvalue())
        return p
    return Plan.load(io.BytesIO(store.get(f"{name}/plan", timeout)))
