"""CRC32C (Castagnoli) of byte buffers, the same value on the host and on a CUDA device.

On the host the ``crc32c`` library computes it (SSE4.2 or ARMv8 instructions, the GIL released
for long buffers). On a device :class:`Launcher` takes many buffers' CRCs in one kernel launch:
each thread takes :data:`SUB` bytes of a buffer (slice-by-8 tables in shared memory, its words
loaded 16 at a time), shifts its CRC past the bytes that follow its stretch (a multiplication
by ``x**(8 n)`` modulo the polynomial, zlib's ``crc32_combine`` identity: ``crc(A + B) =
shift(crc(A), len(B)) ^ crc(B)``)
and XORs it into its buffer's slot of the output, which must hold zeros before the launch.

The kernel's source (:func:`kernel_source`) is also compiled for the host and checked against the
library in ``tests/test_crc.py``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

__all__ = ["host", "load", "combine", "Launcher", "kernel_source", "tables", "powers", "POLY", "SUB"]

#: CRC32C's polynomial, bit-reflected.
POLY = 0x82F63B78
#: Bytes per thread of the device kernel: short stretches, so that a message's loads are spread
#: over many threads (one thread hashing 4 KiB word by word waits on device memory at every
#: word), long enough that shifting each stretch's CRC into place (a few thousand instructions)
#: costs little per byte; stretches of exactly this many bytes, 16-byte aligned, load their
#: words 16 at a time.
SUB = 1024
_THREADS = 256


def host(buf) -> int:
    """The CRC32C of a contiguous host buffer (numpy array, bytes, memoryview)."""
    if isinstance(buf, np.ndarray):
        buf = buf.reshape(-1).view(np.uint8)
    return _library().crc32c(buf)


@functools.lru_cache(maxsize=None)
def _library():
    """The ``crc32c`` library, imported once where checksums are set up (tens of milliseconds:
    not inside a first update)."""
    import crc32c

    return crc32c


def load() -> None:
    """Imports what :func:`host` needs now (a program's set-up calls it)."""
    _library()


@functools.lru_cache(maxsize=None)
def tables() -> np.ndarray:
    """The ``(8, 256)`` slice-by-8 tables: row 0 the byte-wise table, row ``k`` the CRC of a byte
    followed by ``k`` zero bytes."""
    t = np.zeros((8, 256), np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (POLY if c & 1 else 0)
        t[0, i] = c
    for k in range(1, 8):
        prev = t[k - 1]
        t[k] = (prev >> 8) ^ t[0][prev & 0xFF]
    return t


def _multmodp(a: int, b: int) -> int:
    """``a(x) * b(x)`` modulo the polynomial (bit-reflected: bit 31 is ``x**0``)."""
    m, p = 1 << 31, 0
    while a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1
    return p


@functools.lru_cache(maxsize=None)
def powers() -> np.ndarray:
    """``x**(2**k)`` modulo the polynomial, ``k = 0..63`` (``uint32``): every shift of fewer than
    ``2**61`` bytes (CRC32C's ``x**(2**32)`` is not ``x``: the table does not wrap)."""
    out, p = [], 1 << 30  # x**1
    for _ in range(64):
        out.append(p)
        p = _multmodp(p, p)
    return np.array(out, np.uint32)


def combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)`` (bytes)."""
    x, p, k, n = powers(), 1 << 31, 3, int(len2)
    while n:
        if n & 1:
            p = _multmodp(int(x[k]), p)
        n >>= 1
        k += 1
    return _multmodp(p, int(crc1)) ^ int(crc2)


_SOURCE = r"""
__device__ unsigned int wb_multmodp(unsigned int a, unsigned int b) {
    unsigned int m = 1u << 31, p = 0;
    while (a) {
        if (a & m) { p ^= b; a ^= m; }
        m >>= 1;
        b = (b & 1) ? (b >> 1) ^ 0x82F63B78u : b >> 1;
    }
    return p;
}

#define WB_FAST 1024

/* eight bytes (lo, hi: little-endian words) into the CRC, slice-by-8 */
__device__ unsigned int wb_step8(const unsigned int* T, unsigned int crc, unsigned int lo,
                                 unsigned int hi) {
    unsigned int a = crc ^ lo;
    return T[7 * 256 + (a & 0xFF)] ^ T[6 * 256 + ((a >> 8) & 0xFF)]
         ^ T[5 * 256 + ((a >> 16) & 0xFF)] ^ T[4 * 256 + (a >> 24)]
         ^ T[3 * 256 + (hi & 0xFF)] ^ T[2 * 256 + ((hi >> 8) & 0xFF)]
         ^ T[1 * 256 + ((hi >> 16) & 0xFF)] ^ T[hi >> 24];
}

/* the CRC of bytes [a, b) of a buffer of `len` bytes at `base`, shifted past the bytes after
   them (x**(8 (len - b))): what XORed together over a buffer's stretches is its CRC */
__device__ unsigned int wb_stretch(const unsigned int* T, const unsigned int* pows,
        const unsigned char* base, long long len, long long a, long long b) {
    const unsigned char* p = base + a;
    const unsigned char* e = base + b;
    unsigned int crc = 0xFFFFFFFFu;
    if (e - p == WB_FAST && !((unsigned long long)p & 15)) {
        /* a whole aligned stretch, in groups of 16 words each loaded before the first is used
           (the latency of device memory is paid once per group, not once per word) */
        for (int g = 0; g < WB_FAST / 256; ++g, p += 256) {
            uint4 w[16];
#pragma unroll
            for (int k = 0; k < 16; ++k) w[k] = ((const uint4*)p)[k];
#pragma unroll
            for (int k = 0; k < 16; ++k) {
                crc = wb_step8(T, crc, w[k].x, w[k].y);
                crc = wb_step8(T, crc, w[k].z, w[k].w);
            }
        }
    }
    while (p < e && ((unsigned long long)p & 7)) crc = (crc >> 8) ^ T[(crc ^ *p++) & 0xFF];
    while (e - p >= 8) {
        unsigned long long w = *(const unsigned long long*)p;
        crc = wb_step8(T, crc, (unsigned int)w, (unsigned int)(w >> 32));
        p += 8;
    }
    while (p < e) crc = (crc >> 8) ^ T[(crc ^ *p++) & 0xFF];
    crc ^= 0xFFFFFFFFu;
    unsigned long long after = (unsigned long long)(len - b);
    unsigned int x = 1u << 31;
    for (int k = 3; after; after >>= 1, ++k)
        if (after & 1) x = wb_multmodp(pows[k & 63], x);
    return wb_multmodp(x, crc);
}

#define WB_TABLES(tabs) \
    __shared__ unsigned int T[8 * 256]; \
    for (int i = threadIdx.x; i < 8 * 256; i += blockDim.x) T[i] = tabs[i]; \
    __syncthreads();

/* CRC32C of the buffers of rows [0, n) of a table `rows` (n x 4: pointer, length, slot, first
   stretch of the row; `total` stretches of `sub` bytes in all), each XORed into `out[slot]`
   (zeros before) */
extern "C" __global__ void wb_crc32c_rows(const long long* rows, long long n, long long total,
        long long sub, const unsigned int* tabs, const unsigned int* pows, unsigned int* out) {
    WB_TABLES(tabs)
    for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < total;
         c += (long long)gridDim.x * blockDim.x) {
        long long lo = 0, hi = n - 1;  /* the row whose stretches hold c */
        while (lo < hi) {
            long long mid = (lo + hi + 1) / 2;
            if (rows[4 * mid + 3] <= c) lo = mid; else hi = mid - 1;
        }
        const long long* r = rows + 4 * lo;
        long long len = r[1], a = (c - r[3]) * sub, b = a + sub < len ? a + sub : len;
        atomicXor(&out[r[2]], wb_stretch(T, pows, (const unsigned char*)r[0], len, a, b));
    }
}
"""


def kernel_source() -> str:
    """The CUDA source of :class:`Launcher`'s kernel (``wb_crc32c_rows``)."""
    return _SOURCE


