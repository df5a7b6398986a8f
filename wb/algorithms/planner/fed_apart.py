"""Rollouts fed apart: each on a node of its own, fed by the trainers alone, forwarding nothing."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

import numpy as np

from wb.algorithms.planner.facts import bytes_per_cell, gpu_count
from wb.algorithms.planner.holders import (least_loaded_holders, nic_bytes_per_s_by_gpu,
                                           sorted_holders)
from wb.algorithms.planner.routes import RouteRows
from wb.data.correspondence import Correspondence
from wb.data.layout import Cluster, Layout
from wb.errors import PlanError

#: What marks the node of a rollout fed apart (see :func:`~wb.algorithms.planner.plan`'s ``apart``).
APART = "~apart"


def on_nodes_of_their_own(rollouts: tuple[Layout, ...],
                          apart: Collection[int]) -> tuple[Layout, ...]:
    """``rollouts`` with each rank of ``apart`` on a node of its own, ``"<node>~apart<rank>"``.

    Args:
        rollouts: the rollout layouts.
        apart: rollout ranks to feed apart.

    Returns:
        The rollout layouts, the others unchanged.

    Raises:
        PlanError: ``apart`` names a rank that is no rollout.
    """
    ranks = {int(r) for r in apart}
    known = {lay.worker.rank for lay in rollouts}
    if ranks - known:
        raise PlanError(f"apart={sorted(ranks - known)} are not rollout ranks of this plan "
                        f"(rollouts: {sorted(known)[:8]}...)")
    return tuple(
        Layout(replace(lay.worker, node=f"{lay.worker.node}{APART}{lay.worker.rank}"),
               lay.buffers) if lay.worker.rank in ranks else lay for lay in rollouts)


def add_routes_fed_apart(rows: RouteRows, corr: Correspondence, table, nodes: list[str],
                         cluster: Cluster, needs: np.ndarray) -> None:
    """Adds to ``rows`` the routes that feed ``needs``, on nodes fed apart, from the trainers.

    Per cell and node, one stage-1 route from the holder with the least busy trainer NIC (largest
    cells first) to one of the node's needs of the cell, then stage 3 from that need to the
    node's others (several buffers of a rank needing the same cell); nothing leaves the node.

    Args:
        rows: where the routes go.
        corr: the correspondence.
        table: ``slot_table(corr.slots, trainers, rollouts)[0]`` (:mod:`wb.data.plan`).
        nodes: node names, as ``slot_table`` returns them.
        cluster: the bandwidths, to balance the trainer NICs.
        needs: ``(n,) int64`` need incidences to feed, all on nodes fed apart.
    """
    nic_bytes_per_s = nic_bytes_per_s_by_gpu(table, nodes, cluster, gpu_count(table))
    cell_bytes = bytes_per_cell(corr)
    holders = sorted_holders(corr, table)
    cell, node = corr.inc_cell[needs], table.node[corr.inc_slot[needs]]
    order = np.lexsort((node, cell))
    needs = needs[order].astype(np.int64)
    cell, node = cell[order].astype(np.int64), node[order]
    starts_group = np.r_[True, (cell[1:] != cell[:-1]) | (node[1:] != node[:-1])]
    receiver = np.flatnonzero(starts_group)  # the first need of each (cell, node) group
    group = np.cumsum(starts_group) - 1
    others = np.flatnonzero(~starts_group)
    sender = least_loaded_holders(cell[receiver], cell_bytes, holders, nic_bytes_per_s)
    ids = rows.add(cell=cell[receiver], stage=1, src=sender, dst=needs[receiver], parent=-1,
                   level=0)
    rows.add(cell=cell[others], stage=3, src=needs[receiver][group[others]], dst=needs[others],
             parent=ids[group[others]], level=1)
