"""What a version arrives in at a :class:`wb.Receiver`: a *target*.

- :class:`InPlace`: the live buffers keep their addresses (CUDA graphs hold them): a version is
  written into them, directly or by one copy from staging.
- :class:`Handoff`: every version lands in new buffers, handed over and never written again
  (JAX wraps such host buffers as arrays without copying).
- :class:`Recycled`: every version lands in one of a few sets of wb's own buffers, handed over
  as DLPack exports (the framework's arrays are that memory); a set is written again once every
  array made of it has been freed (JAX on a GPU: UCX maps each set once, receives land in it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from wb.data.layout import Layout
from wb.runtime.engine import dlpack
from wb.runtime.engine.buffers import as_array, copy, copy_of, settle

__all__ = ["Target", "InPlace", "Handoff", "Recycled", "BufferSet", "allocated", "Live"]

log = logging.getLogger(__name__)

Live = dict[str, tuple[Any, Any]]  # name -> (array module, array) of the live weights


class Target(Protocol):
    in_place: bool  # a direct receive lands in the live buffers themselves

    def arrays(self) -> dict[str, Any]:
        """The live buffers (the newest applied version's)."""

    def landing(self) -> dict[str, Any]:
        """Where a direct receive writes."""

    def adopt(self, arrays: dict[str, Any]) -> None:
        """``arrays`` (from :meth:`landing`) now hold the newest version."""

    def spare(self) -> dict[str, Any]:
        """New staging, holding the live values (a transfer writes only mapped elements)."""

    def install(self, staged: dict[str, Any]) -> dict[str, Any] | None:
        """Makes the version in ``staged`` live; returns staging for the next version (None:
        :meth:`spare` when the next version starts to land)."""


class InPlace:
    """The live buffers keep their addresses: versions are written into them."""

    in_place = True

    def __init__(self, live: Live):
        self.live = live

    def arrays(self) -> dict[str, Any]:
        return {n: a for n, (_, a) in self.live.items()}

    def landing(self) -> dict[str, Any]:
        return self.arrays()

    def adopt(self, arrays: dict[str, Any]) -> None:
        pass  # already in place

    def spare(self) -> dict[str, Any]:
        return copy_of(self.live)

    def install(self, staged: dict[str, Any]) -> dict[str, Any]:
        for n, (xp, a) in self.live.items():
            copy(xp, a, staged[n])
        return staged  # the same staging serves the next version


class Handoff:
    """Every version lands in new buffers made by ``allocate(shape, dtype name)``; the arrays
    handed over are those objects themselves (a JAX array on a GPU, say), not wb's views of
    them, so the framework wraps them without a copy."""

    in_place = False  # versions land in other buffers, adopted once whole

    def __init__(self, given: dict[str, Any], layout: Layout, allocate: Callable, rank: int):
        self.layout, self.allocate, self.rank = layout, allocate, rank
        self.given: dict[str, Any] = {}  # the arrays handed over
        self.live: Live = {}  # wb's views of them
        self.adopt(given)

    def arrays(self) -> dict[str, Any]:
        return dict(self.given)

    def landing(self) -> dict[str, Any]:
        return self.spare()

    def adopt(self, arrays: dict[str, Any]) -> None:
        self.given = {n: arrays[n] for n in self.layout.buffers}
        self.live = {n: as_array(n, a, rank=self.rank) for n, a in self.given.items()}

    def spare(self) -> dict[str, Any]:
        return allocated(self.layout, self.allocate, self.live, rank=self.rank)

    def install(self, staged: dict[str, Any]) -> dict[str, Any]:
        self.adopt(staged)  # the staging buffers become the live ones; new staging next time
        return self.spare()


class BufferSet:
    """One set of a :class:`Recycled` target's buffers and the capsules exported of them."""

    def __init__(self, arrays: dict[str, Any], rank: int):
        self.arrays = arrays
        self.views: Live = {n: as_array(n, a, rank=rank) for n, a in arrays.items()}
        self.holds = dlpack.Holds()


class Recycled:
    """Every version lands in one of a few sets of wb's own buffers (made by ``allocate``, which
    UCX maps once: receives go straight into them), handed over as :func:`wb.runtime.engine.dlpack.
    export` s: the framework's arrays are that memory, no copy. A set is written again only once
    no capsule exported of it is held (the framework freed every array made of it) and its
    device has finished the work queued before; while the caller keeps older versions' arrays,
    new sets are made (logged). Elements no transfer writes (padding) keep the values the set
    got when it was made, from the live version then: the same in every version."""

    in_place = False  # versions land in other buffers, adopted once whole

    def __init__(self, given: dict[str, Any], layout: Layout, allocate: Callable, rank: int):
        self.layout, self.allocate, self.rank = layout, allocate, rank
        self.given = {n: given[n] for n in layout.buffers}  # handed over: exports after adopt
        self.live: Live = {n: as_array(n, a, rank=rank) for n, a in self.given.items()}
        self.sets: list[BufferSet] = []
        self.current: BufferSet | None = None  # the live version's set (None: the given buffers)
        self.lock = threading.Lock()  # spare() runs in the background receive's thread

    def arrays(self) -> dict[str, Any]:
        return dict(self.given)

    def landing(self) -> dict[str, Any]:
        return self.spare()

    def adopt(self, arrays: dict[str, Any]) -> None:
        with self.lock:
            s = next(x for x in self.sets if x.arrays is arrays)
            self.current, self.live = s, s.views
            self.given = {n: dlpack.export(a, self.layout.buffers[n].dtype, s.holds)
                          for n, (_, a) in s.views.items()}

    def spare(self) -> dict[str, Any]:
        with self.lock:
            for s in self.sets:
                if s is not self.current and s.holds.count == 0:
                    settle(s.views)  # work queued on the freed arrays has finished
                    return s.arrays
            s = BufferSet(allocated(self.layout, self.allocate, self.live, rank=self.rank),
                     self.rank)
            self.sets.append(s)
        if len(self.sets) > 2:
            log.info("rank %d: a new set of receive buffers (%d now): the arrays of %d older "
                     "versions are still referenced", self.rank, len(self.sets),
                     len(self.sets) - 2)
        return s.arrays

    def install(self, staged: dict[str, Any]) -> None:
        self.adopt(staged)
        return None  # the next set is taken when the next version starts to land: by then the
        #              caller has usually let go of this version's predecessor


def allocated(layout: Layout, allocate: Callable, live: Live | None, *,
               rank: int) -> dict[str, Any]:
    """New buffers for ``layout`` holding the ``live`` values (zeros without)."""
    out = {}
    for n, b in layout.buffers.items():
        out[n] = allocate(b.shape, b.dtype)
        xp, a = as_array(n, out[n], rank=rank)
        if live is None:
            a[...] = 0
        else:
            copy(xp, a, live[n][1])
    return out
