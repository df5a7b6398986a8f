"""Liveness through the store: every worker beats, a stalled update asks whose beat stopped.

A :class:`Heartbeat` thread writes a counter to the store every ``interval`` seconds, whatever the
worker is doing (a long transfer of a healthy peer keeps beating: the thread needs the GIL only
for a moment, and UCX and numpy release it). A :class:`Watch` reads the peers' counters and
calls a peer dead or hung once its counter has not changed for ``grace`` seconds of the watcher's
own clock. An update that makes no progress asks the watch about the peers it still waits for,
so a killed or stopped peer is named within about ``grace`` seconds, not after the inactivity
timeout.

The trainers' leader, which calls the dead, also keeps its watch looking at every member between
its own questions (:meth:`Watch.follow`, a daemon thread reading each member's beat every
:data:`FOLLOW_S`), so a death between versions is timed from the last beat on its own clock. A
watch that looks only now and then does not count a peer's silence from its own first look after
a pause either: each beat carries the peer's monotonic clock, and the watch, having seen earlier
beats of the same peer, places the newest one on its own clock by the peer's elapsed time since
them. Only differences of one peer's clock are used (never one machine's time against
another's), over the last few beats seen, so clock drift cannot add up; the estimate is never
earlier than the beat was written (a beat seen is credited at least as recent as it can have
been).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable

from wb.errors import TransferError

__all__ = ["Heartbeat", "Watch", "BEAT_S", "GRACE_S", "FOLLOW_S", "new_incarnation", "repeat"]

log = logging.getLogger(__name__)

#: Seconds between two beats of a worker.
BEAT_S = 0.5
#: Seconds without a new beat after which a peer is called dead or hung.
GRACE_S = 3.0
#: Seconds between two looks of a following watch (:meth:`Watch.follow`) at each peer.
FOLLOW_S = BEAT_S / 2


def repeat(seconds: float, look: Callable[[], object], name: str) -> threading.Event:
    """Calls ``look()`` every ``seconds`` from a daemon thread ``name`` until the returned event
    is set; a call that raises (a store hiccup) is logged and the next one comes as usual."""
    stop = threading.Event()

    def run():
        while not stop.wait(seconds):
            try:
                look()
            except Exception:  # noqa: BLE001 - the next look, or the owner, asks again
                log.debug("%s: a look failed", name, exc_info=True)
    threading.Thread(target=run, name=name, daemon=True).start()
    return stop


def new_incarnation() -> str:
    """A name for one run of a worker process (its beats carry it)."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Heartbeat:
    """Writes ``key`` = an increasing counter to ``store`` every ``interval`` s, from a daemon
    thread, until :meth:`stop`.

    Args:
        store: the rendezvous store (``set``).
        key: this worker's heartbeat key.
        interval: seconds between beats.
    """

    def __init__(self, store, key: str, interval: float = BEAT_S, *,
                 incarnation: str | None = None):
        self.store, self.key, self.interval = store, key, float(interval)
        # tells a restarted worker (the same rank, the same key) from the one that died
        self.incarnation = incarnation or new_incarnation()
        self._stop = threading.Event()
        self._beats = 0
        #: a short note every beat carries (what this worker has done: wb.runtime.membership.finish), so
        #: peers read it again within a beat should the store lose the key it was also put in
        self.status = ""
        self._beat()  # the first beat before anyone waits for it
        self._thread = threading.Thread(target=self._run, name=f"wb-heartbeat {key}",
                                        daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self._beats += 1
        # incarnation:count:this process's monotonic clock:status
        self.store.set(self.key, f"{self.incarnation}:{self._beats}:{time.monotonic():.3f}:"
                                 f"{self.status}".encode())

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - a store hiccup must not kill the worker
                log.warning("heartbeat %s: the store refused a beat", self.key, exc_info=True)

    def stop(self) -> None:
        """Stops beating (peers will call this worker gone after their grace)."""
        self._stop.set()
        self._thread.join(timeout=2 * self.interval + 1)


class Watch:
    """Which peers stopped beating.

    Args:
        store: the rendezvous store (``get``).
        key_of: ``rank -> heartbeat key``.
        grace: seconds without a new beat after which a peer is dead or hung.
    """

    def __init__(self, store, key_of: Callable[[int], str], grace: float = GRACE_S):
        self.store, self.key_of, self.grace = store, key_of, float(grace)
        self._seen: dict[int, tuple[bytes | None, float]] = {}  # rank -> (last beat, when
        #                                                         written, on this clock)
        self._incarnation: dict[int, bytes] = {}  # rank -> the incarnation first seen beating
        self._restarted: dict[int, float] = {}  # rank -> when another incarnation was seen
        # rank -> (when seen on this clock - the peer's clock in it) of its last few new beats:
        # the smallest is the tightest bound on where the peer's clock sits on this one
        self._offsets: dict[int, deque] = {}
        self._lock = threading.Lock()  # a following thread and the owner's questions
        self._resets: dict[int, int] = {}  # rank -> how often it was reset (stale reads)
        self._following: threading.Event | None = None

    def follow(self, peers: Callable[[], Iterable[int]], every: float = FOLLOW_S) -> None:
        """Looks at the beats of ``peers()`` every ``every`` seconds from a daemon thread, until
        :meth:`stop`: between the owner's own questions too, so a peer's silence is timed on
        this clock from within ``every`` of its last beat. Costs one store read per peer per
        look (the trainers' leader follows its members)."""
        if self._following is None:
            self._following = repeat(every, lambda: self.silent(list(peers())), "wb-watch")

    def stop(self) -> None:
        """Stops following (:meth:`follow`)."""
        if self._following is not None:
            self._following.set()

    def silent(self, peers: Iterable[int], grace: float | None = None) -> dict[int, float]:
        """``{peer: seconds since its beat last changed}`` for the peers silent longer than the
        grace (``grace``: another threshold for this call, e.g. to suspect a peer early; a peer
        never seen counts from the first time it was asked about). A peer that beats as another
        incarnation than the one first seen (it died and was restarted under the same rank) is
        silent from then on, until :meth:`reset`."""
        grace = self.grace if grace is None else float(grace)
        reads = []  # read without the lock (a following sweep must not hold the owner up)
        for p in peers:
            gen = self._resets.get(p, 0)
            try:
                beat = self.store.get(self.key_of(p), 0.05)  # 0 means "forever" to some stores
            except TransferError:
                beat = None
            reads.append((p, gen, beat, time.monotonic()))  # after the read: written by then
        with self._lock:
            return self._book(reads, grace)

    def _book(self, reads, grace: float) -> dict[int, float]:
        out = {}
        for p, gen, beat, now in reads:
            if self._resets.get(p, 0) != gen:  # read before a reset: an old incarnation's
                continue
            last, since = self._seen.get(p, (None, now))
            if beat is not None and beat != last:
                last, since = beat, now
                who, clock = _parse(beat)
                if self._incarnation.setdefault(p, who) != who:
                    self._restarted.setdefault(p, now)
                elif clock is not None:  # when it was written, on this clock
                    offsets = self._offsets.setdefault(p, deque(maxlen=8))
                    offsets.append(now - clock)
                    since = min(now, min(offsets) + clock)
            self._seen[p] = (last, since)
            if p in self._restarted:
                out[p] = self.grace + now - self._restarted[p]
            elif now - since > grace:
                out[p] = now - since
        return out

    def status(self, peer: int) -> str:
        """The status note of ``peer``'s last beat ("" if none)."""
        try:
            beat = self.store.get(self.key_of(peer), 0.001)
        except TransferError:
            return ""
        parts = beat.decode(errors="replace").split(":", 3)
        return parts[3] if len(parts) == 4 else ""

    def reset(self, peers: Iterable[int]) -> None:
        """Accepts the incarnation ``peers`` beat as now (restarted workers taken back in)."""
        with self._lock:
            for p in peers:
                for book in (self._seen, self._incarnation, self._restarted, self._offsets):
                    book.pop(p, None)
                self._resets[p] = self._resets.get(p, 0) + 1


def _parse(beat: bytes) -> tuple[bytes, float | None]:
    """``(incarnation, the beater's monotonic clock or None)`` of a beat (a join request's
    first beat carries no clock)."""
    parts = beat.split(b":", 3)
    try:
        return parts[0], float(parts[2]) if len(parts) == 4 else None
    except ValueError:
        return parts[0], None
