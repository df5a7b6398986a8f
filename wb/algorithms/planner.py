"""The three-stage planner: every needed byte leaves the trainers once and enters each node once.

Long because routing, piece cutting and the lower bound share per-cell helpers and one data flow.

For every cell of the correspondence (a set of ids with all its holders and needs), per rollout node
that needs it, one of three cases holds:

- **L** (local): a GPU of the node hosts both a trainer holding the cell and a rollout needing it: a
  local copy, no link used.
- **W** (held on the node): a trainer on another GPU of the node holds it: one NVLink send.
- **V** (from outside): nothing on the node has it: the node receives it exactly once over a NIC,
  either from a trainer (stage 1, for the first such node when no L/W node exists) or from another
  rollout node that already has it (stage 2).

Inside a node the receiving GPU forwards to the node's other GPUs that need the cell (stage 3).
The V nodes of a cell form a chain (each forwards to the next), with the chain's start rotating
from cell to cell so every node forwards about as much as it receives. Choices that balance load:
the trainer replica that sends (least-loaded NIC first, largest cells first), and the receiving GPU
of a node when several GPUs need the cell (least-loaded NIC in). Cells are then cut into pieces
of at most ``chunk_bytes`` that follow their cell's route, so forwarding starts as soon as a
piece lands; pieces are packed into messages per pair of ranks.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from wb.data.conversions import ITEMSIZE
from wb.data.correspondence import Correspondence, correspond
from wb.errors import PlanError
from wb.data.layout import Cluster, Layout
from wb.data.plan import Messages, Pieces, Plan, Traffic, Transfers, slot_table

__all__ = ["plan", "lower_bound", "plan_from_routes", "Routes", "DEFAULT_CHUNK_BYTES"]

#: Piece size: large enough that per-message costs vanish, small enough to pipeline stages.
DEFAULT_CHUNK_BYTES = 8 << 20
#: Contiguous ranges smaller than this travel packed with others of their pair of ranks, not each
#: in a message of its own: a message costs tens of microseconds, more than such a range's bytes.
SMALL_RUN_BYTES = 1 << 20


class Routes(NamedTuple):
    """How every needed cell travels: one row per route, a hop of one whole cell. Incidences
    index ``corr.inc_*`` (:class:`~wb.data.correspondence.Correspondence`): holders are trainer
    buffers, needs rollout buffers; a forwarded route starts at a need an earlier one filled."""

    cell: np.ndarray  # (r,) int64 cell of the correspondence
    stage: np.ndarray  # (r,) int64 1: from a trainer (or local copy), 2: node to node, 3: in a node
    src: np.ndarray  # (r,) int64 source incidence (holder, or an earlier route's destination)
    dst: np.ndarray  # (r,) int64 destination need incidence
    parent: np.ndarray  # (r,) int64 route that must deliver to ``src`` first; -1: none
    level: np.ndarray  # (r,) int64 forwarding depth: 0 without parent, else the parent's + 1


def plan(trainers: Sequence[Layout], rollouts: Sequence[Layout], cluster: Cluster | None = None,
         *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, apart: Collection[int] = ()) -> Plan:
    """Plans the transfer of every id the rollouts need, at the traffic lower bound.

    Args:
        trainers: trainer layouts (buffers hold ids); several may hold the same id (replicas).
        rollouts: rollout layouts (buffers need ids). Nodes come from ``Worker.node``; a trainer
            and a rollout with the same node and ``local_rank`` share a GPU.
        cluster: bandwidths (default :class:`wb.Cluster`): used to balance and to simulate.
        chunk_bytes: largest piece, in bytes.
        apart: rollout ranks *fed apart*: each receives everything it needs from the trainers
            (stage 1) and forwards nothing, and the others' routes are planned as if it were not
            there, so nobody waits for it (a rollout's first version after joining a running
            job). In the plan each is a node of its own (``"<node>~apart<rank>"``), as
            ``traffic()`` and ``verify()`` count it: bytes into every node stay at the bound,
            and the trainers send what the ranks fed apart need once more (above ``M``).

    Returns:
        A :class:`wb.Plan` whose ``traffic()`` equals :func:`lower_bound` (trainer bytes = M,
        bytes into each node = M_v).

    Raises:
        PlanError: an id needed by a rollout is held by no trainer, dtypes disagree, the
            rollouts need no id at all (no rollouts, no buffers, or maps that are all ``-1``),
            or ``apart`` names a rank that is no rollout.

    Examples:
        >>> import numpy as np, wb
        >>> w = np.arange(64).reshape(8, 8)
        >>> t = wb.Layout(wb.Worker(0, "t", "trainer"), {"w": wb.BufferSpec(wb.SourceMap.from_indices(w), "float32")})
        >>> r = [wb.Layout(wb.Worker(1 + i, f"r{i}", "rollout"), {"w": wb.BufferSpec(wb.SourceMap.from_indices(w[:, :4]), "float32")}) for i in range(2)]
        >>> p = wb.plan([t], r)
        >>> p.verify(); p.traffic().trainer_out, p.traffic().node_in
        ({0: 128}, {'r0': 128, 'r1': 128})
    """
    if chunk_bytes < 1:
        raise PlanError(f"chunk_bytes must be positive, got {chunk_bytes}")
    cluster = cluster or Cluster()
    trainers, rollouts = tuple(trainers), tuple(rollouts)
    if apart:
        rollouts = _fed_apart(rollouts, apart)
    corr = correspond(trainers, rollouts)
    tab, nodes = slot_table(corr.slots, trainers, rollouts)
    if not (tab.role[corr.inc_slot] == 1).any():
        # An empty plan would make every update a silent no-op: the symptom of a probe that found
        # nothing (or of layouts built from the wrong model), which is what a user must hear about.
        why = ("no rollout layouts were given" if not rollouts else
               "no rollout layout lists a buffer" if not any(r.buffers for r in rollouts) else
               "every rollout buffer's source map is -1 (holds no checkpoint id)")
        raise PlanError(f"the rollouts need no checkpoint id ({why}), so there is nothing to "
                        f"plan; probe the rollout model with the checkpoint's spec and pass its "
                        f"layouts as `rollouts`")
    routed = ([i for i, n in enumerate(nodes) if APART in n] if apart else [])
    routes = _route(corr, tab, nodes, cluster, chunk_bytes, apart_nodes=routed)
    return plan_from_routes(trainers, rollouts, routes, corr=corr, table=tab, cluster=cluster,
                            chunk_bytes=chunk_bytes)


def plan_from_routes(trainers: Sequence[Layout], rollouts: Sequence[Layout], routes: Routes, *,
                     corr: Correspondence, table, cluster: Cluster | None = None,
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Plan:
    """The plan that moves every needed cell along ``routes``: cells cut into pieces of at most
    ``chunk_bytes`` that follow their cell's routes, packed into messages per pair of ranks.
    :func:`plan` passes its three-stage routes; the baselines of ``wb bench`` their own.

    Args:
        trainers: trainer layouts, as for :func:`plan`.
        rollouts: rollout layouts, as for :func:`plan`.
        routes: how each needed cell travels; every need incidence must be the destination of
            exactly one route (the plan's ``verify()`` checks the result).
        corr: ``correspond(trainers, rollouts)``.
        table: ``slot_table(corr.slots, trainers, rollouts)[0]`` (:mod:`wb.data.plan`).
        cluster: bandwidths (default :class:`wb.Cluster`).
        chunk_bytes: largest piece, in bytes.

    Returns:
        The :class:`wb.Plan`.

    Raises:
        PlanError: ``chunk_bytes`` is not positive.
    """
    if chunk_bytes < 1:
        raise PlanError(f"chunk_bytes must be positive, got {chunk_bytes}")
    pieces = _cut(corr, table, chunk_bytes)
    transfers, messages = _expand(corr, table, routes, pieces, chunk_bytes)
    return Plan(tuple(trainers), tuple(rollouts), cluster or Cluster(), int(chunk_bytes), corr,
                pieces, transfers, messages)


# --- per-cell facts -----------------------------------------------------------------------------

def _cell_itemsize(corr: Correspondence, tab) -> np.ndarray:
    """Bytes per element of each cell as it travels (its dtype after any conversion)."""
    return ITEMSIZE[corr.cell_dtype]


def _key_in(keys: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Whether each key is in ``table`` (both int64)."""
    t = np.unique(table)
    if t.size == 0:
        return np.zeros(keys.size, bool)
    pos = np.minimum(np.searchsorted(t, keys), t.size - 1)
    return t[pos] == keys


#: What marks the node of a rollout fed apart (see :func:`plan`'s ``apart``).
APART = "~apart"


def _fed_apart(rollouts: tuple[Layout, ...], apart: Collection[int]) -> tuple[Layout, ...]:
    """``rollouts`` with each rank of ``apart`` on a node of its own."""
    ranks = {int(r) for r in apart}
    known = {lay.worker.rank for lay in rollouts}
    if ranks - known:
        raise PlanError(f"apart={sorted(ranks - known)} are not rollout ranks of this plan "
                        f"(rollouts: {sorted(known)[:8]}...)")
    return tuple(
        Layout(replace(lay.worker, node=f"{lay.worker.node}{APART}{lay.worker.rank}"),
               lay.buffers) if lay.worker.rank in ranks else lay for lay in rollouts)


def _route(corr: Correspondence, tab, nodes: list[str], cluster: Cluster, chunk_bytes: int, *,
           apart_nodes: Sequence[int] = ()) -> Routes:
    """The routes of every needed cell: three stages for the needs of every node but
    ``apart_nodes``, whose needs each come from a trainer (stage 1), forwarded to nobody."""
    N = np.flatnonzero(tab.role[corr.inc_slot] == 1)
    fed = np.isin(tab.node[corr.inc_slot[N]], np.asarray(apart_nodes, np.int64))
    parts = []
    if (~fed).any():
        parts.append(_three_stages(corr, tab, nodes, cluster, chunk_bytes, N[~fed]))
    if fed.any():
        first = parts[0].cell.size if parts else 0  # its routes' ids follow the others'
        parts.append(_from_trainers(corr, tab, nodes, cluster, N[fed], first))
    return Routes(*(np.concatenate([getattr(p, k) for p in parts]) for k in Routes._fields))


def _holders(corr: Correspondence, tab):
    """Holder incidences and their cells, GPUs and nodes, sorted by (cell, GPU)."""
    H = np.flatnonzero(tab.role[corr.inc_slot] == 0)
    h_cell, h_gpu, h_node = corr.inc_cell[H], tab.gpu[corr.inc_slot[H]], tab.node[corr.inc_slot[H]]
    order = np.lexsort((h_gpu, h_cell))
    return H[order], h_cell[order], h_gpu[order], h_node[order]


def _from_trainers(corr: Correspondence, tab, nodes: list[str], cluster: Cluster, N: np.ndarray,
                   first: int) -> Routes:
    """Routes of need incidences ``N`` on nodes fed apart (route ids from ``first``): per cell
    and node, one stage-1 route from a holder (the least-loaded trainer NIC, largest cells
    first) to one of its needs, then stage 3 from that one to the others (several buffers of a
    rank needing the same cell); nothing leaves the node."""
    n_gpus = int(tab.gpu.max(initial=-1)) + 1
    cell_bytes = corr.cell_numel * _cell_itemsize(corr, tab)
    H, h_cell, h_gpu, _ = _holders(corr, tab)
    cell, node = corr.inc_cell[N], tab.node[corr.inc_slot[N]]
    order = np.lexsort((node, cell))
    N, cell, node = N[order].astype(np.int64), cell[order].astype(np.int64), node[order]
    head = np.r_[True, (cell[1:] != cell[:-1]) | (node[1:] != node[:-1])]
    h = np.flatnonzero(head)
    src = _pick_holders(cell[h], cell_bytes, H, h_cell, h_gpu, tab, nodes, cluster, n_gpus)
    group = np.cumsum(head) - 1  # each need's (cell, node) group: its head's index in h
    rest = np.flatnonzero(~head)
    n_h = h.size
    return Routes(
        np.r_[cell[h], cell[rest]],
        np.r_[np.ones(n_h, np.int64), np.full(rest.size, 3, np.int64)],
        np.r_[src.astype(np.int64), N[h][group[rest]]],
        np.r_[N[h], N[rest]],
        np.r_[np.full(n_h, -1, np.int64), first + group[rest]],
        np.r_[np.zeros(n_h, np.int64), np.ones(rest.size, np.int64)])


def _three_stages(corr: Correspondence, tab, nodes: list[str], cluster: Cluster,
                  chunk_bytes: int, N: np.ndarray) -> Routes:
    """The three-stage routes of the cells of need incidences ``N`` (the module docstring's L,
    W and V cases)."""
    n_cells = corr.cell_id0.size
    n_gpus = int(tab.gpu.max(initial=-1)) + 1
    n_nodes = len(nodes)
    cell_bytes = corr.cell_numel * _cell_itemsize(corr, tab)
    H, h_cell, h_gpu, h_node = _holders(corr, tab)  # sorted by (cell, GPU), for lookups
    n_cell, n_gpu, n_node = corr.inc_cell[N], tab.gpu[corr.inc_slot[N]], tab.node[corr.inc_slot[N]]
    local = _key_in(n_cell * n_gpus + n_gpu, h_cell * n_gpus + h_gpu)
    held_on_node = _key_in(n_cell * n_nodes + n_node, h_cell * n_nodes + h_node)
    # Group needs by (cell, node); within a group local needs first, then by GPU.
    order = np.lexsort((n_gpu, ~local, n_node, n_cell))
    N, n_cell, n_gpu, n_node = N[order], n_cell[order], n_gpu[order], n_node[order]
    local, held_on_node = local[order], held_on_node[order]
    gkey = n_cell * n_nodes + n_node
    g_start = np.flatnonzero(np.r_[True, gkey[1:] != gkey[:-1]])
    g_of = np.cumsum(np.r_[True, gkey[1:] != gkey[:-1]]) - 1  # group of each need (sorted)
    n_groups = g_start.size
    g_cell, g_node = n_cell[g_start], n_node[g_start]
    g_cls = np.where(local[g_start], 0, np.where(held_on_node[g_start], 1, 2))  # L, W, V
    g_size = np.diff(np.r_[g_start, N.size])

    routes = {k: [] for k in ("cell", "stage", "src", "dst", "parent", "level")}
    rid = [0]

    def add(cell, stage, src, dst, parent, level) -> np.ndarray:
        n = np.asarray(cell).size
        for k, v in zip(("cell", "stage", "src", "dst", "parent", "level"),
                        (cell, stage, src, dst, parent, level)):
            routes[k].append(np.broadcast_to(np.asarray(v, np.int64), (n,)).copy())
        ids = np.arange(rid[0], rid[0] + n)
        rid[0] += n
        return ids

    hkey_gpu = h_cell * n_gpus + h_gpu

    # Receiving need incidence of each group, and how it got the cell (route id).
    g_recv = np.full(n_groups, -1, np.int64)
    g_route = np.full(n_groups, -1, np.int64)
    g_level = np.zeros(n_groups, np.int64)
    # L: every local need gets a local copy from a same-GPU holder; the first is the receiver.
    loc = np.flatnonzero(local)
    if loc.size:
        pos = np.searchsorted(hkey_gpu, n_cell[loc] * n_gpus + n_gpu[loc])
        rids = add(n_cell[loc], 1, H[pos], N[loc], -1, 0)
        first = g_start[g_cls == 0]
        g_recv[g_cls == 0] = N[first]
        route_of_need = np.full(N.size, -1, np.int64)
        route_of_need[loc] = rids
        g_route[g_cls == 0] = route_of_need[first]
    # W: one NVLink send from a holder on the node (rotating over them) to one need of the group.
    w = np.flatnonzero(g_cls == 1)
    if w.size:
        node_order = np.lexsort((h_node, h_cell))
        hk = (h_cell * n_nodes + h_node)[node_order]
        lo = np.searchsorted(hk, g_cell[w] * n_nodes + g_node[w], side="left")
        hi = np.searchsorted(hk, g_cell[w] * n_nodes + g_node[w], side="right")
        pick = node_order[lo + g_cell[w] % (hi - lo)]
        recv = N[g_start[w] + g_cell[w] % g_size[w]]
        g_recv[w] = recv
        g_route[w] = add(g_cell[w], 1, H[pick], recv, -1, 0)
    # V: the receiving GPU balances NIC ingress; forced when one GPU needs it, else least loaded.
    v = np.flatnonzero(g_cls == 2)
    nic_in = np.zeros(n_gpus, np.float64)
    bw_in = np.array([cluster.nic_bytes_per_s(nodes[n]) for n in _gpu_nodes(tab, n_gpus)])
    if v.size:
        last_gpu = n_gpu[g_start[v] + g_size[v] - 1]
        single = n_gpu[g_start[v]] == last_gpu
        sv = v[single]
        g_recv[sv] = N[g_start[sv]]
        np.add.at(nic_in, n_gpu[g_start[sv]], cell_bytes[g_cell[sv]] / bw_in[n_gpu[g_start[sv]]])
        multi = v[~single]
        for g in multi[np.argsort(-cell_bytes[g_cell[multi]], kind="stable")].tolist():
            s, e = g_start[g], g_start[g] + g_size[g]
            cand = n_gpu[s:e]
            best = s + int(np.argmin(nic_in[cand]))
            g_recv[g] = N[best]
            nic_in[n_gpu[best]] += cell_bytes[g_cell[g]] / bw_in[n_gpu[best]]
    # Chains over each cell's V groups; the chain starts at an L/W group if the cell has one.
    if v.size:
        vc = g_cell[v]
        pos_in_cell = np.arange(v.size) - np.searchsorted(vc, vc)
        n_in_cell = np.bincount(vc, minlength=n_cells)[vc]
        # Rotate the chain's first node from block to block of consecutive cells, a piece's worth
        # of bytes each: consecutive cells then go the same way and travel in one message
        # (rotating per cell cut large models into one message per small cell), while the
        # blocks still spread the first hop over the nodes.
        block = np.cumsum(cell_bytes) // max(int(chunk_bytes), 1)
        rot = (pos_in_cell - block[vc] % n_in_cell) % n_in_cell
        chain = v[np.lexsort((rot, vc))]
        cc = g_cell[chain]
        head = np.r_[True, cc[1:] != cc[:-1]]
        # Sources of chain heads: an L/W group's receiver (rotating), else a trainer (stage 1).
        lw = np.flatnonzero(g_cls != 2)
        lw_cells = g_cell[lw]
        heads = chain[head]
        has_lw = _key_in(g_cell[heads], lw_cells)
        # from a rollout node that already has it (stage 2)
        hl = heads[has_lw]
        if hl.size:
            lo = np.searchsorted(lw_cells, g_cell[hl], side="left")
            hi = np.searchsorted(lw_cells, g_cell[hl], side="right")
            src_g = lw[lo + g_cell[hl] % (hi - lo)]
            g_route[hl] = add(g_cell[hl], 2, g_recv[src_g], g_recv[hl], g_route[src_g], 1)
            g_level[hl] = 1
        # from a trainer (stage 1): the least-loaded holder NIC, largest cells first
        ht = heads[~has_lw]
        if ht.size:
            src_h = _pick_holders(g_cell[ht], cell_bytes, H, h_cell, h_gpu, tab, nodes, cluster,
                                  n_gpus)
            g_route[ht] = add(g_cell[ht], 1, src_h, g_recv[ht], -1, 0)
        # the rest of each chain: stage 2 from the previous node's receiver, level by level
        rest = np.flatnonzero(~head)
        if rest.size:
            depth = np.arange(chain.size) - np.maximum.accumulate(np.where(head, np.arange(chain.size), 0))
            for d in range(1, int(depth.max()) + 1):
                at = rest[depth[rest] == d]
                prev = chain[at - 1]
                cur = chain[at]
                g_route[cur] = add(g_cell[cur], 2, g_recv[prev], g_recv[cur], g_route[prev],
                                   g_level[prev] + 1)
                g_level[cur] = g_level[prev] + 1
    # Stage 3: inside every group, the receiver forwards to the group's other needs (L groups:
    # to the needs without a local copy).
    is_recv = np.zeros(corr.inc_cell.size, bool)
    is_recv[g_recv] = True
    fwd = np.flatnonzero(~local & ~is_recv[N])  # local needs were served by local copies
    if fwd.size:
        g = g_of[fwd]
        add(n_cell[fwd], 3, g_recv[g], N[fwd], g_route[g], g_level[g] + 1)
    out = {k: np.concatenate(v) if v else np.zeros(0, np.int64) for k, v in routes.items()}
    if (out["parent"][out["stage"] != 1] < 0).any():
        raise PlanError("internal: a forward without a parent route")
    return Routes(**out)


def _gpu_nodes(tab, n_gpus: int) -> np.ndarray:
    node_of_gpu = np.zeros(n_gpus, np.int64)
    node_of_gpu[tab.gpu] = tab.node
    return node_of_gpu


def _pick_holders(cells, cell_bytes, H, h_cell, h_gpu, tab, nodes, cluster, n_gpus) -> np.ndarray:
    """For each cell (sent by a trainer over its NIC), the holder incidence whose GPU's egress is
    least loaded, deciding the largest cells first (LPT)."""
    bw = np.array([cluster.nic_bytes_per_s(nodes[n]) for n in _gpu_nodes(tab, n_gpus)])
    load = np.zeros(n_gpus, np.float64)
    lo = np.searchsorted(h_cell, cells, side="left")
    hi = np.searchsorted(h_cell, cells, side="right")
    if (hi <= lo).any():
        raise PlanError("internal: a needed cell without holders passed the correspondence check")
    out = H[lo].copy()
    gpus_lo = h_gpu[lo]
    gpus_hi = h_gpu[hi - 1]
    forced = gpus_lo == gpus_hi  # one trainer GPU holds it (maybe in several buffers)
    np.add.at(load, gpus_lo[forced], cell_bytes[cells[forced]] / bw[gpus_lo[forced]])
    free = np.flatnonzero(~forced)
    for k in free[np.argsort(-cell_bytes[cells[free]], kind="stable")].tolist():
        cand = h_gpu[lo[k]:hi[k]]
        j = lo[k] + int(np.argmin(load[cand]))
        out[k] = H[j]
        load[h_gpu[j]] += cell_bytes[cells[k]] / bw[h_gpu[j]]
    return out


# --- pieces and transfers -----------------------------------------------------------------------

def _cut(corr: Correspondence, tab, chunk_bytes: int) -> Pieces:
    """Cuts every needed cell into pieces of at most ``chunk_bytes`` (whole rows when they fit)."""
    need = tab.role[corr.inc_slot] == 1
    cells = np.unique(corr.inc_cell[need])
    item = _cell_itemsize(corr, tab)[cells]
    na, nb = corr.cell_na[cells], corr.cell_nb[cells]
    row_bytes = nb * item
    cols_per = np.where(row_bytes > chunk_bytes, np.maximum(1, chunk_bytes // item), nb)
    rows_per = np.where(row_bytes > chunk_bytes, 1, np.maximum(1, chunk_bytes // row_bytes))
    n_r = -(-na // rows_per)
    n_c = -(-nb // cols_per)
    count = n_r * n_c
    c = np.repeat(np.arange(cells.size), count)
    k = np.arange(c.size) - np.repeat(np.cumsum(count) - count, count)
    ri, ci = np.divmod(k, n_c[c])
    i0 = ri * rows_per[c]
    j0 = ci * cols_per[c]
    pna = np.minimum(rows_per[c], na[c] - i0)
    pnb = np.minimum(cols_per[c], nb[c] - j0)
    return Pieces(cells[c], i0, j0, pna, pnb, pna * pnb * item[c], corr.cell_dtype[cells[c]])


def _expand(corr: Correspondence, tab, routes: Routes, pieces: Pieces, chunk_bytes: int
            ) -> tuple[Transfers, Messages]:
    """Routes x pieces -> transfers in execution order, grouped into messages."""
    n_cells = corr.cell_id0.size
    per_cell = np.bincount(pieces.cell, minlength=n_cells)
    first_piece = np.r_[0, np.cumsum(per_cell)[:-1]]  # pieces are sorted by cell
    r_cell = routes.cell
    cnt = per_cell[r_cell]
    r = np.repeat(np.arange(r_cell.size), cnt)
    k = np.arange(r.size) - np.repeat(np.cumsum(cnt) - cnt, cnt)  # piece number within the cell
    piece = first_piece[r_cell[r]] + k
    # transfer index of (route, k): routes expand in route order
    route_first = np.r_[0, np.cumsum(cnt)[:-1]]
    parent_route = routes.parent[r]
    after = np.where(parent_route >= 0, route_first[np.maximum(parent_route, 0)] + k, -1)
    level = routes.level[r]
    src_inc, dst_inc = routes.src[r], routes.dst[r]
    stage = routes.stage[r].astype(np.int8)
    src_slot, dst_slot = corr.inc_slot[src_inc], corr.inc_slot[dst_inc]
    i0, j0 = pieces.i0[piece], pieces.j0[piece]
    nbytes = pieces.nbytes[piece]
    src_rank, dst_rank = tab.rank[src_slot], tab.rank[dst_slot]
    dst_f0 = corr.inc_f0[dst_inc] + i0 * corr.inc_fa[dst_inc] + j0 * corr.inc_fb[dst_inc]
    # Messages, level by level (a forwarded message needs its parent's id). Within one pair of
    # ranks, pieces go in destination-buffer order: consecutive pieces then often form one
    # contiguous range of the buffer, which the executor receives without staging.
    n_t = r.size
    message = np.full(n_t, -1, np.int64)
    m_parent: list[np.ndarray] = []
    next_id = 0
    order_chunks = []
    for lv in range(int(level.max(initial=-1)) + 1):
        at = np.flatnonzero(level == lv)
        if lv == 0:
            key_order = np.lexsort((dst_f0[at], dst_slot[at], dst_rank[at], src_rank[at]))
            at = at[key_order]
            pair = src_rank[at] * (int(dst_rank.max(initial=0)) + 1) + dst_rank[at]
            cut = np.r_[True, pair[1:] != pair[:-1]]
            parent = np.full(at.size, -1, np.int64)
        else:
            pm = message[after[at]]
            key_order = np.lexsort((dst_f0[at], dst_slot[at], dst_rank[at], pm))
            at = at[key_order]
            pm = pm[key_order]
            cut = np.r_[True, (pm[1:] != pm[:-1]) | (dst_rank[at][1:] != dst_rank[at][:-1])]
            parent = pm
        at, cut, parent = _pack_small(at, cut, parent, piece, pieces, dst_slot, dst_f0,
                                      tab.dtype[dst_slot], nbytes)
        csum = np.cumsum(nbytes[at]) - nbytes[at]
        base = np.maximum.accumulate(np.where(cut, csum, 0))
        bucket = (csum - base) // chunk_bytes
        new = cut | np.r_[True, bucket[1:] != bucket[:-1]]
        mid = next_id + np.cumsum(new) - 1
        message[at] = mid
        m_parent.append(parent[new])
        next_id += int(new.sum())
        order_chunks.append(at)
    order = np.concatenate(order_chunks) if order_chunks else np.zeros(0, np.int64)
    inv = np.empty(n_t, np.int64)
    inv[order] = np.arange(n_t)
    after_o = after[order]
    after_o = np.where(after_o >= 0, inv[np.maximum(after_o, 0)], -1)
    msg_o = message[order]
    T = Transfers(
        stage[order], piece[order],
        src_slot[order], (corr.inc_f0[src_inc] + i0 * corr.inc_fa[src_inc] + j0 * corr.inc_fb[src_inc])[order],
        corr.inc_fa[src_inc][order], corr.inc_fb[src_inc][order],
        dst_slot[order], dst_f0[order],
        corr.inc_fa[dst_inc][order], corr.inc_fb[dst_inc][order],
        after_o, msg_o, src_inc[order], dst_inc[order])
    n_m = next_id
    first = np.searchsorted(msg_o, np.arange(n_m))
    count = np.bincount(msg_o, minlength=n_m)
    M = Messages(T.stage[first], src_rank[order][first], dst_rank[order][first],
                 np.bincount(msg_o, weights=nbytes[order], minlength=n_m).astype(np.int64),
                 np.concatenate(m_parent) if m_parent else np.zeros(0, np.int64), first, count)
    return T, M


def _pack_small(at, group_cut, parent, piece, pieces: Pieces, dst_slot, dst_f0, dst_dtype, nbytes
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where messages end within one group of transfers (a pair of ranks, or a parent and a
    destination rank), ``at`` in destination order: returns ``(at, cut, parent)`` reordered.

    A message ends where the destination stops being one contiguous range (another buffer, or a
    gap): such a message is received in place, without staging. Ranges of less than
    :data:`SMALL_RUN_BYTES` would each cost a message of their own (a scale tensor per expert, a
    bias, a norm: thousands per rank where each costs more than its bytes), so they go after the
    group's large ranges, packed together into staged messages of one travelling and one
    destination dtype (a message packs and unpacks aligned in one of each)."""
    n_el = (pieces.na * pieces.nb)[piece[at]]
    wire, ddt = pieces.dtype[piece[at]], dst_dtype[at]
    run_cut = group_cut.copy()
    run_cut[1:] |= (dst_slot[at][1:] != dst_slot[at][:-1]) | (
        dst_f0[at][1:] != dst_f0[at][:-1] + n_el[:-1]) | (wire[1:] != wire[:-1])
    run = np.cumsum(run_cut) - 1
    small = (np.bincount(run, weights=nbytes[at]) < SMALL_RUN_BYTES)[run]
    group = np.cumsum(group_cut) - 1
    order = np.lexsort((np.arange(at.size), np.where(small, ddt, -1), np.where(small, wire, -1),
                        small, group))
    at, run_cut, parent = at[order], run_cut[order], parent[order]
    small, wire, ddt, group = small[order], wire[order], ddt[order], group[order]
    cut = np.where(small, False, run_cut)
    cut[1:] |= (group[1:] != group[:-1]) | (small[1:] != small[:-1]) | (wire[1:] != wire[:-1]) | (
        ddt[1:] != ddt[:-1])
    cut[:1] = True
    return at, cut, parent


# --- the bound ----------------------------------------------------------------------------------

def lower_bound(trainers: Sequence[Layout], rollouts: Sequence[Layout]) -> Traffic:
    """The least traffic any plan needs: trainer bytes M and bytes M_v into each rollout node.

    M_v: bytes of the ids some GPU of node v needs that no trainer on v holds (they must enter v
    over its NICs). M: for each id, one send if no rollout node has it on the node (held by a
    trainer there), plus one NVLink send into each node where a trainer on another GPU holds it
    and no GPU both holds and needs it; ids a GPU needs and holds itself (colocated) cost nothing.
    Without colocation M is simply the bytes of all needed ids.

    Args:
        trainers: trainer layouts, as for :func:`plan`.
        rollouts: rollout layouts, as for :func:`plan`.

    Returns:
        A :class:`wb.Traffic`: ``trainer_out`` splits M evenly over each id's holders (one
        balanced assignment), ``node_in`` is M_v per node; ``node_out`` and ``intra_node`` are
        empty (no per-node minimum is defined for them).
    """
    trainers, rollouts = tuple(trainers), tuple(rollouts)
    corr = correspond(trainers, rollouts)
    tab, nodes = slot_table(corr.slots, trainers, rollouts)
    b = bound_parts(corr, tab, nodes)
    H = np.flatnonzero(tab.role[corr.inc_slot] == 0)
    hc = corr.inc_cell[H]
    per_cell = b["sends"] * b["cell_bytes"]
    n_h = np.bincount(hc, minlength=corr.cell_id0.size)
    share = np.where(n_h > 0, per_cell // np.maximum(n_h, 1), 0)
    rem = per_cell - share * n_h
    first_h = np.r_[True, hc[1:] != hc[:-1]]
    amount = share[hc] + np.where(first_h, rem[hc], 0)
    trainer_out = {int(lay.worker.rank): 0 for lay in trainers}
    for rk, v in zip(*_sum(tab.rank[corr.inc_slot[H]], amount)):
        trainer_out[int(rk)] += int(v)
    return Traffic(trainer_out, b["node_in"], {}, {})


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
    n_gpus = int(tab.gpu.max(initial=-1)) + 1
    n_nodes = len(nodes)
    n_cells = corr.cell_id0.size
    cell_bytes = corr.cell_numel * _cell_itemsize(corr, tab)
    H, N = np.flatnonzero(role == 0), np.flatnonzero(role == 1)
    hc, nc = corr.inc_cell[H], corr.inc_cell[N]
    hg, ng = tab.gpu[corr.inc_slot[H]], tab.gpu[corr.inc_slot[N]]
    hn, nn = tab.node[corr.inc_slot[H]], tab.node[corr.inc_slot[N]]
    local = _key_in(nc * n_gpus + ng, hc * n_gpus + hg)
    on_node = _key_in(nc * n_nodes + nn, hc * n_nodes + hn)
    groups, ginv = np.unique(nc * n_nodes + nn, return_inverse=True)
    g_local = np.zeros(groups.size, bool)
    np.logical_or.at(g_local, ginv, local)
    g_on = np.zeros(groups.size, bool)
    np.logical_or.at(g_on, ginv, on_node)
    g_cell, g_node = groups // n_nodes, groups % n_nodes
    V = ~g_on
    W = g_on & ~g_local
    any_lw = np.zeros(n_cells, bool)
    any_lw[g_cell[~V]] = True
    any_v = np.zeros(n_cells, bool)
    any_v[g_cell[V]] = True
    offnode = any_v & ~any_lw
    sends = np.bincount(g_cell[W], minlength=n_cells) + offnode
    node_in = {nodes[i]: int(v) for i, v in zip(*_sum(g_node[V], cell_bytes[g_cell[V]])) if v}
    return {"cell_bytes": cell_bytes, "sends": sends, "offnode": offnode, "node_in": node_in}


def _sum(keys, values):
    if keys.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    u, inv = np.unique(keys, return_inverse=True)
    return u, np.bincount(inv, weights=values, minlength=u.size).astype(np.int64)


def traffic_ratio(plan: Plan) -> float:
    """How far a plan's traffic is from :func:`lower_bound`.

    Args:
        plan: a plan (from :func:`plan` or a baseline).

    Returns:
        The largest of trainer bytes / M and node_in[v] / M_v over all nodes v: 1.0 is the
        bound, ``inf`` where a plan sends bytes the bound says need not move.
    """
    tab, nodes = plan.table
    b = bound_parts(plan.corr, tab, nodes)
    t = plan.traffic()
    M = int((b["sends"] * b["cell_bytes"]).sum())
    ratios = [t.trainer_total / M if M else (1.0 if t.trainer_total == 0 else float("inf"))]
    for v in set(t.node_in) | set(b["node_in"]):
        got, need = t.node_in.get(v, 0), b["node_in"].get(v, 0)
        if need or got:
            ratios.append(got / need if need else float("inf"))
    return float(max(ratios))
