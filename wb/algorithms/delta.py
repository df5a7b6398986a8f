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
- :data:`BLOCKS`: the changed elements' values, zeros to a multiple of 4 bytes, then per block of
  :data:`BLOCK` elements how many of them changed (``uint32``), then each changed element's
  place in its block (``uint16``, ascending within the block).

Positions take two bytes a change in :data:`BLOCKS` where variable-length gaps would take about
one at a few percent of changes, but both ends then work in a few vectorised passes over the
changes (a count per block, a repeat and an add), several times less CPU than coding varints:
the dearer side on every link but an emulated one of a few MB/s.

Examples:
    >>> import numpy as np
    >>> base = np.zeros(1000, np.uint16).view(np.uint8)
    >>> new = base.copy(); new.view(np.uint16)[[3, 500]] = 7
    >>> d = encode(base, new, itemsize=2)
    >>> kind_of(d), d.nbytes, size_of(d)
    ('blocks', 44, 44)
    >>> out = base.copy(); _ = apply(out, d); bool((out == new).all())
    True
"""

from __future__ import annotations

import struct

import numpy as np

from wb.errors import TransferError

__all__ = ["DENSE", "MASK", "BLOCKS", "BLOCK", "HEADER", "encode", "of_changes", "dense", "apply",
           "changes", "changed", "kind_of", "size_of", "max_bytes", "sizes", "expected_bytes",
           "choose", "values_pad", "header", "checked"]

DENSE, MASK, BLOCKS = 0, 1, 3
_NAMES = {DENSE: "dense", MASK: "mask", BLOCKS: "blocks"}
#: Elements of a block of :data:`BLOCKS` (a change's place in it fits two bytes).
BLOCK = 1 << 16
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


def values_pad(k: int, itemsize: int) -> int:
    """Zeros after ``k`` values in :data:`BLOCKS`, so that the counts start 4-byte aligned."""
    return -(HEADER.size + k * itemsize) % 4


def sizes(n: int, pos: np.ndarray, *, itemsize: int) -> dict[str, int]:
    """Bytes of each encoding of a delta of ``n`` elements changed at ``pos``, header included."""
    return _sizes(n, int(pos.size), itemsize)


def _sizes(n: int, k: int, itemsize: int) -> dict[str, int]:
    return {"dense": HEADER.size + n * itemsize,
            "mask": HEADER.size + k * itemsize + -(-n // 8),
            "blocks": HEADER.size + k * itemsize + values_pad(k, itemsize) + 4 * -(-n // BLOCK)
            + 2 * k}


def choose(n: int, k: int, itemsize: int) -> tuple[int, int]:
    """``(kind, bytes)`` of the smallest encoding of a delta of ``n`` elements, ``k`` of them
    changed (ties: dense, then blocks, then mask)."""
    size = _sizes(n, k, itemsize)
    kind = min((DENSE, BLOCKS, MASK), key=lambda x: size[_NAMES[x]])
    return kind, size[_NAMES[kind]]


def expected_bytes(nbytes, itemsize, density: float) -> np.ndarray:
    """Expected bytes of the smallest encoding of deltas of messages of ``nbytes`` (an array, or
    one) with elements of ``itemsize`` bytes, where each element changed on its own with
    probability ``density``: a model for planning (:func:`wb.simulate`'s ``delta_density``), the
    encodings' sizes taken at their expected counts (alignment padding left out).

    Examples:
        >>> int(expected_bytes(1 << 20, 2, 0.0)), int(expected_bytes(1 << 20, 2, 1.0)) - (1 << 20)
        (64, 32)
        >>> round(float(expected_bytes(1 << 20, 2, 0.03)) / (1 << 20), 3)  # values and places
        0.06
    """
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"delta: density must be within [0, 1], got {density}")
    size = np.asarray(nbytes, np.float64)
    n = size / np.asarray(itemsize, np.float64)
    k = density * n
    return HEADER.size + np.minimum.reduce([size, k * itemsize + np.ceil(n / 8),
                                            k * (itemsize + 2) + 4 * np.ceil(n / BLOCK)])


def max_bytes(nbytes: int) -> int:
    """The most bytes a delta of an ``nbytes`` message takes (its dense form)."""
    return HEADER.size + int(nbytes)


def encode(base: np.ndarray, new: np.ndarray, *, itemsize: int) -> np.ndarray:
    """The delta that turns ``base`` into ``new`` (byte arrays of one size, elements of
    ``itemsize`` bytes), in its smallest encoding (ties: dense, then blocks).

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
    kind, nbytes = choose(n, k, itemsize)
    if kind == DENSE:
        return dense(whole(), itemsize=itemsize)
    out = np.empty(nbytes, np.uint8)
    HEADER.pack_into(out, 0, kind, itemsize, out.nbytes, n, k)
    at = HEADER.size
    out[at:at + k * itemsize] = np.ascontiguousarray(values).reshape(-1).view(np.uint8)
    at += k * itemsize
    if kind == MASK:
        bits = np.zeros(n, np.uint8)
        bits[pos] = 1
        out[at:] = np.packbits(bits, bitorder="little")
        return out
    pad, nb = values_pad(k, itemsize), -(-n // BLOCK)
    out[at:at + pad] = 0
    at += pad
    out[at:at + 4 * nb].view("<u4")[:] = np.bincount(pos >> 16, minlength=nb)
    out[at + 4 * nb:].view("<u2")[:] = pos & (BLOCK - 1)
    return out


def dense(new: np.ndarray, *, itemsize: int) -> np.ndarray:
    """``new`` (bytes, elements of ``itemsize`` bytes) as a delta of the :data:`DENSE` kind: what
    goes to a receiver that expects a delta where the sender has no base to make one against."""
    vals = _elements(new, itemsize, "new")
    out = np.empty(HEADER.size + vals.nbytes, np.uint8)
    HEADER.pack_into(out, 0, DENSE, itemsize, out.nbytes, vals.size, vals.size)
    out[HEADER.size:] = vals.view(np.uint8)
    return out


def header(delta: np.ndarray) -> tuple[int, int, int, int, int]:
    """``(kind, element bytes, the delta's bytes, elements, changed elements)`` of the delta at
    the start of ``delta`` (host bytes), checked.

    Raises:
        TransferError: shorter than :data:`HEADER` or malformed."""
    if delta.nbytes < HEADER.size:
        raise TransferError(f"delta of {delta.nbytes} bytes: shorter than its "
                            f"{HEADER.size}-byte header")
    kind, itemsize, size, n, k = HEADER.unpack_from(delta)
    if kind not in _NAMES or itemsize not in _WIDTHS or k > n or size < HEADER.size:
        raise TransferError(f"delta header malformed: kind {kind}, itemsize {itemsize}, "
                            f"{size} bytes, {k} changed of {n} elements")
    return kind, itemsize, size, n, k


def checked(head: np.ndarray, nbytes: int, target_nbytes: int) -> tuple[int, int, int, int]:
    """``(kind, element bytes, elements, changed elements)`` of a delta of ``nbytes`` whose first
    bytes are ``head`` (host bytes), for a message of ``target_nbytes``: every check of its sizes
    that applying it makes before reading its body (where the body is, host or device).

    Raises:
        TransferError: a malformed header, or sizes that disagree with it."""
    kind, itemsize, size, n, k = header(head)
    if size != nbytes:
        raise TransferError(f"delta header says {size:,} bytes; it has {nbytes:,}")
    if target_nbytes != n * itemsize:
        raise TransferError(f"delta of {n:,} elements of {itemsize} bytes for a message of "
                            f"{target_nbytes:,} bytes")
    tail = nbytes - HEADER.size - (n if kind == DENSE else k) * itemsize
    if kind == DENSE and tail:
        raise TransferError(f"dense delta of {nbytes:,} bytes for {n:,} elements")
    if tail < 0:
        raise TransferError(f"delta of {nbytes:,} bytes: too short for {k:,} values")
    if kind == MASK and tail != -(-n // 8):
        raise TransferError(f"delta mask of {tail} bytes for {n} elements")
    if kind == BLOCKS and tail != values_pad(k, itemsize) + 4 * -(-n // BLOCK) + 2 * k:
        raise TransferError(f"delta blocks of {tail} bytes for {k} changes of {n} elements")
    return kind, itemsize, n, k


def kind_of(delta: np.ndarray) -> str:
    """The encoding of ``delta``: ``"dense"``, ``"mask"`` or ``"blocks"``."""
    return _NAMES[header(np.asarray(delta).reshape(-1).view(np.uint8))[0]]


def size_of(buf: np.ndarray) -> int:
    """The bytes of the delta at the start of ``buf`` (a receive may be larger than what came).

    Raises:
        TransferError: its header is malformed or says more bytes than ``buf`` holds.
    """
    b = np.asarray(buf).reshape(-1).view(np.uint8)
    size = header(b)[2]
    if size > b.nbytes:
        raise TransferError(f"delta header says {size:,} bytes; {b.nbytes:,} came")
    return size


def _positions(kind: int, tail: np.ndarray, n: int, k: int, itemsize: int) -> np.ndarray:
    """The changed positions a MASK or BLOCKS tail holds (its size checked: :func:`checked`;
    ascending, checked against ``n`` and ``k``)."""
    if kind == MASK:
        if n % 8 and int(tail[-1]) >> (n % 8):
            raise TransferError(f"delta mask sets bits past its {n} elements")
        bits = np.unpackbits(tail, count=n, bitorder="little").view(bool)
        set_bits = int(np.count_nonzero(bits))
        if set_bits != k:
            raise TransferError(f"delta mask sets {set_bits} elements, its header says {k}")
        return np.flatnonzero(bits)  # then a fancy index: numpy's boolean one is 6x slower
    pad, nb = values_pad(k, itemsize), -(-n // BLOCK)
    counts = tail[pad:pad + 4 * nb].view("<u4")
    if int(counts.sum(dtype=np.int64)) != k:
        raise TransferError(f"delta blocks count {int(counts.sum(dtype=np.int64))} changes, "
                            f"its header says {k}")
    pos = np.repeat(np.arange(0, nb * BLOCK, BLOCK, dtype=np.int64), counts)
    pos += tail[pad + 4 * nb:].view("<u2")
    if k and (pos[-1] >= n or (k > 1 and not (pos[1:] > pos[:-1]).all())):
        raise TransferError("delta positions malformed: not ascending within the message")
    return pos


def changes(delta: np.ndarray, nbytes: int):
    """What ``delta`` writes into a message of ``nbytes`` bytes, checked, writing nothing (for a
    caller that writes the values where the message's elements lie: :func:`apply` does into one
    array).

    Returns:
        ``(positions, values)``: the changed elements' positions (ascending) and their values
        (unsigned integers of the delta's element width, a view of ``delta``), or ``(None,
        values)`` for a delta of the dense kind (every element's value).

    Raises:
        TransferError: ``delta`` is malformed or made for a message of another size or element
            width.
    """
    d = np.asarray(delta).reshape(-1).view(np.uint8)
    kind, itemsize, n, k = checked(d, d.nbytes, nbytes)
    at = HEADER.size
    if kind == DENSE:
        return None, d[at:].view(f"<u{itemsize}")
    vals = d[at:at + k * itemsize].view(f"<u{itemsize}")
    return _positions(kind, d[at + k * itemsize:], n, k, itemsize), vals


def apply(target: np.ndarray, delta: np.ndarray):
    """Turns ``target`` (a writable byte array holding the delta's base) into the new bytes, in
    place.

    Returns:
        ``(positions, values)`` it wrote, as :func:`changes` gives them.

    Raises:
        TransferError: ``delta`` is malformed or made for a message of another size or element
            width (nothing of ``target`` is written then).
    """
    t = target.reshape(-1).view(np.uint8)
    pos, vals = changes(delta, t.nbytes)
    if pos is None:
        t[:] = vals.view(np.uint8)
    else:
        t.view(vals.dtype)[pos] = vals
    return pos, vals
