"""What a :class:`wb.Sender` and a :class:`wb.Receiver` share: one worker's end of a plan, kept
across versions (:class:`Endpoint`), and how a background transfer hands its result back
(:func:`in_thread`, :class:`Transferred`).

Per version ``v``, every worker of the plan *joins* ``v`` (a key in the rendezvous store) and waits
for the peers it exchanges bytes with; then its program runs with tags ``v << 32``. A trainer
*announces* ``v`` when it is pushed, which is what a receiver without staging waits for.

In a job that sends deltas (a :class:`wb.Sender` made with ``delta=True``; its announcement says
so, and rollouts follow from the first version they see it), each worker's join record says the
version its program holds (:mod:`wb.runtime.engine.deltas.units`), and the units between two workers
that hold the same one travel as deltas.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import CancelledError, Future
from typing import Any, NamedTuple

from wb.data.layout import Layout, Role
from wb.data.plan import Plan, RankPlan, part_of
from wb.errors import PlanError, TransferError
from wb.runtime.engine.executor import connect
from wb.runtime.membership.finish import Finisher, Roster
from wb.runtime.membership.joining import Admission
from wb.runtime.membership.liveness import Heartbeat, Watch
from wb.runtime.engine.deltas.units import DeltaPlan
from wb.runtime.engine.digests import checksumming
from wb.runtime.engine.frames import framing
from wb.runtime.engine.program import Program
from wb.runtime.endpoints.stats import UpdateStats
from wb.runtime.engine.update import ExecStats

log = logging.getLogger(__name__)

__all__ = ["Endpoint", "Transferred", "in_thread", "take_part"]


class Transferred(NamedTuple):
    """One version's transfer at one worker."""

    joined_s: float  # time.time() when this worker joined the version
    stats: ExecStats  # what its program's update did


def in_thread(fn: Callable[..., Any], *args, name: str) -> Future:
    """Runs ``fn(*args)`` in a new daemon thread; its result (or error) comes in the Future.

    Daemon, not a pool's thread: a process must be able to exit while a background transfer
    still waits for a peer that is gone (up to ``wait_timeout``)."""
    fut: Future = Future()

    def body():
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever reads the Future
            fut.set_exception(e)

    threading.Thread(target=body, daemon=True, name=name).start()
    return fut


def take_part(plan: Plan | RankPlan | Mapping[int, RankPlan], rank: int, role: Role
              ) -> tuple[RankPlan, Roster | None]:
    """Where a plan enters a worker: ``rank``'s part of ``plan`` (cut out of a whole plan, or
    looked up among a process's parts), and the roster of a whole plan (``None`` for parts).

    Raises:
        TransferError: ``rank`` has no part in ``plan``, or is not a ``role`` of it (naming the
            plan's ranks of that role, or the ranks of the parts given).
    """
    if isinstance(plan, Plan):
        lays = plan.trainers if role == Role.TRAINER else plan.rollouts
        ranks = [lay.worker.rank for lay in lays]
        if int(rank) not in ranks:
            raise TransferError(f"rank {rank} is not a {role.value} of this plan "
                                f"({role.value} ranks: {ranks})")
        return RankPlan.of(plan, rank), Roster.of(plan)
    try:
        part = part_of(plan, rank)
    except PlanError as e:
        raise TransferError(str(e)) from None
    if part.role != role:
        have = sorted(plan) if isinstance(plan, Mapping) else [part.rank]
        raise TransferError(f"rank {rank} is not a {role.value} of these parts of the plan "
                            f"(they are ranks {have}'s; a part may have another role)")
    return part, None


