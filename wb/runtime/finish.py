"""How a version finishes when rollouts die during it: attempts, repair plans, membership.

A version runs in *attempts*; attempt 0 is the plan's. Each worker marks in the store that its
part of an attempt is done. The *leader*, the lowest trainer rank, waits after its own part until
every worker of the attempt is done. A worker that stays missing and stops beating (dead or hung:
:mod:`wb.runtime.liveness`) makes it open the next attempt: it names the dead, takes the surviving
rollouts not done yet (the *need*: their buffers are partial), plans the trainers -> need transfer
(the planner's ordinary plan over those rollouts: what the dead were to forward comes from a
trainer, or from another rollout in need), and publishes each worker's part and the attempt's
record. Every trainer and every rollout in need then runs its part of the new attempt into the
same buffers (a rollout's staging or live buffers, written whole again: the same bytes), under
tags of its own. A worker whose attempt is stalled, on a silent peer or on a live one that waits
for the dead, cancels what it has in flight (the connections stay) and goes on with the new one.
Once every worker of the last attempt is done, the leader writes the version's *final* record:
the rollouts of the next version (the dead removed) and, when they changed, each worker's part of
the plan without the dead, which every worker takes up at its next join.

Trainers keep the version (their staging, or the live weights: ``push`` without staging blocks)
until the final record, since they may have to send it again. A rollout whose part is done
returns at once, unless a repair is under way: the leader marks its *intent* before it reads who
is done, and a rollout reads the intent after marking its own done, so one of the two always sees
the other. A trainer that dies fails the version for everyone, as before: rollouts keep the
previous version.

Needs the whole plan at every worker (a :class:`~wb.data.plan.Plan`), to plan again from its
layouts, and a transport with ``cancel``/``add_peers``/``forget`` (UCX's and the local one);
otherwise a dead peer fails the version, as before.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from wb.algorithms.planner import plan as make_plan
from wb.data.plan import Plan
from wb.data.rankplan import RankPlan, parts
from wb.errors import PlanError, TransferError
from wb.runtime.program import Program
from wb.runtime.rendezvous import get_large, set_large
from wb.runtime.update import ExecStats, PeersLost

__all__ = ["Finisher", "repairable", "tag_base", "ATTEMPT_BITS"]

log = logging.getLogger(__name__)

#: Bits of a tag for the message index within an attempt; the attempt sits above them and the
#: version above ``32``.
ATTEMPT_BITS = 27
_POLL_S = 0.01


def tag_base(v: int, attempt: int) -> int:
    """The tag of message 0 of attempt ``attempt`` of version ``v``."""
    return (int(v) << 32) + (int(attempt) << ATTEMPT_BITS)


def repairable(plan: Any) -> bool:
    """Whether versions finish through a :class:`Finisher`: the whole plan is at every worker
    (to plan again). It depends on the plan alone, so every worker of a job decides alike; a
    transport without ``cancel`` then fails the version when a peer dies, as before."""
    return isinstance(plan, Plan)


def _call(transport, method: str, peers) -> None:
    fn = getattr(transport, method, None)
    if fn is not None:
        fn(peers)


def _merged(a: ExecStats | None, b: ExecStats) -> ExecStats:
    """One version's stats over its attempts: from the first start to the last end, bytes and
    messages summed, the higher staging peak."""
    if a is None:
        return b
    return ExecStats(b.rank, a.bytes_sent + b.bytes_sent, a.bytes_received + b.bytes_received,
                     a.bytes_local + b.bytes_local, a.messages_sent + b.messages_sent,
                     a.messages_received + b.messages_received, a.start_s, b.end_s,
                     max(a.staging_peak, b.staging_peak))


class Finisher:
    """One worker's side of finishing versions (see the module doc), used by its
    :class:`~wb.runtime.endpoint.Endpoint`.

    Args:
        end: the endpoint (its plan must be a whole :class:`~wb.data.plan.Plan`).
    """

    def __init__(self, end):
        self.end = end
        plan: Plan = end.plan
        self.plan = plan
        self.layouts = {lay.worker.rank: lay for lay in (*plan.trainers, *plan.rollouts)}
        self.trainers = sorted(lay.worker.rank for lay in plan.trainers)
        self.rollouts = sorted(lay.worker.rank for lay in plan.rollouts)  # this epoch's
        self.leader = self.trainers[0]
        self.is_trainer = end.rank in self.trainers
        self.epoch = 0
        self.pending_final: int | None = None  # a version whose final record is not read yet
        self.repairs: list[dict] = []  # the attempt records this worker ran or saw

    # --- the store --------------------------------------------------------------------------------
    def _key(self, v: int, *parts) -> str:
        return self.end.key("v", v, *parts)

    def _has(self, key: str) -> bytes | None:
        try:
            return self.end.store.get(key, 0)
        except TransferError:
            return None

    # --- one version ------------------------------------------------------------------------------
    def run(self, v: int, arrays) -> ExecStats:
        """Version ``v`` for this worker, over as many attempts as it takes."""
        end, a, prog = self.end, 0, self.end.program
        total: ExecStats | None = None
        while True:
            ok = False
            if prog is not None:
                try:
                    ex = prog.run(arrays, end.transport, tag_base=tag_base(v, a),
                                  staging_bytes=end.staging_bytes, timeout=end.timeout,
                                  liveness=end.watch,
                                  interrupt=lambda: self._has(self._key(v, "intent", a + 1))
                                  is not None)
                    total, ok = _merged(total, ex), True
                except PeersLost as e:
                    log.warning("version %d, attempt %d: %s", v, a, e)
            if ok:
                end.store.set(self._key(v, "done", a, end.rank), b"1")
            if end.rank == self.leader:
                nxt = self._lead(v, a, ok)
            elif not self.is_trainer and ok and self._has(self._key(v, "intent", a + 1)) is None:
                self.pending_final = v  # done; the next join reads the final record
                return total if total is not None else ex
            else:
                nxt = self._await(v, a)
            if nxt is None:  # final
                if not self.is_trainer:
                    self.pending_final = v
                self._take_final(v)
                if total is None:
                    raise TransferError(f"rank {end.rank}: version {v} finished without this "
                                        f"rank's part")
                return total
            a += 1
            self.repairs.append(nxt)
            if self.is_trainer or end.rank in nxt["need"]:
                part = RankPlan.from_bytes(_get_parts(end, self._key(v, "part", a), end.rank))
                _call(end.transport, "add_peers", part.peers)
                prog = Program(part, end.rank)
            elif ok:  # done before the repair: nothing more to receive
                self.pending_final = v
                return total
            else:
                raise TransferError(f"rank {end.rank}: version {v} went on without this rank "
                                    f"(called dead after {nxt['dead']}); it holds part of it")

    def _await(self, v: int, a: int) -> dict | None:
        """Waits for the version's final record (None) or attempt ``a + 1``'s record; fails if
        a trainer stops beating meanwhile (the version fails)."""
        end = self.end
        deadline = time.monotonic() + max(end.wait_timeout, end.timeout)
        others = [t for t in self.trainers if t != end.rank]
        while True:
            if self._has(self._key(v, "final")) is not None:
                return None
            rec = self._has(self._key(v, "attempt", a + 1))
            if rec is not None:
                return json.loads(rec)
            silent = end.watch.silent(others)
            if silent:
                raise TransferError(
                    f"rank {end.rank}: trainer {min(silent)} stopped beating while version {v} "
                    f"finished; the version failed")
            if time.monotonic() > deadline:
                raise TransferError(f"rank {end.rank}: version {v} was not finished by its "
                                    f"leader (trainer {self.leader}) within "
                                    f"{max(end.wait_timeout, end.timeout):.0f} s")
            time.sleep(_POLL_S)

    def _lead(self, v: int, a: int, ok: bool) -> dict | None:
        """The leader after its part of attempt ``a``: the final record once all are done
        (None), or the next attempt's record once a missing worker is silent."""
        end = self.end
        need = self.rollouts if a == 0 else self.repairs[-1]["need"]
        workers = [r for r in (*self.trainers, *need) if r != end.rank or not ok]
        deadline = time.monotonic() + max(end.wait_timeout, end.timeout)
        while True:
            done = {r for r in workers if self._has(self._key(v, "done", a, r)) is not None}
            missing = [r for r in workers if r not in done]
            if not missing:
                self._finish(v, set())
                return None
            silent = end.watch.silent([r for r in missing if r != end.rank])
            if any(r in self.trainers for r in silent):
                raise TransferError(f"rank {end.rank}: trainer {min(silent)} stopped beating "
                                    f"during version {v}; the version failed")
            if silent:
                return self._repair(v, a, need, set(silent))
            if time.monotonic() > deadline:
                raise TransferError(f"rank {end.rank}: workers {missing[:8]} did not finish "
                                    f"version {v} within {max(end.wait_timeout, end.timeout):.0f}"
                                    f" s and still beat (hung?)")
            time.sleep(_POLL_S)

    def _repair(self, v: int, a: int, need: list[int], dead: set[int]) -> dict | None:
        end, store = self.end, self.end.store
        detected = time.time()
        store.set(self._key(v, "intent", a + 1), b"1")
        done = {r for r in need if self._has(self._key(v, "done", a, r)) is not None}
        dead_all = sorted(dead | {r for rec in self.repairs for r in rec["dead"]})
        left = [r for r in need if r not in done and r not in dead]
        if not left:
            self._finish(v, set(dead_all))
            return None
        repair = make_plan([self.layouts[t] for t in self.trainers],
                           [self.layouts[r] for r in left], self.plan.cluster,
                           chunk_bytes=self.plan.chunk_bytes)
        if repair.messages.stage.size >= 1 << ATTEMPT_BITS:
            raise PlanError(f"a repair plan of {repair.messages.stage.size} messages: more than "
                            f"2**{ATTEMPT_BITS} fit a tag")
        _publish(store, repair, self._key(v, "part", a + 1))
        rec = {"attempt": a + 1, "dead": dead_all, "need": left, "detected_s": detected,
               "planned_s": time.time() - detected}
        store.set(self._key(v, "attempt", a + 1), json.dumps(rec).encode())
        log.warning("version %d: rollouts %s stopped beating; attempt %d sends again to %s",
                    v, sorted(dead), a + 1, left)
        return rec

    def _finish(self, v: int, dead: set[int]) -> None:
        """The final record of version ``v``; with dead rollouts, the plan without them first."""
        dead |= {r for rec in self.repairs for r in rec["dead"]}
        rollouts = [r for r in self.rollouts if r not in dead]
        rec: dict = {"dead": sorted(dead), "rollouts": rollouts, "epoch": self.epoch}
        if dead & set(self.rollouts):
            if not rollouts:
                raise TransferError(f"version {v}: every rollout died")
            nxt = make_plan([self.layouts[t] for t in self.trainers],
                            [self.layouts[r] for r in rollouts], self.plan.cluster,
                            chunk_bytes=self.plan.chunk_bytes)
            rec["epoch"] = self.epoch + 1
            _publish(self.end.store, nxt, self.end.key("epoch", rec["epoch"]))
        self.end.store.set(self._key(v, "final"), json.dumps(rec).encode())

    # --- between versions -------------------------------------------------------------------------
    def before_join(self) -> None:
        """Takes up the membership the last version's final record set (a rollout that returned
        before it was written waits for it here)."""
        if self.pending_final is not None:
            v, self.pending_final = self.pending_final, None
            self._take_final(v, wait=True)

    def _take_final(self, v: int, *, wait: bool = False) -> None:
        end = self.end
        raw = (end.store.get(self._key(v, "final"), max(end.wait_timeout, end.timeout)) if wait
               else self._has(self._key(v, "final")))
        if raw is None:
            return
        rec = json.loads(raw)
        if rec["epoch"] == self.epoch:
            return
        gone = set(self.rollouts) - set(rec["rollouts"])
        self.rollouts, self.epoch = list(rec["rollouts"]), rec["epoch"]
        _call(end.transport, "forget", gone)
        if end.rank in gone:
            raise TransferError(f"rank {end.rank} was called dead during version {v}")
        part = RankPlan.from_bytes(_get_parts(end, end.key("epoch", self.epoch), end.rank))
        _call(end.transport, "add_peers", part.peers)
        end.adopt(part)
        log.warning("rank %d: from version %d on, rollouts %s (without %s)", end.rank, v + 1,
                    self.rollouts, sorted(gone))


def _publish(store, plan: Plan, name: str) -> None:
    """Every rank's part of ``plan`` under ``name`` (as :func:`wb.agree_parts` puts them)."""
    for part in parts(plan):
        set_large(store, f"{name}/part/{part.rank}", part.to_bytes())


def _get_parts(end, name: str, rank: int) -> bytes:
    return get_large(end.store, f"{name}/part/{rank}", max(end.wait_timeout, end.timeout))
