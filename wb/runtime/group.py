"""A process's workers of one role driven together, over a framework's own parameters.

A process may drive several devices (a JAX process does), each a wb worker with its own rank and
transport: :class:`SenderGroup` runs one :class:`~wb.runtime.sender.Sender` per trainer rank and
:class:`ReceiverGroup` one :class:`~wb.runtime.receiver.Receiver` per rollout rank. Both take the
caller's parameters in the caller's own form, through a :class:`ParamsAdapter`: how parameters
become ``{rank: {name: array}}`` without a copy, how to wait for work a framework has queued on
them, and what the parameters are once a version has landed. ``wb_torch.Sender`` and
``wb_jax.Sender`` (and their Receivers) are these groups with their framework's adapter and
nothing more; here, parameters are ``{rank: {name: array}}`` already.

With one rank every call runs in the caller's thread; with several, the ranks run at once in a
small thread pool (a rank's transfer may wait on another rank of the same process).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from wb.data.plan import Plan
from wb.data.rankplan import RankPlans
from wb.errors import TransferError
from wb.runtime.joining import request_joins
from wb.runtime.receiver import Receiver
from wb.runtime.sender import Sender
from wb.runtime.stats import UpdateStats

__all__ = ["ParamsAdapter", "ArrayParams", "SenderGroup", "ReceiverGroup"]

R = TypeVar("R")


class ParamsAdapter(Protocol):
    """How a framework's parameters meet wb (what a shim supplies)."""

    def buffers(self, params: Any) -> dict[int, dict[str, Any]]:
        """``{rank: {name: array}}`` sharing memory with ``params`` (numpy, DLPack or CUDA
        arrays), for this process's ranks."""

    def settle(self, params: Any) -> None:
        """Blocks until work the framework has queued on ``params`` is done (wb reads them from
        other threads and streams)."""

    def received(self, params: Any, buffers: dict[int, dict[str, Any]]) -> Any:
        """``params`` holding the version that just landed in ``buffers`` (the same object when
        the buffers are its own storage; a new one for immutable arrays)."""

    #: the framework's arrays are immutable: a receiver lands every version in new buffers
    #: (:class:`wb.Receiver`'s ``handoff``), which :meth:`received` wraps. An adapter may then
    #: also have ``allocator(rank)``: the ``allocate(shape, dtype name)`` that makes the rank's
    #: new buffers (on its device), or None for host arrays; and ``recycles(rank)``, True
    #: where :meth:`received` makes its arrays of DLPack exports without copying and frees them
    #: when they die (the receiver then reuses a few sets of buffers: :class:`wb.Receiver`'s
    #: ``recycle``).
    handoff: bool


class ArrayParams:
    """The adapter for parameters that already are ``{rank: {name: array}}`` (``ranks``: unused).

    Args:
        plan: the plan (unused).
        params: ``{rank: {name: array}}``.
        ranks: unused (the ranks are ``params``' keys).
    """

    handoff = False  # the arrays are written in place

    def __init__(self, plan: Plan, params: Any, ranks: Any = None):
        del plan, params, ranks  # nothing to remember

    def buffers(self, params: Mapping[int, Mapping[str, Any]]) -> dict[int, dict[str, Any]]:
        """The arrays themselves, per rank."""
        return {int(r): dict(b) for r, b in params.items()}

    def settle(self, params: Any) -> None:
        """Nothing to wait for: numpy work is done when it returns."""

    def received(self, params: Any, buffers: dict[int, dict[str, Any]]) -> Any:
        """The live buffers per rank."""
        return buffers


class _Ranks:
    """This process's workers of one role, by rank, and the threads that drive them at once."""

    def __init__(self, make: Mapping[int, Callable[[], Any]]):
        if not make:
            raise TransferError("no rank of the plan is in this process's parameters; give the "
                                "ranks of this process's devices")
        self._pool = (ThreadPoolExecutor(max_workers=len(make), thread_name_prefix="wb-group")
                      if len(make) > 1 else None)
        # every worker connects to its peers when made, possibly to this process's other ranks:
        # make them all at once
        self.workers = dict(zip(make, self._each(lambda f: f(), list(make.values()))))

    def _each(self, fn: Callable[[Any], R], items: list) -> list[R]:
        if self._pool is None:
            return [fn(x) for x in items]
        return list(self._pool.map(fn, items))

    def all(self, fn: Callable[[Any], R]) -> list[R]:
        return self._each(fn, list(self.workers.values()))

    def close(self) -> None:
        try:
            self.all(lambda w: w.close())
        finally:
            if self._pool is not None:
                self._pool.shutdown()


