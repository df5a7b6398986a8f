"""How an update's loop waits when a turn made no progress: it spins a few turns (a completion
is often a turn away), then sleeps longer each turn, up to a cap.

The cap is what a message arriving then waits: short on a GPU host's many cores, longer where
cores are few and ranks would starve. On a crowded host (more ranks want the cores than there
are, as 41 processes on 2 cores), a sleep comes back late: there each turn of an idle rank is
CPU that a rank with work waits for, so the wait spins less and sleeps longer. Measured there
(4 rollout replicas, 41 processes): a delta update took 0.23-0.30x of the dense one's time with
the longer sleeps, 0.38-0.49x without (``python -m wb bench --replicas 4 --delta 1e-6``). Only
hosts of few cores wait so: on a GPU host, a rank also waits for its device's work, which a
longer sleep would notice late (not measured there).

Linux ends a sleep up to its thread's *timer slack* late (50 us unless set), more than the
short sleeps asked here: on the 2-core machine a sleep of 10 us took 81 us, one of 100 us 176 us;
with a slack of 1 us, 28 and 122 us. So on a host of many cores the loop's thread sleeps with
a slack of :data:`TIMER_SLACK_NS` (on a crowded host a longer sleep is what is wanted).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

__all__ = ["Idle", "IDLE_MAX_S", "IDLE_CROWDED_S", "CROWDED_LATE_S", "SPIN_TURNS",
           "SPIN_TURNS_CROWDED", "TIMER_SLACK_NS", "fine_sleeps"]

_FEW_CORES = len(os.sched_getaffinity(0)) < 8
#: Longest sleep of an idle turn: short on a GPU host's cores; few: ranks would starve.
IDLE_MAX_S = 1e-3 if _FEW_CORES else 1e-4
#: A sleep that comes back this much later than asked says the host is crowded; the longest
#: sleep then.
CROWDED_LATE_S, IDLE_CROWDED_S = 1e-3, 5e-3
#: Turns without progress that spin (yield only) before the first sleep; on a crowded host.
SPIN_TURNS, SPIN_TURNS_CROWDED = 20, 2
_FIRST_S = 1e-5  # the first sleep; each next one twice as long
#: The timer slack of a waiting loop's thread on a host of many cores (nanoseconds).
TIMER_SLACK_NS = 1000
_PR_SET_TIMERSLACK = 29  # prctl(2)
_slack = threading.local()


def fine_sleeps() -> bool:
    """This thread's sleeps end within :data:`TIMER_SLACK_NS` of their time (Linux's prctl;
    set once per thread); whether that holds."""
    if getattr(_slack, "done", None) is None:
        try:
            _slack.done = ctypes.CDLL(None, use_errno=True).prctl(
                _PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0) == 0
        except (OSError, AttributeError):  # no prctl here
            _slack.done = False
    return _slack.done


class Idle:
    """The waiting of one update's loop: :meth:`wait` after a turn without progress,
    :meth:`reset` after one with; :attr:`turns` counts the turns since progress. ``crowdable``:
    whether late sleeps make it wait as on a crowded host (default: on a host of few cores)."""

    __slots__ = ("turns", "spin", "most", "crowdable")

    def __init__(self, *, crowdable: bool = _FEW_CORES):
        self.turns, self.spin, self.most = 0, SPIN_TURNS, IDLE_MAX_S
        self.crowdable = crowdable
        if not crowdable:
            fine_sleeps()

    def reset(self) -> None:
        self.turns = 0

    def wait(self) -> None:
        self.turns += 1
        if self.turns < self.spin:
            time.sleep(0)  # lets this process's other threads run (heartbeats)
            return
        nap = min(self.most, _FIRST_S * 2.0 ** min(self.turns - self.spin, 12))
        t = time.monotonic()
        time.sleep(nap)
        if self.crowdable and nap >= 1e-4:  # a shorter one may be late by a time slice alone
            crowded = time.monotonic() - t - nap > CROWDED_LATE_S
            self.spin, self.most = ((SPIN_TURNS_CROWDED, IDLE_CROWDED_S) if crowded
                                    else (SPIN_TURNS, IDLE_MAX_S))
