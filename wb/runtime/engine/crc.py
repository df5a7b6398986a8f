"""CRC32C (Castagnoli) of byte buffers, the same value on the host and on a CUDA device.

On the host the ``crc32c`` library computes it (SSE4.2 or ARMv8 instructions, the GIL released
for long buffers). On a device :class:`Launcher` takes many buffers' CRCs in one kernel launch:
each thread takes one stretch of :data:`SUB` bytes of a buffer (stretches counted from the
buffer's end, so that only its first may be shorter), hashes it slice-by-4 from tables in shared
memory (one copy of each table per lane of a warp: lookups never wait on each other, the bank
of every lane's entry is its own), its words loaded 16 at a time, then shifts its CRC past the
whole stretches that follow it (one multiplication by ``x**(8 SUB j)`` modulo the polynomial,
from a table of them: zlib's ``crc32_combine`` identity, ``crc(A + B) = shift(crc(A), len(B)) ^
crc(B)``). A warp XORs its lanes' values per buffer before one atomic XOR into the buffer's slot
of the output, which must hold zeros before the launch. A buffer given a destination is also
copied there by the threads that hash it, from the words they loaded (a receive copied out of
its sender's memory is then read once, not twice).

The kernel's source (:func:`kernel_source`) is also compiled for the host and checked against the
library in ``tests/test_crc.py``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

__all__ = ["host", "load", "combine", "Launcher", "kernel_source", "tables", "powers", "shifts",
           "POLY", "SUB", "COPIES",
           "GROUP"]

#: CRC32C's polynomial, bit-reflected.
POLY = 0x82F63B78
#: Bytes per thread of the device kernel: short stretches, so that a message's loads are spread
#: over many threads, long enough that a stretch's binary search for its buffer, its shift and
#: its share of the warp's atomic cost little per byte.
SUB = 1024
#: Copies of each of the kernel's four tables in shared memory, one per lane (``32``: a warp's
#: lookups are served at once; ``16`` halves the memory, two lanes sharing a bank).
COPIES = 32
#: 16-byte words each thread loads at once (registers: a thread of a block of 1024 has 64).
GROUP = 8
_THREADS = 1024
_ROW = 5  # words of a row of the kernel's table (WB_ROW)


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
    """The ``(4, 256)`` slice-by-4 tables: row 0 the byte-wise table, row ``k`` the CRC of a byte
    followed by ``k`` zero bytes."""
    t = np.zeros((4, 256), np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (POLY if c & 1 else 0)
        t[0, i] = c
    for k in range(1, 4):
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


def _xpow8n(n: int) -> int:
    """``x**(8 n)`` modulo the polynomial: a shift past ``n`` bytes."""
    x, p, k = powers(), 1 << 31, 3
    while n:
        if n & 1:
            p = _multmodp(int(x[k]), p)
        n >>= 1
        k += 1
    return p


def _multmodp_many(a: np.ndarray, b: int) -> np.ndarray:
    """:func:`_multmodp` of each of ``a`` (``uint32``) by ``b``."""
    p = np.zeros_like(a)
    m = 1 << 31
    for _ in range(32):
        p ^= np.where(a & np.uint32(m), np.uint32(b), np.uint32(0))
        m >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1
    return p


@functools.lru_cache(maxsize=None)
def shifts(n: int, sub: int = SUB) -> np.ndarray:
    """``x**(8 sub j)`` modulo the polynomial for ``j < n`` (``uint32``): the device kernel's
    shift of a stretch past the ``j`` whole stretches after it (doubling: each half the first
    half multiplied by one power)."""
    z = np.empty(max(int(n), 1), np.uint32)
    z[0], have = 1 << 31, 1
    while have < z.size:
        take = min(have, z.size - have)
        z[have:have + take] = _multmodp_many(z[:take], _xpow8n(sub * have))
        have += take
    return z


def combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)`` (bytes)."""
    return _multmodp(_xpow8n(int(len2)), int(crc1)) ^ int(crc2)


