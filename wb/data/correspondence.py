"""Correspondence: which trainer elements feed which rollout elements, computed on blocks.

Every block of every buffer (holders and needs alike) is brought into a common coordinate system
and cut into an *arrangement* of disjoint **cells**; each cell is a set of ids
``{id0 + i * S + j : i < na, j < nb}`` and lists every buffer that holds or needs all of it, with
where those ids sit in the buffer (an affine map of ``(i, j)`` to the buffer's flat index).

The coordinate system: a *zone* is a range of ids viewed as a grid of rows of width ``S``
(``id = p + a * S + b``). Zones are inferred from the 2-D blocks themselves (a slice copy of a
checkpoint tensor of row length ``B`` is a rectangle of the grid ``S = B`` whatever its
orientation in the buffer), so no checkpoint spec is needed. 1-D runs of ids (rows, flat FSDP
shards) are cut into at most three rectangles of whichever zone they cross; ids outside every zone
live on a single *line* (one row). Blocks that fit no consistent grid are split into rows, which is
always exact. The cost is O(blocks + cells), independent of the number of elements.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from wb.errors import PlanError
from wb.data.conversions import check_dtypes, streams
from wb.data.dtypes import CODE
from wb.data.layout import Layout, Role
from wb.data.sourcemap import Blocks

__all__ = ["Slot", "Correspondence", "Overlaps", "correspond"]

_LINE_S = np.int64(2**62)  # width of the line zone: one row holds every id


class Slot(NamedTuple):
    """One buffer of one worker: ``layouts[layout][buffer]`` on ``role``'s side."""

    role: Role
    layout: int  # index into trainers or rollouts
    rank: int
    buffer: str


class Correspondence(NamedTuple):
    """Disjoint cells of ids and, per cell, every buffer region holding or needing it.

    A cell also has the dtype its ids travel in (:func:`wb.data.dtypes.wire_dtype` of the
    holders' dtype and its needs' dtype). Where rollouts need the same ids in dtypes that travel
    differently (one rollout keeps a tensor in float32, another in bfloat16, the trainers hold it
    in float32), the ids form one cell per travelling dtype, each with every holder and the needs
    of that dtype; otherwise cells are disjoint. Incidences are sorted by cell. Element ``(i, j)``
    of cell ``k`` (id ``cell_id0[k] + i * cell_S[k] + j``) sits at flat index
    ``f0 + i * fa + j * fb`` of the incidence's buffer.
    """

    slots: tuple[Slot, ...]  # (n_slots,) every buffer of every worker
    slot_role: np.ndarray  # (n_slots,) int8: 0 holder (trainer), 1 need (rollout)
    cell_id0: np.ndarray  # (n_cells,) int64 first id
    cell_na: np.ndarray  # (n_cells,) int64 rows
    cell_nb: np.ndarray  # (n_cells,) int64 columns
    cell_S: np.ndarray  # (n_cells,) int64 id step per row
    inc_cell: np.ndarray  # (n_inc,) int64
    inc_slot: np.ndarray  # (n_inc,) int64
    inc_f0: np.ndarray  # (n_inc,) int64 buffer flat index of the cell's first element
    inc_fa: np.ndarray  # (n_inc,) int64 buffer flat step per cell row
    inc_fb: np.ndarray  # (n_inc,) int64 buffer flat step per cell column
    cell_dtype: np.ndarray  # (n_cells,) int8 code (wb.data.dtypes.CODES) of the dtype it travels in

    @property
    def cell_numel(self) -> np.ndarray:
        return self.cell_na * self.cell_nb

    def overlaps(self) -> Overlaps:
        """Every (holder region, need region) pair with the same ids, one per cell and pair."""
        holder = self.slot_role[self.inc_slot] == 0
        h, n = np.flatnonzero(holder), np.flatnonzero(~holder)
        hc, nc = self.inc_cell[h], self.inc_cell[n]
        # Incidences are sorted by cell: pair each need with every holder of its cell.
        lo = np.searchsorted(hc, nc, side="left")
        hi = np.searchsorted(hc, nc, side="right")
        count = hi - lo
        ni = np.repeat(n, count)
        start = np.repeat(lo - np.cumsum(np.r_[0, count[:-1]]), count)
        hi_idx = h[start + np.arange(count.sum())]
        c = self.inc_cell[ni]
        return Overlaps(
            self.inc_slot[hi_idx], self.inc_slot[ni], self.cell_id0[c], self.cell_na[c],
            self.cell_nb[c], self.cell_S[c], self.inc_f0[hi_idx], self.inc_fa[hi_idx],
            self.inc_fb[hi_idx], self.inc_f0[ni], self.inc_fa[ni], self.inc_fb[ni])


