"""A rank's part of a plan, worked out once: :class:`Program`.

A Sender or Receiver runs the same plan many times, one update per version. Everything about a
rank's part that does not depend on the buffers' contents is worked out here, once, when the
program is made: the rank's messages (:class:`Message`), which of them move zero-copy, when each
should go (:func:`wb.data.plan.schedule`), the forwards each message releases, and the receives
to post into staging or straight into the buffers. :meth:`Program.run` then runs one update
(:func:`wb.runtime.engine.update.run_update`): it only posts and completes.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from wb.data.dtypes import CODES
from wb.data.layout import Layout
from wb.data.plan import RankPlan
from wb.errors import TransferError
from wb.runtime.engine.buffers import check_buffers, fixed_memory
from wb.runtime.engine.casts import prepare, prepare_copies
from wb.runtime.engine.deltas import tables as delta_tables
from wb.runtime.engine.deltas.units import DeltaPlan
from wb.runtime.engine.digests import Routes
from wb.runtime.engine.frames import Frame
from wb.runtime.engine.frames import frames as frames_of
from wb.runtime.engine.movers import Mover, mover_for, new_pool
from wb.runtime.engine.update import DEFAULT_STAGING_BYTES, ExecStats, run_update

#: The staging budget with CUDA buffers unless one is given: within a host a packed send's
#: staging comes back a copy-and-acknowledge round trip (~1 ms) after it goes, and a GPU's
#: links move gigabytes in that time.
DEVICE_STAGING_BYTES = 1 << 30

__all__ = ["Program", "Message", "Span"]


class Message:
    """One message of a rank's program (a plan message this rank sends, receives or copies).

    Attributes:
        m: its index in ``plan.messages`` (its tag is ``tag_base + m`` on every rank).
        stage: 1 (trainer -> rollout), 2 or 3 (a forward between rollouts).
        peer: the other rank (this rank itself for a local copy).
        nbytes: its size in bytes.
        ts: ``(k,) int64`` its transfers, in message order.
        parent: the message that brought its data here (a forward), or -1.
        zc_src: its transfers are one contiguous range of the source buffer (sent zero-copy).
        zc_dst: the same in the destination buffer (received zero-copy).
        out: sent (or copied locally) by this rank.
        local: source and destination are this rank (a local copy).
        wire: the dtype its elements travel in (one per message).
        conv: this rank converts them (from its buffers' dtype when sending, into them when
            receiving): packed and unpacked, never zero-copy.
    """

    # slots: the update loop reads these fields a few times per message
    __slots__ = ("m", "stage", "peer", "nbytes", "ts", "parent", "zc_src", "zc_dst", "out",
                 "local", "wire", "conv", "spans", "table")

    def __init__(self, m: int, stage: int, peer: int, nbytes: int, ts, parent: int,
                 zc_src: bool, zc_dst: bool, out: bool, local: bool, wire: str = "",
                 conv: bool = False):
        self.m, self.stage, self.peer, self.nbytes, self.ts = m, stage, peer, nbytes, ts
        self.parent, self.zc_src, self.zc_dst = parent, zc_src, zc_dst
        self.out, self.local, self.wire, self.conv = out, local, wire, conv
        self.spans: list | None = None  # Program.spans(self), made on first use
        self.table: Any = None  # its spans as a device table (wb.runtime.engine.gather), on first use

    def label(self) -> str:
        return f"message {self.m} (stage {self.stage}, {self.nbytes:,} bytes, peer {self.peer})"


class Span(NamedTuple):
    """Where a stretch of a message lies in one buffer: an (na, nb) region, element (i, j) at
    ``flat[f0 + i * fa + j * fb]`` of slot ``slot`` (on a local copy, ``d*`` in the destination's
    slot; else the same as the source's fields)."""

    slot: int
    f0: int
    na: int
    nb: int
    fa: int
    fb: int
    dslot: int
    d0: int
    da: int
    db: int


def _is_run(fa, fb, na, nb):
    """Per transfer: whether its (na, nb) region is one contiguous run of its buffer."""
    return ((nb == 1) | (fb == 1)) & ((na == 1) | (fa == nb))


def _continues(slot, f0, fa, fb, na, nb):
    """Per transfer (in message order): whether its region is one contiguous run that starts
    where the previous transfer's run ended, in the same buffer (the first: False)."""
    run = _is_run(fa, fb, na, nb)
    out = np.zeros(len(slot), bool)
    out[1:] = (run[1:] & run[:-1] & (slot[1:] == slot[:-1])
               & (f0[1:] == f0[:-1] + na[:-1] * nb[:-1]))
    return out


def _run_contiguous(ts, slot, f0, fa, fb, na, nb) -> bool:
    """Whether the regions of transfers ``ts`` (in message order) are one contiguous range of one
    buffer: then the message is that range of the buffer itself, no packing."""
    return bool(_is_run(fa[0], fb[0], na[0], nb[0])
                and _continues(slot[ts], f0, fa, fb, na, nb)[1:].all())


def _spans(src: tuple, dst: tuple | None, na, nb) -> list[Span]:
    """The regions of a message's transfers in message order, consecutive contiguous runs of one
    buffer merged into one (a message packed from 1,000 block rows of a tensor is then one copy,
    not 1,000). ``src``/``dst``: ``(slot, f0, fa, fb)`` arrays of the transfers; with ``dst``
    (a local copy) a run merges only where both sides continue."""
    cont = _continues(*src, na, nb)
    if dst is not None:
        cont &= _continues(*dst, na, nb)
    starts = np.flatnonzero(~cont).tolist() + [len(na)]
    n = na * nb
    out = []
    for a, b in zip(starts[:-1], starts[1:]):
        s0 = (int(src[0][a]), int(src[1][a]))
        d0 = (int(dst[0][a]), int(dst[1][a])) if dst is not None else s0
        if b - a == 1:  # as it is
            sa, sb = int(src[2][a]), int(src[3][a])
            da, db = ((int(dst[2][a]), int(dst[3][a])) if dst is not None else (sa, sb))
            out.append(Span(*s0, int(na[a]), int(nb[a]), sa, sb, *d0, da, db))
        else:  # one run of all their elements
            k = int(n[a:b].sum())
            out.append(Span(*s0, 1, k, k, 1, *d0, k, 1))
    return out


class _Checked(NamedTuple):
    """The arrays a program last checked, held weakly (their 1-D views strongly, as the view
    cache holds them, until :meth:`Program.release`): the same ones again skip the check."""

    layout: Layout | None  # the probed layout the check compared with (None: none)
    refs: dict[str, tuple[weakref.ref, tuple]]  # name -> (array, (shape, dtype))
    xp: Any  # their array module
    flat: dict[str, Any]  # name -> the 1-D view the check returned (as the view cache holds)


class Program:
    """One rank's part of a plan, worked out once and run by every update.

    A :class:`wb.Sender` / :class:`wb.Receiver` makes its program at set-up and owns it; each
    update is :meth:`run`. Also remembers the last buffers it checked: an update with the same
    numpy/CuPy arrays skips the check.

    Args:
        part: the rank's part of the plan (:class:`wb.RankPlan`).
        stage_receives: every receive lands in staging and is unpacked, none straight into the
            buffers (for buffers that are new memory every update: see :class:`wb.Receiver`).
        frames: small messages that are ready together travel as one
            (:mod:`wb.runtime.engine.frames`); what the transport says
            (:func:`~wb.runtime.engine.frames.framing`): both ends of a pair must agree.
        checksums: every message is hashed at both ends and checked against its sender's
            digest (:mod:`wb.runtime.engine.digests`); what the transport says
            (:func:`~wb.runtime.engine.digests.checksumming`): both ends must agree.

    Attributes:
        part: the rank's part of the plan, as given (its ``transfers`` and ``pieces``, numbered
            within the part, are what an update reads).
        rank: the worker's rank.
        layout: ``rank``'s layout in the plan.
        messages: ``{plan message index: Message}`` of the messages this rank sends, receives or
            copies.
        units: what an update moves: ``{index: Message or Frame}``, the small messages that
            travel together as a :class:`~wb.runtime.engine.frames.Frame` keyed by the first.
        children: ``{message: [forwards]}``: the forwards this rank sends once a message landed.
        when: ``{plan message index: time}`` (:func:`wb.data.plan.schedule`) of this rank's
            messages.
        zero_copy_receives: receives straight into the buffers, in schedule order (units).
        staged_receives: receives into staging (then unpacked), in schedule order (units).
        roots: ``[(when, unit)]`` of the sends that wait for no other message, sorted.
        n_out: how many units this rank sends or copies.
        conversions: the ``(from, to)`` dtype pairs this rank converts between.
        routes: what the rank exchanges with each peer, for checksums
            (:class:`~wb.runtime.engine.digests.Routes`), or ``None`` without them.

    Examples:
        >>> import numpy as np, wb
        >>> sm = wb.SourceMap.from_indices(np.arange(8))
        >>> t = wb.Layout(wb.Worker(0, "n", "trainer"), {"w": wb.BufferSpec(sm, "float32")})
        >>> r = wb.Layout(wb.Worker(1, "n", "rollout"), {"w": wb.BufferSpec(sm, "float32")})
        >>> prog = Program(wb.RankPlan.of(wb.plan([t], [r]), 1))
        >>> len(prog.messages), prog.zero_copy_receives, prog.staged_receives
        (1, [0], [])
    """

    def __init__(self, part: RankPlan, *, stage_receives: bool = False, frames: bool = True,
                 checksums: bool = False):
        # the rank's own transfers and pieces, numbered within the part (what the loop reads)
        self.part, self.layout, self.rank = part, part.layout, part.rank
        M, T, P = part.messages, part.transfers, part.pieces
        self.slot_buf = list(part.slot_buffer)  # slot of the part -> buffer name
        self.slot_rank = part.slot_rank
        self.messages: dict[int, Message] = {}  # plan message index -> this rank's Message
        self.children: dict[int, list[int]] = {}  # message -> the forwards it releases here
        rank = part.rank
        self.when: dict[int, float] = {}  # plan message index -> its schedule time
        self.conversions: set[tuple[str, str]] = set()  # (from, to) dtypes this rank converts
        slot_dt = [self.dtype_of(s) for s in range(len(self.slot_buf))]
        for k, m in enumerate(part.index.tolist()):
            f, c = int(M.first[k]), int(M.count[k])
            ts = np.arange(f, f + c)
            out = int(M.src_rank[k]) == rank
            local = out and int(M.dst_rank[k]) == rank
            na, nb = P.na[T.piece[ts]], P.nb[T.piece[ts]]
            zc_src = _run_contiguous(ts, T.src_slot, T.src_f0[ts], T.src_fa[ts], T.src_fb[ts],
                                     na, nb)
            zc_dst = _run_contiguous(ts, T.dst_slot, T.dst_f0[ts], T.dst_fa[ts], T.dst_fb[ts],
                                     na, nb)
            peer = int(M.dst_rank[k]) if out else int(M.src_rank[k])
            wire = CODES[int(P.dtype[T.piece[f]])] if c else ""
            own = {slot_dt[x] for x in np.unique(T.src_slot[ts] if out else T.dst_slot[ts][:1])}
            conv = own != {wire} or (local and slot_dt[T.dst_slot[f]] != wire)
            if conv:  # the conversions this rank makes (kernels are prepared before updates)
                to = slot_dt[T.dst_slot[f]] if local else wire
                self.conversions |= {(d, to) for d in own} if out else {(wire, d) for d in own}
            zc_src, zc_dst = zc_src and not conv, zc_dst and not conv and not stage_receives
            self.messages[m] = Message(m, int(M.stage[k]), peer, int(M.nbytes[k]), ts,
                                       int(M.parent[k]), zc_src, zc_dst, out, local, wire, conv)
            self.when[m] = float(part.when[k])
            if out and M.parent[k] >= 0:
                self.children.setdefault(int(M.parent[k]), []).append(m)
        when = self.when
        # what an update moves: a message, or a frame of small ones (keyed by its first member)
        self.units: dict[int, Message | Frame] = dict(self.messages)
        for members in (frames_of(self.messages, when) if frames else ()):
            for m in members[1:]:
                del self.units[m]
            self.units[members[0]] = Frame([self.messages[m] for m in members])
        units = self.units
        #: ``{message: [(schedule time, forward)]}``: the units a landed message releases here
        #: (a frame's first member's time), as the update loop queues them
        self.forwards: dict[int, list[tuple[float, int]]] = {}
        for m, g in units.items():
            if g.out and g.parent >= 0:
                self.forwards.setdefault(g.parent, []).append((when[m], m))
        order_in = sorted((m for m, g in units.items() if not g.out),
                          key=lambda m: (when[m], m))  # receives, in schedule order
        self.zero_copy_receives = [m for m in order_in if units[m].zc_dst]
        self.staged_receives = [m for m in order_in if not units[m].zc_dst]
        # (time, unit) of the sends that need no other message first, sorted
        self.roots = sorted((float(when[m]), m) for m, g in units.items()
                            if g.out and g.parent < 0)
        self.n_out = sum(g.out for g in units.values())  # sends and local copies
        #: forwards that carry exactly the bytes their parent brought here: the same pieces,
        #: neither a frame nor converted at either end (a conversion there and back may not keep
        #: a NaN's payload). A checksum's alias; a delta that came goes on as it came.
        self.relays = frozenset(
            m for m, g in units.items()
            if g.out and g.__class__ is not Frame and not g.conv and not g.local
            and (p := units.get(g.parent)) is not None and p.__class__ is not Frame
            and not p.out and not p.conv and np.array_equal(T.piece[g.ts], T.piece[p.ts]))
        #: ``{forward: (frame, byte offset)}``: forwards of exactly the bytes of one member of a
        #: frame that came here (neither converted): a delta that came for the frame goes on
        #: cut to the member's part
        member_at = {x.m: (m, off) for m, f in units.items() if f.__class__ is Frame and not f.out
                     for x, off in zip(f.members, f.offsets) if not x.conv}
        self.sliced = {
            m: member_at[g.parent] for m, g in units.items()
            if g.out and g.__class__ is not Frame and not g.conv and not g.local
            and g.parent in member_at
            and np.array_equal(T.piece[g.ts], T.piece[self.messages[g.parent].ts])}
        self.senders = frozenset(g.peer for g in units.values() if not g.out)  # it receives from
        self.routes = Routes(self) if checksums else None
        self._checked: _Checked | None = None
        self._prepared = False  # the CUDA conversion and copy kernels are loaded
        #: staging no message uses, by size, reused by every update (see
        #: :mod:`wb.runtime.engine.movers`)
        self.staging_pool = new_pool()
        #: views of the buffers by message (:mod:`wb.runtime.engine.movers`), for as long as
        #: updates run on the same buffers: emptied when :meth:`check` is given others
        self.view_cache: dict = {}
        #: device tables of messages packed in one launch, by their units, and the groups they
        #: are packed in (:meth:`~wb.runtime.engine.movers.DeviceMover.batches`)
        self.tables: dict = {}
        #: deltas (:mod:`wb.runtime.engine.deltas.units`): the version this program last completed
        #: with its bases kept (-1: none), the bytes each unit it sends last carried, a copy of
        #: what each unit it converts on receipt last carried, and the buffers that version was
        #: written into (held weakly: a delta applies only to them)
        self.version = -1
        self.bases: dict[int, np.ndarray] = {}
        self.recv_bases: dict[int, np.ndarray] = {}
        self._held: list | None = None

    def first_sent(self) -> list[str]:
        """This rank's buffer names in the order its update first sends from them (schedule
        order): the order a quantiser writes them in."""
        order: dict[str, None] = {}
        T = self.part.transfers
        for _, m in sorted((self.when[m], m) for m, g in self.messages.items() if g.out):
            order.setdefault(self.slot_buf[T.src_slot[self.messages[m].ts[0]]], None)
        return list(order)

    def release(self) -> None:
        """Lets go of the memory kept between updates: staging in the pool and views of the
        buffers (the worker is closing, or runs another program from now on)."""
        self.staging_pool = new_pool()
        self.view_cache, self.tables = {}, {}
        self._checked = None
        self.forget_version()

    def forget_version(self) -> None:
        """Holds no version for deltas from now (its bases are dropped)."""
        self.version, self._held = -1, None
        self.bases, self.recv_bases = {}, {}

    def _same_held(self, buffers) -> bool:
        """Whether ``buffers`` are the very arrays the version held was written into."""
        held = self._held
        return (held is not None and len(held) == len(buffers)
                and all(r() is a for r, a in zip(held, buffers.values())))

    def spans(self, g: Message) -> list[Span]:
        """Message ``g``'s regions in its order, contiguous runs merged (on the side this rank
        packs from or unpacks into; both sides of a local copy), made once and kept."""
        if g.spans is None:
            T, P, ts = self.part.transfers, self.part.pieces, g.ts
            na, nb = P.na[T.piece[ts]], P.nb[T.piece[ts]]
            src = (T.src_slot[ts], T.src_f0[ts], T.src_fa[ts], T.src_fb[ts])
            dst = (T.dst_slot[ts], T.dst_f0[ts], T.dst_fa[ts], T.dst_fb[ts])
            g.spans = _spans(src if g.out else dst, dst if g.local else None, na, nb)
        return g.spans

    def dtype_of(self, slot: int) -> str:
        """The dtype of this rank's buffer ``slot`` (a slot of the part); ``""`` for another
        rank's."""
        if int(self.slot_rank[slot]) != self.rank:
            return ""
        return self.layout.buffers[self.slot_buf[slot]].dtype

    def check(self, buffers: Mapping[str, Any], *,
              layout: Layout | None = None) -> tuple[dict[str, Any], Any]:
        """:func:`wb.runtime.engine.buffers.check_buffers` against this rank's layout; skipped when
        given the very same numpy/CuPy arrays as last time, with the same shapes and dtypes
        (their memory cannot have moved; framework tensors, whose storage can be swapped, are
        checked every time). A check against a probed ``layout`` also stands for later checks
        without one. The arrays are held only weakly by the check; :attr:`view_cache` holds
        views of them (as their Sender or Receiver holds them) until other buffers come.

        Returns:
            ``({name: 1-D view}, array module)``.

        Raises:
            TransferError: as :func:`~wb.runtime.engine.buffers.check_buffers`.
        """
        last = self._checked
        if last is not None and (layout is None or last.layout is layout):
            for n, (ref, shape) in last.refs.items():
                a = buffers.get(n)
                if a is None or ref() is not a or (a.shape, a.dtype) != shape:
                    break
            else:
                return dict(last.flat), last.xp
        flat, xp = check_buffers(self.layout, buffers, layout=layout)
        self.view_cache = {}  # other buffers (or ones that may have moved): no view stands
        given = {n: buffers[n] for n in flat}
        try:
            refs = {n: (weakref.ref(a), (tuple(a.shape), a.dtype)) for n, a in given.items()
                    if fixed_memory(a)}
        except TypeError:  # an array type without weak references: check every time
            refs = {}
        self._checked = (_Checked(layout, refs, xp, dict(flat)) if len(refs) == len(given)
                         else None)
        return flat, xp

    def run(self, buffers: Mapping[str, Any] | None, transport, *, tag_base: int = 0,
            staging_bytes: int | None = None, timeout: float = 60.0,
            trace: list | None = None, layout: Layout | None = None,
            liveness=None, interrupt=None, mover: Mover | None = None,
            ready: Mapping[str, Any] | None = None, delta: DeltaPlan | None = None) -> ExecStats:
        """Runs one update: this rank's sends, receives, local copies and forwards.

        Args:
            buffers: ``{buffer name: array}`` of this worker's layout: numpy or DLPack host
                arrays, or CUDA arrays (packing then runs on the device, with CuPy). Filled in
                place on rollouts.
            transport: this rank's transport, connected to its peers, which were checked to run
                this same plan (:func:`wb.runtime.engine.executor.connect`); left open.
            tag_base: added to every tag (keeps updates of different versions apart).
            staging_bytes: bound on packing/unpacking memory in flight (split receive/send);
                default :data:`~wb.runtime.engine.update.DEFAULT_STAGING_BYTES` (256 MiB) on
                the host, :data:`DEVICE_STAGING_BYTES` (1 GiB) with CUDA buffers.
            timeout: seconds without any progress before raising :class:`wb.TransferError`.
            trace: a list to append one :class:`~wb.runtime.engine.update.TraceEntry` per message of
                this rank to (for finding where an update's time goes).
            layout: this worker's own layout (as it probed it); refused if the plan's differs.
            liveness: a :class:`~wb.runtime.membership.liveness.Watch` over the peers' heartbeats: a peer
                that stops beating fails the update within its grace, not after ``timeout``.
            interrupt: a callable asked while the update is stalled whether to give up (see
                :func:`wb.runtime.engine.update.run_update`); with it, lost peers raise
                :class:`wb.PeersLost` and the transport is kept.
            mover: how bytes move (a :class:`~wb.runtime.engine.movers.Mover`); default: made
                for ``buffers`` (numpy on the host, CUDA kernels for CuPy arrays). With a mover
                of one's own, ``buffers`` are not checked (a benchmark's mover that moves nothing
                takes ``None``).
            ready: ``{buffer name: event}`` of device work still writing a buffer (an FP8
                quantiser's, launched before this update): what is sent straight from it
                leaves once the event has passed; the rest moves meanwhile.
            delta: the update runs in a job that sends deltas
                (:class:`~wb.runtime.engine.deltas.units.DeltaPlan`): bases are kept, units with its
                peers travel as deltas, and once it completes this program holds its version
                (host or device buffers).

        Returns:
            :class:`~wb.runtime.engine.update.ExecStats`.

        Raises:
            TransferError: bad buffers or a plan for other layouts (before any byte moves), a
                failed or stalled transfer (naming the peer and plan step; the transport is
                then aborted).
        """
        kw = dict(tag_base=tag_base, staging_bytes=staging_bytes, timeout=timeout, trace=trace,
                  liveness=liveness, interrupt=interrupt)
        if mover is not None:
            kw["staging_bytes"] = DEFAULT_STAGING_BYTES if staging_bytes is None else staging_bytes
            return run_update(self, mover, transport, **kw)
        flat, xp = self.check(buffers, layout=layout)
        if staging_bytes is None:
            kw["staging_bytes"] = DEFAULT_STAGING_BYTES if xp is np else DEVICE_STAGING_BYTES
        if xp is not np and flat and not self._prepared:
            with next(iter(flat.values())).device:  # compiled once, before the first update
                prepare(xp, self.conversions)
                prepare_copies(xp, {a.dtype for a in flat.values()})
            self._prepared = True
        if delta is not None:
            return self._run_delta(delta, buffers, flat, xp, transport, ready, kw)
        if xp is not np and flat:
            # CuPy's current device is per thread: staging and kernels must go to the buffers'
            # own device, whichever thread runs this (a Sender's or Receiver's background thread
            # starts on device 0)
            with next(iter(flat.values())).device:
                return run_update(self, mover_for(self, flat, xp, ready), transport, **kw)
        return run_update(self, mover_for(self, flat, xp, ready), transport, **kw)

    def _run_delta(self, delta: DeltaPlan, buffers, flat, xp, transport, ready, kw) -> ExecStats:
        """:meth:`run` in a job that sends deltas: see ``delta`` there."""
        if not delta.frm.isdisjoint(self.senders) and not self._same_held(buffers):
            was = self.version
            self.forget_version()
            raise TransferError(f"rank {self.rank}: deltas came for buffers other than those "
                                f"version {was} was written into")
        self.version = -1  # a failure leaves part of the version (and of the bases) written
        if xp is not np and flat:
            with next(iter(flat.values())).device:  # see run: the buffers' own device
                delta_tables.prepare(xp)  # (compiled once, before the first delta)
                stats = run_update(self, mover_for(self, flat, xp, ready), transport,
                                   delta=delta, **kw)
        else:
            stats = run_update(self, mover_for(self, flat, xp, ready), transport, delta=delta,
                               **kw)
        try:
            self._held = [weakref.ref(a) for a in buffers.values()]
        except TypeError:  # arrays without weak references: what they hold cannot be vouched for
            self._held = None
            return stats
        self.version = delta.version
        return stats

