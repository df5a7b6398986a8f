"""Choosing holders: which trainer sends a cell that must leave the trainers over a NIC."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from wb.data.correspondence import Correspondence
from wb.data.layout import Cluster
from wb.errors import PlanError


class Holders(NamedTuple):
    """Every holder incidence (a trainer buffer region with a cell), sorted by (cell, GPU) so the
    holders of one cell are one run, found by ``searchsorted`` on ``cell``."""

    incidence: np.ndarray  # (h,) int64 holder incidence (corr.inc_*)
    cell: np.ndarray  # (h,) int64 its cell
    gpu: np.ndarray  # (h,) int64 its GPU
    node: np.ndarray  # (h,) int64 its node


def sorted_holders(corr: Correspondence, table) -> Holders:
    """The holder incidences of ``corr``, sorted by (cell, GPU).

    Args:
        corr: the correspondence.
        table: ``slot_table(corr.slots, trainers, rollouts)[0]`` (:mod:`wb.data.plan`).

    Returns:
        The :class:`Holders`.
    """
    incidence = np.flatnonzero(table.role[corr.inc_slot] == 0)
    cell = corr.inc_cell[incidence]
    gpu, node = table.gpu[corr.inc_slot[incidence]], table.node[corr.inc_slot[incidence]]
    order = np.lexsort((gpu, cell))
    return Holders(incidence[order], cell[order], gpu[order], node[order])


def nic_bytes_per_s_by_gpu(table, nodes: list[str], cluster: Cluster, n_gpus: int) -> np.ndarray:
    """The NIC rate of every GPU (its node's).

    Args:
        table: ``slot_table(...)[0]``.
        nodes: node names, as ``slot_table`` returns them.
        cluster: the bandwidths.
        n_gpus: how many GPUs (``gpu_count(table)``).

    Returns:
        ``(n_gpus,) float64`` bytes per second.
    """
    node_of_gpu = np.zeros(n_gpus, np.int64)
    node_of_gpu[table.gpu] = table.node
    return np.array([cluster.nic_bytes_per_s(nodes[n]) for n in node_of_gpu])


def least_loaded_holders(cells: np.ndarray, cell_bytes: np.ndarray, holders: Holders,
                         nic_bytes_per_s: np.ndarray) -> np.ndarray:
    """For each cell a trainer sends over its NIC, the holder whose GPU's NIC is least busy.

    Deciding the largest cells first (longest processing time first) keeps the busiest NIC
    close to the average. A cell held on one GPU only (maybe in several buffers) has no choice;
    its time counts before the choices are made.

    Args:
        cells: ``(k,) int64`` cells to send, each with at least one holder.
        cell_bytes: ``(cells,) int64`` bytes of every cell.
        holders: :func:`sorted_holders`.
        nic_bytes_per_s: ``(gpus,) float64`` NIC rate of every GPU.

    Returns:
        ``(k,) int64`` the sending holder incidence of each cell.

    Raises:
        PlanError: a cell has no holder (the correspondence checks this first).
    """
    seconds_out = np.zeros(nic_bytes_per_s.size, np.float64)
    first = np.searchsorted(holders.cell, cells, side="left")
    end = np.searchsorted(holders.cell, cells, side="right")
    if (end <= first).any():
        raise PlanError("internal: a needed cell without holders passed the correspondence check")
    chosen = holders.incidence[first].copy()
    first_gpu = holders.gpu[first]
    one_gpu = first_gpu == holders.gpu[end - 1]  # holders sort by GPU within a cell
    np.add.at(seconds_out, first_gpu[one_gpu],
              cell_bytes[cells[one_gpu]] / nic_bytes_per_s[first_gpu[one_gpu]])
    several = np.flatnonzero(~one_gpu)
    for k in several[np.argsort(-cell_bytes[cells[several]], kind="stable")].tolist():
        candidates = holders.gpu[first[k]:end[k]]
        best = first[k] + int(np.argmin(seconds_out[candidates]))
        chosen[k] = holders.incidence[best]
        seconds_out[holders.gpu[best]] += cell_bytes[cells[k]] / nic_bytes_per_s[holders.gpu[best]]
    return chosen