_SOURCE = r"""
#ifndef WB_COPIES
#define WB_COPIES 32
#endif
#ifndef WB_GROUP
#define WB_GROUP 8
#endif
#define WB_ROW 5  /* words of a row of the table */
#ifndef WB_SHARED
#define WB_SHARED extern __shared__ unsigned int wb_T[];
#endif

__device__ unsigned int wb_multmodp(unsigned int a, unsigned int b) {
    unsigned int m = 1u << 31, p = 0;
    while (a) {
        if (a & m) { p ^= b; a ^= m; }
        m >>= 1;
        b = (b & 1) ? (b >> 1) ^ 0x82F63B78u : b >> 1;
    }
    return p;
}

/* entry i of table t, in this lane's copy (T: the tables offset by the lane) */
#define WB_AT(t, i) T[((t) * 256 + (i)) * WB_COPIES]

/* four bytes (a little-endian word) into the CRC, slice-by-4 */
__device__ unsigned int wb_step4(const unsigned int* T, unsigned int crc, unsigned int w) {
    unsigned int a = crc ^ w;
    return WB_AT(3, a & 0xFF) ^ WB_AT(2, (a >> 8) & 0xFF) ^ WB_AT(1, (a >> 16) & 0xFF)
         ^ WB_AT(0, a >> 24);
}

/* bytes [lo, hi) of a 16-byte word into the CRC, one by one */
__device__ unsigned int wb_bytes(const unsigned int* T, unsigned int crc, uint4 w, int lo, int hi) {
    unsigned int q[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 16; ++i)
        if (i >= lo && i < hi) crc = (crc >> 8) ^ WB_AT(0, (crc ^ (q[i / 4] >> (8 * (i % 4)))) & 0xFF);
    return crc;
}

/* where a source word's bytes go: its address moved by `shift` */
#define WB_AT_D(w) ((unsigned char*)((unsigned long long)(w) + shift))

/* bytes [lo, hi) of word v written to q (where the word's byte 0 goes), one by one */
__device__ void wb_put_bytes(unsigned char* q, uint4 v, int lo, int hi) {
    unsigned int a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 16; ++i)
        if (i >= lo && i < hi) q[i] = (unsigned char)(a[i / 4] >> (8 * (i % 4)));
}

/* the 16 bytes of word v written to q in words of wd bytes (q aligned to wd) */
__device__ void wb_put(unsigned char* q, uint4 v, int wd) {
    if (wd == 16) {
        *(uint4*)q = v;
    } else if (wd == 8) {
        unsigned long long* o = (unsigned long long*)q;
        o[0] = ((unsigned long long)v.y << 32) | v.x;
        o[1] = ((unsigned long long)v.w << 32) | v.z;
    } else if (wd == 4) {
        unsigned int* o = (unsigned int*)q;
        o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
    } else if (wd == 2) {
        unsigned short* o = (unsigned short*)q;
        unsigned int a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = (unsigned short)(a[i / 2] >> (16 * (i % 2)));
    } else {
        wb_put_bytes(q, v, 0, 16);
    }
}

/* the CRC32C of bytes [p, e), at any address: device memory is read in aligned 16-byte words
   only (a word holding bytes out of the range lies in the same allocation), each group of them
   loaded before the first is used (the latency of device memory paid once per group). With
   `d` (not null) the bytes are also copied there as they are hashed, in words as wide as the
   two addresses' common alignment (16 bytes at most); no byte outside [d, d + (e - p)) is
   written. */
__device__ unsigned int wb_crc(const unsigned int* T, const unsigned char* p,
                               const unsigned char* e, unsigned char* d) {
    unsigned int crc = 0xFFFFFFFFu;
    if (p >= e) return 0;
    const uint4* w = (const uint4*)((unsigned long long)p & ~15ull);
    const uint4* we = (const uint4*)(((unsigned long long)e + 15) & ~15ull);
    int head = (int)((unsigned long long)p & 15), tail = (int)((unsigned long long)e & 15);
    /* a source word's destination: its address + shift; written in words of wd bytes */
    const unsigned long long shift = d ? (unsigned long long)d - (unsigned long long)p : 0;
    int wd = 16;
    while (wd > 1 && (shift & (unsigned long long)(wd - 1))) wd >>= 1;
    if (head) {  /* the word the range starts inside */
        int hi = (w + 1 == we && tail) ? tail : 16;
        uint4 v = *w;
        crc = wb_bytes(T, crc, v, head, hi);
        if (d) wb_put_bytes(WB_AT_D(w), v, head, hi);
        if (++w == we) return crc ^ 0xFFFFFFFFu;
    }
    const uint4* full = tail ? we - 1 : we;  /* the whole words end here */
    while (w < full) {
        uint4 g[WB_GROUP];
        long long left = full - w;
        if (left >= WB_GROUP) {
#pragma unroll
            for (int k = 0; k < WB_GROUP; ++k) g[k] = w[k];
#pragma unroll
            for (int k = 0; k < WB_GROUP; ++k) {
                crc = wb_step4(T, crc, g[k].x);
                crc = wb_step4(T, crc, g[k].y);
                crc = wb_step4(T, crc, g[k].z);
                crc = wb_step4(T, crc, g[k].w);
            }
            if (d) {
#pragma unroll
                for (int k = 0; k < WB_GROUP; ++k) wb_put(WB_AT_D(w + k), g[k], wd);
            }
            w += WB_GROUP;
        } else {
#pragma unroll
            for (int k = 0; k < WB_GROUP; ++k) if (k < left) g[k] = w[k];
#pragma unroll
            for (int k = 0; k < WB_GROUP; ++k) if (k < left) {
                crc = wb_step4(T, crc, g[k].x);
                crc = wb_step4(T, crc, g[k].y);
                crc = wb_step4(T, crc, g[k].z);
                crc = wb_step4(T, crc, g[k].w);
                if (d) wb_put(WB_AT_D(w + k), g[k], wd);
            }
            w = full;
        }
    }
    if (tail && w < we) {  /* the word the range ends in */
        uint4 v = *w;
        crc = wb_bytes(T, crc, v, 0, tail);
        if (d) wb_put_bytes(WB_AT_D(w), v, 0, tail);
    }
    return crc ^ 0xFFFFFFFFu;
}

/* CRC32C of the buffers of rows [0, n) of a table `rows` (n x 5: pointer, length, slot, first
   stretch of the row, destination; `total` stretches of `sub` bytes in all, counted from each
   buffer's end), each XORed into `out[slot]` (zeros before), and the buffer copied to its
   destination as it is read where that is not 0; `zeros[j]`: x**(8 sub j) modulo the
   polynomial for every j below a row's stretches. Blocks of whole warps; 4 * 256 * WB_COPIES
   words of dynamic shared memory. */
extern "C" __global__ void __launch_bounds__(1024) wb_crc32c_rows(const long long* rows,
        long long n, long long total, long long sub, const unsigned int* tabs,
        const unsigned int* zeros, unsigned int* out) {
    WB_SHARED
    for (int i = threadIdx.x; i < 4 * 256 * WB_COPIES; i += blockDim.x) wb_T[i] = tabs[i / WB_COPIES];
    __syncthreads();
    const unsigned int* T = wb_T + threadIdx.x % WB_COPIES;
    const int lane = threadIdx.x & 31;
    /* whole warps go round the loop together (their lanes' results are combined) */
    for (long long base = (long long)blockIdx.x * blockDim.x + (threadIdx.x - lane); base < total;
         base += (long long)gridDim.x * blockDim.x) {
        long long c = base + lane, row = -1;
        unsigned int v = 0;
        if (c < total) {
            long long lo = 0, hi = n - 1;  /* the row whose stretches hold c */
            while (lo < hi) {
                long long mid = (lo + hi + 1) / 2;
                if (rows[WB_ROW * mid + 3] <= c) lo = mid; else hi = mid - 1;
            }
            const long long* r = rows + WB_ROW * lo;
            long long len = r[1], j = (len + sub - 1) / sub - 1 - (c - r[3]);  /* stretches after */
            long long e = len - j * sub, a = e > sub ? e - sub : 0;
            const unsigned char* base_p = (const unsigned char*)r[0];
            v = wb_crc(T, base_p + a, base_p + e, r[4] ? (unsigned char*)r[4] + a : 0);
            if (j) v = wb_multmodp(zeros[j], v);
            row = lo;
        }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
        unsigned int peers = __match_any_sync(0xFFFFFFFFu, row);  /* lanes of the same buffer */
        v = __reduce_xor_sync(peers, v);
        if (row >= 0 && lane == __ffs(peers) - 1) atomicXor(&out[rows[WB_ROW * row + 2]], v);
#else
        if (row >= 0) atomicXor(&out[rows[WB_ROW * row + 2]], v);
#endif
    }
}
"""


