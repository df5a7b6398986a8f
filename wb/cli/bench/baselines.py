"""What RL frameworks do today, as plans the same executor runs: the baselines of ``wb bench``.

- **Naive P2P** (:func:`p2p_plan`): every rollout buffer pulls each of its regions straight from a
  fixed holder (the lowest-rank trainer holding it), as Miles' P2P mode and hand-written
  shard-to-shard transfers do: no dedup across replicas or the GPUs of a node, no balancing.
- **Broadcast** (:func:`broadcast_plans`): as slime / Miles by default, full tensors are first
  gathered at one trainer rank (the *gather rank*, on trainer 0's GPU), then sent whole to every
  rollout worker, which cuts out its own slices with its loader (:meth:`FullArena.load`). The
  sending side is given the same fan-out as wb's plans (stage 2 chains between nodes, stage 3
  inside them), which is at least as good as NCCL's ring: the baseline's costs are the gather,
  the single sending GPU, every rollout GPU receiving every byte, and the load.

Both are :class:`wb.Plan` objects built from the same correspondence and pieces as :func:`wb.plan`,
so the executor, the transport and the checks are the same for all three.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from wb.algorithms.planner import DEFAULT_CHUNK_BYTES, Routes, plan, plan_from_routes
from wb.data.correspondence import correspond
from wb.data.layout import Cluster, Layout, Worker
from wb.data.plan import Plan, slot_table
from wb.data.spec import CheckpointSpec
from wb.layouts.blocks import buffer_spec, slice_block

__all__ = ["p2p_plan", "broadcast_plans", "full_layout", "needed_tensors", "FullArena"]


def p2p_plan(trainers: Sequence[Layout], rollouts: Sequence[Layout], cluster: Cluster | None = None,
             *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Plan:
    """The naive P2P baseline: each need region from the lowest-rank holder, stage 1 only.

    Examples:
        >>> import numpy as np, wb
        >>> sm = wb.SourceMap.from_indices(np.arange(16).reshape(4, 4))
        >>> t = [wb.Layout(wb.Worker(r, "t", "trainer", r), {"w": wb.BufferSpec(sm, "float32")})
        ...      for r in range(2)]
        >>> r = [wb.Layout(wb.Worker(2 + i, f"r{i}", "rollout"), {"w": wb.BufferSpec(sm, "float32")})
        ...      for i in range(2)]
        >>> p2p_plan(t, r).traffic().trainer_out   # everything from rank 0, once per rollout
        {0: 128, 1: 0}
    """
    trainers, rollouts = tuple(trainers), tuple(rollouts)
    corr = correspond(trainers, rollouts)
    tab, _ = slot_table(corr.slots, trainers, rollouts)
    role = tab.role[corr.inc_slot]
    H = np.flatnonzero(role == 0)
    N = np.flatnonzero(role == 1)
    # the fixed holder of each cell: its lowest-rank holder incidence
    order = np.lexsort((tab.rank[corr.inc_slot[H]], corr.inc_cell[H]))
    H = H[order]
    hc = corr.inc_cell[H]
    first = np.r_[True, hc[1:] != hc[:-1]]
    fixed = np.full(corr.cell_id0.size, -1, np.int64)
    fixed[hc[first]] = H[first]
    n_cell = corr.inc_cell[N]
    z = np.zeros(N.size, np.int64)
    routes = Routes(cell=n_cell, stage=z + 1, src=fixed[n_cell], dst=N, parent=z - 1, level=z)
    return plan_from_routes(trainers, rollouts, routes, corr=corr, table=tab, cluster=cluster,
                            chunk_bytes=chunk_bytes)


def full_layout(spec: CheckpointSpec, worker: Worker, names: Sequence[str] | None = None, *,
                buffers: dict | None = None) -> Layout:
    """A layout of whole checkpoint tensors (what a broadcast delivers to every worker).

    The maps are built from one affine block per tensor (nothing of model size is allocated);
    pass ``buffers`` of an earlier call to share its BufferSpecs between workers.
    """
    if buffers is None:
        buffers = {n: buffer_spec(spec.shape(n), slice_block(spec, n), spec.dtype(n))
                   for n in (spec.names if names is None else names)}
    return Layout(worker, buffers)


def broadcast_plans(spec: CheckpointSpec, trainers: Sequence[Layout], rollouts: Sequence[Layout],
                    cluster: Cluster | None = None, *, gather_rank: int,
                    chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[Plan, Plan]:
    """The broadcast baseline: ``(gather, broadcast)``.

    ``gather`` moves every trainer shard into whole tensors at ``gather_rank`` (a worker on trainer
    0's GPU); ``broadcast`` sends those whole tensors to every rollout worker, each receiving every
    tensor the rollouts need. Each rollout then cuts its buffers out with :meth:`FullArena.load`.
    """
    t0 = trainers[0].worker
    needed = needed_tensors(spec, rollouts)
    g_worker = Worker(gather_rank, t0.node, "rollout", t0.local_rank)
    bufs = dict(full_layout(spec, g_worker, needed).buffers)
    gather = plan(trainers, [Layout(g_worker, bufs)], cluster, chunk_bytes=chunk_bytes)
    g_holder = Layout(Worker(gather_rank, t0.node, "trainer", t0.local_rank), bufs)
    full = [Layout(lay.worker, bufs) for lay in rollouts]
    return gather, plan([g_holder], full, cluster, chunk_bytes=chunk_bytes)


def needed_tensors(spec: CheckpointSpec, layouts: Sequence[Layout]) -> list[str]:
    """The checkpoint tensors any buffer of ``layouts`` takes elements from, in id order."""
    starts = np.array([spec.offset(n) for n in spec.names], np.int64)
    hit = np.zeros(len(spec.names), bool)
    for lay in layouts:
        for b in lay.buffers.values():
            bl = b.sourcemap.blocks
            if not bl.count:
                continue
            ends = [bl.id0 + a * (bl.nr - 1) * bl.sr + c * (bl.nc - 1) * bl.sc
                    for a in (0, 1) for c in (0, 1)]
            lo = np.searchsorted(starts, np.minimum.reduce(ends), side="right") - 1
            hi = np.searchsorted(starts, np.maximum.reduce(ends), side="right") - 1
            for a, c in zip(lo.tolist(), hi.tolist()):
                hit[a:c + 1] = True
    order = np.argsort(starts, kind="stable")
    return [spec.names[int(k)] for k in order if hit[k]]


class FullArena:
    """Whole tensors in one flat array, in id order (what a broadcast delivers), and the loader
    that cuts a rollout's buffers out of it.

    Args:
        spec: the checkpoint.
        names: the tensors it holds (:func:`needed_tensors`, in id order); one dtype for all.
        xp: numpy, or CuPy for device memory (bf16/fp8 then held as same-width integers).
    """

    def __init__(self, spec: CheckpointSpec, names: Sequence[str], *, xp=np):
        from wb.data.dtypes import dtype_info

        dts = {spec.dtype(n) for n in names}
        if len(dts) != 1:
            raise ValueError(f"FullArena holds one dtype, the tensors have {sorted(dts)}")
        self.dtype = dts.pop()
        self.names = list(names)
        sizes = np.array([int(np.prod(spec.shape(n))) for n in self.names], np.int64)
        self.starts = np.array([spec.offset(n) for n in self.names], np.int64)  # first ids
        self.base = np.r_[0, np.cumsum(sizes)[:-1]]  # arena position of each first id
        npdt = np.dtype(dtype_info(self.dtype).numpy)
        if xp is not np and npdt.kind == "V":  # CuPy has no bfloat16 / float8
            npdt = np.dtype(f"u{npdt.itemsize}")
        self.flat = xp.empty(int(sizes.sum()), dtype=npdt)
        self.xp = xp
        self.views = {n: self.flat[int(b):int(b + z)].reshape(spec.shape(n))
                      for n, b, z in zip(self.names, self.base, sizes)}

    def positions(self, ids: np.ndarray) -> np.ndarray:
        """Arena positions of ids (each >= 0 and in one of the arena's tensors)."""
        k = np.searchsorted(self.starts, ids, side="right") - 1
        return self.base[k] + (ids - self.starts[k])

    def load(self, layout: Layout, buffers: dict) -> None:
        """The rollout's loader after a broadcast: each affine block of each buffer's map is one
        strided slice copy out of the arena (what ``load_weights`` does with full tensors), on the
        device for CuPy arenas."""
        xp = self.xp
        item = self.flat.itemsize
        for n, b in layout.buffers.items():
            sm = b.sourcemap
            rows, cols = sm.view2d
            out = buffers[n].reshape(rows, cols)
            if out.dtype != self.flat.dtype:
                out = out.view(self.flat.dtype)
            bl = sm.blocks
            pos = self.positions(bl.id0)
            for k in range(bl.count):
                nr, nc = int(bl.nr[k]), int(bl.nc[k])
                sr, sc = int(bl.sr[k]), int(bl.sc[k])
                src = xp.lib.stride_tricks.as_strided(
                    self.flat[int(pos[k]):], shape=(nr, nc),
                    strides=(sr * item if nr > 1 else 0, sc * item if nc > 1 else 0))
                r0, c0 = int(bl.r0[k]), int(bl.c0[k])
                out[r0:r0 + nr, c0:c0 + nc] = src
        if xp is not np:
            xp.cuda.get_current_stream().synchronize()