def _transports_of(ranks, transports) -> Mapping[int, Any]:
    """``{rank: Transport}`` for ``ranks`` (one transport stands for the one rank there is)."""
    ranks = sorted(ranks)
    if not isinstance(transports, Mapping):
        if len(ranks) != 1:
            raise TransferError(f"one transport was given for ranks {ranks}; every rank needs "
                                f"its own: give transports={{rank: Transport}}")
        transports = {ranks[0]: transports}
    missing = sorted(set(ranks) - set(transports))
    if missing:
        raise TransferError(f"ranks {missing} have no transport (transports has ranks "
                            f"{sorted(transports)}); give one transport per rank")
    return transports


def _workers(plan: Plan, buffers: Mapping[int, Mapping[str, Any]], transports, make
             ) -> _Ranks:
    """One worker per rank of ``buffers``, each given its buffers that the plan names."""
    transports = _transports_of(buffers, transports)
    planned = {r: {n: b[n] for n in plan.layout_of(r).buffers if n in b}
               for r, b in buffers.items()}
    return _Ranks({r: (lambda r=r: make(r, planned[r], transports[r])) for r in planned})


def _no_options(adapter: ParamsAdapter, rank: int) -> dict:
    return {}


def _receiver_options(adapter: ParamsAdapter, rank: int) -> dict:
    """``handoff`` from the adapter, and ``allocate`` where it makes a rank's new buffers itself
    (on that rank's device: JAX on a GPU)."""
    allocate = getattr(adapter, "allocator", lambda r: None)(rank)
    return {"handoff": adapter.handoff,
            "recycle": getattr(adapter, "recycles", lambda r: False)(rank),
            **({"allocate": allocate} if allocate else {})}


def _group_of(worker: type, worker_options: Callable[[ParamsAdapter, int], dict] = _no_options
              ) -> Callable[[type], type]:
    """Gives a group class what both kinds share, over one ``worker`` per rank (:class:`wb.Sender`
    or :class:`wb.Receiver`): the constructor, ``workers`` (``{rank: worker}``), ``version`` (the
    newest version every rank has sent or applied), ``stats`` (every rank's records, for
    :func:`wb.summarize`), ``close()`` and ``with``; ``worker_options(adapter, rank)`` adds options
    of a rank's worker that follow from the adapter. A class decorator rather than a common base:
    the shims subclass the groups, and one level of inheritance is all the house allows."""

    def __init__(self, params: Any, plan: Plan, ranks: Any = None, *, transports=None, store,
                 **options) -> None:
        if "transport" in options:  # the 0.1 name
            warnings.warn("transport= is now transports= (one Transport or {rank: Transport})",
                          DeprecationWarning, stacklevel=2)
            transports = options.pop("transport")
        per_rank = options.pop("_per_rank", {})  # options of one rank's worker (a join's)
        self.plan, self.params = plan, params
        self.adapter: ParamsAdapter = self.adapter_type(plan, params, ranks)
        self._ranks = _workers(plan, self.adapter.buffers(params), transports,
                               lambda r, b, t: worker(plan, r, b, transport=t, store=store,
                                                      **{**worker_options(self.adapter, r),
                                                         **options, **per_rank.get(r, {})}))

    def close(self) -> None:
        """Closes every rank's worker (a sender waits for its last send first)."""
        self._ranks.close()

    def __exit__(self, *exc) -> None:
        self.close()

    def decorate(cls: type) -> type:
        cls.__init__, cls.close, cls.__exit__ = __init__, close, __exit__
        cls.__enter__ = lambda self: self
        cls.workers = property(lambda self: self._ranks.workers,
                               doc=f"``{{rank: wb.{worker.__name__}}}`` of this process.")
        cls.version = property(lambda self: min(w.version for w in self._ranks.workers.values()),
                               doc="The newest version every rank has sent (applied).")
        cls.stats = property(
            lambda self: [s for w in self._ranks.workers.values() for s in w.stats],
            doc="Every rank's records (for :func:`wb.summarize`).")
        return cls
    return decorate