class Overlaps(NamedTuple):
    """Pairs ``(holder slot, region) -> (need slot, region)`` carrying the same ids in order."""

    src_slot: np.ndarray  # (n,) int64
    dst_slot: np.ndarray  # (n,) int64
    id0: np.ndarray  # (n,) int64
    na: np.ndarray  # (n,) int64
    nb: np.ndarray  # (n,) int64
    S: np.ndarray  # (n,) int64
    src_f0: np.ndarray  # (n,) int64
    src_fa: np.ndarray  # (n,) int64
    src_fb: np.ndarray  # (n,) int64
    dst_f0: np.ndarray  # (n,) int64
    dst_fa: np.ndarray  # (n,) int64
    dst_fb: np.ndarray  # (n,) int64


# --- blocks -> canonical pieces ---------------------------------------------------------------

class _Seg(NamedTuple):  # 1-D runs of consecutive ids: id x0 + k sits at flat f0 + k * fs
    slot: np.ndarray
    x0: np.ndarray
    n: np.ndarray
    f0: np.ndarray
    fs: np.ndarray


class _Rect(NamedTuple):  # ids x0 + i * S + j (i < nrow, j < ncol) at flat f0 + i * fa + j * fb
    slot: np.ndarray
    x0: np.ndarray
    nrow: np.ndarray
    ncol: np.ndarray
    S: np.ndarray
    f0: np.ndarray
    fa: np.ndarray
    fb: np.ndarray


def _cat(parts, cls):
    parts = [p for p in parts if p is not None and len(p[0])]
    if not parts:
        return cls(*(np.zeros(0, np.int64) for _ in cls._fields))
    return cls(*(np.concatenate(f).astype(np.int64, copy=False) for f in zip(*parts)))


