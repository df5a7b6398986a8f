"""A process's workers of one role driven together, over a framework's own parameters.

A process may drive several devices (a JAX process does), each a wb worker with its own rank and
transport: :class:`SenderGroup` runs one :class:`~wb.runtime.endpoints.sender.Sender` per trainer rank and
:class:`ReceiverGroup` one :class:`~wb.runtime.endpoints.receiver.Receiver` per rollout rank. Both take the
caller's parameters in the caller's own form, through a :class:`ParamsAdapter`: how parameters
become ``{rank: {name: array}}`` without a copy, how to wait for work a framework has queued on
them, and what the parameters are once a version has landed. ``wb_torch.Sender`` and
``wb_jax.Sender`` (and their Receivers) are these groups with their framework's adapter and
nothing more; here, parameters are ``{rank: {name: array}}`` already.

With one rank every call runs in the caller's thread; with several, the ranks run at once in a
small thread pool (a rank's transfer may wait on another rank of the same process).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from wb.data.layout import Layout
from wb.data.plan import Plan, RankPlan, part_of
from wb.errors import TransferError
from wb.runtime.transport.keyed import keyed
from wb.runtime.endpoints.receiver import Receiver
from wb.runtime.endpoints.sender import Sender
from wb.runtime.endpoints.stats import UpdateStats
from wb.runtime.membership.joining import request_joins

__all__ = ["ParamsAdapter", "ArrayParams", "SenderGroup", "ReceiverGroup"]

R = TypeVar("R")


class ParamsAdapter(Protocol):
    """How a framework's parameters meet wb (what a shim supplies): a group makes one with
    ``adapter_type(layouts, params, ranks)``, where ``layouts`` are ``{rank: wb.Layout}`` of the
    plan's workers this process may drive (the buffers each rank's part names), ``params`` the
    parameters in the framework's form and ``ranks`` what the shim's caller said the ranks are.
    """

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
    """The adapter for parameters that already are ``{rank: {name: array}}``.

    Args:
        layouts: ``{rank: Layout}`` of the plan's workers (unused: the arrays are given by name).
        params: ``{rank: {name: array}}``.
        ranks: unused (the ranks are ``params``' keys).
    """

    handoff = False  # the arrays are written in place

    def __init__(self, layouts: Mapping[int, Layout], params: Any, ranks: Any = None):
        del layouts, params, ranks  # nothing to remember

    def buffers(self, params: Mapping[int, Mapping[str, Any]]) -> dict[int, dict[str, Any]]:
        """The arrays themselves, per rank."""
        return {int(r): dict(b) for r, b in params.items()}

    def settle(self, params: Any) -> None:
        """Nothing to wait for: numpy work is done when it returns."""

    def received(self, params: Any, buffers: dict[int, dict[str, Any]]) -> Any:
        """The live buffers per rank."""
        return buffers


Plans = Plan | RankPlan | Mapping[int, RankPlan]  # what a group is given: see SenderGroup's plan


def _layouts_of(plan: Plans) -> dict[int, Layout]:
    """``{rank: Layout}`` of the workers ``plan`` describes: every worker of a whole plan, the
    rank of a part, the ranks of a process's parts."""
    if isinstance(plan, Plan):
        return {lay.worker.rank: lay for lay in (*plan.trainers, *plan.rollouts)}
    if isinstance(plan, RankPlan):
        return {plan.rank: plan.layout}
    return {int(r): q.layout for r, q in plan.items()}


def _refuse_unknown(plan: Plans, rank: int) -> None:
    """Raises the plan's own error for a rank it has no part for (naming the ranks it has)."""
    if isinstance(plan, Plan):
        plan.layout_of(rank)
    part_of(plan, rank)


class _Ranks:
    """This process's workers of one role, by rank, and the threads that drive them at once:
    what both groups hold (they differ in what a call does, not in how ranks are driven).

    Args:
        plan: what the group was given (see :class:`SenderGroup`).
        layouts: ``{rank: Layout}`` of ``plan`` (:func:`_layouts_of`).
        buffers: ``{rank: {name: array}}`` from the adapter, for this process's ranks.
        transports: one transport (one rank) or ``{rank: Transport}``.
        make: ``make(rank, buffers, transport)``, the rank's worker.

    Raises:
        TransferError: no rank in ``buffers``, or a rank without a transport.
        PlanError: a rank of ``buffers`` has no part in ``plan``.
    """

    def __init__(self, plan: Plans, layouts: Mapping[int, Layout],
                 buffers: Mapping[int, Mapping[str, Any]], transports,
                 make: Callable[[int, dict, Any], Any]):
        if not buffers:
            raise TransferError("no rank of the plan is in this process's parameters; give the "
                                "ranks of this process's devices")
        transports = _transports_of(buffers, transports)
        for r in sorted(set(buffers) - set(layouts)):
            _refuse_unknown(plan, r)
        planned = {r: {n: b[n] for n in layouts[r].buffers if n in b} for r, b in buffers.items()}
        self._pool = (ThreadPoolExecutor(max_workers=len(planned), thread_name_prefix="wb-group")
                      if len(planned) > 1 else None)
        # every worker connects to its peers when made, possibly to this process's other ranks:
        # make them all at once
        self.workers = dict(zip(planned, self._each(
            lambda r: make(r, planned[r], transports[r]), list(planned))))

    def _each(self, fn: Callable[[Any], R], items: list) -> list[R]:
        if self._pool is None:
            return [fn(x) for x in items]
        return list(self._pool.map(fn, items))

    def all(self, fn: Callable[[Any], R]) -> list[R]:
        """``fn(worker)`` for every rank's worker, at once; the results in rank order."""
        return self._each(fn, list(self.workers.values()))

    @property
    def version(self) -> int:
        """The newest version every rank has sent (applied)."""
        return min(w.version for w in self.workers.values())

    @property
    def stats(self) -> list[UpdateStats]:
        """Every rank's records."""
        return [s for w in self.workers.values() for s in w.stats]

    def close(self) -> None:
        """Closes every rank's worker, then the threads."""
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


def _receiver_options(adapter: ParamsAdapter, rank: int) -> dict:
    """``handoff`` from the adapter, and ``allocate`` where it makes a rank's new buffers itself
    (on that rank's device: JAX on a GPU)."""
    allocate = getattr(adapter, "allocator", lambda r: None)(rank)
    return {"handoff": adapter.handoff,
            "recycle": getattr(adapter, "recycles", lambda r: False)(rank),
            **({"allocate": allocate} if allocate else {})}


class SenderGroup:
    """The trainer's end in one process: ``push()`` after each training step; one
    :class:`wb.Sender` per trainer rank of ``params``.

    Args:
        params: this process's trainer parameters, in the form :attr:`adapter_type` takes
            (here ``{rank: {name: array}}``); read at each ``push``.
        plan: the parts :func:`wb.agree_parts` gave this process (``{rank: RankPlan}``), one
            :class:`wb.RankPlan`, or the whole :class:`wb.Plan`.
        ranks: which ranks ``params`` are (for a shim's adapter; unused here).
        transports: one :class:`wb.Transport` (one rank), or ``{rank: Transport}``.
        store: the rendezvous store every worker shares.
        options: keyword options of :class:`wb.Sender` (``staging=``, ``timeout=``, ...).

    Raises:
        TransferError: a rank without a transport, or what :class:`wb.Sender` refuses at set-up
            (buffers that do not fit the plan, a peer running another plan).
        PlanError: a rank of ``params`` without a part in ``plan``.

    Attributes:
        workers: ``{rank: wb.Sender}`` of this process.
        plan: as given.
        params: the parameters pushed last.
        adapter: the :class:`ParamsAdapter` made of ``params``.
    """

    #: How parameters become buffers (a :class:`ParamsAdapter` made from ``(layouts, params,
    #: ranks)``): the one thing ``wb_torch.Sender`` and ``wb_jax.Sender`` change.
    adapter_type: Callable[[Mapping[int, Layout], Any, Any], ParamsAdapter] = ArrayParams

    def __init__(self, params: Any, plan: Plans, ranks: Any = None, *, transports, store,
                 **options):
        layouts = _layouts_of(plan)
        self.plan, self.params = plan, params
        self.adapter: ParamsAdapter = self.adapter_type(layouts, params, ranks)
        self._ranks = _Ranks(plan, layouts, self.adapter.buffers(params), transports,
                             lambda r, b, t: Sender(plan, r, b, transport=t, store=store,
                                                    **options))

    @property
    def workers(self) -> dict[int, Sender]:
        """``{rank: wb.Sender}`` of this process."""
        return self._ranks.workers

    @property
    def version(self) -> int:
        """The newest version every rank has sent."""
        return self._ranks.version

    @property
    def stats(self) -> list[UpdateStats]:
        """Every rank's records (for :func:`wb.summarize`)."""
        return self._ranks.stats

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

    def claim(self, spec, **kw) -> int:
        """Every rank claims the version pushed last, for the rollouts' weight checks (see
        :meth:`wb.Sender.claim`: ``weights``, ``per_tensor``, ``version``); returns how many
        elements they published."""
        return sum(self._ranks.all(lambda s: s.claim(spec, **kw)))

    def serve_checks(self, spec, **kw) -> None:
        """Every rank answers weight checks asked from outside (see
        :meth:`wb.Sender.serve_checks`: ``per_tensor``)."""
        self._ranks.all(lambda s: s.serve_checks(spec, **kw))

    def wait(self) -> None:
        """Blocks until every rank's last pushed version is sent (see :meth:`wb.Sender.wait`)."""
        self._ranks.all(lambda s: s.wait())

    def close(self) -> None:
        """Closes every rank's Sender (each waits for its last send first)."""
        self._ranks.close()

    def __enter__(self) -> SenderGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ReceiverGroup:
    """The rollout's end in one process: ``ready()`` between generation steps, then ``apply()``;
    one :class:`wb.Receiver` per rollout rank of ``params``.

    Args:
        params: this process's rollout parameters, in the form :attr:`adapter_type` takes
            (here ``{rank: {name: array}}``): the live buffers, written in place (with
            ``handoff=True``: the first version's values).
        plan, ranks, transports, store: as :class:`SenderGroup`.
        options: keyword options of :class:`wb.Receiver` (``staging=``, ``handoff=``, ...).

    Raises:
        TransferError: a rank without a transport, or what :class:`wb.Receiver` refuses at
            set-up.
        PlanError: a rank of ``params`` without a part in ``plan``.

    Attributes:
        workers: ``{rank: wb.Receiver}`` of this process.
        plan: as given.
        params: the parameters holding the newest applied version.
        adapter: the :class:`ParamsAdapter` made of ``params``.
    """

    #: How parameters become buffers and back (see :attr:`SenderGroup.adapter_type`).
    adapter_type: Callable[[Mapping[int, Layout], Any, Any], ParamsAdapter] = ArrayParams

    def __init__(self, params: Any, plan: Plans, ranks: Any = None, *, transports, store,
                 **options):
        self._start(params, plan, ranks, transports, lambda r, b, t, adapter: Receiver(
            plan, r, b, transport=t, store=store, **{**_receiver_options(adapter, r), **options}))

    def _start(self, params: Any, plan: Plans, ranks: Any, transports,
               make: Callable[[int, dict, Any, ParamsAdapter], Receiver]) -> None:
        """The constructor's work, with ``make(rank, buffers, transport, adapter)`` making each
        rank's Receiver (:meth:`join` makes admitted ones, without calling ``__init__``: a
        subclass sets itself up here, not in ``__init__``)."""
        layouts = _layouts_of(plan)
        self.plan, self.params = plan, params
        self.adapter: ParamsAdapter = self.adapter_type(layouts, params, ranks)
        self._ranks = _Ranks(plan, layouts, self.adapter.buffers(params), transports,
                             lambda r, b, t: make(r, b, t, self.adapter))

    @classmethod
    def join(cls, params: Any, layouts, ranks: Any = None, *, transports, store,
             name: str = "wb", join_timeout: float = 600.0, **options) -> ReceiverGroup:
        """A rollout process joining a running job (restarted, or a new replica's): its ranks ask
        to be taken in together (:func:`wb.runtime.membership.joining.request_joins`: the leader
        admits them at one version end, all or none), start their transports while they wait,
        and the group is made from their parts of the plan.

        Args:
            params: this process's rollout parameters, as for the constructor.
            layouts: one :class:`wb.Layout` per rank of this process (from the shim's
                ``layouts`` of its maps: cached, or probed again).
            ranks, transports, store: as for the constructor.
            name: the running job's session name.
            join_timeout: seconds to wait for the admission.
            options: keyword options of each rank's :meth:`wb.Receiver.admitted`.

        Returns:
            The group, admitted: its first :meth:`apply` installs the next version.

        Raises:
            TransferError: a rank was not admitted within ``join_timeout`` seconds, or a layout
                without a transport.
        """
        lays = {int(lay.worker.rank): lay for lay in layouts}
        transports = _transports_of(lays, transports)

        def connect_all():
            for r in lays:
                transports[r].connect([], hello=b"")
        store = keyed(store, transport=next(iter(transports.values()), None))
        got = request_joins(store, list(lays.values()), name=name, timeout=join_timeout,
                            meanwhile=connect_all)
        parts = {r: admission.part for r, admission in got.items()}
        options.pop("layout", None)  # each rank's own, from ``layouts``
        group = cls.__new__(cls)
        group._start(params, parts, ranks, transports, lambda r, b, t, adapter: Receiver.admitted(
            got[r], b, transport=t, store=store, name=name, layout=lays[r],
            **{**_receiver_options(adapter, r), **options}))
        return group

    @property
    def workers(self) -> dict[int, Receiver]:
        """``{rank: wb.Receiver}`` of this process."""
        return self._ranks.workers

    @property
    def version(self) -> int:
        """The newest version every rank has applied."""
        return self._ranks.version

    @property
    def stats(self) -> list[UpdateStats]:
        """Every rank's records (for :func:`wb.summarize`)."""
        return self._ranks.stats

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

    def check(self, spec, **kw) -> dict:
        """Every rank checks its live buffers against the trainers' claim of its version (see
        :meth:`wb.Receiver.check`: ``maps``, ``per_tensor``, ``timeout``; ``maps`` here by rank,
        ``{rank: {buffer: SourceMap}}``); returns ``{rank: CheckReport}``."""
        maps = kw.pop("maps", None) or {}
        return dict(zip(self.workers, self._ranks.all(
            lambda w: w.check(spec, maps=maps.get(w.rank), **kw))))

    def serve_checks(self, spec, **kw) -> None:
        """Every rank answers weight checks asked from outside (see
        :meth:`wb.Receiver.serve_checks`: ``per_tensor``; ``maps`` here by rank)."""
        maps = kw.pop("maps", None) or {}
        self._ranks.all(lambda w: w.serve_checks(spec, maps=maps.get(w.rank), **kw))

    def close(self) -> None:
        """Closes every rank's Receiver."""
        self._ranks.close()

    def __enter__(self) -> ReceiverGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
