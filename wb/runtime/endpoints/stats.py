"""What each worker spent on each version (:class:`UpdateStats`), and EWTT and AGST over all of
them (:func:`summarize`)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np

__all__ = ["UpdateStats", "Summary", "summarize"]


@dataclass(frozen=True, slots=True)
class UpdateStats:
    """What one worker spent on one version (times from ``time.time()``, seconds)."""

    version: int  # the version this record is of
    rank: int  # the worker
    role: str  # "trainer" or "rollout"
    stall_s: float  # seconds push/apply/pull blocked the caller for this version
    join_s: float  # when this worker joined the version's transfer
    start_s: float  # when its first byte could move (all its peers joined and connected)
    end_s: float  # when its last message completed
    bytes_sent: int  # to other ranks, in this version's transfer
    bytes_received: int  # from other ranks, in this version's transfer

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> UpdateStats:
        return cls(**json.loads(text))


class Summary(NamedTuple):
    """EWTT and AGST of a series of updates (seconds)."""

    ewtt_s: float  # mean over versions: last worker's end - last worker's start of the transfer
    agst_s: float  # mean over versions of the mean stall over every worker (GPU), both roles
    versions: int  # how many versions the records cover
    ewtt_per_version: dict[int, float]  # version -> its EWTT
    stall_per_rank: dict[int, float]  # mean stall per version, by rank
    trainer_stall_s: float  # mean over trainer workers and versions
    rollout_stall_s: float  # mean over rollout workers and versions


def summarize(stats: Iterable[UpdateStats]) -> Summary:
    """EWTT and AGST from every worker's :class:`UpdateStats` (gather them from all processes).

    EWTT of a version is the transfer itself: from the moment the last worker could start moving
    bytes to the moment the last worker finished. AGST is the average, over workers and versions,
    of the time wb blocked a worker (a GPU): trainers in ``push``, rollouts in ``apply``/``pull``.

    Args:
        stats: the records of every worker (``Sender.stats``, ``Receiver.stats``), any order.

    Returns:
        :class:`Summary`.

    Raises:
        ValueError: ``stats`` is empty.

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
