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

On a device the same steps run where the buffers are (:mod:`wb.runtime.engine.delta_device`, the
host codec's bytes made by kernels on the update's stream), a few launches for many messages: the
sends a turn takes are encoded together (:func:`post_sends`: the host reads their counts once
and waits for the stream once, before they leave), and the deltas a completion batch brought
are applied together, without the host waiting: the batch is parked while its headers, then
the flags of malformed deltas, come to the host behind the stream (:func:`take_parked`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from wb.algorithms import delta as codec
from wb.data.dtypes import dtype_info
from wb.errors import TransferError
from wb.runtime.engine import delta_device as dev
from wb.runtime.engine.frames import Frame

__all__ = ["DeltaPlan", "width", "encode_send", "encode_sends", "post_sends", "land",
           "take_completions", "take_parked", "alike"]


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
    out = _encode_send(prog, mover, g, as_delta=as_delta, came=came, cut=cut)
    _settle(mover)  # device buffers: the payload is written before the transport reads it
    return out


def encode_sends(prog, mover, gs, *, to, came: dict, cut: dict) -> list:
    """:func:`encode_send` for units ``gs`` (their peers in ``to`` get deltas), in one go. On a
    device the deltas of the units that keep a base are made together
    (:func:`~wb.runtime.engine.delta_device.advance_many`: one read by the host for all, and a
    zero-copy unit's base advanced by the compaction, not copied), and the host waits for the
    device once, before any of them leaves."""
    xp = mover.xp
    if xp is np:
        return [encode_send(prog, mover, g, as_delta=g.peer in to, came=came, cut=cut)
                for g in gs]
    out, jobs, spent, bases = [None] * len(gs), [], [], prog.bases
    queued = False  # device work this call queued (a relay of what came queues none)
    for i, g in enumerate(gs):
        ev = mover.wait(g) if g.zc_src else None
        if ev is not None:  # device work still writes its source (a quantiser)
            ev.synchronize()
        if g.m in prog.relays and g.peer in to and g.parent in came:
            out[i] = _encode_send(prog, mover, g, as_delta=True, came=came, cut=cut)
            continue
        queued = True
        if g.m in prog.sliced or g.m in prog.relays:
            out[i] = _encode_send(prog, mover, g, as_delta=g.peer in to, came=came, cut=cut)
            continue
        old = bases.get(g.m)
        as_delta = g.peer in to and old is not None
        if g.zc_src:
            new = mover.array(g, src=True)
            if as_delta:
                jobs.append((i, old, new, g))
                continue
            if old is None:
                old = bases[g.m] = xp.empty(g.nbytes, xp.uint8)
            xp.copyto(old, new)
            out[i] = (new, False, False)
            continue
        new = bases[g.m] = mover.pack(g)  # the packed bytes are the next base
        if old is not None:
            spent.append(old)
        if as_delta:
            jobs.append((i, old, new, g))
        else:
            out[i] = (new, True, False)
    if jobs:
        made = dev.advance_many([(old, new, width(g)) for _, old, new, g in jobs], xp=xp)
        for (i, _, _, _), d in zip(jobs, made):
            out[i] = (d, True, False)
    if queued:
        _settle(mover)  # the payloads are written before the transport reads them
    for old in spent:
        mover.release(old)
    return out


def post_sends(u, gs) -> None:
    """Posts the sends of units ``gs`` of update ``u`` (:class:`~wb.runtime.engine.update.
    _Update`) in a job that sends deltas, encoded together (:func:`encode_sends`). Each was
    counted in the send budget as staged (its unit's bytes) when it was taken; once encoded it
    counts what its payload holds, and one that leaves from its own buffer nothing."""
    sums, marks = u.sums, u.marks
    outs = encode_sends(u.prog, u.mover, gs, to=u.delta.to, came=u.came, cut=u.cut)
    for g, (buf, staged, pooled) in zip(gs, outs):
        if pooled:
            u.pooled.add(g.m)
        u.inflight.add(u.transport.send(g.peer, buf, u.tag_base + g.m), g,
                       buf if staged else None)
        if sums is not None:
            sums.sent(g, buf, parent_alike=alike(u, g))
        if not staged:
            u.staged_send -= g.nbytes
            u.packed_done.add(g.m)
        else:  # counted as what it holds (a delta: a few percent of the unit) until sent
            u.staged_send -= g.nbytes - buf.nbytes
        if marks is not None:
            u.mark(g.m, 1)


def _encode_send(prog, mover, g, *, as_delta: bool, came: dict, cut: dict):
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
    (:func:`~wb.runtime.engine.delta_device.received_many`). On a device, ``bad``: the flag a
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


def take_completions(u, got) -> bool:
    """An update's completed requests (``u``: its :class:`~wb.runtime.engine.update._Update`) in
    a job that sends deltas: bytes are counted as they travelled; a send's memory is its base
    or its own (nothing goes back to the pool); a receive is applied or unpacked, its base kept,
    and it lands once the device work on it is done. On a device a batch is parked: its
    headers, then its flags, come to the host behind the stream (:func:`take_parked`)."""
    sums, delta, prog, mover = u.sums, u.delta, u.prog, u.mover
    xp, landing = mover.xp, []
    for req, g, buf in got:
        if g.out:
            if buf is not None:  # counted as its payload's bytes (post_sends)
                u.staged_send += g.nbytes - buf.nbytes
            u.sent(g, buf.nbytes if buf is not None else g.nbytes, staged=buf is not None)
            if g.m in u.pooled:
                u.pooled.discard(g.m)
                u.release(buf)
            continue
        if buf is None:  # dense, zero-copy: its destination is its base
            if sums is not None:
                sums.landed(g, mover.target(g))
            u.landed(g, None)
            continue
        landing.append((g, buf))
    if not landing:
        return bool(got)
    if xp is not np:  # they land once the device work on them passed (take_parked)
        _land_on_device(u, landing)
        return True
    for g, buf in landing:
        as_delta = g.peer in delta.frm
        came, decoded = land(prog, mover, g, buf, as_delta=as_delta)
        if as_delta:  # kept for the forwards that send it on (see encode_send)
            _keep(u, g, came, decoded)
        if sums is not None:
            sums.landed(g, came)
        u.bytes_received += came.nbytes - g.nbytes  # landed() counts g.nbytes
    for g, buf in landing:
        u.landed(g, buf)
    return bool(got)


def _land_on_device(u, landing) -> None:
    """:func:`take_completions`' receives on a device, parked (:func:`take_parked` goes on):
    the headers of the deltas that came are copied to the host behind the stream, without
    waiting."""
    ins = [buf for g, buf in landing if g.peer in u.delta.frm]
    u.parked.append(("headers", landing, ins, dev.headers(ins, xp=u.mover.xp) if ins else None))
    take_parked(u)


def take_parked(u) -> bool:
    """The device receives of an update (:func:`take_completions`) whose host copies have come:
    once a batch's headers are on the host, the deltas are applied (:func:`_apply_batch`) and
    their flags copied back; once those are, malformed ones fail the update and the rest land.
    The host never waits for the device here: a batch not ready stays parked."""
    moved, left = False, []
    for p in u.parked:
        if p[0] == "headers":  # (_, landing, receives of deltas, (headers, event, memory))
            heads = p[3]
            if heads is not None and not heads[1].done:
                left.append(p)
                continue
            p = _apply_batch(u, p[1], p[2], heads[0] if heads is not None else None)
            moved = True
        _, landing, (flags, ev, _), spent = p
        if not ev.done:
            left.append(p)
            continue
        moved = True
        for old in spent:
            u.mover.release(old)
        for j in np.flatnonzero(flags):
            g = landing[int(j)][0]
            raise TransferError(f"rank {u.prog.rank}: the delta for {g.label()} from rank "
                                f"{g.peer} is malformed: its places are not ascending within "
                                f"the message, or its counts are not its header's")
        for g, buf in landing:
            u.landed(g, buf)
    u.parked = left
    return moved


def _apply_batch(u, landing, ins, heads) -> list:
    """A batch's deltas applied, its dense receives unpacked: the BLOCKS deltas whose changes no
    forward needs decoded together (:func:`~wb.runtime.engine.delta_device.apply_many`), into
    their destination, or into their staging gathered from it and unpacked after; the rest one
    by one (:func:`land`). Returns the batch parked on its flags' copy to the host:
    ``("flags", landing, (flags, event, memory), staging to give back)``."""
    sums, delta, prog, mover = u.sums, u.delta, u.prog, u.mover
    xp = mover.xp
    came_of = dict(zip((id(b) for b in ins), dev.sized(ins, heads, xp=xp))) if ins else {}
    flags = xp.zeros(len(landing), xp.uint32)
    spent, together, unpack = [], [], []
    for j, (g, buf) in enumerate(landing):
        as_delta = g.peer in delta.frm
        got_head = came_of.get(id(buf))
        if as_delta and codec.header(got_head[1])[0] == codec.BLOCKS and \
                not _decoded_needed(u, g):
            if g.conv:
                target = prog.recv_bases.get(g.m)
                if target is None:
                    raise TransferError(f"rank {prog.rank}: a delta for {g.label()} came, but "
                                        f"this rank holds no base of it")
                unpack.append((g, target))
            elif g.zc_dst:
                target = mover.array(g, src=False)
            else:
                target = mover.gather(g)
                spent.append(target)
                unpack.append((g, target))
            together.append((target, got_head[0], got_head[1], j))
            came, decoded = got_head[0], None
        else:
            came, decoded = land(prog, mover, g, buf, as_delta=as_delta, came=got_head,
                                 bad=flags[j:j + 1], spent=spent)
        if as_delta:  # kept for the forwards that send it on (see encode_send)
            _keep(u, g, came, decoded)
        if sums is not None:
            sums.landed(g, came)
        u.bytes_received += came.nbytes - g.nbytes  # landed() counts g.nbytes
    dev.apply_many(together, flags, xp=xp)
    for g, base in unpack:
        mover.unpack(g, base)
    return "flags", landing, dev.to_host(flags, xp=xp), spent  # behind the units' device work


def _decoded_needed(u, g) -> bool:
    """Whether forwards of this update send on part of what a delta for frame ``g`` changed
    (they need its positions and values decoded: :func:`_keep`)."""
    if g.__class__ is not Frame:
        return False
    prog, to, units = u.prog, u.delta.to, u.prog.units
    kids = prog.children
    return any(c in prog.sliced and units[c].peer in to
               for x in g.members for c in kids.get(x.m, ()))


def _keep(u, g, came, decoded) -> None:
    """Keeps what a delta for unit ``g`` brought for as long as forwards of this update will send
    it on: the delta itself for relays, the decoded changes of a frame for forwards of its
    members (copies: the staging goes back to the pool)."""
    prog, to, units = u.prog, u.delta.to, u.prog.units
    kids = prog.children
    n = sum(1 for c in kids.get(g.m, ()) if c in prog.relays and units[c].peer in to)
    if n:
        u.came[g.m] = [came.copy(), n]
    if g.__class__ is Frame:
        n = sum(1 for x in g.members for c in kids.get(x.m, ())
                if c in prog.sliced and units[c].peer in to)
        if n:
            pos, vals = decoded
            u.cut[g.m] = [(None if pos is None else pos.copy(), vals.copy()), n]


def alike(u, g) -> bool:
    """Whether forward ``g`` of update ``u`` travels as its parent came (both dense, or both
    deltas against one version): then its bytes may be its parent's (a checksum's alias)."""
    d = u.delta
    if d is None:
        return True
    p = u.msgs.get(g.parent)
    return p is not None and (p.peer in d.frm) == (g.peer in d.to)
