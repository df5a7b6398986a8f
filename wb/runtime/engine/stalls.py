"""What a stalled update says it waits for: the errors of
:func:`~wb.runtime.engine.update.run_update` name peers and plan steps, read off the update's
state (:class:`~wb.runtime.engine.update._Update`, which these methods are part of)."""

from __future__ import annotations

__all__ = ["Stalls"]


class Stalls:
    """The stall reports of an update: its ``prog``, ``msgs``, ``done``, ``ready``,
    ``inflight`` and ``sums`` are the update's own."""

    __slots__ = ()

    def waiting_for(self) -> set[int]:
        """The peers of the messages not done yet."""
        me, done = self.prog.rank, self.done
        out = {g.peer for m, g in self.msgs.items() if m not in done and g.peer != me}
        return out | self.sums.peers() if self.sums is not None else out

    def silent(self, silent: dict[int, float], stalled_s: float) -> str:
        """The error for peers that stopped beating while this rank waits for them."""
        who = ", ".join(f"{p} ({s:.1f} s)" for p, s in sorted(silent.items()))
        return (f"rank {self.prog.rank}: {'peer' if len(silent) == 1 else 'peers'} {who} "
                f"stopped beating (dead or hung: no heartbeat in the store for that long) while "
                f"this update waited {stalled_s:.1f} s for it; Waiting for: " + self.waiting())

    def stalled(self, timeout: float) -> str:
        """The stall error: no progress for ``timeout``, naming peers and plan steps."""
        peers = sorted({peer for (peer, _), q in self.inflight.queues.items() if q}
                       | (self.sums.peers() if self.sums is not None else set()))
        return (f"rank {self.prog.rank}: no progress for {timeout:.1f} s; peers {peers} are dead "
                f"or hung? Waiting for: " + self.waiting())

    def waiting(self) -> str:
        """What the rank still waits for: requests in flight, staging, forwards."""
        msgs, ready = self.msgs, self.ready
        waiting = [f"{'sending' if g.out else 'receiving'} {g.label()}"
                   for _, g, _ in self.inflight.first(4)]
        if ready:
            waiting.append(f"staging budget for {msgs[ready[0][1]].label()}")
        forwards = [g for g in msgs.values()
                    if g.out and g.parent >= 0 and g.parent not in self.done]
        for g in forwards[:2]:
            waiting.append(f"forwarding {g.label()} once message {g.parent} arrives")
        if self.sums is not None:
            waiting += self.sums.waiting()[:4]
        return "; ".join(waiting)
