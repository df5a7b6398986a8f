"""A delta update's steps over many units at once (:mod:`wb.runtime.engine.deltas.units` says what a
unit's delta is and how it lands): the sends a turn takes, encoded together, and the receives a
turn completed, applied together.

On the host each unit goes in turn (numpy's codec). On a device a few launches serve a whole
batch (:mod:`wb.runtime.engine.deltas.device`), and the host waits for the device nowhere: a
batch of sends is parked while its counts come to the host behind the stream, then while its
deltas are written, and is posted after; a batch of receives is applied at once (the kernels
read each delta's header on the device) and parked while its flags and sizes come, landing
after (:func:`take_parked`, each turn of the update's loop). Only deltas the host must read
first (whose changes forwards need decoded, or not BLOCKS deltas) wait for their headers.
"""

from __future__ import annotations

import numpy as np

from wb.algorithms import delta as codec
from wb.errors import TransferError
from wb.runtime.engine.deltas import device as dev
from wb.runtime.engine.deltas import tables as many
from wb.runtime.engine.deltas.units import alike, encode_one, encode_send, keep, land, width
from wb.runtime.engine.frames import Frame

__all__ = ["post_sends", "take_completions", "take_parked"]


def _encode_start(prog, mover, gs, *, to, came: dict, cut: dict):
    """The encoding of units ``gs`` on a device up to the changes counted (the deltas of the
    units that keep a base are made together, a zero-copy unit's base advanced by the
    compaction): ``(outs, counted, jobs, spent, queued)``: the payloads known already (``None``
    for the deltas to make), what :func:`~wb.runtime.engine.deltas.tables.count_many` gave (or
    ``None``), the deltas to make, the bases to give back once the device work passed, whether
    any device work was queued."""
    xp = mover.xp
    out, jobs, spent, bases = [None] * len(gs), [], [], prog.bases
    queued = False  # device work this call queued (a relay of what came queues none)
    for i, g in enumerate(gs):
        ev = mover.wait(g) if g.zc_src else None
        if ev is not None:  # device work still writes its source (a quantiser)
            ev.synchronize()
        if g.m in prog.relays and g.peer in to and g.parent in came:
            out[i] = encode_one(prog, mover, g, as_delta=True, came=came, cut=cut)
            continue
        queued = True
        if g.m in prog.sliced or g.m in prog.relays:
            out[i] = encode_one(prog, mover, g, as_delta=g.peer in to, came=came, cut=cut)
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
    counted = many.count_many([(old, new, width(g)) for _, old, new, g in jobs], xp=xp) \
        if jobs else None
    return out, counted, jobs, spent, queued


def _encode_finish(mover, state, host) -> tuple[list, bool]:
    """The deltas of :func:`_encode_start`'s state written, once the host holds the counts
    (``host``); returns the payloads and whether device work was queued."""
    out, counted, jobs, _, queued = state
    if jobs:
        made = many.write_many(counted, host, xp=mover.xp)
        for (i, _, _, _), d in zip(jobs, made):
            out[i] = (d, True, False)
    return out, queued


def post_sends(u, gs) -> None:
    """Posts the sends of units ``gs`` of update ``u`` (:class:`~wb.runtime.engine.update.
    _Update`) in a job that sends deltas, encoded together (on the host one by one:
    :func:`~wb.runtime.engine.deltas.units.encode_send`). Each was
    counted in the send budget as staged (its unit's bytes) when it was taken; once encoded it
    counts what its payload holds, and one that leaves from its own buffer nothing. On a
    device the host waits for nothing: the batch is parked while its counts come to the host,
    then while its deltas are written (:func:`take_parked`)."""
    if u.mover.xp is np:
        _post(u, gs, [encode_send(u.prog, u.mover, g, as_delta=g.peer in u.delta.to,
                                  came=u.came, cut=u.cut) for g in gs])
        return
    state = _encode_start(u.prog, u.mover, gs, to=u.delta.to, came=u.came, cut=u.cut)
    counted = state[1]
    u.parked.append(("counts", gs, state,
                     dev.to_host(counted[0], xp=u.mover.xp) if counted else None))
    take_parked(u)


def _post(u, gs, outs) -> None:
    sums, marks = u.sums, u.marks
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
        if as_delta:  # kept for the forwards that send it on (see deltas.encode_send)
            keep(u, g, came, decoded)
        if sums is not None:
            sums.landed(g, came)
        u.bytes_received += came.nbytes - g.nbytes  # landed() counts g.nbytes
    for g, buf in landing:
        u.landed(g, buf)
    return bool(got)


