"""In-process transport: ranks are threads of one process sharing a :class:`LocalHub`.

For notebooks and tests: the same executor code path as UCX, with bytes copied by numpy.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable

import numpy as np

from wb.errors import TransferError

__all__ = ["LocalHub", "LocalTransport"]


class _LocalRequest:
    __slots__ = ("peer", "tag", "event", "error", "upto")

    def __init__(self, peer: int, tag: int):
        self.peer, self.tag, self.upto = peer, tag, False
        self.event = threading.Event()
        self.error: str | None = None

    def done(self) -> bool:
        if not self.event.is_set():
            return False
        if self.error:
            raise TransferError(self.error)
        return True


class LocalHub:
    """Matches sends with receives by ``(source, destination, tag)`` and copies the bytes."""

    def __init__(self):
        self._lock = threading.Lock()
        self._sends: dict[tuple[int, int, int], tuple[np.ndarray, _LocalRequest]] = {}
        self._recvs: dict[tuple[int, int, int], tuple[np.ndarray, _LocalRequest]] = {}
        self._hello: dict[tuple[int, int], bytes] = {}  # (round, rank) -> hello
        self._cv = threading.Condition(self._lock)
        self._done: set[int] = set()

    def post(self, key, buf: np.ndarray, req: _LocalRequest, *, is_send: bool) -> None:
        with self._lock:
            mine, other = (self._sends, self._recvs) if is_send else (self._recvs, self._sends)
            if key in mine:
                req.error = f"tag {key[2]:#x} from rank {key[0]} to rank {key[1]} posted twice"
                req.event.set()
                return
            if key in other:
                obuf, oreq = other.pop(key)
                src, dst = (buf, obuf) if is_send else (obuf, buf)
                rreq = oreq if is_send else req
                if rreq.upto and src.nbytes <= dst.nbytes:
                    dst = dst.reshape(-1)[:src.nbytes]
                if src.nbytes != dst.nbytes:
                    msg = (f"tag {key[2]:#x} from rank {key[0]} to rank {key[1]}: {src.nbytes} "
                           f"bytes sent into a {dst.nbytes}-byte receive")
                    req.error = oreq.error = msg
                else:
                    np.copyto(dst, src)
                req.event.set()
                oreq.event.set()
            else:
                mine[key] = (buf, req)


class LocalTransport:
    """One thread's end of a :class:`LocalHub`: the :class:`~wb.runtime.transport.Transport` of
    ranks that are threads of one process (:class:`wb.LocalSession` builds them).

    Args:
        rank: this thread's global rank in the plan.
        hub: the hub every rank of the plan shares.
        timeout: seconds :meth:`connect` waits for the peers' hellos.
        checksums: messages are checked against their senders' CRC32C (see
            :class:`~wb.runtime.transport.ucx.UcxTransport`); every rank must say the same.

    Examples:
        >>> import numpy as np
        >>> hub = LocalHub()
        >>> a, b = LocalTransport(0, hub), LocalTransport(1, hub)
        >>> dst = np.zeros(3, np.uint8)
        >>> rx = b.recv(0, dst, tag=7)
        >>> a.send(1, np.array([1, 2, 3], np.uint8), tag=7).done() and rx.done(), dst.tolist()
        (True, [1, 2, 3])
    """

    def __init__(self, rank: int, hub: LocalHub, *, timeout: float = 60.0,
                 checksums: bool = True):
        self.rank, self.hub, self.timeout = int(rank), hub, timeout
        self.checksums = checksums
        self._round = -1

    def connect(self, peers: Iterable[int], *, hello: bytes = b"") -> dict[int, bytes]:
        """Publishes ``hello`` and returns each peer's; every call is a new round (as UCX's)."""
        peers = sorted(set(int(p) for p in peers) - {self.rank})
        self._round += 1
        r = self._round
        with self.hub._cv:
            self.hub._hello[(r, self.rank)] = hello
            self.hub._cv.notify_all()
            if not self.hub._cv.wait_for(lambda: all((r, p) in self.hub._hello for p in peers),
                                         self.timeout):
                missing = [p for p in peers if (r, p) not in self.hub._hello]
                raise TransferError(f"rank {self.rank}: peers {missing} never connected")
            return {p: self.hub._hello[(r, p)] for p in peers}

    def send(self, peer: int, buf, tag: int) -> _LocalRequest:
        req = _LocalRequest(peer, tag)
        self.hub.post((self.rank, int(peer), int(tag)), np.asarray(buf), req, is_send=True)
        return req

    def recv(self, peer: int, buf, tag: int, *, upto: bool = False) -> _LocalRequest:
        req = _LocalRequest(peer, tag)
        req.upto = upto
        self.hub.post((int(peer), self.rank, int(tag)), np.asarray(buf), req, is_send=False)
        return req

    def describe(self) -> str:
        return json.dumps({"transport": "local", "rank": self.rank})

    def close(self, *, barrier: bool = True) -> None:
        with self.hub._cv:
            self.hub._done.add(self.rank)
            self.hub._cv.notify_all()

    def abort(self) -> None:
        self.close(barrier=False)

    def cancel(self) -> None:
        """Cancels this rank's sends and receives not yet matched (their requests fail)."""
        with self.hub._lock:
            for book in (self.hub._sends, self.hub._recvs):
                for key in [k for k in book if self.rank in k[:2]
                            and (book is self.hub._sends) == (k[0] == self.rank)]:
                    _, req = book.pop(key)
                    req.error = f"rank {self.rank}: tag {key[2]:#x} cancelled"
                    req.event.set()

    def add_peers(self, peers: Iterable[int]) -> None:
        """Nothing to do: every rank of the hub can reach every other."""

    def forget(self, peers: Iterable[int]) -> None:
        """Nothing to do: no connection to close."""
