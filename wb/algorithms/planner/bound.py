"""The traffic lower bound, and how far a plan's traffic is from it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from wb.algorithms.planner.facts import bytes_per_cell, gpu_count, is_member, sum_by_key
from wb.data.correspondence import Correspondence, correspond
from wb.data.layout import Layout
from wb.data.plan import Plan, Traffic, slot_table


def lower_bound(trainers: Sequence[Layout], rollouts: Sequence[Layout]) -> Traffic:
    """The least traffic any plan needs: trainer bytes M and bytes M_v into each rollout node.

    M_v: bytes of the ids some GPU of node v needs that no trainer on v holds (they must enter v
    over its NICs). M: for each id, one send if no rollout node has it on the node (held by a
    trainer there), plus one NVLink send into each node where a trainer on another GPU holds it
    and no GPU both holds and needs it; ids a GPU needs and holds itself (colocated) cost nothing.
    Without colocation M is simply the bytes of all needed ids.

    Args:
        trainers: trainer layouts, as for :func:`~wb.algorithms.planner.plan`.
        rollouts: rollout layouts, as for :func:`~wb.algorithms.planner.plan`.

    Returns:
        A :class:`wb.Traffic`: ``trainer_out`` splits M evenly over each id's holders (one
        balanced assignment), ``node_in`` is M_v per node; ``node_out`` and ``intra_node`` are
        empty (no per-node minimum is defined for them).
    """
    trainers, rollouts = tuple(trainers), tuple(rollouts)
    corr = correspond(trainers, rollouts)
    table, nodes = slot_table(corr.slots, trainers, rollouts)
    parts = bound_parts(corr, table, nodes)
    holders = np.flatnonzero(table.role[corr.inc_slot] == 0)
    holder_cell = corr.inc_cell[holders]
    cell_total = parts["sends"] * parts["cell_bytes"]
    n_holders = np.bincount(holder_cell, minlength=corr.cell_id0.size)
    share = np.where(n_holders > 0, cell_total // np.maximum(n_holders, 1), 0)
    remainder = cell_total - share * n_holders
    # the first holder of a cell (incidences run cell by cell) also sends what does not divide
    first_of_cell = np.r_[True, holder_cell[1:] != holder_cell[:-1]]
    amount = share[holder_cell] + np.where(first_of_cell, remainder[holder_cell], 0)
    trainer_out = {int(lay.worker.rank): 0 for lay in trainers}
    for rank, sent in zip(*sum_by_key(table.rank[corr.inc_slot[holders]], amount)):
        trainer_out[int(rank)] += int(sent)
    return Traffic(trainer_out, parts["node_in"], {}, {})


def bound_parts(corr: Correspondence, tab, nodes: list[str]) -> dict:
    """The parts of the bound, per cell and per node.

    Args:
        corr: the correspondence of a plan's layouts.
        tab: ``slot_table(corr.slots, ...)[0]``.
        nodes: node names, as ``slot_table`` returns them.

    Returns:
        ``{"cell_bytes", "sends", "offnode"}``: per cell, ``(c,)`` arrays of its bytes, the
        trainer sends the bound requires and whether it must leave the trainers' nodes over a
        NIC; ``"node_in"``: ``{node: M_v}``.
    """
    role = tab.role[corr.inc_slot]
    n_gpus = gpu_count(tab)
    n_nodes = len(nodes)
    n_cells = corr.cell_id0.size
    cell_bytes = bytes_per_cell(corr)
    holders, needs = np.flatnonzero(role == 0), np.flatnonzero(role == 1)
    holder_cell, need_cell = corr.inc_cell[holders], corr.inc_cell[needs]
    holder_gpu, need_gpu = tab.gpu[corr.inc_slot[holders]], tab.gpu[corr.inc_slot[needs]]
    holder_node, need_node = tab.node[corr.inc_slot[holders]], tab.node[corr.inc_slot[needs]]
    local = is_member(need_cell * n_gpus + need_gpu, holder_cell * n_gpus + holder_gpu)
    on_node = is_member(need_cell * n_nodes + need_node, holder_cell * n_nodes + holder_node)
    # one group per (cell, node) that needs it: the node's cases L, W and V
    groups, group_of_need = np.unique(need_cell * n_nodes + need_node, return_inverse=True)
    group_local = np.zeros(groups.size, bool)
    np.logical_or.at(group_local, group_of_need, local)
    group_on_node = np.zeros(groups.size, bool)
    np.logical_or.at(group_on_node, group_of_need, on_node)
    group_cell, group_node = groups // n_nodes, groups % n_nodes
    from_outside = ~group_on_node
    nvlink_send = group_on_node & ~group_local
    held_on_a_node = np.zeros(n_cells, bool)
    held_on_a_node[group_cell[~from_outside]] = True
    needed_outside = np.zeros(n_cells, bool)
    needed_outside[group_cell[from_outside]] = True
    offnode = needed_outside & ~held_on_a_node
    sends = np.bincount(group_cell[nvlink_send], minlength=n_cells) + offnode
    node_in = {nodes[i]: int(v)
               for i, v in zip(*sum_by_key(group_node[from_outside],
                                           cell_bytes[group_cell[from_outside]])) if v}
    return {"cell_bytes": cell_bytes, "sends": sends, "offnode": offnode, "node_in": node_in}


def traffic_ratio(plan: Plan) -> float:
    """How far a plan's traffic is from :func:`lower_bound`.

    Args:
        plan: a plan (from :func:`~wb.algorithms.planner.plan` or a baseline).

    Returns:
        The largest of trainer bytes / M and node_in[v] / M_v over all nodes v: 1.0 is the
        bound, ``inf`` where a plan sends bytes the bound says need not move.
    """
    tab, nodes = plan.table
    parts = bound_parts(plan.corr, tab, nodes)
    traffic = plan.traffic()
    M = int((parts["sends"] * parts["cell_bytes"]).sum())
    ratios = [traffic.trainer_total / M if M else (1.0 if traffic.trainer_total == 0
                                                   else float("inf"))]
    for v in set(traffic.node_in) | set(parts["node_in"]):
        got, need = traffic.node_in.get(v, 0), parts["node_in"].get(v, 0)
        if need or got:
            ratios.append(got / need if need else float("inf"))
    return float(max(ratios))
