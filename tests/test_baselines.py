"""The baselines are real plans: exact in-process, with the traffic they are meant to have."""

import numpy as np

import wb
from wb.cli.bench.baselines import FullArena, broadcast_plans, needed_tensors, p2p_plan
from wb.layouts import TINY, megatron_trainer, spec_from_config, vllm_rollout
from harness.multiproc import buffers_for

SPEC = spec_from_config(TINY)


def _deployment(replicas=2):
    tr = megatron_trainer(TINY, tp=2, pp=1, ep=2, nodes=["t0"], gpus_per_node=4)
    ro = vllm_rollout(TINY, tp=2, ep=2, replicas=replicas, gpus_per_replica=2, gpus_per_node=2,
                      first_rank=5)
    return tr, ro


def _exact(plan, rollouts, got):
    return all(np.array_equal(got[lay.worker.rank][k].view(np.uint8),
                              buffers_for(plan, lay.worker.rank, fill=True)[k].view(np.uint8))
               for lay in rollouts for k in got[lay.worker.rank])


def test_p2p_is_exact_and_sends_once_per_need_from_fixed_holders():
    tr, ro = _deployment(replicas=2)
    p = p2p_plan(tr, ro, chunk_bytes=1024)
    tb = {lay.worker.rank: buffers_for(p, lay.worker.rank, fill=True) for lay in tr}
    rb = {lay.worker.rank: buffers_for(p, lay.worker.rank, fill=False) for lay in ro}
    wb.run_local(p, tb, rb)
    assert _exact(p, ro, rb)
    assert set(p.messages.stage.tolist()) == {1}  # no forwarding
    need = sum(b.sourcemap.n_ids * b.itemsize for lay in ro for b in lay.buffers.values())
    assert sum(p.traffic().trainer_out.values()) == need  # every need straight from a trainer
    # data-parallel trainer copies hold the same bytes: the fixed holder is the lowest rank
    assert p.traffic().trainer_out[2] == p.traffic().trainer_out[3] == 0
    assert sum(p.traffic().trainer_out.values()) > sum(wb.lower_bound(tr, ro).trainer_out.values())


def test_broadcast_gathers_then_sends_whole_tensors_to_every_worker():
    tr, ro = _deployment(replicas=2)
    gather, bcast = broadcast_plans(SPEC, tr, ro, gather_rank=4, chunk_bytes=1024)
    names = needed_tensors(SPEC, ro)
    assert names == [n for n in SPEC.names]  # the rollouts need every tensor
    at_g = FullArena(SPEC, names)
    tb = {lay.worker.rank: buffers_for(gather, lay.worker.rank, fill=True) for lay in tr}
    wb.run_local(gather, tb, {4: at_g.views})
    full = {lay.worker.rank: FullArena(SPEC, names) for lay in ro}
    wb.run_local(bcast, {4: at_g.views}, {r: f.views for r, f in full.items()})
    # every rollout worker holds every whole tensor, then loads its own slices
    assert all(f.flat.nbytes == SPEC.nbytes for f in full.values())
    p = wb.plan(tr, ro)
    got = {lay.worker.rank: buffers_for(p, lay.worker.rank, fill=False) for lay in ro}
    for lay in ro:
        full[lay.worker.rank].load(lay, got[lay.worker.rank])
    assert _exact(p, ro, got)
    assert bcast.traffic().trainer_out == {4: SPEC.nbytes}  # one sending GPU
