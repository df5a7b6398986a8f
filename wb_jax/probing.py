"""The probe's per-element work on JAX's device, with ``jax.numpy`` (mirrors
:mod:`wb_torch.probing`).

:class:`DeviceArrays` is a :class:`wb.algorithms.probing.ProbeArrays`. Every step is one jitted
function, compiled once per shape and dtype (the values that change from tensor to tensor and
pass to pass are arguments), so a pass is a stream of dispatches the host never waits for:

- a checkpoint array is made on the device from its first id: pass ``k``'s digit of id
  ``first + j`` is ``(c + q(j)) mod B`` with ``q`` a shift of ``j`` (32-bit arithmetic); the
  check pass hashes each element's row of ``B`` ids with 64-bit integers, as the core does;
- the feeds' arguments (each tensor's first id, the pass) are device scalars made once per
  probe, so a feed copies nothing to the device;
- every step is compiled ahead of time from shapes (:meth:`DeviceArrays.begin`), in background
  threads, while pass 1 runs the load function;
- every leaf is checked there, and a pass waits once, for all its checks;
- after the last pass, ids are decoded there a chunk of rows at a time, with 64-bit integers
  (``jax.enable_x64`` inside these functions only), their runs are found there, and only the runs
  (O(runs)) come back for :meth:`wb.SourceMap.from_runs`.

Extra device memory: per leaf element 1 byte (the written mask) plus one digit per pass (1 byte
at base <= 256, 2 at <= 2**15, 4 above), kept across passes; while a leaf is read, or a chunk of
``chunk`` elements decoded, at most :data:`TRANSIENT_BYTES` more per element; plus the
checkpoint arrays ``load_fn`` holds at once.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import math
import os
import types

import jax
import jax.numpy as jnp
import numpy as np

import wb
from wb.algorithms.probing import HostArrays, RunMarks, Runs, chunks, idcode, runs_from_marks
from wb.data.dtypes import canonical_dtype, dtype_info, known_dtype

__all__ = ["DeviceArrays", "TRANSIENT_BYTES"]

log = logging.getLogger(__name__)

#: Bound on the transient device bytes per element of the leaf being read, or of the chunk being
#: decoded (as :data:`wb_torch.probing.TRANSIENT_BYTES`).
TRANSIENT_BYTES = 48


def _x64():
    return jax.enable_x64(True)


class DeviceArrays:
    """:class:`wb.algorithms.probing.ProbeArrays` with ``jax.numpy`` on ``device`` (the module
    docstring says what runs where and the memory it takes).

    Args:
        device: where checkpoint arrays are made (default: JAX's first device).
        chunk: elements of a leaf decoded at once (whole rows).
    """

    def __init__(self, device=None, chunk: int = 1 << 26, leaves=None):
        self.device = device or jax.devices()[0]
        self.chunk = int(chunk)
        self.leaves = dict(leaves or {})  # {name: (shape, dtype)} the load will return, if known
        self._done: set = set()  # compiled steps: ("feed" | "read", shape, dtype, base[, passes])
        self._pending: dict = {}  # step -> Future of its compile, started by begin()
        self._firsts: tuple | None = None  # (spec, base, {name: device int64 of its first id})
        self._pass_args: dict = {}  # pass index (-1: the check pass) -> device int64
        self._j = _steps(self.device.platform)  # the jitted steps

    # --- compiling ahead ------------------------------------------------------------------------
    # Each step compiles once per shape (0.1-0.5 s each on a GPU). begin() compiles them all, ahead
    # of time from shapes alone (jit(...).lower(...).compile() fills the cache calls use), from
    # threads (XLA releases the GIL while compiling), while pass 1 runs the load function, which
    # compiles its own operations: the feeds first, then, for the leaves named in ``leaves``
    # (wb_jax.probe traces them with jax.eval_shape), the reads and decodes.
    def begin(self, spec, base, passes):
        if base & (base - 1):
            return
        bits = base.bit_length() - 1
        names = [n for n in spec if 0 < spec.size(n) < 2**31 - base]
        with _x64():
            firsts = jax.device_put([np.int64(spec.offset(n)) for n in names], self.device)
        self._firsts = (spec, base, dict(zip(names, firsts)))
        self._pass_args.clear()
        steps = [("feed", spec.shape(n), np.dtype(dtype_info(spec.dtype(n)).numpy), bits)
                 for n in names]
        steps += [("read", tuple(s), np.dtype(d), base, passes) for s, d in self.leaves.values()]
        todo = [k for k in dict.fromkeys(steps) if k not in self._done and k not in self._pending]
        if not todo:
            return
        pool = concurrent.futures.ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1, 16))
        self._pending.update((k, pool.submit(self._compile, k)) for k in todo)
        pool.shutdown(wait=False)  # its threads end when the compiles do

    def _compile(self, step) -> None:
        on = jax.sharding.SingleDeviceSharding(self.device)

        def sds(shape, dtype):
            return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=on)

        # each compiled in the x64 mode it is called in (the mode is part of jit's cache key)
        i64 = sds((), np.int64)
        if step[0] == "feed":
            _, shape, dtype, bits = step
            with _x64():
                self._j.feed.lower(i64, i64, shape=tuple(shape), dtype=dtype, bits=bits).compile()
        else:
            _, shape, dtype, base, passes = step
            n = math.prod(shape)
            w = sds((n,), np.bool_)
            d = sds((n,), idcode.digit_dtype(base))
            self._j.read.lower(sds(shape, dtype), base=base).compile()
            self._j.same.lower(w, w).compile()
            cols = shape[-1] if shape else 1
            size, cap = self._chunk(n, cols)
            with _x64():
                host = jax.ShapeDtypeStruct((), np.int64)  # numpy scalars at the call
                self._j.runs_chunk.lower(w, [d] * (passes + 1), host, host, host, size=size, cols=cols,
                                  base=base, cap=cap).compile()
        self._done.add(step)

    def _wait(self, step) -> None:
        fut = self._pending.pop(step, None)
        if fut is not None and fut.exception() is not None:  # the call itself compiles it again
            log.debug("probe: compiling %s ahead failed: %r", step[:3], fut.exception())

    def prepare(self, buffers, base, passes):
        steps = {}
        for a in buffers.values():
            steps.setdefault(("read", tuple(a.shape), np.dtype(a.dtype), base, passes), a)
        for k in [k for k in self._pending if k[0] == "read"]:
            self._wait(k)
        # the leaves nobody named (or placed differently): compiled now, with the real arrays
        _parallel(lambda a: self._warm_read(a, base, passes),
                  [a for k, a in steps.items() if k not in self._done])
        self._done.update(steps)

    def _warm_read(self, a, base, passes):
        w, d, ok = self._j.read(jnp.asarray(a), base=base)
        self._j.same(w, w)
        cols = a.shape[-1] if a.ndim else 1
        size, cap = self._chunk(int(w.size), cols)
        with _x64():
            jax.block_until_ready(self._j.runs_chunk(
                w, [d] * (passes + 1), np.int64(0), np.int64(0), np.int64(1),
                size=size, cols=cols, base=base, cap=cap))

    # --- feeding --------------------------------------------------------------------------------
    def feed(self, spec, name, base, pass_index):
        dtype = np.dtype(dtype_info(spec.dtype(name)).numpy)
        shape, n = tuple(spec.shape(name)), spec.size(name)
        if base & (base - 1) or n == 0 or n >= 2**31 - base:  # a base given by hand: the host's
            return jax.device_put(HostArrays().feed(spec, name, base, pass_index),
                                  self.device)
        bits = base.bit_length() - 1
        self._wait(("feed", shape, dtype, bits))
        k = -1 if pass_index is None else pass_index
        with _x64():  # the arguments stay on the device: no copy per tensor
            if self._firsts is not None and self._firsts[0] is spec and self._firsts[1] == base:
                first = self._firsts[2][name]
            else:  # fed without begin(): one copy
                first = jax.device_put(np.int64(spec.offset(name)), self.device)
            kd = self._pass_args.get(k)
            if kd is None:
                kd = self._pass_args[k] = jax.device_put(np.int64(k), self.device)
            return self._j.feed(first, kd, shape=shape, dtype=dtype, bits=bits)

    # --- reading --------------------------------------------------------------------------------
    def buffer(self, name, arr):
        if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
            raise wb.ProbeError(f"leaf `{name}` is a {type(arr).__name__}, not an array")
        return arr

    def dtype_name(self, a):
        return known_dtype(a.dtype)

    def read(self, a, base):
        return self._j.read(jnp.asarray(a), base=base)

    def first_bad(self, a, base):  # an error path: on the host
        return HostArrays().first_bad(np.asarray(a), base)

    def same(self, a, b):
        return self._j.same(a, b)

    def first_difference(self, a, b):
        return int(np.argmax(np.asarray(a) != np.asarray(b)))

    def all_true(self, oks):
        if not all(bool(o) for o in oks if not isinstance(o, jax.Array)):
            return False
        dev = [o for o in oks if isinstance(o, jax.Array)]
        return bool(np.all(jax.device_get(dev))) if dev else True

    # --- decoding -------------------------------------------------------------------------------
    def _chunk(self, n: int, cols: int) -> tuple[int, int]:
        """``(size, cap)``: one static chunk size per leaf (whole rows; the last chunk overlaps
        the one before) and room for the usual few runs per row."""
        size = min(n, max(1, self.chunk // max(cols, 1)) * cols)
        return size, 4 * (size // cols) + 64

    def runs(self, written, digits, base, numel, cols):
        n = int(written.size)
        size, cap = self._chunk(n, cols)
        spans = list(chunks(n, cols, self.chunk))
        parts = []
        with _x64():
            def launch(start, keep, cap):
                return self._j.runs_chunk(written, digits, np.int64(start), np.int64(keep),
                                   np.int64(numel), size=size, cols=cols, base=base, cap=cap)

            starts = [min(lo, n - size) for lo, _ in spans]
            outs = jax.device_get([launch(s, lo - s, cap)  # one wait per leaf
                                   for s, (lo, _) in zip(starts, spans)])
            for start, (lo, hi), out in zip(starts, spans, outs):
                flags, n_cand, n_last = (int(x) for x in out[0])
                if max(n_cand, n_last) > cap:  # more runs than that: room for every element
                    out = jax.device_get(launch(start, lo - start, size))
                    flags, n_cand, n_last = (int(x) for x in out[0])
                if flags:  # found again on the host, an error path
                    w = np.asarray(written)[lo:hi]
                    _, bad, in_check = HostArrays().runs(
                        w, [np.asarray(d)[lo:hi] for d in digits], base, numel, cols)
                    return None, bad._replace(index=bad.index + lo), in_check
                pos, forced, v_at, v_next, last = out[1:]
                m = RunMarks(pos[:n_cand] - (lo - start), forced[:n_cand].astype(bool),
                             v_at[:n_cand], v_next[:n_cand], last[:n_last] - (lo - start))
                parts.append(runs_from_marks(m, hi - lo, cols, lo // cols))
        return Runs.concat(parts), None, False


#: XLA options of the probe's programs on GPUs: no autotuning. They are elementwise passes,
#: reductions and a binary search with nothing to tune, and autotuning them took most of their
#: compile time (H200, the first probe of a TP=8 rank of qwen3-235b dims: 5.3 s -> 4.2 s).
GPU_COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0}


@functools.lru_cache(maxsize=None)
def _steps(platform: str) -> types.SimpleNamespace:
    """The probe's jitted steps for devices of ``platform`` (each compiled once per shape)."""
    opts = dict(GPU_COMPILER_OPTIONS) if platform in ("gpu", "cuda", "rocm") else None

    def jit(fn, *static):
        return jax.jit(fn, static_argnames=static, compiler_options=opts)
    return types.SimpleNamespace(
        feed=jit(_feed, "shape", "dtype", "bits"), read=jit(_read, "base"), same=jit(_same),
        runs_chunk=jit(_runs_chunk, "size", "cols", "base", "cap"))


def _parallel(fn, items) -> None:
    """``fn`` of every item, from a few threads; the first error is raised."""
    if len(items) <= 1:
        for x in items:
            fn(x)
        return
    with concurrent.futures.ThreadPoolExecutor(min(len(items), os.cpu_count() or 1, 16)) as ex:
        for f in [ex.submit(fn, x) for x in items]:
            f.result()


def _feed(first, k, *, shape, dtype, bits):
    """Pass ``k``'s values (``k < 0``: the check pass) of a checkpoint tensor whose first id is
    ``first``; traced with 64-bit integers (both arguments are device int64 scalars)."""
    n = math.prod(shape)
    mask = (1 << bits) - 1
    j = jax.lax.iota(jnp.int32, n)
    col0, row0 = first & mask, first >> bits  # the row of B ids the tensor starts in

    def digits(_):  # (c + q(j)) mod B, q a shift of j past the first carry of digit k
        kb = bits * k
        c = (first >> kb) & mask
        split = jnp.minimum((jnp.int64(1) << kb) - (first & ((jnp.int64(1) << kb) - 1)), n)
        shift = jnp.minimum(kb, 31).astype(jnp.int32)
        split = split.astype(jnp.int32)
        q = jnp.where(j >= split, 1 + jax.lax.shift_right_logical(j - split, shift), 0)
        return (c.astype(jnp.int32) + q) & mask

    def checks(_):  # (T(col) + G(row)) mod B, as idcode.check_digit
        col = col0.astype(jnp.int32) + j
        rows = (row0 + jax.lax.shift_right_logical(col, jnp.int32(bits))).astype(jnp.uint64)
        g = jax.lax.shift_right_logical(rows * np.uint64(idcode.ROW_MUL),
                                        np.uint64(idcode.ROW_SHIFT)).astype(jnp.uint32)
        # T(col) = col * COL_MUL mod B: the low bits of a wrapping 32-bit product
        tcol = (col & mask).astype(jnp.uint32) * jnp.uint32(idcode.COL_MUL % 2**32)
        return ((g + tcol) & jnp.uint32(mask)).astype(jnp.int32)

    d = jax.lax.cond(k < 0, checks, digits, None)
    return (d + 1).astype(jnp.float32).astype(dtype).reshape(shape)


def _read(a, *, base):
    flat = a.reshape(-1)
    if canonical_dtype(flat.dtype).startswith("float8"):
        flat = flat.astype(jnp.float16)  # exact
    if jnp.issubdtype(flat.dtype, jnp.floating):
        ok = (flat >= 0) & (flat <= base) & (flat == jnp.round(flat))  # NaN fails all
    else:
        ok = (flat >= 0) & (flat <= base)
    d = jnp.where(ok, flat, 0).astype(jnp.int32)
    digit = jnp.uint8 if base <= 256 else jnp.int16 if base <= 2**15 else jnp.int32
    return d != 0, (d - 1).astype(digit), ok.all()


def _same(a, b):
    return (a == b).all()


def _runs_chunk(written, digits, start, keep_from, numel, *, size, cols, base, cap):
    """Decodes ``size`` elements from ``start`` (whole rows) and finds their run marks, kept from
    ``keep_from`` on: ``(counts, cand, forced, v_at, v_next, last)``, each list padded to
    ``cap``; ``counts = (flags, n_cand, n_last)``, flags 1: an id beyond ``numel``, 2: a check
    digit disagrees (then the marks are meaningless)."""
    *id_digits, check = digits
    w = jax.lax.dynamic_slice(written, (start,), (size,))
    ids = jnp.zeros(size, jnp.int64)
    for k, d in enumerate(id_digits):
        ids = ids + jax.lax.dynamic_slice(d, (start,), (size,)).astype(jnp.int64) * base ** k
    ids = jnp.where(w, ids, 0)
    over = (ids >= numel).any()
    wrong = (w & (jax.lax.dynamic_slice(check, (start,), (size,)).astype(jnp.int64)
                  != _check_digit(ids, base))).any()
    v = jnp.where(w, ids, -1)
    valid = w
    idx = jnp.arange(size, dtype=jnp.int64)
    rowstart = idx % cols == 0
    prev_valid = jnp.concatenate([jnp.zeros(1, bool), valid[:-1]])
    forced = valid & (rowstart | ~prev_valid)
    dd = jnp.concatenate([jnp.zeros(2, jnp.int64), v[2:] - 2 * v[1:-1] + v[:-2]])
    prev_forced = jnp.concatenate([jnp.ones(1, bool), forced[:-1]])
    cand = forced | (valid & ~prev_forced & (dd != 0) & (idx >= 2))
    next_valid = jnp.concatenate([valid[1:], jnp.zeros(1, bool)])
    next_forced = jnp.concatenate([forced[1:], jnp.zeros(1, bool)])
    last = valid & (~next_valid | next_forced)
    keep = idx >= keep_from
    cand, last = cand & keep, last & keep
    pos, n_cand = _first_true(cand, cap)
    lpos, n_last = _first_true(last, cap)
    counts = jnp.stack([jnp.where(over, 1, jnp.where(wrong, 2, 0)).astype(jnp.int64),
                        n_cand, n_last])
    return (counts, pos, forced[pos].astype(jnp.int8), v[pos],
            v[jnp.minimum(pos + 1, size - 1)], lpos)


def _first_true(mask, cap):
    """``(positions of the first cap true elements (sorted; padding: the last index), count)``:
    a prefix count and a binary search per output, not a scatter over every element."""
    cs = jnp.cumsum(mask, dtype=jnp.int32)
    pos = jnp.searchsorted(cs, jnp.arange(1, cap + 1, dtype=jnp.int32), side="left")
    return jnp.minimum(pos, mask.shape[0] - 1).astype(jnp.int64), cs[-1].astype(jnp.int64)


def _check_digit(ids, base):
    """:func:`~wb.algorithms.probing.idcode.check_digit` of int64 ids (power-of-two base), in
    uint64."""
    bits, mask = base.bit_length() - 1, np.uint64(base - 1)
    u = ids.astype(jnp.uint64)
    h = jax.lax.shift_right_logical((u >> np.uint64(bits)) * np.uint64(idcode.ROW_MUL),
                                    np.uint64(idcode.ROW_SHIFT))
    col = (u & mask) * np.uint64(idcode.COL_MUL % base)
    return ((h + col) & mask).astype(jnp.int64)
