"""The three-stage routes: the L, W and V cases of :mod:`wb.algorithms.planner`, step by step.

The needs of the routed cells are grouped by (cell, rollout node). Each group gets its cell at one
*receiver* (one of its needs), by a local copy (L), an NVLink send from a trainer on the node (W),
or over the node's NIC (V), from a trainer or from another node along a chain; the receiver then
forwards it to the group's other needs (stage 3).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from wb.algorithms.planner.facts import bytes_per_cell, gpu_count, is_member
from wb.algorithms.planner.holders import (Holders, least_loaded_holders, nic_bytes_per_s_by_gpu,
                                           sorted_holders)
from wb.algorithms.planner.routes import RouteRows
from wb.data.correspondence import Correspondence
from wb.data.layout import Cluster

#: How a group gets its cell (:attr:`NeedGroups.case`), best first: a GPU of the node holds and
#: needs it (L), a trainer on another GPU of the node holds it (W), nothing on the node has it (V).
LOCAL_COPY, HELD_ON_NODE, FROM_OUTSIDE = 0, 1, 2


class NeedGroups(NamedTuple):
    """The needs being routed, grouped by (cell, rollout node): a group is one node's need of
    one cell. Needs are sorted by group; inside a group, needs with a local copy come first
    (the first of them receives for the group), then by GPU."""

    needs: np.ndarray  # (n,) int64 need incidences (corr.inc_*)
    need_cell: np.ndarray  # (n,) int64 cell of each need
    need_gpu: np.ndarray  # (n,) int64 GPU of each need
    need_local: np.ndarray  # (n,) bool a trainer on the need's own GPU holds its cell
    need_group: np.ndarray  # (n,) int64 group of each need
    start: np.ndarray  # (g,) int64 first need of each group
    size: np.ndarray  # (g,) int64 needs in each group
    cell: np.ndarray  # (g,) int64 cell of each group (groups sort by cell)
    node: np.ndarray  # (g,) int64 node of each group
    case: np.ndarray  # (g,) int64 LOCAL_COPY, HELD_ON_NODE or FROM_OUTSIDE


class Arrivals(NamedTuple):
    """How each group's cell reaches the group; each step fills in the groups it serves."""

    receiver: np.ndarray  # (g,) int64 need incidence that gets the cell for its group; -1 not yet
    route: np.ndarray  # (g,) int64 route that delivers the cell to the receiver; -1 not yet
    level: np.ndarray  # (g,) int64 that route's forwarding depth

    @classmethod
    def unknown(cls, n_groups: int) -> Arrivals:
        """No group has a receiver or a route yet."""
        return cls(np.full(n_groups, -1, np.int64), np.full(n_groups, -1, np.int64),
                   np.zeros(n_groups, np.int64))


def add_three_stage_routes(rows: RouteRows, corr: Correspondence, table, nodes: list[str],
                           cluster: Cluster, chunk_bytes: int, needs: np.ndarray) -> None:
    """Adds to ``rows`` the three-stage routes that feed ``needs``.

    Args:
        rows: where the routes go.
        corr: the correspondence.
        table: ``slot_table(corr.slots, trainers, rollouts)[0]`` (:mod:`wb.data.plan`).
        nodes: node names, as ``slot_table`` returns them.
        cluster: the bandwidths, to balance the NICs.
        chunk_bytes: largest piece, in bytes (chains rotate their start every this many bytes).
        needs: ``(n,) int64`` need incidences to feed.
    """
    n_gpus = gpu_count(table)
    cell_bytes = bytes_per_cell(corr)
    holders = sorted_holders(corr, table)
    groups = group_needs(corr, table, len(nodes), holders, needs)
    arrivals = Arrivals.unknown(groups.start.size)
    copy_locally(rows, groups, holders, arrivals, n_gpus)
    send_on_node(rows, groups, holders, arrivals, len(nodes))
    # Every V group has its receiver before any chain is routed: a chain hop goes from one
    # group's receiver to the next's.
    outside = np.flatnonzero(groups.case == FROM_OUTSIDE)
    nic_bytes_per_s = nic_bytes_per_s_by_gpu(table, nodes, cluster, n_gpus)
    arrivals.receiver[outside] = pick_receivers(groups, outside, cell_bytes, nic_bytes_per_s)
    if outside.size:
        chain, starts_chain = chain_order(groups, outside, cell_bytes, chunk_bytes)
        feed_chain_heads(rows, groups, holders, arrivals, chain[starts_chain], cell_bytes,
                         nic_bytes_per_s)
        pass_along_chains(rows, groups, arrivals, chain, starts_chain)
    forward_in_node(rows, groups, arrivals)