@_group_of(Sender)
class SenderGroup:
    """The trainer's end in one process: ``push()`` after each training step.

    Args:
        params: this process's trainer parameters, in the form :attr:`adapter_type` takes
            (here ``{rank: {name: array}}``); read at each ``push``.
        plan: the plan every worker runs.
        ranks: which ranks ``params`` are (for a shim's adapter; unused here).
        transports: one :class:`wb.Transport` (one rank), or ``{rank: Transport}``.
        store: the rendezvous store every worker shares.
        options: keyword options of :class:`wb.Sender` (``staging=``, ``timeout=``, ...).

    Raises:
        TransferError: a rank without a transport, or what :class:`wb.Sender` refuses at
            set-up (buffers that do not fit the plan, a peer running another plan).
    """

    #: How parameters become buffers (a :class:`ParamsAdapter` made from ``(plan, params,
    #: ranks)``): the one thing ``wb_torch.Sender`` and ``wb_jax.Sender`` change.
    adapter_type: Callable[[Plan, Any, Any], ParamsAdapter] = ArrayParams

    def push(self, params: Any = None) -> int:
        """Sends the parameters as the next version; returns it.

        Args:
            params: new parameters to send from now on (frameworks with immutable arrays make
                new ones every step); default: the ones given so far, as they are now.

        Returns:
            The version number.

        Raises:
            TransferError: this or the previous update failed (a peer died or hung).
        """
        new = params is not None
        self.params = params if new else self.params
        self.adapter.settle(self.params)
        bufs = self.adapter.buffers(self.params) if new else {}
        return self._ranks.all(lambda s: s.push(buffers=bufs.get(s.rank)))[0]

    def wait(self) -> None:
        """Blocks until every rank's last pushed version is sent (see :meth:`wb.Sender.wait`)."""
        self._ranks.all(lambda s: s.wait())


@_group_of(Receiver, _receiver_options)
class ReceiverGroup:
    """The rollout's end in one process: ``ready()`` between generation steps, then ``apply()``.

    Args:
        params: this process's rollout parameters, in the form :attr:`adapter_type` takes
            (here ``{rank: {name: array}}``): the live buffers, written in place (with
            ``handoff=True``: the first version's values).
        plan, ranks, transports, store: as :class:`SenderGroup`.
        options: keyword options of :class:`wb.Receiver` (``staging=``, ``handoff=``, ...).

    Raises:
        TransferError: a rank without a transport, or what :class:`wb.Receiver` refuses at
            set-up.
    """

    #: How parameters become buffers and back (see :attr:`SenderGroup.adapter_type`).
    adapter_type: Callable[[Plan, Any, Any], ParamsAdapter] = ArrayParams

    @classmethod
    def join(cls, params: Any, layouts, ranks: Any = None, *, transports, store,
             name: str = "wb", join_timeout: float = 600.0, **options):
        """A rollout process joining a running job (restarted, or a new replica's): its ranks ask
        to be taken in together (:func:`wb.runtime.joining.request_joins`: the leader admits them
        at one version end, all or none), start their transports while they wait, and the group
        is made from their parts of the plan.

        Args:
            params: this process's rollout parameters, as for the constructor.
            layouts: one :class:`wb.Layout` per rank of this process (from the shim's
                ``layouts`` of its maps: cached, or probed again).
            ranks, transports, store, options: as for the constructor; ``name`` and
                ``join_timeout`` as :meth:`wb.Receiver.join`.

        Raises:
            TransferError: a rank was not admitted within ``join_timeout`` seconds, or a layout
                without a transport.
        """
        lays = {int(lay.worker.rank): lay for lay in layouts}
        transports = _transports_of(lays, transports)

        def connect_all():
            for r in lays:
                transports[r].connect([], hello=b"")
        got = request_joins(store, list(lays.values()), name=name, timeout=join_timeout,
                            meanwhile=connect_all)
        plan = RankPlans([part for part, *_ in got.values()])
        per_rank = {r: {"_joined": tuple(rest), "layout": lays[r]}
                    for r, (_, *rest) in got.items()}
        return cls(params, plan, ranks, transports=transports, store=store, name=name,
                   _per_rank=per_rank, **options)

    def ready(self) -> bool:
        """Whether every rank has the next version ready (never blocks)."""
        return all(w.ready() for w in self.workers.values())

    def apply(self) -> Any:
        """Every rank installs the next version; returns the parameters holding it (see the
        adapter; :attr:`version` says which version).

        Raises:
            TransferError: a rank's update failed (see :meth:`wb.Receiver.apply` for what the
                buffers hold then).
        """
        self._ranks.all(lambda w: w.apply())
        self.params = self.adapter.received(self.params,
                                            {r: w.buffers for r, w in self.workers.items()})
        return self.params