def _pieces(slot: np.ndarray, b: Blocks, cols: np.ndarray) -> tuple[_Seg, _Rect]:
    """Canonical pieces of blocks (of any buffers): 1-D id runs and grid rectangles.

    ``slot`` and ``cols`` give, per block, its buffer and the buffer's row length.
    """
    n = b.count
    id0, sr, sc = b.id0.copy(), b.sr.copy(), b.sc.copy()
    f0 = b.r0 * cols + b.c0
    fr = cols.astype(np.int64, copy=True)
    fc = np.ones(n, np.int64)
    # Negative steps: walk the block backwards so ids ascend (the buffer steps turn negative).
    neg = sr < 0
    id0[neg] += (b.nr[neg] - 1) * sr[neg]
    f0[neg] += (b.nr[neg] - 1) * cols[neg]
    sr[neg], fr[neg] = -sr[neg], -fr[neg]
    neg = sc < 0
    id0[neg] += (b.nc[neg] - 1) * sc[neg]
    f0[neg] += b.nc[neg] - 1
    sc[neg], fc[neg] = -sc[neg], -fc[neg]
    nr, nc = b.nr, b.nc
    # 1-D progressions (id step s, flat step fs, length L).
    row1 = nr == 1
    col1 = (nc == 1) & ~row1
    flat_c = (nr > 1) & (nc > 1) & (sr == nc * sc) & (fr == nc * fc)
    flat_r = (nr > 1) & (nc > 1) & ~flat_c & (sc == nr * sr) & (fc == nr * fr)
    two_d = (nr > 1) & (nc > 1) & ~flat_c & ~flat_r
    p_s = np.concatenate([sc[row1], sr[col1], sc[flat_c], sr[flat_r]])
    p_fs = np.concatenate([fc[row1], fr[col1], fc[flat_c], fr[flat_r]])
    p_L = np.concatenate([nc[row1], nr[col1], (nr * nc)[flat_c], (nr * nc)[flat_r]])
    p_x0 = np.concatenate([id0[row1], id0[col1], id0[flat_c], id0[flat_r]])
    p_f0 = np.concatenate([f0[row1], f0[col1], f0[flat_c], f0[flat_r]])
    p_slot = np.concatenate([slot[row1], slot[col1], slot[flat_c], slot[flat_r]])
    # Genuine 2-D blocks with a unit id step on one axis are grid rectangles.
    inner_c = two_d & (sc == 1) & (sr >= nc)
    inner_r = two_d & ~inner_c & (sr == 1) & (sc >= nr)
    rects = [(slot[inner_c], id0[inner_c], nr[inner_c], nc[inner_c], sr[inner_c], f0[inner_c],
              fr[inner_c], fc[inner_c]),
             (slot[inner_r], id0[inner_r], nc[inner_r], nr[inner_r], sc[inner_r], f0[inner_r],
              fc[inner_r], fr[inner_r])]
    # Anything else: one 1-D progression per buffer row (exact, O(rows)).
    odd = two_d & ~inner_c & ~inner_r
    if odd.any():
        k = np.repeat(np.flatnonzero(odd), nr[odd])
        i = np.arange(k.size) - np.repeat(np.cumsum(nr[odd]) - nr[odd], nr[odd])
        p_s = np.concatenate([p_s, sc[k]])
        p_fs = np.concatenate([p_fs, fc[k]])
        p_L = np.concatenate([p_L, nc[k]])
        p_x0 = np.concatenate([p_x0, id0[k] + i * sr[k]])
        p_f0 = np.concatenate([p_f0, f0[k] + i * fr[k]])
        p_slot = np.concatenate([p_slot, slot[k]])
    rep = (p_s == 0) & (p_L > 1)  # one id repeated: each copy is its own one-element run
    if rep.any():
        k = np.repeat(np.flatnonzero(rep), p_L[rep])
        i = np.arange(k.size) - np.repeat(np.cumsum(p_L[rep]) - p_L[rep], p_L[rep])
        keep = ~rep
        p_slot = np.concatenate([p_slot[keep], p_slot[k]])
        p_x0 = np.concatenate([p_x0[keep], p_x0[k]])
        p_f0 = np.concatenate([p_f0[keep], p_f0[k] + i * p_fs[k]])
        p_s = np.concatenate([p_s[keep], np.ones(k.size, np.int64)])
        p_fs = np.concatenate([p_fs[keep], np.ones(k.size, np.int64)])
        p_L = np.concatenate([p_L[keep], np.ones(k.size, np.int64)])
    unit = (p_s == 1) | (p_L == 1)
    seg = _Seg(p_slot[unit], p_x0[unit], p_L[unit], p_f0[unit], p_fs[unit])
    st = ~unit  # strided 1-D progressions: a one-column rectangle of grid width s
    rects.append((p_slot[st], p_x0[st], p_L[st], np.ones(st.sum(), np.int64), p_s[st], p_f0[st],
                  p_fs[st], np.zeros(st.sum(), np.int64)))
    return seg, _cat(rects, _Rect)


# --- zones ------------------------------------------------------------------------------------

class _Zones(NamedTuple):
    lo: np.ndarray  # (z,) first id
    hi: np.ndarray  # (z,) one past the last id
    S: np.ndarray  # (z,) row width
    p: np.ndarray  # (z,) phase: id = p + a * S + b with 0 <= b < S


