"""The probe's id encoding: the contract every :class:`~wb.algorithms.probing.ProbeArrays` keeps.

Element ``j`` (flat, C order) of checkpoint tensor ``name`` has id ``i = spec.offset(name) + j``.
With ``B`` the digit base (by default :func:`digit_base` of every dtype on the path) and
``P = n_passes(spec.numel, B)``, a probe runs ``P`` id passes and one check pass. In id pass ``k`` (``0 <= k < P``) that element carries the value
``i // B**k % B + 1``; in the check pass ``check_digit(i) + 1``, where ::

    check_digit(i) = (i % B * COL_MUL + row_hash(i // B)) % B
    row_hash(r)    = ((r * ROW_MUL) % 2**64 >> ROW_SHIFT) % B

A value ``0`` means "never written": a buffer element that reads 0 in every pass maps to ``-1``.
A device implementation must produce (feeding) and expect (decoding) exactly these values.

Ids are seen as rows of ``B`` (``row = i // B``, ``col = i % B``): in every pass an element's value
depends on its row through one index (:func:`row_index`) and on its column through one row of a
small table (:func:`check_table` for the check pass), so a tensor is filled by broadcasts and row
gathers (:func:`segments` cuts a run of ids into rows). The column term ``col * COL_MUL % B`` is a
permutation of the digits (``COL_MUL`` is a prime above every base, so coprime to it), and
``row_hash`` a Fibonacci hash of the row: ids that differ in their lowest digit always get different
check digits, others agree with probability about ``1/B``, as a hash of the whole id would.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from wb.data.dtypes import dtype_info

__all__ = ["digit_base", "n_passes", "digit_dtype", "COL_MUL", "ROW_MUL", "ROW_SHIFT", "TABLE_MAX",
           "row_hash", "check_digit", "pass_digits", "segments", "row_index", "check_table",
           "decode"]

#: The column multiplier of the check digit: a prime above every base.
COL_MUL = 2654435761
#: The row hash's multiplier (``2**64`` over the golden ratio); products wrap modulo ``2**64``.
ROW_MUL = 0x9E3779B97F4A7C15
#: The row hash keeps the bits of the wrapped product from this one up.
ROW_SHIFT = 24
#: Bases up to this are fed from per-base tables (``(B, B)`` for the check pass: 8 MiB at 2048);
#: wider ones by arithmetic on ids. A choice of the implementations, not part of the encoding.
TABLE_MAX = 2048

_ROW_MUL = np.uint64(ROW_MUL)
_ROW_SHIFT = np.uint64(ROW_SHIFT)


def digit_base(dtypes) -> int:
    """The digit base every dtype in ``dtypes`` carries exactly (values ``1 .. base``).

    Examples:
        >>> digit_base(["bfloat16", "float32"]), digit_base(["float8_e4m3fn"])
        (256, 16)
    """
    return int(min(min(dtype_info(d).exact_int_max for d in dtypes), 2**24))


def n_passes(numel: int, base: int) -> int:
    """The id passes of ``numel`` ids: the fewest ``P >= 1`` with ``base**P >= numel``.

    Examples:
        >>> n_passes(1, 256), n_passes(256, 256), n_passes(257, 256)
        (1, 1, 2)
    """
    passes, reach = 1, base
    while reach < numel:
        passes, reach = passes + 1, reach * base
    return passes


def digit_dtype(base: int) -> np.dtype:
    """The narrowest unsigned dtype that holds a digit ``0 .. base-1``."""
    return np.dtype(np.uint8 if base <= 256 else np.uint16 if base <= 2**16 else np.uint32)


def row_hash(rows: np.ndarray, base: int) -> np.ndarray:
    """``row_hash`` of the module docstring: int ``rows >= 0`` -> int64 ``0 .. base-1``.

    Examples:
        >>> row_hash(np.arange(4), 256)
        array([  0, 127, 254, 125])
    """
    with np.errstate(over="ignore"):  # the hash wraps modulo 2**64 by design
        h = (np.asarray(rows).astype(np.uint64) * _ROW_MUL) >> _ROW_SHIFT
    return (h % np.uint64(base)).astype(np.int64)


def check_digit(ids: np.ndarray, base: int) -> np.ndarray:
    """The check pass's digit of each id (int64 ``ids`` >= 0 -> int64 digits ``0 .. base-1``).

    Examples:
        >>> check_digit(np.array([0, 1, 256, 257]), 256)
        array([  0, 177, 127,  48])
    """
    if base & (base - 1) == 0:  # every default base: shifts and masks, no 64-bit division
        shift, mask = np.uint64(base.bit_length() - 1), np.uint64(base - 1)
        u = ids.view(np.uint64)
        with np.errstate(over="ignore"):
            h = u >> shift
            h *= _ROW_MUL
        h >>= _ROW_SHIFT
        col = u & mask
        col *= np.uint64(COL_MUL % base)
        h += col  # may wrap modulo 2**64, which base divides
        h &= mask
        return h.view(np.int64)
    col, row = ids % base, ids // base
    return (col * (COL_MUL % base) % base + row_hash(row, base)) % base


def pass_digits(ids: np.ndarray, pass_index: int | None, base: int) -> np.ndarray:
    """The digit each id carries in a pass (``None``: the check pass), int64 ``ids`` -> int64."""
    if pass_index is None:
        return check_digit(ids, base)
    return ids // base ** pass_index % base


def segments(first_id: int, n: int, base: int) -> Iterator[tuple[int, int, int, int, int]]:
    """How ids ``first_id .. first_id + n`` fall on rows of ``base`` ids: ``(start, rows, width,
    row0, col0)`` runs, each ``rows x width`` elements from flat position ``start`` (at most 16 Ki
    rows each, so per-row index arrays stay small).

    Examples:
        >>> list(segments(5, 20, 8))  # 3 ids ending row 0, rows 1 and 2, 1 id of row 3
        [(0, 1, 3, 0, 5), (3, 2, 8, 1, 0), (19, 1, 1, 3, 0)]
    """
    B = base
    r0, c0 = divmod(first_id, B)
    head = min(n, (B - c0) % B)  # the ids before the first full row
    if head:
        yield 0, 1, head, r0, c0
    full = (n - head) // B
    first_full = r0 + (head > 0)
    for a in range(0, full, 1 << 14):
        m = min(full - a, 1 << 14)
        yield head + a * B, m, B, first_full + a, 0
    tail = n - head - full * B
    if tail:
        yield n - tail, 1, tail, first_full + full, 0


def row_index(pass_index: int | None, row0: int, m: int, base: int) -> np.ndarray | None:
    """``(m,) int64``: per row of ids, the digit (pass ``k >= 1``) or the row of
    :func:`check_table` (check pass: :func:`row_hash`) of rows ``row0 .. row0 + m``; ``None`` for
    pass 0 (its values depend on the column only)."""
    if pass_index == 0:
        return None
    rows = np.arange(row0, row0 + m, dtype=np.int64)
    if pass_index is None:
        return row_hash(rows, base)
    return rows // base ** (pass_index - 1) % base


def check_table(base: int) -> np.ndarray:
    """``(base, base) int64``: the check digit of column ``c`` in a row of hash ``g`` at
    ``[g, c]``."""
    digits = np.arange(base, dtype=np.int64)
    return (digits[None, :] * (COL_MUL % base) + digits[:, None]) % base


def decode(digits: Sequence[np.ndarray], base: int) -> np.ndarray:
    """``(n,) int64``: the ids whose id-pass digits are ``digits`` (one ``(n,)`` integer array per
    id pass, pass 0 first; at least one).

    Examples:
        >>> decode([np.array([1, 255]), np.array([2, 0])], 256)
        array([513, 255])
    """
    if base == 256 and len(digits) <= 8:
        # bytes of a little-endian int64: the digits are its bytes, no arithmetic
        raw = np.zeros((digits[0].size, 8), dtype=np.uint8)
        for j, d in enumerate(digits):
            raw[:, j] = d
        return raw.view("<i8").reshape(-1).astype(np.int64, copy=False)
    ids = np.zeros(digits[0].shape, dtype=np.int64)
    scale = 1
    for d in digits:
        ids += d.astype(np.int64) * scale
        scale *= base
    return ids
