"""Updates that send deltas: each unit goes as what changed since the version its receiver holds
(:mod:`wb.algorithms.delta` encodes it), never against a base that is assumed.

A rank in a job that sends deltas keeps, per unit it sends (a trainer's messages, a rollout's
forwards that it packs otherwise than they came), a *base*: the bytes it last sent, in their
travelling dtype (a packed message's staging becomes its base; a zero-copy one is copied). A
forward of exactly the bytes its parent brought (a *relay*) keeps none: the delta that came goes
on as it came. A unit it receives has its base where it
lands: its own destination regions, which hold what the last update wrote there (a unit this
rank converts keeps a copy of the travelling bytes instead, since a conversion back may not
give them). A :class:`~wb.runtime.engine.program.Program` that completed version ``v`` with its
bases kept *holds* ``v`` (:attr:`Program.version`); a failed or interrupted update, a new
program (other membership) or a device rank holds ``-1``.

Per update and peer the two ends decide alike, from what both published when they joined the
version (:class:`DeltaPlan`): a unit travels as a delta exactly when its sender and receiver
hold the same version; else dense. The receiver then posts a receive as large as the unit's
largest delta (``upto``: the delta says its own length), and applies it in place: into the
destination range (zero-copy units), or into the regions gathered into staging and unpacked
again. A relay's receiver holds the version its forwarder holds, which is the one the parent's
delta was made against, so the delta applies there alike; where the parent came dense, the relay
sends the new bytes as a delta of the dense kind. Other forwards are encoded against the
forwarder's own bases.

On a device the same steps run where the buffers are (:mod:`wb.runtime.engine.deltas.device`, the
host codec's bytes made by kernels on the update's stream), many units at once and without the
host waiting for the device (:mod:`wb.runtime.engine.deltas.batches`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from wb.algorithms import delta as codec
from wb.data.dtypes import dtype_info
from wb.errors import TransferError
from wb.runtime.engine.deltas import device as dev
from wb.runtime.engine.frames import Frame

__all__ = ["DeltaPlan", "width", "encode_send", "encode_one", "land", "keep", "alike"]


class DeltaPlan(NamedTuple):
    """How one update of a rank runs in a job that sends deltas.

    Attributes:
        version: the version this update moves (held once it completes).
        to: peers that get this rank's units as deltas (they hold what this rank holds).
        frm: peers whose units come to this rank as deltas.
    """

    version: int
    to: frozenset = frozenset()
    frm: frozenset = frozenset()


def width(g) -> int:
    """The element width (bytes) unit ``g``'s bytes are compared in: its travelling dtype's."""
    return dtype_info(g.wire).itemsize if g.wire else 1


def _encode(xp, old, new, w: int):
    return codec.encode(old, new, itemsize=w) if xp is np else dev.encode(old, new, itemsize=w,
                                                                          xp=xp)


def _dense(xp, new, w: int):
    return codec.dense(new, itemsize=w) if xp is np else dev.dense(new, itemsize=w, xp=xp)


def _apply(xp, target, delta, head, bad=None):
    return codec.apply(target, delta) if xp is np else dev.apply(target, delta, xp=xp, head=head,
                                                                 bad=bad)


def _settle(mover) -> None:
    """The host waits for the device work queued so far (nothing on the host)."""
    ev = mover.fence()
    if ev is not None:
        ev.synchronize()


def encode_send(prog, mover, g, *, as_delta: bool, came: dict, cut: dict):
    """Unit ``g``'s payload for this update, and its base updated to the new bytes.

    A relay (:attr:`Program.relays <wb.runtime.engine.program.Program.relays>`: a forward of
    exactly its parent's bytes) keeps no base: as a delta it carries the delta its parent brought
    (``came``: ``{parent: [delta, relays still to send it]}``; both pairs hold the same version,
    so it applies alike at its receiver). A forward of one member of a frame that came
    (:attr:`Program.sliced <wb.runtime.engine.program.Program.sliced>`) keeps none either: it
    carries the member's part of the frame's delta (``cut``: ``{frame: [(positions, values),
    forwards still to send]}``, what :func:`~wb.algorithms.delta.apply` decoded), encoded anew.
    Where the parent came dense, either sends the new bytes as a delta of the dense kind.

    Returns:
        ``(payload, staged, pooled)``: what to send (the delta, or the dense bytes), whether it
        is memory of this update's (counted in the send budget) and whether that memory is a
        pool buffer (given back once sent).
    """
    ev = mover.wait(g) if g.zc_src else None  # (a packed one's pack waits on the device)
    if ev is not None:  # device work still writes its source (a quantiser)
        ev.synchronize()
    out = encode_one(prog, mover, g, as_delta=as_delta, came=came, cut=cut)
    _settle(mover)  # device buffers: the payload is written before the transport reads it
    return out


def encode_one(prog, mover, g, *, as_delta: bool, came: dict, cut: dict):
    """:func:`encode_send` without waiting for the device (its caller waits, or queues the wait
    behind an event: :mod:`wb.runtime.engine.deltas.batches`)."""
    xp = mover.xp
    at = prog.sliced.get(g.m)
    if at is not None or g.m in prog.relays:
        if not as_delta:
            return (mover.source(g), False, False) if g.zc_src else (mover.pack(g), True, True)
        key, kept_by = (g.parent, came) if at is None else (at[0], cut)
        kept = kept_by.get(key)
        if kept is not None:
            kept[1] -= 1
            if not kept[1]:
                del kept_by[key]
            if at is None:
                return kept[0], True, False
            pos, vals = kept[0]
            w = width(g)
            e0, e1 = at[1] // w, (at[1] + g.nbytes) // w
            if pos is None:  # the frame came dense: these are the member's new values
                return _dense(xp, vals[e0:e1], w), True, False
            i0, i1 = (int(i) for i in xp.searchsorted(pos, xp.asarray([e0, e1])).tolist())
            whole = lambda: _whole(mover, g)  # noqa: E731
            return (codec.of_changes(e1 - e0, pos[i0:i1] - e0, vals[i0:i1], itemsize=w,
                                     whole=whole) if xp is np else
                    dev.of_changes(e1 - e0, pos[i0:i1] - e0, vals[i0:i1], itemsize=w,
                                   whole=whole, xp=xp)), True, False
        return _dense(xp, _whole(mover, g), width(g)), True, False
    bases = prog.bases
    old = bases.get(g.m)
    if g.zc_src:
        new = mover.array(g, src=True)
        payload = _encode(xp, old, new, width(g)) if as_delta and old is not None else new
        if old is None:
            old = bases[g.m] = xp.empty(g.nbytes, xp.uint8)
        xp.copyto(old, new)
        return payload, payload is not new, False
    new = mover.pack(g)
    payload = _encode(xp, old, new, width(g)) if as_delta and old is not None else new
    bases[g.m] = new  # the packed bytes are the next base
    if old is not None:
        mover.release(old)
    return payload, True, False


def _whole(mover, g) -> np.ndarray:
    """Unit ``g``'s new bytes, as a copy of this update's own (the pool's staging goes back)."""
    if g.zc_src:
        return mover.array(g, src=True)
    packed = mover.pack(g)
    try:
        return packed.copy()
    finally:
        mover.release(packed)


def land(prog, mover, g, buf, *, as_delta: bool, came=None, bad=None, spent=None):
    """Unit ``g`` landed in staging ``buf``: applies it (a delta) or unpacks it (dense), keeping
    the base of a converted unit.

    ``came``: the delta and its header's bytes on the host, where the caller read them
    (:func:`~wb.runtime.engine.deltas.tables.received_many`). On a device, ``bad``: the flag a
    malformed delta sets (the caller reads it), and ``spent``: a list that takes the staging to
    give back once the device work passed (else the host waits for it here).

    Returns:
        ``(came, decoded)``: the bytes that came (what its checksum covers), and a delta's
        ``(positions, values)`` as :func:`~wb.algorithms.delta.apply` returns them (``None``
        for dense bytes)."""
    xp, got, head = mover.xp, buf, None
    if as_delta:  # the delta's header read once (on a device, by the host)
        got, head = came if came is not None else (buf[:codec.size_of(buf)], None) \
            if xp is np else dev.received(buf, xp=xp)
    if g.conv:  # its base is a copy of the travelling bytes
        base = prog.recv_bases.get(g.m)
        if as_delta:
            if base is None:
                raise TransferError(f"rank {prog.rank}: a delta for {g.label()} came, but this "
                                    f"rank holds no base of it")
            decoded = _apply(xp, base, got, head, bad)
            mover.unpack(g, base)
            return got, decoded
        if base is None:
            base = prog.recv_bases[g.m] = xp.empty(g.nbytes, xp.uint8)
        xp.copyto(base, buf)
        mover.unpack(g, buf)
        return got, None
    if not as_delta:
        mover.unpack(g, buf)
        return got, None
    if g.zc_dst:
        return got, _apply(xp, mover.array(g, src=False), got, head, bad)
    if xp is np:  # written where the unit's regions lie (no gathering and unpacking)
        decoded = codec.changes(got, g.nbytes)
        if mover.scatter(g, *decoded):
            return got, decoded
    base = mover.gather(g)
    if spent is not None:
        spent.append(base)
        decoded = _apply(xp, base, got, head, bad)
        mover.unpack(g, base)
        return got, decoded
    try:
        decoded = _apply(xp, base, got, head)
        mover.unpack(g, base)
    finally:
        _settle(mover)  # the base's staging goes back to the pool: read first
        mover.release(base)
    return got, decoded


def keep(u, g, came, decoded) -> bool:
    """Keeps what a delta for unit ``g`` brought for as long as forwards of this update will send
    it on: the delta itself for relays, the decoded changes of a frame for forwards of its
    members (copies: the staging goes back to the pool). Returns whether it kept anything (on a
    device the copies are queued: the staging may go back once they have run)."""
    prog, to, units = u.prog, u.delta.to, u.prog.units
    kids, kept = prog.children, False
    n = sum(1 for c in kids.get(g.m, ()) if c in prog.relays and units[c].peer in to)
    if n:
        u.came[g.m] = [came.copy(), n]
        kept = True
    if g.__class__ is Frame:
        n = sum(1 for x in g.members for c in kids.get(x.m, ())
                if c in prog.sliced and units[c].peer in to)
        if n:
            pos, vals = decoded
            u.cut[g.m] = [(None if pos is None else pos.copy(), vals.copy()), n]
            kept = True
    return kept


def alike(u, g) -> bool:
    """Whether forward ``g`` of update ``u`` travels as its parent came (both dense, or both
    deltas against one version): then its bytes may be its parent's (a checksum's alias)."""
    d = u.delta
    if d is None:
        return True
    p = u.msgs.get(g.parent)
    return p is not None and (p.peer in d.frm) == (g.peer in d.to)

