"""Updates that send deltas (:mod:`wb.runtime.engine.deltas`): each rank's program run version
after version, units as deltas between ranks that hold the same version, against an oracle that
runs the same versions dense into other buffers. Every rollout byte equal, every version."""

from __future__ import annotations

import numpy as np
import pytest

import wb
from harness.multiproc import buffers_for
from harness.threads import run_each
from test_casts import converting_deployment
from wb.data.plan import RankPlan
from wb.layouts import megatron_trainer, vllm_rollout
from wb.layouts.presets import TINY
from wb.runtime.engine.deltas import DeltaPlan
from wb.runtime.engine.executor import connect
from wb.runtime.engine.program import Program
from wb.runtime.transport.local import LocalHub, LocalTransport


@pytest.fixture(scope="module")
def tiny_plan():
    trainers = megatron_trainer(TINY, tp=2, pp=1, ep=2, nodes=["t0"], gpus_per_node=2)
    rollouts = vllm_rollout(TINY, tp=2, ep=2, replicas=3, gpus_per_node=2, first_rank=2)
    return wb.plan(trainers, rollouts, chunk_bytes=2048)  # small messages: frames too


@pytest.fixture(scope="module")
def strided_plan():
    """Row blocks to transposed column blocks: every unit packed, every receive gathered."""
    w = np.arange(64 * 64).reshape(64, 64)

    def buf(ids):
        return {"w": wb.BufferSpec(wb.SourceMap.from_indices(np.ascontiguousarray(ids)),
                                   "bfloat16")}
    trainers = [wb.Layout(wb.Worker(r, "t0", "trainer", local_rank=r), buf(w[32 * r:32 * r + 32]))
                for r in range(2)]
    rollouts = [wb.Layout(wb.Worker(2 + 2 * n + g, f"r{n}", "rollout", local_rank=g),
                          buf(w[:, 32 * g:32 * g + 32].T)) for n in range(3) for g in range(2)]
    return wb.plan(trainers, rollouts, chunk_bytes=1024)


@pytest.fixture(scope="module")
def converting_plan():
    return wb.plan(*converting_deployment(), chunk_bytes=2048)


class _Job:
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


def _trainer_bufs(plan):
    return {lay.worker.rank: buffers_for(plan, lay.worker.rank, fill=True) for lay in plan.trainers}


def _rollout_bufs(plan):
    return {lay.worker.rank: buffers_for(plan, lay.worker.rank, fill=False)
            for lay in plan.rollouts}


def _step(trainer_bufs, rng, density: float) -> None:
    """A new version: ``density`` of each trainer buffer's elements get other bits (the same
    element ids in every copy of them are not kept alike: the plan reads each from one)."""
    for bufs in trainer_bufs.values():
        for a in bufs.values():
            flat = a.reshape(-1).view(f"u{a.itemsize}")
            hit = rng.random(flat.size) < density
            flat[hit] ^= rng.integers(1, 1 << (8 * a.itemsize) - 1, int(hit.sum()),
                                      dtype=np.uint64).astype(flat.dtype) | 1


def _same(a: dict, b: dict) -> None:
    for r in a:
        for k in a[r]:
            assert a[r][k].tobytes() == b[r][k].tobytes(), (r, k)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("which", ["tiny_plan", "strided_plan", "converting_plan"])
def test_deltas_give_every_rollout_the_dense_bytes_and_move_fewer(which, request):
    plan = request.getfixturevalue(which)
    trainers = _trainer_bufs(plan)
    delta_rollouts, dense_rollouts = _rollout_bufs(plan), _rollout_bufs(plan)
    job = _Job(plan, {**trainers, **delta_rollouts})
    oracle = _Job(plan, {**trainers, **dense_rollouts})
    rng = np.random.default_rng(0)
    for v, density in enumerate([1.0, 0.01, 0.0, 0.05, 1.0, 0.002]):
        if v:
            _step(trainers, rng, density)
        got = job.update(v)
        dense = oracle.update(v, delta=False)
        _same(delta_rollouts, dense_rollouts)
        moved = sum(s.bytes_received for s in got.values())
        full = sum(s.bytes_received for s in dense.values())
        if v == 0:  # nobody holds a version yet: dense
            assert moved == full
        elif density <= 0.05:
            assert moved < full * (0.5 if density <= 0.01 else 0.9), (v, density, moved, full)
        assert all(p.version == v for p in job.progs.values())


@pytest.mark.timeout(120)
def test_a_rank_without_a_version_gets_dense_bytes_and_its_peers_keep_theirs(tiny_plan):
    plan = tiny_plan
    trainers = _trainer_bufs(plan)
    delta_rollouts, dense_rollouts = _rollout_bufs(plan), _rollout_bufs(plan)
    job = _Job(plan, {**trainers, **delta_rollouts})
    oracle = _Job(plan, {**trainers, **dense_rollouts})
    rng = np.random.default_rng(1)
    job.update(0), oracle.update(0, delta=False)
    lost = plan.rollouts[1].worker.rank
    job.progs[lost].forget_version()  # as after a failed update: it holds part of a version
    for bufs in (delta_rollouts, dense_rollouts):  # and its buffers hold anything (padding,
        for a in bufs[lost].values():  # which no update writes, alike in both)
            a.reshape(-1).view(f"u{a.itemsize}")[...] = 0x7F
    _step(trainers, rng, 0.01)
    got = job.update(1)
    oracle.update(1, delta=False)
    _same(delta_rollouts, dense_rollouts)
    # what reached the lost rank was dense; the others got deltas
    dense_in = sum(g.nbytes for g in job.progs[lost].units.values() if not g.out)
    assert got[lost].bytes_received == dense_in
    assert all(p.version == 1 for p in job.progs.values())


def test_deltas_into_other_buffers_than_the_version_held_are_refused(tiny_plan):
    plan = tiny_plan
    trainers = _trainer_bufs(plan)
    rollouts = _rollout_bufs(plan)
    job = _Job(plan, {**trainers, **rollouts})
    job.update(0)
    r = plan.rollouts[0].worker.rank
    other = {k: a.copy() for k, a in rollouts[r].items()}
    prog = job.progs[r]
    peers = frozenset(g.peer for g in prog.units.values() if not g.out)
    with pytest.raises(wb.TransferError, match="other than those version 0 was written into"):
        prog.run(other, job.t[r], tag_base=1 << 32, timeout=1, delta=DeltaPlan(1, frm=peers))
    assert prog.version == -1


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["sync", "sender", "receiver", "both"])
def test_a_session_with_deltas_serves_the_trainers_weights_and_moves_less(tiny_plan, mode):
    plan = tiny_plan
    trainers = _trainer_bufs(plan)
    rollouts = _rollout_bufs(plan)
    oracle_rollouts = _rollout_bufs(plan)
    oracle = _Job(plan, {**trainers, **oracle_rollouts})
    rng = np.random.default_rng(2)
    with wb.LocalSession(plan, trainers, rollouts, mode=mode, timeout=30, delta=True) as s:
        got = []
        for v in range(4):
            if v:
                _step(trainers, rng, 0.01)
            s.update()
            oracle.update(v, delta=False)
            want = {r: {k: a for k, a in oracle_rollouts[r].items()} for r in rollouts}
            _same({r: s.receivers[r].buffers for r in rollouts}, want)
            got.append(sum(x.bytes_received for x in s.stats() if x.version == v + 1
                           and x.role == "rollout"))
    # the first version is dense (nobody holds one), the others a few percent of it
    assert max(got[1:]) < 0.1 * got[0], got
