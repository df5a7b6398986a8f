"""A trainer worker's end of a plan: :class:`Sender`, and the two ways a version leaves it.

Without sender staging (:class:`_DirectSend`), ``push`` sends from the live buffers and returns
when this worker's bytes are sent. With it (:class:`_StagedSend`), ``push`` copies the live
buffers into staging and returns; a background thread sends the copy while training goes on,
and the next ``push`` first waits for that send. The way is chosen once, at set-up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future, wait
from typing import Any, NamedTuple, Protocol

import numpy as np

from wb.algorithms.fp8.tasks import Quantized, combine_amax, tasks_for
from wb.data.fp8 import BlockScaled
from wb.data.layout import Layout, Role
from wb.data.plan import Plan, RankPlan
from wb.errors import PlanError, TransferError
from wb.runtime.engine.buffers import as_array, check_buffers, copy, copy_of
from wb.runtime.endpoints.endpoint import Endpoint, Transferred, in_thread, take_part
from wb.runtime.engine.fp8 import Quantiser, amax_bytes, amax_from_bytes
from wb.runtime.transport.stores import get_large, read_record, set_large
from wb.runtime.endpoints.stats import UpdateStats
from wb.runtime.endpoints.targets import Live
from wb.runtime.engine.inflight import abort
from wb.runtime.transport.keyed import keyed
from wb.runtime.membership.joining import mark_pushing
from wb.runtime.endpoints import asks, checks

__all__ = ["Sender"]

log = logging.getLogger(__name__)


class _SendPath(Protocol):
    """How a pushed version leaves: what ``push`` does after it is announced."""

    def stage(self, live: Live) -> None:
        """Takes what must be copied before ``push`` returns."""

    def send(self, v: int, live: Live, t0: float, ready: dict) -> None:
        """Sends version ``v`` (``t0``: ``time.perf_counter()`` when ``push`` was called;
        ``ready``: device work still writing buffers, as :meth:`Quantiser.launch
        <wb.runtime.engine.fp8.Quantiser.launch>` gives it)."""

    def finish(self, *, charge: bool) -> None:
        """Waits for a version still being sent, records it, raises its error."""


class _DirectSend:
    """Sender staging off: ``push`` joins the version and sends from the live buffers, blocking
    until this worker's bytes are sent."""

    def __init__(self, end: Endpoint):
        self.end = end

    def stage(self, live: Live) -> None:
        pass  # nothing to copy: the live buffers themselves are sent

    def send(self, v: int, live: Live, t0: float, ready: dict) -> None:
        joined = self.end.join(v)
        ex = self.end.run(v, {n: a for n, (_, a) in live.items()}, ready=ready)
        self.end.record(v, time.perf_counter() - t0, Transferred(joined, ex))

    def finish(self, *, charge: bool) -> None:
        pass  # nothing runs in the background


class _Pending(NamedTuple):
    """A version being sent in the background."""

    version: int
    stall_s: float  # what push blocked its caller for (the copy into staging)
    result: Future  # of Transferred


class _StagedSend:
    """Sender staging on: ``push`` copies the live buffers into staging and returns; a thread
    joins the version and sends the copy while training goes on. Buffers the Sender itself
    writes at each push (``own``: an FP8 quantiser's) are sent as they are: nothing else writes
    them until the next push, which waits for this send first."""

    def __init__(self, end: Endpoint, live: Live, own: frozenset = frozenset()):
        self.end, self.own = end, own
        self.staging = copy_of({n: x for n, x in live.items() if n not in own})
        self.sent: dict[str, Any] = {}  # what the background send reads
        self.pending: _Pending | None = None

    def stage(self, live: Live) -> None:
        for n, (xp, a) in live.items():
            if n not in self.own:
                copy(xp, self.staging[n], a)
        self.sent = {**self.staging, **{n: live[n][1] for n in self.own}}

    def send(self, v: int, live: Live, t0: float, ready: dict) -> None:
        stall = time.perf_counter() - t0
        self.pending = _Pending(v, stall, in_thread(self._send, v, ready,
                                                    name=f"wb-send-{self.end.rank}-v{v}"))

    def _send(self, v: int, ready: dict) -> Transferred:
        joined = self.end.join(v)
        return Transferred(joined, self.end.run(v, self.sent, ready=ready))

    def finish(self, *, charge: bool) -> None:
        """The wait is a stall of the version that caused it when ``push`` waits (``charge``),
        not when the caller asks to wait (``wait``/``close``: the end of training, not a
        training step)."""
        if self.pending is None:
            return
        v, stall, fut = self.pending
        t0 = time.perf_counter()
        wait([fut])
        waited = time.perf_counter() - t0
        self.pending = None
        e = fut.exception()
        if e is not None:
            raise TransferError(f"rank {self.end.rank}: sending version {v} failed: {e}") from e
        self.end.record(v, stall + (waited if charge else 0.0), fut.result())