def _infer_zones(rect: _Rect, seg: _Seg) -> tuple[_Zones, np.ndarray]:
    """Groups rectangles whose id extents overlap into zones with one consistent grid.

    A group's grid width is its rectangles' ``S``; its phase ``p`` must let every rectangle sit
    inside one grid row. Candidate phases are the residues of 1-D run ends inside the group (whole
    tensors and whole rows start on row boundaries) and of the rectangles' first ids; the valid
    candidate leaving the fewest run ends off a row boundary wins, so runs are cut as little as
    possible. Zone extents are then widened to whole grid rows where no neighbour is in the way.

    Returns the zones (sorted, disjoint) and, per rectangle, its zone or -1 where no grid fits all
    rectangles of its group (the caller splits those into rows, which is always exact).
    """
    m = rect.x0.size
    if m == 0:
        z = np.zeros(0, np.int64)
        return _Zones(z, z, z, z), z
    lo, hi = rect.x0, rect.x0 + (rect.nrow - 1) * rect.S + rect.ncol
    order = np.lexsort((rect.x0, lo))
    reach = np.maximum.accumulate(hi[order])
    new = np.r_[True, lo[order][1:] >= reach[:-1]]
    group = np.empty(m, np.int64)
    group[order] = np.cumsum(new) - 1
    n_g = int(group.max()) + 1
    g_lo = np.full(n_g, np.iinfo(np.int64).max)
    g_hi = np.zeros(n_g, np.int64)
    np.minimum.at(g_lo, group, lo)
    np.maximum.at(g_hi, group, hi)
    g_S = np.zeros(n_g, np.int64)
    g_S[group[order][::-1]] = rect.S[order][::-1]  # S of the first rectangle of each group
    same_S = np.ones(n_g, bool)
    np.logical_and.at(same_S, group, rect.S == g_S[group])
    S_safe = np.maximum(g_S, 1)
    # Run ends that fall inside a group (groups are numbered in increasing id order).
    ends = np.concatenate([seg.x0, seg.x0 + seg.n])
    eg = np.searchsorted(g_lo, ends, side="right") - 1
    inside = (eg >= 0) & (ends <= g_hi[np.maximum(eg, 0)])
    ends, eg = ends[inside], eg[inside]
    e_order = np.lexsort((ends, eg))
    ends, eg = ends[e_order], eg[e_order]
    e_start = np.searchsorted(eg, np.arange(n_g))
    e_count = np.bincount(eg, minlength=n_g)
    members = order[np.argsort(group[order], kind="stable")]  # by group, then by lo
    r_start = np.searchsorted(group[members], np.arange(n_g))
    r_count = np.bincount(group, minlength=n_g)
    best_p = np.full(n_g, -1, np.int64)
    best_score = np.full(n_g, np.iinfo(np.int64).max)
    rounds = [("end", k) for k in range(8)] + [("rect", k) for k in range(8)]
    for kind, k in rounds:
        has = same_S & ((e_count if kind == "end" else r_count) > k)
        if not has.any():
            continue
        gi = np.flatnonzero(has)
        phase = np.zeros(n_g, np.int64)
        src = ends[e_start[gi] + k] if kind == "end" else rect.x0[members[r_start[gi] + k]]
        phase[gi] = src % S_safe[gi]
        fits = has.copy()
        mine = has[group]
        b0 = (rect.x0 - phase[group]) % S_safe[group]
        np.logical_and.at(fits, group[mine], (b0 + rect.ncol <= g_S[group])[mine])
        score = np.zeros(n_g, np.int64)
        np.add.at(score, eg, ((ends - phase[eg]) % S_safe[eg] != 0).astype(np.int64))
        better = fits & (score < best_score)
        best_p[better], best_score[better] = phase[better], score[better]
    good = best_p >= 0
    zone_of_group = np.cumsum(good) - 1
    z_lo, z_hi, z_S, z_p = g_lo[good], g_hi[good], g_S[good], best_p[good]
    # Widen to whole grid rows, never into a neighbour (zones stay sorted and disjoint).
    want_lo = z_p + ((z_lo - z_p) // z_S) * z_S
    want_hi = z_p + (-((z_p - z_hi) // z_S)) * z_S
    nxt = np.r_[z_lo[1:], np.iinfo(np.int64).max]
    z_hi = np.minimum(want_hi, nxt)
    prev = np.r_[np.iinfo(np.int64).min, z_hi[:-1]]
    z_lo = np.maximum(want_lo, prev)
    zones = _Zones(z_lo, z_hi, z_S, z_p)
    return zones, np.where(good[group], zone_of_group[group], -1)


def _rect_rows(rect: _Rect, mask: np.ndarray) -> _Seg | _Rect:
    """Rows of the masked rectangles as 1-D runs (ids x0 + i*S + j, j < ncol)."""
    k = np.repeat(np.flatnonzero(mask), rect.nrow[mask])
    i = np.arange(k.size) - np.repeat(np.cumsum(rect.nrow[mask]) - rect.nrow[mask],
                                      rect.nrow[mask])
    unit = rect.fb[k] != 0
    one = rect.ncol[k] == 1
    keep = unit | one
    k, i = k[keep], i[keep]
    return _Seg(rect.slot[k], rect.x0[k] + i * rect.S[k], rect.ncol[k], rect.f0[k] + i * rect.fa[k],
                np.where(rect.ncol[k] == 1, 1, rect.fb[k]))


# --- the arrangement --------------------------------------------------------------------------

def _seg_in_zones(seg: _Seg, zones: _Zones):
    """Cuts 1-D runs at zone boundaries, then into grid rows: (zone index or -1 for line, piece)."""
    if seg.x0.size == 0:
        return _cat([], _Rect), np.zeros(0, np.int64)
    bnd = np.unique(np.concatenate([zones.lo, zones.hi]))
    x, y = seg.x0, seg.x0 + seg.n
    k0 = np.searchsorted(bnd, x, side="right")
    k1 = np.searchsorted(bnd, y, side="left")
    parts = 1 + np.maximum(k1 - k0, 0)
    idx = np.repeat(np.arange(x.size), parts)
    j = np.arange(idx.size) - np.repeat(np.cumsum(parts) - parts, parts)
    ext = np.r_[bnd, np.iinfo(np.int64).max]  # never read where there is no cut
    cut_lo = np.where(j == 0, x[idx], ext[np.clip(k0[idx] + j - 1, 0, bnd.size)])
    cut_hi = np.where(j == parts[idx] - 1, y[idx], ext[np.clip(k0[idx] + j, 0, bnd.size)])
    big = np.iinfo(np.int64).max  # a sentinel zone (empty) keeps the lookups below in bounds
    z_lo, z_hi = np.r_[zones.lo, big], np.r_[zones.hi, big]
    z_S, z_p = np.r_[zones.S, 1], np.r_[zones.p, 0]
    zi = np.searchsorted(z_lo, cut_lo, side="right") - 1
    inside = (zi >= 0) & (cut_lo < z_hi[np.maximum(zi, 0)])
    zi = np.where(inside, zi, -1)
    f_lo = seg.f0[idx] + (cut_lo - x[idx]) * seg.fs[idx]
    S = np.where(inside, z_S[np.maximum(zi, 0)], _LINE_S)
    p = np.where(inside, z_p[np.maximum(zi, 0)], 0)
    a_u, b_u = np.divmod(cut_lo - p, S)
    a_l, b_l = np.divmod(cut_hi - 1 - p, S)
    fs = seg.fs[idx]
    slot = seg.slot[idx]
    # head row (partial), middle rows (full), tail row (partial); empty pieces are dropped.
    single = a_u == a_l
    head_n = np.where(single, cut_hi - cut_lo, np.where(b_u > 0, S - b_u, 0))
    mid_a0 = np.where(b_u > 0, a_u + 1, a_u)
    mid_a1 = np.where(b_l < S - 1, a_l, a_l + 1)
    mid_n = np.where(single, 0, np.maximum(mid_a1 - mid_a0, 0))
    tail_n = np.where(single | (b_l == S - 1), 0, b_l + 1)
    head_n = np.where(single, head_n, np.where(b_u > 0, head_n, 0))
    out = []
    for sel, a0, na, b0, nb in [
        (head_n > 0, a_u, np.ones_like(a_u), b_u, head_n),
        (mid_n > 0, mid_a0, mid_n, np.zeros_like(a_u), S),
        (tail_n > 0, a_l, np.ones_like(a_u), np.zeros_like(a_u), tail_n),
    ]:
        first = p + a0 * S + b0
        out.append((slot[sel], first[sel], na[sel], nb[sel], S[sel],
                    (f_lo + (first - cut_lo) * fs)[sel], (S * fs)[sel], fs[sel], zi[sel]))
    cat = [np.concatenate(f) for f in zip(*out)]
    return _Rect(*cat[:8]), cat[8]


def correspond(trainers: Sequence[Layout], rollouts: Sequence[Layout], *,
               check: bool = True) -> Correspondence:
    """Cells of ids with every trainer buffer region holding them and rollout region needing them.

    Args:
        trainers: layouts of trainer workers (their buffers hold ids).
        rollouts: layouts of rollout workers (their buffers need ids).
        check: raise if a needed id is held by no trainer, trainers hold one id in different
            dtypes, or a rollout needs an id in a dtype wb does not convert the held one to.

    Returns:
        The :class:`Correspondence`; ``.overlaps()`` lists holder -> need region pairs.

    Raises:
        PlanError: an id needed by a rollout buffer is held by no trainer (names the rollout rank,
            buffer and first missing id), or dtypes disagree beyond a float conversion.
    """
    slots: list[Slot] = []
    blocks: list[Blocks] = []
    cols: list[int] = []
    for role, layouts in ((Role.TRAINER, trainers), (Role.ROLLOUT, rollouts)):
        for li, lay in enumerate(layouts):
            if not isinstance(lay, Layout):
                raise PlanError(f"{role.value}s[{li}] must be a wb.Layout, got {type(lay).__name__}")
            if lay.worker.role != role:
                raise PlanError(f"{role.value}s[{li}] is a layout of a {lay.worker.role.value} "
                                f"(rank {lay.worker.rank}); pass it in the {lay.worker.role.value}s list")
            for name, buf in lay.buffers.items():
                slots.append(Slot(role, li, lay.worker.rank, name))
                blocks.append(buf.sourcemap.blocks)
                cols.append(buf.sourcemap.view2d[1])
    counts = np.array([b.count for b in blocks], np.int64)
    all_blocks = Blocks(*(np.concatenate(f) if blocks else np.zeros(0, np.int64)
                          for f in zip(*blocks))) if blocks else Blocks.empty()
    seg, rect = _pieces(np.repeat(np.arange(len(slots)), counts), all_blocks,
                        np.repeat(np.asarray(cols, np.int64), counts))
    zones, rect_zone = _infer_zones(rect, seg)
    misfit = rect_zone < 0
    if misfit.any():
        seg = _cat([seg, _rect_rows(rect, misfit)], _Seg)
        rect = _Rect(*(f[~misfit] for f in rect))
        rect_zone = rect_zone[~misfit]
    # Pieces in zone coordinates: rectangles (a0, na, b0, nb) plus buffer affine maps.
    cut, cut_zone = _seg_in_zones(seg, zones)
    zS = np.r_[zones.S, _LINE_S]
    zp = np.r_[zones.p, 0]
    zone = np.concatenate([rect_zone, np.where(cut_zone < 0, zones.S.size, cut_zone)])
    P = _cat([rect, cut], _Rect)
    a0, b0 = np.divmod(P.x0 - zp[zone], zS[zone])
    # Global rows: each zone's grid rows laid end to end.
    z_amin = np.r_[(zones.lo - zones.p) // np.maximum(zones.S, 1), 0]
    z_amax = np.r_[(zones.hi - 1 - zones.p) // np.maximum(zones.S, 1), 0]
    z_off = np.r_[0, np.cumsum(z_amax - z_amin + 1)]
    g0 = z_off[zone] + a0 - z_amin[zone]
    g1 = g0 + P.nrow
    slot_role = np.array([0 if s.role == Role.TRAINER else 1 for s in slots], np.int8)
    corr = _arrange(tuple(slots), slot_role, P, zone, g0, g1, b0, zS, zp, z_off, z_amin)
    slot_dt = np.array([CODE[_dtype(trainers if s.role == Role.TRAINER else rollouts, s)]
                        for s in slots], np.int64)
    if check:
        _check(corr, slot_dt)
    return streams(corr, slot_dt)


def _arrange(slots, slot_role, P: _Rect, zone, g0, g1, b0, zS, zp, z_off, z_amin):
    empty = np.zeros(0, np.int64)
    if P.x0.size == 0:
        return Correspondence(slots, slot_role, empty, empty, empty, empty, empty, empty, empty,
                              empty, empty, np.zeros(0, np.int8))
    bp = np.unique(np.concatenate([g0, g1]))  # slab breakpoints on global rows
    s0 = np.searchsorted(bp, g0)
    s1 = np.searchsorted(bp, g1)
    cnt = s1 - s0
    pi = np.repeat(np.arange(P.x0.size), cnt)  # (piece, slab) pairs
    slab = s0[pi] + (np.arange(pi.size) - np.repeat(np.cumsum(cnt) - cnt, cnt))
    lo_b, hi_b = b0[pi], b0[pi] + P.ncol[pi]
    vals, inv = np.unique(np.concatenate([lo_b, hi_b]), return_inverse=True)
    nv = np.int64(vals.size)
    key_lo = slab * nv + inv[: pi.size]
    key_hi = slab * nv + inv[pi.size:]
    pts = np.unique(np.concatenate([key_lo, key_hi]))
    i0 = np.searchsorted(pts, key_lo)
    i1 = np.searchsorted(pts, key_hi)
    c = i1 - i0
    inc_pair = np.repeat(np.arange(pi.size), c)
    inc_pt = i0[inc_pair] + (np.arange(inc_pair.size) - np.repeat(np.cumsum(c) - c, c))
    cells, inc_cell = np.unique(inc_pt, return_inverse=True)
    cslab = pts[cells] // nv
    cb0 = vals[pts[cells] % nv]
    cb1 = vals[pts[cells + 1] % nv]
    # Zone of each cell: the zone of any incident piece (all pieces of a slab share its zone).
    first_inc = np.zeros(cells.size, np.int64)
    first_inc[inc_cell[::-1]] = np.arange(inc_cell.size)[::-1]
    czone = zone[pi[inc_pair[first_inc]]]
    ca0 = bp[cslab] - z_off[czone] + z_amin[czone]
    cna = bp[cslab + 1] - bp[cslab]
    cid0 = zp[czone] + ca0 * zS[czone] + cb0
    piece = pi[inc_pair]
    g_piece_row = g0[piece]
    da = bp[cslab[inc_cell]] - g_piece_row
    db = cb0[inc_cell] - b0[piece]
    f0 = P.f0[piece] + da * P.fa[piece] + db * P.fb[piece]
    order = np.lexsort((P.slot[piece], inc_cell))
    return Correspondence(
        slots, slot_role, cid0, cna, cb1 - cb0, zS[czone],
        inc_cell[order], P.slot[piece][order], f0[order], P.fa[piece][order],
        P.fb[piece][order], np.zeros(cells.size, np.int8))


def _check(corr: Correspondence, slot_dt: np.ndarray) -> None:
    role = corr.slot_role[corr.inc_slot]
    n_cells = corr.cell_id0.size
    held = np.zeros(n_cells, bool)
    held[corr.inc_cell[role == 0]] = True
    need = role == 1
    missing = need & ~held[corr.inc_cell]
    if missing.any():
        k = np.flatnonzero(missing)
        first = k[np.argmin(corr.cell_id0[corr.inc_cell[k]])]
        s = corr.slots[corr.inc_slot[first]]
        mine = k[corr.inc_slot[k] == corr.inc_slot[first]]
        n_missing = int(corr.cell_numel[corr.inc_cell[mine]].sum())
        first_id = int(corr.cell_id0[corr.inc_cell[first]])
        held_cells = np.flatnonzero(held)
        top = int((corr.cell_id0[held_cells] + corr.cell_numel[held_cells]).max(initial=0))
        beyond = (f"; the trainers hold no id from {top} on: rollouts probed against a larger "
                  f"checkpoint, such as an FP8 one's scales, need the conversion declared "
                  f"(wb.FP8Blocks, quantize= on wb.agree_parts and wb.Sender, or "
                  f"wb.algorithms.fp8.tasks.quantize_layouts)" if first_id >= top else "")
        raise PlanError(
            f"rollouts[{s.layout}] (rank {s.rank}) needs {n_missing} elements of buffer "
            f"`{s.buffer}` that no trainer holds (first missing id {first_id}); check that every "
            f"trainer layout was probed with the same checkpoint spec and that together they "
            f"hold the whole model{beyond}")
    check_dtypes(corr, slot_dt)


def _dtype(layouts, s: Slot) -> str:
    return layouts[s.layout].buffers[s.buffer].dtype
