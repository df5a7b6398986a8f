"""EWTT estimates of a plan, of the ideal, and of the baselines RL frameworks use today.

The model: every GPU has a NIC (out and in) and NVLink (out and in) at the :class:`wb.Cluster`
bandwidths; all links run concurrently at full rate and the fabric has full bisection, so a
schedule takes as long as its busiest link, plus one chunk per hop of its deepest forwarding chain
(pipeline fill). Local copies on one GPU cost nothing. Messages cost their rank's worker
``message_s`` each (posting, completing, launching their packing: :data:`MESSAGE_S` by default,
as measured), spent while the bytes of others move: a GPU takes as long as the larger of its
busiest link and its worker's messages. It ignores congestion inside the fabric.

Baselines, modelled on what RL frameworks do:

- **broadcast** (slime / Miles default): full tensors are gathered at one trainer rank per trainer
  node over NVLink, then broadcast to every rollout GPU, which keeps its slice: every rollout GPU
  receives every needed byte over its NIC. Gather and broadcast of a bucket do not overlap.
- **p2p** (naive point-to-point): every rollout buffer pulls each region it needs from a fixed
  trainer holder (the lowest rank holding it): no dedup across replicas or across the GPUs of a
  node, no balancing.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from wb.data.layout import Cluster
from wb.data.plan import Plan
from wb.data.plan.plan import need_plan
from wb.errors import PlanError
from wb.algorithms.delta import expected_bytes
from wb.algorithms.planner import bound_parts
from wb.data.dtypes import CODES, dtype_info

__all__ = ["Simulation", "simulate", "simulate_broadcast", "simulate_p2p", "MESSAGE_S"]

#: Seconds a rank's worker spends per message it sends or receives: the cost :func:`simulate`
#: charges by default. Measured on an H200 with CUDA buffers (``bench/bench_executor.py --cuda``,
#: ``bench/results/executor/h200.json``): UCX posts and completes a message in 21-22 us whatever
#: its size, and wb's loop adds 3-3.4 us. Small messages travel framed for far less (0.41 us each
#: end to end there: :mod:`wb.runtime.engine.frames`); a 1T plan's messages of megabytes do not.
MESSAGE_S = 25e-6


class Simulation(NamedTuple):
    """A bandwidth-model estimate of one plan's transfer (seconds)."""

    ewtt_s: float  # estimated end-to-end weight transfer time
    ideal_s: float  # lower-bound bytes over the busiest link class, perfectly balanced
    busiest: str  # which link (or "messages": a worker's control) bounds ewtt_s
    link_s: dict  # {link class: (n,) seconds per GPU}: "trainer_nic_out", "rollout_nic_in", ...
    pipeline_s: float  # the pipeline-fill part of ewtt_s
    control_s: float = 0.0  # the busiest worker's messages times message_s
    free_messages_s: float = 0.0  # ewtt_s were messages free (message_s = 0)

    @property
    def ratio(self) -> float:
        return self.ewtt_s / self.ideal_s if self.ideal_s else 1.0


def _gpu_info(plan: Plan, cluster: Cluster):
    tab, nodes = plan.table
    n_gpus = int(tab.gpu.max(initial=-1)) + 1
    node_of = np.zeros(n_gpus, np.int64)
    node_of[tab.gpu] = tab.node
    is_trainer = np.zeros(n_gpus, bool)
    is_trainer[tab.gpu[tab.role == 0]] = True
    is_rollout = np.zeros(n_gpus, bool)
    is_rollout[tab.gpu[tab.role == 1]] = True
    nic = np.array([cluster.nic_bytes_per_s(nodes[n]) for n in node_of])
    nvl = np.array([cluster.nvlink_bytes_per_s(nodes[n]) for n in node_of])
    return tab, nodes, n_gpus, node_of, is_trainer, is_rollout, nic, nvl


