"""What one trainer buffer holds of the declared tensors' blocks (:mod:`wb.algorithms.fp8.tasks`).

From a source map's affine rectangles (row or column shards, transposes, stacks, flat runs across
tensors), in O(rectangles + blocks): which blocks the buffer holds whole, each with its first
element's position and its row and column steps; which it holds in part, each with the window
of the block it holds (one rectangle: its first element's position, steps and rows and columns
within the block; else every element's position); its map without the declared ids; and the map
of its quantised copy given the blocks it quantises. A buffer with any other kind of rectangle is
read element by element (:func:`analyse_elements`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from wb.data.fp8 import BlockScaled
from wb.data.sourcemap import Blocks, SourceMap

__all__ = ["Geometry", "Held", "Rect", "analyse", "mirror_map"]


class Geometry(NamedTuple):
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
    def of(scaled: BlockScaled) -> Geometry:
        bh, bw = scaled.decl.block
        grid = -(-scaled.rows // bh) * scaled.grid_cols
        key0 = np.concatenate([[0], np.cumsum(grid)]).astype(np.int64)
        t_of = np.repeat(np.arange(len(grid)), grid)
        br, bc = np.divmod(np.arange(int(key0[-1])) - key0[t_of], scaled.grid_cols[t_of])
        size = (np.minimum(bh, scaled.rows[t_of] - br * bh)
                * np.minimum(bw, scaled.cols[t_of] - bc * bw))
        lo = scaled.offset
        return Geometry(scaled, (bh, bw), key0, t_of, br, bc, size, lo,
                         lo + scaled.rows * scaled.cols)


class Rect(NamedTuple):
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


class Held(NamedTuple):
    """The blocks of declared tensors one buffer holds."""

    keys: np.ndarray  # (n,) int64 blocks held whole, sorted
    at: np.ndarray  # (n, 3) int64 their first position and steps; first -1: held, not affinely
    partial: np.ndarray  # (m,) int64 blocks held in part, sorted
    masked: SourceMap  # the buffer without the declared tensors' ids
    rects: tuple | None  # the _Rects (None: read element by element, see `ids`)
    ids: np.ndarray | None  # element by element: every element's id (flat)
    odd: dict  # key -> (bh, bw) int64 positions (-1: not held) of blocks held not affinely
    part_at: np.ndarray  # (m,) x 3 int64 as `at`, of the window of each partial block
    part_win: np.ndarray  # (m, 4) int64 its window: rows i0:i1, columns j0:j1 of the block


def analyse(sm: SourceMap, g: Geometry) -> Held | None:
    """What a buffer holds of the declared tensors (``None``: nothing)."""
    if sm.n_ids == 0:
        return None
    idlo, idhi = sm.blocks.id_range()
    if not ((g.lo <= idhi) & (g.hi > idlo)).any():
        return None
    rects, kept = rects_of(sm, g)
    if rects is None:
        return analyse_elements(sm, g)
    if not rects:
        return None
    whole, at, part_key, part_n, part_rect, part_at, part_win = [], [], [], [], [], [], []
    for ri, r in enumerate(rects):
        k, a, pk, pn, pa, pw = blocks_of(r, g)
        whole.append(k)
        at.append(a)
        part_key.append(pk)
        part_n.append(pn)
        part_rect.append(np.full(pk.size, ri))
        part_at.append(pa)
        part_win.append(pw)
    keys, at = np.concatenate(whole), np.concatenate(at)
    pk, pn, pr = np.concatenate(part_key), np.concatenate(part_n), np.concatenate(part_rect)
    pa, pw = np.concatenate(part_at), np.concatenate(part_win)
    odd = {}
    partial, p_at, p_win = np.zeros(0, np.int64), np.zeros((0, 3), np.int64), _windows(0, g)
    if pk.size:  # parts of one block in several rectangles of this buffer: whole if they add up
        u, first, inv, times = np.unique(pk, return_index=True, return_inverse=True,
                                         return_counts=True)
        inv = inv.reshape(-1)
        total = np.bincount(inv, weights=pn).astype(np.int64)
        done = u[(total == g.size[u]) & ~np.isin(u, keys)]
        for k in done.tolist():
            odd[k] = odd_positions(k, [rects[i] for i in pr[pk == k]], g)
        part = (total != g.size[u]) & ~np.isin(u, keys)
        partial = u[part]
        # a part in one rectangle keeps its window; in several, or in a flat run: listed
        p_at, p_win = pa[first[part]].reshape(-1, 3), pw[first[part]].reshape(-1, 4)
        listed = (times[part] > 1) | (p_at[:, 0] < 0)
        for i in np.flatnonzero(listed).tolist():
            k = int(partial[i])
            odd[k] = odd_positions(k, [rects[j] for j in pr[pk == k]], g)
            p_at[i] = (-1, 0, 0)
    if odd:
        whole_odd = np.array(sorted(set(odd) - set(partial.tolist())), np.int64)
        keys = np.concatenate([keys, whole_odd])
        at = np.concatenate([at, np.tile([-1, 0, 0], (whole_odd.size, 1))])
    keys, order = np.unique(keys, return_index=True)  # a block held twice: its first holding
    masked = SourceMap.from_blocks(sm.shape, Blocks.of(*kept) if kept else Blocks.empty(),
                                   check=False)
    return Held(keys, at[order].reshape(-1, 3), partial, masked, tuple(rects), None, odd,
                p_at, p_win)


def _windows(n: int, g: Geometry) -> np.ndarray:
    """``(n, 4)`` windows of whole blocks: rows ``0:bh``, columns ``0:bw``."""
    return np.tile(np.array([0, g.block[0], 0, g.block[1]], np.int64), (n, 1))


def rects_of(sm: SourceMap, g: Geometry) -> tuple[list | None, list]:
    """The buffer's rectangles that hold declared ids, as :class:`Rect` (``None`` when one is
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
                    rects.append(Rect(t, ra, rb, ca, cb, pos + a - id0, C, 1, "run"))
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
            rects.append(Rect(t, R0, R0 + nr, C0, C0 + nc, pos, cols_view, 1, "rows"))
        elif (nr == 1 or sr == 1) and (nc == 1 or sc == C) and C0 + nr <= C:
            rects.append(Rect(t, R0, R0 + nc, C0, C0 + nr, pos, 1, cols_view, "cols"))
        else:
            return None, []
    return rects, kept


