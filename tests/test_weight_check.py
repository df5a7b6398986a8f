"""The weight check through the source maps (``wb.runtime.endpoints.checks``): trainers claim a
version (``Sender.claim``), rollouts check their live buffers against it (``Receiver.check``).
On the demo's deployment (its JAX trainers on a 2 x 2 mesh, its PyTorch rollouts: their own
probed layouts and buffers, the rollouts' the models' parameters), in threads: no false alarm
over 100 clean versions, and every planted mismatch found (one element flipped per tensor, at
random, checking every element). On a Megatron -> vLLM plan: a stale map (a loader that lays one
tensor out otherwise) and a trainer that pushes other weights than it claims are reported, on
exactly the tensors that differ."""

import numpy as np
import pytest

import wb
from harness.threads import run_each
from wb.cli.bench.weights import buffers_for, mapped_of, version_bits
from wb.layouts import megatron_trainer, vllm_rollout
from wb.layouts.presets import TINY, spec_from_config
from wb.runtime.transport.local import LocalHub, LocalTransport


@pytest.fixture(scope="module")
def job():
    trainers = megatron_trainer(TINY, tp=2, pp=1, ep=2, nodes=["t0"], gpus_per_node=2)
    rollouts = vllm_rollout(TINY, tp=2, ep=2, replicas=2, gpus_per_node=2, first_rank=2)
    return wb.plan(trainers, rollouts), spec_from_config(TINY)


@pytest.fixture(scope="module")
def demo():
    """The demo's deployment, in process: JAX trainers (the layouts its load function gives, the
    checkpoint loaded), PyTorch rollouts whose live buffers are their models' parameters."""
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    from wb.cli.demo.checkpoint import random_checkpoint
    from wb.cli.demo.runner import _side

    ckpt = random_checkpoint()
    tl, loaded, _ = _side("jax", "trainer", replicas=1, tp=2, first_rank=0, ckpt=ckpt)
    rl, _, params = _side("torch", "rollout", replicas=2, tp=2, first_rank=len(tl), ckpt=ckpt)
    plan = wb.plan(tl, rl)
    plan.verify()
    return plan, spec_from_config(TINY), loaded, params


def _run(plan, spec, versions: int, *, per_tensor=16, tamper=None, claim_from=None,
         maps=None, weights=None, live=None, staging=False, train_on=False):
    """Trainers push ``versions`` and claim each; rollouts apply and check each. ``tamper``:
    ``(rank, version) -> fn(buffers)`` run on a rollout's live buffers before its check;
    ``claim_from``: a trainer's weights it claims instead of what it pushes; ``weights``,
    ``live``: ``{rank: {name: array}}`` of the trainers' loaded weights and the rollouts' live
    buffers (default: made from the layouts); ``staging``: sender staging; ``train_on``: the
    trainers change their weights between push and claim (training goes on)."""
    hub, store = LocalHub(), wb.MemoryStore()
    nt = len(plan.trainers)
    reports: dict[int, list] = {}

    def run(r):
        kw = dict(transport=LocalTransport(r, hub, timeout=30), store=store, timeout=30,
                  wait_timeout=30)
        base = (weights[r] if weights and r in weights else buffers_for(plan, r, fill=True))
        base = {k: np.asarray(a) for k, a in base.items()}
        mapped = mapped_of(plan.layout_of(r))
        if r < nt:
            bufs = {k: v.copy() for k, v in base.items()}
            with wb.Sender(plan, r, bufs, staging=staging, **kw) as tx:
                for v in range(1, versions + 1):
                    for k, a in version_bits(base, v, mapped).items():
                        bufs[k][...] = a
                    tx.push()
                    if train_on:  # the next step already writes the weights
                        for k, a in version_bits(base, v + 7, mapped).items():
                            bufs[k][...] = a
                    other = claim_from(r, v, bufs) if claim_from else None
                    tx.claim(spec, other, per_tensor=per_tensor)
        else:
            mine = live[r] if live else {k: np.zeros_like(a) for k, a in base.items()}
            with wb.Receiver(plan, r, mine, **kw) as rx:
                for v in range(1, versions + 1):
                    assert rx.apply() == v
                    if tamper and (r, v) in tamper:
                        tamper[(r, v)](mine)
                    reports.setdefault(r, []).append(
                        rx.check(spec, per_tensor=per_tensor, maps=maps and maps.get(r)))
    errors = run_each(run, plan.ranks)
    assert not errors, errors
    return reports


