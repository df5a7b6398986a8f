"""Probing: run a framework's own load function on tensors whose values encode element ids.

Long because the pass loop, its numpy arrays and the id encoding a device implementation shares
(:class:`ProbeArrays`) are one algorithm whose invariants must be read together.

Each pass feeds every checkpoint tensor with one base-``B`` digit of each element's id (as the value
``digit + 1``; ``0`` is reserved for "never written"), then reads every buffer the load function
produced. ``B`` is the largest integer count every dtype on the path holds exactly (bf16: 256,
fp16: 2048, fp32: 2**24, fp8 e4m3: 16), so ``passes = ceil(log_B(numel))`` plus one *check pass*
whose value is a hash digit of the id. A load function that is pure data movement reproduces the
digits; one that scales, adds or quantises produces non-integers, out-of-range values, elements
written in some passes but not others, or ids whose hash disagrees with the check pass: all raise
:class:`wb.ProbeError`, never a wrong map.

Cost (issue 13): no per-element 64-bit arithmetic on the checkpoint side. A checkpoint tensor is
filled in its own dtype by broadcasts and row gathers from small per-base tables (see
:class:`_Feed`: ids are rows of ``B``; a pass's value depends on an element's row through one
index and on its column through one table row), into memory reused from tensors the load function
has dropped (:class:`_Pool`). Buffers are checked in their own dtype: 1- and 2-byte floats through
a table over their bit patterns, wider ones with same-dtype arithmetic; 64-bit ids exist only for
the rank's own elements, one buffer at a time, when its map is encoded.

Memory, per element of the rank's own buffers (what the load function returns): kept across
passes, ``1 + (passes + 1) * w`` bytes (the written mask and one digit per pass, ``w`` = 1 byte at
base <= 256, 2 at <= 65536, 4 above: 6 bytes for bf16 up to 2**32 ids); transient, for one buffer
at a time, at most :data:`TRANSIENT_BYTES_PER_ELEMENT` more while it is read or encoded. On the
checkpoint side: the tensors the load function holds at once (one, if it reads them one at a time)
plus the largest one, kept for reuse, and ``O(elements / B)`` row indices in chunks of 16 Ki rows.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, Protocol

import numpy as np

from wb.data.dtypes import dtype_info
from wb.data.mapcache import BufferInfo, MapCache, cache_file, fingerprint
from wb.data.sourcemap import Runs, SourceMap, run_marks, runs_from_marks
from wb.errors import ProbeError, SpecError
from wb.data.spec import CheckpointSpec

__all__ = ["probe", "digit_base", "ProbeCheckpoint", "ProbeArrays", "HostArrays", "Bad",
           "segments", "row_index", "check_table", "pass_digits", "check_digit", "TABLE_MAX",
           "COL_MUL", "TRANSIENT_BYTES_PER_ELEMENT", "DECODE_CHUNK", "digit_dtype", "chunks"]

log = logging.getLogger(__name__)

def digit_base(dtypes) -> int:
    """The digit base every dtype in ``dtypes`` carries exactly (values ``1 .. base``).

    Examples:
        >>> digit_base(["bfloat16", "float32"]), digit_base(["float8_e4m3fn"])
        (256, 16)
    """
    return int(min(min(dtype_info(d).exact_int_max for d in dtypes), 2**24))


def _n_passes(numel: int, base: int) -> int:
    passes, reach = 1, base
    while reach < numel:
        passes, reach = passes + 1, reach * base
    return passes


# The check digit of id ``i`` is ``(T(i % B) + G(i // B)) % B``: ``T(c) = c * COL_MUL % B`` is a
# permutation of the digits (the multiplier is a prime above every base, so coprime to it) and
# ``G`` a Fibonacci hash of the id's row ``i // B``. Ids that differ in their lowest digit always
# get different check digits, others agree with probability ~1/B, as a hash of the whole id would;
# and a checkpoint tensor's check values are a (rows, B) gather from a small (B, B) table, as cheap
# to produce as a digit pass (no per-element 64-bit arithmetic).
COL_MUL = 2654435761
#: Bound on the transient bytes per element of the one buffer being read or encoded (int64 ids,
#: their byte image, the check digits and two masks); a test measures it with tracemalloc.
TRANSIENT_BYTES_PER_ELEMENT = 40
_ROW_MUL = np.uint64(0x9E3779B97F4A7C15)
#: Elements of a buffer decoded at once (whole rows): bounds the transient memory of decoding.
DECODE_CHUNK = 1 << 22
#: Bases up to this are fed from per-base tables (``(B, B)`` for the check pass: 8 MiB at 2048).
TABLE_MAX = 2048


def _row_hash(rows: np.ndarray, base: int) -> np.ndarray:
    with np.errstate(over="ignore"):  # the hash wraps modulo 2**64 by design
        h = (rows.astype(np.uint64) * _ROW_MUL) >> np.uint64(24)
    return (h % np.uint64(base)).astype(np.int64)


def check_digit(ids: np.ndarray, base: int) -> np.ndarray:
    """The check pass's digit of each id (int64 ``ids`` >= 0 -> int64 digits ``0 .. base-1``)."""
    if base & (base - 1) == 0:  # every default base: shifts and masks, no 64-bit division
        shift, mask = np.uint64(base.bit_length() - 1), np.uint64(base - 1)
        u = ids.view(np.uint64)
        with np.errstate(over="ignore"):
            h = u >> shift
            h *= _ROW_MUL
        h >>= np.uint64(24)
        col = u & mask
        col *= np.uint64(COL_MUL % base)
        h += col
        h &= mask
        return h.view(np.int64)
    col, row = ids % base, ids // base
    return (col * (COL_MUL % base) % base + _row_hash(row, base)) % base


