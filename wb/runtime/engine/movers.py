"""How an update touches bytes: a *mover* packs, unpacks and copies a rank's messages, gives the
transport the byte ranges of zero-copy ones, and hands out staging.

The update loop (:mod:`wb.runtime.engine.update`) decides *when* each message moves; the mover
decides *how* its bytes do. :class:`HostMover` works on numpy arrays; :class:`DeviceMover` on
CuPy arrays, with one kernel launch per message where no conversion is needed
(:mod:`wb.runtime.engine.gather`) and an event per piece of device work (the loop acts on it
once it has passed, never blocking on a stream). Both reuse staging: a message's staging goes
back to a pool of its size when the message is done, so an update touches fresh memory only for
what it holds in flight at once (a fresh host buffer costs a page fault per 4 KiB on its first
write; UCX maps device memory it has not seen before).

A mover is anything with these methods (:class:`Mover`); a benchmark passes one that moves
nothing to time the loop alone.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Protocol

import numpy as np

from wb.data.dtypes import dtype_info
from wb.runtime.engine import gather
from wb.runtime.engine.casts import assign, xp_dtype
from wb.runtime.engine.frames import Frame
from wb.runtime.engine.inflight import DeviceBytes, fencer, region

__all__ = ["Mover", "HostMover", "DeviceMover", "mover_for", "new_pool"]


class Mover(Protocol):
    """The byte work of one rank's messages (``g``: a :class:`~wb.runtime.engine.program.
    Message` of the program the mover was made for)."""

    def source(self, g) -> Any:
        """A zero-copy message's bytes in its source buffer (what the transport sends)."""

    def target(self, g) -> Any:
        """A zero-copy message's bytes in its destination buffer (where it is received)."""

    def staging(self, nbytes: int) -> Any:
        """``nbytes`` of staging for a message to be received into."""

    def release(self, buf: Any) -> None:
        """Staging from :meth:`staging` or :meth:`pack` that is no longer in use."""

    def pack(self, g) -> Any:
        """New staging holding ``g``'s source regions in order, in its travelling dtype."""

    def unpack(self, g, buf: Any) -> None:
        """``g``'s staging ``buf`` into its destination regions, in their dtype."""

    def unpack_all(self, items: list) -> list:
        """:meth:`unpack` of each ``(g, buf)``; returns ``(event, g, buf)`` for each (the
        event as :meth:`fence` gives, once its unpacking is queued)."""

    def copy_local(self, g) -> None:
        """A local copy's source regions into its destination regions."""

    def fence(self) -> Any:
        """An event for the work queued so far (``.done`` once it has passed), or ``None`` when
        the work is done already."""

    def wait(self, g) -> Any:
        """The device work a zero-copy message's source must wait for before it may leave (an
        event, as :meth:`fence` gives: a quantiser writing its buffer), or ``None``."""

    def direct(self, g, stage_send) -> bool:
        """Whether a zero-copy message leaves from its buffer itself (asked only over a
        transport with ``stage_send``; else it is packed like any other)."""


class HostMover:
    """A :class:`Mover` over numpy arrays: copies are done when they return.

    Args:
        prog: the :class:`~wb.runtime.engine.program.Program` whose messages move.
        flat: ``{buffer name: 1-D array}`` of this rank's buffers (checked).
        xp: the array module (numpy here; CuPy for :class:`DeviceMover`).
        ready: ``{buffer name: event}``: device work still writing a buffer (an FP8
            quantiser's), which a message sent straight from it waits for (:meth:`wait`).
    """

    def __init__(self, prog, flat: dict[str, Any], xp=np, ready: dict | None = None):
        self.prog, self.flat, self.xp = prog, flat, xp
        self.ready = ready or {}
        self.T = prog.part.transfers
        self.pool = prog.staging_pool  # {nbytes: [free staging]}, kept across updates
        # views of the buffers by message, kept while the program runs on the same buffers
        self.cache = prog.view_cache
        self.fence = fencer(xp)
        self.ptrs = None  # this rank's buffer addresses by slot (:meth:`_ptrs`), on first use

    def _range(self, g, *, src: bool):
        """The buffer and first element of a zero-copy message's range."""
        t, T = g.ts[0], self.T
        slot, f0 = (T.src_slot[t], T.src_f0[t]) if src else (T.dst_slot[t], T.dst_f0[t])
        return self.flat[self.prog.slot_buf[slot]], int(f0)

    def wait(self, g):
        if not self.ready:
            return None
        ev = self.ready.get(self.prog.slot_buf[self.T.src_slot[g.ts[0]]])
        return None if ev is None or ev.done else ev

    def _slice(self, g, *, src: bool):
        """A zero-copy message's range of its buffer, as an array of bytes."""
        a, f0 = self._range(g, src=src)
        return a[f0:f0 + g.nbytes // a.itemsize].view(self.xp.uint8)

    def _bytes(self, g, *, src: bool):
        """A zero-copy message's range as the transport takes it."""
        return self._slice(g, src=src)

    def source(self, g):
        v = self.cache.get((g.m, 0))
        if v is None:
            v = self.cache[(g.m, 0)] = self._bytes(g, src=True)
        return v

    def direct(self, g, stage_send) -> bool:
        """Whether zero-copy message ``g`` leaves from its buffer itself rather than packed into
        staging: ``stage_send(peer, view)`` is the transport's say (its path from that memory is
        slow); its answer is kept while the buffers stay the same, except ``None`` (it cannot
        tell yet: the message leaves from the buffer and the transport is asked again next
        time)."""
        v = self.cache.get((g.m, 3))
        if v is None:
            stage = stage_send(g.peer, self.source(g))
            if stage is None:
                return True
            v = self.cache[(g.m, 3)] = not stage
        return v

    def target(self, g):
        v = self.cache.get((g.m, 1))
        if v is None:
            v = self.cache[(g.m, 1)] = self._bytes(g, src=False)
        return v

    def array(self, g, *, src: bool):
        """A zero-copy message's range of its buffer as an array of bytes (on the host what
        :meth:`source` and :meth:`target` give), kept while the buffers stay the same."""
        v = self.cache.get((g.m, 4 if src else 5))
        if v is None:
            v = self.cache[(g.m, 4 if src else 5)] = self._slice(g, src=src)
        return v

    def regions(self, g) -> list:
        """Message ``g``'s regions of this rank's buffers, in message order (for a local copy,
        ``(source, destination)`` pairs), made once while the buffers stay the same."""
        v = self.cache.get((g.m, 2))
        if v is None:
            if g.local:
                v = [(self.view(*sp[:6]), self.view(sp.dslot, sp.d0, sp.na, sp.nb, sp.da, sp.db))
                     for sp in self.prog.spans(g)]
            else:
                v = [self.view(*sp[:6]) for sp in self.prog.spans(g)]
            self.cache[(g.m, 2)] = v
        return v

    def staging(self, nbytes: int):
        free = self.pool.get(nbytes)
        return free.pop() if free else self.xp.empty(nbytes, dtype=self.xp.uint8)

    def release(self, buf) -> None:
        self.pool[buf.nbytes].append(buf)

    def view(self, slot, f0, na, nb, fa, fb):
        """The (na, nb) region of this rank's buffer ``slot`` (see
        :class:`~wb.runtime.engine.program.Span`)."""
        return region(self.xp, self.flat[self.prog.slot_buf[slot]], f0, na, nb, fa, fb)

    def pack(self, g):
        buf = self.staging(g.nbytes)
        if g.__class__ is Frame:
            for member, at in zip(g.members, g.offsets):
                self.pack_into(member, buf[at:at + member.nbytes])
        else:
            self.pack_into(g, buf)
        return buf

    def pack_many(self, gs) -> list:
        """:meth:`pack` of each of ``gs`` (messages or frames that :meth:`batches` let go
        together)."""
        return [self.pack(g) for g in gs]

    def batches(self, g) -> Any:
        """What a message must share with those it is packed with in one :meth:`pack_many`
        (``None``: it is packed alone)."""
        return None

    def pack_into(self, g, buf) -> None:
        """Message ``g``'s source regions into ``buf`` (its bytes), in its travelling dtype."""
        if g.zc_src:  # one range of a buffer
            self.xp.copyto(buf, self._slice(g, src=True))
            return
        o, xp, dtype_of = 0, self.xp, self.prog.dtype_of
        wire = xp_dtype(xp, g.wire) if g.conv else None
        for sp, v in zip(self.prog.spans(g), self.regions(g)):
            w = wire or v.dtype
            n = v.size * w.itemsize
            assign(xp, buf[o:o + n].view(w).reshape(v.shape), v, g.wire,
                   dtype_of(sp.slot) if g.conv else g.wire)
            o += n

    def unpack(self, g, buf) -> None:
        if g.__class__ is Frame:
            for member, at in zip(g.members, g.offsets):
                self.unpack_from(member, buf[at:at + member.nbytes])
        else:
            self.unpack_from(g, buf)

    def unpack_all(self, items: list) -> list:
        out = []
        for g, buf in items:
            self.unpack(g, buf)
            out.append((self.fence(), g, buf))
        return out

    def unpack_from(self, g, buf) -> None:
        """Message ``g``'s bytes ``buf`` into its destination regions, in their dtype."""
        if g.zc_dst:  # one range of a buffer
            self.xp.copyto(self._slice(g, src=False), buf)
            return
        o, xp = 0, self.xp
        mine = self.prog.dtype_of(self.T.dst_slot[g.ts[0]]) if g.conv else g.wire
        wire = xp_dtype(xp, g.wire) if g.conv else None
        for v in self.regions(g):
            w = wire or v.dtype
            n = v.size * w.itemsize
            assign(xp, v, buf[o:o + n].view(w).reshape(v.shape), mine, g.wire)
            o += n

    def gather(self, g):
        """New staging holding ``g``'s destination regions in order, as a receive wrote them
        (the base a delta applies to: :mod:`wb.runtime.engine.deltas.units`); not for a unit this
        rank converts."""
        buf = self.staging(g.nbytes)
        for member, at in (zip(g.members, g.offsets) if g.__class__ is Frame else ((g, 0),)):
            if member.zc_dst:
                self.xp.copyto(buf[at:at + member.nbytes], self._slice(member, src=False))
                continue
            for v in self.regions(member):
                n = v.size * v.itemsize
                buf[at:at + n].view(v.dtype).reshape(v.shape)[...] = v
                at += n
        return buf

    def spread(self, g):
        """Received unit ``g``'s destination regions as a delta's target that a kernel writes
        element by element (:class:`~wb.runtime.engine.gather.Regions`: the regions'
        table, made once, and this rank's buffer addresses by slot); not for a unit this rank
        converts."""
        return gather.Regions(self._table(g), self._ptrs(), g.nbytes,
                              dtype_info(g.wire).itemsize if g.wire else 1)

    def scatter(self, g, pos, values) -> bool:
        """Received unit ``g``'s message elements at ``pos`` (ascending) set to ``values``
        (unsigned integers of the unit's element width), where they lie in its destination
        regions (a delta applied in place, on the host); ``pos`` None: every element. Returns
        False, writing nothing, where it cannot: a unit this rank converts, or values of
        another width than its elements'."""
        width = dtype_info(g.wire).itemsize if g.wire else 1
        if g.conv or values.dtype.itemsize != width:
            return False
        if pos is None:
            self.unpack(g, values.view(np.uint8))
            return True
        spans, starts = self._starts(g)
        cuts = np.searchsorted(pos, starts).tolist()
        for sp, at, i0, i1 in zip(spans, starts.tolist(), cuts, cuts[1:]):
            if i1 > i0:
                q = pos[i0:i1] - at
                idx = sp.f0 + q // sp.nb * sp.fa + q % sp.nb * sp.fb
                self.flat[self.prog.slot_buf[sp.slot]].view(values.dtype)[idx] = values[i0:i1]
        return True

    def _starts(self, g) -> tuple[list, np.ndarray]:
        """Unit ``g``'s spans and where each starts in its message (elements; the end last),
        worked out once per program."""
        kept = self.prog.tables.setdefault("starts", {})
        got = kept.get(g.m)
        if got is None:
            spans = self._spans(g)
            got = kept[g.m] = (spans, np.cumsum([0] + [sp.na * sp.nb for sp in spans]))
        return got

    def _table(self, g):
        """Unit ``g``'s regions as a table of the buffers' module (:func:`~wb.runtime.engine.
        gather.table`: its source's for a send, its destination's for a receive), made once."""
        if g.table is None:
            g.table = self.xp.asarray(gather.table(self._spans(g)))
        return g.table

    def _spans(self, g) -> list:
        """A message's spans, or a frame's members' one after another."""
        prog = self.prog
        return ([sp for member in g.members for sp in prog.spans(member)]
                if g.__class__ is Frame else prog.spans(g))

    def _ptrs(self):
        """This rank's buffer addresses by slot, as an array of the buffers' module (another
        rank's slots: 0), made once per mover."""
        if self.ptrs is None:
            prog = self.prog
            ptrs = [_address(self.flat[b]) if int(r) == prog.rank else 0
                    for b, r in zip(prog.slot_buf, prog.slot_rank)]
            self.ptrs = self.xp.asarray(np.array(ptrs, np.uint64))
        return self.ptrs

    def copy_local(self, g) -> None:
        dtype_of = self.prog.dtype_of
        for sp, (src, dst) in zip(self.prog.spans(g), self.regions(g)):
            assign(self.xp, dst, src, dtype_of(sp.dslot) if g.conv else "",
                   dtype_of(sp.slot) if g.conv else "")


class DeviceMover(HostMover):
    """A :class:`Mover` over CuPy arrays: a message without conversion is packed or unpacked in
    one kernel launch (:func:`wb.runtime.engine.gather.copy`); zero-copy ranges go to the
    transport as CUDA array interfaces (:class:`~wb.runtime.engine.inflight.DeviceBytes`: no
    CuPy slice per message)."""

    def __init__(self, prog, flat: dict[str, Any], xp, ready: dict | None = None):
        super().__init__(prog, flat, xp, ready)
        self.writers: dict[int, list] = {}  # by message: the ready events of what it reads

    def _after_writers(self, g) -> None:
        """Makes the current stream wait for the device work still writing a buffer that ``g``
        (a message or a frame) reads: the quantiser runs on streams of its own."""
        evs = self.writers.get(g.m)
        if evs is None:
            T, slot_buf = self.T, self.prog.slot_buf
            names = {slot_buf[s] for member in (g.members if g.__class__ is Frame else (g,))
                     for s in T.src_slot[member.ts]}
            evs = self.writers[g.m] = [self.ready[n] for n in names if n in self.ready]
        stream = self.xp.cuda.get_current_stream()
        for ev in evs:
            if not ev.done:
                stream.wait_event(ev)

    def _bytes(self, g, *, src: bool):
        a, f0 = self._range(g, src=src)
        return DeviceBytes(a, f0 * a.itemsize, g.nbytes)

    def pack(self, g):
        if self.ready:
            self._after_writers(g)
        if g.conv:
            return super().pack(g)
        buf = self.staging(g.nbytes)
        self._fused(g, buf, scatter=False)
        return buf

    def batches(self, g) -> Any:
        """A message's element width (one kernel each) and its group: this rank's sends in
        schedule order, :data:`~wb.runtime.engine.gather.STAGES` a group. Runs stay within a
        group, so the tables of the runs an update may make (:meth:`pack_many`, kept on the
        program) are a bounded few whatever the budget or the timing cut them into."""
        if g.conv:
            return None
        groups = self.prog.tables.get("groups")
        if groups is None:
            prog = self.prog
            outs = sorted((prog.when[m], m) for m, u in prog.units.items() if u.out)
            groups = prog.tables["groups"] = {m: i // gather.STAGES
                                              for i, (_, m) in enumerate(outs)}
        return dtype_info(g.wire).itemsize, groups[g.m]

    def pack_many(self, gs) -> list:
        """Up to :data:`~wb.runtime.engine.gather.STAGES` messages of one element width and
        group (see :meth:`batches`) packed in one launch, each into staging of its own."""
        if len(gs) == 1:
            return [self.pack(gs[0])]
        if self.ready:
            for g in gs:
                self._after_writers(g)
        bufs = [self.staging(g.nbytes) for g in gs]
        key = tuple(g.m for g in gs)
        tab = self.prog.tables.get(key)
        if tab is None:
            tab = self.prog.tables[key] = self.xp.asarray(
                gather.stacked([gather.table(self._spans(g)) for g in gs]))
        gather.copy(self._ptrs(), tab, bufs, dtype_info(gs[0].wire).itemsize, scatter=False)
        return bufs

    def gather(self, g):
        if g.conv:
            return super().gather(g)
        buf = self.staging(g.nbytes)
        self._fused(g, buf, scatter=False)  # (a received unit's table is of its destination)
        return buf

    def copy_local(self, g) -> None:
        if self.ready:
            self._after_writers(g)
        super().copy_local(g)

    def unpack(self, g, buf) -> None:
        if g.conv:
            super().unpack(g, buf)
        else:
            self._fused(g, buf, scatter=True)

    def unpack_all(self, items: list) -> list:
        """Receives of one element width unpacked up to
        :data:`~wb.runtime.engine.gather.STAGES` a launch (a launch costs ~15-20 us of the
        caller's time, a JAX rollout unpacks every message), one event each launch; the tables
        of the sets that came together are kept, a bounded few (:data:`UNPACK_TABLES`)."""
        out, runs = [], {}
        for g, buf in items:
            if g.conv:  # converted as it is unpacked: on its own
                self.unpack(g, buf)
                out.append((self.fence(), g, buf))
                continue
            run = runs.setdefault(dtype_info(g.wire).itemsize, [])
            run.append((g, buf))
            if len(run) == gather.STAGES:
                out += self._unpack_run(run)
                run.clear()
        for run in runs.values():
            if run:
                out += self._unpack_run(run)
        return out

    def unpack_many(self, items: list) -> None:
        """Messages unpacked from another process's memory, ``(g, address)`` each (a transport
        that reads its peers' memory in place: :mod:`wb.runtime.transport.ipc`), on the current
        stream, :data:`~wb.runtime.engine.gather.STAGES` a launch as :meth:`unpack_all`."""
        runs: dict[int, list] = {}
        for g, address in items:  # the kernel takes an address as a pointer
            runs.setdefault(dtype_info(g.wire).itemsize, []).append((g, np.uint64(address)))
        for run in runs.values():
            for k in range(0, len(run), gather.STAGES):
                part = run[k:k + gather.STAGES]
                if not self._stacked(part):
                    for g, at in part:
                        self._fused(g, at, scatter=True)

    def _unpack_run(self, run: list) -> list:
        if not self._stacked(run):  # one message, or too many sets seen: one launch each
            return HostMover.unpack_all(self, run)
        ev = self.fence()
        return [(ev, g, buf) for g, buf in run]

    def _stacked(self, run: list) -> bool:
        """Unpacks ``run`` (``(g, staging)`` each) in one launch, if its table is or can be kept."""
        tables = self.prog.tables.setdefault("unpacks", {})
        key = tuple(g.m for g, _ in run)
        tab = tables.get(key)
        if tab is None and len(run) > 1 and len(tables) < UNPACK_TABLES:
            tab = tables[key] = self.xp.asarray(
                gather.stacked([gather.table(self._spans(g)) for g, _ in run]))
        if tab is None:
            return False
        gather.copy(self._ptrs(), tab, [buf for _, buf in run],
                    dtype_info(run[0][0].wire).itemsize, scatter=True)
        return True

    def _fused(self, g, buf, *, scatter: bool) -> None:
        """Packs ``g`` (a message or a frame) into ``buf`` (or, with ``scatter``, unpacks
        ``buf``) in one launch: a frame's members' regions lie one after another, as its
        members do."""
        gather.copy(self._ptrs(), self._table(g), buf, dtype_info(g.wire).itemsize, scatter=scatter)


#: Stacked unpack tables a program keeps (:meth:`DeviceMover.unpack_all`): the sets of receives
#: that completed together, which repeat from one update to the next.
UNPACK_TABLES = 256


def _address(a) -> int:
    """An array's address: a CuPy array's on the device, a numpy array's on the host."""
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr


def mover_for(prog, flat: dict[str, Any], xp, ready: dict | None = None) -> HostMover:
    """The mover for buffers of array module ``xp``: :class:`HostMover` for numpy,
    :class:`DeviceMover` for CuPy (``ready``: see :class:`HostMover`)."""
    return HostMover(prog, flat, xp, ready) if xp is np else DeviceMover(prog, flat, xp, ready)


def new_pool() -> defaultdict:
    """An empty staging pool: ``{nbytes: [free buffers]}``."""
    return defaultdict(list)
