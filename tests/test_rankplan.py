"""A rank's part of a plan (RankPlan): the parts put together are the whole plan (an oracle), they
round-trip through bytes, and running from parts moves the very same bytes as the whole plan."""


import numpy as np
import pytest
from hypothesis import given, settings

import wb
from wb.data.plan import RankPlan, part_of, parts
from wb.layouts import megatron_trainer, vllm_rollout
from wb.layouts.presets import TINY
from wb.runtime.engine.executor import execute
from wb.runtime.engine.program import Program
from wb.runtime.transport.local import LocalHub, LocalTransport
from wb.testing import strategies as wbst
from harness.threads import run_each
from harness.multiproc import buffers_for


@pytest.fixture(scope="module")
def plan():
    trainers = megatron_trainer(TINY, tp=2, pp=1, ep=2, nodes=["t0"], gpus_per_node=2)
    rollouts = vllm_rollout(TINY, tp=2, ep=2, replicas=3, gpus_per_node=2, first_rank=2)
    return wb.plan(trainers, rollouts, chunk_bytes=2048)


def assert_parts_are_the_plan(p):
    """Oracle: each rank's part holds exactly the messages it sends or receives (brute force over
    the whole plan), with the same transfers, pieces and buffers, in order."""
    M, T, P = p.messages, p.transfers, p.pieces
    tab = p.table[0]
    seen = np.zeros(M.stage.size, np.int64)
    by_rank = {part.rank: part for part in parts(p)}
    assert sorted(by_rank) == p.ranks
    for r, part in by_rank.items():
        assert part == RankPlan.of(p, r)
        want = [m for m in range(M.stage.size) if M.src_rank[m] == r or M.dst_rank[m] == r]
        assert part.index.tolist() == want
        seen[part.index] += 1
        for f in ("stage", "src_rank", "dst_rank", "nbytes", "parent", "count"):
            assert np.array_equal(getattr(part.messages, f), getattr(M, f)[part.index])
        ts = np.concatenate([np.arange(M.first[m], M.first[m] + M.count[m]) for m in want]
                            ) if want else np.zeros(0, np.int64)
        pt = part.transfers
        for f in ("stage", "src_f0", "src_fa", "src_fb", "dst_f0", "dst_fa", "dst_fb", "after",
                  "src_inc", "dst_inc"):
            assert np.array_equal(getattr(pt, f), getattr(T, f)[ts])
        for f in P._fields:
            assert np.array_equal(getattr(part.pieces, f)[pt.piece], getattr(P, f)[T.piece[ts]])
        for mine, whole in ((pt.src_slot, T.src_slot[ts]), (pt.dst_slot, T.dst_slot[ts])):
            assert np.array_equal(part.slot_rank[mine], tab.rank[whole])
            assert [part.slot_buffer[s] for s in mine] == [p.slots[s].buffer for s in whole]
        assert np.array_equal(part.index[pt.message], T.message[ts])
        first = part.messages.first
        assert np.array_equal(first, np.cumsum(np.r_[0, part.messages.count])[:-1])
        assert part.layout == p.layout_of(r)
        assert part.trainers == tuple(lay.worker.rank for lay in p.trainers)
        M = p.messages  # the oracle: every rank it sends to or receives from
        mine = (M.src_rank == r) | (M.dst_rank == r)
        peers = set(M.src_rank[mine].tolist()) | set(M.dst_rank[mine].tolist())
        assert list(part.peers) == sorted(peers - {r})
        assert part.fingerprint == p.fingerprint
        assert RankPlan.from_bytes(part.to_bytes()) == part
    local = M.src_rank == M.dst_rank  # a local copy is in one part, other messages in two
    assert np.array_equal(seen, np.where(local, 1, 2))


def test_parts_put_together_are_the_plan(plan):
    assert_parts_are_the_plan(plan)


@settings(max_examples=30, deadline=None)
@given(wbst.layouts(), wbst.clusters())
def test_parts_put_together_are_the_plan_for_random_layouts(case, cluster):
    assert_parts_are_the_plan(wb.plan(case.trainers, case.rollouts, cluster, chunk_bytes=64))


def test_a_part_is_much_smaller_than_the_plan(plan, tmp_path):
    plan.save(tmp_path / "p.npz")
    whole = (tmp_path / "p.npz").stat().st_size
    assert max(len(part.to_bytes()) for part in parts(plan)) < whole


def test_a_program_from_a_part_equals_one_from_the_plan(plan):
    for r in plan.ranks:
        part = RankPlan.of(plan, r)
        a, b = Program(part), Program(RankPlan.from_bytes(part.to_bytes()))
        assert a.messages.keys() == b.messages.keys()
        for m, g in a.messages.items():
            h = b.messages[m]
            assert [getattr(g, f) for f in ("stage", "peer", "nbytes", "parent", "zc_src",
                                            "zc_dst", "out", "local")] == \
                   [getattr(h, f) for f in ("stage", "peer", "nbytes", "parent", "zc_src",
                                            "zc_dst", "out", "local")]
        assert (a.when, a.roots, a.children) == (b.when, b.roots, b.children)
        assert (a.zero_copy_receives, a.staged_receives) == (b.zero_copy_receives,
                                                             b.staged_receives)


