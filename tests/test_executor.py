"""The executor's send schedule and its staging budget, in one process over the local transport.

The multi-process paths (UCX, faults) are in test_transfer_ucx.py; here: the order a worker sends
in (`schedule`), that any staging budget, however small, still delivers every byte, and that a
rank's `Program` runs update after update.
"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import wb
from wb.data.plan import RankPlan
from wb.runtime.engine.executor import connect, execute
from wb.data.plan import schedule
from wb.runtime.engine.program import Program
from wb.layouts import megatron_trainer, vllm_rollout
from wb.layouts.presets import TINY
from harness.multiproc import buffers_for
from wb.runtime.transport.local import LocalHub, LocalTransport
from harness.threads import run_each


@pytest.fixture(scope="module")
def plan():
    trainers = megatron_trainer(TINY, tp=2, pp=1, ep=2, nodes=["t0"], gpus_per_node=2)
    rollouts = vllm_rollout(TINY, tp=2, ep=2, replicas=3, gpus_per_node=2, first_rank=2)
    p = wb.plan(trainers, rollouts, chunk_bytes=2048)  # many pieces: long streams per pair
    p.verify()
    return p


@pytest.fixture(scope="module")
def strided_plan():
    """Every message strided on both sides: trainers hold row blocks, rollouts need transposed
    column blocks; so every send is packed and every receive staged and unpacked."""
    w = np.arange(64 * 64).reshape(64, 64)

    def buf(ids):
        return {"w": wb.BufferSpec(wb.SourceMap.from_indices(np.ascontiguousarray(ids)),
                                   "float32")}
    trainers = [wb.Layout(wb.Worker(r, "t0", "trainer", local_rank=r), buf(w[32 * r:32 * r + 32]))
                for r in range(2)]
    rollouts = [wb.Layout(wb.Worker(2 + 2 * n + g, f"r{n}", "rollout", local_rank=g),
                          buf(w[:, 32 * g:32 * g + 32].T)) for n in range(3) for g in range(2)]
    p = wb.plan(trainers, rollouts, chunk_bytes=1024)
    p.verify()
    return p


def test_trainers_interleave_their_destinations(plan):
    M = plan.messages
    when = schedule(M)
    for src in {lay.worker.rank for lay in plan.trainers}:
        mine = np.flatnonzero((M.src_rank == src) & (M.parent < 0))
        dsts = np.unique(M.dst_rank[mine])
        assert dsts.size >= 2  # the case that matters: one trainer, several rollout GPUs
        order = mine[np.lexsort((mine, when[mine]))]
        # plan order is grouped by destination; the schedule alternates them
        assert np.unique(M.dst_rank[order[:dsts.size]]).size == dsts.size
        # each destination's own messages keep plan order (its contiguous ranges stay in order)
        for d in dsts:
            seq = order[M.dst_rank[order] == d]
            assert (np.diff(seq) > 0).all()
        # and every destination's stream is spread over the whole send: its first message goes
        # in the first round, its last in the last (times are fractions of each pair's stream)
        assert when[mine].min() == 0.0 and when[mine].max() < 1.0


def test_forwards_go_after_what_they_forward(plan):
    M = plan.messages
    when = schedule(M)
    fwd = np.flatnonzero(M.parent >= 0)
    assert fwd.size  # 3 replicas: stage 2 and 3 forwards exist
    assert (when[fwd] > when[M.parent[fwd]]).all()


def _run_threads(plan, staging_bytes, bufs=None, traces=None):
    hub = LocalHub()
    if bufs is None:
        bufs = {r: buffers_for(plan, r, fill=r < len(plan.trainers)) for r in plan.ranks}
    stats = {}

    def run(r):
        stats[r] = execute(RankPlan.of(plan, r), bufs[r], LocalTransport(r, hub, timeout=20),
                           staging_bytes=staging_bytes, timeout=20,
                           trace=None if traces is None else traces.setdefault(r, []))
    errors = run_each(run, plan.ranks)
    assert not errors, errors
    return bufs, stats


@pytest.mark.timeout(120)
@pytest.mark.parametrize("staging_bytes", [1, 4096, 256 << 20])
@pytest.mark.parametrize("which", ["plan", "strided_plan"])
def test_any_staging_budget_delivers_every_byte(which, staging_bytes, request):
    plan = request.getfixturevalue(which)
    bufs, stats = _run_threads(plan, staging_bytes)
    for lay in plan.rollouts:
        r = lay.worker.rank
        want = buffers_for(plan, r, fill=True)
        for k, a in want.items():
            np.testing.assert_array_equal(bufs[r][k].view(np.uint8), a.view(np.uint8))
    # the budget bounds staging in flight (a message, or a frame of small ones, bigger than the
    # budget still goes alone)
    biggest = max(g.nbytes for r in plan.ranks
                  for g in Program(RankPlan.of(plan, r)).units.values())
    for s in stats.values():
        assert s.staging_peak <= staging_bytes + 2 * biggest
    if which == "strided_plan":  # the staging path really ran
        assert max(s.staging_peak for s in stats.values()) > 0


def _each(ranks, fn):
    """``fn(rank)`` for every rank at once (each rank is a thread); raises the first error."""
    with ThreadPoolExecutor(len(ranks)) as pool:
        for f in [pool.submit(fn, r) for r in ranks]:
            f.result(timeout=60)


def test_a_program_runs_many_updates_and_skips_the_check_of_the_same_arrays(plan, monkeypatch):
    """A Sender/Receiver runs one plan many times over one connected transport: its rank's
    Program is worked out once, and the very same arrays given again are not checked again. New
    arrays are; so is an array whose dtype changed in place, which is then refused."""
    import wb.runtime.engine.program as program_module

    checked = []
    real = program_module.check_buffers
    monkeypatch.setattr(program_module, "check_buffers", lambda mine, *a, **k: (
        checked.append(mine.worker.rank) or real(mine, *a, **k)))
    ranks = plan.ranks
    hub = LocalHub()
    transports = {r: LocalTransport(r, hub, timeout=20) for r in ranks}
    programs = {r: Program(RankPlan.of(plan, r)) for r in ranks}
    _each(ranks, lambda r: connect(RankPlan.of(plan, r), transports[r]))
    bufs = {r: buffers_for(plan, r, fill=r < len(plan.trainers)) for r in ranks}

    def update(v):
        _each(ranks, lambda r: programs[r].run(bufs[r], transports[r], tag_base=v << 32,
                                               staging_bytes=1 << 20, timeout=20))

    update(0)
    assert sorted(checked) == sorted(ranks)
    for v in (1, 2):  # the same arrays, zeroed: no check, every byte again
        checked.clear()
        for lay in plan.rollouts:
            for a in bufs[lay.worker.rank].values():
                a[...] = 0
        update(v)
        assert checked == []
        for lay in plan.rollouts:
            want = buffers_for(plan, lay.worker.rank, fill=True)
            for k, a in want.items():
                np.testing.assert_array_equal(bufs[lay.worker.rank][k].view(np.uint8),
                                              a.view(np.uint8))
    r = plan.rollouts[0].worker.rank
    k = next(iter(bufs[r]))
    bufs[r][k] = bufs[r][k].copy()  # a new array: checked again
    checked.clear()
    update(3)
    assert checked == [r]
    bufs[r][k].dtype = np.int32 if bufs[r][k].dtype == np.float32 else np.float32  # in place
    with pytest.raises(wb.TransferError, match="refusing before any byte moves"):
        programs[r].run(bufs[r], transports[r], tag_base=4 << 32, timeout=1)
    _each(ranks, lambda r: transports[r].close())


def test_programs_are_values_their_owners_hold(plan):
    """No cache behind the caller's back: each Program is made by whoever runs it and holds only
    its own rank's part; an unknown rank has no part (refused with the plan's ranks)."""
    a, b = Program(RankPlan.of(plan, 0)), Program(RankPlan.of(plan, 0))
    assert a is not b and a.messages.keys() == b.messages.keys()
    assert all(g.peer != 0 or g.local for g in a.messages.values())
    M = plan.messages
    assert sorted(a.messages) == np.flatnonzero((M.src_rank == 0) | (M.dst_rank == 0)).tolist()
    with pytest.raises(wb.PlanError, match=r"rank 99 has no layout in this plan \(ranks"):
        RankPlan.of(plan, 99)


def test_trace_times_every_message_of_the_rank_in_order(plan):
    traces = {}
    _run_threads(plan, 1 << 20, traces=traces)
    M = plan.messages
    done_at = {}
    for r, rows in traces.items():
        mine = np.flatnonzero((M.src_rank == r) | (M.dst_rank == r))
        assert sorted(row[0] for row in rows) == mine.tolist()
        for m, stage, peer, out, nbytes, ready, posted, done in rows:
            assert stage == M.stage[m] and nbytes == M.nbytes[m]
            assert peer == (M.dst_rank[m] if out else M.src_rank[m])
            assert ready <= posted <= done
            if not out:
                done_at[m] = done
    for rows in traces.values():  # a forward is ready only once what it forwards has landed
        for m, _, _, out, _, ready, _, _ in rows:
            if out and M.parent[m] >= 0:
                assert ready >= done_at[int(M.parent[m])]


class _SlowEvent:
    """Stands for a CUDA event: ``done`` only from its fourth query on."""

    made: list = []

    def __init__(self):
        type(self).made.append(self)
        self.queries = 0

    @property
    def done(self) -> bool:
        self.queries += 1
        return self.queries > 3


@pytest.mark.timeout(120)
def test_device_work_waits_for_its_event(strided_plan, monkeypatch):
    """The CUDA path's deferrals, on host buffers: every pack, unpack and local copy is followed by
    an event the loop polls; a send is posted, and a message counts as landed, only once it passed.
    Everything still arrives, bit for bit."""
    import wb.runtime.engine.movers

    monkeypatch.setattr(wb.runtime.engine.movers, "fencer", lambda xp: _SlowEvent)
    _SlowEvent.made = []
    bufs, stats = _run_threads(strided_plan, 256 << 20)
    for lay in strided_plan.rollouts:
        want = buffers_for(strided_plan, lay.worker.rank, fill=True)
        np.testing.assert_array_equal(bufs[lay.worker.rank]["w"], want["w"])
    # every message (or frame of small ones) of this plan is packed at its sender and unpacked
    # at its receiver, and the loop waited for each of those events to pass
    units = sum(len(Program(RankPlan.of(strided_plan, r)).units) for r in strided_plan.ranks)
    assert len(_SlowEvent.made) == units
    assert all(ev.queries >= 4 for ev in _SlowEvent.made)


class _Req:
    def __init__(self):
        self.finished = False

    def done(self):
        return self.finished


def test_inflight_polls_the_heads_and_finds_late_ones_on_a_full_sweep():
    from wb.runtime.engine.program import Message
    from wb.runtime.engine.inflight import Inflight

    inf = Inflight()
    reqs = [_Req() for _ in range(40)]
    for i, r in enumerate(reqs):  # 2 peers x 20 receives, in posting order
        inf.add(r, Message(i, 1, i % 2, 8, None, -1, True, True, False, False), None)
    assert len(inf) == 40 and inf.completed(full=False) == []
    reqs[0].finished = reqs[1].finished = True  # the heads complete: a window poll sees them
    assert sorted(g.m for _, g, _ in inf.completed(full=False)) == [0, 1]
    reqs[39].finished = True  # far behind its peer's head: only a full sweep looks there
    assert inf.completed(full=False) == []
    assert [g.m for _, g, _ in inf.completed(full=True)] == [39] and len(inf) == 37


def test_inflight_takes_a_whole_burst_of_completions_in_one_poll():
    from wb.runtime.engine.program import Message
    from wb.runtime.engine.inflight import Inflight

    inf = Inflight()
    reqs = [_Req() for _ in range(40)]
    for i, r in enumerate(reqs):  # one peer's receives, in posting order
        inf.add(r, Message(i, 1, 0, 8, None, -1, True, True, False, False), None)
    for r in reqs[:33]:  # a burst of 33, in order
        r.finished = True
    got = [g.m for _, g, _ in inf.completed(full=False)]
    assert got == list(range(33)) and len(inf) == 7


@pytest.mark.parametrize("which", ["plan", "strided_plan"])
def test_mapped_of_marks_exactly_the_mapped_elements(which, request):
    from harness.multiproc import mapped_of

    p = request.getfixturevalue(which)
    for lay in (*p.trainers, *p.rollouts):
        got = mapped_of(lay)
        for name, b in lay.buffers.items():
            want = b.sourcemap.to_indices() >= 0  # the oracle: one id per element
            np.testing.assert_array_equal(got[name], want)


def test_mapped_of_leaves_padding_unmapped():
    from harness.multiproc import mapped_of

    ids = np.arange(40 * 24).reshape(40, 24).T.copy()  # transposed kernel: strided blocks
    ids[:, 30:] = -1  # padded vocabulary rows: no source
    ids[5, 3] = -1
    lay = wb.Layout(wb.Worker(0, "t0", "trainer"),
                    {"w": wb.BufferSpec(wb.SourceMap.from_indices(ids), "bfloat16")})
    got = mapped_of(lay)["w"]
    np.testing.assert_array_equal(got, ids >= 0)
    assert 0 < got.sum() < got.size


def test_staged_receives_land_every_message_through_staging(plan):
    """``stage_receives`` (a Receiver whose buffers are new device memory every version): no
    receive lands straight in the buffers; every one is staged and unpacked, bit-identical."""
    hub = LocalHub()
    bufs = {r: buffers_for(plan, r, fill=r < len(plan.trainers)) for r in plan.ranks}
    progs = {r: Program(RankPlan.of(plan, r), stage_receives=r >= len(plan.trainers)) for r in plan.ranks}
    assert any(Program(RankPlan.of(plan, r)).zero_copy_receives for r in progs)  # the plan has some
    stats = {}

    def run(r):
        prog, t = progs[r], LocalTransport(r, hub, timeout=20)
        connect(prog.part, t)
        stats[r] = prog.run(bufs[r], t, staging_bytes=1 << 16, timeout=20)
        t.close()
    assert not run_each(run, plan.ranks)
    for lay in plan.rollouts:
        r = lay.worker.rank
        assert progs[r].zero_copy_receives == [] and progs[r].staged_receives
        assert stats[r].staging_peak > 0
        for k, a in buffers_for(plan, r, fill=True).items():
            np.testing.assert_array_equal(bufs[r][k].view(np.uint8), a.view(np.uint8))


@pytest.mark.timeout(120)
def test_sends_from_a_buffer_still_being_written_wait_for_its_event(plan):
    """``ready`` (an FP8 quantiser's events, per buffer it writes): a message sent straight from
    such a buffer is posted only once that buffer's event has passed, while the other buffers'
    messages go at once; everything arrives, bit for bit."""
    trainer = plan.trainers[0].worker.rank
    part = RankPlan.of(plan, trainer)
    prog = Program(part, frames=False)  # small messages apart: sent straight from the buffers
    names = list(part.layout.buffers)
    slow = set(names[::2])  # every other buffer is "still being written"
    events = {n: _SlowEvent() for n in slow}
    posted: list[tuple[int, bool]] = []  # (message, its buffer's event had passed)
    T = part.transfers

    class Watching(LocalTransport):
        def send(self, peer, buf, tag):
            g = prog.units[int(tag) & 0xFFFFFFFF]
            name = prog.slot_buf[T.src_slot[g.ts[0]]]
            if g.zc_src and name in slow:
                posted.append((g.m, events[name].queries > 3))
            return super().send(peer, buf, tag)

    hub = LocalHub()
    bufs = {r: buffers_for(plan, r, fill=r < len(plan.trainers)) for r in plan.ranks}

    def run(r):
        t = (Watching if r == trainer else LocalTransport)(r, hub, timeout=20)
        p = prog if r == trainer else Program(RankPlan.of(plan, r), frames=False)
        connect(p.part, t)
        p.run(bufs[r], t, timeout=20, ready=events if r == trainer else None)
        t.close()
    assert not run_each(run, plan.ranks)
    assert posted and all(ok for _, ok in posted), posted  # none went before its event passed
    _assert_rollouts_hold_the_checkpoint(plan, bufs)


def test_sends_a_transport_cannot_read_in_place_leave_from_staging(plan):
    """``stage_send`` (the UCX transport's, for CUDA memory without an IPC handle, as JAX's is):
    every message it names leaves from staging, never from the buffer itself; the ones it does
    not name still leave in place, asked once per message while the buffers stay the same; what
    arrives is bit-identical."""
    trainer = plan.trainers[0].worker.rank
    prog = Program(RankPlan.of(plan, trainer), frames=False)
    hub = LocalHub()
    bufs = {r: buffers_for(plan, r, fill=r < len(plan.trainers)) for r in plan.ranks}
    mine = [b for b in bufs[trainer].values()]
    asked: list[int] = []
    sent: dict[int, bool] = {}  # zero-copy message -> whether it left from the buffer itself

    class Staging(LocalTransport):
        def stage_send(self, peer, buf):
            asked.append(peer)
            return peer % 2 == 1  # odd peers' messages from staging

        def send(self, peer, buf, tag):
            g = prog.units[int(tag) & 0xFFFFFFFF]
            if g.zc_src:
                sent[g.m] = any(np.shares_memory(buf, b) for b in mine)
            return super().send(peer, buf, tag)

    def run(r):
        t = (Staging if r == trainer else LocalTransport)(r, hub, timeout=20)
        p = prog if r == trainer else Program(RankPlan.of(plan, r), frames=False)
        connect(p.part, t)
        for _ in range(2):  # the same buffers again: the answers are kept
            p.run(bufs[r], t, staging_bytes=1 << 16, timeout=20)
        t.close()
    assert not run_each(run, plan.ranks)
    zc = [g for g in prog.units.values() if g.zc_src and not g.local]
    assert {g.peer % 2 for g in zc} == {0, 1}  # the plan has both kinds
    assert sent == {g.m: g.peer % 2 == 0 for g in zc}
    assert len(asked) == len(zc)  # once per message, not once per update
    _assert_rollouts_hold_the_checkpoint(plan, bufs)


def test_a_transport_that_cannot_tell_yet_is_asked_again_next_update(plan):
    """``stage_send`` answering ``None`` (a peer whose job-key challenge is still running): the
    message leaves from the buffer and the answer is not kept; the next update asks again and
    follows the answer it then gets (staging)."""
    trainer = plan.trainers[0].worker.rank
    prog = Program(RankPlan.of(plan, trainer), frames=False)
    hub = LocalHub()
    bufs = {r: buffers_for(plan, r, fill=r < len(plan.trainers)) for r in plan.ranks}
    mine = list(bufs[trainer].values())
    update = [0]
    in_place: dict[int, list[bool]] = {0: [], 1: []}  # update -> zero-copy sends' sources

    class Settling(LocalTransport):
        def stage_send(self, peer, buf):
            return None if update[0] == 0 else True

        def send(self, peer, buf, tag):
            if prog.units[int(tag) & 0xFFFFFFFF].zc_src:
                in_place[update[0]].append(any(np.shares_memory(buf, b) for b in mine))
            return super().send(peer, buf, tag)

    def run(r):
        t = (Settling if r == trainer else LocalTransport)(r, hub, timeout=20)
        p = prog if r == trainer else Program(RankPlan.of(plan, r), frames=False)
        connect(p.part, t)
        for v in range(2):
            p.run(bufs[r], t, staging_bytes=1 << 16, timeout=20, tag_base=v << 32)
            if r == trainer:
                update[0] = 1
        t.close()
    assert not run_each(run, plan.ranks)
    assert in_place[0] and all(in_place[0])  # not known: from the buffers
    assert in_place[1] and not any(in_place[1])  # then staged
    _assert_rollouts_hold_the_checkpoint(plan, bufs)


def _assert_rollouts_hold_the_checkpoint(plan, bufs):
    """Every rollout buffer in ``bufs`` is bit for bit what the plan fills it with."""
    for lay in plan.rollouts:
        for k, a in buffers_for(plan, lay.worker.rank, fill=True).items():
            np.testing.assert_array_equal(bufs[lay.worker.rank][k].view(np.uint8),
                                          a.view(np.uint8))


@pytest.fixture(scope="module")
def long_strided_plan():
    """As ``strided_plan``, 2048 x 2048 and in pieces too big to frame: 30 packed sends per
    trainer, of three sizes."""
    n = 2048
    w = np.arange(n * n).reshape(n, n)

    def buf(ids):
        return {"w": wb.BufferSpec(wb.SourceMap.from_indices(np.ascontiguousarray(ids)),
                                   "float32")}
    h = n // 2
    trainers = [wb.Layout(wb.Worker(r, "t0", "trainer", local_rank=r), buf(w[h * r:h * r + h]))
                for r in range(2)]
    rollouts = [wb.Layout(wb.Worker(2 + 2 * k + g, f"r{k}", "rollout", local_rank=g),
                          buf(w[:, h * g:h * g + h].T)) for k in range(2) for g in range(2)]
    p = wb.plan(trainers, rollouts, chunk_bytes=270_000)
    p.verify()
    return p


@pytest.mark.timeout(120)
@pytest.mark.parametrize("staging_bytes", [1, 1 << 20, 256 << 20])
def test_packed_sends_go_in_runs_of_one_kind(long_strided_plan, monkeypatch, staging_bytes):
    """A mover that packs several messages in one launch (as the CUDA one does) is given runs of
    at most STAGES consecutive packed sends of one kind, each message once; whatever the budget,
    every byte still arrives."""
    strided_plan = long_strided_plan
    from wb.runtime.engine.gather import STAGES
    from wb.runtime.engine.movers import HostMover

    runs = []

    def pack_many(self, gs):
        runs.append([(self.prog.rank, g.m, self.batches(g)) for g in gs])
        return [self.pack(g) for g in gs]
    monkeypatch.setattr(HostMover, "batches", lambda self, g: g.nbytes % 3, raising=False)
    monkeypatch.setattr(HostMover, "pack_many", pack_many)
    bufs, _ = _run_threads(strided_plan, staging_bytes)
    _assert_rollouts_hold_the_checkpoint(strided_plan, bufs)
    assert all(1 <= len(run) <= STAGES and len({k for *_, k in run}) == 1 for run in runs)
    packed = [(r, m) for run in runs for r, m, _ in run]
    sends = [(r, m) for r in strided_plan.ranks
             for m, g in Program(RankPlan.of(strided_plan, r)).units.items() if g.out]
    assert sorted(packed) == sorted(sends)  # every send of this plan is packed, once
    if staging_bytes == 256 << 20:  # room for them all: runs of several
        assert max(len(run) for run in runs) > 1


def test_device_runs_stay_in_fixed_groups_of_the_schedule(long_strided_plan):
    """The CUDA mover's kinds (asked on the host: they need no device): a send's element width
    and its group, STAGES of this rank's sends in schedule order a group, so a run and the table
    made for it are one of a bounded few; converting sends go alone."""
    from wb.runtime.engine.gather import STAGES
    from wb.runtime.engine.movers import DeviceMover

    prog = Program(RankPlan.of(long_strided_plan, 0))
    mover = DeviceMover(prog, {}, np)
    outs = sorted((prog.when[m], m) for m, g in prog.units.items() if g.out)
    kinds = [mover.batches(prog.units[m]) for _, m in outs]
    assert [k[1] for k in kinds] == [i // STAGES for i in range(len(outs))]
    assert {k[0] for k in kinds} == {4}  # float32
    g = prog.units[outs[0][1]]
    g.conv, was = True, g.conv
    try:
        assert mover.batches(g) is None
    finally:
        g.conv = was