def group_needs(corr: Correspondence, table, n_nodes: int, holders: Holders,
                needs: np.ndarray) -> NeedGroups:
    """Sorts ``needs`` into (cell, node) groups and tells how each group gets its cell."""
    n_gpus = gpu_count(table)
    cell, gpu = corr.inc_cell[needs], table.gpu[corr.inc_slot[needs]]
    node = table.node[corr.inc_slot[needs]]
    local = is_member(cell * n_gpus + gpu, holders.cell * n_gpus + holders.gpu)
    held_on_node = is_member(cell * n_nodes + node, holders.cell * n_nodes + holders.node)
    order = np.lexsort((gpu, ~local, node, cell))
    needs, cell, gpu, node = needs[order], cell[order], gpu[order], node[order]
    local, held_on_node = local[order], held_on_node[order]
    key = cell * n_nodes + node
    starts_group = np.r_[True, key[1:] != key[:-1]]
    start = np.flatnonzero(starts_group)
    # A group's first need is local if any is, and all its needs agree on being held on the node.
    case = np.where(local[start], LOCAL_COPY,
                    np.where(held_on_node[start], HELD_ON_NODE, FROM_OUTSIDE))
    return NeedGroups(needs=needs, need_cell=cell, need_gpu=gpu, need_local=local,
                      need_group=np.cumsum(starts_group) - 1, start=start,
                      size=np.diff(np.r_[start, needs.size]), cell=cell[start], node=node[start],
                      case=case)


def copy_locally(rows: RouteRows, groups: NeedGroups, holders: Holders, arrivals: Arrivals,
                 n_gpus: int) -> None:
    """L: every need whose own GPU holds its cell copies it there (stage 1, no link used)."""
    local = np.flatnonzero(groups.need_local)
    if not local.size:
        return
    holder_keys = holders.cell * n_gpus + holders.gpu  # ascending: holders sort by (cell, GPU)
    same_gpu = np.searchsorted(holder_keys,
                               groups.need_cell[local] * n_gpus + groups.need_gpu[local])
    ids = rows.add(cell=groups.need_cell[local], stage=1, src=holders.incidence[same_gpu],
                   dst=groups.needs[local], parent=-1, level=0)
    route_of_need = np.full(groups.needs.size, -1, np.int64)
    route_of_need[local] = ids
    served = np.flatnonzero(groups.case == LOCAL_COPY)
    first = groups.start[served]  # a local need: they lead their group
    arrivals.receiver[served] = groups.needs[first]
    arrivals.route[served] = route_of_need[first]


def send_on_node(rows: RouteRows, groups: NeedGroups, holders: Holders, arrivals: Arrivals,
                 n_nodes: int) -> None:
    """W: one NVLink send per group, from a holder on the node to one of the group's needs."""
    served = np.flatnonzero(groups.case == HELD_ON_NODE)
    if not served.size:
        return
    cell = groups.cell[served]
    by_node = np.lexsort((holders.node, holders.cell))
    holder_keys = (holders.cell * n_nodes + holders.node)[by_node]
    keys = cell * n_nodes + groups.node[served]
    first = np.searchsorted(holder_keys, keys, side="left")
    end = np.searchsorted(holder_keys, keys, side="right")
    # Sender and receiver rotate from cell to cell, to spread the sends over the node's GPUs.
    sender = holders.incidence[by_node[first + cell % (end - first)]]
    receiver = groups.needs[groups.start[served] + cell % groups.size[served]]
    arrivals.receiver[served] = receiver
    arrivals.route[served] = rows.add(cell=cell, stage=1, src=sender, dst=receiver, parent=-1,
                                      level=0)


def pick_receivers(groups: NeedGroups, outside: np.ndarray, cell_bytes: np.ndarray,
                   nic_bytes_per_s: np.ndarray) -> np.ndarray:
    """V: the need that takes each of the ``outside`` groups' cell in over its GPU's NIC.

    The only GPU of the group that needs the cell, or else the GPU whose NIC has taken in the
    fewest seconds so far, deciding the largest cells first. Returns ``(len(outside),) int64``
    need incidences.
    """
    seconds_in = np.zeros(nic_bytes_per_s.size, np.float64)
    first_gpu = groups.need_gpu[groups.start[outside]]
    # needs of a group sort by GPU: first and last on one GPU means the group is on one GPU
    one_gpu = first_gpu == groups.need_gpu[groups.start[outside] + groups.size[outside] - 1]
    receiver = groups.needs[groups.start[outside]]
    np.add.at(seconds_in, first_gpu[one_gpu],
              cell_bytes[groups.cell[outside[one_gpu]]] / nic_bytes_per_s[first_gpu[one_gpu]])
    several = np.flatnonzero(~one_gpu)
    largest_first = np.argsort(-cell_bytes[groups.cell[outside[several]]], kind="stable")
    for k in several[largest_first].tolist():
        group = outside[k]
        start = groups.start[group]
        candidates = groups.need_gpu[start:start + groups.size[group]]
        best = start + int(np.argmin(seconds_in[candidates]))
        receiver[k] = groups.needs[best]
        gpu = groups.need_gpu[best]
        seconds_in[gpu] += cell_bytes[groups.cell[group]] / nic_bytes_per_s[gpu]
    return receiver


