"""The element-exact check of a plan against its layouts, on blocks (:func:`verify_plan`)."""

from __future__ import annotations

import numpy as np

from wb.data.conversions import ITEMSIZE
from wb.data.dtypes import CODES, castable
from wb.errors import PlanError

__all__ = ["verify_plan"]


def _fail(what: str, t: int | None = None, plan=None) -> PlanError:
    if t is None or plan is None:
        return PlanError(what)
    tr = plan.transfers
    s, d = plan.slots[tr.src_slot[t]], plan.slots[tr.dst_slot[t]]
    return PlanError(f"{what}: transfer {t} (stage {int(tr.stage[t])}, piece {int(tr.piece[t])}, "
                     f"rank {s.rank} `{s.buffer}` -> rank {d.rank} `{d.buffer}`)")


def verify_plan(plan) -> None:
    """Checks ``plan`` (a :class:`wb.Plan`) element-exactly against the correspondence it
    carries (see :meth:`wb.Plan.verify`, which first checks that correspondence against the
    layouts).

    Raises:
        PlanError: saying what is wrong and where (first offending transfer).
    """
    corr, P, T, M = plan.corr, plan.pieces, plan.transfers, plan.messages
    tab, _ = plan.table
    n_t = T.piece.size
    # Pieces tile their cells exactly: in bounds, and areas add up to each needed cell's area.
    ca, cb = corr.cell_na[P.cell], corr.cell_nb[P.cell]
    if ((P.i0 < 0) | (P.j0 < 0) | (P.na < 1) | (P.nb < 1) | (P.i0 + P.na > ca)
            | (P.j0 + P.nb > cb)).any():
        raise _fail("a piece lies outside its cell")
    if (P.dtype != corr.cell_dtype[P.cell]).any() or (P.nbytes != P.na * P.nb * ITEMSIZE[P.dtype]).any():
        raise _fail("a piece does not travel in its cell's dtype, or its size is not its area "
                    "times that dtype's")
    area = np.bincount(P.cell, weights=P.na * P.nb, minlength=corr.cell_id0.size)
    needed_cells = np.unique(corr.inc_cell[tab.role[corr.inc_slot] == 1])
    if not np.array_equal(area[needed_cells], corr.cell_numel[needed_cells]):
        raise _fail("pieces do not tile the cells they cut")
    order = np.lexsort((P.j0, P.i0, P.cell))
    c, i0, j0, na, nb = P.cell[order], P.i0[order], P.j0[order], P.na[order], P.nb[order]
    same = c[1:] == c[:-1]
    nxt_row = same & (i0[1:] != i0[:-1])
    same_row = same & ~nxt_row
    if ((same_row & ((j0[1:] != j0[:-1] + nb[:-1]) | (na[1:] != na[:-1])))
            | (nxt_row & ((i0[1:] != i0[:-1] + na[:-1]) | (j0[1:] != 0)))).any():
        raise _fail("pieces of a cell overlap or leave gaps")
    # Every transfer's regions are incidences of its piece's cell, offset to the piece.
    n_inc = corr.inc_cell.size
    cell_t = P.cell[T.piece]
    for side, inc, slot, f0, fa, fb in (
            ("source", T.src_inc, T.src_slot, T.src_f0, T.src_fa, T.src_fb),
            ("destination", T.dst_inc, T.dst_slot, T.dst_f0, T.dst_fa, T.dst_fb)):
        k = np.clip(inc, 0, max(n_inc - 1, 0))
        ok = (inc >= 0) & (inc < n_inc)
        if n_inc:
            ok &= (corr.inc_cell[k] == cell_t) & (corr.inc_slot[k] == slot)
        if not ok.all():
            t = int(np.flatnonzero(~ok)[0])
            raise _fail(f"the {side} buffer does not hold/need these ids", t, plan)
        want = corr.inc_f0[k] + P.i0[T.piece] * corr.inc_fa[k] + P.j0[T.piece] * corr.inc_fb[k]
        bad = (f0 != want) | (fa != corr.inc_fa[k]) | (fb != corr.inc_fb[k])
        if bad.any():
            raise _fail(f"the {side} region is not where the buffer keeps these ids",
                        int(np.flatnonzero(bad)[0]), plan)
    src_role, dst_role = tab.role[T.src_slot], tab.role[T.dst_slot]
    wire = P.dtype[T.piece].astype(np.int64)
    for side, slot in (("source", T.src_slot), ("destination", T.dst_slot)):
        dt = tab.dtype[slot]
        for k in np.unique(dt * len(CODES) + wire, return_index=True)[1]:  # each pair once
            if not castable(CODES[dt[k]], CODES[wire[k]]):
                raise _fail(f"the {side} is {CODES[dt[k]]}, which wb does not convert to "
                            f"{CODES[wire[k]]}", int(k), plan)
    if (dst_role != 1).any():
        raise _fail("a transfer writes into a trainer buffer", int(np.argmax(dst_role != 1)), plan)
    # Sources: a trainer directly, or a rollout buffer an earlier transfer filled with this piece.
    from_trainer = src_role == 0
    bad = from_trainer & ((T.after != -1) | (T.stage != 1))
    if bad.any():
        raise _fail("a send from a trainer must be stage 1 and wait for nothing",
                    int(np.argmax(bad)), plan)
    fwd = np.flatnonzero(~from_trainer)
    a = T.after[fwd]
    if ((a < 0) | (a >= np.arange(n_t)[fwd])).any():
        t = int(fwd[np.argmax((a < 0) | (a >= fwd))])
        raise _fail("a forward comes before the transfer that brings it its piece "
                    "(stage order violated)", t, plan)
    bad = (T.piece[a] != T.piece[fwd]) | (T.dst_inc[a] != T.src_inc[fwd])
    if bad.any():
        raise _fail("a forward's source never received its piece", int(fwd[np.argmax(bad)]), plan)
    # Stages match where the bytes go.
    sn, dn = tab.node[T.src_slot], tab.node[T.dst_slot]
    bad = ((T.stage == 2) & (from_trainer | (sn == dn))) | ((T.stage == 3) & (from_trainer | (sn != dn)))
    if bad.any():
        raise _fail("stage 2 must cross rollout nodes and stage 3 stay inside one",
                    int(np.argmax(bad)), plan)
    # Every needed (piece, buffer) is delivered exactly once, and nothing else is.
    need = tab.role[corr.inc_slot] == 1
    n_pieces_of_cell = np.bincount(P.cell, minlength=corr.cell_id0.size)
    first_piece = np.r_[0, np.cumsum(n_pieces_of_cell)[:-1]]
    piece_order = np.argsort(P.cell, kind="stable")
    need_inc = np.flatnonzero(need)
    inc_c = corr.inc_cell[need_inc]
    cnt = n_pieces_of_cell[inc_c]
    rep = np.repeat(np.arange(inc_c.size), cnt)
    k = first_piece[inc_c][rep] + (np.arange(rep.size) - np.repeat(np.cumsum(cnt) - cnt, cnt))
    required = np.sort(piece_order[k] * n_inc + need_inc[rep])
    delivered = T.piece * n_inc + T.dst_inc
    d_sorted = np.sort(delivered)
    dup = d_sorted[1:] == d_sorted[:-1]
    if dup.any():
        key = d_sorted[1:][dup][0]
        t = int(np.flatnonzero(delivered == key)[1])
        raise _fail("a piece is delivered twice to the same buffer region (duplicated send)", t,
                    plan)
    if not np.array_equal(required, d_sorted):
        missing = np.setdiff1d(required, d_sorted)
        if missing.size:
            p, i = divmod(int(missing[0]), n_inc)
            sl = corr.slots[corr.inc_slot[i]]
            raise _fail(f"needed ids are never delivered: piece {p} (first id "
                        f"{int(corr.cell_id0[P.cell[p]] + P.i0[p] * corr.cell_S[P.cell[p]] + P.j0[p])}"
                        f") for rank {sl.rank} buffer `{sl.buffer}` (a dropped chunk?)")
        extra = np.setdiff1d(d_sorted, required)
        t = int(np.flatnonzero(delivered == extra[0])[0])
        raise _fail("a transfer delivers ids its destination does not need", t, plan)
    # No piece enters a node from outside twice.
    cross = np.flatnonzero(sn != dn)
    key = T.piece[cross] * (int(dn.max(initial=0)) + 1) + dn[cross]
    ks = np.sort(key)
    if (ks[1:] == ks[:-1]).any():
        dupk = ks[1:][ks[1:] == ks[:-1]][0]
        raise _fail("a piece enters a node from outside twice",
                    int(cross[np.flatnonzero(key == dupk)[1]]), plan)
    # Messages agree with their transfers.
    if M.stage.size:
        idx = np.repeat(np.arange(M.stage.size), M.count)
        if (idx.size != n_t or not np.array_equal(T.message, idx)
                or not np.array_equal(M.first, np.r_[0, np.cumsum(M.count)[:-1]])):
            raise _fail("messages do not partition the transfers in order")
        bad = ((M.stage[T.message] != T.stage) | (M.src_rank[T.message] != tab.rank[T.src_slot])
               | (M.dst_rank[T.message] != tab.rank[T.dst_slot]))
        if bad.any():
            raise _fail("a transfer travels in a message between other ranks",
                        int(np.argmax(bad)), plan)
        f = np.flatnonzero(~from_trainer)
        bad = M.parent[T.message[f]] != T.message[T.after[f]]
        if bad.any():
            raise _fail("a forwarded message does not wait for the message that brings its data",
                        int(f[np.argmax(bad)]), plan)
    elif n_t:
        raise _fail("transfers without messages")

