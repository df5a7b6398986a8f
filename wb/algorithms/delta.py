"""Deltas of a message's bytes against the version its receiver holds: the elements that changed,
in whichever of three encodings is smallest for that message.

Elements are compared as raw bits of the message's element width (so ``-0.0`` differs from
``0.0`` and every NaN payload is kept), and a delta replaces them: applied to the base it was made
against it gives the new bytes bit for bit. A delta is self-describing bytes (a forwarder sends it
on as it came, and a receive larger than it finds its end in the header). Layout, little-endian:
a header of :data:`HEADER` (kind, element bytes, the delta's own bytes, elements, changed
elements), then

- :data:`DENSE`: every element (what travels when a delta would not be smaller);
- :data:`MASK`: the changed elements' values, then one bit per element (set where it changed);
- :data:`GAPS`: the changed elements' values, then their positions as LEB128 varints of the gaps
  between them (the first position itself, then each gap less one).

Examples:
    >>> import numpy as np
    >>> base = np.zeros(1000, np.uint16).view(np.uint8)
    >>> new = base.copy(); new.view(np.uint16)[[3, 500]] = 7
    >>> d = encode(base, new, itemsize=2)
    >>> kind_of(d), d.nbytes, size_of(d)
    ('gaps', 39, 39)
    >>> out = base.copy(); _ = apply(out, d); bool((out == new).all())
    True
"""

from __future__ import annotations

import struct

import numpy as np

from wb.errors import TransferError

__all__ = ["DENSE", "MASK", "GAPS", "HEADER", "encode", "of_changes", "dense", "apply", "changed",
           "kind_of", "size_of", "max_bytes", "sizes", "expected_bytes"]

DENSE, MASK, GAPS = 0, 1, 2
_NAMES = {DENSE: "dense", MASK: "mask", GAPS: "gaps"}
#: kind (u8), element bytes (u8), 6 pad bytes, the delta's bytes, header included (u64),
#: elements (u64), changed elements (u64): 32 bytes, so that the values after it stay aligned for
#: any element width up to 8
HEADER = struct.Struct("<BB6xQQQ")
_WIDTHS = (1, 2, 4, 8)
#: Messages of at least this many elements are compared a word of 8 bytes at a time first.
_WORDS_FROM = 1 << 12


def _elements(a: np.ndarray, itemsize: int, what: str) -> np.ndarray:
    """``a`` (bytes) as unsigned integers of ``itemsize`` bytes, refusing what does not fit."""
    if itemsize not in _WIDTHS:
        raise ValueError(f"delta: itemsize={itemsize} must be one of {_WIDTHS}")
    a = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    if a.nbytes % itemsize:
        raise ValueError(f"delta: {what} holds {a.nbytes:,} bytes, not a multiple of "
                         f"itemsize={itemsize}")
    return a.view(f"<u{itemsize}")


def changed(base: np.ndarray, new: np.ndarray, *, itemsize: int) -> np.ndarray:
    """Positions (elements of ``itemsize`` bytes, ascending ``int64``) where ``new``'s bits differ
    from ``base``'s; the two are byte arrays of one size."""
    b, n = _elements(base, itemsize, "base"), _elements(new, itemsize, "new")
    if b.size != n.size:
        raise ValueError(f"delta: base holds {b.nbytes:,} bytes, new {n.nbytes:,}: they must "
                         f"be one size")
    per = 8 // itemsize
    whole = b.size - b.size % per
    if per == 1 or whole < _WORDS_FROM:
        return np.flatnonzero(b != n)
    # 8-byte words first (a fraction of the elements to look at), then the elements of the
    # words that differ; the few elements past the last whole word on their own
    bw, nw = b[:whole].view("<u8"), n[:whole].view("<u8")
    words = np.flatnonzero(bw != nw)
    lanes = (bw[words] ^ nw[words]).view(f"<u{itemsize}").reshape(-1, per)
    row, lane = np.nonzero(lanes)
    pos = words[row] * per + lane
    if whole == b.size:
        return pos
    return np.concatenate([pos, np.flatnonzero(b[whole:] != n[whole:]) + whole])


def _varint_lengths(v: np.ndarray) -> np.ndarray:
    lengths = np.ones(v.size, np.int64)
    top = int(v.max()) if v.size else 0
    for j in range(1, 10):
        if top < 1 << (7 * j):  # gaps are mostly short: a pass per byte the longest one needs
            break
        lengths += v >= np.uint64(1) << np.uint64(7 * j)
    return lengths


def _gaps(pos: np.ndarray) -> np.ndarray:
    g = np.diff(pos, prepend=-1) - 1  # >= 0: positions are strictly ascending
    return g.astype(np.uint64)


def sizes(n: int, pos: np.ndarray, *, itemsize: int) -> dict[str, int]:
    """Bytes of each encoding of a delta of ``n`` elements changed at ``pos``, header included."""
    return _sizes(n, int(pos.size), _varint_lengths(_gaps(pos)), itemsize)


