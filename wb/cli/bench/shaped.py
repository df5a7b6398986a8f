"""A transport that emulates a cluster's links on one machine: per-GPU NICs and NVLink as rates.

On one machine every process shares the same cores, memory and loopback, so a transfer's time says
nothing about a cluster where each GPU has its own NIC. :class:`ShapedTransport` wraps a real
transport and holds each message back as a link of the emulated cluster would:

- *egress*: a send occupies this worker's NIC (peer on another node) or NVLink (same node) for
  ``bytes / rate``; sends on one link go one after the other, and a send is handed to the real
  transport when its last byte would have left;
- *ingress*: a receive completes no earlier than the receiver's link of that kind, serving the
  messages in the order they arrive at ``bytes / rate``, could have taken it in.

A single flow therefore runs at the link rate, several flows into one GPU share its ingress, and
several out of one GPU share its egress: the fluid model of :mod:`wb.simulate`. The real bytes
still move over the real transport and are checked as always. Benchmarks use it to measure plans
and baselines on the topology they are made for; it is never used unless asked for.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Mapping

from wb.algorithms import delta

__all__ = ["ShapedTransport"]


class _Link:
    __slots__ = ("rate", "free_at", "lock", "busy_s", "first", "nbytes")

    def __init__(self, rate: float):
        self.rate, self.free_at, self.lock = float(rate), 0.0, threading.Lock()
        self.busy_s, self.first, self.nbytes = 0.0, None, 0

    def book(self, nbytes: int, earliest: float) -> float:
        """Occupies the link for ``nbytes`` from ``earliest`` or when it frees; returns the end."""
        with self.lock:
            start = max(earliest, self.free_at)
            self.free_at = start + nbytes / self.rate
            self.busy_s += nbytes / self.rate
            self.nbytes += nbytes
            self.first = start if self.first is None else self.first
            return self.free_at

    def stats(self) -> dict:
        """Bytes, busy seconds, and the span from the first booking to the end of the last."""
        with self.lock:
            if self.first is None:
                return {"bytes": 0, "busy_s": 0.0, "span_s": 0.0}
            wall = time.time() - time.monotonic()
            return {"bytes": self.nbytes, "busy_s": self.busy_s, "span_s": self.free_at - self.first,
                    "first": self.first + wall, "last": self.free_at + wall}

    def reset(self) -> None:
        with self.lock:
            self.busy_s, self.first, self.nbytes = 0.0, None, 0


class _HeldSend:
    __slots__ = ("t", "peer", "buf", "tag", "at", "req")

    def __init__(self, t, peer, buf, tag, at):
        self.t, self.peer, self.buf, self.tag, self.at, self.req = t, peer, buf, tag, at, None

    def done(self) -> bool:
        if self.req is None:
            if time.monotonic() < self.at:
                return False
            self.req = self.t.inner.send(self.peer, self.buf, self.tag)
        return self.req.done()


class _ShapedRecv:
    """``nbytes``: the message's size, or the buffer of a receive of a delta (whose header says
    how much of it came)."""

    __slots__ = ("t", "req", "link", "nbytes", "at")

    def __init__(self, t, req, link, nbytes):
        self.t, self.req, self.link, self.nbytes, self.at = t, req, link, nbytes, None

    def done(self) -> bool:
        if self.at is None:
            if not self.req.done():
                return False
            if not isinstance(self.nbytes, int):
                self.nbytes = delta.size_of(self.nbytes)
            self.at = self.link.book(self.nbytes, time.monotonic() - self.nbytes / self.link.rate)
        return time.monotonic() >= self.at


class ShapedTransport:
    """Wraps ``inner`` (any :class:`wb.runtime.transport.Transport`) with emulated link rates.

    Args:
        inner: the real transport of this rank.
        gpu_of: ``{rank: (node, local_rank)}`` of every rank it may talk to (and itself): ranks on
            another node talk over NICs, on another GPU of the node over NVLink, on the same GPU
            without limit (a device copy).
        nic_Bps: each worker's NIC rate, bytes/s per direction (messages between nodes).
        nvlink_Bps: each worker's NVLink rate, bytes/s per direction (messages within a node).
    """

    def __init__(self, inner, *, gpu_of: Mapping[int, tuple[str, int]], nic_Bps: float,
                 nvlink_Bps: float):
        if nic_Bps <= 0 or nvlink_Bps <= 0:
            raise ValueError(f"link rates must be positive, got {nic_Bps} and {nvlink_Bps}")
        self.inner, self.rank = inner, inner.rank
        self.checksums = getattr(inner, "checksums", True)  # what its messages carry
        self.gpu_of = {int(r): (str(g[0]), int(g[1])) for r, g in gpu_of.items()}
        self.nic_Bps, self.nvlink_Bps = float(nic_Bps), float(nvlink_Bps)
        self._out = {"nic": _Link(nic_Bps), "nvlink": _Link(nvlink_Bps)}
        self._in = {"nic": _Link(nic_Bps), "nvlink": _Link(nvlink_Bps)}

    def _kind(self, peer: int) -> str | None:
        mine, theirs = self.gpu_of[self.rank], self.gpu_of[int(peer)]
        if mine == theirs:
            return None
        return "nvlink" if mine[0] == theirs[0] else "nic"

    def connect(self, peers: Iterable[int], *, hello: bytes = b"") -> dict[int, bytes]:
        return self.inner.connect(peers, hello=hello)

    def prepare(self, peers: Iterable[int]) -> None:
        prepare = getattr(self.inner, "prepare", None)
        if prepare is not None:
            prepare(peers)

    def send(self, peer: int, buf, tag: int):
        kind = self._kind(peer)
        if kind is None:
            return self.inner.send(peer, buf, tag)
        at = self._out[kind].book(int(buf.nbytes), time.monotonic())
        return _HeldSend(self, peer, buf, tag, at)

    def recv(self, peer: int, buf, tag: int, *, upto: bool = False):
        kind = self._kind(peer)
        req = self.inner.recv(peer, buf, tag, upto=upto) if upto else self.inner.recv(peer, buf, tag)
        if kind is None:
            return req
        return _ShapedRecv(self, req, self._in[kind], buf if upto else int(buf.nbytes))

    def link_stats(self, *, reset: bool = False) -> dict:
        """Per emulated link of this worker (``out/nic``, ``in/nvlink``, ...): bytes carried, busy
        seconds, and the span from its first message to the end of its last; links that carried
        nothing are left out. A span longer than the busy time means the link sat idle in between
        (the plan or the executor did not keep it fed). ``reset`` starts counting again."""
        out = {}
        for d, links in (("out", self._out), ("in", self._in)):
            for kind, link in links.items():
                st = link.stats()
                if reset:
                    link.reset()
                if st["bytes"]:
                    out[f"{d}/{kind}"] = st
        return out

    def describe(self) -> str:
        d = json.loads(self.inner.describe())
        d.update(shaped={"nic_Bps": self.nic_Bps, "nvlink_Bps": self.nvlink_Bps})
        return json.dumps(d)

    def close(self, **kw) -> None:
        self.inner.close(**kw)

    def abort(self) -> None:
        getattr(self.inner, "abort", self.inner.close)()
