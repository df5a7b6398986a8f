"""Facts about cells and the slot table that routing, piece cutting and the bound all use."""

from __future__ import annotations

import numpy as np

from wb.data.conversions import ITEMSIZE
from wb.data.correspondence import Correspondence


def cell_itemsize(corr: Correspondence) -> np.ndarray:
    """Bytes per element of each cell as it travels (its dtype after any conversion).

    Args:
        corr: the correspondence.

    Returns:
        ``(cells,) int64`` bytes per element.
    """
    return ITEMSIZE[corr.cell_dtype]


def bytes_per_cell(corr: Correspondence) -> np.ndarray:
    """Bytes of each whole cell as it travels.

    Args:
        corr: the correspondence.

    Returns:
        ``(cells,) int64`` bytes.
    """
    return corr.cell_numel * cell_itemsize(corr)


def gpu_count(table) -> int:
    """How many GPUs the slot table's workers are on (GPU indices run from 0).

    Args:
        table: ``slot_table(corr.slots, trainers, rollouts)[0]`` (:mod:`wb.data.plan`).

    Returns:
        The number of GPUs.
    """
    return int(table.gpu.max(initial=-1)) + 1


def is_member(keys: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Whether each key is in ``table``.

    Args:
        keys: ``(k,) int64`` keys to look up.
        table: ``(t,) int64`` keys present, in any order, repeats allowed.

    Returns:
        ``(k,) bool``.

    Examples:
        >>> is_member(np.array([3, 4, 9]), np.array([9, 3, 3]))
        array([ True, False,  True])
    """
    present = np.unique(table)
    if present.size == 0:
        return np.zeros(keys.size, bool)
    pos = np.minimum(np.searchsorted(present, keys), present.size - 1)
    return present[pos] == keys


def sum_by_key(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sum of ``values`` per distinct key.

    Args:
        keys: ``(n,) int64``.
        values: ``(n,)`` numbers (bytes).

    Returns:
        ``(distinct keys, sums)``, both ``(u,) int64``, keys ascending.

    Examples:
        >>> sum_by_key(np.array([2, 0, 2]), np.array([5, 1, 7]))
        (array([0, 2]), array([ 1, 12]))
    """
    if keys.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    distinct, inverse = np.unique(keys, return_inverse=True)
    return distinct, np.bincount(inverse, weights=values, minlength=distinct.size).astype(np.int64)
