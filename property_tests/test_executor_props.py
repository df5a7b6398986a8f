"""Property: the executor delivers every plan bit-exactly, whatever its staging bound (no
deadlock), with every rank a thread over the in-process transport."""

import threading

import numpy as np
from hypothesis import given, settings, strategies as st

import wb
from wb.data.plan import RankPlan
from wb.runtime.engine.executor import execute
from wb.testing import strategies as wbst
from harness.multiproc import buffers_for
from wb.runtime.transport.local import LocalHub, LocalTransport


@settings(max_examples=25, deadline=None)
@given(wbst.layouts(), st.integers(8, 512), st.integers(1, 600))
def test_execute_is_exact_under_any_bounds(case, chunk, staging):
    p = wb.plan(case.trainers, case.rollouts, chunk_bytes=chunk)
    hub = LocalHub()
    bufs = {lay.worker.rank: buffers_for(p, lay.worker.rank, fill=True) for lay in case.trainers}
    bufs.update({lay.worker.rank: buffers_for(p, lay.worker.rank, fill=False)
                 for lay in case.rollouts})
    errors = []

    def run(rank):
        try:
            execute(RankPlan.of(p, rank), bufs[rank], LocalTransport(rank, hub, timeout=20),
                    staging_bytes=staging, timeout=20)
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append((rank, e))

    threads = [threading.Thread(target=run, args=(r,)) for r in bufs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for lay in case.rollouts:
        want = buffers_for(p, lay.worker.rank, fill=True)
        for k, v in bufs[lay.worker.rank].items():
            assert np.array_equal(v.view(np.uint8), want[k].view(np.uint8))


@settings(max_examples=40, deadline=None)
@given(wbst.layouts(), st.integers(8, 4096))
def test_sender_and_receiver_cut_the_same_frames(case, chunk):
    """Both ends of a pair cut the same frames from their own parts (nothing tells one how the
    other framed): each frame of a sender is a frame of its receiver, member for member; its
    members share the parent and the travelling dtype, each is small, and together they fit a
    frame."""
    from wb.runtime.engine.frames import FRAME_BYTES, FRAME_MEMBER_BYTES, Frame
    from wb.runtime.engine.program import Program

    p = wb.plan(case.trainers, case.rollouts, chunk_bytes=chunk)
    progs = {r: Program(RankPlan.of(p, r)) for r in p.ranks}
    M = p.messages
    for r, prog in progs.items():
        for m, u in prog.units.items():
            if u.__class__ is not Frame:
                continue
            ms = [g.m for g in u.members]
            assert len(ms) >= 2 and u.nbytes <= FRAME_BYTES
            assert all(M.nbytes[k] <= FRAME_MEMBER_BYTES for k in ms)
            assert len({int(M.parent[k]) for k in ms}) == 1
            assert len({(int(M.src_rank[k]), int(M.dst_rank[k])) for k in ms}) == 1
            assert len({g.wire for g in u.members}) == 1
            other = progs[u.peer].units.get(m)
            assert other.__class__ is Frame and [g.m for g in other.members] == ms
            assert other.out != u.out
