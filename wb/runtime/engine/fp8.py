"""A trainer's quantisation before each update: its blocks of the declared tensors, gathered from
its live buffers, quantised into the buffers the plan sends (:mod:`wb.algorithms.fp8.tasks`).
Blocks it holds only a part of take two steps: each part's ``amax`` first, then, once the
caller has exchanged those with the other holders (``exchange``), the part encoded with the
whole block's ``amax``.

Host buffers use numpy (:func:`wb.algorithms.fp8.tasks.quantize_buffers`). CUDA buffers use one
CUDA kernel on their device (:data:`_QUANT`, one launch per task), by the rule of
:mod:`wb.data.fp8` computed in double (exact for every value a block holds; a quotient of
two floats rounded to double and then to float32 is the float32 quotient): values decoded from
their raw bits, ``amax`` and ``x / scale`` in double, each rounded to float32 and then to the
format by the integer and double code of :mod:`wb.runtime.engine.casts` (no flush of subnormals to
zero). It reads each source element twice and writes it once: no temporaries.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from wb.algorithms.fp8.tasks import Quantized, combine_amax, partial_amax, quantize_buffers
from wb.data.fp8 import FORMATS
from wb.data.dtypes import dtype_info
from wb.data.sealed import seal, unseal
from wb.errors import TransferError
from wb.runtime.engine.casts import CAST_DEVICE_CODE, FLOAT_BITS, xp_dtype

__all__ = ["Quantiser", "amax_bytes", "amax_from_bytes", "kernel_source"]


class Quantiser:
    """Trainer ``rank``'s quantisation: its output buffers (zeroed, each on the device and array
    module of the buffer its blocks are read from) and, on CUDA, its gather indices there.

    Args:
        q: from :func:`wb.algorithms.fp8.tasks.quantize_layouts`.
        rank: the trainer's rank.
        live: ``{name: (xp, array)}`` of its buffers (:func:`wb.runtime.engine.buffers.as_array`).
        chunk: elements quantised per kernel launch on a GPU.

    Attributes:
        buffers: ``{name: array}`` to add to the trainer's buffers (what the plan sends).
    """

    def __init__(self, q: Quantized, rank: int, live: Mapping[str, tuple[Any, Any]], *,
                 chunk: int = 1 << 24):
        self.q, self.rank = q, rank
        bh, bw = q.scaled.decl.block
        self.step = max(1, chunk // (bh * bw))  # blocks quantised at once on a GPU
        self.tasks = q.tasks.get(rank, ())
        shapes = q.shapes(rank)
        self.buffers: dict[str, Any] = {}
        self._on: dict[int, tuple] = {}  # task index -> its blocks' arrays on its device
        self._args: dict[tuple, tuple] = {}  # (task, mode) -> (source, its launches)
        for i, task in enumerate(self.tasks):
            xp, src = live[task.source]
            for name in (task.weights, task.scales):
                if name in self.buffers:  # a quantised copy serves every tensor in its buffer
                    continue
                shape, dtype = shapes[name]
                if xp is np:
                    self.buffers[name] = np.zeros(shape, xp_dtype(np, dtype))
                else:
                    with xp.cuda.Device(src.device.id):
                        self.buffers[name] = xp.zeros(shape, xp_dtype(xp, dtype))
            if xp is not np:
                with xp.cuda.Device(src.device.id):
                    blocks, at, gather, odd, win = task.device_arrays(xp, bh, bw)
                    # the kernel reads `gather` only for blocks listed there: any array will do
                    gather = gather.reshape(-1) if gather.size else xp.full(1, -1, np.int64)
                    amax = xp.zeros(max(task.blocks.size, 1), np.float64)  # parts' amax
                    self._on[i] = (blocks, at, gather, odd, win, amax)
        # the tasks whose buffers are on the host (numpy), decided once: devices do not change
        host = tuple(t for t in self.tasks if live[t.source][0] is np)
        self._host = Quantized(q.scaled, q.trainers, {rank: host}) if host else None

    @property
    def parts(self) -> bool:
        """Whether it holds blocks in part (``run`` then needs ``exchange``)."""
        return any(t.part for t in self.tasks)

    def run(self, live: Mapping[str, tuple[Any, Any]], exchange=None) -> None:
        """Fills :attr:`buffers` from the ``live`` buffers (as given at set-up, or new ones of the
        same shapes), finished when this returns.

        Args:
            live: ``{name: (xp, array)}`` of its buffers.
            exchange: where it holds blocks in part: ``exchange(keys, amax)`` gets its parts'
                ``amax`` (:func:`wb.algorithms.fp8.tasks.partial_amax`) and returns
                ``(keys, amax)`` over the whole blocks, every other holder's parts included.
        """
        for ev in self.launch(live, exchange).values():
            ev.synchronize()

    def launch(self, live: Mapping[str, tuple[Any, Any]], exchange=None, *,
               order: list[str] | None = None) -> dict[str, Any]:
        """Starts filling :attr:`buffers` from the ``live`` buffers: host tasks are done when
        this returns; CUDA tasks are queued, one after another, and each output buffer gets the
        event after the last task that writes it (what an update waits for before it sends
        from that buffer: :meth:`wb.runtime.engine.program.Program.run`'s ``ready``).

        Args:
            live, exchange: as :meth:`run` (blocks held in part are exchanged first, at once).
            order: output buffer names in the order an update first sends from them: their
                tasks are queued in that order (others after).

        Returns:
            ``{output buffer name: event}`` of the CUDA tasks (``.done``, ``.synchronize()``).
        """
        amax = None
        if self.parts:
            if exchange is None:
                raise TransferError(f"rank {self.rank} holds FP8 blocks in part: quantising them "
                                    f"needs the other holders' amax (exchange=)")
            amax = exchange(*self._partial_amax(live))
        if self._host is not None:
            host = self._host.tasks[self.rank]
            quantize_buffers(self._host, self.rank, {t.source: live[t.source][1] for t in host},
                             out={n: self.buffers[n] for t in host for n in (t.weights, t.scales)},
                             amax=amax)
        first = {n: k for k, n in enumerate(order or ())}
        tasks = [i for i in sorted(range(len(self.tasks)), key=lambda i: (
            min(first.get(self.tasks[i].weights, len(first)),
                first.get(self.tasks[i].scales, len(first))), i))
            if live[self.tasks[i].source][0] is not np]
        # the whole blocks' amax of parts, where the kernels read it: copied before any kernel
        # is queued (a copy from host memory waits for the kernels queued before it)
        for i in tasks:
            task = self.tasks[i]
            if task.part:
                xp, src = live[task.source]
                with xp.cuda.Device(src.device.id):
                    self._on[i][5][:task.blocks.size] = xp.asarray(
                        amax[1][np.searchsorted(amax[0], task.keys())])
        ready: dict[str, Any] = {}
        with contextlib.ExitStack() as on_device:
            device = None
            for n, i in enumerate(tasks):
                task = self.tasks[i]
                xp, src = live[task.source]
                if device != src.device.id:  # entered once per run of tasks on one device
                    device = src.device.id
                    on_device.enter_context(xp.cuda.Device(device))
                view = self._view(task, src)
                for kernel, grid, args in self._launches(i, _GIVEN if task.part else _WHOLE):
                    kernel(grid, (_THREADS,), (view, *args))
                nxt = self.tasks[tasks[n + 1]] if n + 1 < len(tasks) else None
                if nxt is None or (nxt.weights, nxt.scales) != (task.weights, task.scales):
                    # the end of a run of tasks writing the same buffers: their event
                    ev = xp.cuda.Event(block=False, disable_timing=True)
                    ev.record()
                    ready[task.weights] = ready[task.scales] = ev
        return ready

    def _launches(self, i: int, mode: int) -> list:
        """``[(kernel, grid, args but the source)]`` of task ``i`` in ``mode``, made once
        (slicing device arrays and boxing scalars costs more than the launch itself). The
        source is not kept: a trainer may hand new arrays at every push."""
        key = (i, mode)
        got = self._args.get(key)
        if got is None:
            task = self.tasks[i]
            got = self._args[key] = [self._launch_args(task, self._on[i], lo, lo + self.step,
                                                       mode)
                                     for lo in range(0, task.blocks.size, self.step)]
        return got

    def _view(self, task, src):
        """``src`` as the raw unsigned integers the kernel reads."""
        scaled = self.q.scaled
        itemsize = dtype_info(scaled.trainer_spec.dtype(scaled.names[task.tensor])).itemsize
        return src.reshape(-1).view(_RAW[itemsize])

    def _partial_amax(self, live) -> tuple[np.ndarray, np.ndarray]:
        """``(keys, amax)`` of the parts it holds, on the host and on its devices."""
        out = []
        if self._host is not None:
            host = self._host.tasks[self.rank]
            out.append(partial_amax(self._host, self.rank,
                                    {t.source: live[t.source][1] for t in host}))
        mine = [(i, t) for i, t in enumerate(self.tasks)
                if t.part and live[t.source][0] is not np]
        for i, task in mine:  # every kernel queued first, then read back
            xp, src = live[task.source]
            with xp.cuda.Device(src.device.id):
                view = self._view(task, src)
                for kernel, grid, args in self._launches(i, _PARTS):
                    kernel(grid, (_THREADS,), (view, *args))
        for i, task in mine:
            xp, src = live[task.source]
            with xp.cuda.Device(src.device.id):
                out.append((task.keys(), xp.asnumpy(self._on[i][5][:task.blocks.size])))
        return combine_amax(out)

    def _launch_args(self, task, on, lo, hi, mode) -> tuple:
        """Blocks ``lo:hi`` of ``task`` as one kernel launch (:data:`_QUANT`): one CUDA block per
        quantisation block finds its elements, ``amax`` (``mode`` :data:`_PARTS`: only that,
        into ``on[5]``; :data:`_GIVEN`: read from there) and the scale, then writes each value."""
        scaled, decl = self.q.scaled, self.q.scaled.decl
        t = task.tensor
        src_dtype = scaled.trainer_spec.dtype(scaled.names[t])
        blocks, at, gather, odd, win, amax = on
        hi = min(hi, task.blocks.size)
        bh, bw = decl.block
        q = self.buffers[task.weights].reshape(-1)
        scales = self.buffers[task.scales].reshape(-1)[lo:hi]
        return (_quant_kernel(src_dtype, decl.format), (hi - lo,),
                (at[lo:hi], blocks[lo:hi], odd[lo:hi], gather,
                 win[lo:hi], np.int64(hi - lo), np.int32(bh), np.int32(bw),
                 np.int64(scaled.rows[t]), np.int64(scaled.cols[t]),
                 np.int64(scaled.grid_cols[t]), np.int32(mode), amax[lo:hi], q.view(np.uint8),
                 scales.view(np.uint32)))


def amax_bytes(keys: np.ndarray, amax: np.ndarray) -> bytes:
    """``(keys, amax)`` of block parts (:func:`wb.algorithms.fp8.tasks.partial_amax`) as sealed
    bytes for the store (:mod:`wb.data.sealed`): their count, the int64 keys, the float64 amax
    (little-endian)."""
    return seal("FP8 amax exchange", np.int64(keys.size).astype("<i8").tobytes()
                + keys.astype("<i8").tobytes() + amax.astype("<f8").tobytes())


def amax_from_bytes(b: bytes, *, where: str = "an FP8 amax exchange") -> tuple[np.ndarray,
                                                                               np.ndarray]:
    """The inverse of :func:`amax_bytes`, once the digest matches.

    Raises:
        TransferError: the bytes changed since they were written, or hold no whole count of
            keys and amax; names ``where``.
    """
    p = unseal("FP8 amax exchange", b, where=where, remedy="the rendezvous store is corrupt")
    n = int(np.frombuffer(p, "<i8", 1)[0]) if len(p) >= 8 else -1
    if n < 0 or len(p) != 8 + 16 * n:
        raise TransferError(f"{where} holds {len(p)} bytes, not a count and as many int64 keys "
                            f"and float64 amax")
    return np.frombuffer(p, "<i8", n, 8), np.frombuffer(p, "<f8", n, 8 + 8 * n)


#: The unsigned integers a kernel reads a source's values as, by item size.
_RAW = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32),
        8: np.dtype(np.uint64)}
#: Kernel modes: quantise whole blocks; only write each part's amax; encode with a given amax.
_WHOLE, _PARTS, _GIVEN = 0, 1, 2
_THREADS = 256  # per CUDA block (one quantisation block each)

#: One CUDA block per quantisation block: its elements' positions in the source buffer (as
#: :meth:`wb.algorithms.fp8.tasks.Task.positions` computes them: -1 outside the tensor or the
#: window held), ``amax`` reduced in shared memory (NaN if any element is NaN; ``mode`` 1:
#: written to ``amax[b]``, and done; ``mode`` 2: read from ``amax[b]`` instead, a part's block),
#: ``scale = float32(amax / FMAX)``, then every element ``float32(x / scale)`` (0 for a zero
#: scale, NaN for a non-finite amax) encoded in the format.
#: In float32, as fast as memory allows: every value of the source dtypes but float64 is a
#: float32, the amax is one of them, and a quotient of two float32 rounded once to float32
#: is the quotient rounded to double and then to float32, as the rule computes it; the format's
#: encoding rounds a float32's bits with integers (:func:`wb_enc_f`), as
#: :mod:`wb.runtime.engine.casts` does a double. No subnormal is flushed to zero: CuPy compiles
#: every kernel with ``-ftz=true``, which flushes float32 subnormals in and out of float32
#: arithmetic, so the amax is the largest of the magnitudes' bits (integers), and the divisions
#: and conversions are PTX instructions without ``.ftz`` (:func:`wb_div`, :func:`wb_f32`,
#: :func:`wb_f64`).
_QUANT = r"""
#ifdef __CUDA_ARCH__
__device__ float wb_div(float a, float b) {  /* a / b rounded to nearest, subnormals kept */
    float r; asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
}
__device__ float wb_f32(double a) {
    float r; asm("cvt.rn.f32.f64 %0, %1;" : "=f"(r) : "d"(a)); return r;
}
__device__ double wb_f64(float a) {
    double r; asm("cvt.f64.f32 %0, %1;" : "=d"(r) : "f"(a)); return r;
}
#else
__device__ float wb_div(float a, float b) { return a / b; }
__device__ float wb_f32(double a) { return (float)a; }
__device__ double wb_f64(float a) { return (double)a; }
#endif
__device__ unsigned int wb_enc_f(float v, int EB, int M, bool fn) {
    unsigned int u = __float_as_uint(v), e32 = (u >> 23) & 0xffu, m32 = u & 0x7fffffu;
    unsigned int sign = (u >> 31) << (EB + M), emask = (1u << EB) - 1u, inf = emask << M;
    unsigned int top = fn ? ((emask << M) | ((1u << M) - 2u))
                          : (((emask - 1u) << M) | ((1u << M) - 1u));
    int bias = (1 << (EB - 1)) - 1, emin = 1 - bias;
    if (e32 == 0xffu) {
        if (m32) return fn ? ((emask << M) | ((1u << M) - 1u)) : (inf | (1u << (M - 1)));
        return sign | (fn ? top : inf);
    }
    /* zero, and float32 subnormals (below 2**-126: less than half of any 8-bit format's least
       subnormal): zero of the sign */
    if (e32 == 0u) return sign;
    unsigned int sig = m32 | 0x800000u;
    int ue = (int)e32 - 127, E = ue > emin ? ue : emin;
    int shift = 23 - M + (E - ue);  /* the significand in units of 2**(E - M), ties to even */
    unsigned int q;
    if (shift >= 25) q = 0u;
    else {
        unsigned int rem = sig & ((1u << shift) - 1u), half = 1u << (shift - 1);
        q = sig >> shift;
        if (rem > half || (rem == half && (q & 1u))) q += 1u;
    }
    if (q >= (1u << (M + 1))) { E += 1; q >>= 1; }
    unsigned int bits = q < (1u << M) ? q : ((unsigned int)(E - emin + 1) << M) | (q - (1u << M));
    if (bits > top) bits = fn ? top : inf;
    return sign | bits;
}
__device__ long long wb_pos(int k, int bh, int bw, long long br, long long bc, long long rows,
                            long long cols, long long a0, long long a1, long long a2,
                            const long long* w, long long o, const long long* gather) {
    int i = k / bw, j = k - (k / bw) * bw;
    if (o >= 0) return gather[o * (long long)(bh * bw) + k];
    if (br * bh + i >= rows || bc * bw + j >= cols) return -1;
    if (i < w[0] || i >= w[1] || j < w[2] || j >= w[3]) return -1;
    return a0 + (i - w[0]) * a1 + (j - w[2]) * a2;
}
extern "C" __global__ void wb_quant(const SRC* src, const long long* at, const long long* keys,
        const long long* odd, const long long* gather, const long long* win, long long n,
        int bh, int bw, long long rows, long long cols, long long gc, int mode, double* given,
        unsigned char* q, unsigned int* scales) {
    __shared__ unsigned int s_max[THREADS];
    long long b = blockIdx.x;
    if (b >= n) return;
    int t = threadIdx.x, per = bh * bw;
    long long key = keys[b], br = key / gc, bc = key % gc, o = odd[b];
    long long a0 = at[3 * b], a1 = at[3 * b + 1], a2 = at[3 * b + 2];
    const long long* w = win + 4 * b;
    unsigned int amax;  /* the bits of the largest magnitude; above 0x7f800000: NaN */
    if (mode == 2) {
        amax = __float_as_uint(wb_f32(given[b]));  /* a float32, exchanged as a double */
    } else {
        unsigned int top = 0u;  /* magnitudes' bits order as the magnitudes, NaNs above all */
        for (int k = t; k < per; k += THREADS) {
            long long p = wb_pos(k, bh, bw, br, bc, rows, cols, a0, a1, a2, w, o, gather);
            if (p < 0) continue;
            unsigned int m = __float_as_uint(DEC(src[p])) & 0x7fffffffu;
            top = m > top ? m : top;
        }
        s_max[t] = top;
        __syncthreads();
        for (int h = THREADS / 2; h > 0; h >>= 1) {
            if (t < h && s_max[t + h] > s_max[t]) s_max[t] = s_max[t + h];
            __syncthreads();
        }
        amax = s_max[0] > 0x7f800000u ? 0x7fc00000u : s_max[0];
        if (mode == 1) {
            if (t == 0) given[b] = wb_f64(__uint_as_float(amax));
            return;
        }
    }
    bool nan = amax > 0x7f800000u, finite = amax < 0x7f800000u;
    float s = wb_div(__uint_as_float(amax), FMAX);
    unsigned int sb = __float_as_uint(s);
    if (t == 0) scales[b] = nan ? 0x7fc00000u : sb;
    for (int k = t; k < per; k += THREADS) {
        long long p = wb_pos(k, bh, bw, br, bc, rows, cols, a0, a1, a2, w, o, gather);
        if (p < 0) continue;
        float x = DEC(src[p]);
        float y = finite ? ((sb & 0x7fffffffu) == 0u ? 0.0f : wb_div(x, s))
                         : __uint_as_float(0x7fc00000u);
        q[p] = (unsigned char)ENC(y);
    }
}
"""


def kernel_source(src: str, fmt: str, threads: int = _THREADS) -> str:
    """The CUDA source of :data:`_QUANT` for ``src`` values (raw bits) into ``fmt``, with
    ``threads`` per block (``tests/test_quant_kernel_host.py`` compiles it for the host too)."""
    bits = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int",
            8: "unsigned long long"}[dtype_info(src).itemsize]
    if src == "bfloat16":  # the upper half of a float32
        dec = "__uint_as_float(((unsigned int)(X)) << 16)"
    elif src == "float32":
        dec = "__uint_as_float((unsigned int)(X))"
    elif src == "float64":  # rounded to float32 first, as the rule (to nearest, ties to even)
        dec = "wb_f32(__longlong_as_double((long long)(X)))"
    else:  # exact in float32
        eb, m, fn = FLOAT_BITS[src]
        dec = f"(float)wb_dec((unsigned long long)(X), {eb}, {m}, {str(fn).lower()})"
    eb, m, fn = FLOAT_BITS[fmt]
    defs = (f"#define SRC {bits}\n#define THREADS {threads}\n#define FMAX {FORMATS[fmt]!r}f\n"
            f"#define DEC(X) {dec}\n#define ENC(Y) wb_enc_f(Y, {eb}, {m}, {str(fn).lower()})\n")
    return defs + CAST_DEVICE_CODE + _QUANT


@functools.lru_cache(maxsize=None)
def _quant_kernel(src: str, fmt: str):
    """The compiled :func:`kernel_source` for ``src`` values into ``fmt``."""
    import cupy  # only CUDA buffers come here

    k = cupy.RawKernel(kernel_source(src, fmt), "wb_quant")
    k.compile()
    return k
