"""Cutting cells into pieces: the units that move, so forwarding starts as soon as one lands."""

from __future__ import annotations

import numpy as np

from wb.algorithms.planner.facts import cell_itemsize
from wb.data.correspondence import Correspondence
from wb.data.plan import Pieces


def cut_into_pieces(corr: Correspondence, table, chunk_bytes: int) -> Pieces:
    """Cuts every needed cell into pieces of at most ``chunk_bytes``: whole rows when a row
    fits, else runs of one row's columns.

    Args:
        corr: the correspondence.
        table: ``slot_table(corr.slots, trainers, rollouts)[0]`` (:mod:`wb.data.plan`).
        chunk_bytes: largest piece, in bytes (a piece holds one element at least).

    Returns:
        The :class:`~wb.data.plan.Pieces`, sorted by cell, each cell's row by row.
    """
    needed = table.role[corr.inc_slot] == 1
    cells = np.unique(corr.inc_cell[needed])
    itemsize = cell_itemsize(corr)[cells]
    rows, cols = corr.cell_na[cells], corr.cell_nb[cells]
    row_bytes = cols * itemsize
    wide = row_bytes > chunk_bytes
    cols_per_piece = np.where(wide, np.maximum(1, chunk_bytes // itemsize), cols)
    rows_per_piece = np.where(wide, 1, np.maximum(1, chunk_bytes // row_bytes))
    pieces_down = -(-rows // rows_per_piece)
    pieces_across = -(-cols // cols_per_piece)
    count = pieces_down * pieces_across
    of = np.repeat(np.arange(cells.size), count)  # each piece's index into ``cells``
    number = np.arange(of.size) - np.repeat(np.cumsum(count) - count, count)  # within its cell
    down, across = np.divmod(number, pieces_across[of])
    i0 = down * rows_per_piece[of]
    j0 = across * cols_per_piece[of]
    na = np.minimum(rows_per_piece[of], rows[of] - i0)
    nb = np.minimum(cols_per_piece[of], cols[of] - j0)
    return Pieces(cells[of], i0, j0, na, nb, na * nb * itemsize[of], corr.cell_dtype[cells[of]])
