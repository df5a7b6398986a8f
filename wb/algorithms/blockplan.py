"""Who quantises which block: trainer layouts turned into holders of a block-scaled FP8 checkpoint.

Rollouts that serve block-scaled FP8 (:mod:`wb.data.blockscale`) need the FP8 checkpoint's ids:
each declared tensor's elements (the same ids as the trainers' copy, in the FP8 format) and its
scales. :func:`quantize_layouts` gives every block of every declared tensor to exactly one
trainer buffer that holds the whole block (where several do, replicas, each takes a range of
block rows of each tensor: a share of the work, in large rectangles) and returns:

- trainer layouts to plan with (:func:`wb.plan`): each declared tensor's ids taken out of the
  trainers' own buffers (they hold the unquantised values); beside each buffer a trainer
  quantises blocks of, a quantised copy ``wb:fp8:<buffer>`` of its shape in the format (holding
  the ids of the blocks it was given: pieces stay as large as the buffer's own; extra memory one
  byte per element of that buffer), and per declared tensor in it a buffer of the blocks'
  scales, ``wb:fp8:<buffer>:<scale tensor>`` (``(k,)`` float32);
- per trainer rank, the :class:`Task` that fills them from its own buffer before each update
  (:func:`quantize_buffers` with numpy; ``wb.runtime.quant`` on a GPU): per block the position of
  its first element and its row and column steps in the buffer (24 bytes per block of 16384
  elements); only blocks a buffer holds in several pieces list their elements' positions.

Everything is computed from the source maps' affine rectangles (row or column shards,
transposes, stacks, flat FSDP-style runs across tensors), in O(rectangles + blocks); a buffer
with any other kind of rectangle is read element by element.

The plan then moves FP8 bytes and scales like any bytes, at the lower bound of what the rollouts
need in the FP8 checkpoint. A block no trainer buffer holds whole (split between ranks, or
between two buffers of one rank) would need a gather between trainers first: wb does not do that
yet, and says so at plan time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from wb.data.blockscale import BlockScaled, quantize_blocks
from wb.data.dtypes import dtype_info
from wb.data.layout import BufferSpec, Layout
from wb.data.sourcemap import SourceMap
from wb.algorithms.blockheld import Geometry, Held, analyse, mirror_map
from wb.errors import PlanError

__all__ = ["PREFIX", "Quantized", "Task", "quantize_buffers", "quantize_layouts", "tasks_for"]

#: Names of the buffers a trainer quantises into start with this.
PREFIX = "wb:fp8:"


class Task(NamedTuple):
    """The blocks of one declared tensor that one trainer buffer quantises."""

    tensor: int  # index into BlockScaled.names
    source: str  # the trainer's buffer the blocks are read from
    weights: str  # the quantised copy of `source`: its shape, in the format
    scales: str  # the buffer of the blocks' scales: (k,) float32
    blocks: np.ndarray  # (k,) int64 block index, row-major over the tensor's grid of blocks
    at: np.ndarray  # (k, 3) int64 flat position in `source` (and `weights`) of each block's
    #                 first element, and the steps per row and per column; -1 first: `gather`
    gather: np.ndarray  # (g * bh * bw,) int64 positions of every element of the g blocks whose
    #                     `at` is -1 (held, but not as one affine rectangle), block by block,
    #                     row-major; -1 outside the tensor

    def positions(self, scaled: BlockScaled, lo: int = 0, hi: int | None = None, *, xp=np,
                  on: tuple | None = None):
        """``(n, bh, bw)`` int64 flat positions of blocks ``lo:hi`` in ``source``, -1 outside
        the tensor: computed, never stored (O(blocks) memory). ``xp``: the array module to
        compute with; ``on``: ``(blocks, at, gather, odd)`` already in its memory (CuPy), with
        ``odd`` each block's index among the gathered ones (:meth:`device_arrays`)."""
        bh, bw = scaled.decl.block
        rows, cols = int(scaled.rows[self.tensor]), int(scaled.cols[self.tensor])
        gc = int(scaled.grid_cols[self.tensor])
        blocks, at, gather, odd = on if on is not None else self.device_arrays(np)
        at, keys, odd = at[lo:hi], blocks[lo:hi], odd[lo:hi]
        i = xp.arange(bh).reshape(1, bh, 1)
        j = xp.arange(bw).reshape(1, 1, bw)
        pos = at[:, 0, None, None] + i * at[:, 1, None, None] + j * at[:, 2, None, None]
        br, bc = keys // gc, keys % gc
        inside = (br[:, None, None] * bh + i < rows) & (bc[:, None, None] * bw + j < cols)
        pos = xp.where(inside, pos, -1)
        if gather.size:  # blocks listed in `gather`, in order
            g = gather.reshape(-1, bh, bw)[xp.maximum(odd, 0)]
            pos = xp.where((odd >= 0)[:, None, None], g, pos)
        return pos

    def device_arrays(self, xp) -> tuple:
        """``(blocks, at, gather, odd)`` in ``xp``'s memory, for :meth:`positions`."""
        odd = np.where(self.at[:, 0] < 0, np.cumsum(self.at[:, 0] < 0) - 1, -1)
        return tuple(xp.asarray(a) for a in (self.blocks, self.at, self.gather, odd))


