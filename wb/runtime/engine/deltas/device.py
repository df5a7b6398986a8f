"""The delta codec on a device: :mod:`wb.algorithms.delta`'s bytes, made and applied where the
buffers are, bit for bit what the host codec makes.

On a CUDA device, kernels (:mod:`wb.runtime.engine.deltas.kernels`), one block of
:data:`THREADS` threads per :data:`~wb.algorithms.delta.BLOCK` of elements:

- encode (:func:`advance_many`: the deltas of a turn's sends at once): each block counts its
  changes (the one thing the host reads back, for all the messages together, to choose each
  encoding and size each delta), then writes their values and places in order (a warp's ballot
  gives a change's rank in its warp, a scan of the warps' counts the warps' offsets), writing the
  base's changed elements as it goes; a :data:`~wb.algorithms.delta.MASK` delta's bits are
  CuPy's ``packbits`` of the compare;
- apply (:data:`~wb.algorithms.delta.BLOCKS`; :func:`apply_many` for several, each reading its
  header on the device): one kernel finds each block's first change and checks its places
  (ascending in its block, inside the message) and the counts' total, and one scatter writes the
  values of each delta found good; a bad one (or one the host must apply) sets a flag on the
  device, which the caller reads with whatever it reads next. A mask is decoded by CuPy's array
  operations.

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

import numpy as np

from wb.algorithms import delta as codec
from wb.errors import TransferError
from wb.runtime.engine.deltas import kernels as delta_kernels
from wb.runtime.engine.deltas.kernels import THREADS, kernel_source

__all__ = ["encode", "of_changes", "dense", "apply", "to_host", "sized", "changed", "received",
           "elements", "address", "kernel_module", "kernels_of", "kernel_source", "WIDTHS",
           "THREADS"]

WIDTHS = (1, 2, 4, 8)


def elements(a, itemsize: int, xp):
    """Byte array ``a`` (made contiguous) as unsigned elements of ``itemsize`` bytes."""
    if itemsize not in WIDTHS:
        raise ValueError(f"delta: itemsize={itemsize} must be one of {WIDTHS}")
    a = xp.ascontiguousarray(a).reshape(-1).view(xp.uint8)
    if a.nbytes % itemsize:
        raise ValueError(f"delta: {a.nbytes:,} bytes are not a multiple of itemsize={itemsize}")
    return a.view(f"<u{itemsize}")


def changed(base, new, *, itemsize: int, xp):
    """Positions (ascending ``int64``) where ``new``'s elements' bits differ from ``base``'s."""
    b, n = elements(base, itemsize, xp), elements(new, itemsize, xp)
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
        vals = elements(new, itemsize, xp)
        return of_changes(int(vals.size), pos, vals[pos], itemsize=itemsize,
                          whole=lambda: vals, xp=xp)
    b, v = elements(base, itemsize, xp), elements(new, itemsize, xp)
    if b.size != v.size:
        raise ValueError(f"delta: base holds {b.nbytes:,} bytes, new {v.nbytes:,}: they must "
                         f"be one size")
    n, nb = int(v.size), -(-int(v.size) // codec.BLOCK)
    count, compact = kernels_of(itemsize)
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


def kernel_module():
    """The codec's compiled kernels (:func:`wb.runtime.engine.deltas.kernels.module`); the tests
    put the host-compiled ones here."""
    return delta_kernels.module()


def kernels_of(itemsize: int):
    """``(count, compact)`` of one message's elements of ``itemsize`` bytes."""
    m = kernel_module()
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
    m = kernel_module()
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
    vals = elements(new, itemsize, xp)
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


def address(a) -> int:
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
        xp.cuda.runtime.memcpyAsync(host.ctypes.data, address(a), n, 2, stream.ptr)  # D2H
    ev = xp.cuda.Event(block=False, disable_timing=True)
    ev.record(stream)
    return host, ev, keep


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
