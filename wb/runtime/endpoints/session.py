"""An in-process session: every worker of a plan as a thread, over the local transport.

For notebooks and tests: the same :class:`wb.Sender` / :class:`wb.Receiver` / executor code as a
multi-process run, with bytes copied by numpy between threads (no UCX, no processes).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from wb.data.layout import Role
from wb.data.plan import Plan, RankPlan
from wb.errors import TransferError
from wb.runtime.endpoints.modes import MODES
from wb.runtime.endpoints.receiver import Receiver
from wb.runtime.endpoints.sender import Sender
from wb.runtime.endpoints.stats import Summary, UpdateStats, summarize
from wb.runtime.transport.local import LocalHub, LocalTransport
from wb.runtime.transport.stores import MemoryStore

__all__ = ["LocalSession"]


class LocalSession:
    """Senders and receivers of one plan as threads of this process.

    Args:
        plan: the plan, or every worker's part of it (``{rank: RankPlan}``, as
            :func:`wb.agree_parts` gives them): each worker then gets only its own part.
        trainer_buffers: ``{rank: {name: array}}`` of every trainer (read at each update).
        rollout_buffers: ``{rank: {name: array}}`` of every rollout (written in place).
        mode: one of :data:`wb.MODES` (``"sync"``, ``"sender"``, ``"receiver"``, ``"both"``):
            which sides stage.
        timeout: seconds without progress before a transfer fails.
        delta: versions travel as deltas (see :class:`wb.Sender`).

    Examples:
        >>> import numpy as np, wb
        >>> sm = wb.SourceMap.from_indices(np.arange(8))
        >>> t = wb.Layout(wb.Worker(0, "t", "trainer", 0), {"w": wb.BufferSpec(sm, "float32")})
        >>> r = wb.Layout(wb.Worker(1, "r", "rollout", 0), {"w": wb.BufferSpec(sm, "float32")})
        >>> src, dst = np.arange(8, dtype=np.float32), np.zeros(8, np.float32)
        >>> with wb.LocalSession(wb.plan([t], [r]), {0: {"w": src}}, {1: {"w": dst}}) as s:
        ...     s.update().versions
        1
        >>> bool((dst == src).all())
        True
    """

    def __init__(self, plan: Plan | Mapping[int, RankPlan],
                 trainer_buffers: Mapping[int, Mapping[str, Any]],
                 rollout_buffers: Mapping[int, Mapping[str, Any]], *, mode: str = "both",
                 timeout: float = 60.0, delta: bool = False):
        if mode not in MODES:
            raise TransferError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
        # every worker takes its part of what is given (wb.Sender, wb.Receiver): cut out of a
        # whole plan, whose roster it then knows, or looked up among the parts
        if isinstance(plan, Plan):
            t_ranks = [lay.worker.rank for lay in plan.trainers]
            r_ranks = [lay.worker.rank for lay in plan.rollouts]
        else:
            t_ranks = sorted(r for r, q in plan.items() if q.role == Role.TRAINER)
            r_ranks = sorted(r for r, q in plan.items() if q.role == Role.ROLLOUT)
        for what, given, want in (("trainer_buffers", trainer_buffers, t_ranks),
                                  ("rollout_buffers", rollout_buffers, r_ranks)):
            if sorted(given) != sorted(want):
                raise TransferError(f"{what} has ranks {sorted(given)}, the plan's are "
                                    f"{sorted(want)}; give one buffer dict per rank")
        sync = MODES[mode]
        self.mode = mode
        hub, store = LocalHub(), MemoryStore()

        def kw(r):
            return dict(transport=LocalTransport(r, hub, timeout=timeout), store=store,
                        timeout=timeout, wait_timeout=timeout)
        self._pool = ThreadPoolExecutor(max_workers=len(t_ranks) + len(r_ranks),
                                        thread_name_prefix="wb-session")
        # every worker connects to its peers when made: make them all at once
        s_futs = {r: self._pool.submit(Sender, plan, r, trainer_buffers[r],
                                       staging=sync.sender_staging, delta=delta, **kw(r))
                  for r in t_ranks}
        r_futs = {r: self._pool.submit(Receiver, plan, r, rollout_buffers[r],
                                       staging=sync.receiver_staging, **kw(r)) for r in r_ranks}
        self.senders = {r: f.result() for r, f in s_futs.items()}
        self.receivers = {r: f.result() for r, f in r_futs.items()}

    def push(self) -> int:
        """Every trainer pushes its current weights (without sender staging this returns once the
        rollouts have received them, so call :meth:`update` instead); returns the version."""
        versions = list(self._pool.map(lambda s: s.push(), self.senders.values()))
        return versions[0]

    def update(self, trainer_buffers: Mapping[int, Mapping[str, Any]] | None = None) -> Summary:
        """One full update: trainers push, rollouts apply, all concurrently; returns its summary.

        Args:
            trainer_buffers: new trainer buffers ``{rank: {name: array}}`` to push from now on
                (JAX makes new arrays every step); default: the ones given so far.

        Raises:
            TransferError: any worker failed (the first error is raised).
        """
        given = trainer_buffers or {}
        futs = [self._pool.submit(s.push, buffers=given.get(r))
                for r, s in self.senders.items()]
        futs += [self._pool.submit(self._apply, r) for r in self.receivers.values()]
        versions = {f.result() for f in futs}
        for s in self.senders.values():
            s.wait()
        (v,) = versions
        return summarize(x for x in self.stats() if x.version == v)

    def _apply(self, rx: Receiver) -> int:
        # A staging receiver's rollout generates while bytes land and applies once ready (only
        # the apply is a stall); a receiver without staging blocks for the whole transfer.
        if rx.staging:
            deadline = time.monotonic() + rx.wait_timeout
            while not rx.ready() and time.monotonic() < deadline:
                time.sleep(0.0005)
        return rx.apply()

    def stats(self) -> list[UpdateStats]:
        """Every worker's records so far."""
        out = [x for s in self.senders.values() for x in s.stats]
        return out + [x for r in self.receivers.values() for x in r.stats]

    def summary(self) -> Summary:
        """EWTT and AGST over every update so far."""
        return summarize(self.stats())

    def close(self) -> None:
        list(self._pool.map(lambda w: w.close(),
                            [*self.senders.values(), *self.receivers.values()]))
        self._pool.shutdown()

    def __enter__(self) -> LocalSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
