"""The planner's entry points: :func:`plan` routes the needed cells and :func:`plan_from_routes`
turns any routes into a plan."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from wb.algorithms.planner.fed_apart import APART, add_routes_fed_apart, on_nodes_of_their_own
from wb.algorithms.planner.messages import transfers_and_messages
from wb.algorithms.planner.pieces import cut_into_pieces
from wb.algorithms.planner.routes import RouteRows, Routes
from wb.algorithms.planner.three_stages import add_three_stage_routes
from wb.data.correspondence import Correspondence, correspond
from wb.data.layout import Cluster, Layout
from wb.data.plan import Plan, slot_table
from wb.data.plan.plan import SMALL_RUN_BYTES
from wb.errors import PlanError

#: Piece size: large enough that per-message costs vanish, small enough to pipeline stages.
DEFAULT_CHUNK_BYTES = 8 << 20
#: Piece size of a job that sends deltas (``agree_parts(..., delta=True)``): a message carries
#: what changed of it, a few percent at RL's learning rates, so at the dense size its fixed cost
#: would bound the update. Sixteen times larger pieces take a Kimi-K2 rollout rank from 20,365
#: messages to about 5,100, at the price of a coarser balance for versions that go dense
#: (simulated: 1.07x the ideal instead of 1.004x; ``python -m wb plan --delta-density``).
DELTA_CHUNK_BYTES = 128 << 20
#: What a job that sends deltas packs (``plan(..., pack_below=)``): every range below its pieces'
#: size, so that a rank's messages are about its bytes over the piece size (a Kimi-K2-sized
#: model's rollout rank: a few hundred), not its tensors.
DELTA_PACK_BELOW = DELTA_CHUNK_BYTES


def plan(trainers: Sequence[Layout], rollouts: Sequence[Layout], cluster: Cluster | None = None,
         *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, apart: Collection[int] = (),
         pack_below: int = SMALL_RUN_BYTES) -> Plan:
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
        pack_below: contiguous ranges of fewer bytes travel packed with others of their pair of
            ranks (a message of its own costs more than their bytes); larger ones each in a
            message that is sent and received in place. A job that sends deltas packs all but
            the largest (``agree_parts(..., delta=True)``: ``chunk_bytes``): a delta's receive is
            staged anyway, and its fixed costs are what its update pays.

    Returns:
        A :class:`wb.Plan` whose ``traffic()`` equals :func:`lower_bound` (trainer bytes = M,
        bytes into each node = M_v).

    Raises:
        PlanError: an id needed by a rollout is held by no trainer, dtypes disagree, the
            rollouts need no id at all (no rollouts, no buffers, or maps that are all ``-1``),
            or ``apart`` names a rank that is no rollout; ``chunk_bytes`` is not positive or
            ``pack_below`` not a size.

    Examples:
        >>> import numpy as np, wb
        >>> w = np.arange(64).reshape(8, 8)
        >>> t = wb.Layout(wb.Worker(0, "t", "trainer"), {"w": wb.BufferSpec(wb.SourceMap.from_indices(w), "float32")})
        >>> r = [wb.Layout(wb.Worker(1 + i, f"r{i}", "rollout"), {"w": wb.BufferSpec(wb.SourceMap.from_indices(w[:, :4]), "float32")}) for i in range(2)]
        >>> p = wb.plan([t], r)
        >>> p.verify(); p.traffic().trainer_out, p.traffic().node_in
        ({0: 128}, {'r0': 128, 'r1': 128})
    """
    _check_sizes(chunk_bytes, pack_below)
    cluster = cluster or Cluster()
    trainers, rollouts = tuple(trainers), tuple(rollouts)
    if apart:
        rollouts = on_nodes_of_their_own(rollouts, apart)
    corr = correspond(trainers, rollouts)
    table, nodes = slot_table(corr.slots, trainers, rollouts)
    if not (table.role[corr.inc_slot] == 1).any():
        # An empty plan would make every update a silent no-op: the symptom of a probe that found
        # nothing (or of layouts built from the wrong model), which is what a user must hear about.
        why = ("no rollout layouts were given" if not rollouts else
               "no rollout layout lists a buffer" if not any(r.buffers for r in rollouts) else
               "every rollout buffer's source map is -1 (holds no checkpoint id)")
        raise PlanError(f"the rollouts need no checkpoint id ({why}), so there is nothing to "
                        f"plan; probe the rollout model with the checkpoint's spec and pass its "
                        f"layouts as `rollouts`")
    apart_nodes = [i for i, n in enumerate(nodes) if APART in n] if apart else []
    routes = _route(corr, table, nodes, cluster, chunk_bytes, apart_nodes=apart_nodes)
    return plan_from_routes(trainers, rollouts, routes, corr=corr, table=table, cluster=cluster,
                            chunk_bytes=chunk_bytes, pack_below=pack_below)


def plan_from_routes(trainers: Sequence[Layout], rollouts: Sequence[Layout], routes: Routes, *,
                     corr: Correspondence, table, cluster: Cluster | None = None,
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                     pack_below: int = SMALL_RUN_BYTES) -> Plan:
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
        pack_below: as for :func:`plan`.

    Returns:
        The :class:`wb.Plan`.

    Raises:
        PlanError: ``chunk_bytes`` is not positive, or ``pack_below`` not a size.
    """
    _check_sizes(chunk_bytes, pack_below)
    pieces = cut_into_pieces(corr, table, chunk_bytes)
    transfers, messages = transfers_and_messages(corr, table, routes, pieces, chunk_bytes,
                                                 pack_below)
    return Plan(tuple(trainers), tuple(rollouts), cluster or Cluster(), int(chunk_bytes), corr,
                pieces, transfers, messages, int(pack_below))


def _check_sizes(chunk_bytes, pack_below) -> None:
    if chunk_bytes < 1:
        raise PlanError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if isinstance(pack_below, bool) or not isinstance(pack_below, (int, np.integer)) \
            or pack_below < 0:
        raise PlanError(f"pack_below must be a number of bytes (an int >= 0), got "
                        f"{pack_below!r}")


def _route(corr: Correspondence, table, nodes: list[str], cluster: Cluster, chunk_bytes: int, *,
           apart_nodes: Sequence[int] = ()) -> Routes:
    """The routes of every needed cell: three stages for the needs of every node but
    ``apart_nodes``, whose needs each come from a trainer (stage 1), forwarded to nobody."""
    needs = np.flatnonzero(table.role[corr.inc_slot] == 1)
    fed_apart = np.isin(table.node[corr.inc_slot[needs]], np.asarray(apart_nodes, np.int64))
    rows = RouteRows()
    if (~fed_apart).any():
        add_three_stage_routes(rows, corr, table, nodes, cluster, chunk_bytes, needs[~fed_apart])
    if fed_apart.any():
        add_routes_fed_apart(rows, corr, table, nodes, cluster, needs[fed_apart])
    routes = rows.routes()
    if (routes.parent[routes.stage != 1] < 0).any():
        raise PlanError("internal: a forward without a parent route")
    return routes
