"""Synthetic weights of a plan's workers: every element's value is a fixed function of its checkpoint
id, so every process of a benchmark (or test) makes and checks its own buffers without shipping
arrays."""

from __future__ import annotations

import numpy as np

from wb.data.dtypes import convert, dtype_info

__all__ = ["weight_bits", "buffers_for", "buffers_of", "fp8_expected", "mapped_of",
           "version_bits", "version_into", "version_matches"]


def weight_bits(ids, dtype: np.dtype, xp=np):
    """Deterministic, finite weight values of checkpoint ids (ids >= 0), as ``dtype``.

    Bits are a hash of the id with the exponent field kept away from inf/nan. ``xp`` is numpy or
    CuPy (values are made where the buffer lives).
    """
    item = np.dtype(dtype).itemsize
    u = {1: xp.uint8, 2: xp.uint16, 4: xp.uint32, 8: xp.uint64}[item]
    h = (ids.astype(xp.uint64) * xp.uint64(0x9E3779B97F4A7C15)) >> xp.uint64(17)
    mask = {1: 0x3F, 2: 0x3FFF, 4: 0x3FFFFFFF, 8: 0x3FFFFFFFFFFFFFFF}[item]
    bits = (h & xp.uint64(mask)).astype(u)
    if item == 2:
        bits |= xp.uint16(0x3C00)
    return bits


def buffers_for(plan, rank: int, *, fill: bool, xp=np, held: str | None = None) -> dict:
    """This rank's buffers, made on the host (numpy) or the device (CuPy): trainer weights
    (``fill``, element by element from the source map's blocks, one block at a time) or zeros.

    ``held``: the trainers' dtype, where this rank's buffers may be of another (a plan that
    converts): the weights are then those values converted to each buffer's dtype, as
    :func:`wb.data.dtypes.convert` does (made on the host)."""
    return buffers_of(plan.layout_of(rank), fill=fill, xp=xp, held=held)


def buffers_of(lay, *, fill: bool, xp=np, held: str | None = None) -> dict:
    """:func:`buffers_for` of one layout (a trainer's own, before quantisation takes its declared
    tensors out of the plan's)."""
    out = {}
    for name, b in lay.buffers.items():
        dt = dtype_info(b.dtype).numpy
        raw = np.dtype(f"u{dt.itemsize}")
        if not fill:
            arr = xp.full(b.shape, 0, dtype=raw)  # resident, as live weights are (not lazy)
        elif held is None or held == b.dtype:
            arr = _filled(b, dt, xp)
        else:
            hd = dtype_info(held).numpy
            want = np.empty(b.shape, dt)
            convert(want, _filled(b, hd, np).view(hd))
            arr = xp.asarray(want.view(raw))
        # CuPy has no bfloat16/float8: device buffers of those stay raw integer bits
        out[name] = arr.view(dt) if (xp is np or dt.kind != "V") else arr
    return out


def _filled(b, dt: np.dtype, xp):
    """Raw bits of buffer ``b``'s weights as ``dt``: every mapped element
    :func:`weight_bits` of its id, the others 0."""
    arr = xp.full(b.shape, 0, dtype=np.dtype(f"u{dt.itemsize}"))
    v = arr.reshape(b.sourcemap.view2d)
    for where, ids in _blocks(b.sourcemap, xp):
        v[where] = weight_bits(ids, dt, xp)
    return arr


def _blocks(sourcemap, xp=np):
    """``(where, ids)`` of each block of a source map: the slice of its 2-D view the block
    covers, and the block's ids there (made one block at a time, on ``xp``'s side)."""
    bl = sourcemap.blocks
    for k in range(bl.count):
        nr, nc, r0, c0 = int(bl.nr[k]), int(bl.nc[k]), int(bl.r0[k]), int(bl.c0[k])
        ids = (int(bl.id0[k]) + xp.arange(nr, dtype=xp.int64)[:, None] * int(bl.sr[k])
               + xp.arange(nc, dtype=xp.int64)[None, :] * int(bl.sc[k]))
        yield (slice(r0, r0 + nr), slice(c0, c0 + nc)), ids


