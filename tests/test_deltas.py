"""Updates that send deltas (:mod:`wb.runtime.engine.deltas.units`): each rank's program run version
after version, units as deltas between ranks that hold the same version, against an oracle that
runs the same versions dense into other buffers. Every rollout byte equal, every version."""

from __future__ import annotations

import numpy as np
import pytest

import wb
from harness.deltas import Job, rollout_bufs, same, step, trainer_bufs
from test_casts import converting_deployment
from wb.layouts import megatron_trainer, vllm_rollout
from wb.layouts.presets import TINY
from wb.runtime.engine.deltas.units import DeltaPlan


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


@pytest.mark.timeout(180)
@pytest.mark.parametrize("which", ["tiny_plan", "strided_plan", "converting_plan"])
def test_deltas_give_every_rollout_the_dense_bytes_and_move_fewer(which, request):
    plan = request.getfixturevalue(which)
    trainers = trainer_bufs(plan)
    delta_rollouts, dense_rollouts = rollout_bufs(plan), rollout_bufs(plan)
    job = Job(plan, {**trainers, **delta_rollouts})
    oracle = Job(plan, {**trainers, **dense_rollouts})
    rng = np.random.default_rng(0)
    for v, density in enumerate([1.0, 0.01, 0.0, 0.05, 0.3, 0.002]):
        if v:
            step(trainers, rng, density)
        got = job.update(v)
        dense = oracle.update(v, delta=False)
        same(delta_rollouts, dense_rollouts)
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
    trainers = trainer_bufs(plan)
    delta_rollouts, dense_rollouts = rollout_bufs(plan), rollout_bufs(plan)
    job = Job(plan, {**trainers, **delta_rollouts})
    oracle = Job(plan, {**trainers, **dense_rollouts})
    rng = np.random.default_rng(1)
    job.update(0), oracle.update(0, delta=False)
    lost = plan.rollouts[1].worker.rank
    job.progs[lost].forget_version()  # as after a failed update: it holds part of a version
    for bufs in (delta_rollouts, dense_rollouts):  # and its buffers hold anything (padding,
        for a in bufs[lost].values():  # which no update writes, alike in both)
            a.reshape(-1).view(f"u{a.itemsize}")[...] = 0x7F
    step(trainers, rng, 0.01)
    got = job.update(1)
    oracle.update(1, delta=False)
    same(delta_rollouts, dense_rollouts)
    # what reached the lost rank was dense; the others got deltas
    dense_in = sum(g.nbytes for g in job.progs[lost].units.values() if not g.out)
    assert got[lost].bytes_received == dense_in
    assert all(p.version == 1 for p in job.progs.values())


def test_deltas_into_other_buffers_than_the_version_held_are_refused(tiny_plan):
    plan = tiny_plan
    trainers = trainer_bufs(plan)
    rollouts = rollout_bufs(plan)
    job = Job(plan, {**trainers, **rollouts})
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
    trainers = trainer_bufs(plan)
    rollouts = rollout_bufs(plan)
    oracle_rollouts = rollout_bufs(plan)
    oracle = Job(plan, {**trainers, **oracle_rollouts})
    rng = np.random.default_rng(2)
    with wb.LocalSession(plan, trainers, rollouts, mode=mode, timeout=30, delta=True) as s:
        got = []
        for v in range(4):
            if v:
                step(trainers, rng, 0.01)
            s.update()
            oracle.update(v, delta=False)
            want = {r: {k: a for k, a in oracle_rollouts[r].items()} for r in rollouts}
            same({r: s.receivers[r].buffers for r in rollouts}, want)
            got.append(sum(x.bytes_received for x in s.stats() if x.version == v + 1
                           and x.role == "rollout"))
    # the first version is dense (nobody holds one), the others a few percent of it
    assert max(got[1:]) < 0.1 * got[0], got


def test_a_job_that_sends_deltas_plans_larger_pieces(tiny_plan):
    """``agree_parts(delta=True)`` plans pieces of ``DELTA_CHUNK_BYTES`` and packs every range
    below them (a message carries only what changed of it); a ``chunk_bytes`` given wins, and
    without ``delta`` the defaults stay. The roster the leader plans repairs from says the same."""
    from wb.algorithms.planner import (DEFAULT_CHUNK_BYTES, DELTA_CHUNK_BYTES, DELTA_PACK_BELOW,
                                       SMALL_RUN_BYTES)
    from wb.runtime.transport.stores import get_record

    layouts = list(tiny_plan.trainers) + list(tiny_plan.rollouts)
    world = len(layouts)
    for kwargs, chunk, packed in (({"delta": True}, DELTA_CHUNK_BYTES, DELTA_PACK_BELOW),
                                  ({}, DEFAULT_CHUNK_BYTES, SMALL_RUN_BYTES),
                                  ({"delta": True, "chunk_bytes": 4096}, 4096, 4096)):
        planned, store = [], wb.MemoryStore()
        mine = wb.agree_parts(store, layouts, world=world, planned=planned, **kwargs)
        assert sorted(mine) == list(range(world)) and planned[0].chunk_bytes == chunk
        assert planned[0].pack_below == packed
        roster = get_record(store, "wb/roster", 5.0)
        assert (roster["chunk_bytes"], roster["pack_below"]) == (chunk, packed)
        planned[0].verify()
    assert DELTA_CHUNK_BYTES > DEFAULT_CHUNK_BYTES
