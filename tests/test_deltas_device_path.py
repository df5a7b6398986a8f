"""The delta update's device path (what runs between the kernels on a GPU: a turn's sends encoded
together, the deltas that came applied together, the flags read once) run on the host: each
rank's program given its buffers as "device" arrays of ``harness.host_device`` (numpy memory, the
kernels compiled for the host, CuPy's calls answered by numpy), its units moved by the host
mover. Against an oracle that runs the same versions dense: every rollout byte equal, every
version, and later versions move fewer bytes."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import wb
from harness.deltas import rollout_bufs, same, step, trainer_bufs
from harness.host_device import Dev, Module, Xp, compile_kernels
from harness.threads import run_each
from wb.data.plan import RankPlan
from wb.layouts import megatron_trainer, vllm_rollout
from wb.layouts.presets import TINY
from wb.runtime.engine import movers, program, update
from wb.runtime.engine.deltas import batches as delta_batches
from wb.runtime.engine.deltas import device as delta_device
from wb.runtime.engine.deltas import tables as delta_tables
from wb.runtime.engine.deltas.units import DeltaPlan
from wb.runtime.engine.executor import connect
from wb.runtime.engine.program import Program
from wb.runtime.transport.local import LocalHub, LocalTransport

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")


class _Job:
    """Every rank of ``plan`` as a thread over one hub, its program kept across versions."""

    def __init__(self, plan, bufs):
        self.plan, self.bufs, self.ranks = plan, bufs, plan.ranks
        hub = LocalHub()
        self.t = {r: LocalTransport(r, hub, timeout=20) for r in self.ranks}
        self.progs = {r: Program(RankPlan.of(plan, r)) for r in self.ranks}
        assert not run_each(lambda r: connect(RankPlan.of(plan, r), self.t[r]), self.ranks)

    def update(self, v: int, *, delta: bool):
        held = {r: p.version for r, p in self.progs.items()}
        stats = {}

        def plan_of(r):
            units, mine = self.progs[r].units.values(), held[r]
            return DeltaPlan(v, frozenset(g.peer for g in units if g.out and not g.local
                                          and mine >= 0 and held[g.peer] == mine),
                             frozenset(g.peer for g in units if not g.out
                                       and mine >= 0 and held[g.peer] == mine))

        def run(r):
            stats[r] = self.progs[r].run(self.bufs[r], self.t[r], tag_base=v << 32,
                                         staging_bytes=1 << 16, timeout=20,
                                         delta=plan_of(r) if delta else None)
        errors = run_each(run, self.ranks)
        assert not errors, errors
        return stats


@pytest.fixture
def on_the_host_device(tmp_path, monkeypatch):
    """Programs whose buffers are "device" arrays: Program.check hands out :class:`Dev` views
    with :class:`Xp` as their array module, the host mover moves them, the codec's kernels are
    the host-compiled ones."""
    lib, xp = compile_kernels(tmp_path), Xp()  # (the fixture gives the counts of the steps)
    check = Program.check

    def as_device(self, buffers, **kw):
        flat, _ = check(self, buffers, **kw)
        return {k: v.view(Dev) for k, v in flat.items()}, xp
    monkeypatch.setattr(Program, "check", as_device)
    monkeypatch.setattr(program, "mover_for", lambda prog, flat, xp, ready=None:
                        movers.HostMover(prog, flat, xp, ready))
    monkeypatch.setattr(program, "prepare", lambda *a, **k: None)  # (casts: none here)
    monkeypatch.setattr(program, "prepare_copies", lambda *a, **k: None)
    monkeypatch.setattr(delta_device, "kernel_module", lambda: Module(lib))
    delta_tables._prepared.cache_clear()
    delta_tables.prepare(xp)  # (as the first update would: before the steps are counted)
    seen = {"advanced": 0, "applied together": 0, "by headers": 0,  # through the batched steps
            "landed after the kept copies": 0, "applied where packed units lie": 0}
    count_many, apply_many = delta_tables.count_many, delta_tables.apply_many
    by_headers, take_parked = delta_batches._by_headers, delta_batches.take_parked

    kept = set()

    def parked_spy(u):  # (asks no event: the harness's say "not yet" once)
        kept.update(id(p) for p in u.parked if p[0] == "kept")
        seen["landed after the kept copies"] = len(kept)
        return take_parked(u)

    def advance_spy(jobs, **kw):
        seen["advanced"] += len(jobs)
        return count_many(jobs, **kw)

    def apply_spy(items, bad, sizes, **kw):
        seen["applied together"] += len(items)
        return apply_many(items, bad, sizes, **kw)
    spread = movers.HostMover.spread

    def spread_spy(self, g):
        seen["applied where packed units lie"] += 1
        return spread(self, g)
    monkeypatch.setattr(movers.HostMover, "spread", spread_spy)

    def headers_spy(u, landing):
        seen["by headers"] += len(landing)
        return by_headers(u, landing)
    monkeypatch.setattr(delta_tables, "count_many", advance_spy)
    monkeypatch.setattr(delta_tables, "apply_many", apply_spy)
    monkeypatch.setattr(delta_batches, "_by_headers", headers_spy)
    monkeypatch.setattr(delta_batches, "take_parked", parked_spy)
    monkeypatch.setattr(update, "take_parked", parked_spy)
    yield seen
    delta_tables._prepared.cache_clear()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("frames", [False, True])
def test_the_device_path_gives_every_rollout_the_dense_bytes(on_the_host_device, frames):
    trainers = megatron_trainer(TINY, tp=2, pp=1, ep=2, nodes=["t0"], gpus_per_node=2)
    rollouts = vllm_rollout(TINY, tp=2, ep=2, replicas=3, gpus_per_node=2, first_rank=2)
    plan = wb.plan(trainers, rollouts, chunk_bytes=2048 if frames else 1 << 20)
    trainer = trainer_bufs(plan)
    delta_rollouts, dense_rollouts = rollout_bufs(plan), rollout_bufs(plan)
    job, oracle = _Job(plan, {**trainer, **delta_rollouts}), _Job(plan, {**trainer,
                                                                        **dense_rollouts})
    rng = np.random.default_rng(1)
    for v, density in enumerate([1.0, 0.01, 0.0, 0.05, 0.3, 0.002]):
        if v:
            step(trainer, rng, density)
        got = job.update(v, delta=True)
        dense = oracle.update(v, delta=False)
        same(delta_rollouts, dense_rollouts)
        moved = sum(s.bytes_received for s in got.values())
        full = sum(s.bytes_received for s in dense.values())
        if v and density <= 0.05:
            assert moved < full * 0.6, (v, moved, full)
    assert all(p.version == 5 for p in job.progs.values())
    # every kind of batch ran: sends encoded together, deltas applied by kernels that read their
    # headers, the deltas those left to the host (masks, at density 0.3) by their headers, and
    # receives whose deltas relays forward, landing once the copies kept of them had run, and
    # deltas of packed units applied where their regions lie
    assert all(on_the_host_device.values()), on_the_host_device
