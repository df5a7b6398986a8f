"""Transports: post tagged sends and receives of contiguous byte buffers between ranks.

:class:`Transport` is the seam the executor talks to. :class:`~wb.runtime.transport.ucx.UcxTransport`
moves bytes between processes and machines over UCX (``ucxx``); :class:`~wb.runtime.transport.local.
LocalTransport` between threads of one process (notebooks, tests). A buffer is a contiguous
1-D ``uint8`` array: numpy on the host, or a CUDA array (``__cuda_array_interface__``, e.g. CuPy).
Processes meet through a key -> bytes store (:mod:`~wb.runtime.transport.stores`): transports
exchange their addresses there, the membership its records.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

__all__ = ["Transport", "Request"]


@runtime_checkable
class Request(Protocol):
    """One posted send or receive."""

    peer: int
    tag: int

    def done(self) -> bool:
        """True once complete; raises :class:`wb.TransferError` if it failed."""
        ...


@runtime_checkable
class Transport(Protocol):
    """Tagged point-to-point byte transport among the ranks of one plan."""

    rank: int

    def connect(self, peers: Iterable[int], *, hello: bytes = b"") -> dict[int, bytes]:
        """Connects to ``peers``; publishes ``hello`` and returns each peer's ``hello``."""
        ...

    def send(self, peer: int, buf: Any, tag: int) -> Request: ...

    def recv(self, peer: int, buf: Any, tag: int, *, upto: bool = False) -> Request:
        """Receives the message of ``tag`` from ``peer`` into ``buf``: as many bytes as ``buf``
        holds, or, ``upto``, as many at most (the message lands at its start; what it is says
        its own length: a delta of :mod:`wb.algorithms.delta`)."""
        ...

    def describe(self) -> str:
        """What is in use (transports, devices), for logs."""
        ...

    def close(self) -> None:
        """Waits until every peer is done (a barrier), then releases endpoints and the worker."""
        ...

    # Optional: ``stage_send(peer, buf)``, whether a message from ``buf`` to ``peer`` should
    # leave from staging instead (a device copy first: the transport's path from that memory is
    # slow), or ``None`` while it cannot tell (asked again); a transport without it sends every
    # message from its buffer where the plan allows.
    # Optional, for versions that finish without a dead peer (wb.runtime.membership.finish): ``cancel()``
    # cancels the requests in flight and keeps the connections, ``add_peers(peers)`` allows
    # ranks of the same session not connected so far, ``forget(peers)`` drops dead ones. A
    # transport without them fails the whole version when a peer dies.
