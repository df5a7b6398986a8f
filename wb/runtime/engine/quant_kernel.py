"""The CUDA kernel of the FP8 quantiser (:mod:`wb.runtime.engine.fp8`): its source, compiled once
per source dtype and format, and the layout of the block and task tables it reads."""

from __future__ import annotations

import functools

from wb.data.dtypes import dtype_info
from wb.data.fp8 import FORMATS
from wb.runtime.engine.casts import CAST_DEVICE_CODE, FLOAT_BITS

__all__ = ["GIVEN", "PARTS", "QUANT", "ROW", "SLOT", "TASK", "THREADS", "WHOLE", "kernel_source",
           "quant_kernel"]

#: Kernel modes: quantise whole blocks; only write each part's amax; encode with a given amax.
WHOLE, PARTS, GIVEN = 0, 1, 2
#: Columns of a block's row (:func:`wb.runtime.engine.fp8.block_table`) and of a task's (the
#: source's, weights' and scales' addresses, the tensor's rows, columns and grid columns,
#: its mode, one unused); ``SLOT``: the row column of the block's amax slot.
ROW, TASK, SLOT = 12, 8, 11
THREADS = 256  # per CUDA block (one quantisation block each)

#: One CUDA block per quantisation block, the row ``blockIdx.x`` of a block table
#: (:func:`~wb.runtime.engine.fp8.block_table`; its task's row gives the source, weights and
#: scales addresses and the tensor's shape): its elements' positions in the source buffer (as
#: :meth:`wb.algorithms.fp8.tasks.Task.positions` computes them: -1 outside the tensor or the
#: window held), ``amax`` reduced in shared memory (NaN if any element is NaN; ``mode`` 1:
#: written to ``given[slot]``, and done; ``mode`` 2: read from there instead, a part's block;
#: ``mode_all`` -1: each task's own mode),
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
#: :func:`wb_f64`). Where the block's lines along an axis lie contiguous in memory and 16-byte
#: aligned (row-major shards, and their transposes), each thread reads 16 bytes of values at once
#: and writes their encoded bytes at once; ``float8_e4m3fn`` is encoded by the GPU's conversion
#: instruction where it has one (``wb_enc_e4m3``: equal to ``wb_enc_f`` for every float32, which
#: ``tests/test_fp8_cuda.py`` checks).
QUANT = r"""
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
__device__ unsigned int wb_enc_e4m3(float v) {  /* wb_enc_f(v, 4, 3, true) */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short r;  /* one instruction: rounded to nearest even, beyond +-448 to +-448 */
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(v));
    return v != v ? 0x7fu : r & 0xffu;
#else
    return wb_enc_f(v, 4, 3, true);
#endif
}
__device__ float wb_scaled(float x, float s, bool finite, bool zero) {
    return finite ? (zero ? 0.0f : wb_div(x, s)) : __uint_as_float(0x7fc00000u);
}
__device__ long long wb_pos(int k, int bh, int bw, long long br, long long bc, long long rows,
                            long long cols, long long a0, long long a1, long long a2,
                            const long long* w, long long o, const long long* gather) {
    int i = k / bw, j = k - (k / bw) * bw;
    if (o >= 0) return gather[o + k];
    if (br * bh + i >= rows || bc * bw + j >= cols) return -1;
    if (i < w[0] || i >= w[1] || j < w[2] || j >= w[3]) return -1;
    return a0 + (i - w[0]) * a1 + (j - w[2]) * a2;
}
struct __align__(16) wb_sv { SRC v[VEC]; };  /* VEC source values: one 16-byte load */
struct __align__(VEC) wb_qv { unsigned char v[VEC]; };  /* their VEC encoded bytes */
extern "C" __global__ void wb_quant(const long long* blk, const long long* tsk,
        const long long* gather, double* given, long long n, int bh, int bw, int mode_all) {
    __shared__ unsigned int s_max[THREADS];
    long long b = blockIdx.x;
    if (b >= n) return;
    int t = threadIdx.x, per = bh * bw;
    const long long* r = blk + ROW * b;  /* this block's row, then its task's */
    const long long* tk = tsk + TASK * r[0];
    const SRC* src = (const SRC*)tk[0];
    unsigned char* q = (unsigned char*)tk[1];
    unsigned int* scales = (unsigned int*)tk[2];
    long long rows = tk[3], cols = tk[4], gc = tk[5];
    int mode = mode_all >= 0 ? mode_all : (int)tk[6];
    long long lb = r[1], key = r[2], br = key / gc, bc = key % gc, o = r[6], slot = r[11];
    long long a0 = r[3], a1 = r[4], a2 = r[5];
    const long long* w = r + 7;
    /* whole lines of the block along an axis contiguous in memory, 16-byte aligned: VEC
       values read at once, nv per line, lines ostride apart (nvec values in all; -1: element by
       element, as wb_pos places them) */
    long long nv = 0, ostride = 0, nvec = -1, lines = 0;
    if (a2 == 1 && bw % VEC == 0 && w[2] == 0 && w[3] >= bw && (bc + 1) * bw <= cols) {
        nv = bw / VEC, ostride = a1, lines = min(min(w[1], (long long)bh), rows - br * bh) - w[0];
    } else if (a1 == 1 && bh % VEC == 0 && w[0] == 0 && w[1] >= bh && (br + 1) * bh <= rows) {
        nv = bh / VEC, ostride = a2, lines = min(min(w[3], (long long)bw), cols - bc * bw) - w[2];
    }
    if (nv && o < 0 && ostride % VEC == 0 && (unsigned long long)(src + a0) % 16 == 0
            && (unsigned long long)(q + a0) % VEC == 0)
        nvec = lines > 0 ? lines * nv : 0;
    unsigned int amax;  /* the bits of the largest magnitude; above 0x7f800000: NaN */
    if (mode == 2) {
        amax = __float_as_uint(wb_f32(given[slot]));  /* a float32, exchanged as a double */
    } else {
        unsigned int top = 0u;  /* magnitudes' bits order as the magnitudes, NaNs above all */
        if (nvec >= 0) {
#pragma unroll 4
            for (long long k = t; k < nvec; k += THREADS) {
                long long i = k / nv;
                wb_sv x = *(const wb_sv*)(src + a0 + i * ostride + (k - i * nv) * VEC);
                for (int e = 0; e < VEC; e++) {
                    unsigned int m = __float_as_uint(DEC(x.v[e])) & 0x7fffffffu;
                    top = m > top ? m : top;
                }
            }
        } else {
            for (int k = t; k < per; k += THREADS) {
                long long p = wb_pos(k, bh, bw, br, bc, rows, cols, a0, a1, a2, w, o, gather);
                if (p < 0) continue;
                unsigned int m = __float_as_uint(DEC(src[p])) & 0x7fffffffu;
                top = m > top ? m : top;
            }
        }
        s_max[t] = top;
        __syncthreads();
        for (int h = THREADS / 2; h > 0; h >>= 1) {
            if (t < h && s_max[t + h] > s_max[t]) s_max[t] = s_max[t + h];
            __syncthreads();
        }
        amax = s_max[0] > 0x7f800000u ? 0x7fc00000u : s_max[0];
        if (mode == 1) {
            if (t == 0) given[slot] = wb_f64(__uint_as_float(amax));
            return;
        }
    }
    bool nan = amax > 0x7f800000u, finite = amax < 0x7f800000u;
    float s = wb_div(__uint_as_float(amax), FMAX);
    unsigned int sb = __float_as_uint(s);
    if (t == 0) scales[lb] = nan ? 0x7fc00000u : sb;
    bool zero = (sb & 0x7fffffffu) == 0u;
    if (nvec >= 0) {
#pragma unroll 4
        for (long long k = t; k < nvec; k += THREADS) {
            long long i = k / nv, p = a0 + i * ostride + (k - i * nv) * VEC;
            wb_sv x = *(const wb_sv*)(src + p);
            wb_qv y;
            for (int e = 0; e < VEC; e++)
                y.v[e] = (unsigned char)ENC(wb_scaled(DEC(x.v[e]), s, finite, zero));
            *(wb_qv*)(q + p) = y;
        }
        return;
    }
    for (int k = t; k < per; k += THREADS) {
        long long p = wb_pos(k, bh, bw, br, bc, rows, cols, a0, a1, a2, w, o, gather);
        if (p < 0) continue;
        q[p] = (unsigned char)ENC(wb_scaled(DEC(src[p]), s, finite, zero));
    }
}
"""


def kernel_source(src: str, fmt: str, threads: int = THREADS) -> str:
    """The CUDA source of :data:`QUANT` for ``src`` values (raw bits) into ``fmt``, with
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
    enc = ("wb_enc_e4m3(Y)" if fmt == "float8_e4m3fn" else
           f"wb_enc_f(Y, {eb}, {m}, {str(fn).lower()})")
    defs = (f"#define SRC {bits}\n#define THREADS {threads}\n#define FMAX {FORMATS[fmt]!r}f\n"
            f"#define ROW {ROW}\n#define TASK {TASK}\n"
            f"#define VEC {16 // dtype_info(src).itemsize}\n"
            f"#define DEC(X) {dec}\n#define ENC(Y) {enc}\n")
    return defs + CAST_DEVICE_CODE + QUANT


@functools.lru_cache(maxsize=None)
def quant_kernel(src: str, fmt: str):
    """The compiled :func:`kernel_source` for ``src`` values into ``fmt``."""
    import cupy  # only CUDA buffers come here

    k = cupy.RawKernel(kernel_source(src, fmt), "wb_quant")
    k.compile()
    return k
