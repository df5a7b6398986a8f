"""The delta codec on a device: :mod:`wb.algorithms.delta`'s bytes, made and applied where the
buffers are, bit for bit what the host codec makes.

On a CUDA device, kernels (:mod:`wb.runtime.engine.delta_kernels`), one block of
:data:`THREADS` threads per :data:`~wb.algorithms.delta.BLOCK` of elements:

- encode (:func:`advance_many`: the deltas of a turn's sends at once): each block counts its
  changes (the one thing the host reads back, for all the messages together, to choose each
  encoding and size each delta), then writes their values and places in order (a warp's ballot
  gives a change's rank in its warp, a scan of the warps' counts the warps' offsets), writing the
  base's changed elements as it goes; a :data:`~wb.algorithms.delta.MASK` delta's bits are
  CuPy's ``packbits`` of the compare;
- apply (:data:`~wb.algorithms.delta.BLOCKS`; :func:`apply_many` for several): one kernel finds
  each block's first change and checks its places (ascending in its block, inside the message)
  and the counts' total, and one scatter writes the values of each delta found good; a bad one
  sets a flag on the device, which the caller reads with whatever it reads next. A mask is
  decoded by CuPy's array operations.

With numpy (``xp``), the same results by array operations on the host, which the tests check
against the host codec; the kernels' source is compiled for the host by the tests too.

Examples:
    >>> import numpy as np
    >>> from wb.algorithms import delta as codec
    >>> base = np.zeros(1000, np.uint16).view(np.uint8)
    >>> new = base.copy(); new.view(np.uint16)[[3, 500]] = 7
    >>> d = encode(base, new, itemsize=2, xp=np)
    >>> bool((d == codec.encode(base, new, itemsize=2)).all())
    True
    >>> out = base.copy(); _ = apply(out, d, xp=np); bool((out == new).all())
    True
"""

from __future__ import annotations

import functools

import numpy as np

from wb.algorithms import delta as codec
from wb.errors import TransferError
from wb.runtime.engine import delta_kernels
from wb.runtime.engine.delta_kernels import THREADS, kernel_source

__all__ = ["encode", "advance_many", "count_many", "write_many", "of_changes", "dense", "apply",
           "apply_many", "prepare", "to_host", "headers", "sized", "changed", "received",
           "received_many", "kernel_source", "THREADS"]

_WIDTHS = (1, 2, 4, 8)


def _elements(a, itemsize: int, xp):
    if itemsize not in _WIDTHS:
        raise ValueError(f"delta: itemsize={itemsize} must be one of {_WIDTHS}")
    a = xp.ascontiguousarray(a).reshape(-1).view(xp.uint8)
    if a.nbytes % itemsize:
        raise ValueError(f"delta: {a.nbytes:,} bytes are not a multiple of itemsize={itemsize}")
    return a.view(f"<u{itemsize}")


def changed(base, new, *, itemsize: int, xp):
    """Positions (ascending ``int64``) where ``new``'s elements' bits differ from ``base``'s."""
    b, n = _elements(base, itemsize, xp), _elements(new, itemsize, xp)
    if b.size != n.size:
        raise ValueError(f"delta: base holds {b.nbytes:,} bytes, new {n.nbytes:,}: they must "
                         f"be one size")
    return xp.flatnonzero(b != n).astype(xp.int64, copy=False)


def _header(xp, out, kind: int, itemsize: int, n: int, k: int) -> None:
    h = np.empty(codec.HEADER.size, np.uint8)
    codec.HEADER.pack_into(h, 0, kind, itemsize, out.nbytes, n, k)
    out[:codec.HEADER.size] = xp.asarray(h)


