"""Set-up: every process publishes its workers' layouts, one plans, each rank gets its part
(:func:`agree_parts`).
"""

from __future__ import annotations

import time

from wb.algorithms import planner
from wb.algorithms.fp8.tasks import quantize_layouts
from wb.data.fp8 import BlockScaled
from wb.data.layout import Cluster, Layout, Role
from wb.data.plan import Plan, RankPlan, parts
from wb.errors import TransferError
from wb.runtime.transport.keyed import keyed
from wb.runtime.membership.records import fetch_part, gather_layouts, publish_layouts
from wb.runtime.transport.stores import set_large, set_record

__all__ = ["agree_parts"]


def _plan_here(store, layouts: list, *, world: int, name: str, timeout: float,
               quantize: BlockScaled | None, **plan_kwargs) -> Plan | None:
    """Publishes this process's layouts; in the process holding rank 0, gathers everyone's and
    returns the plan of them (``None`` elsewhere)."""
    publish_layouts(store, layouts, world=world, name=name)
    if not any(lay.worker.rank == 0 for lay in layouts):
        return None
    everyone = gather_layouts(store, world=world, name=name, timeout=timeout)
    trainers = [x for x in everyone if x.worker.role == Role.TRAINER]
    if quantize is not None:  # each trainer rebuilds its own tasks (tasks_for): none travel,
        q = quantize_layouts(trainers, quantize)  # only who exchanges blocks' amax with whom
        set_record(store, f"{name}/fp8peers", {str(r): p for r, p in q.peers.items()})
        trainers = list(q.trainers)
    return planner.plan(trainers, [x for x in everyone if x.worker.role == Role.ROLLOUT],
                        **plan_kwargs)


def agree_parts(store, layouts, *, world: int, name: str = "wb", timeout: float = 600.0,
                planned: list | None = None, quantize: BlockScaled | None = None,
                cluster: Cluster | None = None, chunk_bytes: int | None = None,
                delta: bool = False) -> dict[int, RankPlan]:
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
        quantize: rollouts serve these tensors block-scaled FP8 (``wb.FP8Blocks(...).bind(spec)``,
            a :class:`~wb.data.fp8.BlockScaled`): the trainers' layouts are turned into holders
            of the quantised checkpoint before planning
            (:func:`wb.algorithms.fp8.tasks.quantize_layouts`); pass the same to each trainer's
            :class:`wb.Sender` with its own ``layout=``.
        cluster: link rates to balance for, as :func:`wb.plan`.
        chunk_bytes: the largest piece, as :func:`wb.plan` (default
            :data:`~wb.algorithms.planner.DEFAULT_CHUNK_BYTES`, or
            :data:`~wb.algorithms.planner.DELTA_CHUNK_BYTES` with ``delta``).
        delta: the trainers will send deltas (``wb.Sender(..., delta=True)``): plan larger
            pieces, and pack every range below their size (``wb.plan``'s ``pack_below``), since
            each message then carries only what changed of it. The job runs either way; this is
            the messages' size only.

    Returns:
        ``{rank: RankPlan}`` of this process's workers: what :class:`wb.Sender`,
        :class:`wb.Receiver` and the shims' groups take.

    Raises:
        TransferError: ``world`` is not a positive int, a layout is not a :class:`wb.Layout`,
            a rank outside ``0 .. world - 1``, or another process did not publish its
            layouts (or the parts) within ``timeout``.

    Examples:
        >>> import numpy as np, wb
        >>> sm = wb.SourceMap.from_indices(np.arange(8))
        >>> lays = [wb.Layout(wb.Worker(r, "n", role), {"w": wb.BufferSpec(sm, "float32")})
        ...         for r, role in ((0, "trainer"), (1, "rollout"))]
        >>> sorted(agree_parts(wb.MemoryStore(), lays, world=2))
        [0, 1]
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise TransferError(f"agree_parts: world must be the number of workers (an int >= 1), "
                            f"got {world!r}")
    layouts = list(layouts)
    store = keyed(store)  # signed with the job's key (WB_JOB_KEY), if there is one
    bad = [type(lay).__name__ for lay in layouts if not isinstance(lay, Layout)]
    if bad:
        raise TransferError(f"agree_parts: layouts must be wb.Layout values, got {bad[0]}")
    if chunk_bytes is None:
        chunk_bytes = planner.DELTA_CHUNK_BYTES if delta else planner.DEFAULT_CHUNK_BYTES
    pack_below = chunk_bytes if delta else planner.SMALL_RUN_BYTES
    p = _plan_here(store, layouts, world=world, name=name, timeout=timeout, quantize=quantize,
                   cluster=cluster, chunk_bytes=chunk_bytes, pack_below=pack_below)
    if p is not None:
        if planned is not None:
            planned.append(p)
        # what the trainers' leader needs to plan again (a dead rollout, a joiner): the layouts
        # are in the store already (wb.runtime.membership.finish)
        c = p.cluster
        set_record(store, f"{name}/roster", {
            "world": world, "chunk_bytes": p.chunk_bytes, "pack_below": p.pack_below,
            "quantized": quantize is not None,
            "cluster": [c.nic_gbps, c.nvlink_GBps, dict(c.nodes)]})
        mine = {lay.worker.rank for lay in layouts}
        out = {}
        for part in parts(p):
            set_large(store, f"{name}/part/{part.rank}", part.to_bytes())
            if part.rank in mine:
                out[part.rank] = part
        return out
    deadline = time.monotonic() + timeout
    return {lay.worker.rank: fetch_part(store, lay.worker.rank, name=name,
                                        timeout=max(deadline - time.monotonic(), 0.001))
            for lay in layouts}
