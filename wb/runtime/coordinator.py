"""Versions and sync modes on top of the executor: :class:`Sender` (trainer) and :class:`Receiver`
(rollout), one per worker (GPU), and the stall accounting behind EWTT and AGST.

Two switches give the four sync modes (:data:`MODES`):

- sender staging off: :meth:`Sender.push` blocks until this trainer's bytes are sent; on: it blocks
  only for a local copy of the weights into a staging buffer, then the copy is sent by a background
  thread while training goes on (the next ``push`` first waits for that send to finish).
- receiver staging off: :meth:`Receiver.apply` receives the new version straight into the live
  buffers, so the rollout stops generating for the whole transfer; on: the version lands in a
  staging buffer in the background while the rollout generates, and ``apply`` is one device copy
  into the live buffers (same addresses, as CUDA graphs need). A rollout never sees half a version,
  and a failed transfer leaves the previous version in place and raises from ``apply``.

Per update, every worker of the plan *joins* version ``v`` (a key in the rendezvous store) and waits
for the peers it exchanges bytes with; then the executor runs with tags ``v << 32``. A trainer
*announces* ``v`` when ``push`` is called, which is what :meth:`Receiver.ready` looks for without
staging. Each call records the seconds it blocked its caller (:class:`UpdateStats`);
:func:`summarize` turns every worker's records into EWTT and AGST.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import numpy as np

from wb.errors import TransferError
from wb.runtime.executor import (DEFAULT_STAGING_BYTES, ExecStats, _as_array, _check_buffers, connect,
                         execute)
from wb.data.layout import Layout, Role
from wb.data.plan import Plan

__all__ = ["Sender", "Receiver", "UpdateStats", "Summary", "summarize", "MODES", "aligned_empty",
           "agree_plan"]

log = logging.getLogger(__name__)

#: The four sync modes: ``name -> (sender staging, receiver staging)``.
MODES: dict[str, tuple[bool, bool]] = {
    "sync": (False, False),      # both sides block for the whole transfer
    "sender": (True, False),     # trainer copies and trains on; rollouts block while bytes land
    "receiver": (False, True),   # trainer blocks; rollouts generate while bytes land in staging
    "both": (True, True),        # each side blocks only for one local copy
}


@dataclass(frozen=True, slots=True)
class UpdateStats:
    """What one worker spent on one version (times from ``time.time()``, seconds)."""

    version: int
    rank: int
    role: str
    stall_s: float  # seconds push/apply/pull blocked the caller for this version
    join_s: float  # when this worker joined the version's transfer
    start_s: float  # when its first byte could move (all its peers joined and connected)
    end_s: float  # when its last message completed
    bytes_sent: int
    bytes_received: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> UpdateStats:
        return cls(**json.loads(text))


class Summary(NamedTuple):
    """EWTT and AGST of a series of updates (seconds)."""

    ewtt_s: float  # mean over versions: last worker's end - last worker's start of the transfer
    agst_s: float  # mean over versions of the mean stall over every worker (GPU), both roles
    versions: int
    ewtt_per_version: dict[int, float]
    stall_per_rank: dict[int, float]  # mean stall per version, by rank
    trainer_stall_s: float  # mean over trainer workers and versions
    rollout_stall_s: float  # mean over rollout workers and versions


def summarize(stats: Iterable[UpdateStats]) -> Summary:
    """EWTT and AGST from every worker's :class:`UpdateStats` (gather them from all processes).

    EWTT of a version is the transfer itself: from the moment the last worker could start moving
    bytes to the moment the last worker finished. AGST is the average, over workers and versions,
    of the time wb blocked a worker (a GPU): trainers in ``push``, rollouts in ``apply``/``pull``.

    Examples:
        >>> s = [UpdateStats(1, 0, "trainer", 0.5, 0., 1., 3., 8, 0),
        ...      UpdateStats(1, 1, "rollout", 0.1, 0., 2., 4., 0, 8)]
        >>> summarize(s).ewtt_s, summarize(s).agst_s
        (2.0, 0.3)
    """
    stats = list(stats)
    if not stats:
        raise ValueError("summarize needs at least one UpdateStats")
    by_v: dict[int, list[UpdateStats]] = {}
    for s in stats:
        by_v.setdefault(s.version, []).append(s)
    ewtt = {v: max(s.end_s for s in ss) - max(s.start_s for s in ss) for v, ss in sorted(by_v.items())}
    agst = float(np.mean([np.mean([s.stall_s for s in ss]) for ss in by_v.values()]))
    per_rank: dict[int, list[float]] = {}
    for s in stats:
        per_rank.setdefault(s.rank, []).append(s.stall_s)
    roles = {s.rank: s.role for s in stats}
    mean = {r: float(np.mean(v)) for r, v in sorted(per_rank.items())}

    def role_mean(role):
        vals = [m for r, m in mean.items() if roles[r] == role]
        return float(np.mean(vals)) if vals else 0.0
    return Summary(float(np.mean(list(ewtt.values()))), agst, len(by_v), ewtt, mean,
                   role_mean("trainer"), role_mean("rollout"))


def _copy(xp, dst, src) -> None:
    if xp is np:
        np.copyto(dst, src)
    else:
        with dst.device:  # CuPy's current device is per thread
            dst[...] = src
            xp.cuda.get_current_stream().synchronize()


class _Worker:
    """What Sender and Receiver share: the plan, this rank's buffers, peers, joins, records."""

    role: Role

    def __init__(self, plan: Plan, rank: int, buffers: Mapping[str, Any], *, transport, store,
                 staging: bool, name: str, staging_bytes: int, timeout: float,
                 wait_timeout: float, layout: Layout | None):
        lay = next((x for x in (*plan.trainers, *plan.rollouts) if x.worker.rank == rank), None)
        if lay is None or lay.worker.role != self.role:
            raise TransferError(f"rank {rank} is not a {self.role.value} of this plan "
                                f"({self.role.value} ranks: "
                                f"{[x.worker.rank for x in self._mine(plan)]})")
        # refuse wrong buffers now, at set-up, not at the first update
        _check_buffers(plan, rank, buffers, layout)
        self.plan, self.rank, self.transport, self.store = plan, int(rank), transport, store
        self.staging, self.name = bool(staging), name
        self.staging_bytes, self.timeout, self.wait_timeout = staging_bytes, timeout, wait_timeout
        self.live = {n: _as_array(n, buffers[n], rank) for n in lay.buffers}
        self.version = 0
        self.stats: list[UpdateStats] = []
        self._closed = False
        # Set-up round: connect once now (UCX context, worker, endpoints), so updates do not pay
        # for it, and refuse peers that run another plan before any update.
        self.peers = connect(plan, self.rank, transport)

    def _mine(self, plan):
        return plan.trainers if self.role == Role.TRAINER else plan.rollouts

    def _staging_copy(self) -> dict[str, Any]:
        """A copy of the live buffers: a transfer writes only the elements the plan maps, and the
        others (padding, elements no checkpoint id reaches) must keep their live values."""
        out = {}
        for n, (xp, a) in self.live.items():
            if xp is np:
                out[n] = np.empty_like(a)
            else:
                with a.device:  # on the buffer's own device, whatever this thread's is
                    out[n] = xp.empty_like(a)
            _copy(xp, out[n], a)
        return out

    def _key(self, *parts) -> str:
        return "/".join((self.name, *map(str, parts)))

    def _await_keys(self, keys: dict[int, str], cancel: threading.Event | None,
                    late: Callable[[int], str]) -> None:
        """Waits (up to ``wait_timeout`` in all) until every ``keys[rank]`` is in the store;
        raises ``_Cancelled`` when ``cancel`` is set, :class:`TransferError` ``late(rank)``."""
        deadline = time.monotonic() + self.wait_timeout
        for r, key in keys.items():
            while True:
                try:
                    self.store.get(key, 0.2)
                    break
                except TransferError:
                    if cancel is not None and cancel.is_set():
                        raise _Cancelled() from None
                    if time.monotonic() > deadline:
                        raise TransferError(late(r)) from None

    def _join(self, v: int, *, cancel: threading.Event | None = None) -> float:
        """Joins version ``v`` and waits for every peer to join it; returns the join time."""
        joined = time.time()
        self.store.set(self._key("join", v, self.rank), b"1")
        trainers = set(self._trainer_ranks())
        self._await_keys({p: self._key("join", v, p) for p in self.peers}, cancel, lambda p: (
            f"rank {self.rank}: peer {p} did not join version {v} within "
            f"{self.wait_timeout:.0f} s (wait_timeout); is its "
            f"{'push' if p in trainers else 'apply'} being called?"))
        return joined

    def _trainer_ranks(self) -> list[int]:
        return [x.worker.rank for x in self.plan.trainers]

    def _run(self, v: int, arrays: Mapping[str, Any]) -> ExecStats:
        return execute(self.plan, self.rank, arrays, self.transport,
                       staging_bytes=self.staging_bytes, timeout=self.timeout, tag_base=v << 32,
                       close=False, connected=True)  # peers checked at set-up, joined for v

    def _live_arrays(self) -> dict[str, Any]:
        return {n: a for n, (xp, a) in self.live.items()}

    def _record(self, v: int, stall: float, joined: float, ex: ExecStats) -> None:
        self.stats.append(UpdateStats(v, self.rank, self.role.value, stall, joined, ex.start_s,
                                      ex.end_s, ex.bytes_sent, ex.bytes_received))


