"""What an update reports: :class:`ExecStats` per worker and :class:`TraceEntry` per message
(:func:`wb.runtime.engine.update.run_update` makes them)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

__all__ = ["ExecStats", "TraceEntry"]


@dataclass(frozen=True)
class ExecStats:
    """What one worker did: bytes and messages each way, seconds, staging high-water mark."""

    rank: int  # the worker
    bytes_sent: int  # to other ranks (local copies not counted)
    bytes_received: int  # from other ranks
    bytes_local: int  # copied within this rank
    messages_sent: int  # to other ranks
    messages_received: int  # from other ranks
    start_s: float  # time.time() when the first byte could move (after connecting)
    end_s: float  # time.time() when the worker's last message completed
    staging_peak: int  # bytes of packing/unpacking staging in use at most

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s

    def since(self, first: float | None) -> ExecStats:
        """These stats counted from ``first`` (a failed attempt's start), if earlier."""
        return self if first is None else replace(self, start_s=min(first, self.start_s))

    @staticmethod
    def merged(a: ExecStats | None, b: ExecStats) -> ExecStats:
        """One version's stats over its attempts ``a`` then ``b``: from the first start to the
        last end, bytes and messages summed, the higher staging peak."""
        if a is None:
            return b
        return ExecStats(b.rank, a.bytes_sent + b.bytes_sent, a.bytes_received + b.bytes_received,
                         a.bytes_local + b.bytes_local, a.messages_sent + b.messages_sent,
                         a.messages_received + b.messages_received, a.start_s, b.end_s,
                         max(a.staging_peak, b.staging_peak))


class TraceEntry(NamedTuple):
    """One message of a rank in one update, timed with ``time.time()`` (comparable across the
    processes of one host). A tuple: JSON writes it as a list, in this order."""

    message: int  # index in plan.messages
    stage: int  # 1 from a trainer, 2 between rollout nodes, 3 inside a rollout node
    peer: int  # the other rank
    outgoing: bool  # sent (or copied locally) by this rank
    nbytes: int  # bytes moved
    ready: float  # its data was here (a forward: its parent landed)
    posted: float  # handed to the transport (after packing)
    done: float  # completed (a receive: after unpacking)