class Sender:
    """A trainer worker's end: ``push()`` once per training step.

    Args:
        plan: this rank's part of the plan (:class:`wb.RankPlan`, all a worker needs), the
            parts :func:`wb.agree_parts` gave this process (``{rank: RankPlan}``), or the whole
            :class:`wb.Plan` (its part is cut out here; its trainers' leader then plans repairs
            and joiners from it).
        rank: this worker's rank (a trainer of ``plan``).
        buffers: ``{name: array}`` of this worker's live weights (numpy / DLPack host arrays or CUDA
            arrays), read at every ``push``.
        transport: this rank's :class:`wb.runtime.transport.Transport`, kept connected across
            updates.
        store: the rendezvous :class:`wb.runtime.transport.stores.Store` every worker shares (joins,
            versions).
        staging: sender staging (see :mod:`wb.runtime.endpoints.modes`): ``push`` returns after a local
            copy.
        name: keeps the store keys of concurrent sessions apart.
        staging_bytes: the executor's packing budget (default: 256 MiB on the host, 1 GiB with
            CUDA buffers).
        timeout: seconds without progress during a transfer before :class:`wb.TransferError`.
        wait_timeout: seconds to wait for peers to join a version (rollouts reach ``apply`` only
            between generation steps).
        layout: this worker's layout as it probed it; refused if the plan's differs (a mapping
            ``{rank: Layout}``: this rank's; what a group of ranks passes).
        quantize: block-scaled FP8 rollouts: the :class:`~wb.data.fp8.BlockScaled` the plan was
            made with (``agree_parts(..., quantize=)``; give ``layout=`` too, this worker's own
            layout), or the :class:`~wb.algorithms.fp8.tasks.Quantized` of
            :func:`~wb.algorithms.fp8.tasks.quantize_layouts` whose trainer layouts the plan was
            made from. Every ``push`` first quantises this worker's blocks, from
            ``buffers``, into buffers the Sender keeps (on the same devices); ``buffers`` are the
            worker's own.
        delta: send each version as what changed since the version each rollout holds
            (:mod:`wb.runtime.engine.deltas.units`; one trainer's choice is the job's: give it to
            every trainer, rollouts follow; plan with ``agree_parts(..., delta=True)``, whose
            larger messages suit deltas). Every worker then keeps a copy of the bytes it
            sends (a trainer: its part of the weights, in their travelling dtype; a forwarding
            rollout: what it forwards) and a rollout one of what it converts on receipt. A
            rollout gets dense bytes until it holds a whole version (its first, one after a
            failed update, a new membership); rollouts that land each version in new memory
            (``handoff``) always do. Host buffers only so far: devices get dense bytes.

    Raises:
        TransferError: ``rank`` is not a trainer of ``plan``, wrong buffers, or a peer runs
            another plan (at set-up, before any update).

    Attributes:
        plan, rank, staging: as given.
        version: the last version pushed (0 before the first).
        stats: one :class:`~wb.runtime.endpoints.stats.UpdateStats` per version sent, in order.

    Examples:
        See ``examples/notebook_session.py`` and :class:`wb.LocalSession`.
    """

    def __init__(self, plan: Plan | RankPlan | Mapping[int, RankPlan], rank: int,
                 buffers: Mapping[str, Any], *, transport, store, staging: bool = True,
                 name: str = "wb",
                 staging_bytes: int | None = None, timeout: float = 60.0,
                 wait_timeout: float = 600.0, layout: Layout | None = None,
                 quantize: Quantized | BlockScaled | None = None, delta: bool = False):
        if isinstance(layout, Mapping):  # a group's ranks, each its own (the shims' groups)
            layout = layout.get(rank)
        part, roster = take_part(plan, rank, Role.TRAINER)
        store = keyed(store, transport=transport)  # signed with the job's key, if there is one
        self._quant, self._peers = None, ()
        if quantize is not None:
            if isinstance(quantize, BlockScaled):  # the tasks, rebuilt from both layouts
                if layout is None:
                    raise TransferError(f"rank {rank}: quantize= a declaration needs layout= "
                                        f"(this worker's own layout, as it probed it)")
                try:
                    quantize = tasks_for(quantize, layout, part.layout)
                except PlanError as e:
                    raise TransferError(str(e)) from e
            layout = None  # the plan's layout is the quantised one, not the probed one
            self._quant = Quantiser(quantize, rank,
                                    {n: as_array(n, a, rank=rank) for n, a in buffers.items()})
            buffers = {**buffers, **self._quant.buffers}
            if self._quant.parts:  # blocks held in part: who else holds parts of them
                self._peers = _amax_peers(quantize, rank, store, name, wait_timeout)
        self._end = Endpoint(part, buffers, role=Role.TRAINER, transport=transport,
                             store=store, name=name, staging_bytes=staging_bytes,
                             timeout=timeout, wait_timeout=wait_timeout, layout=layout,
                             roster=roster)
        self._end.delta = bool(delta)
        if self._quant is not None:  # its tables in the order every push sends
            self._quant.prepare(self._end.program.first_sent())
        self.plan, self.rank = plan, self._end.rank
        self.stats: list[UpdateStats] = self._end.stats  # one record per version sent, in order
        self.staging = bool(staging)
        try:
            self._live: Live = {n: as_array(n, buffers[n], rank=self.rank)
                                for n in self._end.layout.buffers}
            own = frozenset(self._quant.buffers) if self._quant is not None else frozenset()
            self._path: _SendPath = (_StagedSend(self._end, self._live, own) if self.staging
                                     else _DirectSend(self._end))
        except BaseException:  # no beating or watching thread is left behind
            self._end.halt()
            raise
        self.version = 0
        self._closed = False
        self._desk: asks.Desk | None = None
        self._leader = self._end.rank == self._end.finisher.leader
        if self._leader:  # joiners are admitted again (a session's earlier Sender closed)
            mark_pushing(store, name, None)

    @property
    def buffers(self) -> dict[str, Any]:
        """The live weights as wb reads them: numpy or CuPy views of the given arrays' own
        memory (no copy; :func:`wb.runtime.engine.buffers.address` gives their addresses)."""
        return {n: a for n, (_, a) in self._live.items()}

    def push(self, version: int | None = None, *, buffers: Mapping[str, Any] | None = None) -> int:
        """Sends the live weights as ``version`` (default: the last one + 1); returns it.

        ``buffers`` replaces the live weights from now on (frameworks whose arrays are immutable,
        like JAX, make new ones every step); they are checked as at set-up.

        Without staging this blocks until this worker's bytes are sent (and its rollout peers
        joined); with staging it blocks for the previous background send, if still running, and
        a local copy.

        Raises:
            TransferError: this or the previous update failed (a peer died or hung), bad
                ``buffers``, or a version not above the last one.
        """
        t0 = time.perf_counter()
        if self._closed:
            raise TransferError(f"rank {self.rank}: push() after close()")
        self._path.finish(charge=True)
        if buffers is not None:
            if self._quant is not None:
                buffers = {**buffers, **self._quant.buffers}
            check_buffers(self._end.layout, buffers)
            self._live = {n: as_array(n, buffers[n], rank=self.rank) for n in self._live}
        v = self.version + 1 if version is None else int(version)
        if v <= self.version:
            raise TransferError(f"rank {self.rank}: push(version={v}) but version {self.version} "
                                f"was already pushed; versions must increase")
        ready: dict = {}
        if self._quant is not None:  # queued on the device, sent as each buffer is written
            ready = self._quant.launch(
                self._live, exchange=lambda keys, amax: self._exchange(v, keys, amax),
                order=self._end.program.first_sent())
            if self.staging:  # the caller's step may overwrite what the kernels still read
                for ev in ready.values():
                    ev.synchronize()
        self._path.stage(self._live)
        self._end.finisher.admit(v)  # the leader takes in joiners before announcing v
        self._end.announce(v)
        self.version = v
        self._path.send(v, self._live, t0, ready)
        if self._desk is not None:
            self._desk.poll()
        return v

    def serve_checks(self, spec, *, per_tensor: int | None = checks.DEFAULT_PER_TENSOR) -> None:
        """Answers weight checks asked for from outside the job (``python -m wb check``,
        :mod:`wb.runtime.endpoints.asks`): while one is open, every push is claimed
        (:meth:`claim` of what was sent, ``per_tensor`` elements per tensor, as the rollouts'
        :meth:`wb.Receiver.serve_checks` must say). Looks for one at each push (a store read at
        most every second)."""
        since: dict[int, int] = {}  # ask -> the first version claimed for it

        def act(n: int) -> dict:
            count = self.claim(spec, per_tensor=per_tensor)
            return {"version": self.version, "since": since.setdefault(n, self.version),
                    "claimed": count}

        self._desk = asks.Desk(self._end.store, self._end.name, self.rank, "trainer", act)

    def _exchange(self, v: int, keys: np.ndarray, amax: np.ndarray) -> tuple:
        """Publishes the ``amax`` of this worker's parts of blocks for version ``v`` and returns
        ``(keys, amax)`` over the whole blocks, with the parts its peers published."""
        end = self._end
        set_large(end.store, end.key("amax", v, self.rank), amax_bytes(keys, amax))
        keys_of = {r: end.key("amax", v, r) for r in self._peers}
        end.await_keys(keys_of, lambda r: f"rank {self.rank}: trainer {r} did not publish the "
                                          f"amax of its FP8 block parts for version {v} within "
                                          f"{end.wait_timeout:.0f} s")
        parts = [(keys, amax)]
        parts += [amax_from_bytes(get_large(end.store, key, end.wait_timeout),
                                  where=f"store key `{key}`") for key in keys_of.values()]
        return combine_amax(parts)

    def claim(self, spec, weights: Mapping[str, Any] | None = None, *,
              per_tensor: int | None = checks.DEFAULT_PER_TENSOR,
              version: int | None = None) -> int:
        """Publishes what this trainer says ``version`` (default: the last pushed) holds, for
        the rollouts' weight checks (:meth:`wb.Receiver.check`): the values of a seeded sample
        of the checkpoint elements it holds (``per_tensor`` per tensor; ``None``: all).

        Args:
            spec: the checkpoint's :class:`wb.CheckpointSpec` (the one the maps were probed with).
            weights: ``{buffer: array}`` in this trainer's layout to read the values from: the
                weights it trains. Default: what it sent as ``version`` (with sender staging
                the staged copy, so training may go on after ``push``). Pass the framework's
                own parameters to catch a push of other buffers than those.
            per_tensor: elements sampled per checkpoint tensor; every trainer and rollout of a
                check must say the same.
            version: the version claimed.

        Returns:
            How many elements it published.
        """
        v = self.version if version is None else int(version)
        if weights is None and v != self.version:
            raise TransferError(f"rank {self.rank}: claim(version={v}) of another version than "
                                f"the last pushed ({self.version}) needs its weights=")
        if weights is None:  # what was sent: the staged copy, or the live weights
            sent = getattr(self._path, "sent", None) or {}
            live = {n: (x, sent.get(n, a)) for n, (x, a) in self._live.items()}
        else:
            live = {n: as_array(n, weights[n], rank=self.rank) for n in self._end.layout.buffers}
        xp = next(iter(live.values()))[0] if live else None
        ids = checks.sample(spec, self._end.key("check", v), per_tensor)
        return checks.claim(self._end.store, self._end.key("claim", v, self.rank),
                            self._end.layout, {n: a.reshape(-1) for n, (_, a) in live.items()},
                            xp, ids)

    def wait(self) -> None:
        """Blocks until the last pushed version is sent (staging); raises if it failed. This wait
        is not recorded as a stall (the caller chose to wait, e.g. at the end of training).

        Raises:
            TransferError: the last version failed.
        """
        self._path.finish(charge=False)

    def close(self) -> None:
        """Waits for the last send, then closes the transport (a barrier with the peers; after
        a failed version it is aborted instead: a peer may be dead, and would hold the barrier).

        Raises:
            TransferError: the last version failed (the transport is closed all the same).
        """
        if self._closed:
            return
        failed = True
        try:
            self._path.finish(charge=False)
            failed = False
        finally:
            self._closed = True
            self._end.stop()
            if self._leader:  # a rollout still asking to join is told, not left waiting
                try:
                    mark_pushing(self._end.store, self._end.name, self.version)
                except TransferError as e:
                    log.warning("rank %d: could not record the close in the store: %s",
                                self.rank, e)
            if failed:
                abort(self._end.transport)
            else:
                self._end.transport.close()

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _amax_peers(quantize, rank: int, store, name: str, timeout: float) -> tuple[int, ...]:
    """The trainers that hold parts of the blocks ``rank`` holds parts of: from the
    :class:`~wb.algorithms.fp8.tasks.Quantized` given, or as :func:`wb.agree_parts` published them."""
    if getattr(quantize, "peers", None) is not None:
        return tuple(quantize.peers.get(rank, ()))
    try:
        raw = store.get(f"{name}/fp8peers", timeout)
    except TransferError as e:
        raise TransferError(f"rank {rank} holds FP8 blocks in part, and no record of who else "
                            f"does (`{name}/fp8peers`, written by wb.agree_parts(..., "
                            f"quantize=)): {e}") from e
    peers = read_record(raw, f"{name}/fp8peers")
    if not isinstance(peers, dict):
        raise TransferError(f"rendezvous: key `{name}/fp8peers` holds no map of FP8 peers")
    return tuple(int(p) for p in peers.get(str(rank), ()))