class _Cancelled(Exception):
    pass


def aligned_empty(shape, dtype: str, *, align: int = 64) -> np.ndarray:
    """An uninitialised host array whose data starts on an ``align``-byte boundary (XLA's CPU
    client aliases such arrays instead of copying them)."""
    from wb.data.dtypes import dtype_info

    dt = np.dtype(dtype_info(dtype).numpy)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    raw = np.empty(n + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + n].view(dt).reshape(shape)


class Sender(_Worker):
    """A trainer worker's end: ``push()`` once per training step.

    Args:
        plan: the plan every worker of the update runs.
        rank: this worker's rank (a trainer of ``plan``).
        buffers: ``{name: array}`` of this worker's live weights (numpy / DLPack host arrays or CUDA
            arrays), read at every ``push``.
        transport: this rank's :class:`wb.runtime.transport.Transport`, kept connected across updates.
        store: the rendezvous :class:`wb.runtime.rendezvous.Store` every worker shares (joins, versions).
        staging: sender staging (see the module doc): ``push`` returns after a local copy.
        name: keeps the store keys of concurrent sessions apart.
        staging_bytes: the executor's packing budget.
        timeout: seconds without progress during a transfer before :class:`wb.TransferError`.
        wait_timeout: seconds to wait for peers to join a version (rollouts reach ``apply`` only
            between generation steps).
        layout: this worker's layout as it probed it; refused if the plan's differs.

    Examples:
        See ``examples/notebook_session.py`` and :class:`wb.LocalSession`.
    """

    role = Role.TRAINER

    def __init__(self, plan: Plan, rank: int, buffers: Mapping[str, Any], *, transport, store,
                 staging: bool = True, name: str = "wb",
                 staging_bytes: int = DEFAULT_STAGING_BYTES, timeout: float = 60.0,
                 wait_timeout: float = 600.0, layout: Layout | None = None):
        super().__init__(plan, rank, buffers, transport=transport, store=store, staging=staging,
                         name=name, staging_bytes=staging_bytes, timeout=timeout,
                         wait_timeout=wait_timeout, layout=layout)
        self._stage = self._staging_copy() if self.staging else None
        self._thread: threading.Thread | None = None
        self._pending: tuple | None = None  # (version, stall) of the send in the background
        self._result: dict[str, Any] = {}

    def push(self, version: int | None = None, *, buffers: Mapping[str, Any] | None = None) -> int:
        """Sends the live weights as ``version`` (default: the last one + 1); returns it.

        ``buffers`` replaces the live weights from now on (frameworks whose arrays are immutable,
        like JAX, make new ones every step); they are checked as at set-up.

        Without staging this blocks until this worker's bytes are sent (and its rollout peers
        joined); with staging it blocks for the previous background send, if still running, and
        a local copy.

        Raises:
            TransferError: this or the previous update failed (a peer died or hung).
        """
        t0 = time.perf_counter()
        if self._closed:
            raise TransferError(f"rank {self.rank}: push() after close()")
        self._finish()
        if buffers is not None:
            _check_buffers(self.plan, self.rank, buffers, None)
            self.live = {n: _as_array(n, buffers[n], self.rank) for n in self.live}
        v = self.version + 1 if version is None else int(version)
        if v <= self.version:
            raise TransferError(f"rank {self.rank}: push(version={v}) but version {self.version} "
                                f"was already pushed; versions must increase")
        if self.staging:
            for n, (xp, a) in self.live.items():
                _copy(xp, self._stage[n], a)
        self.store.set(self._key("version", v, self.rank), b"1")
        self.version = v
        if not self.staging:
            joined = self._join(v)
            ex = self._run(v, self._live_arrays())
            self._record(v, time.perf_counter() - t0, joined, ex)
            return v
        stall = time.perf_counter() - t0
        self._pending = (v, stall)
        self._result = {}
        self._thread = threading.Thread(target=self._background, args=(v,), daemon=True,
                                        name=f"wb-send-{self.rank}-v{v}")
        self._thread.start()
        return v

    def _background(self, v: int) -> None:
        try:
            joined = self._join(v)
            self._result["stats"] = (joined, self._run(v, self._stage))
        except BaseException as e:  # noqa: BLE001 - handed to the caller by wait()/push()
            self._result["error"] = e

    def _finish(self, *, charge: bool = True) -> float:
        """Waits for the background send; returns the seconds waited; raises its error. The wait
        is a stall of the version that caused it when ``push`` waits (``charge``), not when the
        caller asks to wait (``wait``/``close``: the end of training, not a training step)."""
        if self._thread is None:
            return 0.0
        t0 = time.perf_counter()
        self._thread.join()
        waited = time.perf_counter() - t0
        self._thread = None
        v, stall = self._pending
        if "error" in self._result:
            e = self._result["error"]
            raise TransferError(f"rank {self.rank}: sending version {v} failed: {e}") from e
        joined, ex = self._result["stats"]
        self._record(v, stall + (waited if charge else 0.0), joined, ex)
        return waited

    def wait(self) -> None:
        """Blocks until the last pushed version is sent (staging); raises if it failed. This wait
        is not recorded as a stall (the caller chose to wait, e.g. at the end of training)."""
        self._finish(charge=False)

    def close(self) -> None:
        """Waits for the last send, then closes the transport (a barrier with the peers)."""
        if self._closed:
            return
        try:
            self._finish(charge=False)
        finally:
            self._closed = True
            self.transport.close()


