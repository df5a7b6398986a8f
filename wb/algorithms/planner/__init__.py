"""The three-stage planner: every needed byte leaves the trainers once and enters each node once.

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
from block to block of consecutive cells so every node forwards about as much as it receives.
Choices that balance load: the trainer replica that sends (least-loaded NIC first, largest cells
first), and the receiving GPU of a node when several GPUs need the cell (least-loaded NIC in).
Cells are then cut into pieces of at most ``chunk_bytes`` that follow their cell's route, so
forwarding starts as soon as a piece lands; pieces are packed into messages per pair of ranks.

The modules, in the order a plan is made:

- :mod:`~wb.algorithms.planner.planning`: :func:`plan` and :func:`plan_from_routes`.
- :mod:`~wb.algorithms.planner.routes`: :class:`Routes`, how every cell travels.
- :mod:`~wb.algorithms.planner.three_stages`: the L, W and V routes.
- :mod:`~wb.algorithms.planner.fed_apart`: the routes of rollouts fed apart.
- :mod:`~wb.algorithms.planner.holders`: which trainer sends a cell.
- :mod:`~wb.algorithms.planner.pieces`: cells cut into pieces.
- :mod:`~wb.algorithms.planner.messages`: pieces along routes, packed into messages.
- :mod:`~wb.algorithms.planner.bound`: the lower bound and a plan's distance from it.
- :mod:`~wb.algorithms.planner.facts`: per-cell facts the others share.
"""

from wb.algorithms.planner.bound import bound_parts, lower_bound, traffic_ratio
from wb.algorithms.planner.fed_apart import APART
from wb.algorithms.planner.planning import (DEFAULT_CHUNK_BYTES, DELTA_CHUNK_BYTES,
                                             DELTA_PACK_BELOW, plan, plan_from_routes)
from wb.algorithms.planner.routes import Routes
from wb.data.plan.plan import SMALL_RUN_BYTES

__all__ = ["plan", "lower_bound", "plan_from_routes", "Routes", "DEFAULT_CHUNK_BYTES",
           "DELTA_CHUNK_BYTES", "DELTA_PACK_BELOW", "traffic_ratio", "bound_parts", "APART",
           "SMALL_RUN_BYTES"]
