"""Joining a running job, both sides: a rollout's (:func:`request_join`: its layout and join
request published, then admission awaited) and the trainers' leader's (:class:`Admissions`:
it admits joiners into the version it pushes next, a process's ranks all together, fed apart in
that version; :mod:`wb.runtime.membership.finish` takes the new membership up from there).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from wb.data.layout import Layout, layouts_from_bytes, layouts_to_bytes
from wb.data.plan import RankPlan
from wb.errors import PlanError, SpecError, TransferError
from wb.runtime.transport.keyed import keyed
from wb.runtime.membership.liveness import new_incarnation, repeat
from wb.runtime.membership.records import fetch_part, publish_parts
from wb.runtime.membership.repairs import plan_for
from wb.runtime.transport.stores import get_large, read_record, set_large, set_record

__all__ = ["Admission", "request_join", "request_joins", "Admissions", "JOIN_RANGE",
           "mark_pushing"]

log = logging.getLogger(__name__)

#: How many ranks after the highest it knows a leader asks for join requests.
JOIN_RANGE = 16
#: Seconds a push waits for the joiners' plan before it goes on without admitting them.
PLAN_WAIT_S = 0.25
#: How often the leader looks for join requests between pushes (:meth:`Admissions.follow`).
LOOK_S = 0.05
#: Between pushes, requests left waiting (a process's other ranks) are read again this often.
RESCAN_S = 0.5


class Admission(NamedTuple):
    """A rollout taken into a running job: what it runs and from when."""

    part: RankPlan  # its part of the plan from its first version on
    first: int  # the first version it receives (whole)
    epoch: int  # the membership epoch it joins
    incarnation: str  # what its heartbeat must carry (tells it from a dead process of its rank)


def request_join(store, layout: Layout, *, name: str = "wb", timeout: float = 600.0,
                 meanwhile: Callable[[], Any] | None = None) -> Admission:
    """Asks the running job of ``store`` (session ``name``) to take in rollout ``layout``: a new
    replica's worker, or a restarted one. Publishes the layout, calls ``meanwhile()`` (set-up that
    must be done by admission: starting the transport, which publishes its address), publishes
    the join request, then waits until the trainers' leader admits it, when it pushes the next
    version.

    Returns:
        The rank's :class:`Admission`.

    Raises:
        TransferError: not admitted within ``timeout`` seconds (is the job pushing versions?),
            or as soon as the session's trainers have closed (:func:`mark_pushing`).
    """
    return request_joins(store, [layout], name=name, timeout=timeout,
                         meanwhile=meanwhile)[layout.worker.rank]


def request_joins(store, layouts, *, name: str = "wb", timeout: float = 600.0,
                  meanwhile: Callable[[], Any] | None = None
                  ) -> dict[int, Admission]:
    """:func:`request_join` for several ranks of one process at once: the leader admits them
    into the same version, all or none (a process's ranks must start together: one of them
    admitted a version before the others would hold that version up until they are).

    Returns:
        ``{rank: Admission}``.
    """
    lays = {int(lay.worker.rank): lay for lay in layouts}
    store = keyed(store)  # signed with the job's key (WB_JOB_KEY), if there is one
    token = new_incarnation()
    if len(lays) > 1:  # the leader admits none of them until it sees every one's request
        set_record(store, f"{name}/joingroup/{token}", sorted(lays))
    for rank, layout in lays.items():
        # beat as this incarnation from now on: the leader takes it for the member it admits
        store.set(f"{name}/alive/{rank}", f"{token}:0".encode())
        set_large(store, f"{name}/member/{rank}", layouts_to_bytes([layout]))
    deadline = time.monotonic() + timeout
    # before the request: the leader may admit it into the version it pushes next, and the
    # trainers then reach this rank at once, at the address its transport publishes (a
    # restarted rank's old one is still in the store until then)
    if meanwhile is not None:
        meanwhile()
    for rank in lays:
        store.set(f"{name}/joinreq/{rank}", token.encode())
    # one key the leader reads at every push: it looks for requests only when it changed
    store.set(f"{name}/joins", f"{token}:{time.time()}".encode())
    recs = {}
    for rank in lays:
        while True:
            try:
                raw = store.get(f"{name}/admitted/{rank}", 0.2)
            except TransferError:
                raw = None
            rec = None if raw is None else read_record(raw, f"{name}/admitted/{rank}")
            if rec is not None and rec["token"] == token:
                if "refused" in rec:
                    raise TransferError(f"rank {rank}: the trainers' leader refused to take it "
                                        f"into session `{name}`: {rec['refused']}")
                recs[rank] = rec
                break
            closed = _closed(store, name)
            if closed is not None:
                raise TransferError(
                    f"rank {rank}: the trainers of session `{name}` closed after version "
                    f"{closed['version']} ({time.time() - closed['t']:.0f} s ago): no version "
                    f"is left to join. A new Sender of the session takes joiners again")
            if time.monotonic() > deadline:
                raise TransferError(f"rank {rank}: not admitted to session `{name}` within "
                                    f"{timeout:.0f} s; the trainers' leader admits joiners when "
                                    f"it pushes a version: is the job pushing versions?")
            time.sleep(0.05)
    return {rank: Admission(fetch_part(store, rank, name=f"{name}/epoch/{rec['epoch']}",
                                       timeout=timeout), int(rec["version"]), int(rec["epoch"]),
                            token) for rank, rec in recs.items()}


def mark_pushing(store, name: str, last: int | None) -> None:
    """The trainers' leader says whether session ``name`` pushes versions: ``last=None`` when
    its Sender starts, the last version pushed when it closes. A rollout waiting to be admitted
    (:func:`request_joins`) is told at once that the trainers closed, instead of waiting out its
    timeout for a push that never comes."""
    set_record(store, f"{name}/closed", None if last is None else
               {"version": int(last), "t": time.time()})


def _closed(store, name: str) -> dict | None:
    """The close :func:`mark_pushing` recorded, or ``None``: the session pushes (or its record
    is missing or unreadable: the admission's timeout still stands)."""
    try:
        rec = read_record(store.get(f"{name}/closed", 0.0), f"{name}/closed")
    except TransferError:
        return None
    return rec if isinstance(rec, dict) and "version" in rec and "t" in rec else None


class Admissions:
    """The trainers' leader's side of joining: the join requests in the store, and their
    admission into a version it pushes.

    The plan for the new membership is made on a thread (a 1T job's takes seconds), started
    as soon as the request is seen (:meth:`follow` looks between pushes, and every push looks):
    a push waits for it at most :data:`PLAN_WAIT_S`, and one not ready by then admits the
    joiners at a later push (the trainers' pushes are never held up by a joiner). A plan that
    the membership changed under meanwhile (a death called) is dropped and made again; joiners
    whose layouts cannot be planned are refused.

    Args:
        fin: the leader's :class:`wb.runtime.membership.finish.Finisher` (its layouts, members, epoch,
            cluster and endpoint).
        peek: a store lookup that does not wait (``None`` when the key is missing).
    """

    def __init__(self, fin, *, peek: Callable[[str], bytes | None]):
        self.fin, self.peek = fin, peek
        self.joined: dict[int, str] = {}  # rank -> the join request admitted
        self._asked: bytes | None = None  # the join marker last read
        self._rescan = False  # requests were left waiting: read them again at the next push
        self._planning: _Planning | None = None
        # a plan for the requests that came while _planning was being made, with theirs: a
        # replica's restarted ranks ask a few tens of ms apart and are admitted together
        self._wider: _Planning | None = None
        self._lock = threading.Lock()  # the pushing thread and the looking one (follow)
        self._stop: threading.Event | None = None
        self._scanned = 0.0  # when the requests were last read (monotonic)

    def follow(self, every: float = LOOK_S) -> None:
        """Looks for join requests every ``every`` seconds from a daemon thread, until
        :meth:`stop`, and starts planning them as soon as they come: the push after a request
        then usually finds its plan made, where a plan started at that push may take longer
        than it waits (:data:`PLAN_WAIT_S`) and admit the joiner a version later."""
        if self._stop is None:
            self._stop = repeat(every, self._look, "wb-joins")

    def _look(self) -> None:
        with self._lock:
            self._start(looking=True)

    def stop(self) -> None:
        """Stops looking between pushes (:meth:`follow`)."""
        if self._stop is not None:
            self._stop.set()

    def _start(self, *, looking: bool = False) -> _Planning | None:
        """The plan being made for the rollouts that asked to join, started now if they asked
        since the last look (one key read when nobody did); None if nobody waits. Requests
        left waiting are read again at every push, and between pushes (``looking``) at most
        every :data:`RESCAN_S` (a read per rollout rank)."""
        job = self._planning
        if job is not None and job.members != self.fin.members():
            self._planning, self._rescan = None, True  # made for members that changed since
            self._wider = None
        if self._planning is not None and looking:
            self._widen()
        if self._planning is None:
            asked = self.peek(self.fin.end.key("joins"))
            if asked is None or (asked == self._asked and not self._rescan):
                return None
            if looking and asked == self._asked and time.monotonic() - self._scanned < RESCAN_S:
                return None
            self._asked, self._scanned = asked, time.monotonic()
            joiners = self.requests(set())
            if not joiners:
                return None
            self._planning = _Planning(self.fin, joiners)
        return self._planning

    def _widen(self) -> None:
        """Starts :attr:`_wider` where requests came since the plan being made started."""
        asked = self.peek(self.fin.end.key("joins"))
        if asked is None or asked == self._asked:
            return
        self._asked, self._scanned = asked, time.monotonic()
        joiners = self.requests(set())
        have = self._wider.joiners if self._wider is not None else self._planning.joiners
        if set(joiners.items()) - set(have.items()):
            self._wider = _Planning(self.fin, joiners)

    def admit(self, v: int) -> None:
        """Admits the rollouts that asked to join (all ranks of a process or none) into version
        ``v``, before the leader announces it, once their plan is made. They run ``v`` fed apart
        (:func:`wb.plan`'s ``apart``) under a new epoch, whose parts and *start* record are in
        the store before ``v`` is announced. Reads one key when nobody asked since the last
        look."""
        with self._lock:
            job, wider = self._start(), self._wider
        if job is None:
            return
        if wider is not None and wider.wait(PLAN_WAIT_S):
            job = wider  # every request so far; else the first ones, the others at a later push
        elif not job.wait(0.0 if wider is not None else PLAN_WAIT_S):
            log.info("version %d: the plan for joiners %s is not made yet; they are admitted "
                     "at a later push", v, sorted(job.joiners))
            return
        with self._lock:
            if job is not wider and wider is not None:
                self._rescan = True  # the wider plan's own joiners: planned again
            self._wider = None
            self._take(v, job)

    def _take(self, v: int, job: _Planning) -> None:
        """Admits ``job``'s joiners into ``v`` if its plan still holds (else plans again)."""
        fin, end = self.fin, self.fin.end
        self._planning = None
        # made for another membership (a death was called meanwhile), or a rank asked again
        # under another token (a missed peek reads None: the request stands): plan again at the
        # next push
        if job.members != fin.members() or any(
                (raw := self.peek(end.key("joinreq", r))) is not None and raw.decode(errors="replace") != token
                for r, token in job.joiners.items()):
            self._rescan = True
            return
        if isinstance(job.error, (PlanError, SpecError)):  # the joiners cannot be planned
            log.error("version %d: joiners %s refused: %s", v, sorted(job.joiners), job.error)
            for r, token in job.joiners.items():
                self.joined[r] = token  # not asked again until the rank asks anew
                set_record(end.store, end.key("admitted", r), {
                    "token": token, "refused": f"{type(job.error).__name__}: {job.error}"})
            return
        if job.error is not None:  # the store, say: plan again at the next push
            log.warning("version %d: planning for joiners %s failed (%s); again at the next "
                        "push", v, sorted(job.joiners), job.error)
            self._rescan = True
            return
        self._admit(v, job)

    def _admit(self, v: int, job: _Planning) -> None:
        fin, end = self.fin, self.fin.end
        store, epoch, joiners = end.store, job.epoch, job.joiners
        # members whose rank asked to join again: their process was restarted, so the
        # incarnation that was a member is dead (called so now, not a grace later) and the new
        # one is fed apart in v as any joiner; everyone drops the old one's connection
        replaced = sorted(set(joiners) & set(fin.rollouts))
        if replaced:
            fin.deaths.append({"version": v, "ranks": replaced, "detected_s": time.time(),
                               "restarted": True})
        for r, token in joiners.items():
            self.joined[r] = token
            set_record(store, end.key("admitted", r),
                       {"token": token, "epoch": epoch, "version": v})
        set_record(store, end.key("v", v, "start"),
                   {"epoch": epoch, "rollouts": job.rollouts, "joined": sorted(joiners),
                    "apart": sorted(joiners), "replaced": replaced, "planned_s": job.planned_s})
        log.warning("version %d: rollouts %s admitted (fed apart in this version)%s", v,
                    sorted(joiners), f"; {replaced} replace their dead incarnations"
                    if replaced else "")

    def requests(self, dead: set[int]) -> dict[int, str]:
        """Rollouts asking to join (:func:`request_join`) not admitted yet: ``{rank: token}``,
        their layouts read into the finisher's ``layouts``. Asked of every rollout rank the job
        knows (lost ones, and members: a member asking under a new incarnation was restarted,
        a launcher restarts a rank once its process ended, and the new one replaces it in
        :meth:`admit`), of ``dead``, and of the :data:`JOIN_RANGE` ranks after the highest it
        knows (new replicas number their ranks on from there)."""
        fin, end = self.fin, self.fin.end
        self._rescan = False
        known = set(fin.layouts) | set(self.joined)
        ranks = (set(fin.layouts) - set(fin.trainers)) | set(dead)
        top = max(known)
        out = {}
        for r in sorted(ranks | set(range(top + 1, top + 1 + JOIN_RANGE))):
            raw = self.peek(end.key("joinreq", r))
            if raw is None or raw.decode(errors="replace") == self.joined.get(r):
                continue
            key = end.key("member", r)
            try:
                lay = layouts_from_bytes(get_large(end.store, key, end.wait_timeout),
                                         where=f"store key `{key}`")[0]
            except (TransferError, SpecError) as e:
                log.warning("rank %d asked to join without a readable layout: %s", r, e)
                self._rescan = True
                continue
            if lay.worker.rank != r or lay.worker.role.value != "rollout":
                log.warning("a join request for rank %d came with the layout of rank %d (%s)",
                            r, lay.worker.rank, lay.worker.role.value)
                continue
            fin.layouts[r] = lay
            out[r] = raw.decode(errors="replace")
        for token in set(out.values()):  # a process's ranks: all of them, or none this time
            group = self.peek(end.key("joingroup", token))
            try:
                ranks = (read_record(group, end.key("joingroup", token)) if group is not None
                         else [])
            except TransferError as e:  # not admitted until its process asks anew
                log.warning("join request %s: %s", token, e)
                ranks = [None]
            if any(out.get(q) != token for q in ranks):
                log.info("join request %s: waiting for all of ranks %s", token, ranks)
                out = {q: t for q, t in out.items() if t != token}
                self._rescan = True
        return out


class _Planning:
    """The plan of the trainers and the members with ``joiners`` fed apart, made on a thread
    from the membership the next version runs (``members``: the epoch and rollouts it was made
    for) and its parts published under a new epoch (skipped, should the plan be dropped)."""

    def __init__(self, fin, joiners: dict[int, str]):
        self.joiners = dict(joiners)
        self.members = fin.members()
        self.rollouts = sorted(set(self.members[1]) | set(joiners))
        self.epoch = fin.new_epoch()
        self.error: BaseException | None = None
        self.planned_s = 0.0
        end = fin.end

        def run():
            t0 = time.time()
            try:
                nxt = plan_for(fin, self.rollouts, apart=sorted(self.joiners))
                publish_parts(end.store, nxt, name=end.key("epoch", self.epoch))
            except BaseException as e:  # noqa: BLE001 - the push that takes it up refuses them
                self.error = e
            self.planned_s = time.time() - t0
        self._thread = threading.Thread(target=run, name="wb-plan-joiners", daemon=True)
        self._thread.start()

    def wait(self, seconds: float) -> bool:
        """Whether the plan is made (or failed), waiting up to ``seconds``."""
        self._thread.join(seconds)
        return not self._thread.is_alive()
