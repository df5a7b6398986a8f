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
import json
import time
from typing import NamedTuple

from wb.algorithms.blockplan import quantize_layouts
from wb.algorithms.planner import plan as make_plan
from wb.data.layout import Role
from wb.data.plan import Plan
from wb.data.rankplan import RankPlans, parts
from wb.runtime.buffers import aligned_empty
from wb.runtime.receiver import Receiver
from wb.runtime.records import fetch_part, gather_layouts, publish_layouts, publish_parts
from wb.runtime.rendezvous import get_large, set_large
from wb.runtime.sender import Sender
from wb.runtime.stats import Summary, UpdateStats, summarize

__all__ = ["Sender", "Receiver", "SyncMode", "MODES", "UpdateStats", "Summary", "summarize",
           "aligned_empty", "agree_plan", "agree_parts", "publish_layouts", "gather_layouts",
           "publish_parts", "fetch_part"]


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


def _plan_here(store, layouts: list, *, world: int, name: str, timeout: float,
               **plan_kwargs) -> Plan | None:
    """Publishes this process's layouts; in the process holding rank 0, gathers everyone's and
    returns the plan of them (``None`` elsewhere)."""
    publish_layouts(store, layouts, world=world, name=name)
    if not any(lay.worker.rank == 0 for lay in layouts):
        return None
    everyone = gather_layouts(store, world=world, name=name, timeout=timeout)
    trainers = [x for x in everyone if x.worker.role == Role.TRAINER]
    quantize = plan_kwargs.pop("quantize", None)
    if quantize is not None:  # each trainer rebuilds its own tasks (tasks_for): none travel,
        q = quantize_layouts(trainers, quantize)  # only who exchanges blocks' amax with whom
        store.set(f"{name}/fp8peers", json.dumps({str(r): p for r, p in q.peers.items()}).encode())
        trainers = list(q.trainers)
    return make_plan(trainers, [x for x in everyone if x.worker.role == Role.ROLLOUT],
                     **plan_kwargs)


def agree_parts(store, layouts, *, world: int, name: str = "wb", timeout: float = 600.0,
                planned: list | None = None, **plan_kwargs) -> RankPlans:
    """Every process publishes its workers' layouts; the one holding rank 0 plans and publishes
    each rank's part under its own key; every process fetches only its own workers' parts.

    What goes through the store is the layouts once and the parts once (a part is the messages a
    rank sends and receives: kilobytes to a few MB even for a 1T model on 512 GPUs), chunked
    where the store limits its values (``max_value_bytes`` of the adapter). Pass each part to
    :class:`wb.Sender` / :class:`wb.Receiver` (or all of them to :class:`wb.LocalSession`).

    Args:
        store: the rendezvous store every process shares.
        layouts: this process's workers' layouts (as each probed its own load path).
        world: the number of workers (trainers + rollouts) of the plan.
        name: keeps the keys of concurrent sessions apart.
        timeout: seconds to wait for the other processes.
        planned: a list; in the process that plans, the whole :class:`wb.Plan` is appended to
            it (for ``verify()``, ``traffic()``, saving).
        plan_kwargs: passed to :func:`wb.plan` (``cluster=``, ``chunk_bytes=``); and
            ``quantize=``, a :class:`wb.BlockScaled`: rollouts serve those tensors block-scaled
            (:func:`wb.quantize_layouts` before planning; pass the same to each trainer's
            :class:`wb.Sender` with its own ``layout=``).

    Returns:
        :class:`~wb.data.rankplan.RankPlans`: ``{rank: RankPlan}`` of this process's workers;
        it stands where a whole plan stood for them (Sender, Receiver, the shims' groups).

    Raises:
        TransferError: a rank outside ``0 .. world - 1``, or another process did not publish its
            layouts (or the parts) within ``timeout``.

    Examples:
        >>> import numpy as np, wb
        >>> sm = wb.SourceMap.from_indices(np.arange(8))
        >>> lays = [wb.Layout(wb.Worker(r, "n", role), {"w": wb.BufferSpec(sm, "float32")})
        ...         for r, role in ((0, "trainer"), (1, "rollout"))]
        >>> sorted(agree_parts(wb.MemoryStore(), lays, world=2))
        [0, 1]
    """
    layouts = list(layouts)
    quantized = plan_kwargs.get("quantize") is not None
    p = _plan_here(store, layouts, world=world, name=name, timeout=timeout, **plan_kwargs)
    if p is not None:
        if planned is not None:
            planned.append(p)
        # what the trainers' leader needs to plan again (a dead rollout, a joiner): the layouts
        # are in the store already (wb.runtime.finish)
        c = p.cluster
        store.set(f"{name}/roster", json.dumps({
            "world": world, "chunk_bytes": p.chunk_bytes, "quantized": quantized,
            "cluster": [c.nic_gbps, c.nvlink_GBps, dict(c.nodes)]}).encode())
        mine = {lay.worker.rank for lay in layouts}
        out = {}
        for part in parts(p):
            set_large(store, f"{name}/part/{part.rank}", part.to_bytes())
            if part.rank in mine:
                out[part.rank] = part
        return RankPlans(out)
    deadline = time.monotonic() + timeout
    return RankPlans([fetch_part(store, lay.worker.rank, name=name,
                                 timeout=max(deadline - time.monotonic(), 0.001))
                      for lay in layouts])


def agree_plan(store, layouts, *, world: int, name: str = "wb", timeout: float = 600.0,
               **plan_kwargs) -> Plan:
    """Every process publishes its workers' layouts; the one holding rank 0 plans; all get the
    whole plan.

    Every process downloads and loads the whole plan: fine for small jobs; at scale (hundreds of
    GPUs) use :func:`agree_parts`, which gives each rank only its part.
    Layouts and the plan travel through ``store`` as ``.npz`` bytes (no pickle), chunked where the
    store limits its values. Ranks must be ``0 .. world - 1`` across all processes.

    Args:
        store, layouts, world, name, timeout, plan_kwargs: as :func:`agree_parts`.

    Returns:
        The :class:`wb.Plan`, the same in every process.

    Raises:
        TransferError: a rank outside ``0 .. world - 1``, or another process did not publish its
            layouts (or the plan) within ``timeout``.
    """
    p = _plan_here(store, list(layouts), world=world, name=name, timeout=timeout, **plan_kwargs)
    if p is not None:
        f = io.BytesIO()
        p.save(f)
        set_large(store, f"{name}/plan", f.getvalue())
        return p
    return Plan.load(io.BytesIO(get_large(store, f"{name}/plan", timeout)))
