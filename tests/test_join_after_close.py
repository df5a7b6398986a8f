"""A rollout that asks to join a session whose trainers have closed is told so at once, instead
of waiting out its join timeout for a push that never comes (a rollout restarted after training
ended: seen as a hang of a Ray example under load); a new Sender of the session takes joiners
again. In-process workers (threads, :class:`LocalTransport`)."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import wb
from wb.runtime.membership.joining import request_join
from wb.runtime.transport.local import LocalHub, LocalTransport
from wb.runtime.transport.stores import MemoryStore


def _plan():
    """One trainer holding everything -> two rollout nodes of one worker each."""
    ids = np.arange(8 * 12).reshape(8, 12)
    buf = wb.BufferSpec(wb.SourceMap.from_indices(ids), "float32")
    trainer = wb.Layout(wb.Worker(0, "t0", "trainer", 0), {"w": buf})
    rollouts = [wb.Layout(wb.Worker(r, f"r{r}", "rollout", 0), {"w": buf}) for r in (1, 2)]
    return wb.plan([trainer], rollouts, chunk_bytes=64)


def _job(plan, store):
    """A Sender and two Receivers on ``store`` (made at once: each connects to its peers)."""
    hub = LocalHub()
    weights = {"w": np.arange(96, dtype=np.float32).reshape(8, 12)}
    kw = dict(store=store, timeout=20)
    with ThreadPoolExecutor(3) as pool:
        tx = pool.submit(wb.Sender, plan, 0, weights, transport=LocalTransport(0, hub), **kw)
        rxs = [pool.submit(wb.Receiver, plan, r, {"w": np.zeros((8, 12), np.float32)},
                           transport=LocalTransport(r, hub), wait_timeout=20, **kw)
               for r in (1, 2)]
        return weights, tx.result(), [f.result() for f in rxs]


def _one_version(plan, store):
    """:func:`_job`, version 1 pushed and applied by both rollouts."""
    weights, tx, rxs = _job(plan, store)
    tx.push()
    for rx in rxs:
        rx.apply()
    return weights, tx, rxs


def _ask(store, layout, timeout: float) -> tuple[BaseException | None, float]:
    """``request_join`` in a thread: what it raised, and after how many seconds."""
    out: list = [None, 0.0]

    def run():
        t0 = time.monotonic()
        try:
            request_join(store, layout, timeout=timeout)
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out[0] = e
        out[1] = time.monotonic() - t0
    t = threading.Thread(target=run)
    t.start()
    t.join(timeout + 10)
    assert not t.is_alive(), "request_join did not return"
    return out[0], out[1]


def test_a_join_after_the_trainers_closed_fails_at_once_and_a_new_sender_takes_joiners():
    plan, store = _plan(), MemoryStore()
    weights, tx, rxs = _job(plan, store)
    for v in (1, 2):
        weights["w"] *= -2
        tx.push()
        for rx in rxs:
            assert rx.apply() == v
            assert np.array_equal(rx.buffers["w"], weights["w"])
    for w in (tx, *rxs):
        w.close()

    # rank 2's process restarted after training ended: told at once, the version named
    err, took = _ask(store, plan.layout_of(2), timeout=60)
    assert isinstance(err, wb.TransferError), err
    assert "closed after version 2" in str(err) and "rank 2" in str(err), err
    assert took < 5, took

    # the session's trainers start again: a join waits to be admitted (nobody pushes here, so
    # it runs into its own timeout), it is not refused as closed
    weights, tx, rxs = _job(plan, store)
    err, took = _ask(store, plan.layout_of(2), timeout=1.5)
    assert isinstance(err, wb.TransferError) and "not admitted" in str(err), err
    assert "closed" not in str(err)
    for w in (tx, *rxs):
        w.close()


def test_a_rollout_waiting_to_join_is_told_when_the_trainers_close():
    """Asked while the job ran, never admitted (no push came), then the trainers closed."""
    plan, store = _plan(), MemoryStore()
    weights, tx, rxs = _one_version(plan, store)
    got: list = []
    t = threading.Thread(target=lambda: got.append(_ask(store, plan.layout_of(2), timeout=60)))
    t.start()
    time.sleep(1.0)  # the request stands, unanswered: no version is pushed
    assert t.is_alive()
    t0 = time.monotonic()
    for w in (tx, *rxs):
        w.close()
    t.join(30)
    assert got, "request_join did not return"
    err, _ = got[0]
    assert isinstance(err, wb.TransferError) and "closed after version 1" in str(err), err
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("last", [0, 7])
def test_the_close_record_names_the_last_version(last):
    from wb.runtime.membership.joining import mark_pushing

    store = MemoryStore()
    lay = _plan().layout_of(1)
    mark_pushing(store, "wb", last)
    err, _ = _ask(store, lay, timeout=10)
    assert f"closed after version {last}" in str(err)
    mark_pushing(store, "wb", None)  # pushing again: the join waits for its admission
    err, took = _ask(store, lay, timeout=1.0)
    assert "not admitted" in str(err) and took >= 1.0


def test_a_join_request_is_planned_before_the_next_push_and_admitted_at_it():
    """The leader looks for join requests between pushes: the joiner's plan is made while the
    trainers train, and the next push admits it (a 1T job's plan takes seconds, longer than a
    push waits for one)."""
    from wb.runtime.transport.stores import get_large

    plan, store = _plan(), MemoryStore()
    weights, tx, rxs = _one_version(plan, store)
    got: list = []

    def ask():
        got.append(request_join(store, plan.layout_of(2), timeout=30))
    t = threading.Thread(target=ask)
    t.start()
    # no push meanwhile: the parts of the plan with rank 2 fed apart appear all the same
    part = wb.RankPlan.from_bytes(get_large(store, "wb/epoch/1/part/2", 5.0))
    assert part.rank == 2
    assert t.is_alive()  # admitted only by a push
    tx.push()
    t.join(10)
    assert got and got[0].first == 2 and got[0].epoch == 1, got
    for w in (tx, *rxs):
        w.close()