def test_a_part_refuses_another_rank(plan):
    part = RankPlan.of(plan, 3)
    assert part_of(part, 3) is part
    with pytest.raises(wb.PlanError, match="rank 3's part"):
        part_of(part, 4)
    with pytest.raises(wb.PlanError, match=r"rank 99 has no layout in this plan \(ranks"):
        RankPlan.of(plan, 99)


def test_a_part_of_another_format_is_refused(plan):
    """A part of another format number, the npz parts of older wbs, and bytes that are no part at
    all: each refused with a PlanError that says to make the plan again (or names the array)."""
    import io
    import json

    from wb.data.plan.part import _pack, _unpack
    header, arrays = _unpack(RankPlan.of(plan, 2).to_bytes(), "part")
    with pytest.raises(wb.PlanError, match="make the plan again"):
        RankPlan.from_bytes(_pack({**header, "format": 99}, arrays))
    f = io.BytesIO()
    np.savez(f, header=np.frombuffer(json.dumps(header).encode(), np.uint8), **arrays)
    with pytest.raises(wb.PlanError, match="make the plan again"):
        RankPlan.from_bytes(f.getvalue())
    with pytest.raises(wb.PlanError, match="dtype"):
        _unpack(_pack(header, {**arrays, "index": np.array(["a"], object)}), "part")
    import zlib

    head = json.dumps({"header": {**header, "format": 4}, "arrays": []}).encode()
    old = b"WBPART\n" + zlib.compress(len(head).to_bytes(8, "little") + head)  # format 4: unsealed
    with pytest.raises(wb.PlanError, match="store key `k` is not a rank part sealed by this wb"):
        RankPlan.from_bytes(old, where="store key `k`")


def test_a_parts_index_is_deflated_with_its_arrays(plan):
    """The JSON index (the slot buffers' names, the layout's header) is in the deflated stream, not
    before it: left raw it would be a third of a Kimi-K2 part's bytes (52 of 152 MB for 512 parts)."""
    part = RankPlan.of(plan, 2)
    data = part.to_bytes()
    assert b'"slot_buffer"' not in data
    assert not any(name.encode() in data for name in part.slot_buffer)
    assert RankPlan.from_bytes(data) == part


def _execute_all(plan, source):
    """Every rank runs ``source(rank)`` (the plan or its part) over the local transport."""
    hub = LocalHub()
    bufs = {r: buffers_for(plan, r, fill=r < len(plan.trainers)) for r in plan.ranks}
    errors = run_each(lambda r: execute(source(r), bufs[r], LocalTransport(r, hub, timeout=20),
                                        staging_bytes=4096, timeout=20), plan.ranks)
    assert not errors, errors
    return bufs


@pytest.mark.timeout(120)
def test_running_from_parts_is_bit_identical_to_running_the_plan(plan):
    by_rank = {q.rank: RankPlan.from_bytes(q.to_bytes()) for q in parts(plan)}
    whole = _execute_all(plan, lambda r: RankPlan.of(plan, r))
    from_parts = _execute_all(plan, lambda r: by_rank[r])
    for lay in plan.rollouts:
        r = lay.worker.rank
        for k, a in whole[r].items():
            np.testing.assert_array_equal(from_parts[r][k].view(np.uint8), a.view(np.uint8))
            want = buffers_for(plan, r, fill=True)[k]
            np.testing.assert_array_equal(a.view(np.uint8), want.view(np.uint8))


@pytest.mark.timeout(120)
def test_a_part_of_another_plan_is_refused_by_its_peers(plan):
    other = wb.plan(plan.trainers, plan.rollouts, chunk_bytes=1024)
    hub = LocalHub()
    bufs = {r: buffers_for(plan, r, fill=r < len(plan.trainers)) for r in plan.ranks}
    errors = run_each(lambda r: execute(RankPlan.of(other if r == 0 else plan, r), bufs[r],
                                        LocalTransport(r, hub, timeout=5), timeout=5),
                      plan.ranks)
    assert errors and any("different plan" in str(e) for e in errors.values())


def test_a_process_s_parts_stand_for_the_plan_for_its_ranks(plan):
    """``{rank: part}`` (what agree_parts gives a process) stands for the plan for its ranks: a
    rank's part is looked up, and a rank without one is refused naming the ranks there are."""
    mine = {q.rank: q for q in parts(plan, ranks=[0, 5])}
    assert sorted(mine) == [0, 5] and mine[5] == RankPlan.of(plan, 5)
    assert part_of(mine, 5) is mine[5] and part_of(plan, 5) == mine[5]
    with pytest.raises(wb.PlanError, match="rank 3 has no part here .*ranks \\[0, 5\\]"):
        part_of(mine, 3)
    with pytest.raises(TypeError, match="a plan must be"):
        part_of([mine[5]], 5)