def _sizes(n: int, k: int, lengths: np.ndarray, itemsize: int) -> dict[str, int]:
    return {"dense": HEADER.size + n * itemsize,
            "mask": HEADER.size + k * itemsize + -(-n // 8),
            "gaps": HEADER.size + k * itemsize + int(lengths.sum())}


def expected_bytes(nbytes, itemsize, density: float) -> np.ndarray:
    """Expected bytes of the smallest encoding of deltas of messages of ``nbytes`` (an array, or
    one) with elements of ``itemsize`` bytes, where each element changed on its own with
    probability ``density``: a model for planning (:func:`wb.simulate`'s ``delta_density``), the
    encodings' sizes taken at their expected counts. Gaps between changes are then geometric,
    and a gap needs a ``j``-th varint byte when it is at least ``128**(j - 1)`` (probability
    ``(1 - density)**(128**(j - 1))``).

    Examples:
        >>> int(expected_bytes(1 << 20, 2, 0.0)), int(expected_bytes(1 << 20, 2, 1.0)) - (1 << 20)
        (32, 32)
        >>> round(float(expected_bytes(1 << 20, 2, 0.03)) / (1 << 20), 3)  # values and gaps
        0.045
    """
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"delta: density must be within [0, 1], got {density}")
    size = np.asarray(nbytes, np.float64)
    n = size / np.asarray(itemsize, np.float64)
    k = density * n
    varint = 1.0 + sum((1.0 - density) ** (128.0 ** j) for j in range(1, 10))
    return HEADER.size + np.minimum.reduce([size, k * itemsize + np.ceil(n / 8),
                                            k * (itemsize + varint)])


def max_bytes(nbytes: int) -> int:
    """The most bytes a delta of an ``nbytes`` message takes (its dense form)."""
    return HEADER.size + int(nbytes)


def encode(base: np.ndarray, new: np.ndarray, *, itemsize: int) -> np.ndarray:
    """The delta that turns ``base`` into ``new`` (byte arrays of one size, elements of
    ``itemsize`` bytes), in its smallest encoding (ties: dense, then gaps).

    Returns:
        The delta's bytes (``uint8``), at most :func:`max_bytes` of the message's size.
    """
    pos = changed(base, new, itemsize=itemsize)
    vals = _elements(new, itemsize, "new")
    return of_changes(vals.size, pos, vals[pos], itemsize=itemsize, whole=lambda: vals)


def of_changes(n: int, pos: np.ndarray, values: np.ndarray, *, itemsize: int,
               whole) -> np.ndarray:
    """The delta of a message of ``n`` elements whose elements at ``pos`` (ascending) changed to
    ``values`` (as many, ``itemsize`` bytes each), in its smallest encoding; ``whole()`` gives
    all ``n`` new elements, asked for only when the dense form is the smallest. What
    :func:`encode` makes from two versions, and a forwarder from the part of a delta that came
    (:func:`apply` returns what it decoded)."""
    k = int(pos.size)
    g = _gaps(pos)
    lengths = _varint_lengths(g)
    size = _sizes(n, k, lengths, itemsize)
    kind = min((DENSE, GAPS, MASK), key=lambda x: size[_NAMES[x]])
    if kind == DENSE:
        return dense(whole(), itemsize=itemsize)
    out = np.empty(size[_NAMES[kind]], np.uint8)
    HEADER.pack_into(out, 0, kind, itemsize, out.nbytes, n, k)
    at = HEADER.size
    out[at:at + k * itemsize] = np.ascontiguousarray(values).reshape(-1).view(np.uint8)
    at += k * itemsize
    if kind == MASK:
        bits = np.zeros(n, np.uint8)
        bits[pos] = 1
        out[at:] = np.packbits(bits, bitorder="little")
        return out
    starts = np.cumsum(lengths) - lengths
    dst = out[at:]
    for j in range(int(lengths.max()) if k else 0):
        sel = lengths > j
        byte = (g[sel] >> np.uint64(7 * j)) & np.uint64(0x7F)
        more = (lengths[sel] > j + 1).astype(np.uint64) << np.uint64(7)
        dst[starts[sel] + j] = (byte | more).astype(np.uint8)
    return out


def dense(new: np.ndarray, *, itemsize: int) -> np.ndarray:
    """``new`` (bytes, elements of ``itemsize`` bytes) as a delta of the :data:`DENSE` kind: what
    goes to a receiver that expects a delta where the sender has no base to make one against."""
    vals = _elements(new, itemsize, "new")
    out = np.empty(HEADER.size + vals.nbytes, np.uint8)
    HEADER.pack_into(out, 0, DENSE, itemsize, out.nbytes, vals.size, vals.size)
    out[HEADER.size:] = vals.view(np.uint8)
    return out


