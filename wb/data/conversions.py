"""Conversions in a correspondence: the dtype each cell travels in, and the dtype differences
wb refuses.

A rollout may need an element in another float dtype than the trainers hold it: it then travels
in :func:`wb.data.dtypes.wire_dtype` of the two (narrowed by the sender, widened by the receiver),
and a cell whose needs travel in different dtypes is split, one copy per dtype (:func:`streams`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from wb.data.dtypes import CODE, CODES, FLOATS, castable, dtype_info, wire_dtype
from wb.errors import PlanError

__all__ = ["ITEMSIZE", "check_dtypes", "streams"]

#: Bytes per element of each dtype code (``wb.data.dtypes.CODES``).
ITEMSIZE = np.array([dtype_info(n).itemsize for n in CODES], np.int64)
ITEMSIZE.flags.writeable = False
#: ``WIRE[held, needed]``: the code of :func:`wb.data.dtypes.wire_dtype` of two dtype codes.
WIRE = np.array([[CODE[wire_dtype(h, n)] for n in CODES] for h in CODES], np.int64)
WIRE.flags.writeable = False


def streams(corr: Any, slot_dt: np.ndarray) -> Any:
    """``corr`` (a :class:`~wb.data.correspondence.Correspondence`) with each cell's travelling
    dtype set (:func:`wb.data.dtypes.wire_dtype` of its holders' and needs' dtypes):
    a cell whose needs travel in several is split, one copy per dtype, each with every holder of
    the cell and the needs of that dtype.

    Args:
        corr: the correspondence, its ``cell_dtype`` not set yet.
        slot_dt: ``(slots,) int64`` each slot's dtype code (``wb.data.dtypes.CODES``).
    """
    n_cells, n_codes = corr.cell_id0.size, len(CODES)
    role = corr.slot_role[corr.inc_slot]
    inc_dt = slot_dt[corr.inc_slot] if slot_dt.size else np.zeros(0, np.int64)
    held = np.full(n_cells, -1, np.int64)
    held[corr.inc_cell[role == 0]] = inc_dt[role == 0]
    need = np.flatnonzero(role == 1)
    h = held[corr.inc_cell[need]]
    nd = inc_dt[need]
    wire = np.where(h < 0, nd, WIRE[np.maximum(h, 0), nd])  # no holder (unchecked): as needed
    keys = np.unique(corr.inc_cell[need] * n_codes + wire)
    s_cell, s_dt = np.divmod(keys, n_codes)
    per_cell = np.bincount(s_cell, minlength=n_cells)
    cell_dtype = held.copy()
    if (per_cell <= 1).all():
        cell_dtype[s_cell] = s_dt
        return corr._replace(cell_dtype=cell_dtype.astype(np.int8))
    copies = np.maximum(per_cell, 1)
    first = np.r_[0, np.cumsum(copies)[:-1]]
    new_dt = np.repeat(cell_dtype, copies)
    new_dt[first[s_cell] + np.arange(keys.size) - np.searchsorted(s_cell, s_cell)] = s_dt
    # needs go to the copy of their dtype; holders to every copy of their cell
    k_need = corr.inc_cell[need] * n_codes + wire
    need_cell = first[corr.inc_cell[need]] + (np.searchsorted(keys, k_need)
                                             - np.searchsorted(s_cell, corr.inc_cell[need]))
    hold = np.flatnonzero(role == 0)
    rep = copies[corr.inc_cell[hold]]
    hold_inc = np.repeat(hold, rep)
    hold_cell = np.repeat(first[corr.inc_cell[hold]], rep) + (
        np.arange(hold_inc.size) - np.repeat(np.cumsum(rep) - rep, rep))
    inc = np.concatenate([hold_inc, need])
    cell = np.concatenate([hold_cell, need_cell])
    order = np.lexsort((corr.inc_slot[inc], cell))
    inc, cell = inc[order], cell[order]
    return corr._replace(
        cell_id0=np.repeat(corr.cell_id0, copies), cell_na=np.repeat(corr.cell_na, copies),
        cell_nb=np.repeat(corr.cell_nb, copies), cell_S=np.repeat(corr.cell_S, copies),
        inc_cell=cell, inc_slot=corr.inc_slot[inc], inc_f0=corr.inc_f0[inc],
        inc_fa=corr.inc_fa[inc], inc_fb=corr.inc_fb[inc], cell_dtype=new_dt.astype(np.int8))


def check_dtypes(corr: Any, slot_dt: np.ndarray) -> None:
    """Refuses ids the trainers hold in two dtypes, and needs wb cannot convert to.

    Args:
        corr: a :class:`~wb.data.correspondence.Correspondence` (before :func:`streams`).
        slot_dt: ``(slots,) int64`` each slot's dtype code (``wb.data.dtypes.CODES``).

    Raises:
        PlanError: naming the id, or the rollout buffer, and the dtypes.
    """
    if not slot_dt.size:
        return
    need = corr.slot_role[corr.inc_slot] == 1
    n_cells = corr.cell_id0.size
    inc_dt = slot_dt[corr.inc_slot]
    hold = ~need
    lo = np.full(n_cells, len(CODES), np.int64)
    hi = np.full(n_cells, -1, np.int64)
    np.minimum.at(lo, corr.inc_cell[hold], inc_dt[hold])
    np.maximum.at(hi, corr.inc_cell[hold], inc_dt[hold])
    mixed = np.flatnonzero((hi >= 0) & (lo != hi))
    if mixed.size:
        c = int(mixed[np.argmin(corr.cell_id0[mixed])])
        raise PlanError(
            f"the trainers hold id {int(corr.cell_id0[c])} both as {CODES[lo[c]]} and as "
            f"{CODES[hi[c]]}; every trainer must keep a weight in one dtype (cast the trainer "
            f"buffers, or leave the odd copy out of its layout)")
    held = hi[corr.inc_cell]
    bad = np.flatnonzero(need & (held >= 0) & (inc_dt != held))
    for i in bad[np.unique(inc_dt[bad] * len(CODES) + held[bad], return_index=True)[1]]:
        if not castable(CODES[inc_dt[i]], CODES[held[i]]):
            s = corr.slots[corr.inc_slot[i]]
            raise PlanError(
                f"rollouts[{s.layout}] buffer `{s.buffer}` is {CODES[inc_dt[i]]} but the "
                f"trainers hold its id {int(corr.cell_id0[corr.inc_cell[i]])} as "
                f"{CODES[held[i]]}; wb converts only between float dtypes "
                f"({', '.join(sorted(FLOATS))}): make both sides the same dtype")