class Receiver(_Worker):
    """A rollout worker's end: ``ready()`` between generation steps, then ``apply()``.

    Args: as :class:`Sender`; ``buffers`` are the live weights the rollout reads (written in
        place: their addresses never change). With ``staging`` the next version is received in
        the background into a staging copy as soon as the previous one is applied (or at once).
        handoff: for frameworks whose arrays are immutable (JAX): ``buffers`` may be ``None``;
            every version lands in new buffers made by ``allocate(shape, dtype name)`` (default:
            64-byte aligned host arrays, which JAX wraps without copying), and after ``apply()``
            :attr:`buffers` are the newest version's, handed over, never written again.
        allocate: see ``handoff``.

    Examples:
        See ``examples/notebook_session.py`` and :class:`wb.LocalSession`.
    """

    role = Role.ROLLOUT

    def __init__(self, plan: Plan, rank: int, buffers: Mapping[str, Any], *, transport, store,
                 staging: bool = True, name: str = "wb",
                 staging_bytes: int = DEFAULT_STAGING_BYTES, timeout: float = 60.0,
                 wait_timeout: float = 600.0, layout: Layout | None = None,
                 handoff: bool = False, allocate=None):
        self.handoff = bool(handoff)
        self._allocate = allocate or aligned_empty
        if buffers is None:
            if not self.handoff:
                raise TransferError(f"rank {rank}: Receiver needs the live buffers (or "
                                    f"handoff=True to receive into new ones every version)")
            buffers = self._fresh(plan, rank)
        super().__init__(plan, rank, buffers, transport=transport, store=store, staging=staging,
                         name=name, staging_bytes=staging_bytes, timeout=timeout,
                         wait_timeout=wait_timeout, layout=layout)
        self._stage = self._staging_copy() if self.staging else None
        self._thread: threading.Thread | None = None
        self._landed = threading.Event()
        self._cancel = threading.Event()
        self._result: dict[str, Any] = {}
        self._error: BaseException | None = None
        self._announced: set[tuple[int, int]] = set()  # (version, trainer rank) seen
        if self.staging:
            self.pull()

    @property
    def buffers(self) -> dict[str, Any]:
        """The live buffers (with ``handoff``: the newest applied version's)."""
        return self._live_arrays()

    def _fresh(self, plan=None, rank=None) -> dict[str, Any]:
        """New buffers (handoff), holding the live values where they exist (see _staging_copy),
        zeros at first."""
        plan, rank = plan or self.plan, self.rank if rank is None else rank
        lay = next(x for x in plan.rollouts if x.worker.rank == rank)
        live = getattr(self, "live", None)
        out = {}
        for n, b in lay.buffers.items():
            out[n] = self._allocate(b.shape, b.dtype)
            xp, a = _as_array(n, out[n], rank)
            if live is None:
                a[...] = 0
            else:
                _copy(xp, a, live[n][1])
        return out

    def _staging_copy(self) -> dict[str, Any]:
        return self._fresh() if self.handoff else super()._staging_copy()

    # --- the rollout's calls -------------------------------------------------------------------
    def ready(self) -> bool:
        """Whether ``apply()`` has a new version to install (never blocks).

        With staging: the next version has fully landed in staging (or failed: then ``apply``
        raises). Without: every trainer has announced the next version (``apply`` will receive it).
        """
        if self._error is not None:
            return True
        if self.staging:
            return self._landed.is_set()
        v = self.version + 1
        for r in self._trainer_ranks():
            if (v, r) not in self._announced:
                try:
                    self.store.get(self._key("version", v, r), 0.001)
                except TransferError:
                    return False
                self._announced.add((v, r))
        return True

    def pull(self) -> None:
        """Starts receiving the next version into staging in the background (with staging; a
        no-op if already receiving). Without staging, the same as :meth:`apply`."""
        if not self.staging:
            self.apply()
            return
        if self._thread is None and self._error is None and not self._closed:
            self._landed.clear()
            self._result = {}
            v = self.version + 1
            self._thread = threading.Thread(target=self._background, args=(v,), daemon=True,
                                            name=f"wb-recv-{self.rank}-v{v}")
            self._thread.start()

    def apply(self) -> int:
        """Installs the next version into the live buffers and returns its number.

        With staging: waits for it to land (if it has not yet), copies staging into the live
        buffers and starts receiving the following version. Without: waits for the trainers to
        announce it and receives it into the live buffers.

        Raises:
            TransferError: the update failed (a trainer died or hung). With staging the live
                buffers still hold the previous version (``self.version``); without, they may
                hold a mix, and ``self.version`` is ``-1``. The receiver cannot be used again.
        """
        t0 = time.perf_counter()
        self._raise_if_failed()
        if self._closed:
            raise TransferError(f"rank {self.rank}: apply() after close()")
        v = self.version + 1
        if not self.staging:
            try:
                self._wait_announced(v)
                joined = self._join(v)
                target = self._fresh() if self.handoff else self._live_arrays()
                ex = self._run(v, target)
                if self.handoff:
                    self.live = {n: _as_array(n, a, self.rank) for n, a in target.items()}
            except BaseException as e:
                self._fail(v, e, live_intact=False)
                raise self._error from e
            self.version = v
            self._record(v, time.perf_counter() - t0, joined, ex)
            return v
        if self._thread is None:
            self.pull()
        # waiting for the trainers is bounded by wait_timeout; a transfer under way by the
        # executor's own inactivity timeout
        deadline = time.monotonic() + self.wait_timeout
        while self._thread.is_alive() and (self._result.get("moving")
                                           or time.monotonic() < deadline):
            self._thread.join(0.05)
        if self._thread.is_alive():
            raise TransferError(f"rank {self.rank}: version {v} did not arrive within "
                                f"{self.wait_timeout:.0f} s (wait_timeout); has the trainer "
                                f"pushed it?")
        self._thread = None
        if "error" in self._result:
            self._fail(v, self._result["error"], live_intact=True)
            raise self._error from self._result["error"]
        if self.handoff:  # the staging buffers become the live ones; new staging next time
            self.live = {n: _as_array(n, a, self.rank) for n, a in self._stage.items()}
            self._stage = self._staging_copy()
        else:
            for n, (xp, a) in self.live.items():
                _copy(xp, a, self._stage[n])
        self.version = v
        joined, ex = self._result["stats"]
        self._record(v, time.perf_counter() - t0, joined, ex)
        self.pull()
        return v

    def close(self) -> None:
        """Stops waiting for a next version and closes the transport."""
        if self._closed:
            return
        self._closed = True
        self._cancel.set()
        if self._thread is not None:
            self._thread.join(self.timeout + 5)
        if self._error is None:  # after a failure the executor has aborted the transport
            self.transport.close()

    # --- internals -----------------------------------------------------------------------------
    def _background(self, v: int) -> None:
        try:
            self._wait_announced(v, cancel=self._cancel)
            joined = self._join(v, cancel=self._cancel)
            self._result["moving"] = True
            self._result["stats"] = (joined, self._run(v, self._stage))
        except _Cancelled:
            self._result["cancelled"] = True
        except BaseException as e:  # noqa: BLE001 - handed to the caller by apply()
            self._result["error"] = e
        finally:
            self._landed.set()

    def _wait_announced(self, v: int, cancel: threading.Event | None = None) -> None:
        """Waits (up to ``wait_timeout``) until every trainer has announced ``v``."""
        self._await_keys({r: self._key("version", v, r) for r in self._trainer_ranks()}, cancel,
                         lambda r: f"rank {self.rank}: trainer {r} did not push version {v} "
                                   f"within {self.wait_timeout:.0f} s")

    def _fail(self, v: int, e: BaseException, *, live_intact: bool) -> None:
        if live_intact:
            what = (f"the live buffers still hold version {self.version} (staging kept the "
                    f"failed update out)")
        else:
            what = ("the live buffers may hold a mix of versions (no receiver staging); reload or "
                    "receive a full version before generating")
            self.version = -1
        self._error = TransferError(f"rank {self.rank}: receiving version {v} failed: {e}; {what}."
                                    f" This receiver cannot be used again; make a new one")

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error


