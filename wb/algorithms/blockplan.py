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

import math

import numpy as np

from wb.data.blockscale import BlockScaled, quantize_blocks
from wb.data.dtypes import dtype_info
from wb.data.layout import BufferSpec, Layout
from wb.data.sourcemap import Blocks, SourceMap
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
    g = _Geometry.of(scaled)
    masked: list[dict[str, BufferSpec]] = []
    held: dict[int, _Held] = {}  # candidate index -> what that buffer holds
    cand_names: list[tuple[int, str]] = []
    cand_key, cand_buf = [], []
    partial: dict[int, list[str]] = {}  # block key -> who holds part of it
    for li, lay in enumerate(trainers):
        bufs = dict(lay.buffers)
        for name, b in lay.buffers.items():
            if name.startswith(PREFIX):
                raise PlanError(f"trainer rank {lay.worker.rank} has a buffer `{name}`: names "
                                f"starting with {PREFIX!r} are wb's (quantised blocks); rename it")
            h = _analyse(b.sourcemap, g)
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
    # form large rectangles, and so do the pieces cut from them. Blocks of one tensor with the
    # same holders form a group; its block rows are cut into `count` ranges in order.
    group = ((g.t_of[keys] * (len(cand_names) + 1) + cb[start]) * (int(count.max(initial=0)) + 1)
             + count)
    pairs, inv = np.unique(np.stack([group, g.br[keys]], 1), axis=0, return_inverse=True)
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
        masked[li][PREFIX + name] = BufferSpec(_mirror(h, mine, g, shape), scaled.decl.format)
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
    g = _Geometry.of(scaled)
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
        h = _analyse(own.buffers[src].sourcemap, g)
        want = np.sort(np.concatenate(parts))
        if h is None or not np.isin(want, h.keys).all():
            raise PlanError(f"trainer rank {rank}: the plan quantises blocks that `{src}` does "
                            f"not hold whole; the plan was made from other layouts")
        tasks += _tasks(h, want, g, src)
    return Quantized(scaled, (planned,), {rank: tuple(tasks)})