def chain_order(groups: NeedGroups, outside: np.ndarray, cell_bytes: np.ndarray,
                chunk_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """V: the ``outside`` groups in chain order, one chain per cell, and where each chain starts.

    Each node of a chain forwards the cell to the next. The chain's first node rotates from block
    to block of consecutive cells, a piece's worth of bytes each: consecutive cells then go the
    same way and travel in one message (rotating per cell would cut large models into one
    message per small cell), while the blocks still spread the first hop over the nodes.
    Returns ``(chain, starts_chain)``: ``(v,) int64`` groups and ``(v,) bool``.
    """
    cell = groups.cell[outside]  # ascending
    position_in_cell = np.arange(outside.size) - np.searchsorted(cell, cell)
    n_in_cell = np.bincount(cell, minlength=cell_bytes.size)[cell]
    block = np.cumsum(cell_bytes) // max(int(chunk_bytes), 1)
    rotated = (position_in_cell - block[cell] % n_in_cell) % n_in_cell
    chain = outside[np.lexsort((rotated, cell))]
    chain_cell = groups.cell[chain]
    return chain, np.r_[True, chain_cell[1:] != chain_cell[:-1]]


def feed_chain_heads(rows: RouteRows, groups: NeedGroups, holders: Holders, arrivals: Arrivals,
                     heads: np.ndarray, cell_bytes: np.ndarray,
                     nic_bytes_per_s: np.ndarray) -> None:
    """V: the route into each chain's first node: from an L or W node of the cell if there is
    one (stage 2, rotating over them), else from the least busy trainer NIC (stage 1)."""
    on_node = np.flatnonzero(groups.case != FROM_OUTSIDE)
    on_node_cell = groups.cell[on_node]  # ascending
    has_on_node = is_member(groups.cell[heads], on_node_cell)
    from_node = heads[has_on_node]
    if from_node.size:
        cell = groups.cell[from_node]
        first = np.searchsorted(on_node_cell, cell, side="left")
        end = np.searchsorted(on_node_cell, cell, side="right")
        source = on_node[first + cell % (end - first)]
        # one hop after the source's own route, which is a level-0 local copy or NVLink send
        arrivals.route[from_node] = rows.add(cell=cell, stage=2, src=arrivals.receiver[source],
                                             dst=arrivals.receiver[from_node],
                                             parent=arrivals.route[source], level=1)
        arrivals.level[from_node] = 1
    from_trainer = heads[~has_on_node]
    if from_trainer.size:
        cell = groups.cell[from_trainer]
        sender = least_loaded_holders(cell, cell_bytes, holders, nic_bytes_per_s)
        arrivals.route[from_trainer] = rows.add(cell=cell, stage=1, src=sender,
                                                dst=arrivals.receiver[from_trainer], parent=-1,
                                                level=0)


def pass_along_chains(rows: RouteRows, groups: NeedGroups, arrivals: Arrivals, chain: np.ndarray,
                      starts_chain: np.ndarray) -> None:
    """V: stage 2 from each chain node's receiver to the next's, one depth at a time (a route
    forwards from one the depth before, which must have its id)."""
    rest = np.flatnonzero(~starts_chain)
    if not rest.size:
        return
    position = np.arange(chain.size)
    depth = position - np.maximum.accumulate(np.where(starts_chain, position, 0))
    for d in range(1, int(depth.max()) + 1):
        at = rest[depth[rest] == d]
        previous, current = chain[at - 1], chain[at]
        level = arrivals.level[previous] + 1
        arrivals.route[current] = rows.add(cell=groups.cell[current], stage=2,
                                           src=arrivals.receiver[previous],
                                           dst=arrivals.receiver[current],
                                           parent=arrivals.route[previous], level=level)
        arrivals.level[current] = level


def forward_in_node(rows: RouteRows, groups: NeedGroups, arrivals: Arrivals) -> None:
    """Stage 3: each group's receiver forwards the cell to the group's needs that have it from
    neither a local copy nor as the receiver."""
    receives = np.zeros(int(groups.needs.max(initial=-1)) + 1, bool)
    receives[arrivals.receiver] = True
    forwarded = np.flatnonzero(~groups.need_local & ~receives[groups.needs])
    if not forwarded.size:
        return
    group = groups.need_group[forwarded]
    rows.add(cell=groups.need_cell[forwarded], stage=3, src=arrivals.receiver[group],
             dst=groups.needs[forwarded], parent=arrivals.route[group],
             level=arrivals.level[group] + 1)