def _land_on_device(u, landing) -> None:
    """:func:`take_completions`' receives on a device, parked (:func:`take_parked` goes on): the
    deltas applied at once, each kernel reading its delta's header where it lies, so that the
    host waits for nothing first (:func:`_apply_direct`). The deltas whose changes forwards of
    this update need decoded take the longer way: their headers come to the host first
    (:func:`_apply_batch`)."""
    frm, slow, fast = u.delta.frm, [], []
    for g, buf in landing:
        (slow if g.peer in frm and (_decoded_needed(u, g) or not g.nbytes) else fast).append(
            (g, buf))
    if slow:
        u.parked.append(_by_headers(u, slow))
    if fast:
        u.parked.append(_apply_direct(u, fast))
    take_parked(u)


def _by_headers(u, landing) -> tuple:
    """Receives parked while the headers of their deltas come to the host (:func:`headers`)."""
    ins = [buf for g, buf in landing if g.peer in u.delta.frm]
    return "headers", landing, ins, many.headers(ins, xp=u.mover.xp) if ins else None


def _target(u, g, spent: list, unpack: list):
    """Where a delta for unit ``g`` applies on a device: its base (a converted unit: unpacked
    after), its destination: one range (zero-copy), or its regions where they lie (a packed
    unit: :class:`~wb.runtime.engine.gather.Regions`)."""
    prog, mover = u.prog, u.mover
    if g.conv:
        target = prog.recv_bases.get(g.m)
        if target is None:
            raise TransferError(f"rank {prog.rank}: a delta for {g.label()} came, but this rank "
                                f"holds no base of it")
        unpack.append((g, target))
        return target
    if g.zc_dst:
        return mover.array(g, src=False)
    return mover.spread(g)


def _apply_direct(u, landing) -> tuple:
    """A batch's deltas applied by two launches that read their headers on the device
    (:func:`~wb.runtime.engine.deltas.tables.apply_many`), its dense receives unpacked. Returns
    the batch parked on its flags' and sizes' copy to the host: ``("flags", landing, (state,
    event, memory), staging to give back, True)``."""
    prog, mover, frm = u.prog, u.mover, u.delta.frm
    xp = mover.xp
    state, flags, sizes = many.flags_and_sizes(len(landing), xp=xp)
    spent, together, unpack = [], [], []
    for j, (g, buf) in enumerate(landing):
        if g.peer in frm:
            together.append((_target(u, g, spent, unpack), buf, width(g), j))
        else:
            land(prog, mover, g, buf, as_delta=False, spent=spent)
    many.apply_many(together, flags, sizes, xp=xp)
    for g, base in unpack:
        mover.unpack(g, base)
    return "flags", landing, dev.to_host(state, xp=xp), spent, True


def take_parked(u) -> bool:
    """An update's device batches whose host copies or device work have come. Sends
    (:func:`post_sends`): once a batch's counts are on the host its deltas are written, and
    once those are, the batch is posted. Receives (:func:`take_completions`): once a batch's
    flags and sizes are on the host, malformed deltas fail the update, the ones the host must
    apply (not BLOCKS deltas) go the longer way (:func:`_by_headers`), and the rest land (once
    the copies queued of what they brought for forwards have run); a batch that went that way
    is applied once its headers are on the host, and lands once its flags are. The host never
    waits for the device here: a batch not ready stays parked."""
    moved, left = False, []
    for p in u.parked:
        if p[0] == "counts":  # (_, units, _encode_start's state, (counts, event, memory))
            counts = p[3]
            if counts is not None and not counts[1].done:
                left.append(p)
                continue
            outs, queued = _encode_finish(u.mover, p[2], counts[0] if counts else None)
            p = ("encoded", p[1], outs, u.mover.fence() if queued else None, p[2][3])
            moved = True
        if p[0] == "encoded":  # (_, units, payloads, event or None, bases to give back)
            if p[3] is not None and not p[3].done:
                left.append(p)
                continue
            for old in p[4]:
                u.mover.release(old)
            _post(u, p[1], p[2])
            moved = True
            continue
        if p[0] == "headers":  # (_, landing, receives of deltas, (headers, event, memory))
            heads = p[3]
            if heads is not None and not heads[1].done:
                left.append(p)
                continue
            p = _apply_batch(u, p[1], p[2], heads[0] if heads is not None else None)
            moved = True
        if p[0] == "kept":  # (_, receives, event): the copies the forwards keep have run
            if not p[2].done:
                left.append(p)
                continue
            for g, buf in p[1]:
                u.landed(g, buf)
            moved = True
            continue
        _, landing, (state, ev, _), spent, direct = p
        if not ev.done:
            left.append(p)
            continue
        moved = True
        for old in spent:
            u.mover.release(old)
        again, ready, kept = _counted(u, landing, state, direct)
        if again:
            left.append(_by_headers(u, again))
        fence = u.mover.fence() if kept else None
        if fence is not None:  # their staging goes back once the copies they feed have run
            left.append(("kept", ready, fence))
            continue
        for g, buf in ready:
            u.landed(g, buf)
    u.parked = left
    return moved