def fp8_expected(lay, scaled, held: str, xp=np) -> dict:
    """What a rollout of the FP8 checkpoint holds: the trainers' weights (:func:`weight_bits`
    of ids, as ``held``) quantised block by block (:func:`wb.data.fp8.quantize_tensor`,
    made on the host for the blocks this layout reads, :class:`_Quantised`), their scales, and
    the other tensors converted to each buffer's dtype.

    Built one source-map block at a time (a block's ids are one affine rectangle, gathered from
    the tensor they fall in): no id per element of a whole buffer is ever made, so multi-GB
    rollouts are checked in seconds (equal to the per-element construction: test_fp8)."""
    spec, fspec = scaled.trainer_spec, scaled.spec
    hd = dtype_info(held).numpy
    # every FP8 checkpoint tensor: (start id, numel, tensor, 0: the FP8 values, 1: the scales);
    # only blocks this layout reads are quantised (a rank holds a small share of a tensor)
    names = [(n, t, 0) for t, n in enumerate(scaled.names)] + [
        (scaled.scale_name(t), t, 1) for t in range(len(scaled.names))]
    rows = sorted((fspec.offset(n), int(np.prod(fspec.shape(n))), t, which)
                  for n, t, which in names)
    starts = np.array([r[0] for r in rows], np.int64)
    lazy: dict[int, _Quantised] = {}

    def quantised(k: int, idx: np.ndarray) -> np.ndarray:
        """The FP8 checkpoint's values (or scales) of FP8 tensor ``rows[k]`` at flat indices
        ``idx`` into it; only the blocks those cover are quantised (once each)."""
        _, _, t, which = rows[k]
        if t not in lazy:
            n = scaled.names[t]
            lazy[t] = _Quantised(spec.offset(n), spec.shape(n), hd, scaled.decl)
        return lazy[t].at(which, idx)

    numel = np.array([r[1] for r in rows], np.int64)

    def inside(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The FP8 tensor (index into ``rows``) of each id, and whether it is in one."""
        k = np.searchsorted(starts, ids, side="right") - 1
        kk = np.maximum(k, 0)
        return kk, (k >= 0) & (ids - starts[kk] < numel[kk])

    def spans(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For id ranges ``[lo, hi]``: the FP8 tensor of each, whether one FP8 tensor holds
        the whole range (both ends in it: the ids between too), and whether it lies outside
        every FP8 tensor (both ends outside, no tensor starting between: undeclared)."""
        (k_lo, in_lo), (k_hi, in_hi) = inside(lo), inside(hi)
        outside = ~in_lo & ~in_hi & (np.searchsorted(starts, lo, side="right")
                                     == np.searchsorted(starts, hi, side="right"))
        return k_lo, in_lo & in_hi & (k_lo == k_hi), outside

    def values(ids: np.ndarray) -> np.ndarray:
        """float64 of what the FP8 checkpoint holds at ``ids`` (a block: 2-D, affine, >= 0).
        A row of a block lies in one tensor but where a tensor ends inside it: rows are sorted
        out by their end ids, and only rows that straddle tensors are read element by
        element."""
        vals = np.empty(ids.shape, np.float64)
        ends = np.stack([ids[:, 0], ids[:, -1]])
        k_row, whole, outside = spans(ends.min(0), ends.max(0))
        for k in np.unique(k_row[whole]).tolist():
            r = np.flatnonzero(whole & (k_row == k))
            vals[r] = quantised(k, ids[r] - starts[k]).astype(np.float64)
        r = np.flatnonzero(outside)  # undeclared tensors: the weights as held
        vals[r] = weight_bits(ids[r], hd).view(hd).astype(np.float64)
        for i in np.flatnonzero(~whole & ~outside).tolist():  # a row across tensors
            k, ok = inside(ids[i])
            for kk in np.unique(k[ok]).tolist():
                sel = ok & (k == kk)
                vals[i, sel] = quantised(kk, ids[i, sel] - starts[kk]).astype(np.float64)
            vals[i, ~ok] = weight_bits(ids[i, ~ok], hd).view(hd).astype(np.float64)
        return vals

    out = {}
    for name, b in lay.buffers.items():
        dt = dtype_info(b.dtype).numpy
        want = np.zeros(b.shape, dt)
        v = want.reshape(b.sourcemap.view2d)
        for where, ids in _blocks(b.sourcemap):
            corners = ids[[0, 0, -1, -1], [0, -1, 0, -1]]
            (k,), (whole,), (outside,) = spans(corners.min(keepdims=True),
                                               corners.max(keepdims=True))
            if whole:  # the block in one FP8 tensor
                src = quantised(int(k), ids - starts[k])
            elif outside:  # in an undeclared tensor
                src = weight_bits(ids, hd).view(hd)
            else:
                src = values(ids)
            convert(v[where], src)  # a copy where the dtypes are the same
        raw = want.view(f"u{dt.itemsize}")
        arr = xp.asarray(raw)
        out[name] = arr.view(dt) if (xp is np or dt.kind != "V") else arr
    return out


class _Quantised:
    """One declared tensor of the trainers' weights (:func:`weight_bits` of its ids, as ``hd``)
    quantised by :func:`wb.data.fp8.quantize_tensor` a block-aligned rectangle at a time,
    as reads need them: a block's quantisation depends on its own elements only, so a rectangle
    of whole blocks (cut at the tensor's edges as the whole tensor is) quantises to the same
    bits as those blocks of the whole tensor."""

    def __init__(self, start: int, shape, hd: np.dtype, decl):
        from wb.data.dtypes import dtype_info as info

        self.start, (self.r, self.c), self.hd, self.decl = start, shape, hd, decl
        self.bh, self.bw = decl.block
        self.gr, self.gc = -(-self.r // self.bh), -(-self.c // self.bw)
        self.q = np.empty(self.r * self.c, info(decl.format).numpy)  # pages touched as filled
        self.s = np.empty(self.gr * self.gc, np.float32)
        self.done = np.zeros((self.gr, self.gc), bool)

    def at(self, which: int, idx: np.ndarray) -> np.ndarray:
        """Values (``which`` 0: flat indices into the tensor) or scales (1: into the scale
        grid) at ``idx``."""
        if which == 0:
            rows, cols = idx // self.c, idx % self.c
            self._cover(rows.min() // self.bh, rows.max() // self.bh,
                        cols.min() // self.bw, cols.max() // self.bw)
            return self.q[idx]
        g_r, g_c = idx // self.gc, idx % self.gc
        self._cover(g_r.min(), g_r.max(), g_c.min(), g_c.max())
        return self.s[idx]

    def _cover(self, gr0, gr1, gc0, gc1) -> None:
        """Quantises blocks ``[gr0, gr1] x [gc0, gc1]`` (inclusive) unless done."""
        from wb.data.fp8 import quantize_tensor

        gr0, gr1, gc0, gc1 = int(gr0), int(gr1) + 1, int(gc0), int(gc1) + 1
        if self.done[gr0:gr1, gc0:gc1].all():
            return
        r0, r1 = gr0 * self.bh, min(gr1 * self.bh, self.r)
        c0, c1 = gc0 * self.bw, min(gc1 * self.bw, self.c)
        ids = (self.start + np.arange(r0, r1, dtype=np.int64)[:, None] * self.c
               + np.arange(c0, c1, dtype=np.int64)[None, :])
        q, scale = quantize_tensor(weight_bits(ids, self.hd).view(self.hd), (self.bh, self.bw),
                                   self.decl.format)
        self.q.reshape(self.r, self.c)[r0:r1, c0:c1] = q
        self.s.reshape(self.gr, self.gc)[gr0:gr1, gc0:gc1] = scale
        self.done[gr0:gr1, gc0:gc1] = True


def mapped_of(lay, xp=np) -> dict:
    """Which elements of layout ``lay``'s buffers the source map covers (bool arrays, made on the
    host or the device block by block: no id per element is ever materialised, so it scales to
    multi-GB buffers)."""
    out = {}
    for name, b in lay.buffers.items():
        m = xp.zeros(b.shape, dtype=bool)
        v = m.reshape(b.sourcemap.view2d)
        bl = b.sourcemap.blocks
        for r0, c0, nr, nc in zip(bl.r0.tolist(), bl.c0.tolist(), bl.nr.tolist(), bl.nc.tolist()):
            v[r0:r0 + nr, c0:c0 + nc] = True
        out[name] = m
    return out


#: Elements :func:`version_bits` hashes at once (its temporaries: ~24 bytes each).
_CHUNK = 1 << 24


def _version_chunks(base: dict, version: int, mapped: dict, xp, density: float):
    """``(name, chunk, new bits)``: version ``version`` of ``base`` (see :func:`version_bits`) a
    chunk of :data:`_CHUNK` elements at a time, ``chunk`` the slice of the flat buffer."""
    for k, a in base.items():
        u = a.view(f"u{a.dtype.itemsize}")
        flat, where = u.reshape(-1), mapped[k].reshape(-1)
        for c in range(0, flat.size, _CHUNK):  # temporaries of a chunk at a time
            s = slice(c, c + _CHUNK)
            bits = flat[s]
            if density >= 1.0:
                yield k, s, xp.where(where[s], bits + xp.asarray(version, u.dtype), bits)
                continue
            wide, cut = bits.astype(xp.uint64), xp.uint64(int(density * (1 << 20)))
            steps = xp.zeros(bits.size, u.dtype)
            for w in range(1, version + 1):
                h = (wide * xp.uint64(0x9E3779B97F4A7C15)
                     + xp.uint64(w * 0xBF58476D1CE4E5B9 % (1 << 64)))
                steps += ((h >> xp.uint64(40)) & xp.uint64((1 << 20) - 1) < cut).astype(u.dtype)
            yield k, s, bits + steps * where[s].astype(u.dtype)


def version_bits(base: dict, version: int, mapped: dict, xp=np, *,
                 density: float = 1.0) -> dict:
    """Version ``version`` of a rank's weights: ``base``'s raw bits plus ``version`` where an id is
    mapped (``mapped[name]``: bool array), unchanged elsewhere (bitwise distinct per version;
    nothing interprets them as numbers). ``xp``: numpy, or CuPy for device arrays.

    ``density`` below 1: each version changes about that fraction of the mapped elements (plus
    one each time), chosen by a hash of the element's base bits and the version, so every copy
    of an id changes alike (what a delta update sends). :func:`version_into` writes a version
    into buffers and :func:`version_matches` checks one, without a copy of the rank's size."""
    out = {k: a.copy() for k, a in base.items()}
    version_into(out, base, version, mapped, xp, density=density)
    return out


def _flat(a):
    if not a.flags.c_contiguous:
        raise ValueError("version_into: buffers must be contiguous (a copy would take the bits)")
    return a.view(f"u{a.dtype.itemsize}").reshape(-1)


def version_into(bufs: dict, base: dict, version: int, mapped: dict, xp=np, *,
                 density: float = 1.0) -> int:
    """Writes :func:`version_bits` into ``bufs`` (contiguous, shaped as ``base``); returns how
    many elements it changed."""
    changed = 0
    for k, s, new in _version_chunks(base, version, mapped, xp, density):
        dst = _flat(bufs[k])
        changed += int(xp.count_nonzero(dst[s] != new))
        dst[s] = new
    return changed


def version_matches(bufs: dict, base: dict, version: int, mapped: dict, xp=np, *,
                    density: float = 1.0) -> bool:
    """Whether ``bufs`` hold :func:`version_bits`, bit for bit."""
    return all(bool(xp.array_equal(_flat(bufs[k])[s], new))
               for k, s, new in _version_chunks(base, version, mapped, xp, density))
