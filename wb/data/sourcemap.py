"""SourceMap: which checkpoint element every element of a buffer holds, stored in O(blocks).

A buffer of shape ``S`` is viewed as 2-D: ``rows = prod(S[:-1])``, ``cols = S[-1]``. Its map ``M``
(int64, ``-1`` = not from the checkpoint) is stored two equivalent ways:

- **diff2**: the non-zeros of ``D = Δr² Δc² (M + 1)`` with zero padding before row 0 and column 0.
  ``M + 1`` makes "not from the checkpoint" the zero background. An affine rectangle embedded in
  zeros has at most 16 non-zeros in ``D`` (4 rows x 4 columns around its corners), so a slice-copy
  map costs at most 16 entries per rectangle; any map is exact (at worst one entry per element), and
  decoding is two prefix sums per axis. Integer arithmetic wraps modulo 2**64 identically in
  encoding and decoding (both are ring operations), so the round trip is exact for every int64
  value; only ``-1`` is special. Layouts additionally require ids in ``[0, MAX_ID]``.
- **blocks**: affine rectangles ``id(r, c) = id0 + (r - r0) * sr + (c - c0) * sc`` for
  ``r0 <= r < r0 + nr``, ``c0 <= c < c0 + nc``. Intersection and planning work on blocks.

Neither form is ever O(elements); per-element int64 arrays exist only transiently while a map is
built from, or decoded to, indices (in row chunks, so extra memory stays below about the size of
the index array itself).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from wb.errors import SpecError

__all__ = ["SourceMap", "Blocks", "Runs", "RunMarks", "run_marks", "runs_from_marks", "MAX_ID"]

#: Largest id a layout accepts (the codec itself is exact for any int64 value).
MAX_ID = 2**62 - 1

# Elements per chunk when scanning index arrays: bounds the transient memory of encoding.
_CHUNK = 1 << 21


class Blocks(NamedTuple):
    """Affine rectangles of a source map in its 2-D view; all fields ``(n,) int64``.

    Element ``(r, c)`` with ``r0 <= r < r0 + nr`` and ``c0 <= c < c0 + nc`` holds id
    ``id0 + (r - r0) * sr + (c - c0) * sc``. A stride along an axis of length 1 is 0.
    """

    r0: np.ndarray  # (n,) int64 first row
    nr: np.ndarray  # (n,) int64 number of rows (>= 1)
    c0: np.ndarray  # (n,) int64 first column
    nc: np.ndarray  # (n,) int64 number of columns (>= 1)
    id0: np.ndarray  # (n,) int64 id at (r0, c0)
    sr: np.ndarray  # (n,) int64 id step per row
    sc: np.ndarray  # (n,) int64 id step per column

    @staticmethod
    def empty() -> Blocks:
        return Blocks(*(np.zeros(0, np.int64) for _ in range(7)))

    @staticmethod
    def of(*rows: tuple[int, int, int, int, int, int, int]) -> Blocks:
        """Blocks from tuples ``(r0, nr, c0, nc, id0, sr, sc)``."""
        cols = np.asarray(rows, dtype=np.int64).reshape(-1, 7).T
        return Blocks(*(np.ascontiguousarray(c) for c in cols))

    @property
    def count(self) -> int:
        return len(self.r0)

    @property
    def numel(self) -> int:
        """Elements covered by all blocks."""
        return int(np.dot(self.nr, self.nc))

    def __eq__(self, other: object) -> bool:  # arrays compare element-wise; blocks as a whole
        if not isinstance(other, Blocks):
            return NotImplemented
        return all(np.array_equal(a, b) for a, b in zip(self, other))

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = None  # type: ignore[assignment]

    def id_range(self) -> tuple[float, float]:
        """Smallest and largest id in the blocks (as floats: a range check, not an exact value)."""
        if self.count == 0:
            return 0.0, 0.0
        id0 = self.id0.astype(np.float64)
        span_r = (self.nr - 1).astype(np.float64) * self.sr
        span_c = (self.nc - 1).astype(np.float64) * self.sc
        lo = id0 + np.minimum(span_r, 0) + np.minimum(span_c, 0)
        hi = id0 + np.maximum(span_r, 0) + np.maximum(span_c, 0)
        return float(lo.min()), float(hi.max())

    def take(self, index: np.ndarray) -> Blocks:
        return Blocks(*(f[index] for f in self))


def _view2d(shape: tuple[int, ...]) -> tuple[int, int]:
    cols = shape[-1] if shape else 1
    rows = math.prod(shape[:-1]) if shape else 1
    return rows, cols


def _run_starts(v: np.ndarray, valid: np.ndarray, forced: np.ndarray) -> np.ndarray:
    """Greedy starts of maximal arithmetic runs in ``v`` (positions, sorted).

    A run starts at every forced position (a row start, the first valid element after an invalid
    one); the element after a start always joins its run (any step); every later element joins if
    it keeps the run's step. Positions whose second difference is zero never start a run, so only
    the (few) candidates are looked at: in a chain of consecutive candidates, starts alternate.
    """
    pos = np.flatnonzero(_candidates(v, valid, forced))
    return pos[_alternate(pos, forced[pos])]


def _candidates(v: np.ndarray, valid: np.ndarray, forced: np.ndarray) -> np.ndarray:
    """Where a run may start: forced positions, and valid ones after a non-forced element whose
    second difference is not zero."""
    cand = forced.copy()
    if v.shape[0] > 2:
        dd = v[2:] - 2 * v[1:-1] + v[:-2]  # wraps mod 2**64 exactly like the ids' differences
        cand[2:] |= valid[2:] & ~forced[1:-1] & (dd != 0)
    return cand


def _alternate(pos: np.ndarray, forced: np.ndarray) -> np.ndarray:
    """Which candidates start a run (bool mask over ``pos``): every forced one, then every
    other one along a chain of consecutive positions."""
    if pos.size == 0:
        return np.zeros(0, dtype=bool)
    head = forced.copy()
    head[0] = True
    head[1:] |= pos[1:] != pos[:-1] + 1
    idx = np.arange(pos.size)
    head_idx = np.maximum.accumulate(np.where(head, idx, 0))
    return (idx - head_idx) % 2 == 0


class Runs(NamedTuple):
    """Maximal affine runs along the rows of a map's 2-D view; all fields ``(n,) int64``.

    Row ``row`` holds ids ``id0 + (c - c0) * sc`` at columns ``c0 <= c < c0 + nc`` (``sc`` is 0
    for a run of one). :meth:`SourceMap.from_runs` stacks them into blocks.
    """

    row: np.ndarray
    c0: np.ndarray
    nc: np.ndarray
    id0: np.ndarray
    sc: np.ndarray

    @staticmethod
    def concat(parts: list[Runs]) -> Runs:
        if not parts:
            return Runs(*(np.zeros(0, np.int64) for _ in range(5)))
        return Runs(*(np.concatenate(f).astype(np.int64, copy=False) for f in zip(*parts)))


class RunMarks(NamedTuple):
    """What finding the runs of ``n`` ids needs from them, O(runs): computed where the ids are
    (numpy here; a shim's device), finished on the host by :func:`runs_from_marks`.

    With ``valid = v != -1``, ``forced`` = valid and at a row start or after an invalid element:
    """

    cand: np.ndarray  # (k,) int64 sorted positions that are forced or valid, after a non-forced
    #                   element, with a non-zero second difference ``v[i] - 2 v[i-1] + v[i-2]``
    forced: np.ndarray  # (k,) bool: ``cand`` is forced
    v_at: np.ndarray  # (k,) int64 ``v[cand]``
    v_next: np.ndarray  # (k,) int64 ``v[min(cand + 1, n - 1)]``
    last: np.ndarray  # (l,) int64 sorted positions of valid elements whose successor is invalid,
    #                   starts a row, or is past the end


def run_marks(v: np.ndarray, cols: int) -> RunMarks:
    """:class:`RunMarks` of flat int64 ids ``v`` (whole rows of ``cols``), with numpy."""
    n = v.shape[0]
    valid = v != -1
    forced = valid.copy()
    forced[1:] &= ~valid[:-1]
    forced[::cols] = valid[::cols]
    cand = _candidates(v, valid, forced)
    pos = np.flatnonzero(cand)
    last = valid.copy()
    last[:-1] &= ~valid[1:] | forced[1:]  # forced[i+1] and valid[i]: i + 1 starts a row
    return RunMarks(pos, forced[pos], v[pos], v[np.minimum(pos + 1, n - 1)], np.flatnonzero(last))


def runs_from_marks(m: RunMarks, n: int, cols: int, row_offset: int = 0) -> Runs:
    """The maximal affine runs of ``n`` ids (whole rows of ``cols``, the first of them row
    ``row_offset``) from their :class:`RunMarks`: O(runs), the same runs :func:`run_marks`'s ids
    give directly."""
    sel = _alternate(m.cand, m.forced)
    starts = m.cand[sel]
    ends = np.append(starts[1:], n)
    if starts.size:
        ends = np.minimum(ends, m.last[np.searchsorted(m.last, starts)] + 1)
    length = ends - starts
    id0 = m.v_at[sel]
    sc = np.where(length > 1, m.v_next[sel] - id0, 0)
    return Runs(starts // cols + row_offset, starts % cols, length, id0, sc)


def _row_runs(ids2d: np.ndarray, row_offset: int) -> Runs:
    """Maximal affine runs along each row of a chunk."""
    rows, cols = ids2d.shape
    v = ids2d.reshape(-1)
    return runs_from_marks(run_marks(v, cols), v.size, cols, row_offset)


def _merge_rows(row, c0, nc, id0, sc) -> Blocks:
    """Stacks runs of consecutive rows with the same columns and step into affine blocks."""
    if row.size == 0:
        return Blocks.empty()
    if not _lexsorted((row, sc, nc, c0)):  # probed maps come sorted: no sort needed
        order = np.lexsort((row, sc, nc, c0))
        row, c0, nc, id0, sc = row[order], c0[order], nc[order], id0[order], sc[order]
    n = row.size
    forced = np.ones(n, dtype=bool)
    forced[1:] = ((c0[1:] != c0[:-1]) | (nc[1:] != nc[:-1]) | (sc[1:] != sc[:-1])
                  | (row[1:] != row[:-1] + 1))
    starts = _run_starts(id0, np.ones(n, dtype=bool), forced)
    ends = np.append(starts[1:], n)
    nr = ends - starts
    sr = np.zeros(starts.size, dtype=np.int64)
    two = nr > 1
    sr[two] = id0[starts[two] + 1] - id0[starts[two]]
    b = Blocks(row[starts], nr, c0[starts], nc[starts], id0[starts], sr, sc[starts])
    if not _lexsorted((b.c0, b.r0)):
        b = b.take(np.lexsort((b.c0, b.r0)))
    return b


def _lexsorted(keys: tuple[np.ndarray, ...]) -> bool:
    """Whether ``np.lexsort(keys)`` is the identity (last key primary), in O(n)."""
    undecided = np.ones(keys[0].size - 1, dtype=bool)
    for k in reversed(keys):
        a, b = k[:-1], k[1:]
        if (undecided & (a > b)).any():
            return False
        undecided &= a == b
    return True


def _diff2_of_blocks(rows: int, cols: int, b: Blocks) -> tuple[np.ndarray, np.ndarray]:
    """Non-zeros of ``Δr² Δc² (M + 1)`` as (flat positions, values), summing the blocks' terms.

    A block is ``a * 1_R(r) 1_C(c) + sr * (r - r0) 1_R(r) 1_C(c) + sc * 1_R(r) (c - c0) 1_C(c)``
    with ``a = id0 + 1``; each term is separable, and the second difference of an indicator
    ``1_[x, x+n)`` is ``(+1, -1, -1, +1)`` at ``(x, x+1, x+n, x+n+1)``, that of ``(r - x) 1_[x, x+n)``
    is ``(0, 1, -n, n-1)`` there.
    """
    if b.count == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    one = np.ones_like(b.nr)
    rp = np.stack([b.r0, b.r0 + 1, b.r0 + b.nr, b.r0 + b.nr + 1], axis=1)  # (n, 4)
    cp = np.stack([b.c0, b.c0 + 1, b.c0 + b.nc, b.c0 + b.nc + 1], axis=1)
    u1 = np.stack([one, -one, -one, one], axis=1)
    u2 = np.stack([0 * one, one, -b.nr, b.nr - 1], axis=1)
    v2 = np.stack([0 * one, one, -b.nc, b.nc - 1], axis=1)
    a = (b.id0 + 1)[:, None, None]
    val = (a * u1[:, :, None] * u1[:, None, :] + b.sr[:, None, None] * u2[:, :, None]
           * u1[:, None, :] + b.sc[:, None, None] * u1[:, :, None] * v2[:, None, :])
    r = np.broadcast_to(rp[:, :, None], val.shape).reshape(-1)
    c = np.broadcast_to(cp[:, None, :], val.shape).reshape(-1)
    val = val.reshape(-1)
    keep = (r < rows) & (c < cols) & (val != 0)
    pos, val = r[keep] * cols + c[keep], val[keep]
    order = np.argsort(pos, kind="stable")
    pos, val = pos[order], val[order]
    if pos.size:
        first = np.flatnonzero(np.r_[True, pos[1:] != pos[:-1]])
        pos, val = pos[first], np.add.reduceat(val, first)
        nz = val != 0
        pos, val = pos[nz], val[nz]
    return pos, val


class SourceMap:
    """The checkpoint element id held by every element of one buffer, in O(blocks) memory.

    Build one with :meth:`from_indices` (an int64 array, ``-1`` = not from the checkpoint),
    :meth:`from_blocks` (affine rectangles, as presets do without touching elements) or
    :meth:`from_diff2`. Two maps are equal when their shapes and diff2 entries are.

    Args:
        shape: the buffer's shape.
        pos: ``(nnz,)`` flat positions of the diff2 entries in the buffer viewed as 2-D.
        val: ``(nnz,)`` their values.
        blocks: the same map as affine blocks, when the caller has them (else derived lazily).

    Examples:
        >>> ids = np.arange(12).reshape(3, 4)[:, 1:3]          # a column shard
        >>> sm = SourceMap.from_indices(ids)
        >>> sm.shape, sm.nnz, sm.blocks.count
        ((3, 2), 4, 1)
        >>> bool((sm.to_indices() == ids).all())
        True
    """

    __slots__ = ("shape", "_pos", "_val", "_blocks")

    def __init__(self, shape: tuple[int, ...], pos: np.ndarray, val: np.ndarray,
                 blocks: Blocks | None = None):
        self.shape = tuple(int(d) for d in shape)
        self._pos = np.ascontiguousarray(pos, dtype=np.int64)  # (nnz,) int64 flat 2-D position
        self._val = np.ascontiguousarray(val, dtype=np.int64)  # (nnz,) int64 diff2 value
        self._blocks = blocks

    # --- construction --------------------------------------------------------------------------
    @classmethod
    def from_indices(cls, ids: np.ndarray) -> SourceMap:
        """Encodes an integer array of ids (``-1``: not from the checkpoint) of any shape.

        Exact for every id from -1 to the int64 maximum. Layouts (:class:`wb.BufferSpec`)
        accept ids ``0 .. MAX_ID``.

        Raises:
            SpecError: ``ids`` is not an integer array, holds an id below -1 (meaningless: an
                element is from the checkpoint or not), or is uint64 beyond the int64 range.
        """
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise SpecError(f"source map ids must be integers, got dtype {ids.dtype}")
        if ids.dtype == np.uint64 and ids.size and ids.max() > np.iinfo(np.int64).max:
            raise SpecError(f"source map ids must fit int64, found {ids.max()}")
        if ids.dtype.kind == "i" and ids.size and (low := ids.min()) < -1:
            where = np.unravel_index(int(np.argmin(ids)), ids.shape)
            raise SpecError(f"source map ids must be >= -1 (-1: not from the checkpoint), found "
                            f"{low} at index {tuple(int(i) for i in where)}")
        shape = ids.shape
        rows, cols = _view2d(shape)
        runs: list[Runs] = []
        if rows * cols:
            v2 = ids.reshape(rows, cols)
            step = max(1, _CHUNK // cols)
            for r in range(0, rows, step):
                chunk = np.asarray(v2[r:r + step], dtype=np.int64)
                runs.append(_row_runs(chunk, r))
        return cls.from_runs(shape, Runs.concat(runs))

    @classmethod
    def from_runs(cls, shape: tuple[int, ...], runs: Runs) -> SourceMap:
        """A map from the maximal affine runs along its rows (as :func:`runs_from_marks` gives
        them; any order), in O(runs): how a probe that decoded ids on a device builds maps."""
        rows, cols = _view2d(tuple(shape))
        blocks = _merge_rows(*runs) if len(runs.row) else Blocks.empty()
        return cls(tuple(shape), *_diff2_of_blocks(rows, cols, blocks), blocks=blocks)

    @classmethod
    def from_blocks(cls, shape: tuple[int, ...], blocks: Blocks, *,
                    check: bool = True) -> SourceMap:
        """A map from affine blocks in the 2-D view; uncovered elements are ``-1``.

        Blocks must lie inside the view and must not overlap (checked unless ``check=False``,
        for generators that cannot produce overlaps).
        """
        rows, cols = _view2d(tuple(shape))
        b = Blocks(*(np.asarray(f, dtype=np.int64).reshape(-1) for f in blocks))
        if b.count:
            if ((b.nr < 1) | (b.nc < 1) | (b.r0 < 0) | (b.c0 < 0)
                    | (b.r0 + b.nr > rows) | (b.c0 + b.nc > cols)).any():
                raise SpecError(f"blocks must be non-empty and inside the {rows}x{cols} view of "
                                f"shape {tuple(shape)}")
            b = b._replace(sr=np.where(b.nr > 1, b.sr, 0), sc=np.where(b.nc > 1, b.sc, 0))
            if check and b.numel != _covered(rows, cols, b):
                raise SpecError("blocks overlap: every element may belong to one block only")
        return cls(tuple(shape), *_diff2_of_blocks(rows, cols, b), blocks=b)

    @classmethod
    def from_diff2(cls, shape: tuple[int, ...], pos: np.ndarray, val: np.ndarray) -> SourceMap:
        """A map from its stored diff2 entries (as :meth:`to_arrays` writes them)."""
        return cls(tuple(shape), pos, val)

    # --- views ---------------------------------------------------------------------------------
    @property
    def nnz(self) -> int:
        """Stored diff2 entries (at most 16 per affine rectangle)."""
        return int(self._pos.size)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def view2d(self) -> tuple[int, int]:
        """``(rows, cols)`` of the 2-D view."""
        return _view2d(self.shape)

    @property
    def blocks(self) -> Blocks:
        """Affine blocks covering every element that holds an id."""
        if self._blocks is None:
            self._blocks = SourceMap.from_indices(self.to_indices())._blocks
        return self._blocks

    @property
    def n_ids(self) -> int:
        """Elements that hold a checkpoint id (not ``-1``)."""
        return self.blocks.numel

    def to_indices(self) -> np.ndarray:
        """Decodes to the int64 array of ids (O(elements); for tests, probing and small maps)."""
        rows, cols = self.view2d
        d = np.zeros(rows * cols, dtype=np.int64)
        d[self._pos] = self._val
        d = d.reshape(rows, cols)
        for axis in (0, 0, 1, 1):
            np.cumsum(d, axis=axis, out=d)
        d -= 1
        return d.reshape(self.shape)

    def diff2(self) -> tuple[np.ndarray, np.ndarray]:
        """The stored entries: flat positions in the 2-D view and values, ``(nnz,) int64`` each."""
        return self._pos, self._val

    def __getitem__(self, index) -> SourceMap:
        """The map of a slice of the buffer (decodes this map transiently)."""
        return SourceMap.from_indices(self.to_indices()[index])

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Plain arrays for ``np.savez`` / JSON: shape, diff2 entries and blocks."""
        out = {"shape": np.asarray(self.shape, dtype=np.int64), "pos": self._pos, "val": self._val}
        out.update({f"block_{k}": v for k, v in self.blocks._asdict().items()})
        return out

    @classmethod
    def from_arrays(cls, arrays) -> SourceMap:
        blocks = Blocks(*(np.asarray(arrays[f"block_{k}"], np.int64) for k in Blocks._fields))
        return cls(tuple(int(x) for x in arrays["shape"]), arrays["pos"], arrays["val"], blocks)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SourceMap):
            return NotImplemented
        return (self.shape == other.shape and np.array_equal(self._pos, other._pos)
                and np.array_equal(self._val, other._val))

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self):
        return (SourceMap, (self.shape, self._pos, self._val, self._blocks))

    def __repr__(self) -> str:
        nb = f", blocks={self._blocks.count}" if self._blocks is not None else ""
        return f"SourceMap(shape={self.shape}, nnz={self.nnz}{nb})"


def _covered(rows: int, cols: int, b: Blocks) -> int:
    """Distinct elements covered by blocks: a sweep over row slabs, interval union per slab."""
    rb = np.unique(np.concatenate([b.r0, b.r0 + b.nr]))
    total = 0
    for lo, hi in zip(rb[:-1], rb[1:]):
        live = (b.r0 <= lo) & (b.r0 + b.nr >= hi)
        if live.any():
            s, e = b.c0[live], b.c0[live] + b.nc[live]
            order = np.argsort(s)
            s, e = s[order], e[order]
            reach = np.r_[-1, np.maximum.accumulate(e)[:-1]]
            total += int(np.maximum(0, e - np.maximum(s, reach)).sum()) * int(hi - lo)
    return total
