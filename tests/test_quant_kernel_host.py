"""The CUDA quantiser's kernel source (``wb.runtime.engine.quant_kernel.kernel_source``), compiled
for the host with one thread per block and run block after block, equals the rule's plain numpy quantiser
(:func:`wb.data.fp8.quantize_tensor`) bit for bit: its positions, amax, scale and
encoding logic are checked on any machine with a C++ compiler (the GPU test
``tests/test_fp8_cuda.py`` runs the same source on the device with 256 threads). The whole CUDA
path of :class:`wb.runtime.engine.fp8.Quantiser` (its block and task tables, launches, events and
the exchange of parts' amax) runs here too, over host memory standing in for a device's."""

import contextlib
import ctypes
import shutil
import subprocess
import types

import numpy as np
import pytest

from wb.data.fp8 import quantize_tensor
from wb.data.dtypes import dtype_info
from wb.runtime.engine.quant_kernel import ROW, SLOT, kernel_source

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")

_HOST = r"""#include <cmath>
#include <cstring>
#include <algorithm>
using namespace std;
#define __device__
#define __global__
#define __shared__ static
#define __align__(n) alignas(n)
struct D3 { int x; };
static D3 threadIdx, blockIdx;
static void __syncthreads() {}
static double __longlong_as_double(long long x) { double d; memcpy(&d, &x, 8); return d; }
static float __uint_as_float(unsigned int x) { float f; memcpy(&f, &x, 4); return f; }
static unsigned int __float_as_uint(float f) { unsigned int x; memcpy(&x, &f, 4); return x; }
static float __fdiv_rn(float a, float b) { return a / b; }  /* IEEE: rounded once, to nearest */
"""
_RUN = r"""
extern "C" void run_all(const long long* blk, const long long* tsk, const long long* gather,
        double* given, long long n, int bh, int bw, int mode_all) {
    for (long long b = 0; b < n; b++) {
        blockIdx.x = (int)b;
        threadIdx.x = 0;
        wb_quant(blk, tsk, gather, given, n, bh, bw, mode_all);
    }
}
"""


def _compiled(src: str, tmp_path, fmt: str = "float8_e4m3fn"):
    kernel = kernel_source(src, fmt, threads=1).replace(
        'extern "C" __global__ void wb_quant', "static void wb_quant")
    cpp, so = tmp_path / f"{src}_{fmt}.cpp", tmp_path / f"{src}_{fmt}.so"
    cpp.write_text(_HOST + kernel + _RUN)
    subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-o", str(so), str(cpp)], check=True)
    return ctypes.CDLL(str(so))


