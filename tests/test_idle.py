"""The idle loop's waiting (wb.runtime.engine.idle) against a fake clock: it spins, then sleeps
twice as long each turn up to its cap; sleeps that come back late (a crowded host) make it spin
less and sleep up to the longer cap, and sleeps on time bring the short cap back; on a host of
many cores (a GPU host's) it keeps the short cap."""

from __future__ import annotations

import pytest

from wb.runtime.engine import idle as idle_mod
from wb.runtime.engine.idle import (CROWDED_LATE_S, IDLE_CROWDED_S, IDLE_MAX_S, SPIN_TURNS,
                                    SPIN_TURNS_CROWDED, Idle)


class _Clock:
    """``time`` for the module: each sleep takes what it asked plus ``late``."""

    def __init__(self):
        self.t, self.late, self.naps = 0.0, 0.0, []

    def monotonic(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.naps.append(s)
        self.t += s + (self.late if s else 0.0)


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(idle_mod, "time", c)
    return c


def _turns(w: Idle, clock: _Clock, n: int) -> list[float]:
    start = len(clock.naps)
    for _ in range(n):
        w.wait()
    return clock.naps[start:]


def test_it_spins_then_doubles_its_sleeps_up_to_the_cap(clock):
    w = Idle()
    naps = _turns(w, clock, SPIN_TURNS + 40)
    assert naps[:SPIN_TURNS - 1] == [0] * (SPIN_TURNS - 1)
    slept = [s for s in naps if s]
    assert slept[0] == pytest.approx(1e-5)
    assert all(b == pytest.approx(min(2 * a, IDLE_MAX_S)) for a, b in zip(slept, slept[1:]))
    assert slept[-1] == IDLE_MAX_S
    w.reset()
    assert _turns(w, clock, 1) == [0]  # progress: spinning again


def test_late_sleeps_make_it_spin_less_and_sleep_longer_until_they_come_back_on_time(clock):
    w = Idle(crowdable=True)
    clock.late = 2 * CROWDED_LATE_S
    _turns(w, clock, SPIN_TURNS + 40)
    assert (w.spin, w.most) == (SPIN_TURNS_CROWDED, IDLE_CROWDED_S)
    assert max(clock.naps) == IDLE_CROWDED_S > IDLE_MAX_S
    w.reset()
    naps = _turns(w, clock, 3)
    assert naps[0] == 0 and naps[SPIN_TURNS_CROWDED - 1] > 0  # spins less
    clock.late = 0.0
    _turns(w, clock, 40)
    assert (w.spin, w.most) == (SPIN_TURNS, IDLE_MAX_S)
    assert clock.naps[-1] == IDLE_MAX_S


def test_a_host_of_many_cores_keeps_its_short_sleeps_however_late(clock):
    w = Idle(crowdable=False)
    clock.late = 10 * CROWDED_LATE_S
    _turns(w, clock, SPIN_TURNS + 40)
    assert (w.spin, w.most) == (SPIN_TURNS, IDLE_MAX_S)
    assert max(clock.naps) == IDLE_MAX_S


def test_a_loop_on_a_host_of_many_cores_sleeps_with_a_fine_timer_slack():
    """Its thread's timer slack is set to TIMER_SLACK_NS (Linux: read back with prctl), in the
    thread that waits; a crowdable loop's thread keeps the slack it had."""
    import ctypes
    import sys
    import threading

    if not sys.platform.startswith("linux"):
        pytest.skip("timer slack is Linux's")
    libc = ctypes.CDLL(None, use_errno=True)
    got = {}

    def run(crowdable):
        libc.prctl(29, 50_000, 0, 0, 0)  # PR_SET_TIMERSLACK: Linux's default (threads inherit)
        before = libc.prctl(30, 0, 0, 0, 0)  # PR_GET_TIMERSLACK
        Idle(crowdable=crowdable)
        got[crowdable] = (before, libc.prctl(30, 0, 0, 0, 0))

    for crowdable in (False, True):
        t = threading.Thread(target=run, args=(crowdable,))
        t.start()
        t.join()
    assert got[False][1] == idle_mod.TIMER_SLACK_NS != got[False][0]
    assert got[True][1] == got[True][0]