def digit_dtype(base: int) -> np.dtype:
    """The narrowest unsigned dtype that holds a digit ``0 .. base-1``."""
    return np.dtype(np.uint8 if base <= 256 else np.uint16 if base <= 2**16 else np.uint32)


def segments(first_id: int, n: int, base: int) -> Iterator[tuple[int, int, int, int, int]]:
    """How ids ``first_id .. first_id + n`` fall on rows of ``base`` ids: ``(start, rows, width,
    row0, col0)`` runs, each ``rows x width`` elements from flat position ``start`` (at most 16 Ki
    rows each, so per-row index arrays stay small)."""
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
    :func:`check_table` (check pass) of rows ``row0 .. row0 + m``; ``None`` for pass 0 (its values
    depend on the column only)."""
    if pass_index == 0:
        return None
    rows = np.arange(row0, row0 + m, dtype=np.int64)
    if pass_index is None:
        return _row_hash(rows, base)
    return rows // base ** (pass_index - 1) % base


def check_table(base: int) -> np.ndarray:
    """``(base, base) int64``: the check digit of column ``c`` in a row of hash ``g`` at
    ``[g, c]``."""
    digits = np.arange(base, dtype=np.int64)
    return (digits[None, :] * (COL_MUL % base) + digits[:, None]) % base


def pass_digits(ids: np.ndarray, pass_index: int | None, base: int) -> np.ndarray:
    """The digit each id carries in a pass (int64 ``ids`` -> int64), by arithmetic."""
    if pass_index is None:
        return check_digit(ids, base)
    return ids // base ** pass_index % base


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


class ProbeCheckpoint(Mapping):
    """The checkpoint of one probing pass: ``{name: array of digit values}``, built on access.

    Arrays are what ``arrays.feed`` makes: by default numpy arrays in each tensor's spec dtype
    (``ml_dtypes`` for bf16/fp8), filled without a per-element id array (see :class:`_Feed`). The
    name of the tensor accessed last is kept in :attr:`last`, so an error inside the load function
    can say which tensor it was being fed.
    """

    def __init__(self, spec: CheckpointSpec, base: int, pass_index: int | None, *,
                 arrays: ProbeArrays | None = None):
        self.spec, self.base, self.pass_index = spec, base, pass_index  # None: the check pass
        self.last: str | None = None
        self._arrays = arrays or HostArrays()

    def __getitem__(self, name: str) -> Any:
        self.last = name
        return self._arrays.feed(self.spec, name, self.base, self.pass_index)

    def __iter__(self) -> Iterator[str]:
        return iter(self.spec.names)

    def __contains__(self, name: object) -> bool:  # Mapping's default would build the tensor
        return name in self.spec

    def __len__(self) -> int:
        return len(self.spec)


class Bad(NamedTuple):
    """The first element of a buffer that breaks a rule: its flat index and what it did."""

    index: int
    what: str  # e.g. "reads 1.5, not an integer digit 0..256"


class ProbeArrays(Protocol):
    """Where a probe's per-element work runs: :class:`HostArrays` (numpy) by default; a shim
    passes its own to feed, check and decode on the device its tensors live on. Buffers and
    masks are the implementation's own arrays; only ids come back as numpy."""

    def feed(self, spec: CheckpointSpec, name: str, base: int, pass_index: int | None) -> Any:
        """Checkpoint tensor ``name`` of one pass (``None``: the check pass), spec shape and
        dtype, each element ``digit + 1``."""

    def buffer(self, name: str, arr: Any) -> Any:
        """A buffer the load returned, as :meth:`read` takes it (``.shape``, ``.dtype``);
        raises ProbeError if it cannot be read."""

    def dtype_name(self, a: Any) -> str | None:
        """The canonical dtype name of a buffer, ``None`` when wb does not know it."""

    def begin(self, spec: CheckpointSpec, base: int, passes: int) -> None:
        """Optional: told the spec and base before pass 1 feeds anything (``passes`` id passes
        follow, then the check pass), e.g. to start compiling per-shape kernels in the
        background while the load function runs."""

    def prepare(self, buffers: Mapping[str, Any], base: int, passes: int) -> None:
        """Optional: told every buffer of pass 1 before any is read (``passes`` id passes
        follow, then the check pass), e.g. to compile per-shape kernels ahead, in parallel."""

    def read(self, a: Any, base: int) -> tuple[Any, Any, Any]:
        """``(written, digits, ok)``: flat mask of written elements, their digits (any integer
        type), and whether every element is an integer ``0 .. base``: anything :meth:`all_true`
        takes (a device scalar, so a pass needs no synchronisation per buffer)."""

    def first_bad(self, a: Any, base: int) -> Bad:
        """The first element of ``a`` that is not an integer ``0 .. base`` (after ``read``'s
        ``ok`` was false)."""

    def same(self, a: Any, b: Any) -> Any:
        """Whether two masks are equal, as :meth:`all_true` takes it."""

    def first_difference(self, a: Any, b: Any) -> int:
        """The first flat index where two masks differ (after :meth:`same` was false)."""

    def all_true(self, oks: list) -> bool:
        """Whether every ``ok`` of :meth:`read` and :meth:`same` is true: one wait per pass."""

    def runs(self, written: Any, digits: list, base: int, numel: int, cols: int
             ) -> tuple[Runs | None, Bad | None, bool]:
        """``(runs, bad, in_check_pass)``: the maximal affine runs (:class:`wb.data.sourcemap.Runs`,
        numpy, O(runs)) of the ids decoded from the per-pass digits (the last one the check
        pass's; unwritten elements are ``-1``) of a buffer viewed as rows of ``cols``; or the
        first element whose id is ``>= numel`` (``in_check_pass`` False) or disagrees with its
        check digit (True). Ids are decoded a chunk of rows at a time (see
        :data:`DECODE_CHUNK`); only the runs leave the device."""


