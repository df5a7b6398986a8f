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
