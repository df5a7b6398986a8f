"""A rollout worker's end of a plan: :class:`Receiver`, and the two ways a version arrives.

How it arrives (receiver staging, chosen once at set-up):

- :class:`_DirectReceive` (staging off): ``apply`` waits for every trainer to announce the
  version, then receives it in the caller's thread, the rollout paused. A failure may leave a mix
  of versions.
- :class:`_BackgroundReceive` (staging on): the next version lands in staging in a thread while
  the rollout generates; ``apply`` waits for it and installs it. A failure leaves the previous
  version live.

What it arrives in (``handoff``) is a target of :mod:`wb.runtime.endpoints.targets`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, wait
from typing import Any, Protocol

from wb.data.layout import Layout, Role
from wb.data.plan import Plan, RankPlan
from wb.errors import ChecksumError, TransferError
from wb.runtime.endpoints.endpoint import Endpoint, Transferred, in_thread, take_part
from wb.runtime.endpoints.stats import UpdateStats
from wb.runtime.endpoints.targets import Handoff, InPlace, Recycled, Target, allocated
from wb.runtime.engine.buffers import aligned_empty, as_array
from wb.runtime.transport.keyed import keyed
from wb.runtime.endpoints import asks, checks
from wb.runtime.membership.joining import Admission, request_join

__all__ = ["Receiver"]


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

    def __init__(self, end: Endpoint, target: Target):
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

    def __init__(self, end: Endpoint, target: Target):
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
        staging: receiver staging (see :mod:`wb.runtime.endpoints.modes`): the next version is
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
        stats: one :class:`~wb.runtime.endpoints.stats.UpdateStats` per version applied, in order.

    Examples:
        See ``examples/notebook_session.py`` and :class:`wb.LocalSession`.
    """

    def __init__(self, plan: Plan | RankPlan | Mapping[int, RankPlan], rank: int,
                 buffers: Mapping[str, Any] | None, *, transport, store, staging: bool = True,
                 name: str = "wb", staging_bytes: int | None = None,
                 timeout: float = 60.0, wait_timeout: float = 600.0,
                 layout: Layout | None = None, handoff: bool = False,
                 allocate: Callable | None = None, recycle: bool = False):
        self._start(plan, rank, buffers, transport=transport, store=store, staging=staging,
                    name=name, staging_bytes=staging_bytes, timeout=timeout,
                    wait_timeout=wait_timeout, layout=layout, handoff=handoff, allocate=allocate,
                    recycle=recycle, admission=None)

    def _start(self, plan, rank: int, buffers: Mapping[str, Any] | None, *, transport, store,
               staging: bool, name: str, staging_bytes: int | None, timeout: float,
               wait_timeout: float, layout: Layout | None, handoff: bool,
               allocate: Callable | None, recycle: bool, admission: Admission | None) -> None:
        """The constructor's work, for a rollout of a job's start or (``admission``) one taken
        into a running job (:meth:`admitted`)."""
        part, roster = take_part(plan, rank, Role.ROLLOUT)
        store = keyed(store, transport=transport)  # signed with the job's key, if there is one
        self.staging, self.handoff = bool(staging), bool(handoff)
        recycle = self.handoff and recycle
        # new device memory every version: received through staging (see allocate)
        fresh = self.handoff and allocate is not None and not recycle
        allocate = allocate or aligned_empty
        if buffers is None:
            if not self.handoff:
                raise TransferError(f"rank {rank}: Receiver needs the live buffers (or "
                                    f"handoff=True to receive into new ones every version)")
            buffers = allocated(part.layout, allocate, None, rank=rank)
        self._end = Endpoint(part, buffers, role=Role.ROLLOUT, transport=transport,
                             store=store, name=name, staging_bytes=staging_bytes,
                             timeout=timeout, wait_timeout=wait_timeout, layout=layout,
                             admission=admission, stage_receives=fresh, roster=roster)
        self.plan, self.rank, self.wait_timeout = plan, self._end.rank, wait_timeout
        self.stats: list[UpdateStats] = self._end.stats  # one record per version applied
        lay = self._end.layout
        self._target: Target = (
            Recycled(buffers, lay, allocate, self.rank) if recycle
            else Handoff(buffers, lay, allocate, self.rank) if self.handoff
            else InPlace({n: as_array(n, buffers[n], rank=self.rank) for n in lay.buffers}))
        self._path: _ReceivePath = (_BackgroundReceive(self._end, self._target) if self.staging
                                    else _DirectReceive(self._end, self._target))
        # deltas apply to what the last version wrote: only where versions land in one memory
        self._end.stable = isinstance(self._target, InPlace) and not fresh
        self.version = 0 if admission is None else admission.first - 1
        self._next = self.version + 1  # the version the next apply() receives
        self._error: TransferError | None = None  # the failure every later call raises
        self._closed = False
        self._desk: asks.Desk | None = None  # answers checks asked from outside (serve_checks)
        self._path.start(self._next)  # with staging, the first version lands from now

    @classmethod
    def join(cls, store, layout: Layout, buffers: Mapping[str, Any] | None, *, transport,
             name: str = "wb", join_timeout: float = 600.0, staging: bool = True,
             staging_bytes: int | None = None, timeout: float = 60.0,
             wait_timeout: float = 600.0, handoff: bool = False,
             allocate: Callable | None = None, recycle: bool = False) -> Receiver:
        """A rollout joining a running job (a new replica's worker, or a restarted one): asks
        the trainers' leader to take ``layout`` in (:func:`wb.runtime.membership.joining.request_join`),
        waits until it is admitted at the end of a version, and receives from the next version
        on, whole. The others are not disturbed. Other arguments as for :class:`Receiver`.

        Raises:
            TransferError: not admitted within ``join_timeout`` seconds, or at once when the
                session's trainers have closed (no version is left to join).
        """
        # the transport is started while the request waits (a UCX context and worker take
        # ~0.4 s): once admitted, the version this rank joins waits for it, the others with it
        store = keyed(store, transport=transport)
        admission = request_join(store, layout, name=name, timeout=join_timeout,
                                 meanwhile=lambda: transport.connect([], hello=b""))
        return cls.admitted(admission, buffers, transport=transport, store=store, name=name,
                            layout=layout, staging=staging, staging_bytes=staging_bytes,
                            timeout=timeout, wait_timeout=wait_timeout, handoff=handoff,
                            allocate=allocate, recycle=recycle)

    @classmethod
    def admitted(cls, admission: Admission, buffers: Mapping[str, Any] | None, *, transport,
                 store, name: str = "wb", layout: Layout | None = None, staging: bool = True,
                 staging_bytes: int | None = None, timeout: float = 60.0,
                 wait_timeout: float = 600.0, handoff: bool = False,
                 allocate: Callable | None = None, recycle: bool = False) -> Receiver:
        """The Receiver of a rollout the running job has admitted (what :meth:`join` makes once
        :func:`~wb.runtime.membership.joining.request_join` returned; a group of ranks asks for
        all of them at once and makes each with this).

        Args:
            admission: the rank's :class:`~wb.runtime.membership.joining.Admission`.
            buffers, transport, store, name, layout, staging, staging_bytes, timeout,
                wait_timeout, handoff, allocate, recycle: as for :class:`Receiver`
                (``transport`` already started, as :meth:`join` does while it waits).

        Returns:
            The :class:`Receiver`: its first :meth:`apply` installs ``admission.first``.
        """
        rx = cls.__new__(cls)
        rx._start(admission.part, admission.part.rank, buffers, transport=transport, store=store,
                  staging=staging, name=name, staging_bytes=staging_bytes, timeout=timeout,
                  wait_timeout=wait_timeout, layout=layout, handoff=handoff, allocate=allocate,
                  recycle=recycle, admission=admission)
        return rx

    @property
    def buffers(self) -> dict[str, Any]:
        """The live buffers (with ``handoff``: the newest applied version's)."""
        return self._target.arrays()

    def check(self, spec, *, maps=None, per_tensor: int | None = checks.DEFAULT_PER_TENSOR,
              timeout: float | None = None) -> checks.CheckReport:
        """Checks that the live buffers hold the trainers' weights of the version applied
        (:mod:`wb.runtime.endpoints.checks`): the sample the trainers claimed
        (:meth:`wb.Sender.claim`, with the same ``per_tensor``), read here through the source
        maps, compared after this rollout's conversions. Nothing of the model moves.

        Args:
            spec: the checkpoint's :class:`wb.CheckpointSpec`.
            maps: ``{buffer: SourceMap}`` to read through instead of the planned layout's:
                maps just probed from the loader (``wb_torch.probe``...) show a stale map cache
                or a loader that changed.
            per_tensor: as the trainers claimed.
            timeout: seconds to wait for the trainers' claims (default ``wait_timeout``).

        Returns:
            A :class:`~wb.runtime.endpoints.checks.CheckReport` (``.ok``, per tensor status).
        """
        end, v = self._end, self.version
        if v <= 0:
            raise TransferError(f"rank {self.rank}: check() before any version was applied")
        live = {n: as_array(n, a, rank=self.rank) for n, a in self.buffers.items()}
        xp = next(iter(live.values()))[0]
        return checks.check(end.store, [end.key("claim", v, t) for t in end.trainers],
                            end.layout, {n: a.reshape(-1) for n, (_, a) in live.items()}, xp,
                            checks.sample(spec, end.key("check", v), per_tensor), spec,
                            rank=self.rank, version=v, maps=maps,
                            timeout=end.wait_timeout if timeout is None else timeout)

    def ready(self) -> bool:
        """Whether ``apply()`` has a new version to install (never blocks).

        With staging: the next version has fully landed in staging (or failed: then ``apply``
        raises). Without: every trainer has announced the next version (``apply`` will receive it).
        """
        return self._error is not None or self._path.ready(self._next)

    def pull(self) -> None:
        """Starts receiving the next version into staging in the background (with staging; a
        no-op if already receiving). Without staging, the same as :meth:`apply`."""
        if not self.staging:
            self.apply()
        elif self._error is None and not self._closed:
            self._path.start(self._next)

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
            ChecksumError: messages of the version failed their checksums
                (:mod:`wb.runtime.engine.digests`): with staging nothing of it was installed
                (the live buffers hold ``self.version``); without, the live buffers hold bytes
                that failed (``self.version`` is ``-1``). The transfer itself finished, so the
                receiver goes on: the next ``apply`` receives the version after it.
        """
        t0 = time.perf_counter()
        if self._error is not None:
            raise self._error
        if self._closed:
            raise TransferError(f"rank {self.rank}: apply() after close()")
        v = self._next
        try:
            moved = self._path.receive(v)
        except _NotArrived as e:  # nothing failed: the version may still come
            raise TransferError(str(e)) from None
        except ChecksumError as e:  # refused, every byte moved: the next version comes as usual
            self._next = v + 1
            kept_live = self._path.keeps_live or not self._target.in_place
            if not kept_live:
                self.version = -1
            if not self._closed:
                self._path.start(v + 1)
            kept = (f"the live buffers still hold version {self.version}" if kept_live else
                    "the live buffers hold what failed (no receiver staging): do not "
                    "generate from them before the next apply()")
            raise ChecksumError(e.rank, e.bad, e.stats,
                                note=f"version {v} refused; {kept}") from e
        except BaseException as e:
            self._error = self._failure(v, e)
            raise self._error from e
        self.version = v
        self._next = v + 1
        self._end.record(v, time.perf_counter() - t0, moved)
        if not self._closed:
            self._path.start(v + 1)
        if self._desk is not None:
            self._desk.poll()
        return v

    def serve_checks(self, spec, *, maps=None,
                     per_tensor: int | None = checks.DEFAULT_PER_TENSOR) -> None:
        """Answers weight checks asked for from outside the job (``python -m wb check``,
        :mod:`wb.runtime.endpoints.asks`): at the first ``apply`` of a version every trainer
        claimed after the ask, :meth:`check` (``maps``, ``per_tensor``: as there) and the
        report published. Looks for one at each apply (a store read at most every second)."""
        end = self._end

        def act(n: int) -> dict | None:
            v = self.version
            since = asks.claimed_since(end.store, end.name, n, end.trainers)
            if v <= 0 or since is None or since > v:
                return None  # its trainers claim later versions: answered at one of those
            rep = self.check(spec, maps=maps, per_tensor=per_tensor, timeout=30.0)
            return {"version": v, "ok": rep.ok, "counts": rep.counts, "report": str(rep),
                    "mismatched": rep.mismatched[:100], "seconds": round(rep.seconds, 3)}

        self._desk = asks.Desk(end.store, end.name, self.rank, "rollout", act)

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