class HostArrays:
    """:class:`ProbeArrays` on the host with numpy: checkpoint tensors from a :class:`_Pool`,
    buffers checked in their own dtype (:func:`_read`)."""

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


def chunks(n: int, cols: int, chunk: int | None = None) -> Iterator[tuple[int, int]]:
    """``(lo, hi)`` flat ranges of whole rows of ``cols`` covering ``n`` elements, each about
    ``chunk`` (default :data:`DECODE_CHUNK`) elements or one row."""
    step = max(1, (chunk or DECODE_CHUNK) // max(cols, 1)) * cols
    for lo in range(0, n, step):
        yield lo, min(n, lo + step)


def _as_numpy(name: str, arr: Any) -> np.ndarray:
    try:
        return np.asarray(arr)
    except Exception as e:  # noqa: BLE001 - any conversion failure is the caller's type problem
        raise ProbeError(
            f"buffer `{name}` returned by the load function is a {type(arr).__name__} that numpy "
            f"cannot read ({e}); return numpy-convertible arrays (the wb_torch / wb_jax shims do)"
        ) from e


def _bad(name: str, shape, flat: int, what: str, pass_label: str) -> ProbeError:
    where = tuple(int(i) for i in np.unravel_index(flat, shape)) if shape else ()
    return ProbeError(
        f"buffer `{name}` element {where} {what} in {pass_label}: the load function is not pure data "
        f"movement (it scales, adds, casts lossily or quantises); probe a load path that only "
        f"copies, slices, concatenates, transposes or reshapes")


def probe(spec: CheckpointSpec, load: Callable[[Mapping[str, np.ndarray]], Mapping[str, Any]], *,
          base: int | None = None, progress: bool = False,
          cache: str | os.PathLike | None = None, key: Any = None,
          buffers: Mapping[str, BufferInfo] | None = None,
          arrays: ProbeArrays | None = None) -> dict[str, SourceMap]:
    """Discovers the source map of every buffer ``load`` produces from a checkpoint.

    Args:
        spec: the checkpoint's tensors.
        load: the framework's own load function: takes ``{name: array}`` (a lazy mapping that
            builds each checkpoint tensor when accessed) and returns ``{buffer name: array}``
            (anything ``np.asarray`` reads). Elements a pass does not write must read ``0``: start
            from zeros (JAX padding) or pre-fill in-place buffers with zeros (the PyTorch shim does).
        base: digit base; default: the largest that every checkpoint and buffer dtype holds exactly
            (found from the first pass; probing restarts once if a buffer is narrower).
        progress: show a progress bar (rich) over passes.
        cache: a file (``.npz``) or a directory (one file per ``key``) to keep the maps in. When it
            holds maps with the fingerprint of ``spec``, ``buffers`` and ``key``, they are returned
            and ``load`` is never called; otherwise (missing, stale, unreadable: logged) the probe
            runs and overwrites it. See :mod:`wb.data.mapcache`.
        key: what tells this rank's maps from another's (JSON-able: ``{"rank": 3, "tp": 8}``);
            part of the fingerprint.
        buffers: ``{name: (shape, dtype, device kind)}`` of the buffers ``load`` writes, when the
            caller knows them without running it (the shims do); part of the fingerprint, so a
            changed model re-probes.
        arrays: where the per-element work runs (:class:`ProbeArrays`); default numpy on the
            host (:class:`HostArrays`). ``wb_torch.probe`` passes one that works on the
            parameters' device.

    Returns:
        ``{buffer name: SourceMap}``; elements never written map to ``-1``.

    Raises:
        ProbeError: ``load`` raised (the message names the checkpoint tensor it was being fed),
            returned something unusable, wrote no checkpoint id into any buffer, or is not pure
            data movement (names the buffer and the first bad element).
        SpecError: ``key`` is not JSON-able.

    Examples:
        >>> spec = CheckpointSpec({"w": ((4, 6), "bfloat16")})
        >>> maps = probe(spec, lambda ck: {"shard": np.asarray(ck["w"])[:, 3:].T})
        >>> maps["shard"].to_indices()[:, :2]
        array([[ 3,  9],
               [ 4, 10],
               [ 5, 11]])
    """
    if len(spec) == 0 or spec.numel == 0:
        raise ProbeError("the checkpoint spec is empty: nothing to probe")
    if cache is None:
        return _probe(spec, load, base, progress, arrays)
    fp = fingerprint(spec, buffers=buffers, key=key)
    path = cache_file(cache, key)
    cached = _read_cache(path, fp)
    if cached is not None:
        return cached
    maps = _probe(spec, load, base, progress, arrays)
    MapCache(fp, maps).save(path)
    log.info("probe: saved %d maps to %s", len(maps), path)
    return maps


def _read_cache(path, fp: str) -> dict[str, SourceMap] | None:
    """The maps saved at ``path`` if their fingerprint is ``fp``; ``None`` (logged) otherwise."""
    try:
        saved = MapCache.load(path)
    except FileNotFoundError:
        log.info("probe: no map cache at %s; probing", path)
        return None
    except SpecError as e:
        log.warning("probe: %s; probing again", e)
        return None
    if saved.fingerprint != fp:
        log.warning("probe: the map cache %s was probed from another spec, model or key "
                    "(fingerprint %s..., now %s...); probing again and overwriting it", path,
                    saved.fingerprint[:12], fp[:12])
        return None
    log.info("probe: %d maps from the cache %s", len(saved.maps), path)
    return dict(saved.maps)


def _probe(spec, load, base, progress, arrays) -> dict[str, SourceMap]:
    chosen = base or digit_base(set(spec.dtypes))
    for attempt in range(2):
        result = _probe_with_base(spec, load, chosen, progress, base is None and attempt == 0,
                                  arrays or HostArrays())
        if isinstance(result, dict):
            _check_found_ids(result)
            return result
        log.info("restarting probe with digit base %d: %s", result[0], result[1])
        chosen = result[0]
    raise AssertionError("unreachable: the second attempt never narrows")


def _check_found_ids(maps: Mapping[str, SourceMap]) -> None:
    # Maps that are all -1 are what a load writing somewhere else produces (a loader that
    # replaces the Parameter objects read back here): never a useful result, so never silent.
    if not any(m.n_ids for m in maps.values()):
        names = sorted(maps)
        raise ProbeError(
            f"the load function wrote no checkpoint id into any of the {len(names)} buffers it "
            f"returned ({names[:5]}{'...' if len(names) > 5 else ''}): return the arrays the load "
            f"writes (a loader that replaces tensors must be read after it ran), and check that "
            f"the spec's names are the ones the load function expects")


def _call(load, ck: ProbeCheckpoint, label: str) -> Mapping[str, Any]:
    try:
        out = load(ck)
    except ProbeError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with what it was fed
        fed = (f"while being fed checkpoint tensor `{ck.last}` (shape {ck.spec.shape(ck.last)}, "
               f"{ck.spec.dtype(ck.last)})" if ck.last else "before reading any checkpoint tensor")
        raise ProbeError(f"the load function raised {type(e).__name__}: {e} {fed}, in {label}") from e
    if not isinstance(out, Mapping):
        raise ProbeError(f"the load function must return a mapping of buffer name -> array, "
                         f"got {type(out).__name__}")
    return out


def _probe_with_base(spec, load, base, progress, allow_narrowing, arrays):
    passes = _n_passes(spec.numel, base)
    labels = [f"pass {k + 1}/{passes + 1}" for k in range(passes + 1)]
    written: dict[str, Any] = {}  # (buffer numel,) mask, for each buffer
    digits: dict[str, list] = {}  # (buffer numel,) digits, one per pass
    shapes: dict[str, tuple] = {}
    bar = _progress(progress, passes + 1)
    if hasattr(arrays, "begin"):
        arrays.begin(spec, base, passes)
    for k in range(passes + 1):
        ck = ProbeCheckpoint(spec, base, k if k < passes else None, arrays=arrays)
        out = _call(load, ck, labels[k])
        if k == 0:
            dts = {n: arrays.dtype_name(arrays.buffer(n, a)) for n, a in out.items()}
            # bool and other 1-value dtypes cannot carry a digit: they never narrow the base
            narrow = [(n, dtype_info(dt)) for n, dt in dts.items()
                      if dt is not None and dtype_info(dt).exact_int_max > 1]
            limit = min((d.exact_int_max for _, d in narrow), default=base)
            if limit < base:
                name, d = min(narrow, key=lambda x: x[1].exact_int_max)
                if allow_narrowing:
                    return (limit, f"buffer `{name}` is {d.name}")
                raise ProbeError(f"buffer `{name}` is {d.name}, which holds digits only up to "
                                 f"{limit}, below the requested base {base}")
        elif set(out) != set(shapes):
            raise ProbeError(f"the load function returned different buffers in {labels[k]} than in "
                             f"pass 1: {sorted(set(out) ^ set(shapes))[:5]}")
        checks = []  # (name, buffer, ok of its digits, ok of its written mask): checked at once
        if k == 0 and hasattr(arrays, "prepare"):
            arrays.prepare({n: arrays.buffer(n, a) for n, a in out.items()}, base, passes)
        for name, arr in out.items():
            a = arrays.buffer(name, arr)
            shape = tuple(a.shape)
            if k == 0:
                shapes[name] = shape
            elif shape != shapes[name]:
                raise ProbeError(f"buffer `{name}` changed shape from {shapes[name]} to {shape} "
                                 f"in {labels[k]}")
            w, d, ok = arrays.read(a, base)
            if k == 0:
                written[name], same = w, True
            else:
                same = arrays.same(w, written[name])
            checks.append((name, a, ok, same))
            digits.setdefault(name, []).append(d)
            del w, d, a, arr
        if not arrays.all_true([c for _, _, ok, same in checks for c in (ok, same)]):
            _raise_first_bad(arrays, checks, shapes, written, base, labels[k])
        # the buffers may be views of this pass's checkpoint tensors: dropped, their memory is
        # the next pass's (see _Pool)
        del out, ck, checks
        bar.advance()
    bar.close()
    maps: dict[str, SourceMap] = {}
    for name, shape in shapes.items():
        cols = shape[-1] if shape else 1
        runs, bad, in_check = arrays.runs(written.pop(name), digits.pop(name), base, spec.numel,
                                          cols)
        if bad is not None:
            raise _bad(name, shape, bad.index, bad.what,
                       labels[passes] if in_check else "the decoded ids")
        maps[name] = SourceMap.from_runs(shape, runs)
    return maps


def _raise_first_bad(arrays, checks, shapes, written, base, label) -> None:
    """Raises the error of the first buffer whose digits or written mask failed in a pass."""
    for name, a, ok, same in checks:
        if not arrays.all_true([ok]):
            bad = arrays.first_bad(a, base)
            raise _bad(name, shapes[name], bad.index, bad.what, label)
        if not arrays.all_true([same]):
            w = arrays.read(a, base)[0]
            raise _bad(name, shapes[name], arrays.first_difference(w, written[name]),
                       "was written in some passes and not in others", label)
    raise AssertionError("a pass failed its check but no buffer did")


def _decode(w, digits, base, numel) -> tuple[np.ndarray, Bad | None, bool]:
    """:meth:`ProbeArrays.decode` with numpy."""
    *id_digits, check = digits
    if base == 256 and len(id_digits) <= 8:
        # bytes of a little-endian int64: the digits are its bytes, no arithmetic
        raw = np.zeros((w.size, 8), dtype=np.uint8)
        for j, d in enumerate(id_digits):
            raw[:, j] = d
        ids = raw.view("<i8").reshape(-1).astype(np.int64, copy=False)
        del raw
    else:
        ids = np.zeros(w.shape, dtype=np.int64)
        scale = 1
        for d in id_digits:
            ids += d.astype(np.int64) * scale
            scale *= base
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


class _NoBar:
    def advance(self) -> None:
        pass

    def close(self) -> None:
        pass


class _RichBar:
    def __init__(self, total: int):
        from rich.progress import Progress

        self._p = Progress(transient=True)
        self._p.start()
        self._t = self._p.add_task("probing load function", total=total)

    def advance(self) -> None:
        self._p.advance(self._t)

    def close(self) -> None:
        self._p.stop()


def _progress(enabled: bool, total: int):
    return _RichBar(total) if enabled else _NoBar()
