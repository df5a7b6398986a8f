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

Host buffers only so far (numpy on both ends); a rank on a device holds ``-1``: its peers send
it dense bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from wb.algorithms import delta as codec
from wb.data.dtypes import dtype_info
from wb.errors import TransferError

__all__ = ["DeltaPlan", "width", "encode_send", "land", "take_completions", "alike"]


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


def encode_send(prog, mover, g, *, as_delta: bool, came: dict):
    """Unit ``g``'s payload for this update, and its base updated to the new bytes.

    A relay (:attr:`Program.relays <wb.runtime.engine.program.Program.relays>`: a forward of
    exactly its parent's bytes) keeps no base: as a delta it carries the delta its parent brought
    (``came``: ``{parent: [delta, relays still to send it]}``; both pairs hold the same version,
    so it applies alike at its receiver), or, where its parent came dense, the new bytes as a
    delta of the dense kind.

    Returns:
        ``(payload, staged, pooled)``: what to send (the delta, or the dense bytes), whether it
        is memory of this update's (counted in the send budget) and whether that memory is a
        pool buffer (given back once sent).
    """
    if g.m in prog.relays:
        if not as_delta:
            return (mover.source(g), False, False) if g.zc_src else (mover.pack(g), True, True)
        kept = came.get(g.parent)
        if kept is None:
            new = mover.source(g) if g.zc_src else mover.pack(g)
            payload = codec.dense(new, itemsize=width(g))
            if not g.zc_src:
                mover.release(new)
            return payload, True, False
        kept[1] -= 1
        if not kept[1]:
            del came[g.parent]
        return kept[0], True, False
    bases = prog.bases
    old = bases.get(g.m)
    if g.zc_src:
        new = mover.source(g)
        payload = (codec.encode(old, new, itemsize=width(g))
                   if as_delta and old is not None else new)
        if old is None:
            old = bases[g.m] = np.empty(g.nbytes, np.uint8)
        np.copyto(old, new)
        return payload, payload is not new, False
    new = mover.pack(g)
    payload = (codec.encode(old, new, itemsize=width(g))
               if as_delta and old is not None else new)
    bases[g.m] = new  # the packed bytes are the next base
    if old is not None:
        mover.release(old)
    return payload, True, False


def land(prog, mover, g, buf, *, as_delta: bool):
    """Unit ``g`` landed in staging ``buf``: applies it (a delta) or unpacks it (dense), keeping
    the base of a converted unit. Returns the bytes that came (what its checksum covers)."""
    got = buf[:codec.size_of(buf)] if as_delta else buf
    if g.conv:  # its base is a copy of the travelling bytes
        base = prog.recv_bases.get(g.m)
        if as_delta:
            if base is None:
                raise TransferError(f"rank {prog.rank}: a delta for {g.label()} came, but this "
                                    f"rank holds no base of it")
            codec.apply(base, got)
            mover.unpack(g, base)
            return got
        if base is None:
            base = prog.recv_bases[g.m] = np.empty(g.nbytes, np.uint8)
        np.copyto(base, buf)
        mover.unpack(g, buf)
        return got
    if not as_delta:
        mover.unpack(g, buf)
        return got
    if g.zc_dst:
        codec.apply(mover.target(g), got)
        return got
    base = mover.gather(g)
    try:
        codec.apply(base, got)
        mover.unpack(g, base)
    finally:
        mover.release(base)
    return got


def take_completions(u, got) -> bool:
    """An update's completed requests (``u``: its :class:`~wb.runtime.engine.update._Update`) in
    a job that sends deltas (host buffers: nothing waits for a device): bytes are counted as
    they travelled; a send's memory is its base or its own (nothing goes back to the pool); a
    receive is applied or unpacked, its base kept."""
    sums, delta, prog, mover = u.sums, u.delta, u.prog, u.mover
    for req, g, buf in got:
        if g.out:
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
        as_delta = g.peer in delta.frm
        came = land(prog, mover, g, buf, as_delta=as_delta)
        if as_delta:  # kept for the relays that send it on as it came
            n = sum(1 for c in prog.children.get(g.m, ())
                    if c in prog.relays and prog.units[c].peer in delta.to)
            if n:
                u.came[g.m] = [came.copy(), n]
        if sums is not None:
            sums.landed(g, came)
        u.bytes_received += came.nbytes - g.nbytes  # landed() counts g.nbytes
        u.landed(g, buf)
    return bool(got)


def alike(u, g) -> bool:
    """Whether forward ``g`` of update ``u`` travels as its parent came (both dense, or both
    deltas against one version): then its bytes may be its parent's (a checksum's alias)."""
    d = u.delta
    if d is None:
        return True
    p = u.msgs.get(g.parent)
    return p is not None and (p.peer in d.frm) == (g.peer in d.to)
