"""One update of a rank's :class:`~wb.runtime.engine.program.Program`: post, complete and forward
its messages until all are done.

The state of one update is :class:`_Update`; :func:`run_update` is its loop. Every turn it

1. posts receives into staging, in schedule order, while the receive budget lasts;
2. posts sends and local copies whose data is here (a forward once its parent landed), in
   schedule order; packed ones while the send budget lasts (zero-copy ones and local copies use
   no staging and go as soon as they are ready);
3. takes the completions of requests in flight (the completed head of each peer's FIFO, a
   look at the rest now and then: :class:`~wb.runtime.engine.inflight.Inflight`), unpacking
   landed receives (unless their transport did, from the sender's memory: :class:`~wb.runtime.
   engine.inflight.InPlace`) and releasing the forwards they feed, which are posted at once;
4. takes device work whose event has passed (CUDA: see
   :func:`~wb.runtime.engine.inflight.fencer`);
5. stops when every message is done; else, when nothing moved, yields, then backs off.

Receives and packed sends are posted in plan order, which is topological: the lowest unfinished
message of the whole plan always has its parent done, its receive posted and staging free at its
sender, so every plan makes progress whatever the budget. A peer that dies or hangs stops
completions: after ``timeout`` seconds without any progress the update raises
:class:`wb.TransferError` naming the peers and plan steps it still waits for, and aborts the
transport.

Costs per message are what this loop is about (thousands per rank an update): the program has
worked out all that does not depend on the buffers, and a turn allocates per message only what
moving it takes (staging, request, event, the tuples that queue it).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from typing import Any

from wb.errors import PeersLost, TransferError
from wb.algorithms.delta import max_bytes
from wb.runtime.engine.deltas.batches import post_sends, take_completions, take_parked
from wb.runtime.engine.deltas.units import DeltaPlan
from wb.runtime.engine.digests import Digests, copies_hashed
from wb.runtime.engine.execstats import ExecStats, TraceEntry
from wb.runtime.engine.frames import Frame
from wb.runtime.engine.gather import STAGES
from wb.runtime.engine.idle import Idle
from wb.runtime.engine.inflight import Inflight, abort, in_place
from wb.runtime.engine.stalls import Stalls

__all__ = ["DEFAULT_STAGING_BYTES", "ExecStats", "TraceEntry", "run_update"]


DEFAULT_STAGING_BYTES = 256 << 20
#: Packed sends in one launch (a launch costs ~15-20 us), and between looks at the device work
#: in a run of them: those packed go while the rest are packed.
POST_EVERY = STAGES


#: Seconds without progress before a stalled update asks the liveness watch about its peers
#: (then twice a second; a store lookup per peer): a peer dead before the update is named at once.
ASK_AFTER_S = 0.1
INTERRUPT_EVERY_S = 0.01  # then asks ``interrupt`` (a store lookup), and as often after


def run_update(program, mover, transport, *, tag_base: int, staging_bytes: int,
               timeout: float, trace: list | None, liveness=None,
               interrupt: Callable[[], bool] | None = None,
               delta: DeltaPlan | None = None) -> ExecStats:
    """Runs one update of ``program`` (a :class:`~wb.runtime.engine.program.Program`) whose
    bytes ``mover`` moves (a :class:`~wb.runtime.engine.movers.Mover` over its checked buffers)
    over a connected transport (see :meth:`Program.run`, which calls this).

    ``liveness`` (a :class:`~wb.runtime.membership.liveness.Watch`): once no progress has been made for
    :data:`ASK_AFTER_S`, it is asked (twice a second) whether a peer this rank still waits for
    stopped beating; such a peer fails the update at once, long before ``timeout``.

    ``interrupt``: with it, a silent peer raises :class:`PeersLost` and the transport is kept
    (what is in flight is cancelled), and once no progress has been made for
    :data:`INTERRUPT_EVERY_S` it is asked (that often) whether to give up waiting: then
    :class:`PeersLost` too, with no ranks. The caller (:mod:`wb.runtime.membership.finish`) goes on with
    the version another way.

    ``delta``: the update runs in a job that sends deltas (:mod:`wb.runtime.engine.deltas.units`):
    bases are kept, and units with the peers it names travel as deltas.

    Raises:
        PeersLost: see ``interrupt``.
        TransferError: a failed or stalled transfer, or a silent peer (the transport is then
            aborted).
    """
    u = _Update(program, mover, transport, tag_base=tag_base, staging_bytes=staging_bytes,
                traced=trace is not None, delta=delta)
    last = polled = time.monotonic()
    asked = last - 1.0  # the first question comes ASK_AFTER_S into a stall, the next 0.5 s later
    idle = Idle()  # spins, then sleeps longer each turn without progress
    turns = 0
    can_cancel = hasattr(transport, "cancel")
    # a transport progressed by its caller (wb.UcxTransport(progress="caller")): once a turn
    tick = transport.progress if getattr(transport, "progress_mode", "") == "caller" else None
    try:
        u.post_zero_copy_receives()
        start = time.time()
        while True:
            progressed = u.post_staged_receives()
            progressed |= u.post_ready_sends()
            if tick is not None:
                tick()
            turns += 1
            progressed |= u.take_completions(full=turns % 16 == 0 or idle.turns % 8 == 1)
            if u.ready:  # forwards that just became ready go before this turn's device work
                u.post_ready_sends()
            progressed |= u.take_device_work()
            if u.sums is not None:
                progressed |= u.sums.turn(idle=not progressed)
            if u.finished():
                break
            now = time.monotonic()
            if progressed:
                last = now
                idle.reset()
                continue
            if now - last > timeout:
                raise TransferError(u.stalled(timeout))
            if liveness is not None and now - last > ASK_AFTER_S and now - asked > 0.5:
                asked = now
                silent = liveness.silent(u.waiting_for())
                if silent and interrupt is not None and can_cancel:
                    raise PeersLost(u.silent(silent, now - last), silent)
                if silent:
                    raise TransferError(u.silent(silent, now - last))
            if interrupt is not None and can_cancel and now - last > INTERRUPT_EVERY_S \
                    and now - polled > INTERRUPT_EVERY_S:
                polled = now
                if interrupt():
                    raise PeersLost(f"rank {program.rank}: interrupted after {now - last:.1f} s "
                                    f"without progress: the version goes on without this "
                                    f"attempt; waiting for: " + u.waiting(), {})
            idle.wait()
    except PeersLost:
        transport.cancel()  # the connection stays: the version goes on over it
        raise
    except TransferError as e:
        peer = getattr(e, "peer", None)  # a request with this peer failed (connection reset)
        if interrupt is None or peer is None or not hasattr(transport, "cancel"):
            abort(transport)
            raise
        transport.cancel()
        raise PeersLost(str(e), {int(peer): 0.0}) from e
    except BaseException:
        abort(transport)
        raise
    end = time.time()
    if trace is not None:
        trace.extend(u.trace_entries())
    stats = ExecStats(program.rank, u.bytes_sent, u.bytes_received, u.bytes_local,
                      u.messages_sent, u.messages_received, start, end, u.peak)
    failed = u.sums.error(stats) if u.sums is not None else None
    if failed is not None:  # every byte moved; what came is not to be trusted
        raise failed
    return stats


class _Update(Stalls):
    """One update's state: staging in use, requests in flight, the sends whose data is here,
    device work awaiting its event, counters and trace marks. Each method is one step of
    :func:`run_update`'s turn and says whether anything moved."""

    __slots__ = ("prog", "msgs", "mover", "transport", "tag_base", "fence", "recv_budget", "parked",
                 "send_budget", "staged_recv", "staged_send", "peak", "inflight", "next_in",
                 "ready", "sent_out", "fenced", "done", "marks", "bytes_sent", "bytes_received",
                 "bytes_local", "messages_sent", "messages_received", "packed", "packed_done",
                 "sums", "held", "delta", "zc_in", "staged_in", "came", "cut", "pooled",
                 "stage_send", "unpacks", "hasher")

    def __init__(self, prog, mover, transport, *, tag_base: int, staging_bytes: int,
                 traced: bool, delta: DeltaPlan | None = None):
        self.prog, self.msgs, self.mover = prog, prog.units, mover
        self.transport, self.tag_base = transport, tag_base
        # sends the transport would rather take from staging (memory it cannot read one-sided)
        self.stage_send = getattr(transport, "stage_send", None)
        # device work finishes before a send is posted or a receive lands (UCX: `fencer`)
        self.fence = mover.fence
        # staging halved between receives and packed sends (a rank that sends nothing: all)
        self.recv_budget = self.send_budget = max(staging_bytes // (2 if prog.n_out else 1), 1)
        self.staged_recv = self.staged_send = self.peak = 0  # staging bytes in use
        self.inflight = Inflight()
        # deltas (wb.runtime.engine.deltas.units): every send keeps its base; receives of deltas go
        # through staging, in schedule order with the others
        self.delta = delta
        self.came: dict[int, list] = {}  # parent -> [the delta it brought, relays still to send]
        self.cut: dict[int, list] = {}  # frame -> [its changes decoded, forwards still to send]
        self.pooled: set[int] = set()  # sends from pool staging given back once sent
        self.parked: list = []  # device receives of deltas, landing behind events (take_parked)
        self.zc_in, self.staged_in = prog.zero_copy_receives, prog.staged_receives
        if delta is not None and delta.frm:
            units, when, frm = prog.units, prog.when, delta.frm
            self.zc_in = [m for m in self.zc_in if units[m].peer not in frm]
            self.staged_in = sorted(self.staged_in + [m for m in prog.zero_copy_receives
                                                      if units[m].peer in frm],
                                    key=lambda m: (when[m], m))
        self.next_in = 0  # self.staged_in[:next_in] are posted
        # sends whose data is here, as a heap of (schedule time, message); the roots are sorted:
        # a heap already
        self.ready: list[tuple[float, int]] = list(prog.roots)
        self.sent_out = 0  # sends and local copies started
        self.fenced: list[tuple[Any, Any, Any]] = []  # (event, message, staging) on the device
        self.done: set[int] = set()
        self.marks: dict[int, list] | None = {} if traced else None  # m -> [ready, posted, done]
        self.bytes_sent = self.bytes_received = self.bytes_local = 0
        self.messages_sent = self.messages_received = 0
        # packed sends staged and not yet complete: a heap of (schedule time, unit), with the
        # completed ones dropped from its top as they come up
        self.packed: list[tuple[float, int]] = []
        self.packed_done: set[int] = set()
        if traced:
            for _, m in self.ready:
                self.mark(m, 0)
        # checksums (wb.runtime.engine.digests): what is sent and landed is hashed
        self.sums = (Digests(prog.routes, prog, mover, transport, tag_base)
                     if prog.routes is not None else None)
        self.held: list[tuple[Any, Any]] = []  # (token, staging) still read by hashing
        # peers whose messages the transport may unpack from their memory: InPlace by peer
        self.unpacks = in_place(transport, mover, self.sums, delta,
                                {prog.units[m].peer for m in self.staged_in})
        self.hasher = copies_hashed(transport, self.sums, delta)  # copies hashed as they go

    # --- the steps of a turn -------------------------------------------------------------------
    def post_zero_copy_receives(self) -> None:
        """Zero-copy receives cost no staging: all are posted at once, before the loop."""
        msgs, recv, target, add = self.msgs, self.transport.recv, self.mover.target, \
            self.inflight.add
        base, marks = self.tag_base, self.marks
        if self.sums is not None:
            self.sums.post()
        hasher = self.hasher
        for m in self.zc_in:
            g = msgs[m]
            add(recv(g.peer, target(g), base + m) if hasher is None else
                recv(g.peer, target(g), base + m, hashed=(hasher, g)), g, None)
            if marks is not None:
                self.mark(m, 1)

    def post_staged_receives(self) -> bool:
        """Receives into staging, in schedule order, while the receive budget lasts (one at
        least when none is in flight, however big)."""
        staged_in, posted, frm = self.staged_in, False, self.delta.frm if self.delta else ()
        while self.next_in < len(staged_in):
            g = self.msgs[staged_in[self.next_in]]
            if self.staged_recv and self.staged_recv + g.nbytes > self.recv_budget:
                break
            if g.peer in frm:  # a delta: as long as it may be, and as long as it is
                buf = self.mover.staging(max_bytes(g.nbytes))
                req = self.transport.recv(g.peer, buf, self.tag_base + g.m, upto=True)
            elif g.peer in self.unpacks and not g.conv:  # unpacked from the peer's memory
                buf = self.mover.staging(g.nbytes)  # if it cannot be: the message lands here
                req = self.transport.recv(g.peer, buf, self.tag_base + g.m,
                                          unpack=(self.unpacks[g.peer], g))
            else:
                buf = self.mover.staging(g.nbytes)
                req = (self.transport.recv(g.peer, buf, self.tag_base + g.m)
                       if self.hasher is None else self.transport.recv(
                           g.peer, buf, self.tag_base + g.m, hashed=(self.hasher, g)))
            self.inflight.add(req, g, buf)
            self.mark(g.m, 1)
            self.staged_recv += buf.nbytes
            self.next_in += 1
            posted = True
        return posted

    def post_ready_sends(self) -> bool:
        """Sends and local copies whose data is here, in schedule order; packed sends while the
        send budget lasts."""
        ready, msgs, posted, marks = self.ready, self.msgs, False, self.marks
        send, source, add, pop = self.transport.send, self.mover.source, self.inflight.add, \
            heapq.heappop
        wait, sums, delta, stage = self.mover.wait, self.sums, self.delta, self.stage_send
        batches, run, packs, encode = getattr(self.mover, "batches", None), [], 0, []
        while ready:
            g = msgs[ready[0][1]]
            if g.zc_src and not g.local and delta is None and \
                    (stage is None or self.mover.direct(g, stage)):  # common: from the buffer
                pop(ready)
                self.sent_out += 1
                posted = True
                ev = wait(g)
                if ev is not None:  # its buffer is still being written: sent once it is
                    self.fenced.append((ev, g, None))
                    continue
                src = source(g)
                add(send(g.peer, src, self.tag_base + g.m), g, None)
                if sums is not None:
                    sums.sent(g, src)
                if marks is not None:
                    self.mark(g.m, 1)
                continue
            if not g.local and self.staged_send and \
                    self.staged_send + g.nbytes > self.send_budget and \
                    not self.lowest_in_flight(ready[0]):
                break
            pop(ready)
            self.sent_out += 1
            posted = True
            if g.local:
                self.mark(g.m, 1)
                self.mover.copy_local(g)
                self.after(self.fence(), g, None)
            elif delta is not None:  # encoded with the others of this turn, then sent
                self.staged_send += g.nbytes  # (counted as staged until they are encoded)
                heapq.heappush(self.packed, (self.prog.when[g.m], g.m))
                encode.append(g)
            else:  # packed: with the next ones of its kind, in one launch
                self.staged_send += g.nbytes
                heapq.heappush(self.packed, (self.prog.when[g.m], g.m))
                kind = batches(g) if batches is not None else None
                if run and kind != run[0][0]:
                    self.pack_run(run)
                    run = []
                run.append((kind, g))
                if kind is None or len(run) == POST_EVERY:
                    self.pack_run(run)
                    run = []
                packs += 1
                if packs % POST_EVERY == 0:  # the sends packed so far go (and their notes)
                    self.take_device_work()  # while the rest are packed
                    self.take_completions(full=False)
        if run:
            self.pack_run(run)
        if encode:
            post_sends(self, encode)
        self.peak = max(self.peak, self.staged_recv + self.staged_send)
        return posted

    def pack_run(self, run: list) -> None:
        """Packs ``run``'s messages (``(kind, unit)``, one kind) in one launch where the mover
        can; each is sent once the pack has passed."""
        gs = [g for _, g in run]
        bufs = self.mover.pack_many(gs) if run[0][0] is not None else [self.mover.pack(gs[0])]
        if self.sums is not None:  # hashed in a later batch, behind the pack; the sends do not
            for g, buf in zip(gs, bufs):  # wait for it, the staging's reuse does (release)
                self.sums.sent(g, buf)
        ev = self.fence()
        for g, buf in zip(gs, bufs):
            self.after(ev, g, buf)

    def lowest_in_flight(self, item: tuple[float, int]) -> bool:
        """Whether unit ``item`` (``(schedule time, unit)``) comes before every packed send in
        flight: then it goes even over the send budget. Units move in one order everywhere; a
        forward is ready when its parent lands, maybe after later units went, and the lowest
        unfinished unit of the plan must never wait for staging later ones hold (its receiver
        waits for it first): so every budget is deadlock-free. Later units still wait."""
        packed, done = self.packed, self.packed_done
        while packed and packed[0][1] in done:
            done.discard(heapq.heappop(packed)[1])
        return not packed or item < packed[0]

    def take_completions(self, *, full: bool) -> bool:
        """Completed requests: a send frees its staging; a receive is unpacked (then lands once
        the unpacking passed its event) or, zero-copy, has landed."""
        got = self.inflight.completed(full=full)
        sums, delta = self.sums, self.delta
        if delta is not None:
            return take_completions(self, got)
        if sums is not None and got:  # hashed as landed (unpacking only reads the staging)
            for req, g, buf in got:  # (one unpacked from its sender's memory, or copied
                if not g.out:  # hashed: hashed there)
                    sums.landed(g, None if getattr(req, "unpacked", False) or
                                getattr(req, "hashed", False) else
                                buf if buf is not None else self.mover.target(g))
        unpacks = []  # unpacked together where the mover can (one launch for several)
        for req, g, buf in got:
            if g.out:
                self.sent(g, g.nbytes, staged=buf is not None)
                if buf is not None:
                    self.release(buf)
            elif buf is not None and not getattr(req, "unpacked", False):
                unpacks.append((g, buf))
            else:  # zero-copy, or unpacked from the sender's memory by the transport
                self.landed(g, buf)
        if unpacks:
            for ev, g, buf in self.mover.unpack_all(unpacks):
                self.after(ev, g, buf)
        return bool(got)

    def sent(self, g, nbytes: int, *, staged: bool) -> None:
        """Unit ``g``'s send completed, ``nbytes`` on the wire; ``staged``: its memory counted in
        the send budget (a packed send's)."""
        self.bytes_sent += nbytes
        self.messages_sent += len(g.members) if g.__class__ is Frame else 1
        if self.marks is not None:
            self.mark(g.m, 2)
        if staged:
            self.staged_send -= g.nbytes
            self.packed_done.add(g.m)

    def take_device_work(self) -> bool:
        """Does what follows each pack, unpack or local copy whose event has passed; gives back
        the staging whose hashing has."""
        if self.held:
            passed, left = self.sums.passed, []
            for token, buf in self.held:
                if passed(token):
                    self.mover.release(buf)
                else:
                    left.append((token, buf))
            self.held = left
        parked = take_parked(self) if self.parked else False
        if not self.fenced:
            return parked
        waiting, passed, last, done = [], parked, None, False
        for item in self.fenced:
            if item[0] is not last:  # a run packed in one launch shares its event: asked once
                last, done = item[0], item[0].done
            if done:
                passed = True
                self.then(item[1], item[2])
            else:
                waiting.append(item)
        self.fenced = waiting
        return passed

    def finished(self) -> bool:
        return (not len(self.inflight) and not self.fenced and not self.held and not self.parked
                and self.next_in == len(self.staged_in)
                and self.sent_out == self.prog.n_out
                and (self.sums is None or self.sums.finished()))

    # --- what follows device work --------------------------------------------------------------
    def after(self, ev, g, buf) -> None:
        """What follows device work ``ev`` on message ``g``, now or once ``ev`` passed."""
        if ev is None:
            self.then(g, buf)
        else:
            self.fenced.append((ev, g, buf))

    def then(self, g, buf) -> None:
        """What follows a local copy (done), a pack (post the send) or an unpack (landed)."""
        if g.local:
            self.bytes_local += g.nbytes
            self.mark(g.m, 2)
            self.complete(g.m)
        elif g.out:  # packed (``buf``), or zero-copy once its buffer was written (None)
            src = buf if buf is not None else self.mover.source(g)
            self.inflight.add(self.transport.send(g.peer, src, self.tag_base + g.m), g, buf)
            if self.sums is not None and buf is None:  # a packed one was hashed with its pack
                self.sums.sent(g, src)
            self.mark(g.m, 1)
        else:
            self.landed(g, buf)

    def release(self, buf) -> None:
        """Staging back to the pool once no hashing reads it (a receive may go into it at once)."""
        token = self.sums.guard() if self.sums is not None else None
        if token is None:
            self.mover.release(buf)
        else:
            self.held.append((token, buf))

    def landed(self, g, buf) -> None:
        if buf is not None:
            self.staged_recv -= buf.nbytes
            self.release(buf)
        self.bytes_received += g.nbytes
        if g.__class__ is Frame:
            self.messages_received += len(g.members)
            if self.marks is not None:
                self.mark(g.m, 2)
            for member in g.members:
                self.complete(member.m)
            return
        self.messages_received += 1
        if self.marks is not None:
            self.mark(g.m, 2)
        self.complete(g.m)

    def complete(self, m: int) -> None:
        """Message ``m``'s data is here: the forwards it feeds are ready."""
        self.done.add(m)
        forwards = self.prog.forwards.get(m)
        if forwards:
            ready = self.ready
            for item in forwards:  # (schedule time, message)
                heapq.heappush(ready, item)
                if self.marks is not None:
                    self.mark(item[1], 0)

    # --- records -------------------------------------------------------------------------------
    def mark(self, m: int, i: int) -> None:
        """Trace: unit ``m`` (each of a frame's) reached step ``i`` (ready, posted, done) now."""
        if self.marks is not None:
            now, g = time.time(), self.msgs.get(m)
            for k in ([x.m for x in g.members] if g.__class__ is Frame else [m]):
                self.marks.setdefault(k, [None, None, None])[i] = now

    def trace_entries(self) -> list[TraceEntry]:
        out = []
        for m, (r, p, d) in sorted(self.marks.items()):
            g = self.prog.messages[m]
            out.append(TraceEntry(m, g.stage, g.peer, g.out, g.nbytes, r if r is not None else p,
                                  p, d))
        return out