def _header(delta: np.ndarray) -> tuple[int, int, int, int, int]:
    if delta.nbytes < HEADER.size:
        raise TransferError(f"delta of {delta.nbytes} bytes: shorter than its "
                            f"{HEADER.size}-byte header")
    kind, itemsize, size, n, k = HEADER.unpack_from(delta)
    if kind not in _NAMES or itemsize not in _WIDTHS or k > n or size < HEADER.size:
        raise TransferError(f"delta header malformed: kind {kind}, itemsize {itemsize}, "
                            f"{size} bytes, {k} changed of {n} elements")
    return kind, itemsize, size, n, k


def kind_of(delta: np.ndarray) -> str:
    """The encoding of ``delta``: ``"dense"``, ``"mask"`` or ``"gaps"``."""
    return _NAMES[_header(np.asarray(delta).reshape(-1).view(np.uint8))[0]]


def size_of(buf: np.ndarray) -> int:
    """The bytes of the delta at the start of ``buf`` (a receive may be larger than what came).

    Raises:
        TransferError: its header is malformed or says more bytes than ``buf`` holds.
    """
    b = np.asarray(buf).reshape(-1).view(np.uint8)
    size = _header(b)[2]
    if size > b.nbytes:
        raise TransferError(f"delta header says {size:,} bytes; {b.nbytes:,} came")
    return size


def _positions(kind: int, tail: np.ndarray, n: int, k: int) -> np.ndarray:
    """The changed positions a MASK or GAPS tail holds (ascending; checked against ``n`` and
    ``k``)."""
    if kind == MASK:
        if tail.nbytes != -(-n // 8):
            raise TransferError(f"delta mask of {tail.nbytes} bytes for {n} elements")
        if n % 8 and int(tail[-1]) >> (n % 8):
            raise TransferError(f"delta mask sets bits past its {n} elements")
        bits = np.unpackbits(tail, count=n, bitorder="little").view(bool)
        set_bits = int(np.count_nonzero(bits))
        if set_bits != k:
            raise TransferError(f"delta mask sets {set_bits} elements, its header says {k}")
        return np.flatnonzero(bits)  # then a fancy index: numpy's boolean one is 6x slower
    ends = np.flatnonzero(tail < 0x80)  # the last byte of each varint
    if ends.size != k or (k and ends[-1] != tail.size - 1) or (not k and tail.size):
        raise TransferError(f"delta positions malformed: {ends.size} varints in {tail.size} "
                            f"bytes for {k} changed elements")
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    lengths = ends - starts + 1
    if k and lengths.max() > 9:  # gaps below 2**63
        raise TransferError("delta positions malformed: a varint longer than 9 bytes")
    g = np.zeros(k, np.uint64)
    for j in range(int(lengths.max()) if k else 0):
        sel = lengths > j
        g[sel] |= (tail[starts[sel] + j] & np.uint8(0x7F)).astype(np.uint64) << np.uint64(7 * j)
    if k and int(g.max()) >= n:
        raise TransferError(f"delta positions malformed: a gap of {int(g.max())} in {n} elements")
    pos = np.cumsum(g.astype(np.int64) + 1) - 1
    if k and pos[-1] >= n:
        raise TransferError(f"delta positions malformed: position {int(pos[-1])} of {n} elements")
    return pos


def apply(target: np.ndarray, delta: np.ndarray):
    """Turns ``target`` (a writable byte array holding the delta's base) into the new bytes, in
    place.

    Returns:
        ``(positions, values)`` it wrote: the changed elements' positions (ascending) and their
        values (unsigned integers of the delta's element width, a view of ``delta``), or
        ``(None, values)`` for a delta of the dense kind (every element's value).

    Raises:
        TransferError: ``delta`` is malformed or made for a message of another size or element
            width (nothing of ``target`` is written then).
    """
    d = np.asarray(delta).reshape(-1).view(np.uint8)
    kind, itemsize, size, n, k = _header(d)
    if size != d.nbytes:
        raise TransferError(f"delta header says {size:,} bytes; it has {d.nbytes:,}")
    t = target.reshape(-1).view(np.uint8)
    if t.nbytes != n * itemsize:
        raise TransferError(f"delta of {n:,} elements of {itemsize} bytes for a message of "
                            f"{t.nbytes:,} bytes")
    at = HEADER.size
    if kind == DENSE:
        if d.nbytes != at + n * itemsize:
            raise TransferError(f"dense delta of {d.nbytes:,} bytes for {n:,} elements")
        t[:] = d[at:]
        return None, d[at:].view(f"<u{itemsize}")
    if d.nbytes < at + k * itemsize:
        raise TransferError(f"delta of {d.nbytes:,} bytes: too short for {k:,} values")
    vals = d[at:at + k * itemsize].view(f"<u{itemsize}")
    pos = _positions(kind, d[at + k * itemsize:], n, k)
    t.view(f"<u{itemsize}")[pos] = vals
    return pos, vals
