"""A rollout worker's end of a plan: :class:`Receiver`, the two ways a version arrives, and the two
kinds of buffers it arrives in.

How it arrives (receiver staging, chosen once at set-up):

- :class:`_DirectReceive` (staging off): ``apply`` waits for every trainer to announce the
  version, then receives it in the caller's thread, the rollout paused. A failure may leave a mix
  of versions.
- :class:`_BackgroundReceive` (staging on): the next version lands in staging in a thread while
  the rollout generates; ``apply`` waits for it and installs it. A failure leaves the previous
  version live.

What it arrives in (``handoff``):

- :class:`_InPlace`: the live buffers keep their addresses (CUDA graphs hold them): a version is
  written into them, directly or by one copy from staging.
- :class:`_Handoff`: every version lands in new buffers, handed over and never written again
  (JAX wraps such host buffers as arrays without copying).
- :class:`_Recycled`: every version lands in one of a few sets of wb's own buffers, handed over
  as DLPack exports (the framework's arrays are that memory); a set is written again once every
  array made of it has been freed (JAX on a GPU: UCX maps each set once, receives land in it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, wait
from typing import Any, Protocol

from wb.data.layout import Layout, Role
from wb.data.plan import Plan
from wb.data.rankplan import RankPlan
from wb.errors import TransferError
from wb.runtime import dlpack
from wb.runtime.buffers import aligned_empty, as_array, copy, copy_of, settle
from wb.runtime.endpoint import Endpoint, Transferred, in_thread, worker_layout
from wb.runtime.joining import request_join
from wb.runtime.stats import UpdateStats
from wb.runtime.update import DEFAULT_STAGING_BYTES

__all__ = ["Receiver"]

log = logging.getLogger(__name__)

Live = dict[str, tuple[Any, Any]]  # name -> (array module, array) of the live weights


# --- what a version arrives in ---------------------------------------------------------------
class _Target(Protocol):
    def arrays(self) -> dict[str, Any]:
        """The live buffers (the newest applied version's)."""

    def landing(self) -> dict[str, Any]:
        """Where a direct receive writes."""

    def adopt(self, arrays: dict[str, Any]) -> None:
        """``arrays`` (from :meth:`landing`) now hold the newest version."""

    def spare(self) -> dict[str, Any]:
        """New staging, holding the live values (a transfer writes only mapped elements)."""

    def install(self, staged: dict[str, Any]) -> dict[str, Any] | None:
        """Makes the version in ``staged`` live; returns staging for the next version (None:
        :meth:`spare` when the next version starts to land)."""


class _InPlace:
    """The live buffers keep their addresses: versions are written into them."""

    def __init__(self, live: Live):
        self.live = live

    def arrays(self) -> dict[str, Any]:
        return {n: a for n, (_, a) in self.live.items()}

    def landing(self) -> dict[str, Any]:
        return self.arrays()

    def adopt(self, arrays: dict[str, Any]) -> None:
        pass  # already in place

    def spare(self) -> dict[str, Any]:
        return copy_of(self.live)

    def install(self, staged: dict[str, Any]) -> dict[str, Any]:
        for n, (xp, a) in self.live.items():
            copy(xp, a, staged[n])
        return staged  # the same staging serves the next version


class _Handoff:
    """Every version lands in new buffers made by ``allocate(shape, dtype name)``; the arrays
    handed over are those objects themselves (a JAX array on a GPU, say), not wb's views of
    them, so the framework wraps them without a copy."""

    def __init__(self, given: dict[str, Any], layout: Layout, allocate: Callable, rank: int):
        self.layout, self.allocate, self.rank = layout, allocate, rank
        self.given: dict[str, Any] = {}  # the arrays handed over
        self.live: Live = {}  # wb's views of them
        self.adopt(given)

    def arrays(self) -> dict[str, Any]:
        return dict(self.given)

    def landing(self) -> dict[str, Any]:
        return self.spare()

    def adopt(self, arrays: dict[str, Any]) -> None:
        self.given = {n: arrays[n] for n in self.layout.buffers}
        self.live = {n: as_array(n, a, rank=self.rank) for n, a in self.given.items()}

    def spare(self) -> dict[str, Any]:
        return _allocated(self.layout, self.allocate, self.live, rank=self.rank)

    def install(self, staged: dict[str, Any]) -> dict[str, Any]:
        self.adopt(staged)  # the staging buffers become the live ones; new staging next time
        return self.spare()


class _Set:
    """One set of a :class:`_Recycled` target's buffers and the capsules exported of them."""

    def __init__(self, arrays: dict[str, Any], rank: int):
        self.arrays = arrays
        self.views: Live = {n: as_array(n, a, rank=rank) for n, a in arrays.items()}
        self.holds = dlpack.Holds()


class _Recycled:
    """Every version lands in one of a few sets of wb's own buffers (made by ``allocate``, which
    UCX maps once: receives go straight into them), handed over as :func:`wb.runtime.dlpack.
    export` s: the framework's arrays are that memory, no copy. A set is written again only once
    no capsule exported of it is held (the framework freed every array made of it) and its
    device has finished the work queued before; while the caller keeps older versions' arrays,
    new sets are made (logged). Elements no transfer writes (padding) keep the values the set
    got when it was made, from the live version then: the same in every version."""

    def __init__(self, given: dict[str, Any], layout: Layout, allocate: Callable, rank: int):
        self.layout, self.allocate, self.rank = layout, allocate, rank
        self.given = {n: given[n] for n in layout.buffers}  # handed over: exports after adopt
        self.live: Live = {n: as_array(n, a, rank=rank) for n, a in self.given.items()}
        self.sets: list[_Set] = []
        self.current: _Set | None = None  # the live version's set (None: the given buffers)
        self.lock = threading.Lock()  # spare() runs in the background receive's thread

    def arrays(self) -> dict[str, Any]:
        return dict(self.given)

    def landing(self) -> dict[str, Any]:
        return self.spare()

    def adopt(self, arrays: dict[str, Any]) -> None:
        with self.lock:
            s = next(x for x in self.sets if x.arrays is arrays)
            self.current, self.live = s, s.views
            self.given = {n: dlpack.export(a, self.layout.buffers[n].dtype, s.holds)
                          for n, (_, a) in s.views.items()}

    def spare(self) -> dict[str, Any]:
        with self.lock:
            for s in self.sets:
                if s is not self.current and s.holds.count == 0:
                    settle(s.views)  # work queued on the freed arrays has finished
                    return s.arrays
            s = _Set(_allocated(self.layout, self.allocate, self.live, rank=self.rank),
                     self.rank)
            self.sets.append(s)
        if len(self.sets) > 2:
            log.info("rank %d: a new set of receive buffers (%d now): the arrays of %d older "
                     "versions are still referenced", self.rank, len(self.sets),
                     len(self.sets) - 2)
        return s.arrays

    def install(self, staged: dict[str, Any]) -> None:
        self.adopt(staged)
        return None  # the next set is taken when the next version starts to land: by then the
        #              caller has usually let go of this version's predecessor


def _allocated(layout: Layout, allocate: Callable, live: Live | None, *,
               rank: int) -> dict[str, Any]:
    """New buffers for ``layout`` holding the ``live`` values (zeros without)."""
    out = {}
    for n, b in layout.buffers.items():
        out[n] = allocate(b.shape, b.dtype)
        xp, a = as_array(n, out[n], rank=rank)
        if live is None:
            a[...] = 0
        else:
            copy(xp, a, live[n][1])
    return out


# --- how a version arrives ------------------------------------------------------------------
class _NotArrived(TransferError):
    """The version did not come within ``wait_timeout``; nothing failed (apply may be retried)."""


class _ReceivePath(Protocol):
    keeps_live: bool  # a failed update leaves the previous version in the live buffers

    def start(self, v: int) -> None:
        """Starts receiving version ``v`` ahead of ``apply``, if this path does."""

    def ready(self, v: int) -> bool:
        """Whether ``receive(v)`` has something to install (never blocks)."""

    def receive(self, v: int) -> Transferred:
        """Version ``v``, live when this returns."""

    def close(self, timeout: float) -> None:
        """Stops waiting for a next version."""


class _DirectReceive:
    """Receiver staging off: ``apply`` receives the version into the target in the caller's
    thread, once every trainer announced it."""

    keeps_live = False

    def __init__(self, end: Endpoint, target: _Target):
        self.end, self.target = end, target
        self.announced: set[tuple[int, int]] = set()  # (version, trainer rank) seen

    def start(self, v: int) -> None:
        pass  # nothing moves before apply()

    def ready(self, v: int) -> bool:
        end = self.end
        for r in end.trainers:
            if (v, r) not in self.announced:
                try:
                    end.store.get(end.key("version", v, r), 0.001)
                except TransferError:
                    return False
                self.announced.add((v, r))
        return True

    def receive(self, v: int) -> Transferred:
        self.end.await_announced(v)
        joined = self.end.join(v)
        arrays = self.target.landing()
        ex = self.end.run(v, arrays)
        self.target.adopt(arrays)
        return Transferred(joined, ex)

    def close(self, timeout: float) -> None:
        pass  # nothing runs in the background


class _BackgroundReceive:
    """Receiver staging on: the next version lands in staging in a thread (a Future) while the
    rollout generates; ``receive`` waits for it and installs it into the target."""

    keeps_live = True

    def __init__(self, end: Endpoint, target: _Target):
        self.end, self.target = end, target
        self.staging = target.spare()
        self.cancel = threading.Event()  # set by close(): stop waiting for trainers
        self.moving = threading.Event()  # the version's peers joined: its bytes are moving
        self.future: Future | None = None  # of Transferred, for the version being received

    def start(self, v: int) -> None:
        if self.future is None:
            self.moving.clear()
            self.future = in_thread(self._receive, v, name=f"wb-recv-{self.end.rank}-v{v}")

    def _receive(self, v: int) -> Transferred:
        self.end.await_announced(v, cancel=self.cancel)
        joined = self.end.join(v, cancel=self.cancel)
        if self.staging is None:  # a recycled set, taken once the version is about to land
            self.staging = self.target.spare()
        self.moving.set()
        return Transferred(joined, self.end.run(v, self.staging))

    def ready(self, v: int) -> bool:
        return self.future is not None and self.future.done()

    def receive(self, v: int) -> Transferred:
        self.start(v)
        fut = self.future
        # waiting for the trainers is bounded by wait_timeout; a transfer under way by the
        # executor's own inactivity timeout
        deadline = time.monotonic() + self.end.wait_timeout
        while not fut.done() and (self.moving.is_set() or time.monotonic() < deadline):
            wait([fut], 0.05)
        if not fut.done():
            raise _NotArrived(f"rank {self.end.rank}: version {v} did not arrive within "
                              f"{self.end.wait_timeout:.0f} s (wait_timeout); has the trainer "
                              f"pushed it?")
        self.future = None
        moved = fut.result()  # raises the transfer's error
        self.staging = self.target.install(self.staging)
        return moved

    def close(self, timeout: float) -> None:
        self.cancel.set()
        if self.future is not None:
            wait([self.future], timeout)
        # The cancelled receive ends in an error whose traceback holds this object, which holds
        # the Future holding that error: a cycle that would keep the staging buffers (device
        # memory) until the garbage collector runs. Drop both now.
        self.future = self.staging = None


class Receiver:
    """A rollout worker's end: ``ready()`` between generation steps, then ``apply()``.

    Args:
        plan, rank, transport, store, name, staging_bytes, timeout, wait_timeout, layout: as
            :class:`wb.Sender` (``rank`` a rollout of ``plan``).
        buffers: the live weights the rollout reads (written in place: their addresses never
            change).
        staging: receiver staging (see :mod:`wb.runtime.coordinator`): the next version is
            received in the background into a staging copy as soon as the previous one is
            applied (or at once).
        handoff: for frameworks whose arrays are immutable (JAX): ``buffers`` may be ``None``;
            every version lands in new buffers made by ``allocate(shape, dtype name)`` (default:
            64-byte aligned host arrays, which JAX wraps without copying), and after ``apply()``
            :attr:`buffers` are the newest version's, handed over, never written again.
        allocate: see ``handoff``. With an ``allocate`` of your own (device memory) and no
            ``recycle``, every message lands in staging first and is unpacked into the new
            buffers on the device: memory UCX has not seen before costs it a new mapping at
            every version otherwise (hundreds of milliseconds per version on an H200; staging
            memory is reused).
        recycle: with ``handoff``, for frameworks that take memory through DLPack without
            copying and release it when their arrays die (JAX): versions land straight in a
            few sets of buffers made by ``allocate``, reused once nothing refers to them, and
            :attr:`buffers` are DLPack exports of the newest one (``jax.dlpack.from_dlpack``
            makes arrays of that memory). Zero-copy, and UCX maps each set once. A set is
            written again only when every array made of it has been freed: keeping older
            versions' arrays costs a set of memory each (logged).

    Raises:
        TransferError: ``rank`` is not a rollout of ``plan``, wrong or missing buffers, or a peer
            runs another plan (at set-up, before any update).

    Attributes:
        plan, rank, staging, handoff, wait_timeout: as given.
        version: the last version applied (0 before the first; -1 after a failed update without
            staging).
        stats: one :class:`wb.UpdateStats` per version applied, in order.

    Examples:
        See ``examples/notebook_session.py`` and :class:`wb.LocalSession`.
    """

    def __init__(self, plan: Plan | RankPlan, rank: int, buffers: Mapping[str, Any] | None, *,
                 transport,
                 store, staging: bool = True, name: str = "wb",
                 staging_bytes: int = DEFAULT_STAGING_BYTES, timeout: float = 60.0,
                 wait_timeout: float = 600.0, layout: Layout | None = None,
                 handoff: bool = False, allocate: Callable | None = None,
                 recycle: bool = False, _joined: tuple[int, int, str] | None = None):
        self.staging, self.handoff = bool(staging), bool(handoff)
        recycle = self.handoff and recycle
        # new device memory every version: received through staging (see allocate)
        fresh = self.handoff and allocate is not None and not recycle
        allocate = allocate or aligned_empty
        if buffers is None:
            if not self.handoff:
                raise TransferError(f"rank {rank}: Receiver needs the live buffers (or "
                                    f"handoff=True to receive into new ones every version)")
            buffers = _allocated(worker_layout(plan, rank, Role.ROLLOUT), allocate, None,
                                 rank=rank)
        self._end = Endpoint(plan, rank, buffers, role=Role.ROLLOUT, transport=transport,
                             store=store, name=name, staging_bytes=staging_bytes,
                             timeout=timeout, wait_timeout=wait_timeout, layout=layout,
                             joined=_joined, stage_receives=fresh)
        self.plan, self.rank, self.wait_timeout = plan, self._end.rank, wait_timeout
        self.stats: list[UpdateStats] = self._end.stats  # one record per version applied
        lay = self._end.layout
        self._target: _Target = (
            _Recycled(buffers, lay, allocate, self.rank) if recycle
            else _Handoff(buffers, lay, allocate, self.rank) if self.handoff
            else _InPlace({n: as_array(n, buffers[n], rank=self.rank) for n in lay.buffers}))
        self._path: _ReceivePath = (_BackgroundReceive(self._end, self._target) if self.staging
                                    else _DirectReceive(self._end, self._target))
        self.version = 0 if _joined is None else _joined[0] - 1
        self._error: TransferError | None = None  # the failure every later call raises
        self._closed = False
        self._path.start(self.version + 1)  # with staging, the first version lands from now

    @classmethod
    def join(cls, store, layout: Layout, buffers: Mapping[str, Any] | None, *, transport,
             name: str = "wb", join_timeout: float = 600.0, **kw) -> Receiver:
        """A rollout joining a running job (a new replica's worker, or a restarted one): asks
        the trainers' leader to take ``layout`` in (:func:`wb.runtime.joining.request_join`),
        waits until it is admitted at the end of a version, and receives from the next version
        on, whole. The others are not disturbed. Other arguments as for :class:`Receiver`.

        Raises:
            TransferError: not admitted within ``join_timeout`` seconds.
        """
        # the transport is started while the request waits (a UCX context and worker take
        # ~0.4 s): once admitted, the version this rank joins waits for it, the others with it
        part, first, epoch, incarnation = request_join(
            store, layout, name=name, timeout=join_timeout,
            meanwhile=lambda: transport.connect([], hello=b""))
        return cls(part, layout.worker.rank, buffers, transport=transport, store=store,
                   name=name, layout=layout, _joined=(first, epoch, incarnation), **kw)

    @property
    def buffers(self) -> dict[str, Any]:
        """The live buffers (with ``handoff``: the newest applied version's)."""
        return self._target.arrays()

    def ready(self) -> bool:
        """Whether ``apply()`` has a new version to install (never blocks).

        With staging: the next version has fully landed in staging (or failed: then ``apply``
        raises). Without: every trainer has announced the next version (``apply`` will receive it).
        """
        return self._error is not None or self._path.ready(self.version + 1)

    def pull(self) -> None:
        """Starts receiving the next version into staging in the background (with staging; a
        no-op if already receiving). Without staging, the same as :meth:`apply`."""
        if not self.staging:
            self.apply()
        elif self._error is None and not self._closed:
            self._path.start(self.version + 1)

    def apply(self) -> int:
        """Installs the next version into the live buffers and returns its number.

        With staging: waits for it to land (if it has not yet), copies staging into the live
        buffers and starts receiving the following version. Without: waits for the trainers to
        announce it and receives it into the live buffers.

        Raises:
            TransferError: the update failed (a trainer died or hung). With staging the live
                buffers still hold the previous version (``self.version``); without, they may
                hold a mix, and ``self.version`` is ``-1``. The receiver cannot be used again.
                With staging, also when the version did not arrive within ``wait_timeout`` (then
                nothing failed: ``apply`` may be called again).
        """
        t0 = time.perf_counter()
        if self._error is not None:
            raise self._error
        if self._closed:
            raise TransferError(f"rank {self.rank}: apply() after close()")
        v = self.version + 1
        try:
            moved = self._path.receive(v)
        except _NotArrived as e:  # nothing failed: the version may still come
            raise TransferError(str(e)) from None
        except BaseException as e:
            self._error = self._failure(v, e)
            raise self._error from e
        self.version = v
        self._end.record(v, time.perf_counter() - t0, moved)
        if not self._closed:
            self._path.start(v + 1)
        return v

    def close(self) -> None:
        """Stops waiting for a next version and closes the transport."""
        if self._closed:
            return
        self._closed = True
        self._path.close(self._end.timeout + 5)
        self._end.stop()
        if self._error is None:  # after a failure the executor has aborted the transport
            self._end.transport.close()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _failure(self, v: int, e: BaseException) -> TransferError:
        if self._path.keeps_live:
            what = (f"the live buffers still hold version {self.version} (staging kept the "
                    f"failed update out)")
        else:
            what = ("the live buffers may hold a mix of versions (no receiver staging); reload or "
                    "receive a full version before generating")
            self.version = -1
        return TransferError(f"rank {self.rank}: receiving version {v} failed: {e}; {what}. "
                             f"This receiver cannot be used again; make a new one")