def blocks_of(r: Rect, g: Geometry):
    """``(whole keys, their (n, 3) at, partial keys, elements held of each, their (m, 3) at,
    their (m, 4) windows)`` of one rectangle; a partial block's ``at`` is its window's first
    element and steps (first -1 in a flat run: its elements are listed instead)."""
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
        return (keys[whole], at[whole], keys[part], n[part],
                np.tile([-1, 0, 0], (part.size, 1)), _windows(part.size, g))
    i0, i1 = np.maximum(r.r0 - BR * bh, 0), np.minimum(r.r1 - BR * bh, hb)
    j0, j1 = np.maximum(r.c0 - BC * bw, 0), np.minimum(r.c1 - BC * bw, wb)
    n = np.maximum(i1 - i0, 0) * np.maximum(j1 - j0, 0)
    whole = n == hb * wb
    base = r.pos + (BR * bh + i0 - r.r0) * r.dr + (BC * bw + j0 - r.c0) * r.dc
    at = np.stack([base, np.full_like(base, r.dr), np.full_like(base, r.dc)], 1)
    part = ~whole & (n > 0)
    win = np.stack([i0, i1, j0, j1], 1)[part]
    return keys[whole], at[whole], keys[part], n[part], at[part], win


def odd_positions(k: int, rects: list, g: Geometry) -> np.ndarray:
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


def analyse_elements(sm: SourceMap, g: Geometry) -> Held | None:
    """:func:`held` element by element (rectangles that are not shards or transposes)."""
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
    whole, partial = keys[count == g.size[keys]], keys[count != g.size[keys]]
    odd = {}
    order = np.argsort(key, kind="stable")
    ks, lo = key[order], np.searchsorted(key[order], keys)
    hi = np.searchsorted(ks, keys, side="right")
    for k, a, b in zip(keys.tolist(), lo.tolist(), hi.tolist()):  # every block's positions
        out = np.full(bh * bw, -1, np.int64)
        m = order[a:b]
        out[within[m]] = pos[m]
        odd[k] = out.reshape(bh, bw)
    masked = ids.copy()
    masked[pos] = -1
    return Held(whole, np.tile([-1, 0, 0], (whole.size, 1)).reshape(-1, 3), partial,
                SourceMap.from_indices(masked.reshape(sm.shape)), None, ids, odd,
                np.tile([-1, 0, 0], (partial.size, 1)).reshape(-1, 3), _windows(partial.size, g))


def mirror_map(h: Held, mine: np.ndarray, g: Geometry, shape) -> SourceMap:
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
                blocks += rect_part(r, R0, R1, C0, C1, g, cols_view)
    return SourceMap.from_blocks(shape, Blocks.of(*blocks) if blocks else Blocks.empty(),
                                 check=False)


def rect_part(r: Rect, R0: int, R1: int, C0: int, C1: int, g: Geometry, cols_view: int):
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
