"""Float conversions inside an update: where a piece's travelling dtype differs from the buffer it
is packed from or unpacked into.

On the host, :func:`wb.data.dtypes.convert` (numpy and ``ml_dtypes``). On CUDA, one CuPy kernel
per pair of dtypes, made on first use: CuPy has no bfloat16 or float8, so every CUDA buffer is
read and written as raw bits of its width, decoded to a double (exact for every dtype wb
converts) and encoded again with round to nearest even (``rint``) by the same rules as the host:
overflow to infinity, or to +-448 in ``float8_e4m3fn``; NaN to the dtype's quiet NaN; float64
through float32 into narrower dtypes. Only integer and double arithmetic is used (float32
arithmetic may flush subnormals to zero).

Examples:
    >>> import numpy as np
    >>> from wb.data.dtypes import dtype_info
    >>> out = np.empty(2, dtype_info("bfloat16").numpy)
    >>> assign(np, out, np.array([1.00390625, 3.0], np.float32), "bfloat16", "float32")
    >>> out.tolist()
    [1.0, 3.0]
"""

from __future__ import annotations

import functools
import types
from typing import Any

import numpy as np

from wb.data.dtypes import convert, dtype_info
from wb.runtime.engine.dlpack import RAW_BITS

__all__ = ["assign", "prepare", "xp_dtype", "FLOAT_BITS", "CAST_DEVICE_CODE"]

# exponent bits, mantissa bits, and whether the top exponent holds numbers (no infinity: "fn")
FLOAT_BITS = types.MappingProxyType({"float32": (8, 23, False), "float16": (5, 10, False),
                                   "bfloat16": (8, 7, False),
                                   "float8_e4m3fn": (4, 3, True), "float8_e5m2": (5, 2, False)})

CAST_DEVICE_CODE = r"""
__device__ double wb_dec(unsigned long long b, int EB, int M, bool fn) {
    int bias = (1 << (EB - 1)) - 1;
    unsigned long long emask = (1ull << EB) - 1, mmask = (1ull << M) - 1;
    bool neg = (b >> (EB + M)) & 1;
    unsigned long long e = (b >> M) & emask, m = b & mmask;
    double v;
    if (fn && e == emask && m == mmask) return __longlong_as_double(0x7ff8000000000000LL);
    if (!fn && e == emask) {
        if (m) return __longlong_as_double(0x7ff8000000000000LL);
        v = __longlong_as_double(0x7ff0000000000000LL);
    }
    else if (e == 0) v = ldexp((double)m, 1 - bias - M);
    else v = ldexp((double)(m | (1ull << M)), (int)e - bias - M);
    return neg ? -v : v;
}
__device__ unsigned long long wb_enc(double v, int EB, int M, bool fn) {
    int bias = (1 << (EB - 1)) - 1, emin = 1 - bias;
    unsigned long long emask = (1ull << EB) - 1, sign = (unsigned long long)signbit(v) << (EB + M);
    unsigned long long inf = emask << M;
    unsigned long long top = fn ? ((emask << M) | ((1ull << M) - 2)) : (((emask - 1) << M) | ((1ull << M) - 1));
    if (isnan(v)) return fn ? ((emask << M) | ((1ull << M) - 1)) : (inf | (1ull << (M - 1)));
    double a = fabs(v);
    if (isinf(a)) return sign | (fn ? top : inf);
    if (a == 0.0) return sign;
    int e;
    frexp(a, &e);
    int E = max(e - 1, emin);
    double q = rint(ldexp(a, M - E));  /* the significand in units of 2**(E - M), ties to even */
    if (q >= ldexp(1.0, M + 1)) { E += 1; q = ldexp(q, -1); }
    unsigned long long bits = q < ldexp(1.0, M) ? (unsigned long long)q
        : ((unsigned long long)(E - emin + 1) << M) | ((unsigned long long)q - (1ull << M));
    if (bits > top) bits = fn ? top : inf;
    return sign | bits;
}
"""


def xp_dtype(xp, name: str):
    """How arrays of module ``xp`` hold dtype ``name``: numpy its own dtype; CuPy raw bits where it
    lacks the dtype (bfloat16, float8), as :func:`wb.runtime.engine.buffers.as_array` gives them."""
    info = dtype_info(name)
    if xp is np or name not in RAW_BITS:
        return info.numpy
    return np.dtype(f"u{info.itemsize}")


def assign(xp, dst: Any, src: Any, dst_dtype: str, src_dtype: str) -> None:
    """``dst[...] = src``, converting from ``src_dtype`` to ``dst_dtype`` (names of
    :mod:`wb.data.dtypes`); the arrays are of module ``xp`` (numpy, or CuPy: as
    :func:`xp_dtype` holds them), of one shape, ``dst`` writable (strided views are fine)."""
    if dst_dtype == src_dtype:
        dst[...] = src
    elif xp is np:
        convert(dst, src)
    else:
        raw_in = np.dtype(f"u{dtype_info(src_dtype).itemsize}")
        raw_out = np.dtype(f"u{dtype_info(dst_dtype).itemsize}")
        _kernel(src_dtype, dst_dtype)(src.view(raw_in), dst.view(raw_out))


def prepare(xp, pairs) -> None:
    """Compiles and loads the CUDA kernels of ``pairs`` (``(src dtype, dst dtype)``) now, once per
    process, so no update pays for it (a first launch compiles: about 0.1 s each)."""
    if xp is np:
        return
    for src, dst in sorted(pairs):
        if src != dst:
            assign(xp, xp.zeros(1, xp_dtype(xp, dst)), xp.zeros(1, xp_dtype(xp, src)), dst, src)


def prepare_copies(xp, dtypes) -> None:
    """Loads CuPy's copy kernels for arrays of ``dtypes`` (CuPy dtypes) now, once per process,
    in the forms packing, unpacking and local copies use (contiguous, and strided two-dimensional
    regions either way): a first copy of a kind compiles or loads its kernel, tens of
    milliseconds that would otherwise stall the first update's first packed message."""
    if xp is np:
        return
    for dt in sorted({np.dtype(d) for d in dtypes}, key=str):
        a, b = xp.zeros((4, 4), dt), xp.zeros((4, 4), dt)
        b[...] = a  # contiguous
        b[:, :2] = a[:, ::2]  # strided both ways
        b.reshape(-1)[:8].reshape(4, 2)[...] = a[:, 1:3]  # packed from a region
        a[:, 1:3] = b.reshape(-1)[:8].reshape(4, 2)  # unpacked into a region
    xp.cuda.runtime.deviceSynchronize()


@functools.lru_cache(maxsize=None)
def _kernel(src: str, dst: str):
    import cupy  # only CUDA buffers come here

    # float32 too goes through the integer code: float arithmetic may flush subnormals to zero
    if src == "float64":
        dec = "__longlong_as_double((long long)x)"
    else:
        eb, m, fn = FLOAT_BITS[src]
        dec = f"wb_dec((unsigned long long)x, {eb}, {m}, {str(fn).lower()})"
    if src == "float64" and dst not in ("float32", "float64"):  # as torch: through float32
        dec = f"wb_dec(wb_enc({dec}, 8, 23, false), 8, 23, false)"
    if dst == "float64":
        enc = "(unsigned long long)__double_as_longlong(v)"
    else:
        eb, m, fn = FLOAT_BITS[dst]
        enc = f"wb_enc(v, {eb}, {m}, {str(fn).lower()})"
    return cupy.ElementwiseKernel(
        "S x", "D y", f"double v = {dec}; y = (D)({enc});",
        f"wb_cast_{src}_to_{dst}", preamble=CAST_DEVICE_CODE)
