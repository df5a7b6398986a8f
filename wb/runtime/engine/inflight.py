"""What an update keeps in flight: requests per peer (:class:`Inflight`), byte ranges of CUDA
buffers handed to a transport (:class:`DeviceBytes`), strided views of flat buffers
(:func:`region`), the events that say device work is done (:func:`fencer`), the receives a
transport may unpack from their senders' memory (:func:`in_place`), and how a failed update lets
go of its transport (:func:`abort`)."""

from __future__ import annotations

import logging
import os
from collections import deque
from typing import Any

import numpy as np

from wb.errors import TransferError

__all__ = ["Inflight", "DeviceBytes", "DevicePtr", "region", "fencer", "recorded", "abort",
           "in_place", "InPlace"]

log = logging.getLogger(__name__)


def fencer(xp):
    """``fence()`` for the device work queued so far: an object whose ``done`` says it finished,
    or ``None`` when there is nothing to wait for (host buffers: numpy copies are synchronous).

    On CUDA buffers each pack, unpack or local copy records an event, and the loop acts on it once
    ``done`` (a non-blocking query) rather than blocking on a stream synchronisation: a GPU
    time-shared by many processes can keep a kernel waiting, and meanwhile the worker keeps
    posting and completing its other messages."""
    if xp is np:
        return lambda: None

    def fence():
        return recorded(xp, xp.cuda.get_current_stream())
    return fence


def recorded(xp, stream):
    """A CUDA event recorded on ``stream`` now (non-blocking: poll ``.done``)."""
    ev = xp.cuda.Event(block=False, disable_timing=True)
    ev.record(stream)
    return ev


class Inflight:
    """Requests in flight, one FIFO per (peer, direction) in posting order.

    Transfers with one peer mostly complete in the order they were posted, so a poll takes every
    completed request at the head of each FIFO (however many: a burst that completed together is
    seen at once), O(peers + completions), not O(requests), per poll (a rollout can have
    thousands of receives posted); a full poll also looks behind each head, for ones completed
    out of order (the loop asks for one now and then, and after a turn that found nothing):
    every completion is seen, a rare late one a few turns later."""

    def __init__(self):
        # (peer, outgoing) -> deque of (request, message, staging buffer or None)
        self.queues: dict[tuple[int, bool], deque] = {}
        self.n = 0

    def add(self, req, g, buf) -> None:
        """Adds request ``req`` of message ``g`` (a :class:`~wb.runtime.engine.program.Message`), with
        its staging buffer ``buf`` (``None``: zero-copy)."""
        q = self.queues.get((g.peer, g.out))
        if q is None:
            q = self.queues[(g.peer, g.out)] = deque()
        q.append((req, g, buf))
        self.n += 1

    def __len__(self) -> int:
        return self.n

    def completed(self, *, full: bool) -> list[tuple[Any, Any, Any]]:
        """Takes the completed ``(request, message, staging)`` out: each FIFO's completed head,
        and with ``full`` any completed out of order behind it."""
        out = []
        for q in self.queues.values():
            while q and q[0][0].done():  # in posting order: the common case
                out.append(q.popleft())
            if not full:
                continue
            i, limit = 1, len(q)
            while i < limit:  # one that completed out of order
                if q[i][0].done():
                    out.append(q[i])
                    del q[i]
                    limit -= 1
                else:
                    i += 1
        self.n -= len(out)
        return out

    def first(self, k: int) -> list[tuple[Any, Any, Any]]:
        """Up to ``k`` entries still in flight (for the stall message)."""
        return [x for q in self.queues.values() for x in list(q)[:k]][:k]


class DevicePtr:
    """A device address as CuPy's memory pointers give it (``.ptr``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr


class DeviceBytes:
    """A byte range of a CUDA buffer, as the CUDA array interface: what a transport needs to move
    it, without slicing a CuPy array per message (tens of microseconds each; an update posts
    hundreds per rank). Its address is also ``.data.ptr``, as a CuPy array's (read without the
    interface's dict). Keeps its buffer alive."""

    __slots__ = ("__cuda_array_interface__", "nbytes", "owner", "data")

    def __init__(self, owner, offset: int, nbytes: int):
        self.owner, self.nbytes = owner, nbytes
        self.data = DevicePtr(owner.data.ptr + offset)
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "strides": None,
                                         "data": (self.data.ptr, False), "version": 3}


def region(xp, flat, f0, na, nb, fa, fb):
    """A strided (na, nb) view of the flat buffer, element (i, j) at flat[f0 + i*fa + j*fb]."""
    item = flat.itemsize
    # a length-1 axis has no step (the line zone's row step is 2**62: meaningless, and too big)
    strides = (int(fa) * item if na > 1 else 0, int(fb) * item if nb > 1 else 0)
    return xp.lib.stride_tricks.as_strided(flat[f0:], shape=(int(na), int(nb)), strides=strides)


class InPlace:
    """What a transport calls to unpack received messages straight from their senders' memory
    (``unpack_many([(message, address), ...])``, on the stream it reads them on): the mover's
    kernels unpack them, then, with checksums, their CRCs are taken there (in this order: an
    unpacking that fails has hashed nothing, so the copy the transport falls back to is hashed
    once)."""

    __slots__ = ("mover", "sums")

    def __init__(self, mover, sums):
        self.mover, self.sums = mover, sums

    def unpack_many(self, items: list) -> None:
        self.mover.unpack_many(items)
        if self.sums is not None:
            self.sums.hash_at(items)


def in_place(transport, mover, sums, delta, peers) -> dict:
    """``{peer: InPlace}`` for the ``peers`` whose messages ``transport`` may unpack from their
    memory (its ``unpacks_from``; a mover with ``unpack_many``, no deltas), with
    ``WB_UNPACK_IN_PLACE=1`` in the environment (off by default until its speed is measured):
    else ``{}``, every message copied into staging and unpacked after."""
    can = getattr(transport, "unpacks_from", None)
    if can is None or delta is not None or not hasattr(mover, "unpack_many") or \
            os.environ.get("WB_UNPACK_IN_PLACE", "0") != "1":
        return {}
    into, out = InPlace(mover, sums), {}
    for p in peers:
        try:
            if can(p):
                out[p] = into
        except TransferError:  # a peer gone: its receive fails in the loop, as any would
            pass
    return out


def abort(transport) -> None:
    """Closes ``transport`` without the closing barrier (after a failure), logging any error."""
    try:
        getattr(transport, "abort", transport.close)()
    except Exception:
        log.exception("closing the transport after a failure")
