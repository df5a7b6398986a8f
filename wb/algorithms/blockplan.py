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
  (:func:`quantize_buffers` with numpy; ``wb.runtime.quant`` on a GPU).

The plan then moves FP8 bytes and scales like any bytes, at the lower bound of what the rollouts
need in the FP8 checkpoint. A block no trainer buffer holds whole (split between ranks, or
between two buffers of one rank) would need a gather between trainers first: wb does not do that
yet, and says so at plan time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import math

import numpy as np

from wb.data.blockscale import BlockScaled, quantize_blocks
from wb.data.dtypes import dtype_info
from wb.data.layout import BufferSpec, Layout
from wb.data.sourcemap import SourceMap
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
    gather: np.ndarray  # (k * bh * bw,) int64 flat position in `source` (and `weights`) of each
    #                     element of each block, block by block; -1: outside the tensor


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
    decl = scaled.decl
    bh, bw = decl.block
    key0, t_of, br, bc = _grid(scaled)
    size = (np.minimum(bh, scaled.rows[t_of] - br * bh) * np.minimum(bw, scaled.cols[t_of] - bc * bw))
    masked: list[dict[str, BufferSpec]] = []
    elems: dict[tuple[int, str], tuple] = {}  # (layout, buffer) -> (pos, key, within, ids, shape)
    cand_key, cand_buf, cand_names = [], [], []
    partial: dict[int, list[str]] = {}  # block key -> who holds part of it
    for li, lay in enumerate(trainers):
        bufs = dict(lay.buffers)
        for name, b in lay.buffers.items():
            if name.startswith(PREFIX):
                raise PlanError(f"trainer rank {lay.worker.rank} has a buffer `{name}`: names "
                                f"starting with {PREFIX!r} are wb's (quantised blocks); rename it")
            sm = b.sourcemap
            found = _elements(sm, scaled, key0)
            if found is None:
                continue
            pos, key, within, ids = found
            elems[(li, name)] = (pos, key, within, ids[pos], sm.shape)
            uniq = np.unique(key * (bh * bw) + within)
            keys, count = np.unique(uniq // (bh * bw), return_counts=True)
            whole = count == size[keys]
            cand_key.append(keys[whole])
            cand_buf.append(np.full(int(whole.sum()), len(cand_names)))
            cand_names.append((li, name))
            for k in keys[~whole][:8]:
                partial.setdefault(int(k), []).append(f"rank {lay.worker.rank} `{name}`")
            out = ids.copy()
            out[pos] = -1
            bufs[name] = BufferSpec(SourceMap.from_indices(out.reshape(sm.shape)), b.dtype)
        masked.append(bufs)
    ck = np.concatenate(cand_key) if cand_key else np.zeros(0, np.int64)
    cb = np.concatenate(cand_buf) if cand_buf else np.zeros(0, np.int64)
    order = np.lexsort((cb, ck))
    ck, cb = ck[order], cb[order]
    keys, start, count = np.unique(ck, return_index=True, return_counts=True)
    split = sorted(set(partial) - set(keys.tolist()))
    if split:
        k = split[0]
        t = int(t_of[k])
        raise PlanError(
            f"block ({int(br[k])}, {int(bc[k])}) of `{scaled.names[t]}` (rows {int(br[k]) * bh}.., "
            f"cols {int(bc[k]) * bw}.., {len(split)} such blocks in all) is held only in parts "
            f"({', '.join(partial[k][:4])}): quantising it needs a gather between trainer buffers, "
            f"which wb does not do yet; shard the trainer at multiples of the block {decl.block} "
            f"or leave `{scaled.names[t]}` out of FP8Blocks.tensors")
    # replicas share the work in ranges of block rows (not block by block: a holder's blocks
    # then form large rectangles, and so do the pieces cut from them)
    # blocks with the same tensor and the same holders form a group; its block rows are cut into
    # `count` ranges in order
    group = (t_of[keys] * (len(cand_names) + 1) + cb[start]) * (int(count.max(initial=0)) + 1) + count
    pairs, inv = np.unique(np.stack([group, br[keys]], 1), axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    g_first = np.searchsorted(pairs[:, 0], pairs[:, 0], side="left")
    g_size = np.searchsorted(pairs[:, 0], pairs[:, 0], side="right") - g_first
    at = (np.arange(len(pairs)) - g_first)[inv]
    chosen = cb[start + np.minimum(count - 1, at * count // g_size[inv])]
    tasks: dict[int, list[Task]] = {lay.worker.rank: [] for lay in trainers}
    fmt = decl.format
    for bi in np.unique(chosen):
        li, name = cand_names[bi]
        lay = trainers[li]
        pos, key, within, idv, shape = elems[(li, name)]
        mine = keys[chosen == bi]
        slot = np.searchsorted(mine, key)
        ok = (slot < mine.size) & (mine[np.minimum(slot, mine.size - 1)] == key)
        # the quantised copy of the buffer: its shape, the ids of the blocks it was given (so
        # pieces are as large as the buffer's own, not one block each)
        mirror = np.full(math.prod(shape), -1, np.int64)
        mirror[pos[ok]] = idv[ok]
        wname = PREFIX + name
        masked[li][wname] = BufferSpec(SourceMap.from_indices(mirror.reshape(shape)), fmt)
        for t in np.unique(t_of[mine]):
            tk = mine[t_of[mine] == t]  # this tensor's blocks, sorted
            gather = _gather(tk, pos, key, within, ok & (t_of[key] == t), bh * bw)
            local = tk - key0[t]
            sname = f"{PREFIX}{name}:{scaled.scale_name(int(t))}"
            masked[li][sname] = BufferSpec(
                SourceMap.from_indices(scaled.scale_offset[t] + local), "float32")
            tasks[lay.worker.rank].append(Task(int(t), name, wname, sname, local, gather))
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
        PlanError: ``planned`` names a quantised buffer of a buffer ``own`` lacks, or holds blocks
            ``own`` does not hold whole.
    """
    bh, bw = scaled.decl.block
    key0, t_of, _, _ = _grid(scaled)
    scale_of = {scaled.scale_name(t): t for t in range(len(scaled.names))}
    rank = planned.worker.rank
    tasks, cache = [], {}
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
        if src not in cache:
            cache[src] = _elements(own.buffers[src].sourcemap, scaled, key0)
        if cache[src] is None:
            raise PlanError(f"trainer rank {rank}: the plan quantises blocks of `{src}`, which "
                            f"holds no id of a declared tensor here; the plan was made from "
                            f"other layouts")
        pos, key, within, _ = cache[src]
        local = b.sourcemap.to_indices().reshape(-1) - scaled.scale_offset[t]
        tk = key0[t] + local
        i = np.searchsorted(tk, key)
        ok = (i < tk.size) & (tk[np.minimum(i, tk.size - 1)] == key)
        gather = _gather(tk, pos, key, within, ok, bh * bw)
        if (gather.reshape(tk.size, -1) < 0).all(axis=1).any():
            raise PlanError(f"trainer rank {rank}: the plan quantises blocks of "
                            f"`{scaled.names[t]}` that `{src}` does not hold; the plan was made "
                            f"from other layouts")
        tasks.append(Task(int(t), src, PREFIX + src, sname, local, gather))
    return Quantized(scaled, (planned,), {rank: tuple(tasks)})


def _grid(scaled: BlockScaled) -> tuple[np.ndarray, ...]:
    """``(key0, t_of, br, bc)``: each declared tensor's first global block key (``(T + 1,)``),
    and per global block key its tensor, block row and block column (``(blocks,) int64``)."""
    bh, _ = scaled.decl.block
    grid = -(-scaled.rows // bh) * scaled.grid_cols
    key0 = np.concatenate([[0], np.cumsum(grid)]).astype(np.int64)
    t_of = np.repeat(np.arange(len(grid)), grid)
    br, bc = np.divmod(np.arange(int(key0[-1])) - key0[t_of], scaled.grid_cols[t_of])
    return key0, t_of, br, bc


def _elements(sm: SourceMap, scaled: BlockScaled, key0: np.ndarray):
    """The elements of a buffer that hold ids of declared tensors: ``(pos, key, within, ids)``
    (flat positions, global block keys, offsets inside their blocks, and every element's id),
    or ``None``."""
    bh, bw = scaled.decl.block
    lo = scaled.offset
    hi = lo + scaled.rows * scaled.cols
    if sm.n_ids == 0:
        return None
    idlo, idhi = sm.blocks.id_range()
    if not ((lo <= idhi) & (hi > idlo)).any():
        return None
    ids = sm.to_indices().reshape(-1)
    t = np.searchsorted(lo, ids, side="right") - 1
    inside = (ids >= 0) & (t >= 0) & (ids < hi[np.maximum(t, 0)])
    if not inside.any():
        return None
    pos = np.flatnonzero(inside)
    ti = t[pos]
    r, c = np.divmod(ids[pos] - lo[ti], scaled.cols[ti])
    key = key0[ti] + (r // bh) * scaled.grid_cols[ti] + c // bw
    return pos, key, (r % bh) * bw + c % bw, ids


def _gather(tk: np.ndarray, pos, key, within, sel, block: int) -> np.ndarray:
    """The gather index of blocks ``tk`` (sorted keys) from the elements ``sel`` picks."""
    s = np.searchsorted(tk, key[sel])
    gather = np.full(tk.size * block, -1, np.int64)
    gather[s * block + within[sel]] = pos[sel]
    return gather


def quantize_buffers(q: Quantized, rank: int, buffers: Mapping[str, np.ndarray], *,
                     out: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Trainer ``rank``'s quantised blocks and scales, from its own ``buffers`` (numpy).

    Args:
        q: from :func:`quantize_layouts`.
        rank: the trainer's rank.
        buffers: its buffers (``{name: array}``, the layout's shapes).
        out: the arrays to write into (as returned before); new ones when ``None``.

    Returns:
        ``{buffer name: array}`` of the buffers it quantises into (:meth:`Quantized.shapes`).
    """
    bh, bw = q.scaled.decl.block
    fmt = q.scaled.decl.format
    res = dict(out) if out is not None else {
        n: np.zeros(s, dtype_info(d).numpy) for n, (s, d) in q.shapes(rank).items()}
    for task in q.tasks.get(rank, ()):
        src = np.asarray(buffers[task.source]).reshape(-1)
        v = np.zeros(task.gather.size, src.dtype)
        ok = task.gather >= 0
        v[ok] = src[task.gather[ok]]
        qv, s = quantize_blocks(v.reshape(-1, bh, bw), fmt)
        res[task.weights].reshape(-1)[task.gather[ok]] = qv.reshape(-1)[ok]
        res[task.scales][...] = s
    return res