def _loads(src_gpu, dst_gpu, nbytes, node_of, n_gpus):
    cross = node_of[src_gpu] != node_of[dst_gpu]
    nvl = ~cross & (src_gpu != dst_gpu)
    return {
        "nic_out": np.bincount(src_gpu[cross], weights=nbytes[cross], minlength=n_gpus),
        "nic_in": np.bincount(dst_gpu[cross], weights=nbytes[cross], minlength=n_gpus),
        "nvlink_out": np.bincount(src_gpu[nvl], weights=nbytes[nvl], minlength=n_gpus),
        "nvlink_in": np.bincount(dst_gpu[nvl], weights=nbytes[nvl], minlength=n_gpus),
    }


def _link_times(loads, nic, nvl, is_trainer, is_rollout) -> dict:
    return {
        "trainer_nic_out": (loads["nic_out"] / nic)[is_trainer],
        "rollout_nic_in": (loads["nic_in"] / nic)[is_rollout],
        "rollout_nic_out": (loads["nic_out"] / nic)[is_rollout & ~is_trainer],
        "nvlink_out": loads["nvlink_out"] / nvl,
        "nvlink_in": loads["nvlink_in"] / nvl,
    }


def _busiest(times: dict) -> tuple[float, str]:
    best, name = 0.0, "none"
    for k, v in times.items():
        if v.size and v.max() > best:
            best, name = float(v.max()), k
    return best, name


def ideal_s(plan: Plan, cluster: Cluster | None = None) -> float:
    """The lower-bound bytes over the busiest link class, perfectly balanced: trainer bytes that
    must leave the trainers' nodes over all trainer NICs, and each node's M_v over its NICs."""
    cluster = cluster or plan.cluster
    tab, nodes, n_gpus, node_of, is_trainer, is_rollout, nic, _ = _gpu_info(plan, cluster)
    b = bound_parts(plan.corr, tab, nodes)
    out = float((b["cell_bytes"] * b["offnode"]).sum() / max(nic[is_trainer].sum(), 1.0))
    for v, m in b["node_in"].items():
        vi = nodes.index(v)
        out = max(out, m / nic[is_rollout & (node_of == vi)].sum())
    return out


def _cluster(plan, cluster, who: str) -> Cluster:
    """The cluster to simulate ``plan`` under (its own by default), both checked."""
    need_plan(plan, who)
    if cluster is None:
        return plan.cluster
    if not isinstance(cluster, Cluster):
        raise PlanError(f"{who}: cluster must be a wb.Cluster or None, got "
                        f"{type(cluster).__name__}")
    return cluster


