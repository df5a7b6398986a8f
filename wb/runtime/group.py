"""Several workers of one process driven together: one :class:`~wb.runtime.coordinator.Sender` or
:class:`~wb.runtime.coordinator.Receiver` per rank (a process that drives several devices, as a JAX
process does, is several wb workers, each with its own transport).

Both shims wrap the core through these two classes, the same way: ``wb_torch`` and ``wb_jax`` turn
their framework's tensors into ``{rank: {name: array}}`` and hand them over. With one rank every
call runs in the caller's thread; with several, the ranks run at once in a small thread pool
(each rank's transfer may wait on another rank of the same process).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from wb.data.plan import Plan
from wb.errors import TransferError
from wb.runtime.coordinator import Receiver, Sender, UpdateStats

__all__ = ["SenderGroup", "ReceiverGroup"]

W = TypeVar("W", Sender, Receiver)
R = TypeVar("R")


class _Group:
    """The workers of one role of this process, by rank, and the threads that drive them."""

    def __init__(self, make: Mapping[int, Callable[[], W]]):
        if not make:
            raise TransferError("a group needs at least one rank (got none); give the ranks of "
                                "this process's devices")
        self._pool = (ThreadPoolExecutor(max_workers=len(make), thread_name_prefix="wb-group")
                      if len(make) > 1 else None)
        # every worker connects to its peers when made, possibly to this process's other ranks:
        # make them all at once
        made = self._each(lambda f: f(), list(make.values()))
        self.workers: dict[int, W] = dict(zip(make, made))

    def _each(self, fn: Callable[[Any], R], items: list) -> list[R]:
        if self._pool is None:
            return [fn(x) for x in items]
        return list(self._pool.map(fn, items))

    def _all(self, fn: Callable[[W], R]) -> list[R]:
        return self._each(fn, list(self.workers.values()))

    @property
    def ranks(self) -> list[int]:
        """This process's ranks in the group, in the order given."""
        return list(self.workers)

    @property
    def version(self) -> int:
        """The newest version every rank of the group has sent or applied."""
        return min(w.version for w in self.workers.values())

    @property
    def stats(self) -> list[UpdateStats]:
        """Every rank's :class:`~wb.UpdateStats` so far (for :func:`wb.summarize`)."""
        return [s for w in self.workers.values() for s in w.stats]

    def close(self) -> None:
        """Closes every rank's worker (see their ``close``)."""
        try:
            self._all(lambda w: w.close())
        finally:
            if self._pool is not None:
                self._pool.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SenderGroup(_Group):
    """One :class:`wb.Sender` per trainer rank of this process.

    Args:
        plan: the plan every worker runs.
        buffers: ``{rank: {name: array}}`` of this process's trainer ranks (see :class:`wb.Sender`).
        transports: ``{rank: Transport}``, one per rank (or one Transport when there is one rank).
        store: the rendezvous store every worker shares.
        options: keyword options of :class:`wb.Sender` (``staging=``, ``timeout=``, ...).

    Raises:
        TransferError: a rank without a transport, or anything :class:`wb.Sender` refuses.
    """

    def __init__(self, plan: Plan, buffers: Mapping[int, Mapping[str, Any]], *,
                 transports: Mapping[int, Any] | Any, store, **options):
        transports = _per_rank(buffers, transports)
        super().__init__({r: (lambda r=r: Sender(plan, r, buffers[r], transport=transports[r],
                                                 store=store, **options)) for r in buffers})

    def push(self, buffers: Mapping[int, Mapping[str, Any]] | None = None) -> int:
        """Every rank pushes the next version (``buffers``: new arrays per rank from now on, as
        :meth:`wb.Sender.push` takes them); returns the version.

        Raises:
            TransferError: a rank's previous or current update failed.
        """
        given = buffers or {}
        return self._all(lambda s: s.push(buffers=given.get(s.rank)))[0]

    def wait(self) -> None:
        """Blocks until every rank's last pushed version is sent (see :meth:`wb.Sender.wait`)."""
        self._all(lambda s: s.wait())


class ReceiverGroup(_Group):
    """One :class:`wb.Receiver` per rollout rank of this process.

    Args:
        plan: the plan every worker runs.
        buffers: ``{rank: {name: array}}`` of this process's rollout ranks (see
            :class:`wb.Receiver`; with ``handoff=True`` the first version's values).
        transports: ``{rank: Transport}``, one per rank (or one Transport when there is one rank).
        store: the rendezvous store every worker shares.
        options: keyword options of :class:`wb.Receiver` (``staging=``, ``handoff=``, ...).

    Raises:
        TransferError: a rank without a transport, or anything :class:`wb.Receiver` refuses.
    """

    def __init__(self, plan: Plan, buffers: Mapping[int, Mapping[str, Any]], *,
                 transports: Mapping[int, Any] | Any, store, **options):
        transports = _per_rank(buffers, transports)
        super().__init__({r: (lambda r=r: Receiver(plan, r, buffers[r], transport=transports[r],
                                                   store=store, **options)) for r in buffers})

    def ready(self) -> bool:
        """Whether every rank has the next version ready (see :meth:`wb.Receiver.ready`)."""
        return all(w.ready() for w in self.workers.values())

    def apply(self) -> int:
        """Every rank installs the next version; returns it (see :meth:`wb.Receiver.apply`).

        Raises:
            TransferError: a rank's update failed.
        """
        return self._all(lambda w: w.apply())[0]

    @property
    def buffers(self) -> dict[int, dict[str, Any]]:
        """``{rank: live buffers}`` (with ``handoff``: the newest applied version's)."""
        return {r: w.buffers for r, w in self.workers.items()}


def _per_rank(buffers: Mapping[int, Any], transports: Mapping[int, Any] | Any) -> dict[int, Any]:
    """``{rank: Transport}`` from one transport (one rank) or a mapping with every rank."""
    if not isinstance(transports, Mapping):
        if len(buffers) != 1:
            raise TransferError(f"one transport was given for ranks {sorted(buffers)}; every rank "
                                f"needs its own: give transports={{rank: Transport}}")
        return {next(iter(buffers)): transports}
    missing = sorted(set(buffers) - set(transports))
    if missing:
        raise TransferError(f"ranks {missing} have no transport (transports has ranks "
                            f"{sorted(transports)}); give one transport per rank")
    return dict(transports)
