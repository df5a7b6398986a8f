"""Property: over any plan, whatever its staging bound, one bit flipped on the wire in any one
message is refused (``wb.ChecksumError``) by every rank its bytes reach, directly or through
forwards, and every rank that accepts the version holds exactly the trainers' weights; with no
flip, every plan finishes checked and exact."""

import numpy as np
from hypothesis import given, settings, strategies as st

import wb
from harness.multiproc import buffers_for
from harness.threads import run_each
from wb.data.plan import RankPlan
from wb.runtime.engine.executor import execute
from wb.runtime.engine.program import Program
from wb.runtime.transport.local import LocalHub, LocalTransport
from wb.testing import strategies as wbst


class _Flip:
    """Sends the unit tagged ``m`` with its first byte's bit 2 flipped."""

    def __init__(self, inner, m):
        self.inner, self.m, self.rank, self.checksums = inner, m, inner.rank, True

    def send(self, peer, buf, tag):
        if tag == self.m:
            buf = buf.copy()
            buf[0] ^= 4
        return self.inner.send(peer, buf, tag)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@settings(max_examples=30, deadline=None)
@given(wbst.layouts(), st.integers(8, 512), st.integers(1, 600), st.data())
def test_one_flipped_message_is_refused_wherever_it_reaches(case, chunk, staging, data):
    p = wb.plan(case.trainers, case.rollouts, chunk_bytes=chunk)
    M = p.messages
    units = [(r, m) for r in p.ranks
             for m, g in Program(RankPlan.of(p, r), checksums=True).units.items()
             if g.out and not g.local and g.nbytes]
    flip = data.draw(st.sampled_from(units)) if units and data.draw(st.booleans()) else None
    hub = LocalHub()
    bufs = {r: buffers_for(p, r, fill=r in {lay.worker.rank for lay in case.trainers})
            for r in p.ranks}

    def run(r):
        t = LocalTransport(r, hub, timeout=20)
        execute(RankPlan.of(p, r), bufs[r], _Flip(t, flip[1]) if flip and flip[0] == r else t,
                staging_bytes=staging, timeout=20)
    errors = run_each(run, p.ranks)
    assert all(isinstance(e, wb.ChecksumError) for e in errors.values()), errors
    reached, todo = set(), [flip[1]] if flip else []
    while todo:  # the flipped message's receiver, and the receivers of its forwards
        k = todo.pop()
        reached.add(int(M.dst_rank[k]))
        todo += np.flatnonzero(M.parent == k).tolist()
    assert set(errors) >= reached, (flip, reached, errors)
    for lay in case.rollouts:
        r = lay.worker.rank
        if r not in errors:
            want = buffers_for(p, r, fill=True)
            assert all(np.array_equal(v.view(np.uint8), want[k].view(np.uint8))
                       for k, v in bufs[r].items()), (flip, r)