class Quantized(NamedTuple):
    """Trainer layouts holding a block-scaled FP8 checkpoint (:func:`quantize_layouts`)."""

    scaled: BlockScaled  # the declaration, bound to the trainers' spec
    trainers: tuple[Layout, ...]  # to plan with
    tasks: dict[int, tuple[Task, ...]]  # trainer rank -> what it quantises (never changed)

    def shapes(self, rank: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{buffer: (shape, dtype)}`` of the buffers trainer ``rank`` quantises into."""
        lay = next(t for t in self.trainers if t.worker.rank == rank)
        return {n: (b.shape, b.dtype) for n, b in lay.buffers.items() if n.startswith(PREFIX)}


def quantize_layouts(trainers: Sequence[Layout], scaled: BlockScaled) -> Quantized:
    """Gives every block of every declared tensor to one trainer buffer that holds it whole.

    Works on the source maps' affine rectangles (O(rectangles + blocks), never per element, for
    the usual layouts: row or column shards, transposes, stacks, flat shards); a buffer whose
    rectangles are none of those is read element by element.

    Args:
        trainers: the trainers' layouts (ids of ``scaled.trainer_spec``).
        scaled: the declaration bound to that spec (:meth:`wb.data.blockscale.FP8Blocks.bind`).

    Returns:
        :class:`Quantized`: layouts to pass to :func:`wb.plan` with rollouts probed against
        ``scaled.spec``, and each trainer's tasks.

    Raises:
        PlanError: a block is held only in parts (which tensor, block, and by whom), or a
            trainer already has a buffer named like one wb adds.
    """
    g = Geometry.of(scaled)
    masked: list[dict[str, BufferSpec]] = []
    held: dict[int, Held] = {}  # candidate index -> what that buffer holds
    cand_names: list[tuple[int, str]] = []
    cand_key, cand_buf = [], []
    partial: dict[int, list[str]] = {}  # block key -> who holds part of it
    for li, lay in enumerate(trainers):
        bufs = dict(lay.buffers)
        for name, b in lay.buffers.items():
            if name.startswith(PREFIX):
                raise PlanError(f"trainer rank {lay.worker.rank} has a buffer `{name}`: names "
                                f"starting with {PREFIX!r} are wb's (quantised blocks); rename it")
            h = analyse(b.sourcemap, g)
            if h is None:
                continue
            bufs[name] = BufferSpec(h.masked, b.dtype)
            held[len(cand_names)] = h
            cand_key.append(h.keys)
            cand_buf.append(np.full(h.keys.size, len(cand_names)))
            cand_names.append((li, name))
            for k in h.partial[:8].tolist():
                partial.setdefault(k, []).append(f"rank {lay.worker.rank} `{name}`")
        masked.append(bufs)
    ck = np.concatenate(cand_key) if cand_key else np.zeros(0, np.int64)
    cb = np.concatenate(cand_buf) if cand_buf else np.zeros(0, np.int64)
    order = np.lexsort((cb, ck))
    ck, cb = ck[order], cb[order]
    keys, start, count = np.unique(ck, return_index=True, return_counts=True)
    split = sorted(set(partial) - set(keys.tolist()))
    if split:
        k = split[0]
        t = int(g.t_of[k])
        bh, bw = g.block
        raise PlanError(
            f"block ({int(g.br[k])}, {int(g.bc[k])}) of `{scaled.names[t]}` (rows "
            f"{int(g.br[k]) * bh}.., cols {int(g.bc[k]) * bw}.., {len(split)} such blocks in all) "
            f"is held only in parts ({', '.join(partial[k][:4])}): quantising it needs a gather "
            f"between trainer buffers, which wb does not do yet; shard the trainer at multiples "
            f"of the block {g.block} or leave `{scaled.names[t]}` out of FP8Blocks.tensors")
    # replicas share the work in ranges of block rows, not block by block: a holder's blocks then
    # form large rectangles, and so do the pieces cut from them. Blocks with the same first and
    # last holding trainer and number of holders form a group (replicas: their holders); its
    # block rows, tensor after tensor, are cut into `count` ranges in order, so each replica
    # quantises whole tensors but at most one, and a rollout's range of one tensor comes from one
    # trainer (any candidate of a block holds it: the grouping weighs balance, not correctness).
    cand_li = np.array([li for li, _ in cand_names] or [0], np.int64)
    n_li, n_c = len(trainers) + 1, int(count.max(initial=0)) + 1
    group = (cand_li[cb[start]] * n_li + cand_li[cb[start + count - 1]]) * n_c + count
    row = g.t_of[keys] * (int(g.br.max(initial=0)) + 1) + g.br[keys]
    pairs, inv = np.unique(np.stack([group, row], 1), axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    g_first = np.searchsorted(pairs[:, 0], pairs[:, 0], side="left")
    g_size = np.searchsorted(pairs[:, 0], pairs[:, 0], side="right") - g_first
    at = (np.arange(len(pairs)) - g_first)[inv]
    chosen = cb[start + np.minimum(count - 1, at * count // g_size[inv])]
    tasks: dict[int, list[Task]] = {lay.worker.rank: [] for lay in trainers}
    for bi in np.unique(chosen):
        li, name = cand_names[bi]
        h = held[int(bi)]
        mine = keys[chosen == bi]
        shape = trainers[li].buffers[name].shape
        masked[li][PREFIX + name] = BufferSpec(mirror_map(h, mine, g, shape), scaled.decl.format)
        for task in _tasks(h, mine, g, name):
            masked[li][task.scales] = BufferSpec(SourceMap.from_indices(
                scaled.scale_offset[task.tensor] + task.blocks), "float32")
            tasks[trainers[li].worker.rank].append(task)
    layouts = tuple(Layout(lay.worker, masked[li]) for li, lay in enumerate(trainers))
    return Quantized(scaled, layouts, {r: tuple(ts) for r, ts in tasks.items()})


def tasks_for(scaled: BlockScaled, own: Layout, planned: Layout) -> Quantized:
    """One trainer's part of :func:`quantize_layouts`, rebuilt from its own layout and its layout
    in the plan (what :func:`wb.agree_parts` gives it): the tasks need not travel.

    Args:
        scaled: the declaration, bound to the trainers' spec.
        own: the trainer's layout as it holds its weights.
        planned: its layout in the plan (``plan.layout_of(rank)``).

    Returns:
        :class:`Quantized` of this one trainer (``trainers == (planned,)``).

    Raises:
        PlanError: ``planned`` has a quantised buffer that ``own`` does not explain, or blocks
            ``own`` does not hold whole.
    """
    g = Geometry.of(scaled)
    scale_of = {scaled.scale_name(t): t for t in range(len(scaled.names))}
    rank = planned.worker.rank
    mine: dict[str, list] = {}
    for sname, b in planned.buffers.items():
        if not sname.startswith(PREFIX) or sname[len(PREFIX):] in own.buffers:
            continue  # not wb's, or a quantised copy (its tasks come with its scales)
        body = sname[len(PREFIX):]
        hit = [(body[:-len(k) - 1], t) for k, t in scale_of.items() if body.endswith(":" + k)]
        hit = [(src, t) for src, t in hit if src in own.buffers]
        if not hit:
            raise PlanError(f"trainer rank {rank}: the plan has a buffer `{sname}` that no "
                            f"buffer of its own layout and no declared tensor explain; the plan "
                            f"was made from other layouts or another declaration")
        src, t = hit[0]
        local = b.sourcemap.to_indices().reshape(-1)
        mine.setdefault(src, []).append(g.key0[t] + local - scaled.scale_offset[t])
    tasks = []
    for src, parts in mine.items():
        h = analyse(own.buffers[src].sourcemap, g)
        want = np.sort(np.concatenate(parts))
        if h is None or not np.isin(want, h.keys).all():
            raise PlanError(f"trainer rank {rank}: the plan quantises blocks that `{src}` does "
                            f"not hold whole; the plan was made from other layouts")
        tasks += _tasks(h, want, g, src)
    return Quantized(scaled, (planned,), {rank: tuple(tasks)})


def _tasks(h: Held, mine: np.ndarray, g: Geometry, source: str) -> list[Task]:
    """The tasks of blocks ``mine`` (sorted keys) that buffer ``source`` holds (``h``)."""
    out = []
    for t in np.unique(g.t_of[mine]).tolist():
        tk = mine[g.t_of[mine] == t]
        at = h.at[np.searchsorted(h.keys, tk)]
        odd = [h.odd[k].reshape(-1) for k, a in zip(tk.tolist(), at[:, 0].tolist()) if a < 0]
        gather = np.concatenate(odd) if odd else np.zeros(0, np.int64)
        sname = f"{PREFIX}{source}:{g.scaled.scale_name(t)}"
        out.append(Task(t, source, PREFIX + source, sname, tk - g.key0[t], at, gather))
    return out


def quantize_buffers(q: Quantized, rank: int, buffers: Mapping[str, np.ndarray], *,
                     out: Mapping[str, np.ndarray] | None = None,
                     chunk: int = 1 << 22) -> dict[str, np.ndarray]:
    """Trainer ``rank``'s quantised blocks and scales, from its own ``buffers`` (numpy), a chunk
    of about ``chunk`` elements of blocks at a time.

    Args:
        q: from :func:`quantize_layouts`.
        rank: the trainer's rank.
        buffers: its buffers (``{name: array}``, the layout's shapes).
        out: the arrays to write into (as returned before); new ones when ``None``.
        chunk: elements quantised at once (bounds the temporaries).

    Returns:
        ``{buffer name: array}`` of the buffers it quantises into (:meth:`Quantized.shapes`).
    """
    bh, bw = q.scaled.decl.block
    fmt = q.scaled.decl.format
    res = dict(out) if out is not None else {
        n: np.zeros(s, dtype_info(d).numpy) for n, (s, d) in q.shapes(rank).items()}
    step = max(1, chunk // (bh * bw))
    for task in q.tasks.get(rank, ()):
        src = np.asarray(buffers[task.source]).reshape(-1)
        dst = res[task.weights].reshape(-1)
        on = task.device_arrays(np)  # once per task, not per chunk
        for lo in range(0, task.blocks.size, step):
            pos = task.positions(q.scaled, lo, lo + step, on=on)
            ok = pos >= 0
            v = np.zeros(pos.shape, src.dtype)
            v[ok] = src[pos[ok]]
            qv, s = quantize_blocks(v, fmt)
            dst[pos[ok]] = qv[ok]
            res[task.scales][lo:lo + step] = s
    return res
