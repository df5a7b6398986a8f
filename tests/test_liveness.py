"""Heartbeats through the store: a beating worker is never called silent, a stopped one is after
its grace, and a stalled update names a silent peer long before its inactivity timeout."""

import time

import numpy as np
import pytest

import wb
from wb.data.plan import RankPlan
from wb.runtime.membership.liveness import Heartbeat, Watch
from wb.runtime.engine.program import Program
from wb.runtime.transport.stores import DirectoryStore, MemoryStore
from wb.runtime.transport.local import LocalHub, LocalTransport


def _poll(watch, peers, seconds):
    """Every answer of ``watch.silent(peers)`` over ``seconds``."""
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        out.append(watch.silent(peers))
        time.sleep(0.02)
    return out


@pytest.mark.parametrize("store", [MemoryStore, DirectoryStore])
def test_a_beating_worker_is_never_silent_and_a_stopped_one_is_after_its_grace(store, tmp_path):
    s = store(tmp_path) if store is DirectoryStore else store()
    hb = Heartbeat(s, "alive/0", interval=0.05)
    watch = Watch(s, lambda r: f"alive/{r}", grace=0.4)
    try:
        assert all(a == {} for a in _poll(watch, [0], 1.2))  # three graces, always beating
    finally:
        hb.stop()
    stopped = time.monotonic()
    answers = _poll(watch, [0], 3.0)
    silent_at = next(i for i, a in enumerate(answers) if a)  # it is called silent ...
    assert all(0 in a for a in answers[silent_at:])  # ... and stays silent
    assert answers[silent_at][0] > 0.4 and time.monotonic() - stopped >= 0.4


def test_a_watch_that_looked_away_times_silence_from_the_last_beat_not_its_next_look():
    """The leader looks during versions only. A peer seen beating, then killed while nobody
    looked: at the first look after the pause its last beat is placed on the watcher's clock by
    the peer's own clock, so it is silent at once (the pause was longer than the grace), not a
    whole grace after that look; a peer that goes on beating is never silent."""
    s = MemoryStore()
    dead, alive = Heartbeat(s, "alive/0", interval=0.05), Heartbeat(s, "alive/1", interval=0.05)
    watch = Watch(s, lambda r: f"alive/{r}", grace=0.4)
    try:
        for _ in range(5):  # a version: the watch looks at both a few times
            assert watch.silent([0, 1]) == {}
            time.sleep(0.03)
        dead.stop()
        gone = time.monotonic()
        time.sleep(0.6)  # between versions: nobody looks
        first_look = watch.silent([0, 1])
        assert set(first_look) == {0}, first_look
        assert 0.4 < first_look[0] <= time.monotonic() - gone + 0.1, first_look
    finally:
        alive.stop()


def test_a_following_watch_times_a_death_from_the_last_beat_though_never_asked_before():
    """The trainers' leader follows its members between versions: a peer it was never asked
    about, killed while its owner asked nothing, is silent at the owner's first question (timed
    from its last beat, within a beat and a look), where a watch that does not follow would
    count from that question; a peer that goes on beating is never silent."""
    s = MemoryStore()
    dead, alive = Heartbeat(s, "alive/0", interval=0.05), Heartbeat(s, "alive/1", interval=0.05)
    following = Watch(s, lambda r: f"alive/{r}", grace=0.4)
    plain = Watch(s, lambda r: f"alive/{r}", grace=0.4)
    following.follow(lambda: [0, 1], every=0.02)
    try:
        time.sleep(0.3)
        dead.stop()
        gone = time.monotonic()
        time.sleep(0.6)
        first = following.silent([0, 1])
        waited = time.monotonic() - gone
        assert set(first) == {0}, first
        assert waited - 0.05 - 0.02 - 0.02 <= first[0] <= waited + 0.05, (first, waited)
        assert plain.silent([0, 1]) == {}  # never asked before: counts from now
    finally:
        following.stop()
        alive.stop()


def test_a_peer_that_never_beat_is_silent_a_grace_after_first_asked():
    watch = Watch(MemoryStore(), lambda r: f"alive/{r}", grace=0.3)
    assert watch.silent([7]) == {}
    time.sleep(0.4)
    assert set(watch.silent([7])) == {7}


def test_a_shorter_grace_for_one_call_suspects_a_peer_early_and_changes_nothing_else():
    s = MemoryStore()
    s.set("alive/1", b"x:1:0.0:")
    watch = Watch(s, lambda r: f"alive/{r}", grace=0.6)
    assert watch.silent([1]) == {}
    time.sleep(0.25)
    assert list(watch.silent([1], grace=0.2)) == [1]  # suspected (the leader plans ahead)
    assert watch.silent([1]) == {}  # not dead by the watch's own grace
    s.set("alive/1", f"x:2:{time.monotonic():.3f}:".encode())  # it beats again: neither
    assert watch.silent([1], grace=0.2) == {} and watch.silent([1]) == {}
    time.sleep(0.65)
    assert list(watch.silent([1])) == [1]


def test_a_stalled_update_names_the_silent_peer_before_its_timeout():
    """Rank 1 receives from rank 0, which never runs and never beats: with a 60 s inactivity
    timeout, the update fails after ASK_AFTER_S plus the grace, naming rank 0."""
    w = np.arange(24, dtype=np.int64).reshape(4, 6)
    t = wb.Layout(wb.Worker(0, "t", "trainer"),
                  {"w": wb.BufferSpec(wb.SourceMap.from_indices(w), "float32")})
    r = wb.Layout(wb.Worker(1, "r", "rollout"),
                  {"w": wb.BufferSpec(wb.SourceMap.from_indices(w), "float32")})
    p = wb.plan([t], [r])
    watch = Watch(MemoryStore(), lambda k: f"alive/{k}", grace=0.3)
    t0 = time.monotonic()
    with pytest.raises(wb.TransferError, match=r"peer 0 \(\d+\.\d s\) stopped beating"):
        Program(RankPlan.of(p, 1)).run({"w": np.zeros((4, 6), np.float32)}, LocalTransport(1, LocalHub()),
                          timeout=60, liveness=watch)
    assert time.monotonic() - t0 < 30  # the watch, not the 60 s timeout


class _LossyStore(MemoryStore):
    """Forgets keys now and then (a store that restarted, or dropped a write), seeded."""

    def __init__(self, seed: int):
        super().__init__()
        self._rng = np.random.default_rng(seed)

    def get(self, key: str, timeout: float) -> bytes:
        if self._rng.random() < 0.3:
            with self._cv:
                self._data.pop(key, None)  # lost: the next beat writes it again
        return super().get(key, timeout)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_store_that_loses_keys_does_not_make_a_beating_peer_silent(seed):
    s = _LossyStore(seed)
    hb = Heartbeat(s, "alive/0", interval=0.05)
    watch = Watch(s, lambda r: f"alive/{r}", grace=0.4)
    try:
        assert all(a == {} for a in _poll(watch, [0], 1.5))
    finally:
        hb.stop()
    assert any(_poll(watch, [0], 2.0))  # and a stopped one is still found