def simulate(plan: Plan, cluster: Cluster | None = None, *,
             message_s: float = MESSAGE_S, delta_density: float | None = None) -> Simulation:
    """Estimated EWTT of ``plan`` under ``cluster``, and the ideal.

    Every link (each GPU's NIC in and out, NVLink) moves its bytes at its rate, all at once, and
    every GPU's worker spends ``message_s`` on each message it sends or receives, meanwhile; the
    busiest GPU bounds the transfer, plus the time to fill the forwarding pipeline (one piece per
    hop). It assumes full bisection: a model to compare plans, not a measurement.

    Args:
        plan: the plan.
        cluster: link rates (default: the plan's own :class:`wb.Cluster`).
        message_s: seconds per message and side (default :data:`MESSAGE_S`, measured; 0: free
            messages, the bandwidth bound alone).
        delta_density: every message travels as a delta against the version its receiver
            holds, each element changed with this probability: its bytes are the expected size
            of its smallest encoding (:func:`wb.algorithms.delta.expected_bytes`); each message
            still costs ``message_s``. ``ideal_s`` is the dense ideal.

    Returns:
        :class:`Simulation` with ``ewtt_s``, ``ideal_s`` (the lower-bound bytes over the busiest
        link class, perfectly balanced), the per-link times, the busiest worker's
        ``control_s`` and ``free_messages_s`` (``ewtt_s`` with free messages).

    Examples:
        >>> import numpy as np, wb
        >>> sm = wb.SourceMap.from_indices(np.arange(1 << 20))
        >>> lay = lambda r, role, n: wb.Layout(wb.Worker(r, n, role), {"w": wb.BufferSpec(sm, "float32")})
        >>> sim = wb.simulate(wb.plan([lay(0, "trainer", "t")], [lay(1, "rollout", "r")]))
        >>> sim.busiest, sim.ewtt_s >= sim.ideal_s > 0
        ('trainer_nic_out', True)
    """
    cluster = _cluster(plan, cluster, "simulate")
    if not message_s >= 0:
        raise PlanError(f"simulate: message_s must be >= 0 seconds, got {message_s}")
    tab, nodes, n_gpus, node_of, is_trainer, is_rollout, nic, nvl = _gpu_info(plan, cluster)
    T = plan.transfers
    nbytes = plan.pieces.nbytes[T.piece].astype(np.float64)
    if delta_density is not None:
        nbytes *= _delta_fraction(plan, float(delta_density))
    loads = _loads(tab.gpu[T.src_slot], tab.gpu[T.dst_slot], nbytes, node_of, n_gpus)
    times = _link_times(loads, nic, nvl, is_trainer, is_rollout)
    busy, name = _busiest(times)
    depth = _depth(T.after)
    piece = float(plan.pieces.nbytes.max(initial=0) if delta_density is None
                  else nbytes.max(initial=0))  # a delta's chunks are its deltas
    piece_s = piece / float(nic.min()) if nic.size else 0.0
    pipe = depth * piece_s
    free = busy + pipe
    control = _control_s(plan, message_s)
    gpu_s = _gpu_seconds(loads, nic, nvl)
    rank_gpu = np.zeros(int(tab.rank.max(initial=-1)) + 1, np.int64)
    rank_gpu[tab.rank] = tab.gpu
    gpu_control = np.bincount(rank_gpu[np.arange(control.size)], weights=control,
                              minlength=n_gpus)
    both = np.maximum(gpu_s, gpu_control)
    if both.size and both.max() > busy:
        busy, name = float(both.max()), "messages"
    return Simulation(busy + pipe, ideal_s(plan, cluster), name, times, pipe,
                      float(control.max(initial=0.0)), free)


def _delta_fraction(plan: Plan, density: float) -> np.ndarray:
    """``(transfers,)``: the expected size of each transfer's message as a delta over its dense
    size."""
    M, T, P = plan.messages, plan.transfers, plan.pieces
    out = np.ones(T.piece.size, np.float64)
    has = M.count > 0
    if not has.any():
        return out
    first, count, size = M.first[has], M.count[has], M.nbytes[has]
    itemsize = np.array([dtype_info(c).itemsize for c in CODES])[P.dtype[T.piece[first]]]
    frac = expected_bytes(size, itemsize, density) / np.maximum(size, 1)
    # each message's transfers: first .. first + count - 1
    at = np.repeat(first - np.cumsum(count) + count, count) + np.arange(int(count.sum()))
    out[at] = np.repeat(frac, count)
    return out


def _control_s(plan: Plan, message_s: float) -> np.ndarray:
    """``(ranks,)`` seconds each rank's worker spends on its messages (sends, receives and local
    copies: each once)."""
    M = plan.messages
    n = int(max(M.src_rank.max(initial=-1), M.dst_rank.max(initial=-1))) + 1
    count = np.bincount(M.src_rank, minlength=n)
    count += np.bincount(M.dst_rank[M.dst_rank != M.src_rank], minlength=n)
    return count.astype(np.float64) * message_s


def _gpu_seconds(loads: dict, nic: np.ndarray, nvl: np.ndarray) -> np.ndarray:
    """``(gpus,)`` seconds of each GPU's busiest link."""
    return np.maximum.reduce([loads["nic_out"] / nic, loads["nic_in"] / nic,
                              loads["nvlink_out"] / nvl, loads["nvlink_in"] / nvl])


