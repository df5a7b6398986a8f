"""Where given checkpoint ids lie in a buffer, from its source map's blocks: :func:`locate`.

A weight check (:mod:`wb.runtime.endpoints.checks`) reads a sample of checkpoint elements from
a worker's buffers. Decoding a map to one id per element would cost the buffer's size in int64
(a Kimi-K2 rank's buffers hold billions of elements); instead each sampled id is solved for in
the affine rectangles that may hold it (:class:`wb.data.sourcemap.Blocks`): ``id = id0 + i * sr
+ j * sc`` for ``0 <= i < nr``, ``0 <= j < nc``, in O(blocks + samples) array operations.
"""

from __future__ import annotations

import numpy as np

from wb.data.sourcemap import SourceMap

__all__ = ["locate"]


def locate(sm: SourceMap, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every element of a buffer that holds one of ``ids``.

    Args:
        sm: the buffer's source map.
        ids: ``(k,) int64`` checkpoint ids, sorted, without repeats.

    Returns:
        ``(which, flat)``: ``which[n]`` indexes ``ids``, ``flat[n]`` is the element (C order)
        of the buffer holding it; an id held by several elements comes once per element, one
        held by none not at all. Sorted by ``flat``.

    Examples:
        >>> sm = SourceMap.from_indices(np.array([[5, 6, -1], [7, 8, 9]]))
        >>> locate(sm, np.array([6, 9, 42]))
        (array([0, 1]), array([1, 5]))
    """
    ids = np.asarray(ids, np.int64)
    b = sm.blocks
    if not b.count or not ids.size:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    # each block's id range, and the sampled ids inside it: the candidates
    span_r, span_c = (b.nr - 1) * b.sr, (b.nc - 1) * b.sc
    lo = b.id0 + np.minimum(span_r, 0) + np.minimum(span_c, 0)
    hi = b.id0 + np.maximum(span_r, 0) + np.maximum(span_c, 0)
    first, last = np.searchsorted(ids, lo), np.searchsorted(ids, hi, side="right")
    count = last - first
    blk = np.repeat(np.arange(b.count), count)
    which = (np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
             + np.repeat(first, count))
    d = ids[which] - b.id0[blk]
    # the axis of the larger step is solved first: i (or j) = d // step, or a neighbour of it
    sr, sc, nr, nc = b.sr[blk], b.sc[blk], b.nr[blk], b.nc[blk]
    rows_outer = np.abs(sr) >= np.abs(sc)
    so, sn = np.where(rows_outer, sr, sc), np.where(rows_outer, sc, sr)
    no, nn = np.where(rows_outer, nr, nc), np.where(rows_outer, nc, nr)
    hit = np.zeros(d.size, bool)
    oi = np.zeros(d.size, np.int64)
    ni = np.zeros(d.size, np.int64)
    safe_so = np.where(so == 0, 1, so)
    base = np.where(so == 0, 0, np.floor_divide(d, safe_so))
    for off in (-1, 0, 1):
        o = base + off
        rem = d - o * so
        safe_sn = np.where(sn == 0, 1, sn)
        n = np.where(sn == 0, 0, np.floor_divide(rem, safe_sn))
        ok = (~hit & (o >= 0) & (o < no) & (n >= 0) & (n < nn) & (o * so + n * sn == d))
        oi, ni, hit = np.where(ok, o, oi), np.where(ok, n, ni), hit | ok
    # interleaved rectangles (steps that cross: ids of one row between another's, an id maybe
    # held twice) are rare: their candidates are tried against every row of their block
    crossing = (no > 1) & (nn > 1) & (sn != 0) & (np.abs(so) <= np.abs(sn) * (nn - 1))
    extra_which, extra_flat = [], []
    cols = sm.view2d[1]
    for k in np.flatnonzero(crossing):
        o = np.arange(int(no[k]))
        n = (d[k] - o * so[k]) // sn[k]
        good = (n >= 0) & (n < nn[k]) & (o * so[k] + n * sn[k] == d[k])
        o, n = o[good], n[good]
        i, j = (o, n) if rows_outer[k] else (n, o)
        extra_flat.append((b.r0[blk[k]] + i) * cols + b.c0[blk[k]] + j)
        extra_which.append(np.full(i.size, which[k]))
    hit &= ~crossing
    # a step of 0 along an axis longer than 1 repeats the id (a replicated tensor): every
    # element along it holds it
    h = np.flatnonzero(hit)
    ko = np.where(so[h] == 0, no[h], 1)
    kn = np.where(sn[h] == 0, nn[h], 1)
    reps = ko * kn
    h_rep = np.repeat(h, reps)
    k = np.arange(int(reps.sum())) - np.repeat(np.cumsum(reps) - reps, reps)
    o = np.where(so[h_rep] == 0, k // np.repeat(kn, reps), oi[h_rep])
    n = np.where(sn[h_rep] == 0, k % np.repeat(kn, reps), ni[h_rep])
    outer = rows_outer[h_rep]
    i, j = np.where(outer, o, n), np.where(outer, n, o)
    flat = np.concatenate([(b.r0[blk[h_rep]] + i) * cols + b.c0[blk[h_rep]] + j, *extra_flat])
    which = np.concatenate([which[h_rep], *extra_which]).astype(np.int64)
    order = np.argsort(flat, kind="stable")
    return which[order], flat[order]