# --- what one buffer holds ------------------------------------------------------------------------
class _Geometry(NamedTuple):
    """The declared tensors' blocks: per global block key its tensor, block row, block column
    and size; per tensor its first key and id range."""

    scaled: BlockScaled
    block: tuple[int, int]
    key0: np.ndarray  # (T + 1,) int64 first global block key of each tensor
    t_of: np.ndarray  # (K,) int64 tensor of each block key
    br: np.ndarray  # (K,) int64 its block row
    bc: np.ndarray  # (K,) int64 its block column
    size: np.ndarray  # (K,) int64 elements in it (edge blocks are smaller)
    lo: np.ndarray  # (T,) int64 first id of each tensor
    hi: np.ndarray  # (T,) int64 one past its last id

    @staticmethod
    def of(scaled: BlockScaled) -> _Geometry:
        bh, bw = scaled.decl.block
        grid = -(-scaled.rows // bh) * scaled.grid_cols
        key0 = np.concatenate([[0], np.cumsum(grid)]).astype(np.int64)
        t_of = np.repeat(np.arange(len(grid)), grid)
        br, bc = np.divmod(np.arange(int(key0[-1])) - key0[t_of], scaled.grid_cols[t_of])
        size = (np.minimum(bh, scaled.rows[t_of] - br * bh)
                * np.minimum(bw, scaled.cols[t_of] - bc * bw))
        lo = scaled.offset
        return _Geometry(scaled, (bh, bw), key0, t_of, br, bc, size, lo,
                         lo + scaled.rows * scaled.cols)


class _Rect(NamedTuple):
    """A rectangle of a declared tensor a buffer holds affinely: tensor rows ``r0:r1``, columns
    ``c0:c1``; element ``(r, c)`` at flat position ``pos + (r - r0) * dr + (c - c0) * dc``. A
    flat run (``kind`` "run") holds ids ``r0 * cols + c0`` up to ``r1 * cols + c1`` instead, at
    consecutive positions from ``pos``; "rows": tensor rows along buffer rows; "cols": the
    transpose."""

    t: int
    r0: int
    r1: int
    c0: int
    c1: int
    pos: int
    dr: int
    dc: int
    kind: str

    @property
    def run(self) -> bool:
        return self.kind == "run"


class _Held(NamedTuple):
    """The blocks of declared tensors one buffer holds."""

    keys: np.ndarray  # (n,) int64 blocks held whole, sorted
    at: np.ndarray  # (n, 3) int64 their first position and steps; first -1: held, not affinely
    partial: np.ndarray  # (m,) int64 blocks held in part
    masked: SourceMap  # the buffer without the declared tensors' ids
    rects: tuple | None  # the _Rects (None: read element by element, see `ids`)
    ids: np.ndarray | None  # element by element: every element's id (flat)
    odd: dict  # key -> (bh, bw) int64 positions of whole blocks held not affinely


def _analyse(sm: SourceMap, g: _Geometry) -> _Held | None:
    """What a buffer holds of the declared tensors (``None``: nothing)."""
    if sm.n_ids == 0:
        return None
    idlo, idhi = sm.blocks.id_range()
    if not ((g.lo <= idhi) & (g.hi > idlo)).any():
        return None
    rects, kept = _rects(sm, g)
    if rects is None:
        return _analyse_elements(sm, g)
    if not rects:
        return None
    bh, bw = g.block
    whole, at, part_key, part_n, part_rect = [], [], [], [], []
    for ri, r in enumerate(rects):
        k, a, pk, pn = _blocks_of(r, g)
        whole.append(k)
        at.append(a)
        part_key.append(pk)
        part_n.append(pn)
        part_rect.append(np.full(pk.size, ri))
    keys, at = np.concatenate(whole), np.concatenate(at)
    pk, pn, pr = np.concatenate(part_key), np.concatenate(part_n), np.concatenate(part_rect)
    odd = {}
    if pk.size:  # parts of one block in several rectangles of this buffer: whole if they add up
        u, inv = np.unique(pk, return_inverse=True)
        total = np.bincount(inv.reshape(-1), weights=pn).astype(np.int64)
        done = u[(total == g.size[u]) & ~np.isin(u, keys)]
        for k in done.tolist():
            odd[k] = _odd_positions(k, [rects[i] for i in pr[pk == k]], g)
        partial = u[(total != g.size[u]) & ~np.isin(u, keys)]
    else:
        partial = np.zeros(0, np.int64)
    if odd:
        keys = np.concatenate([keys, np.array(sorted(odd), np.int64)])
        at = np.concatenate([at, np.tile([-1, 0, 0], (len(odd), 1))])
    keys, order = np.unique(keys, return_index=True)  # a block held twice: its first holding
    masked = (SourceMap.from_blocks(sm.shape, Blocks.of(*kept), check=False) if kept
              else SourceMap.from_indices(np.full(sm.shape, -1, np.int64)))
    return _Held(keys, at[order].reshape(-1, 3), partial, masked, tuple(rects), None, odd)


def _rects(sm: SourceMap, g: _Geometry) -> tuple[list | None, list]:
    """The buffer's rectangles that hold declared ids, as :class:`_Rect` (``None`` when one is
    not a row or column shard, transpose or flat run of one tensor), and the others, kept as
    ``(r0, nr, c0, nc, id0, sr, sc)``."""
    cols_view = sm.view2d[1]
    b = sm.blocks
    rects, kept = [], []
    for r0, nr, c0, nc, id0, sr, sc in zip(*(f.tolist() for f in b)):
        first = id0 + min(0, (nr - 1) * sr) + min(0, (nc - 1) * sc)
        last = id0 + max(0, (nr - 1) * sr) + max(0, (nc - 1) * sc)
        if not ((g.lo <= last) & (g.hi > first)).any():
            kept.append((r0, nr, c0, nc, id0, sr, sc))
            continue
        pos = r0 * cols_view + c0
        if nr == 1 and (nc == 1 or sc == 1):  # a flat run, maybe across tensors
            a = id0
            while a < id0 + nc:
                t = int(np.searchsorted(g.lo, a, side="right")) - 1
                inside = t >= 0 and a < g.hi[t]
                end = min(id0 + nc, int(g.hi[t]) if inside else
                          int(g.lo[t + 1]) if t + 1 < len(g.lo) else id0 + nc)
                if inside:
                    C = int(g.scaled.cols[t])
                    (ra, ca), (rb, cb) = divmod(a - int(g.lo[t]), C), divmod(end - int(g.lo[t]), C)
                    rects.append(_Rect(t, ra, rb, ca, cb, pos + a - id0, C, 1, "run"))
                else:
                    kept.append((r0, 1, c0 + a - id0, end - a, a, 0, 1))
                a = end
            continue
        t = int(np.searchsorted(g.lo, first, side="right")) - 1
        if t < 0 or last >= g.hi[t]:
            return None, []  # across tensors, not a flat run
        C = int(g.scaled.cols[t])
        R0, C0 = divmod(id0 - int(g.lo[t]), C)
        if (nc == 1 or sc == 1) and (nr == 1 or sr == C) and C0 + nc <= C:
            rects.append(_Rect(t, R0, R0 + nr, C0, C0 + nc, pos, cols_view, 1, "rows"))
        elif (nr == 1 or sr == 1) and (nc == 1 or sc == C) and C0 + nr <= C:
            rects.append(_Rect(t, R0, R0 + nc, C0, C0 + nr, pos, 1, cols_view, "cols"))
        else:
            return None, []
    return rects, kept


def _blocks_of(r: _Rect, g: _Geometry):
    """``(whole keys, their (n, 3) at, partial keys, elements held of each)`` of one rectangle."""
    bh, bw = g.block
    t = r.t
    rows, cols = int(g.scaled.rows[t]), int(g.scaled.cols[t])
    if r.run:  # ids a:b of the tensor's flat order; rows r0..r1 (r1 partial up to c1)
        a, b = r.r0 * cols + r.c0, r.r1 * cols + r.c1
        brs = np.arange(r.r0 // bh, (max(b - 1, a) // cols) // bh + 1)
    else:
        brs = np.arange(r.r0 // bh, -(-r.r1 // bh))
    bcs = np.arange(0, -(-cols // bw)) if r.run else np.arange(r.c0 // bw, -(-r.c1 // bw))
    BR, BC = np.meshgrid(brs, bcs, indexing="ij")
    BR, BC = BR.reshape(-1), BC.reshape(-1)
    hb = np.minimum(bh, rows - BR * bh)
    wb = np.minimum(bw, cols - BC * bw)
    keys = g.key0[t] + BR * g.scaled.grid_cols[t] + BC
    if r.run:
        f = BR * bh * cols + BC * bw  # flat offset of the block's first and last element
        last = (BR * bh + hb - 1) * cols + BC * bw + wb - 1
        whole = (f >= a) & (last < b)
        base = r.pos + f - a
        n = np.zeros(keys.size, np.int64)
        edge = np.flatnonzero(~whole & (last >= a) & (f < b))
        for e in edge.tolist():  # blocks at the run's two ends: count what it holds
            rr = BR[e] * bh + np.arange(hb[e])
            lo_, hi_ = rr * cols + BC[e] * bw, rr * cols + BC[e] * bw + wb[e]
            n[e] = np.clip(np.minimum(hi_, b) - np.maximum(lo_, a), 0, None).sum()
        at = np.stack([base, np.full_like(base, cols), np.ones_like(base)], 1)
        part = edge[n[edge] > 0]
        return keys[whole], at[whole], keys[part], n[part]
    ovr = np.minimum(r.r1, BR * bh + hb) - np.maximum(r.r0, BR * bh)
    ovc = np.minimum(r.c1, BC * bw + wb) - np.maximum(r.c0, BC * bw)
    n = np.maximum(ovr, 0) * np.maximum(ovc, 0)
    whole = n == hb * wb
    base = r.pos + (BR * bh - r.r0) * r.dr + (BC * bw - r.c0) * r.dc
    at = np.stack([base, np.full_like(base, r.dr), np.full_like(base, r.dc)], 1)
    part = ~whole & (n > 0)
    return keys[whole], at[whole], keys[part], n[part]


def _odd_positions(k: int, rects: list, g: _Geometry) -> np.ndarray:
    """``(bh, bw)`` positions of block ``k``, held in parts by several rectangles of a buffer."""
    bh, bw = g.block
    t, R, Cb = int(g.t_of[k]), int(g.br[k]) * bh, int(g.bc[k]) * bw
    cols = int(g.scaled.cols[t])
    out = np.full((bh, bw), -1, np.int64)
    rr, cc = np.meshgrid(R + np.arange(bh), Cb + np.arange(bw), indexing="ij")
    for r in rects:
        if r.run:
            off = rr * cols + cc
            a, b = r.r0 * cols + r.c0, r.r1 * cols + r.c1
            sel = (off >= a) & (off < b) & (rr < g.scaled.rows[t]) & (cc < cols)
            out[sel] = r.pos + off[sel] - a
        else:
            sel = (rr >= r.r0) & (rr < r.r1) & (cc >= r.c0) & (cc < r.c1)
            out[sel] = r.pos + (rr[sel] - r.r0) * r.dr + (cc[sel] - r.c0) * r.dc
    return out


def _analyse_elements(sm: SourceMap, g: _Geometry) -> _Held | None:
    """:func:`_analyse` element by element (rectangles that are not shards or transposes)."""
    bh, bw = g.block
    ids = sm.to_indices().reshape(-1)
    t = np.searchsorted(g.lo, ids, side="right") - 1
    inside = (ids >= 0) & (t >= 0) & (ids < g.hi[np.maximum(t, 0)])
    if not inside.any():
        return None
    pos = np.flatnonzero(inside)
    ti = t[pos]
    r, c = np.divmod(ids[pos] - g.lo[ti], g.scaled.cols[ti])
    key = g.key0[ti] + (r // bh) * g.scaled.grid_cols[ti] + c // bw
    within = (r % bh) * bw + c % bw
    u, first = np.unique(key * (bh * bw) + within, return_index=True)
    keys, count = np.unique(u // (bh * bw), return_counts=True)
    whole = keys[count == g.size[keys]]
    odd = {}
    sel = np.isin(key, whole)
    for k in whole.tolist():
        out = np.full(bh * bw, -1, np.int64)
        m = sel & (key == k)
        out[within[m]] = pos[m]
        odd[k] = out.reshape(bh, bw)
    masked = ids.copy()
    masked[pos] = -1
    return _Held(whole, np.tile([-1, 0, 0], (whole.size, 1)).reshape(-1, 3),
                 keys[count != g.size[keys]], SourceMap.from_indices(masked.reshape(sm.shape)),
                 None, ids, odd)


def _tasks(h: _Held, mine: np.ndarray, g: _Geometry, source: str) -> list[Task]:
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


def _mirror(h: _Held, mine: np.ndarray, g: _Geometry, shape) -> SourceMap:
    """The quantised copy's map: the buffer's ids of the blocks ``mine``, in large rectangles."""
    if h.rects is None:  # element by element
        ids = h.ids
        t = np.searchsorted(g.lo, ids, side="right") - 1
        inside = (ids >= 0) & (t >= 0) & (ids < g.hi[np.maximum(t, 0)])
        out = np.full(ids.size, -1, np.int64)
        ti = t[inside]
        r, c = np.divmod(ids[inside] - g.lo[ti], g.scaled.cols[ti])
        key = g.key0[ti] + (r // g.block[0]) * g.scaled.grid_cols[ti] + c // g.block[1]
        out[np.flatnonzero(inside)[np.isin(key, mine)]] = ids[inside][np.isin(key, mine)]
        return SourceMap.from_indices(out.reshape(shape))
    bh, bw = g.block
    cols_view = int(np.prod(shape[-1:])) if shape else 1
    blocks = []
    for r in h.rects:
        t = r.t
        rows, cols = int(g.scaled.rows[t]), int(g.scaled.cols[t])
        tk = mine[g.t_of[mine] == t] - g.key0[t]
        if not tk.size:
            continue
        br, bc = np.divmod(tk, g.scaled.grid_cols[t])
        for b_row in np.unique(br).tolist():  # per block row, runs of consecutive block columns
            cs = np.sort(bc[br == b_row])
            cut = np.flatnonzero(np.diff(cs) != 1) + 1
            for run in np.split(cs, cut):
                R0, R1 = b_row * bh, min(rows, b_row * bh + bh)
                C0, C1 = int(run[0]) * bw, min(cols, int(run[-1]) * bw + bw)
                blocks += _rect_part(r, R0, R1, C0, C1, g, cols_view)
    return SourceMap.from_blocks(shape, Blocks.of(*blocks), check=False) if blocks else \
        SourceMap.from_indices(np.full(shape, -1, np.int64))


def _rect_part(r: _Rect, R0: int, R1: int, C0: int, C1: int, g: _Geometry, cols_view: int):
    """Source-map rectangles of the part of ``r`` in tensor rows ``R0:R1``, columns ``C0:C1``."""
    t = r.t
    cols = int(g.scaled.cols[t])
    lo = int(g.lo[t])
    if r.run:
        a, b = r.r0 * cols + r.c0, r.r1 * cols + r.c1
        out = []
        if C0 == 0 and C1 == cols:  # whole rows: one stretch of the run
            s, e = max(a, R0 * cols), min(b, R1 * cols)
            if e > s:
                p = r.pos + s - a
                out.append((p // cols_view, 1, p % cols_view, e - s, lo + s, 0, 1))
            return out
        for row in range(R0, R1):
            s, e = max(a, row * cols + C0), min(b, row * cols + C1)
            if e > s:
                p = r.pos + s - a
                out.append((p // cols_view, 1, p % cols_view, e - s, lo + s, 0, 1))
        return out
    R0, R1, C0, C1 = max(R0, r.r0), min(R1, r.r1), max(C0, r.c0), min(C1, r.c1)
    if R1 <= R0 or C1 <= C0:
        return []
    p = r.pos + (R0 - r.r0) * r.dr + (C0 - r.c0) * r.dc
    id0 = lo + R0 * cols + C0
    if r.kind == "rows":  # rows of the tensor along the buffer's rows
        return [(p // cols_view, R1 - R0, p % cols_view, C1 - C0, id0, cols, 1)]
    return [(p // cols_view, C1 - C0, p % cols_view, R1 - R0, id0, 1, cols)]  # transposed


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
        for lo in range(0, task.blocks.size, step):
            pos = task.positions(q.scaled, lo, lo + step)
            ok = pos >= 0
            v = np.zeros(pos.shape, src.dtype)
            v[ok] = src[pos[ok]]
            qv, s = quantize_blocks(v, fmt)
            dst[pos[ok]] = qv[ok]
            res[task.scales][lo:lo + step] = s
    return res