def test_no_false_alarm_over_100_clean_versions(demo):
    plan, spec, loaded, params = demo
    reports = _run(plan, spec, 100, per_tensor=8, weights=loaded, live=params)
    for r, reps in reports.items():
        assert len(reps) == 100 and all(rep.ok for rep in reps), (r, [str(x) for x in reps])
        held = [n for n, t in reps[0].tensors.items() if t.status == "ok"]
        assert held and all(t.status in ("ok", "not held") for t in reps[0].tensors.values())


def test_every_planted_mismatch_is_found(demo):
    """One element flipped per tensor held by one of the demo's rollout ranks (its models'
    parameters), at random, every element checked: every flipped tensor is reported, no other."""
    plan, spec, loaded, params = demo
    rng = np.random.default_rng(7)
    target = plan.rollouts[0].worker.rank
    lay = plan.layout_of(target)
    planted = {}

    def flip(live):  # one element of every tensor this rank holds, at random
        ids = {n: b.sourcemap.to_indices().reshape(-1) for n, b in lay.buffers.items()}
        where = [(n, k) for n, a in ids.items() for k in np.flatnonzero(a >= 0)]
        tensor = np.array([spec.tensor_of(np.array([ids[n][k]]))[0] for n, k in where])
        for t in np.unique(tensor):
            n, k = where[int(rng.choice(np.flatnonzero(tensor == t)))]
            a = live[n].reshape(-1).view(f"u{live[n].dtype.itemsize}")
            a[k] ^= 1 << int(rng.integers(0, 8))
            name = spec.names[int(t)]
            planted.setdefault(name, set()).add(int(ids[n][k]) - spec.offset(name))
    reports = _run(plan, spec, 2, per_tensor=None, tamper={(target, 2): flip}, weights=loaded,
                   live=params)
    first, second = reports[target]
    assert first.ok and all(rep.ok for r, reps in reports.items() if r != target for rep in reps)
    assert set(second.mismatched) == set(planted), (second.mismatched, planted)
    for t in planted:
        assert second.tensors[t].first_bad[0] in planted[t]
    assert "here, the trainers'" in str(second)


def test_a_stale_map_shows_on_the_tensor_whose_layout_changed(job):
    """The rollout checks through maps probed from a loader that now lays one tensor out
    transposed (the cached maps the plan was made from say otherwise): that tensor differs."""
    plan, spec = job
    lay = plan.layout_of(3)
    name = next(n for n, b in lay.buffers.items()
                if len(b.sourcemap.shape) == 2 and b.sourcemap.shape[0] == b.sourcemap.shape[1]
                and b.sourcemap.shape[0] > 1)
    ids = lay.buffers[name].sourcemap.to_indices()
    maps = {3: {name: wb.SourceMap.from_indices(np.ascontiguousarray(ids.T))}}
    reports = _run(plan, spec, 1, per_tensor=None, maps=maps)
    offs = [spec.offset(n) for n in spec.names]
    held = ids[ids >= 0]
    tensors = {spec.names[int(np.searchsorted(offs, i, side="right")) - 1]
               for i in np.unique(held)}
    assert set(reports[3][0].mismatched) == tensors
    assert reports[2][0].ok


def test_a_trainer_pushing_other_weights_than_it_claims(job):
    """Trainer 0 claims the weights it trains now (version v + 1) but pushed version v: every
    rollout reports exactly the tensors it holds elements of that trainer 0 holds (the claim of
    an element several trainers hold is the first trainer's)."""
    plan, spec = job

    def claim_from(r, v, bufs):
        if r != 0:
            return None
        return version_bits(buffers_for(plan, 0, fill=True), v + 1, mapped_of(plan.layout_of(0)))
    reports = _run(plan, spec, 1, per_tensor=None, claim_from=claim_from)
    offs = [spec.offset(n) for n in spec.names]

    def ids_of(rank):
        return np.unique(np.concatenate([b.sourcemap.to_indices().reshape(-1)
                                         for b in plan.layout_of(rank).buffers.values()]))
    mine = ids_of(0)
    for r, reps in reports.items():
        both = np.intersect1d(mine, ids_of(r))
        both = both[both >= 0]
        want = {spec.names[int(np.searchsorted(offs, i, side="right")) - 1] for i in both}
        assert want and set(reps[0].mismatched) == want, (r, reps[0].mismatched, want)


def test_with_sender_staging_a_claim_is_of_what_was_sent(job):
    """Training goes on after push (sender staging): the claim reads the staged copy that was
    sent, not the weights the next step is writing; every check is clean."""
    plan, spec = job
    reports = _run(plan, spec, 3, per_tensor=None, staging=True, train_on=True)
    assert all(rep.ok for reps in reports.values() for rep in reps), reports