class Endpoint:
    """One worker's end of a plan across versions: its program, its connected transport, its
    store keys, joins and records.

    Made once at set-up: checks the worker's role and buffers, works out its program, and connects
    to its peers (refusing any that runs another plan), so updates pay for none of it.

    Args:
        part: this rank's part of the plan (:class:`wb.RankPlan`; all a rank needs).
        buffers: ``{name: array}`` of the worker's buffers as given at set-up (checked now).
        role: the rank's role in the plan (checked where the plan entered: :func:`take_part`).
        transport: this rank's transport, kept connected across updates.
        store: the rendezvous store every worker shares.
        name: prefix of this session's store keys.
        staging_bytes: the executor's packing budget (default: 256 MiB on the host, 1 GiB with
            CUDA buffers).
        timeout: seconds without progress during a transfer before :class:`wb.TransferError`.
        wait_timeout: seconds to wait for peers to join (or trainers to announce) a version.
        layout: the worker's layout as it probed it; refused if the plan's differs.
        admission: a rollout's admission into a running job
            (:func:`wb.runtime.membership.joining.request_join`); ``None`` at a job's start.
        stage_receives: see :class:`~wb.runtime.engine.program.Program`.
        roster: every worker's layout, where the worker was given the whole plan (the trainers'
            leader plans repairs and joiners from it; the others know the members from it: see
            :class:`~wb.runtime.membership.finish.Roster`).

    Raises:
        TransferError: wrong role, wrong buffers, or a peer running another plan.
    """

    def __init__(self, part: RankPlan, buffers: Mapping[str, Any], *, role: Role, transport,
                 store, name: str, staging_bytes: int | None, timeout: float, wait_timeout: float,
                 layout: Layout | None, admission: Admission | None = None,
                 stage_receives: bool = False, roster: Roster | None = None):
        self.layout = part.layout
        self.part, self.rank, self.role = part, part.rank, role
        self.stage_receives = stage_receives
        self.program = Program(part, stage_receives=stage_receives, frames=framing(transport),
                               checksums=checksumming(transport))
        # refuse wrong buffers now, at set-up, not at the first update
        self.program.check(buffers, layout=layout)
        self.transport, self.store, self.name = transport, store, name
        self.staging_bytes, self.timeout, self.wait_timeout = staging_bytes, timeout, wait_timeout
        self.trainers = list(part.trainers)
        self.stats: list[UpdateStats] = []  # one per version, in order
        #: deltas: the job sends them (a trainer's choice; a rollout's once announced), and
        #: what a version lands in is the same memory every time (a rollout's target says)
        self.delta, self.stable = False, True
        self._delta_plan: DeltaPlan | None = None  # the version being joined's
        # Liveness: beat from now on; a stalled update or join asks which peer went silent
        self.heartbeat = Heartbeat(store, self.key("alive", self.rank),
                                   incarnation=None if admission is None else admission.incarnation)
        self.watch = Watch(store, lambda r: self.key("alive", r))
        # Set-up round: connect once now (UCX context, worker, endpoints), so updates do not pay
        # for it, and refuse peers that run another plan before any update.
        try:
            if admission is None:
                self.peers = connect(part, transport)
            else:  # a rollout joining a running job: its peers said hello long ago
                transport.connect([], hello=b"")
                self.peers = list(part.peers)
                transport.add_peers(self.peers)
        except BaseException:
            self.halt()
            raise
        # versions finish without rollouts that die during them; rollouts join between them
        self.finisher = Finisher(self, epoch=0 if admission is None else admission.epoch,
                                 roster=roster)

    def adopt(self, part: RankPlan) -> None:
        """Runs ``part`` (this rank's part of a plan for new membership) from the next version."""
        self.program.release()
        self.part = part
        self.program = Program(part, stage_receives=self.stage_receives,
                               frames=framing(self.transport),
                               checksums=checksumming(self.transport))
        self.peers = list(part.peers)

    # --- the store ------------------------------------------------------------------------------
    def key(self, *parts) -> str:
        return "/".join((self.name, *map(str, parts)))

    def announce(self, v: int) -> None:
        """A trainer says version ``v`` exists (what a receiver without staging waits for), and
        whether it goes as deltas."""
        self.store.set(self.key("version", v, self.rank), b"delta" if self.delta else b"1")

    def _announced_delta(self, v: int) -> bool:
        """Whether the trainers announced version ``v`` (announced already) as deltas."""
        try:
            return self.store.get(self.key("version", v, self.trainers[0]), 1.0) == b"delta"
        except (TransferError, IndexError):
            return False

    def held(self) -> int:
        """The version this worker's program holds for deltas (-1: none; or not a job that
        sends them)."""
        return self.program.version if self.delta and self.stable else -1

    def await_keys(self, keys: Mapping[int, str], late: Callable[[int], str], *,
                   cancel: threading.Event | None = None,
                   skip: Callable[[int], bool] | None = None,
                   gone: Callable[[int], bool] | None = None) -> None:
        """Waits (up to ``wait_timeout`` in all) until every ``keys[rank]`` is in the store; a
        rank that stopped beating meanwhile fails the wait at once (or, where ``skip(rank)``,
        is not waited for), and so is a rank for which ``gone(rank)`` says so (asked about
        every poll: another worker called it dead first).

        Raises:
            CancelledError: ``cancel`` was set (the endpoint is closing).
            TransferError: ``late(rank)``, the first key still missing at the deadline, or a
                rank waited for that stopped beating (dead or hung: named).
        """
        deadline = time.monotonic() + self.wait_timeout
        for r, key in keys.items():
            while True:
                try:
                    self.store.get(key, 0.05)
                    break
                except TransferError:
                    if cancel is not None and cancel.is_set():
                        raise CancelledError() from None
                    if gone is not None and gone(r):
                        log.warning("rank %d: peer %d was called dead before `%s`; going on "
                                    "without it", self.rank, r, key)
                        break
                    silent = self.watch.silent([r]) if r != self.rank else {}
                    if silent and skip is not None and skip(r):
                        log.warning("rank %d: peer %d stopped beating before `%s`; going on "
                                    "without it", self.rank, r, key)
                        break
                    if silent:
                        raise TransferError(
                            f"rank {self.rank}: peer {r} ({silent[r]:.1f} s) stopped beating "
                            f"(dead or hung: no heartbeat in the store) while this rank waited "
                            f"for `{key}`") from None
                    if time.monotonic() > deadline:
                        raise TransferError(late(r)) from None

    def await_announced(self, v: int, *, cancel: threading.Event | None = None) -> None:
        """Waits (up to ``wait_timeout``) until every trainer has announced ``v``."""
        self.await_keys({r: self.key("version", v, r) for r in self.trainers},
                        lambda r: f"rank {self.rank}: trainer {r} did not push version {v} "
                                  f"within {self.wait_timeout:.0f} s", cancel=cancel)

    def join(self, v: int, *, cancel: threading.Event | None = None) -> float:
        """Joins version ``v`` and waits for every peer to join it (but rollouts fed apart in
        it: nobody waits for a joiner); returns the join time."""
        self.finisher.before_join(v)  # the membership the last version left, and v's joiners
        if self.role == Role.ROLLOUT and not self.delta:
            self.delta = self._announced_delta(v)
        joined = time.time()
        mine = self.held()
        self.store.set(self.key("join", v, self.rank),
                       json.dumps({"held": mine}).encode() if self.delta else b"1")
        trainers = set(self.trainers)
        waited = [p for p in self.peers if p not in self.finisher.apart]
        self.await_keys({p: self.key("join", v, p) for p in waited}, lambda p: (
            f"rank {self.rank}: peer {p} did not join version {v} within "
            f"{self.wait_timeout:.0f} s (wait_timeout); is its "
            f"{'push' if p in trainers else 'apply'} being called?"), cancel=cancel,
            # a dead rollout: the version goes on without it (wb.runtime.membership.finish), as soon as
            # this rank's watch finds it silent or the leader has called it dead
            skip=lambda p: p not in trainers,
            gone=lambda p: p not in trainers and p in self.finisher.called_dead(v))
        self._delta_plan = (DeltaPlan(v, *[frozenset(self._holding(v, waited, mine))] * 2)
                            if self.delta else None)
        return joined

    def _holding(self, v: int, peers, mine: int) -> list[int]:
        """The ``peers`` whose join record of ``v`` says they hold version ``mine`` (units with
        them travel as deltas); none where this worker holds none."""
        if mine < 0:
            return []
        out = []
        for p in peers:
            try:
                raw = self.store.get(self.key("join", v, p), 0.05)
                if json.loads(raw).get("held") == mine:
                    out.append(p)
            except (TransferError, ValueError, AttributeError):
                continue  # gone, or a record without deltas: dense
        return out

    # --- the transfer ----------------------------------------------------------------------------
    def run(self, v: int, arrays: Mapping[str, Any], *, ready: dict | None = None) -> ExecStats:
        """Version ``v``'s update of this worker's program, from or into ``arrays`` (peers checked
        at set-up, joined for ``v``; ``ready``: see :meth:`Program.run
        <wb.runtime.engine.program.Program.run>`)."""
        plan, self._delta_plan = self._delta_plan, None
        if plan is not None and plan.version != v:
            plan = None
        if self.delta and plan is None:  # joined without deltas: dense, holding nothing after
            self.program.forget_version()
        return self.finisher.run(v, arrays, ready=ready, delta=plan)

    def stop(self) -> None:
        """Stops beating (the worker is closing), once it knows which peers died (the closing
        barrier waits for the others only)."""
        try:
            self.finisher.before_join()
        except TransferError as e:
            log.warning("rank %d: closing without the last version's final record: %s",
                        self.rank, e)
        self.halt()

    def halt(self) -> None:
        """Stops this worker's threads: its heartbeat (peers will call it gone after their
        grace) and its watch's following."""
        self.heartbeat.stop()
        self.watch.stop()
        finisher = getattr(self, "finisher", None)  # halted before it was made: none
        if finisher is not None:
            finisher.admissions.stop()
        program = getattr(self, "program", None)  # halted before it was made: nothing kept
        if program is not None:
            program.release()

    def record(self, v: int, stall_s: float, t: Transferred) -> None:
        """Records version ``v``: ``stall_s`` seconds blocked the caller."""
        ex = t.stats
        self.stats.append(UpdateStats(v, self.rank, self.role.value, stall_s, t.joined_s,
                                      ex.start_s, ex.end_s, ex.bytes_sent, ex.bytes_received))
