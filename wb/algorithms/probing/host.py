"""The probe's per-element work on the host with numpy: :class:`HostArrays`, the default
:class:`~wb.algorithms.probing.ProbeArrays`, with its feeds, memory pool and buffer reads.

Cost: no per-element 64-bit arithmetic on the checkpoint side. A checkpoint tensor is filled in its
own dtype by broadcasts and row gathers from small per-base tables (see :class:`_Feed`: ids are
rows of ``B``; a pass's value depends on an element's row through one index and on its column
through one table row), into memory reused from tensors the load function has dropped
(:class:`_Pool`). Buffers are checked in their own dtype: 1- and 2-byte floats through a table
over their bit patterns, wider ones with same-dtype arithmetic; 64-bit ids exist only for the
rank's own elements, one chunk of a buffer at a time, when its map is encoded.

Memory, per element of the rank's own buffers (what the load function returns): kept across
passes, ``1 + (passes + 1) * w`` bytes (the written mask and one digit per pass, ``w`` = 1 byte at
base <= 256, 2 at <= 65536, 4 above: 6 bytes for bf16 up to 2**32 ids); transient, for one buffer
at a time, at most :data:`~wb.algorithms.probing.TRANSIENT_BYTES_PER_ELEMENT` more while it is
read or encoded. On the checkpoint side: the tensors the load function holds at once (one, if it
reads them one at a time) plus the largest one, kept for reuse, and ``O(elements / B)`` row indices
in chunks of 16 Ki rows.
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Any

import numpy as np

from wb.algorithms.probing.idcode import (TABLE_MAX, check_digit, check_table, decode,
                                          digit_dtype, pass_digits, row_index, segments)
from wb.algorithms.probing.seam import Bad, chunks
from wb.data.dtypes import dtype_info
from wb.data.sourcemap import Runs, run_marks, runs_from_marks
from wb.errors import ProbeError

__all__ = ["HostArrays"]


class _Feed:
    """Writes one pass's values of a run of ids into a numpy array, row by row of the id space.

    Ids are seen as a 2-D grid of rows of ``B`` ids (``row = id // B``, ``col = id % B``); in every
    pass an element's value depends on its row through one small index and on its column through
    one row of a table: pass 0 is the table row ``digit + 1`` repeated, pass ``k >= 1`` a constant
    per row, the check pass row ``G(row)`` of a ``(B, B)`` table. So a checkpoint tensor is filled
    by broadcasts and row gathers in its own dtype, with ``O(rows)`` index arithmetic.
    """

    def __init__(self, base: int, pass_index: int | None, dtype: np.dtype):
        self.base, self.k, self.dtype = base, pass_index, np.dtype(dtype)
        self.small = base <= TABLE_MAX
        if self.small:
            digits = np.arange(base, dtype=np.int64)
            self.values = (digits + 1).astype(np.float32).astype(self.dtype)  # (B,) digit + 1
            if pass_index is None:
                self.check = self.values[check_table(base)]  # (B, B)

    def fill(self, out: np.ndarray, first_id: int) -> None:
        """Fills the flat array ``out`` with the values of ids ``first_id ..``."""
        B, n = self.base, out.size
        if not self.small:  # wide bases (float32 at 2**24): chunked id arithmetic
            step = 1 << 20
            for a in range(0, n, step):
                ids = np.arange(first_id + a, first_id + min(n, a + step), dtype=np.int64)
                out[a:a + ids.size] = (pass_digits(ids, self.k, B) + 1).astype(
                    np.float64 if B > 2**24 else np.float32)
            return
        for start, m, w, row0, col0 in segments(first_id, n, B):
            out2d = out[start:start + m * w].reshape(m, w)
            idx = row_index(self.k, row0, m, B)
            if idx is None:
                out2d[...] = self.values[col0:col0 + w]
            elif self.k is not None:
                out2d[...] = self.values[idx][:, None]
            elif w == B:
                # mode="clip": with the default "raise" numpy buffers ``out`` (a tensor's copy)
                np.take(self.check, idx, axis=0, out=out2d, mode="clip")
            else:
                out2d[...] = self.check[idx, col0:col0 + w]


class _Pool:
    """Memory for checkpoint tensors, reused once nothing but the pool refers to it.

    A fresh large array costs a page fault per 4 KiB on first write (about as much as filling it
    again, several times over a pass); a load function that drops each tensor after copying it
    frees the memory for the next one, so a pass touches fresh pages only for its largest tensor.
    Memory still reachable from the load function (it kept the array, or a view of it) is never
    reused: reuse is decided by reference count, so the pool holds at most what the load holds at
    once, plus the largest tensor.
    """

    _MIN = 1 << 20  # smaller arrays come from the heap cheaply

    def __init__(self):
        self._raw: list[np.ndarray] = []  # (nbytes,) uint8 each

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self._MIN:
            return np.empty(shape, dtype)
        # 3 references: the list, the loop variable and getrefcount's argument; more means a
        # view (an array handed out earlier, a tensor made from it) is still alive
        free = [r for r in self._raw if r.size >= nbytes and sys.getrefcount(r) <= 3]
        if free:
            raw = min(free, key=lambda r: r.size)
        else:
            raw = np.empty(nbytes, np.uint8)
            self._raw.append(raw)
        return raw[:nbytes].view(dtype).reshape(shape)


class HostArrays:
    """:class:`~wb.algorithms.probing.ProbeArrays` on the host with numpy: checkpoint tensors
    from a :class:`_Pool`, buffers checked in their own dtype (:func:`_read`)."""

    def __init__(self):
        self._pool = _Pool()
        self._feeds: dict[tuple, _Feed] = {}

    def feed(self, spec, name, base, pass_index):
        dtype = dtype_info(spec.dtype(name)).numpy
        feed = self._feeds.get((dtype.name, base, pass_index))
        if feed is None:
            feed = self._feeds[(dtype.name, base, pass_index)] = _Feed(base, pass_index, dtype)
        out = self._pool.empty(spec.shape(name), dtype)
        feed.fill(out.reshape(-1), spec.offset(name))
        return out

    def buffer(self, name, arr):
        return _as_numpy(name, arr)

    def dtype_name(self, a):
        return dtype_info(a.dtype).name if _dtype_known(a.dtype) else None

    def read(self, a, base):
        w, d, bad = _read(a, base, digit_dtype(base))
        return w, d, bad is None

    def first_bad(self, a, base):
        return _read(a, base, digit_dtype(base))[2]

    def same(self, a, b):
        return np.array_equal(a, b)

    def first_difference(self, a, b):
        return int(np.argmax(a != b))

    def all_true(self, oks):
        return all(oks)

    def runs(self, written, digits, base, numel, cols):
        parts = []
        for lo, hi in chunks(written.size, cols):
            ids, bad, in_check = _decode(written[lo:hi], [d[lo:hi] for d in digits], base, numel)
            if bad is not None:
                return None, bad._replace(index=bad.index + lo), in_check
            parts.append(runs_from_marks(run_marks(ids, cols), hi - lo, cols, lo // cols))
        return Runs.concat(parts), None, False


def _decode(w, digits, base, numel) -> tuple[np.ndarray, Bad | None, bool]:
    """``(ids, bad, in_check_pass)`` of one chunk: :meth:`ProbeArrays.runs`'s checks, with numpy."""
    *id_digits, check = digits
    ids = decode(id_digits, base)
    ids[~w] = 0  # unwritten elements hold no digits: keep them in range for the check
    if (ids >= numel).any():
        i = int(np.argmax(ids >= numel))
        return ids, Bad(i, f"decodes to id {ids[i]} >= numel {numel}"), False
    wrong = w & (check != check_digit(ids, base))  # uint8 vs int64: cast in the loop
    if wrong.any():
        return ids, Bad(int(np.argmax(wrong)),
                        "disagrees between the id passes and the check pass"), True
    ids[~w] = -1
    return ids, None, False


_UNWRITTEN = 0xFFFE  # table entries of the bit patterns of +-0 and of everything not a digit
_NOT_DIGIT = 0xFFFF


@functools.lru_cache(maxsize=16)
def _digit_table(dtype: np.dtype, base: int) -> np.ndarray:
    """``(2**bits,) uint16``: for every bit pattern of a 1- or 2-byte float dtype, the digit it
    carries (value - 1), :data:`_UNWRITTEN` for +-0, :data:`_NOT_DIGIT` for anything else."""
    raw = np.arange(2 ** (8 * dtype.itemsize), dtype=np.uint32).astype(
        np.uint8 if dtype.itemsize == 1 else np.uint16)
    with np.errstate(all="ignore"):  # NaN and inf patterns are converted on purpose
        v = raw.view(dtype).astype(np.float64)
        digit = (v >= 1) & (v <= base) & (v == np.round(v))
    out = np.full(raw.size, _NOT_DIGIT, dtype=np.uint16)
    out[digit] = v[digit] - 1
    out[v == 0] = _UNWRITTEN
    return out


def _read(a: np.ndarray, base: int, digit_dtype) -> tuple[np.ndarray, np.ndarray, Bad | None]:
    """:meth:`ProbeArrays.read` with numpy, in the buffer's own dtype: a table over the bit
    patterns of 1- and 2-byte floats (so no element is widened), same-dtype arithmetic else."""
    flat = np.ascontiguousarray(a).reshape(-1)
    dt = flat.dtype
    if dt.itemsize <= 2 and base < _UNWRITTEN and _dtype_known(dt) and dt.kind not in "iub":
        table, bits = _digit_table(dt, base), flat.view(np.uint8 if dt.itemsize == 1 else np.uint16)
        e = np.empty(flat.size, np.uint16)
        for lo in range(0, flat.size, 1 << 20):  # take() widens indices to intp: in chunks
            np.take(table, bits[lo:lo + (1 << 20)], out=e[lo:lo + (1 << 20)], mode="clip")
        if e.size and e.max() == _NOT_DIGIT:
            i = int(np.argmax(e == _NOT_DIGIT))
            return e, e, Bad(i, f"reads {float(flat[i])}, not an integer digit 0..{base}")
        return e != _UNWRITTEN, e.astype(digit_dtype), None
    if dt.kind in "iub":
        ok = (flat >= 0) & (flat <= base)
    else:
        v = flat if dt.kind == "f" else flat.astype(np.float64)  # unknown kinds: widened
        with np.errstate(invalid="ignore"):
            ok = (v >= 0) & (v <= base) & (v == np.rint(v))
        flat = v
    if not ok.all():
        i = int(np.argmax(~ok))
        return ok, ok, Bad(i, f"reads {float(flat[i])}, not an integer digit 0..{base}")
    w = flat != 0
    with np.errstate(invalid="ignore", over="ignore"):
        return w, (flat.astype(np.int64) - 1).astype(digit_dtype), None


def _dtype_known(dt: np.dtype) -> bool:
    try:
        dtype_info(dt)
    except Exception:  # noqa: BLE001 - unknown dtypes are simply not used to narrow the base
        return False
    return True


def _as_numpy(name: str, arr: Any) -> np.ndarray:
    try:
        return np.asarray(arr)
    except Exception as e:  # noqa: BLE001 - any conversion failure is the caller's type problem
        raise ProbeError(
            f"buffer `{name}` returned by the load function is a {type(arr).__name__} that numpy "
            f"cannot read ({e}); return numpy-convertible arrays (the wb_torch / wb_jax shims do)"
        ) from e