def _depth(after: np.ndarray) -> int:
    """Hops of the longest forwarding chain (transfers are in topological order)."""
    d = np.zeros(after.size, np.int64)
    for t in np.flatnonzero(after >= 0):  # parents come first
        d[t] = d[after[t]] + 1
    return int(d.max(initial=0)) + 1 if after.size else 0


def simulate_broadcast(plan: Plan, cluster: Cluster | None = None) -> Simulation:
    """EWTT of the broadcast baseline for the same layouts (see the module docstring)."""
    cluster = _cluster(plan, cluster, "simulate_broadcast")
    tab, nodes, n_gpus, node_of, is_trainer, is_rollout, nic, nvl = _gpu_info(plan, cluster)
    corr = plan.corr
    b = bound_parts(corr, tab, nodes)
    role = tab.role[corr.inc_slot]
    needed = np.zeros(corr.cell_id0.size, bool)
    needed[corr.inc_cell[role == 1]] = True
    total = float((b["cell_bytes"] * needed).sum())
    # gather: each needed cell goes, over NVLink, from its first holder to the lowest trainer GPU
    # of that holder's node (bytes already there do not move)
    H = np.flatnonzero(role == 0)
    first = H[np.r_[True, corr.inc_cell[H][1:] != corr.inc_cell[H][:-1]]]
    first = first[needed[corr.inc_cell[first]]]
    src_gpu = tab.gpu[corr.inc_slot[first]]
    src_node = node_of[src_gpu]
    gpus = np.arange(n_gpus)
    root = np.array([gpus[is_trainer & (node_of == n)].min() if (is_trainer & (node_of == n)).any()
                     else -1 for n in range(len(nodes))])
    moved = src_gpu != root[src_node]
    gathered = np.bincount(src_node[moved], weights=b["cell_bytes"][corr.inc_cell[first]][moved],
                           minlength=len(nodes))
    gather_s = float(max((gathered[n] / nvl[root[n]] for n in np.flatnonzero(gathered)),
                         default=0.0))
    # broadcast: every rollout GPU receives every needed byte
    rin = np.where(is_rollout, total, 0.0)
    times = {"gather_nvlink_in": np.array([gather_s]), "rollout_nic_in": (rin / nic)[is_rollout]}
    bcast_s = float(times["rollout_nic_in"].max(initial=0.0))
    return Simulation(gather_s + bcast_s, ideal_s(plan, cluster), "rollout_nic_in", times, 0.0)


def simulate_p2p(plan: Plan, cluster: Cluster | None = None) -> Simulation:
    """EWTT of the naive P2P baseline for the same layouts (see the module docstring)."""
    cluster = _cluster(plan, cluster, "simulate_p2p")
    tab, nodes, n_gpus, node_of, is_trainer, is_rollout, nic, nvl = _gpu_info(plan, cluster)
    corr = plan.corr
    role = tab.role[corr.inc_slot]
    H = np.flatnonzero(role == 0)
    hc = corr.inc_cell[H]
    # fixed holder: the lowest trainer rank holding the cell
    order = np.lexsort((tab.rank[corr.inc_slot[H]], hc))
    H, hc = H[order], hc[order]
    first = H[np.r_[True, hc[1:] != hc[:-1]]]
    holder_of = np.full(corr.cell_id0.size, -1, np.int64)
    holder_of[corr.inc_cell[first]] = first
    N = np.flatnonzero(role == 1)
    src = tab.gpu[corr.inc_slot[holder_of[corr.inc_cell[N]]]]
    dst = tab.gpu[corr.inc_slot[N]]
    nbytes = (corr.cell_numel[corr.inc_cell[N]] * tab.itemsize[corr.inc_slot[N]]).astype(np.float64)
    loads = _loads(src, dst, nbytes, node_of, n_gpus)
    times = _link_times(loads, nic, nvl, is_trainer, is_rollout)
    busy, name = _busiest(times)
    return Simulation(busy, ideal_s(plan, cluster), name, times, 0.0)