@pytest.mark.parametrize("src", ["bfloat16", "float32", "float16", "float64"])
def test_the_cuda_quantiser_source_follows_the_rule(src, tmp_path):
    lib = _compiled(src, tmp_path)
    dt = np.dtype(dtype_info(src).numpy)
    rng = np.random.default_rng(0)
    low = -6 if src == "float16" else -30
    # the last four: whole rows of 16-byte multiples, which the kernel reads 16 bytes at once
    shapes = [(4, 4), (8, 4), (3, 5), (16, 16), (4, 8), (2, 2)] * 2 + [(16, 16), (4, 16), (8, 32),
                                                                        (2, 16)]
    for trial, (bh, bw) in enumerate(shapes):
        rows, cols = int(rng.integers(1, 40)), int(rng.integers(1, 40))
        if trial >= 12:
            cols = bw * int(rng.integers(1, 4))
        scale = 10.0 ** rng.integers(low, 5, size=(rows, cols))
        with np.errstate(all="ignore"):  # tiny values underflow to subnormals and zeros
            x = (rng.standard_normal((rows, cols)) * scale).astype(dt)
        x[0, 0] = [np.inf, np.nan, -0.0, x[0, 0], -np.inf, 0.0][trial % 6]  # non-finite blocks
        if trial == 3:
            x[:bh, :bw] = 0
        gr, gc = -(-rows // bh), -(-cols // bw)
        n = gr * gc
        keys = np.arange(n, dtype=np.int64)
        # blocks in a shuffled order, as a task lists them: positions from (start, strides)
        keys = rng.permutation(keys)
        at = np.stack([(keys // gc) * bh * cols + (keys % gc) * bw, np.full(n, cols),
                       np.ones(n, np.int64)], 1).astype(np.int64)
        win = np.tile(np.array([0, bh, 0, bw], np.int64), (n, 1))
        q, s = np.zeros(rows * cols, np.uint8), np.zeros(n, np.uint32)
        _run(lib, x, at, keys, win, bh, bw, gc, 0, np.zeros(n), q, s)
        want_q, want_s = quantize_tensor(x, (bh, bw))
        assert q.tobytes() == want_q.view(np.uint8).reshape(-1).tobytes(), (src, trial)
        assert s.tobytes() == want_s.reshape(-1)[keys].astype(np.float32).tobytes(), (src, trial)
        # the same blocks split at a row: each part's amax (mode 1), the largest of the two,
        # then each part encoded with it (mode 2), as trainers holding parts of blocks do
        cut = int(rng.integers(1, bh)) if bh > 1 else 0
        given = [np.zeros(n), np.zeros(n)]
        q2, s2 = np.zeros(rows * cols, np.uint8), [np.zeros(n, np.uint32) for _ in range(2)]
        parts = []
        for k, (i0, i1) in enumerate([(0, cut), (cut, bh)]):
            w = np.tile(np.array([i0, i1, 0, bw], np.int64), (n, 1))
            a = at.copy()
            a[:, 0] += i0 * cols
            parts.append((a, w))
            _run(lib, x, a, keys, w, bh, bw, gc, 1, given[k], q2, s2[k])
        whole = np.maximum(given[0], given[1])  # NaN if either is
        for k, (a, w) in enumerate(parts):
            _run(lib, x, a, keys, w, bh, bw, gc, 2, whole.copy(), q2, s2[k])
        assert q2.tobytes() == q.tobytes(), (src, trial, cut)
        assert s2[0].tobytes() == s2[1].tobytes() == s.tobytes(), (src, trial, cut)


def _run(lib, x, at, keys, win, bh, bw, gc, mode, given, q, s):
    """Blocks ``keys`` of ``x`` (rows ``at``, windows ``win``) through the kernel, as one task
    whose table rows hold the host arrays' addresses."""
    rows, cols = x.shape
    raw = np.ascontiguousarray(x).reshape(-1).view(f"u{x.dtype.itemsize}")
    n = keys.size
    blk = np.zeros((n, ROW), np.int64)
    blk[:, 1], blk[:, 2], blk[:, 3:6], blk[:, 6], blk[:, 7:11] = np.arange(n), keys, at, -1, win
    blk[:, SLOT] = np.arange(n)
    tsk = np.array([[raw.ctypes.data, q.ctypes.data, s.ctypes.data, rows, cols, gc, mode, 0]],
                   np.int64)
    gather = np.full(1, -1, np.int64)
    lib.run_all(*(a.ctypes.data_as(ctypes.c_void_p) for a in (blk, tsk, gather, given)),
                ctypes.c_longlong(n), ctypes.c_int(bh), ctypes.c_int(bw), ctypes.c_int(-1))


_ENC = r"""
extern "C" long long mismatches(int EB, int M, int fn, unsigned int* first) {
    long long bad = 0;
    unsigned int lows[] = {0u, 1u, 2u, 0x3ffu, 0x400u, 0x401u, 0x7ffu, 0xfffu, 0x1000u, 0x1001u};
    for (unsigned int sign = 0; sign < 2; sign++)
    for (unsigned int e = 0; e < 256; e++)
    for (unsigned int top = 0; top < 4096; top++)
    for (unsigned int l = 0; l < 10; l++) {
        if ((e < 90 || e > 160) && top > 8 && e != 0 && e != 255) continue;  /* far out: few */
        unsigned int u = (sign << 31) | (e << 23) | (top << 11) | (lows[l] & 0x7ffu);
        if (lows[l] > 0x7ffu) u = (sign << 31) | (e << 23) | ((top << 11) & 0x7ff000u) | lows[l];
        float f = __uint_as_float(u);
        unsigned long long want = wb_enc((double)f, EB, M, fn != 0);
        unsigned int got = wb_enc_f(f, EB, M, fn != 0);
        if (want != got) { if (!bad) *first = u; bad++; }
    }
    return bad;
}
"""


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_the_float32_encoder_rounds_as_the_double_one(fmt, tmp_path):
    """``wb_enc_f`` (the quantiser's encoder of a float32's bits) gives the bits of ``wb_enc``
    (the casts' encoder of a double, which follows ``torch.Tensor.to``) for every float32 sign,
    exponent and top 12 mantissa bits near the formats' range, with the low bits at and around
    a tie: rounding, ties to even, subnormals, overflow, zeros, infinities and NaN."""
    from wb.runtime.engine.casts import FLOAT_BITS

    kernel = kernel_source("float32", "float8_e4m3fn", threads=1).replace(
        'extern "C" __global__ void wb_quant', "static void wb_quant")
    cpp, so = tmp_path / "enc.cpp", tmp_path / "enc.so"
    cpp.write_text(_HOST + kernel + _ENC)
    subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-o", str(so), str(cpp)], check=True)
    lib = ctypes.CDLL(str(so))
    lib.mismatches.restype = ctypes.c_longlong
    first = ctypes.c_uint(0)
    eb, m, fn = FLOAT_BITS[fmt]
    bad = lib.mismatches(eb, m, int(fn), ctypes.byref(first))
    assert bad == 0, f"{bad} float32 values encode otherwise, the first {first.value:#010x}"


class _Mem(np.ndarray):
    """Host memory standing in for a CuPy array: an address (``.data.ptr``), a device id."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)

    @property
    def device(self):
        return types.SimpleNamespace(id=0)


class _Event:
    def __init__(self, **_):
        self.done = False

    def record(self, stream=None):
        self.done = True

    def synchronize(self):
        assert self.done


class _Stream(contextlib.nullcontext):
    """A stream whose work is done when queued (the host kernels run at once)."""

    def __init__(self, **_):
        super().__init__()

    def wait_event(self, event):
        assert event.done


class _HostXP:
    """The part of CuPy the quantiser's CUDA path calls, over host memory (copies copy)."""

    cuda = types.SimpleNamespace(Device=lambda _: contextlib.nullcontext(), Event=_Event,
                                 Stream=_Stream, get_current_stream=_Stream)

    @staticmethod
    def asarray(a):
        return np.array(a).view(_Mem)

    @staticmethod
    def zeros(shape, dtype):
        return np.zeros(shape, dtype).view(_Mem)

    @staticmethod
    def asnumpy(a):
        return np.array(a)


def _host_kernels(tmp_path, launched):
    """``quant_kernel`` for the host: each launch runs its blocks one after another."""
    libs = {}

    def kernel(src, fmt):
        if (src, fmt) not in libs:
            libs[src, fmt] = _compiled(src, tmp_path, fmt)

        def launch(grid, block, args):
            blk, tsk, gather, given, n, bh, bw, mode = args
            assert grid == (int(n),) and blk.shape[0] == int(n) and blk.flags.c_contiguous
            launched.append((src, int(n), int(mode)))
            libs[src, fmt].run_all(*(ctypes.c_void_p(a.ctypes.data)
                                     for a in (blk, tsk, gather, given)),
                                   ctypes.c_longlong(int(n)), ctypes.c_int(int(bh)),
                                   ctypes.c_int(int(bw)), ctypes.c_int(int(mode)))
        return launch
    return kernel


@pytest.mark.parametrize("chunk_blocks", [1, 3, 1000])
def test_the_quantisers_cuda_path_equals_the_host_one(chunk_blocks, tmp_path, monkeypatch):
    """Tensors of two source dtypes, strided (transposed) and gathered element by element, and
    blocks split between three trainers (parts' amax exchanged): the tables, launches of
    ``chunk`` elements give the numpy quantiser's bytes, each launch within ``chunk`` and of
    one source dtype, and every output buffer gets an event."""
    import wb
    from harness.fp8 import lay
    from wb.algorithms.fp8.tasks import combine_amax, quantize_all, quantize_layouts
    from wb.data.fp8 import FP8Blocks
    from wb.runtime.engine import fp8 as engine_fp8

    launched = []
    monkeypatch.setattr(engine_fp8, "quant_kernel", _host_kernels(tmp_path, launched))
    spec = wb.CheckpointSpec({"w": ((300, 260), "bfloat16"), "v": ((70, 90), "float32"),
                              "u": ((64, 40), "bfloat16")})
    sc = FP8Blocks(("w", "v", "u"), block=(32, 16)).bind(spec)
    ids = {n: spec.ids(n).reshape(s) for n, s in (("w", (300, 260)), ("v", (70, 90)), ("u", (64, 40)))}
    cut = 200 * 260 + 7
    trainers = [lay(0, "t", "trainer", {"w": (ids["w"][:150].T, "bfloat16"),
                                        "v": (ids["v"].T, "float32"),
                                        "u": (ids["u"], "bfloat16")}),
                lay(1, "t", "trainer", {"w": (ids["w"].reshape(-1)[150 * 260:cut], "bfloat16")},
                    local_rank=1),
                lay(2, "u", "trainer", {"w": (ids["w"].reshape(-1)[cut:], "bfloat16")})]
    q = quantize_layouts(trainers, sc)
    rng = np.random.default_rng(chunk_blocks)
    own = {}
    for t in trainers:
        own[t.worker.rank] = {}
        for n, b in t.buffers.items():
            x = rng.standard_normal(b.shape) * np.exp2(rng.integers(-20, 20, b.shape))
            own[t.worker.rank][n] = x.astype(dtype_info(b.dtype).numpy)
    want = quantize_all(q, own)
    live = {r: {n: (_HostXP, np.array(a).view(_Mem)) for n, a in bufs.items()}
            for r, bufs in own.items()}
    qz = {r: engine_fp8.Quantiser(q, r, live[r], chunk=chunk_blocks * 32 * 16) for r in own}
    assert all(z.parts for z in qz.values())
    whole = combine_amax([z._partial_amax(live[r]) for r, z in qz.items()])
    for r, z in qz.items():
        order = sorted(z.buffers, reverse=True)  # any order of first sends
        ready = z.launch(live[r], exchange=lambda keys, amax: whole, order=order)
        assert set(ready) == set(z.buffers)
        for k, h in want[r].items():
            got = np.asarray(z.buffers[k]).view(np.uint8)
            assert got.tobytes() == h.view(np.uint8).tobytes(), (r, k)
    assert {s for s, _, _ in launched} == {"bfloat16", "float32"}
    assert max(n for _, n, m in launched if m == -1) <= chunk_blocks
