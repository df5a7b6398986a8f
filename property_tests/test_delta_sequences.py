"""Deltas never land on a wrong base: random sequences of versions (densities from none to every
element), failures, restarts and new memberships, run through every rank's program over the local
transport, against the same versions run dense into other buffers. After every version every
rollout buffer is bit-identical to the dense one.

What a failure leaves, as modelled here: the rank holds no version (``version = -1``) and its
kept bases hold anything (a failed update wrote part of them); a restarted rollout also holds
anything in its buffers; a new membership gives every rank a new program (no bases). The real
events are run with processes by ``tests/test_transfer_ucx.py`` and ``bench/chaos.py --delta``.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wb
from harness.deltas import Job, rollout_bufs, same, step, trainer_bufs
from test_casts import converting_deployment
from wb.data.plan import RankPlan
from wb.layouts import megatron_trainer, vllm_rollout
from wb.layouts.presets import TINY
from wb.runtime.engine.program import Program


@functools.cache
def _plan(which: str):
    if which == "converting":
        return wb.plan(*converting_deployment(), chunk_bytes=2048)
    trainers = megatron_trainer(TINY, tp=2, pp=1, ep=2, nodes=["t0"], gpus_per_node=2)
    rollouts = vllm_rollout(TINY, tp=2, ep=2, replicas=2, gpus_per_node=2, first_rank=2)
    if which == "packed":  # as a job that sends deltas plans it: every range packed
        return wb.plan(trainers, rollouts, chunk_bytes=64 << 10, pack_below=64 << 10)
    return wb.plan(trainers, rollouts, chunk_bytes=4096)


_event = st.tuples(
    st.sampled_from([0.0, 0.001, 0.01, 0.05, 0.3, 1.0]),  # of the elements each version changes
    st.sets(st.integers(0, 7), max_size=3),  # ranks (by position) whose update failed
    st.sets(st.integers(0, 7), max_size=2),  # rollouts (by position) restarted
    st.booleans())  # a new membership: new programs everywhere


def _scribble(arrays, rng) -> None:
    for a in arrays:
        flat = a.reshape(-1).view(np.uint8)
        flat[rng.random(flat.size) < 0.2] ^= 0x5A


@pytest.mark.timeout(600)
@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["tiny", "converting", "packed"]), st.lists(_event, min_size=2, max_size=6),
       st.integers(0, 2**16))
def test_every_rollout_is_the_dense_update_after_every_version(which, events, seed):
    plan = _plan(which)
    rng = np.random.default_rng(seed)
    trainers = trainer_bufs(plan)
    got, want = rollout_bufs(plan), rollout_bufs(plan)
    job, oracle = Job(plan, {**trainers, **got}), Job(plan, {**trainers, **want})
    ranks, rollouts = plan.ranks, [lay.worker.rank for lay in plan.rollouts]
    for v, (density, failed, restarted, membership) in enumerate(events):
        if v:
            step(trainers, rng, density)
        if membership:
            job.progs = {r: Program(RankPlan.of(plan, r), checksums=True) for r in ranks}
        for i in failed:
            prog = job.progs[ranks[i % len(ranks)]]
            prog.version = -1
            _scribble([*prog.bases.values(), *prog.recv_bases.values()], rng)
        for i in restarted:
            r = rollouts[i % len(rollouts)]
            job.progs[r] = Program(RankPlan.of(plan, r), checksums=True)
            for k, a in got[r].items():  # anything, padding too (alike in both: never written)
                _scribble([a], rng)
                want[r][k][...] = a
        job.update(v)
        oracle.update(v, delta=False)
        same(got, want)
        assert all(p.version == v for p in job.progs.values())
