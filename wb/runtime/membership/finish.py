"""How a version finishes when rollouts die during it: attempts, repair plans, membership.

A version runs in *attempts*; attempt 0 is the plan's. Each worker marks in the store that its part
of an attempt is done. The *leader*, the lowest trainer rank, waits after its own part until every
worker of the attempt is done. A worker that stays missing and stops beating (dead or hung:
:mod:`wb.runtime.membership.liveness`) makes it open the next attempt: it names the dead, takes the
surviving rollouts not done yet (the *need*: their buffers are partial), plans the trainers -> need
transfer (the planner's ordinary plan over those rollouts: what the dead were to forward comes from
a trainer, or from another rollout in need), and publishes each worker's part and the attempt's
record. Every trainer and every rollout in need then runs its part of the new attempt into the same
buffers (a rollout's staging or live buffers, written whole again: the same bytes), under tags of
its own. A worker whose attempt is stalled, on a silent peer or on a live one that waits for the
dead, cancels what it has in flight (the connections stay) and goes on with the new one. Once every
worker of the last attempt is done, the leader writes the version's *final* record: the rollouts of
the next version (the dead removed) and, when they changed, each worker's part of the plan without
the dead, which every worker takes up at its next join.

Trainers keep the version (their staging, or the live weights: ``push`` without staging blocks)
until the final record, since they may have to send it again. A rollout whose part is done returns
at once, unless a repair is under way: the leader marks its *intent* before it reads who is done,
and a rollout reads the intent after marking its own done, so one of the two always sees the other.
A trainer that dies fails the version for everyone: rollouts keep the previous version.

Membership is by version: a rollout that asks to join
(:func:`wb.runtime.membership.joining.request_join`, a new replica or a restarted one) is admitted
by the leader when it pushes the next version (:meth:`Finisher.admit`, before announcing it: a
*start* record names the epoch that version runs), and receives that version whole. In it the
joiner is *fed apart*: it gets everything it needs from the trainers and forwards nothing, the
others' routes are planned as if it were not there, and nobody waits for it to join; from the
version after, a plan with everyone (at the bound) takes over. So the others are not disturbed and
never wait for a joiner.

Planning again needs every worker's layout (a :class:`Roster`): from the whole plan, or from the
store where :func:`wb.agree_parts` put it; without one a rollout's death fails the version and no
joiner is admitted. Cancelling needs a transport with ``cancel`` (UCX's, the local one).

A rollout whose bytes failed their checksums (:class:`wb.ChecksumError`) counts as done: the
version finishes for all, then :meth:`Finisher.run` raises it to that rollout.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import NamedTuple

from wb.data.layout import Cluster, Layout, Role
from wb.data.plan import Plan
from wb.data.plan.plan import SMALL_RUN_BYTES
from wb.errors import ChecksumError, PeersLost, TransferError
from wb.runtime.engine.digests import checksumming
from wb.runtime.engine.frames import framing
from wb.runtime.engine.program import Program
from wb.runtime.engine.update import ExecStats
from wb.runtime.membership.joining import Admissions
from wb.runtime.membership.records import fetch_part, gather_layouts, publish_parts
from wb.runtime.membership.repairs import ATTEMPT_BITS, plan_ahead, plan_for, publish_repair
from wb.runtime.transport.stores import read_record, set_record

__all__ = ["Finisher", "Roster", "tag_base", "ATTEMPT_BITS"]

log = logging.getLogger(__name__)

_POLL_S = 0.004  # how often the store is read for records and done keys
_ASK_S = 0.25  # how often heartbeats are read (a peer is dead only after seconds anyway)
_PEEK_S = 0.001  # a store lookup that does not wait


class Roster(NamedTuple):
    """What the trainers' leader needs to plan again: every worker's layout, the link rates, the
    piece size of the plan and what it packs."""

    layouts: dict[int, Layout]  # {rank: layout} of every worker of the plan
    cluster: Cluster  # link rates the plan was balanced for
    chunk_bytes: int  # the plan's largest piece, bytes
    pack_below: int = SMALL_RUN_BYTES  # ranges of fewer bytes travel packed (wb.plan's)

    @classmethod
    def of(cls, plan: Plan) -> Roster:
        """The roster of a whole plan."""
        return cls({lay.worker.rank: lay for lay in (*plan.trainers, *plan.rollouts)},
                   plan.cluster, plan.chunk_bytes, plan.pack_below)


def tag_base(v: int, attempt: int) -> int:
    """The tag of message 0 of attempt ``attempt`` of version ``v``."""
    return (int(v) << 32) + (int(attempt) << ATTEMPT_BITS)


def _call(transport, method: str, peers) -> None:
    fn = getattr(transport, method, None)
    if fn is not None:
        fn(peers)


class Finisher:
    """One worker's side of finishing versions (see the module doc), used by its
    :class:`~wb.runtime.endpoints.endpoint.Endpoint`.

    Args:
        end: the endpoint.
        epoch: the membership epoch the worker starts in (a joiner's is its admission's).
        roster: every worker's layout (from a whole plan); without it the leader reads the
            roster :func:`wb.agree_parts` published, and the others learn the members from the
            final records.
    """

    def __init__(self, end, *, epoch: int = 0, roster: Roster | None = None):
        self.end = end
        self.trainers = sorted(int(t) for t in end.part.trainers)
        self.layouts: dict = {}  # every worker's, where known: the leader plans again from them
        self.rollouts: list[int] = []  # this epoch's, where known
        self.can_plan = False
        if roster is None and end.rank == self.trainers[0]:  # a part: the leader needs the roster
            roster = self._read_roster()
        if roster is not None:
            self.layouts = dict(roster.layouts)
            self.rollouts = sorted(r for r, lay in self.layouts.items()
                                   if lay.worker.role == Role.ROLLOUT)
            self.cluster, self.chunk_bytes = roster.cluster, roster.chunk_bytes
            self.pack_below = roster.pack_below
            self.can_plan = True
        self.leader = self.trainers[0]
        self.is_trainer = end.rank in self.trainers
        self.epoch = epoch
        self.pending_final: int | None = None  # a version whose final record is not read yet
        self.repairs: list[dict] = []  # the attempt records this worker ran or saw
        self.admissions = Admissions(self, peek=self._has)  # the leader's side of joining
        self.deaths: list[dict] = []  # the leader's: whom it called dead, in which version, when
        self._watched: set[int] = set()  # workers whose incarnation the watch knows
        self.ahead: dict = {}  # (v, attempt, rollouts left): where a repair planned ahead lies
        self._asked = 0.0  # when the leader, stalled in its own part, last read the heartbeats
        self.apart: set[int] = set()  # this epoch's rollouts fed apart (its joiners)
        self._top_epoch = epoch  # the highest epoch the leader has handed out
        self._epochs = threading.Lock()  # handed out by the pushing thread and the joins' one
        if end.rank == self.leader:  # it calls the dead: its watch times silences all along
            end.watch.follow(lambda: [r for r in (*self.trainers, *self.rollouts) if r != end.rank])
            if self.can_plan:  # and it plans joiners as soon as they ask
                self.admissions.follow()

    def _read_roster(self) -> Roster | None:
        """The roster of a job set up by :func:`wb.agree_parts` (under this session's name):
        every worker's layout from the store. Without a roster the leader cannot plan again: a
        dead rollout then fails the version and no rollout can join."""
        end = self.end
        raw = self._has(end.key("roster"))
        if raw is None:
            return None
        record = read_record(raw, end.key("roster"))
        if record.get("quantized"):
            return None  # trainers' quantised layouts are not in the store
        everyone = gather_layouts(end.store, world=int(record["world"]), name=end.name,
                                  timeout=self._patience)
        nic, nvlink, nodes = record["cluster"]
        return Roster({lay.worker.rank: lay for lay in everyone}, Cluster(nic, nvlink, nodes),
                      int(record["chunk_bytes"]),
                      int(record.get("pack_below", SMALL_RUN_BYTES)))

    # --- the store --------------------------------------------------------------------------------
    def _key(self, v: int, *parts) -> str:
        return self.end.key("v", v, *parts)

    def _has(self, key: str) -> bytes | None:
        try:
            return self.end.store.get(key, _PEEK_S)  # 0 means "forever" to some stores
        except TransferError:
            return None

    # --- one version ------------------------------------------------------------------------------
    def run(self, v: int, arrays, *, ready: dict | None = None, delta=None) -> ExecStats:
        """Version ``v`` for this worker, over as many attempts as it takes (``ready``: device
        work still writing ``arrays``, see :meth:`Program.run
        <wb.runtime.engine.program.Program.run>`; later attempts find it done; ``delta``: the
        first attempt's :class:`~wb.runtime.engine.deltas.units.DeltaPlan`, repairs go dense)."""
        self._refused: ChecksumError | None = None
        stats = self._run(v, arrays, ready=ready, delta=delta)
        if self._refused is not None:
            raise self._refused
        return stats

    def _run(self, v: int, arrays, *, ready: dict | None, delta=None) -> ExecStats:
        end, a, prog = self.end, 0, self.end.program
        total: ExecStats | None = None
        first = None  # when a failed attempt started: the version's stats run from there
        while True:
            ok = False
            if prog is not None:
                began = time.time()
                try:
                    ex = prog.run(arrays, end.transport, tag_base=tag_base(v, a),
                                  staging_bytes=end.staging_bytes, timeout=end.timeout,
                                  liveness=end.watch, interrupt=lambda: self._stop(v, a),
                                  ready=ready, delta=delta if a == 0 else None)
                    total, ok = ExecStats.merged(total, ex), True
                    self._refused = None  # this attempt rewrote every element it holds
                except ChecksumError as e:  # done, refused: the version finishes for all
                    total, ok, self._refused = ExecStats.merged(total, e.stats), True, e
                except PeersLost as e:
                    log.warning("version %d, attempt %d: %s", v, a, e)
                    first = began if first is None else first
                    if e.ranks:  # the leader may be waiting on a live peer: tell it
                        set_record(end.store, self._key(v, "lost", a), sorted(e.ranks))
            if ok:
                end.store.set(self._key(v, "done", a, end.rank), b"1")
                end.heartbeat.status = f"{v}.{a}"  # again in every beat: a lost key comes back
            if end.rank == self.leader:
                nxt = self._lead(v, a, ok)
            elif not self.is_trainer and ok and self._has(self._key(v, "intent", a + 1)) is None:
                self.pending_final = v  # done; the next join reads the final record
                return total.since(first)
            else:
                nxt = self._await(v, a)
            if nxt is None:  # final
                if not self.is_trainer:
                    self.pending_final = v
                self._take_final(v)
                if total is None:
                    raise TransferError(f"rank {end.rank}: version {v} finished without this "
                                        f"rank's part")
                return total.since(first)
            a += 1
            self.repairs.append(nxt)
            if self.is_trainer or end.rank in nxt["need"]:
                part = fetch_part(end.store, end.rank, timeout=self._patience,
                                  name=nxt.get("parts") or self._key(v, "part", a))
                _call(end.transport, "add_peers", part.peers)
                prog = Program(part, stage_receives=end.stage_receives,
                               frames=framing(end.transport),
                               checksums=checksumming(end.transport))
            elif ok:  # done before the repair: nothing more to receive
                self.pending_final = v
                return total.since(first)
            else:
                raise TransferError(f"rank {end.rank}: version {v} went on without this rank "
                                    f"(called dead after {nxt['dead']}); it holds part of it")

    def _beats_done(self, v: int, a: int, r: int) -> bool:
        """Whether worker ``r``'s beats say it is done with attempt ``a`` of version ``v`` (for a
        done key the store lost)."""
        return self.end.watch.status(r) == f"{v}.{a}"

    @property
    def _patience(self) -> float:
        """Seconds to wait for a record or for workers before failing the version."""
        return max(self.end.wait_timeout, self.end.timeout)

    def _stop(self, v: int, a: int) -> bool:
        """Whether a stalled attempt ``a`` should give up: the leader opened the next one, or
        (for the leader) a worker reported a lost peer. The leader stalled in its own part plans
        repairs ahead meanwhile, as it does once its part is done (:mod:`~wb.runtime.membership.
        repairs`)."""
        if self.end.rank != self.leader:
            return self._has(self._key(v, "intent", a + 1)) is not None
        if time.monotonic() - self._asked > _ASK_S:
            self._asked = time.monotonic()
            need = self.rollouts if a == 0 else self.repairs[-1]["need"]
            missing = [r for r in need if self._has(self._key(v, "done", a, r)) is None]
            if missing:
                plan_ahead(self, v, a, need, missing)
        return self._has(self._key(v, "lost", a)) is not None

    def _await(self, v: int, a: int) -> dict | None:
        """Waits for the version's final record (None) or attempt ``a + 1``'s record; fails if
        a trainer stops beating meanwhile (the version fails)."""
        end = self.end
        deadline = time.monotonic() + self._patience
        others = [t for t in self.trainers if t != end.rank]
        asked = 0.0
        while True:
            if self._has(self._key(v, "final")) is not None:
                return None
            rec = self._has(self._key(v, "attempt", a + 1))
            if rec is not None:
                rec = read_record(rec, self._key(v, "attempt", a + 1))
                if "failed" in rec:
                    raise TransferError(f"rank {end.rank}: version {v} failed: {rec['failed']}")
                return rec
            silent = {}
            if time.monotonic() - asked > _ASK_S:
                asked, silent = time.monotonic(), end.watch.silent(others)
            if silent:
                raise TransferError(
                    f"rank {end.rank}: trainer {min(silent)} stopped beating while version {v} "
                    f"finished; the version failed")
            if time.monotonic() > deadline:
                raise TransferError(f"rank {end.rank}: version {v} was not finished by its "
                                    f"leader (trainer {self.leader}) within "
                                    f"{self._patience:.0f} s")
            time.sleep(_POLL_S)

    def _lead(self, v: int, a: int, ok: bool) -> dict | None:
        """The leader after its part of attempt ``a``: the final record once all are done
        (None), or the next attempt's record once a missing worker is silent."""
        end = self.end
        need = self.rollouts if a == 0 else self.repairs[-1]["need"]
        workers = [r for r in (*self.trainers, *need) if r != end.rank or not ok]
        # the incarnation each worker beats as now: one restarted under its rank later is dead
        end.watch.silent([r for r in workers if r not in self._watched and r != end.rank])
        self._watched.update(workers)
        deadline = time.monotonic() + self._patience
        done: set[int] = set()  # grows: only the missing are read again
        asked = 0.0
        while True:
            done |= {r for r in workers if r not in done
                     and self._has(self._key(v, "done", a, r)) is not None}
            missing = [r for r in workers if r not in done]
            silent = {}
            if missing and time.monotonic() - asked > _ASK_S:
                asked = time.monotonic()
                # a done key the store lost: the worker's beats carry its status too
                done |= {r for r in missing if self._beats_done(v, a, r)}
                missing = [r for r in workers if r not in done]
                silent = end.watch.silent([r for r in missing if r != end.rank])
                if missing and not silent:  # plan ahead for those that look dead
                    plan_ahead(self, v, a, need, missing)
            if not missing:
                self._finish(v, set())
                return None
            if any(r in self.trainers for r in silent):
                raise TransferError(f"rank {end.rank}: trainer {min(silent)} stopped beating "
                                    f"during version {v}; the version failed")
            if silent:
                self.deaths.append({"version": v, "ranks": sorted(silent),
                                    "detected_s": time.time()})
                return self._repair(v, a, need, set(silent))
            if time.monotonic() > deadline:
                raise TransferError(f"rank {end.rank}: workers {missing[:8]} did not finish "
                                    f"version {v} within {self._patience:.0f} s and still beat "
                                    f"(hung?)")
            time.sleep(_POLL_S)

    def _repair(self, v: int, a: int, need: list[int], dead: set[int]) -> dict | None:
        end, store = self.end, self.end.store
        detected = time.time()
        store.set(self._key(v, "intent", a + 1), b"1")
        done = {r for r in need if self._has(self._key(v, "done", a, r)) is not None
                or self._beats_done(v, a, r)}
        dead_all = sorted(dead | self._dead_in(v))
        left = [r for r in need if r not in done and r not in dead]
        if not left:
            self._finish(v, set(dead_all))
            return None
        if not self.can_plan:
            msg = (f"rollouts {sorted(dead)} stopped beating and the leader (trainer "
                   f"{end.rank}) cannot plan again: give the Senders the whole plan, or set up "
                   f"with wb.agree_parts under this session's name (without quantize=)")
            set_record(store, self._key(v, "attempt", a + 1), {"failed": msg})
            raise TransferError(f"version {v} failed: {msg}")
        ahead = self.ahead.get((v, a + 1, tuple(left)))
        parts = ahead or self._key(v, "part", a + 1)
        if ahead is None:
            publish_repair(self, left, parts)
        rec = {"version": v, "attempt": a + 1, "dead": dead_all, "need": left, "detected_s": detected,
               "planned_s": time.time() - detected, "planned_ahead": ahead is not None,
               "parts": parts}
        set_record(store, self._key(v, "attempt", a + 1), rec)
        log.warning("version %d: rollouts %s stopped beating; attempt %d sends again to %s",
                    v, sorted(dead), a + 1, left)
        return rec

    def _finish(self, v: int, dead: set[int]) -> None:
        """The final record of version ``v``. With dead rollouts, or joiners fed apart in it,
        the plan for the next version's members first (their parts under the new epoch: the
        dead left out, the joiners planned with the others)."""
        dead |= self._dead_in(v)
        rollouts = sorted(r for r in self.rollouts if r not in dead)
        rec: dict = {"dead": sorted(dead), "rollouts": rollouts, "epoch": self.epoch,
                     "joined": []}
        if (dead & set(self.rollouts) or self.apart) and self.can_plan:
            if not rollouts:
                raise TransferError(f"version {v}: every rollout died")
            t0 = time.time()
            nxt = plan_for(self, rollouts)
            rec["epoch"] = self.new_epoch()
            rec["planned_s"] = time.time() - t0
            publish_parts(self.end.store, nxt, name=self.end.key("epoch", rec["epoch"]))
        set_record(self.end.store, self._key(v, "final"), rec)

    def members(self) -> tuple[int, tuple[int, ...]]:
        """``(epoch, rollouts)`` of now: between versions, the leader's are the next one's."""
        return self.epoch, tuple(self.rollouts)

    def new_epoch(self) -> int:
        """A membership epoch never used before (the leader's: epochs it planned and dropped
        are skipped, so no two plans are published under one name)."""
        with self._epochs:
            self._top_epoch = max(self._top_epoch, self.epoch) + 1
            return self._top_epoch

    def admit(self, v: int) -> None:
        """The leader, pushing version ``v`` before it announces it, admits the rollouts that
        asked to join into ``v`` (:meth:`wb.runtime.membership.joining.Admissions.admit`); everyone takes
        the new epoch up when joining ``v`` (:meth:`before_join`)."""
        if self.end.rank == self.leader and self.can_plan:
            self.admissions.admit(v)

    def called_dead(self, v: int) -> set[int]:
        """The rollouts the leader has called dead in version ``v`` so far, by its attempt
        records in the store (what a worker still waiting to join ``v`` for them reads)."""
        out: set[int] = set()
        a = 1
        while (raw := self._has(self._key(v, "attempt", a))) is not None:
            out |= set(read_record(raw, self._key(v, "attempt", a)).get("dead", ()))
            a += 1
        return out

    def _dead_in(self, v: int) -> set[int]:
        """The rollouts called dead in version ``v``'s attempts so far."""
        return {r for rec in self.repairs if rec.get("version") == v for r in rec["dead"]}

    # --- between versions -------------------------------------------------------------------------
    def before_join(self, v: int | None = None) -> None:
        """Takes up the membership the last version's final record set (a rollout that returned
        before it was written waits for it here), then, joining version ``v``, the one its
        start record sets (joiners admitted: :meth:`admit`). The leader writes that record
        before it announces ``v``: rollouts have waited for the announcement already, other
        trainers wait for it here."""
        end = self.end
        if self.pending_final is not None:
            last, self.pending_final = self.pending_final, None
            self._take_final(last, wait=True)
        if v is None:
            return
        if self.is_trainer and end.rank != self.leader:
            end.await_keys({self.leader: end.key("version", v, self.leader)},
                           lambda r: f"rank {end.rank}: the trainers' leader (rank {r}) did not "
                                     f"push version {v} within {end.wait_timeout:.0f} s")
        raw = self._has(self._key(v, "start"))
        if raw is None:
            return
        rec = read_record(raw, self._key(v, "start"))
        if rec["epoch"] <= self.epoch:
            return
        # members restarted under their rank: the old incarnation's connection is dropped
        _call(end.transport, "forget", set(rec.get("replaced", ())) - {end.rank})
        self._take_up(rec["epoch"], rec["rollouts"], set(rec["apart"]), set(rec["joined"]))

    def _take_up(self, epoch: int, rollouts, apart: set[int], back: set[int]) -> None:
        """Runs epoch ``epoch`` from now on: its rollouts (``apart``: those fed apart in it;
        ``back``: new incarnations of ranks, the members from now), this rank's part of it."""
        end = self.end
        self.rollouts, self.epoch, self.apart = list(rollouts), epoch, apart
        end.watch.reset(back)
        self._watched -= back
        part = fetch_part(end.store, end.rank, name=end.key("epoch", epoch),
                          timeout=self._patience)
        _call(end.transport, "add_peers", part.peers)
        end.adopt(part)

    def _take_final(self, v: int, *, wait: bool = False) -> None:
        end = self.end
        raw = (end.store.get(self._key(v, "final"), self._patience) if wait
               else self._has(self._key(v, "final")))
        if raw is None:
            return
        rec = read_record(raw, self._key(v, "final"))
        if rec["epoch"] == self.epoch:
            return
        # a worker without the roster knows no members before its first final record: the dead
        # named in it stand for the members who left
        gone = (set(self.rollouts) | set(rec["dead"])) - set(rec["rollouts"])
        # the dead's connections are dropped, a restarted one's too: it is reached anew
        _call(end.transport, "forget", (gone | set(rec["dead"])) - {end.rank})
        if end.rank in gone:
            raise TransferError(f"rank {end.rank} was called dead during version {v}")
        # the dead's (and joiners') new incarnations are the members from now
        self._take_up(rec["epoch"], rec["rollouts"], set(), set(rec["dead"]) | set(rec["joined"]))
        log.warning("rank %d: from version %d on, rollouts %s (without %s)", end.rank, v + 1,
                    self.rollouts, sorted(gone))