class Launcher:
    """Launches of the CRC kernel over a CUDA device's buffers, many per launch, with nothing
    waiting on the device: each buffer's row (pointer, length, slot, first stretch) is written
    into pinned host memory at a row of its own for the update (rows are not reused before
    :meth:`reset`, so an asynchronous copy never reads a row written after it was queued),
    copied to the device behind the launches before, then one launch hashes them all.

    Args:
        xp: CuPy.
        rows: the most buffers hashed between two :meth:`reset` calls.
    """

    def __init__(self, xp, rows: int, *, sub: int = SUB):
        self.xp, self.sub, self.n = xp, sub, max(int(rows), 1)
        self._pinned = xp.cuda.alloc_pinned_memory(32 * self.n)
        self.host = np.frombuffer(self._pinned, np.int64, 4 * self.n).reshape(self.n, 4)
        self.dev = xp.zeros((self.n, 4), xp.int64)
        self.used = 0

    def reset(self) -> None:
        """A new update: every row may be written again (the last one's launches are done)."""
        self.used = 0

    def launch(self, bufs: list[tuple[int, int, int]], out: Any) -> None:
        """The CRC32C of each ``(pointer, bytes, slot)`` XORed into ``out[slot]`` (zero before)
        once the current stream passes this launch."""
        bufs = [b for b in bufs if b[1]]
        if not bufs:
            return
        k0, k = self.used, len(bufs)
        if k0 + k > self.n:
            raise ValueError(f"CRC launcher: {k0 + k} buffers for {self.n} rows")
        rows = self.host[k0:k0 + k]
        rows[:, :3] = bufs
        stretches = -(-rows[:, 1] // self.sub)
        rows[:, 3] = np.cumsum(stretches) - stretches
        total = int(stretches.sum())
        xp = self.xp
        stream = xp.cuda.get_current_stream()
        xp.cuda.runtime.memcpyAsync(self.dev[k0:].data.ptr, rows.ctypes.data, rows.nbytes,
                                    xp.cuda.runtime.memcpyHostToDevice, stream.ptr)
        tabs, pows = _device_tables(xp, out.device.id)
        blocks = min(-(-total // _THREADS), 4096)
        _kernel("wb_crc32c_rows")((blocks,), (_THREADS,), (self.dev[k0:], np.int64(k),
                                                            np.int64(total), np.int64(self.sub),
                                                            tabs, pows, out))
        self.used += k


@functools.lru_cache(maxsize=None)
def _device_tables(xp, device: int):
    return xp.asarray(tables().reshape(-1)), xp.asarray(powers())


@functools.lru_cache(maxsize=None)
def _kernel(name: str):
    import cupy  # only CUDA buffers come here

    k = cupy.RawKernel(kernel_source(), name)
    k.compile()
    return k
