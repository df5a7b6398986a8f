"""The delta codec's device path run on the host: its CUDA kernels compiled for the host with one
thread a block (a warp of one lane: its ballot is its own flag, a shuffle brings nothing), and as
much of CuPy as that path uses, over numpy memory (:class:`Dev` arrays, :class:`Xp`). What the
GPU-only code does between the kernels runs so in CI; ``tests/test_delta_cuda.py`` runs it on a
GPU where there is one."""

from __future__ import annotations

import contextlib
import ctypes
import subprocess
import threading

import numpy as np

from wb.runtime.engine.deltas.kernels import kernel_source

__all__ = ["compile_kernels", "Dev", "Xp", "Module"]

_HOST = r"""
#include <cstdint>
#define __global__
#define __device__
#define __shared__
#define __syncthreads()
struct D3 { long long x; };
static D3 threadIdx, blockIdx, blockDim, gridDim;
static unsigned int atomicOr(unsigned int* a, unsigned int v) {
    unsigned int o = *a; *a |= v; return o; }
static unsigned int __shfl_down_sync(unsigned int, unsigned int, int) { return 0; }
static unsigned int __shfl_up_sync(unsigned int, unsigned int v, int) { return v; }
static unsigned int __ballot_sync(unsigned int, bool p) { return p ? 1u : 0u; }
static unsigned int __popc(unsigned int x) { return __builtin_popcount(x); }
"""
_RUN = r"""
extern "C" void block(long long b) {
    blockIdx.x = b; threadIdx.x = 0; blockDim.x = 1; gridDim.x = 1; }
"""


def compile_kernels(d) -> ctypes.CDLL:
    """The kernels built into a shared library in folder ``d`` (g++), loaded."""
    cpp, so = d / "k.cpp", d / "k.so"
    cpp.write_text(_HOST + kernel_source() + _RUN)
    flags = ["-fsanitize=address", "-g"] if __import__("os").environ.get("WB_ASAN") else []
    subprocess.run(["g++", "-O1", "-shared", "-fPIC", *flags, "-o", str(so), str(cpp)], check=True)
    return ctypes.CDLL(str(so))


class Dev(np.ndarray):
    """An array "on the device": numpy memory that the host reads back with ``get``."""

    def get(self):
        return np.array(self)

    @property
    def device(self):  # CuPy's ``with array.device:``
        return contextlib.nullcontext()


class _Event:
    """Work is done when queued; an event still says "not yet" the first time it is asked (the
    code that waits for events without blocking takes that path too)."""

    def __init__(self, **_):
        self.asked = 0

    @property
    def done(self):
        self.asked += 1
        return self.asked > 1

    def record(self, _stream=None):
        pass

    def synchronize(self):
        pass


class _Runtime:
    @staticmethod
    def memcpyAsync(dst, src, n, _kind, _stream):  # noqa: N802 (CUDA's name)
        ctypes.memmove(dst, src, n)


class _Cuda:
    Event = _Event
    runtime = _Runtime

    @staticmethod
    def get_current_stream():
        return type("Stream", (), {"ptr": 0})()

    @staticmethod
    def alloc_pinned_memory(n):
        return bytearray(n)

    @staticmethod
    def Device():  # noqa: N802 (CuPy's name)
        return type("Device", (), {"id": 0})()


class Xp:
    """As much of CuPy as the device codec and a delta update on a host mover use, over
    :class:`Dev` arrays (every numpy function, its results as :class:`Dev`); work is done when
    queued."""

    uint8, uint16, uint32, int32, int64 = np.uint8, np.uint16, np.uint32, np.int32, np.int64
    cuda = _Cuda

    def __getattr__(self, name):
        f = getattr(np, name)
        if not callable(f) or isinstance(f, type):  # modules, dtypes
            return f
        return lambda *a, **k: _on(f(*a, **k))


def _on(a):
    return a.view(Dev) if isinstance(a, np.ndarray) else a


_LAUNCH = threading.Lock()  # one launch at a time in the process, whichever Module makes it


class Module:
    """The host-compiled kernels launched as CuPy's ``RawModule`` functions: every block in turn,
    one launch at a time (the kernels' block index is one global of the library)."""

    def __init__(self, lib):
        self.lib = lib

    def get_function(self, name):
        fn = getattr(self.lib, name)

        def launch(grid, _threads, args):
            c = [ctypes.c_void_p(a.ctypes.data) if isinstance(a, np.ndarray) else
                 ctypes.c_int(int(a)) if isinstance(a, np.int32) else ctypes.c_longlong(int(a))
                 for a in args]
            with _LAUNCH:
                for b in range(grid[0]):
                    self.lib.block(ctypes.c_longlong(b))
                    fn(*c)
        return launch