def agree_plan(store, layouts, *, world: int, name: str = "wb", timeout: float = 600.0,
               **plan_kwargs) -> Plan:
    """Every process publishes its workers' layouts; the one holding rank 0 plans; all get the plan.

    Layouts and the plan travel through ``store`` as ``.npz`` bytes (no pickle). Ranks must be
    ``0 .. world - 1`` across all processes.

    Args:
        store: the rendezvous store every process shares.
        layouts: this process's workers' layouts (as each probed its own load path).
        world: the number of workers (trainers + rollouts) of the plan.
        name: keeps the keys of concurrent sessions apart.
        timeout: seconds to wait for the other processes.
        plan_kwargs: passed to :func:`wb.plan` (``cluster=``, ``chunk_bytes=``).

    Returns:
        The :class:`wb.Plan`, the same in every process.
    """
    import io

    from wb.data.layout import layouts_from_bytes, layouts_to_bytes
    from wb.algorithms.planner import plan as make_plan

    layouts = list(layouts)
    for lay in layouts:
        if not 0 <= lay.worker.rank < world:
            raise TransferError(f"rank {lay.worker.rank} is outside 0..{world - 1} (world={world})")
        store.set(f"{name}/layout/{lay.worker.rank}", layouts_to_bytes([lay]))
    if any(lay.worker.rank == 0 for lay in layouts):
        everyone = [layouts_from_bytes(store.get(f"{name}/layout/{r}", timeout))[0]
                    for r in range(world)]
        p = make_plan([x for x in everyone if x.worker.role == Role.TRAINER],
                      [x for x in everyone if x.worker.role == Role.ROLLOUT], **plan_kwargs)
        f = io.BytesIO()
        p.save(f)
        store.set(f"{name}/plan", f.getvalue())
        return p
    return Plan.load(io.BytesIO(store.get(f"{name}/plan", timeout)))
