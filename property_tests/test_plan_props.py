"""Properties of plans on random specs, slice-copy layouts and clusters, colocated or not."""

import numpy as np
from hypothesis import given, strategies as st

import wb
from wb.testing import strategies as wbst


def _value(ids):
    """The weight value of checkpoint element `id` (distinct per id, exact in float64)."""
    return ids.astype(np.float64) * 3.0 + 0.25


def _buffers(layouts, fill):
    out = {}
    for lay in layouts:
        out[lay.worker.rank] = {}
        for name, b in lay.buffers.items():
            ids = b.sourcemap.to_indices()
            out[lay.worker.rank][name] = _value(ids) if fill is None else np.full(ids.shape, fill)
    return out


def _assert_delivered(p):
    """run_local of plan ``p`` reproduces every needed element exactly and touches nothing
    else."""
    out = wb.run_local(p, _buffers(p.trainers, None), _buffers(p.rollouts, np.nan))
    for lay in p.rollouts:
        for name, b in lay.buffers.items():
            ids = b.sourcemap.to_indices()
            got = out[lay.worker.rank][name]
            assert np.array_equal(got[ids >= 0], _value(ids[ids >= 0]))
            assert np.isnan(got[ids < 0]).all()


@given(wbst.layouts(), wbst.clusters())
def test_plan_verifies_delivers_exactly_and_meets_the_bound(case, cluster):
    p = wb.plan(case.trainers, case.rollouts, cluster, chunk_bytes=64)
    p.verify()
    _assert_delivered(p)
    # traffic equals the lower bound: trainer bytes == M, node_in[v] == M_v
    t, lb = p.traffic(), wb.lower_bound(case.trainers, case.rollouts)
    assert t.trainer_total == lb.trainer_total
    assert {k: v for k, v in t.node_in.items() if v} == lb.node_in


@given(wbst.layouts())
def test_stage_order_and_no_piece_enters_a_node_twice(case):
    p = wb.plan(case.trainers, case.rollouts, chunk_bytes=48)
    T = p.transfers
    fwd = T.after >= 0
    assert (T.after[fwd] < np.flatnonzero(fwd)).all()
    assert (T.piece[T.after[fwd]] == T.piece[fwd]).all()
    assert (T.dst_slot[T.after[fwd]] == T.src_slot[fwd]).all()
    node = {i: (p.trainers if s.role == "trainer" else p.rollouts)[s.layout].worker.node
            for i, s in enumerate(p.slots)}
    entered = [(int(T.piece[t]), node[int(T.dst_slot[t])]) for t in range(T.piece.size)
               if node[int(T.src_slot[t])] != node[int(T.dst_slot[t])]]
    assert len(entered) == len(set(entered))
    # messages: a forwarded message waits for exactly the message that carried its data
    M = p.messages
    assert (M.parent[T.message[fwd]] == T.message[T.after[fwd]]).all()


@given(wbst.layouts(colocated=False))
def test_without_colocation_trainers_send_each_needed_byte_once(case):
    p = wb.plan(case.trainers, case.rollouts)
    needed = set()
    for lay in case.rollouts:
        for b in lay.buffers.values():
            ids = b.sourcemap.to_indices()
            needed.update(ids[ids >= 0].tolist())
    assert p.traffic().trainer_total == 2 * len(needed)  # bf16


@given(wbst.layouts(), wbst.clusters())
def test_save_load_round_trips_plans_and_layouts(case, cluster):
    import io
    from wb.data.layout import layouts_from_bytes, layouts_to_bytes
    p = wb.plan(case.trainers, case.rollouts, cluster, chunk_bytes=64)
    f = io.BytesIO()
    p.save(f)
    f.seek(0)
    back = wb.Plan.load(f)
    assert back == p
    for a, b in ((p.trainers, back.trainers), (p.rollouts, back.rollouts)):
        assert [x.worker for x in a] == [y.worker for y in b]
        assert [list(x.buffers.items()) for x in a] == [list(y.buffers.items()) for y in b]
    lays = (*case.trainers, *case.rollouts)
    again = layouts_from_bytes(layouts_to_bytes(lays))
    assert [list(x.buffers.items()) for x in lays] == [list(y.buffers.items()) for y in again]
    assert [x.worker for x in lays] == [y.worker for y in again]


@given(wbst.layouts(), wbst.clusters(), st.data())
def test_rollouts_fed_apart_get_everything_from_trainers_and_nobody_waits_for_them(
        case, cluster, data):
    """``apart=``: any subset of the rollouts (a version's joiners) receives every element it
    needs exactly, from trainers only, and sends nothing; the other rollouts exchange nothing
    with them; bytes into every node (each apart rank a node of its own) stay at the bound."""
    ranks = [lay.worker.rank for lay in case.rollouts]
    apart = set(data.draw(st.lists(st.sampled_from(ranks), unique=True, max_size=len(ranks))))
    p = wb.plan(case.trainers, case.rollouts, cluster, chunk_bytes=64, apart=apart)
    p.verify()
    _assert_delivered(p)
    M = p.messages
    trainers = {lay.worker.rank for lay in case.trainers}
    for r in apart:
        assert set(M.src_rank[M.dst_rank == r].tolist()) <= trainers | {r}
        assert set(M.dst_rank[M.src_rank == r].tolist()) <= {r}
    t, lb = p.traffic(), wb.lower_bound(p.trainers, p.rollouts)
    assert {k: v for k, v in t.node_in.items() if v} == lb.node_in
    if not apart:  # nothing fed apart: the plan of old
        assert t.trainer_total == lb.trainer_total