def encode(base, new, *, itemsize: int, xp):
    """The delta that turns ``base`` into ``new`` (byte arrays of one size, on the device of
    ``xp``), in its smallest encoding: the bytes :func:`wb.algorithms.delta.encode` makes. On a
    CUDA device by two kernels (:func:`kernel_source`): a count of the changes per block, then
    their values and places written in order; with numpy, by array operations."""
    if xp is np:
        pos = changed(base, new, itemsize=itemsize, xp=xp)
        vals = _elements(new, itemsize, xp)
        return of_changes(int(vals.size), pos, vals[pos], itemsize=itemsize,
                          whole=lambda: vals, xp=xp)
    b, v = _elements(base, itemsize, xp), _elements(new, itemsize, xp)
    if b.size != v.size:
        raise ValueError(f"delta: base holds {b.nbytes:,} bytes, new {v.nbytes:,}: they must "
                         f"be one size")
    n, nb = int(v.size), -(-int(v.size) // codec.BLOCK)
    count, compact = _kernels(itemsize)
    counts = xp.empty(max(nb, 1), xp.uint32)
    if nb:
        count((nb,), (THREADS,), (b, v, np.int64(n), counts))
    host = counts[:nb].get()  # the one read: the changes per block
    k = int(host.sum(dtype=np.int64))
    kind, nbytes = codec.choose(n, k, itemsize)
    out = xp.empty(nbytes, xp.uint8)
    at = codec.HEADER.size
    if kind == codec.DENSE:
        _header(xp, out, kind, itemsize, n, n)
        out[at:] = v.view(xp.uint8)
        return out
    _header(xp, out, kind, itemsize, n, k)
    starts = xp.asarray(np.concatenate([[0], np.cumsum(host, dtype=np.int64)[:-1]]))
    values = out[at:at + k * itemsize].view(f"<u{itemsize}")
    tail = at + k * itemsize
    if kind == codec.MASK:
        places = xp.empty(max(k, 1), xp.uint16)  # not sent: the mask says where
        out[tail:] = xp.packbits(b != v, bitorder="little")
    else:
        pad = codec.values_pad(k, itemsize)
        out[tail:tail + pad] = 0
        out[tail + pad:tail + pad + 4 * nb].view("<u4")[:] = counts[:nb]
        places = out[tail + pad + 4 * nb:].view("<u2")
    if k:
        compact((nb,), (THREADS,), (b, v, np.int64(n), starts, values, places, np.int32(0)))
    return out


def _module():
    return delta_kernels.module()


def _kernels(itemsize: int):
    m = _module()
    return (m.get_function(f"wb_delta_count_{itemsize}"),
            m.get_function(f"wb_delta_compact_{itemsize}"))


def _apply_blocks(xp, t, vals, tail, n: int, k: int, itemsize: int, bad):
    """A BLOCKS delta applied on a CUDA device without the host reading anything: the counts'
    sums on the device, each change's place checked and its position written by one kernel (the
    counts' total against ``k`` too), then a scatter that writes only if nothing was flagged in
    ``bad`` (a device ``uint32``, which the caller reads)."""
    pad, nb = codec.values_pad(k, itemsize), -(-n // codec.BLOCK)
    pos = xp.empty(max(k, 1), xp.int64)[:k]
    starts = xp.zeros(nb + 1, xp.int64)
    xp.cumsum(tail[pad:pad + 4 * nb].view("<u4"), dtype=xp.int64, out=starts[1:])
    m = _module()
    if nb:
        m.get_function("wb_delta_positions")((nb,), (THREADS,), (
            tail[pad + 4 * nb:].view("<u2"), starts, np.int64(n), np.int64(nb), np.int64(k),
            pos, bad))
    if k:
        m.get_function(f"wb_delta_scatter_{itemsize}")(
            (min(-(-k // THREADS), 4096),), (THREADS,),
            (t.view(f"<u{itemsize}"), vals, pos, np.int64(k), bad))
    return pos


def of_changes(n: int, pos, values, *, itemsize: int, whole, xp):
    """:func:`wb.algorithms.delta.of_changes` where the arrays are: the delta of a message of
    ``n`` elements whose elements at ``pos`` (ascending) changed to ``values``; ``whole()``
    gives all ``n`` new elements, asked for only when the dense form is the smallest."""
    k = int(pos.size)
    kind, nbytes = codec.choose(n, k, itemsize)
    if kind == codec.DENSE:
        return dense(whole(), itemsize=itemsize, xp=xp)
    out = xp.empty(nbytes, xp.uint8)
    _header(xp, out, kind, itemsize, n, k)
    at = codec.HEADER.size
    out[at:at + k * itemsize] = xp.ascontiguousarray(values).reshape(-1).view(xp.uint8)
    at += k * itemsize
    if kind == codec.MASK:
        bits = xp.zeros(n, xp.uint8)
        bits[pos] = 1
        out[at:] = xp.packbits(bits, bitorder="little")
        return out
    pad, nb = codec.values_pad(k, itemsize), -(-n // codec.BLOCK)
    out[at:at + pad] = 0
    at += pad
    edges = xp.searchsorted(pos, xp.arange(nb + 1, dtype=xp.int64) * codec.BLOCK)
    out[at:at + 4 * nb].view("<u4")[:] = xp.diff(edges).astype(xp.uint32)
    out[at + 4 * nb:].view("<u2")[:] = (pos & (codec.BLOCK - 1)).astype(xp.uint16)
    return out


def dense(new, *, itemsize: int, xp):
    """:func:`wb.algorithms.delta.dense` where ``new`` is: its bytes as a delta of the dense
    kind."""
    vals = _elements(new, itemsize, xp)
    out = xp.empty(codec.HEADER.size + vals.nbytes, xp.uint8)
    _header(xp, out, codec.DENSE, itemsize, int(vals.size), int(vals.size))
    out[codec.HEADER.size:] = vals.view(xp.uint8)
    return out


def received(buf, *, xp):
    """``(delta, head)``: the delta at the start of ``buf`` (a receive may be larger than what
    came) and its header's bytes on the host, read once (:func:`apply` takes them)."""
    return sized([buf], _host(buf.reshape(-1).view(xp.uint8)[:codec.HEADER.size], xp), xp=xp)[0]


def _host(a, xp) -> np.ndarray:
    return a if xp is np else a.get()


def apply(target, delta, *, xp, head=None, bad=None):
    """Turns ``target`` (a writable byte array on the device, holding the delta's base) into the
    new bytes, in place: :func:`wb.algorithms.delta.apply` where the buffers are.

    Returns:
        ``(positions, values)`` it wrote (device arrays), or ``(None, values)`` for a delta of
        the dense kind.

    ``head``: the delta's header bytes on the host where the caller read them already
    (:func:`received`). ``bad``: a device ``uint32`` (zero) where a CUDA apply of a
    :data:`~wb.algorithms.delta.BLOCKS` delta flags malformed places instead of raising: the
    host reads nothing then, and the caller reads the flag (nothing of ``target`` is written
    when it is set).

    Raises:
        TransferError: ``delta`` is malformed or made for a message of another size or element
            width (nothing of ``target`` is written then).
    """
    d = delta.reshape(-1).view(xp.uint8)
    t = target.reshape(-1).view(xp.uint8)
    if head is None:
        head = _host(d[:codec.HEADER.size], xp)
    kind, itemsize, n, k = codec.checked(head, d.nbytes, t.nbytes)
    at = codec.HEADER.size
    if kind == codec.DENSE:
        t[:] = d[at:]
        return None, d[at:].view(f"<u{itemsize}")
    vals = d[at:at + k * itemsize].view(f"<u{itemsize}")
    if kind == codec.BLOCKS and xp is not np:
        flag = xp.zeros(1, xp.uint32) if bad is None else bad
        pos = _apply_blocks(xp, t, vals, d[at + k * itemsize:], n, k, itemsize, flag)
        if bad is None and int(flag.get()[0]):
            raise TransferError(_MALFORMED)
        return pos, vals
    pos = _positions(xp, kind, d[at + k * itemsize:], n, k, itemsize)
    t.view(f"<u{itemsize}")[pos] = vals
    return pos, vals


def apply_many(items, bad, *, xp) -> None:
    """Several :data:`~wb.algorithms.delta.BLOCKS` deltas applied on a CUDA device in two
    launches (:func:`kernel_source`'s ``wb_delta_check_many`` and ``wb_delta_scatter_many``):
    ``items`` are ``(target, delta, head, j)``, each delta with its header's bytes on the host
    (:func:`received`) and ``j`` its flag in ``bad`` (a device ``uint32`` array of zeros), which
    a malformed delta sets (nothing of its target is written then); the host reads nothing.

    Raises:
        TransferError: a delta is made for a message of another size or element width, or
            its header is not a BLOCKS delta's (before anything is queued).
    """
    rows, nbs, total = [], [], 0
    for target, delta, head, j in items:
        if not (target.flags.c_contiguous and delta.flags.c_contiguous):
            raise ValueError("delta: apply_many's targets and deltas must be contiguous")
        kind, w, n, k = codec.checked(head, delta.nbytes, target.nbytes)
        if kind != codec.BLOCKS:
            raise TransferError(f"delta: apply_many takes blocks deltas, not {codec.kind_of(head)}")
        nb = -(-n // codec.BLOCK)
        at = codec.HEADER.size + k * w + codec.values_pad(k, w)
        rows.append((_address(delta), _address(target), n, k, w, nb, at, at + 4 * nb, j, total))
        nbs.append(nb)
        total += nb
    if not total:
        return
    args = _table(xp, rows, nbs)  # the one write
    starts = xp.empty(total, xp.int64)
    m = _module()
    m.get_function("wb_delta_check_many")((total,), (THREADS,), args + (starts, bad))
    m.get_function("wb_delta_scatter_many")((total,), (THREADS,), args + (starts, bad))


def prepare(xp) -> None:
    """Compiles the kernels and runs every step of the codec once on tiny messages (CuPy compiles
    its own operations on first use too), so that a job's first delta costs no compilation: a
    few hundred milliseconds once per process and device, on the job's first update."""
    if xp is np:
        return
    _prepared(xp, xp.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _prepared(xp, device: int) -> None:
    rng = np.random.default_rng(0)
    jobs = []
    for w, density in [(1, 0.01), (2, 0.01), (4, 0.01), (8, 0.01), (2, 0.5), (2, 1.0)]:
        base = rng.integers(0, 256, 4096 * w, dtype=np.uint8)
        new = base.copy()
        new.reshape(-1, w)[rng.random(4096) < density, 0] ^= 1
        jobs.append((xp.asarray(base), xp.asarray(new), w, base))
    made = advance_many([(b, n, w) for b, n, w, _ in jobs], xp=xp)
    heads = received_many(made, xp=xp)
    bad = xp.zeros(len(made), xp.uint32)
    together = []
    for j, ((got, head), (_, _, w, base)) in enumerate(zip(heads, jobs)):
        target = xp.asarray(base)
        if codec.header(head)[0] == codec.BLOCKS:
            together.append((target, got, head, j))
            apply(xp.asarray(base), got, xp=xp, head=head, bad=bad[j:j + 1])
        else:
            apply(target, got, xp=xp, head=head)
    apply_many(together, bad, xp=xp)
    bad.get()


def _address(a) -> int:
    """A device array's address (a host array's, where the tests run the kernels on the host)."""
    return a.data.ptr if hasattr(a.data, "ptr") else a.ctypes.data


_MALFORMED = "delta positions malformed: not ascending within the message, or counts not its own"


def to_host(a, *, xp):
    """``(host, event, keep)``: the bytes of device array ``a`` copied into pinned host memory
    behind the work queued on the current stream, without waiting: ``host`` holds them once
    ``event.done``; ``keep`` (the pinned memory) must live until then."""
    n = a.nbytes
    keep = xp.cuda.alloc_pinned_memory(max(n, 1))
    host = np.frombuffer(keep, np.uint8, n)
    stream = xp.cuda.get_current_stream()
    if n:
        xp.cuda.runtime.memcpyAsync(host.ctypes.data, _address(a), n, 2, stream.ptr)  # D2H
    ev = xp.cuda.Event(block=False, disable_timing=True)
    ev.record(stream)
    return host, ev, keep


def headers(bufs, *, xp):
    """The headers of the deltas at the start of ``bufs`` (receives), gathered on the device and
    copied to the host without waiting (:func:`to_host`); :func:`sized` reads them."""
    return to_host(xp.concatenate([b.reshape(-1).view(xp.uint8)[:codec.HEADER.size]
                                   for b in bufs]), xp=xp)


def sized(bufs, heads, *, xp) -> list:
    """``[(delta, head)]``: each receive's delta (what its header says came) and its header's
    bytes, from ``heads`` (the host bytes of :func:`headers`)."""
    out = []
    for j, buf in enumerate(bufs):
        b = buf.reshape(-1).view(xp.uint8)
        head = heads[j * codec.HEADER.size:(j + 1) * codec.HEADER.size]
        size = codec.header(head)[2]
        if size > b.nbytes:
            raise TransferError(f"delta header says {size:,} bytes; {b.nbytes:,} came")
        out.append((b[:size], head))
    return out


def received_many(bufs, *, xp):
    """:func:`received` for several receives, their headers read by the host in one go."""
    if xp is np or not bufs:
        return [received(b, xp=xp) for b in bufs]
    return sized(bufs, xp.concatenate([b.reshape(-1).view(xp.uint8)[:codec.HEADER.size]
                                       for b in bufs]).get(), xp=xp)


def advance_many(jobs, *, xp):
    """The deltas of several messages at once, each base then holding its new bytes.

    ``jobs``: ``(base, new, itemsize)`` byte arrays of one size each. Returns each job's delta,
    the bytes :func:`encode` makes. On a CUDA device: one launch counts the changes of every
    block of every message, the host reads the counts (its one read) and writes one table, and
    one launch writes every :data:`~wb.algorithms.delta.BLOCKS` delta whole, each base taking
    the changed elements as they are read (a message's base costs no copy); a mask or a dense
    delta (most elements changed) is written apart. The deltas are queued on the current
    stream: the caller waits for it before they leave.
    """
    if xp is np:
        out = []
        for base, new, w in jobs:
            out.append(encode(base, new, itemsize=w, xp=xp))
            base.reshape(-1).view(xp.uint8)[:] = new.reshape(-1).view(xp.uint8)
        return out
    counted = count_many(jobs, xp=xp)
    return write_many(counted, counted[0].get(), xp=xp)  # the one read


def _span(a, w: int, *, written: bool, xp):
    """``(array, address, elements)`` of byte array ``a`` read as elements of ``w`` bytes; one
    the kernels write (``written``) must be contiguous (a copy would take the writes)."""
    if w not in _WIDTHS:
        raise ValueError(f"delta: itemsize={w} must be one of {_WIDTHS}")
    if not a.flags.c_contiguous:
        if written:
            raise ValueError("delta: a base or target the kernels write must be contiguous")
        a = xp.ascontiguousarray(a)
    if a.nbytes % w:
        raise ValueError(f"delta: {a.nbytes:,} bytes are not a multiple of itemsize={w}")
    return a, _address(a), a.nbytes // w


def count_many(jobs, *, xp):
    """:func:`advance_many`'s first launch: every block of every message's changes counted on
    the device. Returns what :func:`write_many` takes, the device counts first (the host reads
    them: ``.get()``, or without waiting: :func:`to_host`)."""
    rows, views = [], []
    for base, new, w in jobs:
        b, ab, nb_ = _span(base, w, written=True, xp=xp)
        v, av, n = _span(new, w, written=False, xp=xp)
        if n != nb_:
            raise ValueError(f"delta: base holds {b.nbytes:,} bytes, new {v.nbytes:,}: they "
                             f"must be one size")
        views.append((b, v, w, n))
        rows.append((ab, av, n, w, 0))
    ns = np.array([r[2] for r in rows], np.int64)
    nbs = -(-ns // codec.BLOCK)
    first = np.concatenate([[0], np.cumsum(nbs)]).astype(np.int64)
    total = int(first[-1])
    counts = xp.empty(max(total, 1), xp.uint32)
    if total:  # every message's changes counted by one launch
        tab = np.array(rows, np.int64).reshape(-1, 5)
        tab[:, 4] = first[:-1]
        dev, block_job = _table(xp, tab, nbs)
        _module().get_function("wb_delta_count_many")((total,), (THREADS,),
                                                       (dev, block_job, counts))
    return counts, views, nbs, first


#: Where each of a batch's deltas starts in their one buffer: a multiple of this many bytes.
_ALIGN = 256


def write_many(counted, host, *, xp):
    """:func:`advance_many`'s second launch, once the host holds the counts (``host``, the bytes
    or the ``uint32`` array of ``counted[0]``): every delta written (into one buffer, each
    returned as its part), each base advanced. Returns the deltas, queued on the current
    stream."""
    counts, views, nbs, first = counted
    total = int(first[-1])
    host = np.asarray(host).view(np.uint32)[:total]
    ends = np.concatenate([[0], np.cumsum(host, dtype=np.int64)])
    ks = ends[first[1:]] - ends[first[:-1]]
    begin = ends[:-1] - np.repeat(ends[first[:-1]], nbs)  # each block's first change in its delta
    kinds, sizes, heads = [], [], np.zeros((len(views), 4), np.int64)
    for j, ((_, _, w, n), k) in enumerate(zip(views, ks.tolist())):
        kind, nbytes = codec.choose(n, k, w)
        kinds.append(kind)
        sizes.append(nbytes)
        codec.HEADER.pack_into(heads[j].view(np.uint8), 0, kind, w, nbytes, n,
                               n if kind == codec.DENSE else k)
    sizes = np.array(sizes, np.int64)
    offs = np.concatenate([[0], np.cumsum(-(-sizes // _ALIGN) * _ALIGN)])
    buf = xp.empty(max(int(offs[-1]), 1), xp.uint8)
    out = [buf[o:o + z] for o, z in zip(offs[:-1].tolist(), sizes.tolist())]
    blocks = np.array([kd == codec.BLOCKS for kd in kinds]) & (nbs > 0)
    if blocks.any():  # every BLOCKS delta written by one launch: header, values, counts, places
        ws = np.array([w for _, _, w, _ in views], np.int64)
        vals_end = codec.HEADER.size + ks * ws
        at = vals_end + np.array([codec.values_pad(k, w) for k, w in zip(ks.tolist(),
                                                                         ws.tolist())], np.int64)
        first_of = np.concatenate([[0], np.cumsum(nbs[blocks])])[:-1]
        tab = np.column_stack([
            [_address(b) for b, _, _, _ in views], [_address(v) for _, v, _, _ in views],
            [n for _, _, _, n in views], ws, _address(buf) + offs[:-1],
            np.zeros(len(views), np.int64), at, at + 4 * nbs, heads, vals_end,
            first[:-1]])[blocks].astype(np.int64)
        tab[:, 5] = first_of
        mine = np.repeat(blocks, nbs)
        dev, block_job, at_dev = _table(xp, tab, nbs[blocks], begin[mine])
        _module().get_function("wb_delta_compact_many")((int(mine.sum()),), (THREADS,),
                                                         (dev, block_job, at_dev, counts))
    for j in np.flatnonzero(~blocks).tolist():  # a mask, the dense bytes, or no elements
        (b, v, w, n), d, at, kind, k = views[j], out[j], codec.HEADER.size, kinds[j], int(ks[j])
        b, v = _elements(b, w, xp), _elements(v, w, xp)
        d[:at] = xp.asarray(heads[j].view(np.uint8))
        if kind == codec.DENSE:
            d[at:] = v.view(xp.uint8)
            b[:] = v
            continue
        values, tail = d[at:at + k * w].view(f"<u{w}"), at + k * w
        if kind == codec.MASK:
            places = xp.empty(max(k, 1), xp.uint16)  # not sent: the mask says where
            d[tail:] = xp.packbits(b != v, bitorder="little")  # before the base advances
        else:  # no elements
            places = d[tail:].view("<u2")
        if k:
            _kernels(w)[1]((int(nbs[j]),), (THREADS,), (
                b, v, np.int64(n), xp.asarray(begin[first[j]:first[j + 1]]), values,
                places, np.int32(1)))
    return out


def _table(xp, rows, nbs, starts=None):
    """``rows`` (an ``int64`` array, a row per job), each global block's job (job ``j`` has
    ``nbs[j]`` blocks) and (optionally) each block's start, on the device by one write; returns
    their device arrays: ``(rows, block_job)`` or ``(rows, block_job, starts)``."""
    tab = np.ascontiguousarray(rows, np.int64).reshape(-1)
    jobs = np.repeat(np.arange(len(nbs), dtype=np.int32), nbs)
    parts = [tab.view(np.uint8)]
    if starts is not None:
        parts.append(np.ascontiguousarray(starts, np.int64).view(np.uint8))
    dev = xp.asarray(np.concatenate(parts + [jobs.view(np.uint8)]))
    a = tab.nbytes
    out = [dev[:a].view(xp.int64)]
    if starts is not None:
        b = a + 8 * jobs.size
        return out[0], dev[b:].view(xp.int32), dev[a:b].view(xp.int64)
    return out[0], dev[a:].view(xp.int32)


def _positions(xp, kind: int, tail, n: int, k: int, itemsize: int):
    """The changed positions a MASK or BLOCKS tail (its size checked: :func:`~wb.algorithms.
    delta.checked`) holds, checked as the host codec checks them (one read by the host)."""
    if kind == codec.MASK:
        bits = xp.unpackbits(tail, bitorder="little")
        pos = xp.flatnonzero(bits[:n])
        if int(pos.size) != k or bool(bits[n:].any()):
            raise TransferError(f"delta mask sets {int(xp.count_nonzero(bits))} elements, its "
                                f"header says {k} of {n}")
        return pos.astype(xp.int64, copy=False)
    pad, nb = codec.values_pad(k, itemsize), -(-n // codec.BLOCK)
    ends = xp.cumsum(tail[pad:pad + 4 * nb].view("<u4"), dtype=xp.int64)
    block = xp.searchsorted(ends, xp.arange(k, dtype=xp.int64), side="right")
    pos = block * codec.BLOCK + tail[pad + 4 * nb:].view("<u2")
    # one read: the counts' total, the last position, and how often the positions descend
    none = xp.zeros(1, xp.int64)
    total, last, disorder = (int(x) for x in xp.concatenate([
        ends[-1:] if nb else none, pos[-1:] if k else none - 1,
        (pos[1:] <= pos[:-1]).sum(dtype=xp.int64).reshape(1) if k > 1 else none]).tolist())
    if total != k:
        raise TransferError(f"delta blocks count {total} changes, its header says {k}")
    if disorder or last >= n:
        raise TransferError("delta positions malformed: not ascending within the message")
    return pos
