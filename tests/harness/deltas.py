"""Runs of a plan version after version, each rank's program kept, with or without deltas
(:mod:`wb.runtime.engine.deltas.units`): what the delta tests and properties share."""

from __future__ import annotations

import numpy as np

from harness.multiproc import buffers_for
from harness.threads import run_each
from wb.data.plan import RankPlan
from wb.runtime.engine.deltas.units import DeltaPlan
from wb.runtime.engine.executor import connect
from wb.runtime.engine.program import Program
from wb.runtime.transport.local import LocalHub, LocalTransport

__all__ = ["Job", "trainer_bufs", "rollout_bufs", "step", "same"]


class Job:
    """Every rank of ``plan`` as a thread over one hub, its program kept across versions."""

    def __init__(self, plan, bufs):
        self.plan, self.bufs = plan, bufs
        self.ranks = plan.ranks
        hub = LocalHub()
        self.t = {r: LocalTransport(r, hub, timeout=20, checksums=True) for r in self.ranks}
        self.progs = {r: Program(RankPlan.of(plan, r), checksums=True) for r in self.ranks}
        errors = run_each(lambda r: connect(RankPlan.of(plan, r), self.t[r]), self.ranks)
        assert not errors, errors
        self.stats = {}

    def update(self, v: int, *, delta: bool = True):
        held = {r: p.version for r, p in self.progs.items()}

        def plan_of(r):
            if not delta:
                return None
            units = self.progs[r].units.values()
            mine = held[r]
            return DeltaPlan(v, frozenset(g.peer for g in units if g.out and not g.local
                                          and mine >= 0 and held[g.peer] == mine),
                             frozenset(g.peer for g in units if not g.out
                                       and mine >= 0 and held[g.peer] == mine))

        def run(r):
            self.stats[r] = self.progs[r].run(self.bufs[r], self.t[r], tag_base=v << 32,
                                              staging_bytes=1 << 16, timeout=20, delta=plan_of(r))
        errors = run_each(run, self.ranks)
        assert not errors, errors
        return self.stats


def trainer_bufs(plan):
    return {lay.worker.rank: buffers_for(plan, lay.worker.rank, fill=True) for lay in plan.trainers}


def rollout_bufs(plan):
    return {lay.worker.rank: buffers_for(plan, lay.worker.rank, fill=False)
            for lay in plan.rollouts}


_LAST: dict[int, tuple] = {}  # id(array) -> (array, positions, xor) of its last step's changes


def step(trainer_bufs, rng, density: float) -> None:
    """A new version: ``density`` of each trainer buffer's elements get other bits, and half of
    the last version's changes go back to the bits before it (a value that comes back, as a
    cast one does: a delta against any older version than the receiver's shows then). The
    same element ids in every copy of them are not kept alike: the plan reads each from one."""
    for bufs in trainer_bufs.values():
        for a in bufs.values():
            flat = a.reshape(-1).view(f"u{a.itemsize}")
            last = _LAST.get(id(a))
            if last is not None and last[0] is a and last[1].size:
                back = rng.random(last[1].size) < 0.5
                flat[last[1][back]] ^= last[2][back]
            pos = np.flatnonzero(rng.random(flat.size) < density)
            xor = rng.integers(1, 1 << (8 * a.itemsize) - 1, pos.size,
                               dtype=np.uint64).astype(flat.dtype) | 1
            flat[pos] ^= xor
            _LAST[id(a)] = (a, pos, xor)


def same(a: dict, b: dict) -> None:
    for r in a:
        for k in a[r]:
            assert a[r][k].tobytes() == b[r][k].tobytes(), (r, k)
