"""Routes, the planner's intermediate value: how every needed cell travels, one hop per row."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


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


class RouteRows:
    """The routes of one routing as its steps add them, numbered in the order they are added.

    A step needs the ids of the routes it forwards from, so routes get their ids when added, and
    a route's parent is always added before it.

    Examples:
        >>> rows = RouteRows()
        >>> rows.add(cell=[4, 5], stage=1, src=[0, 1], dst=[2, 3], parent=-1, level=0)
        array([0, 1])
        >>> rows.add(cell=[4], stage=3, src=[2], dst=[6], parent=[0], level=1)
        array([2])
        >>> rows.routes().parent
        array([-1, -1,  0])
    """

    def __init__(self) -> None:
        self._columns: dict[str, list[np.ndarray]] = {name: [] for name in Routes._fields}
        self._count = 0

    def add(self, *, cell, stage, src, dst, parent, level) -> np.ndarray:
        """Adds one route per element of ``cell``; the other arguments are arrays of the same
        length or one value for all.

        Args:
            cell: ``(n,)`` cells, as :class:`Routes` holds them; so are the others.
            stage: stage of each route.
            src: source incidence of each route.
            dst: destination need incidence of each route.
            parent: route that must deliver to ``src`` first, -1 for none.
            level: forwarding depth of each route.

        Returns:
            ``(n,) int64`` ids of the added routes.
        """
        n = np.asarray(cell).size
        for name, values in zip(Routes._fields, (cell, stage, src, dst, parent, level)):
            self._columns[name].append(np.broadcast_to(np.asarray(values, np.int64), (n,)).copy())
        ids = np.arange(self._count, self._count + n)
        self._count += n
        return ids

    def routes(self) -> Routes:
        """All routes added, in the order they were added.

        Returns:
            The :class:`Routes`; each route's id is its row.
        """
        return Routes(*(np.concatenate(parts) if parts else np.zeros(0, np.int64)
                        for parts in self._columns.values()))