def _counted(u, landing, state, direct: bool) -> tuple[list, list, bool]:
    """A batch of receives whose flags and sizes (``state``'s host bytes) came: a malformed
    delta fails the update. Returns ``(again, ready, kept)``: the deltas a direct apply left to
    the host (to go the longer way), the receives that may land, and whether copies of what they
    brought were queued for forwards (``direct``: applied by :func:`_apply_direct`, so what each
    delta brought is counted and kept here, its size now known; the staging then goes back only
    once those copies have run)."""
    flags, sizes = many.read_flags(state, len(landing))
    for j in np.flatnonzero(flags == 1 if direct else flags):
        g = landing[int(j)][0]
        raise TransferError(f"rank {u.prog.rank}: the delta for {g.label()} from rank {g.peer} "
                            f"is malformed: its sizes disagree with its header or its message, "
                            f"its places are not ascending within the message, or its counts "
                            f"are not its header's")
    if not direct:
        return [], landing, False
    again, ready, kept, sums, frm, xp = [], [], False, u.sums, u.delta.frm, u.mover.xp
    prog = u.prog
    for j, (g, buf) in enumerate(landing):
        if flags[j] == 2:
            again.append((g, buf))
            continue
        came, size = buf, buf.nbytes
        if g.peer in frm:  # kept for the forwards that send it on (see deltas.encode_send)
            size = int(sizes[j])
            if sums is not None or g.m in prog.children:  # (a slice costs a device array)
                came = buf[:size] if buf.ndim == 1 and buf.dtype == np.uint8 else \
                    buf.reshape(-1).view(xp.uint8)[:size]
                kept |= keep(u, g, came, None)
        if sums is not None:
            sums.landed(g, came)
        u.bytes_received += size - g.nbytes  # landed() counts g.nbytes
        ready.append((g, buf))
    return again, ready, kept


def _apply_batch(u, landing, ins, heads) -> tuple:
    """A batch's deltas applied, its dense receives unpacked, once their headers are on the
    host: the BLOCKS deltas whose changes no forward needs decoded together (:func:`~wb.
    runtime.engine.deltas.tables.apply_many`), the rest one by one (:func:`land`). Returns the
    batch parked on its flags' copy to the host: ``("flags", landing, (state, event, memory),
    staging to give back, False)``."""
    sums, delta, prog, mover = u.sums, u.delta, u.prog, u.mover
    xp = mover.xp
    came_of = dict(zip((id(b) for b in ins), dev.sized(ins, heads, xp=xp))) if ins else {}
    state, flags, sizes = many.flags_and_sizes(len(landing), xp=xp)
    spent, together, unpack = [], [], []
    for j, (g, buf) in enumerate(landing):
        as_delta = g.peer in delta.frm
        got_head = came_of.get(id(buf))
        head = codec.header(got_head[1]) if as_delta else None
        if as_delta and head[0] == codec.BLOCKS and not _decoded_needed(u, g) and head[3] \
                and (g.zc_dst or g.conv or head[1] == width(g)):  # (regions: in their width)
            target = _target(u, g, spent, unpack)
            codec.checked(got_head[1], got_head[0].nbytes, target.nbytes)  # raises where not
            together.append((target, buf, head[1], j))
            came, decoded = got_head[0], None
        else:
            came, decoded = land(prog, mover, g, buf, as_delta=as_delta, came=got_head,
                                 bad=flags[j:j + 1], spent=spent)
        if as_delta:  # kept for the forwards that send it on (see deltas.encode_send)
            keep(u, g, came, decoded)
        if sums is not None:
            sums.landed(g, came)
        u.bytes_received += came.nbytes - g.nbytes  # landed() counts g.nbytes
    many.apply_many(together, flags, sizes, xp=xp)
    for g, base in unpack:
        mover.unpack(g, base)
    return "flags", landing, dev.to_host(state, xp=xp), spent, False  # behind the device work


def _decoded_needed(u, g) -> bool:
    """Whether forwards of this update send on part of what a delta for frame ``g`` changed
    (they need its positions and values decoded: :func:`keep`)."""
    if g.__class__ is not Frame:
        return False
    prog, to, units = u.prog, u.delta.to, u.prog.units
    kids = prog.children
    return any(c in prog.sliced and units[c].peer in to
               for x in g.members for c in kids.get(x.m, ()))