def kernel_source() -> str:
    """The CUDA source of :class:`Launcher`'s kernel (``wb_crc32c_rows``)."""
    return _SOURCE


class Launcher:
    """Launches of the CRC kernel over a CUDA device's buffers, many per launch, with nothing
    waiting on the device: each buffer's row (pointer, length, slot, first stretch, where it is
    copied as it is read or 0) is written
    into pinned host memory at a row of its own for the update (rows are not reused before
    :meth:`reset`, so an asynchronous copy never reads a row written after it was queued),
    copied to the device behind the launches before, then one launch hashes them all.

    Args:
        xp: CuPy.
        rows: the most buffers hashed between two :meth:`reset` calls.
        sub: bytes per stretch (tests take short ones); ``copies``, ``group``: see
            :data:`COPIES`, :data:`GROUP`; ``threads``: per CUDA block, a multiple of 32 up to
            1024 (a launch of few stretches spreads over more of the device's processors in
            smaller blocks).
    """

    def __init__(self, xp, rows: int, *, sub: int = SUB, copies: int = COPIES,
                 group: int = GROUP, threads: int = _THREADS):
        if not (0 < threads <= 1024 and threads % 32 == 0):
            raise ValueError(f"CRC launcher: threads per block must be a multiple of 32 up to "
                             f"1024, got {threads}")
        self.xp, self.sub, self.n = xp, sub, max(int(rows), 1)
        self.variant = (int(copies), int(group), int(threads))
        self._pinned = xp.cuda.alloc_pinned_memory(8 * _ROW * self.n)
        self.host = np.frombuffer(self._pinned, np.int64, _ROW * self.n).reshape(self.n, _ROW)
        self.dev = xp.zeros((self.n, _ROW), xp.int64)
        self.zeros = None  # shifts(len, sub) on the device, grown to the longest buffer's
        self._older: list = []
        self.used = 0

    def reset(self) -> None:
        """A new update: every row may be written again (the last one's launches are done)."""
        self.used = 0

    def launch(self, bufs: list[tuple], out: Any, stream=None) -> None:
        """The CRC32C of each ``(pointer, bytes, slot)`` XORed into ``out[slot]`` (zero before)
        once ``stream`` (default: the current one) passes this launch; a row ``(pointer, bytes,
        slot, destination)`` also copies its bytes to ``destination`` as they are read (one
        pass over them: the CRC of what was read is the CRC of what was written)."""
        bufs = [b for b in bufs if b[1]]
        if not bufs:
            return
        k0, k = self.used, len(bufs)
        if k0 + k > self.n:
            raise ValueError(f"CRC launcher: {k0 + k} buffers for {self.n} rows")
        rows = self.host[k0:k0 + k]
        rows[:, :3] = [b[:3] for b in bufs]
        rows[:, 4] = [b[3] if len(b) > 3 else 0 for b in bufs]
        stretches = -(-rows[:, 1] // self.sub)
        rows[:, 3] = np.cumsum(stretches) - stretches
        total, most = int(stretches.sum()), int(stretches.max())
        xp = self.xp
        if self.zeros is None or self.zeros.size < most:  # the first update's, mostly
            # (the smaller table stays: a launch on another stream may still read it)
            self._older.append(self.zeros)
            self.zeros = _made(xp, shifts(max(1 << (most - 1).bit_length(), 1024), self.sub))
        stream = xp.cuda.get_current_stream() if stream is None else stream
        with stream:
            xp.cuda.runtime.memcpyAsync(self.dev[k0:].data.ptr, rows.ctypes.data, rows.nbytes,
                                        xp.cuda.runtime.memcpyHostToDevice, stream.ptr)
            kernel, smem, blocks = _kernel(*self.variant, out.device.id)
            tabs = _device_tables(xp, out.device.id)
            threads = self.variant[2]
            kernel((min(-(-total // threads), blocks),), (threads,),
                   (self.dev[k0:], np.int64(k), np.int64(total), np.int64(self.sub), tabs,
                    self.zeros, out), shared_mem=smem)
        self.used += k


@functools.lru_cache(maxsize=None)
def _device_tables(xp, device: int):
    return _made(xp, tables().reshape(-1))


def _made(xp, a: np.ndarray):
    """``a`` on the device, there before this returns: launches on any stream may read it (an
    array copied on one stream is not ordered with the others)."""
    stream = xp.cuda.Stream(non_blocking=True)
    with stream:
        out = xp.asarray(a)
    stream.synchronize()
    return out


@functools.lru_cache(maxsize=None)
def _kernel(copies: int, group: int, threads: int, device: int):
    """The kernel for ``copies`` copies of its tables and loads of ``group`` words, its shared
    memory and how many of its blocks of ``threads`` the device holds at once (the launch's
    most: each then loops over stretches)."""
    import cupy  # only CUDA buffers come here

    k = cupy.RawKernel(f"#define WB_COPIES {copies}\n#define WB_GROUP {group}\n"
                       + kernel_source(), "wb_crc32c_rows")
    smem = 4 * 256 * copies * 4
    k.max_dynamic_shared_size_bytes = smem
    k.compile()
    dev = cupy.cuda.Device(device)
    per_sm = max(min(dev.attributes["MaxSharedMemoryPerMultiprocessor"] // (smem + 1024),
                     dev.attributes["MaxThreadsPerMultiProcessor"] // threads), 1)
    return k, smem, per_sm * dev.attributes["MultiProcessorCount"]
