"""One-sided CUDA copies as one kernel launch per group: :class:`PieceCopier`.

A receiver copies a group of messages out of its peers' mapped memory. ``cudaMemcpyAsync`` per
message, or the driver's ``cuMemcpyBatchAsync`` per group, reach about 0.8-0.9 TB/s on an H200
for 4 MiB messages and 0.13 TB/s for 0.5 MiB ones, where a device copy of one large buffer moves
2.1 TB/s; a kernel that copies every piece of a table in one launch reaches 1.85 and 1.32 TB/s
(``bench/bench_copies.py``, ``bench/results/copies/``). So a group is a table of rows
``(source address, destination address, bytes)``, written into pinned host memory, copied to
the device behind the launches before it on the same stream, then one launch copies them all:
CUDA blocks along ``y`` over the rows, along ``x`` over a row's words. Each row moves in the
widest words (16, 8, 4, 2 or 1 bytes) in which its two addresses share an alignment, its
unaligned head and tail byte by byte.

The kernel's source (:func:`kernel_source`) is also compiled for the host and checked against
numpy in ``tests/test_copy_kernel_host.py``.
"""

from __future__ import annotations

import functools
from collections import deque
from typing import Any

import numpy as np

__all__ = ["PieceCopier", "kernel_source", "blocks_per_row"]

_THREADS = 256
_MOST_BLOCKS_PER_ROW = 64

_SOURCE = r"""
template <typename W>
static __device__ void wb_copy_words(const unsigned char* s, unsigned char* d, long long n,
                                     long long t, long long step) {
    const W* a = (const W*)s;
    W* b = (W*)d;
    for (long long i = t; i < n; i += step) b[i] = a[i];
}

extern "C" __global__ void wb_copy_rows(const unsigned long long* tab, long long rows) {
    for (long long k = blockIdx.y; k < rows; k += gridDim.y) {
        const unsigned long long s = tab[3 * k], d = tab[3 * k + 1], z = tab[3 * k + 2];
        const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
        const long long step = (long long)gridDim.x * blockDim.x;
        unsigned long long w = 16;
        while (w > 1 && ((s ^ d) & (w - 1))) w >>= 1;
        unsigned long long head = (w - (s & (w - 1))) & (w - 1);
        if (head > z) head = z;
        const unsigned long long words = (z - head) / w, tail = head + words * w;
        const unsigned char* sb = (const unsigned char*)s;
        unsigned char* db = (unsigned char*)d;
        for (long long i = t; i < (long long)head; i += step) db[i] = sb[i];
        for (long long i = (long long)tail + t; i < (long long)z; i += step) db[i] = sb[i];
        switch (w) {
            case 16: wb_copy_words<uint4>(sb + head, db + head, words, t, step); break;
            case 8: wb_copy_words<unsigned long long>(sb + head, db + head, words, t, step); break;
            case 4: wb_copy_words<unsigned int>(sb + head, db + head, words, t, step); break;
            case 2: wb_copy_words<unsigned short>(sb + head, db + head, words, t, step); break;
            default: wb_copy_words<unsigned char>(sb + head, db + head, words, t, step);
        }
    }
}
"""


def kernel_source() -> str:
    """The CUDA source of the row copy kernel (``wb_copy_rows``)."""
    return _SOURCE


def blocks_per_row(most_bytes: int) -> int:
    """CUDA blocks along a row for a launch whose longest row is ``most_bytes``: about 16 KiB
    per block (each thread then moves a few 16-byte words per pass), at most 64."""
    return max(1, min(_MOST_BLOCKS_PER_ROW, int(most_bytes) >> 14))


class PieceCopier:
    """Launches of the row copy kernel on one device, a table of rows per launch.

    Rows are written into a ring of pinned host memory and copied into the same rows of a table
    on the device, on the launch's stream, ahead of the launch. A part of the ring is written
    again only after the launches that used it have passed (each launch records an event of its
    own behind it): the host never overwrites rows an asynchronous copy may still read, nor the
    device rows a kernel may still read.

    Args:
        cp: CuPy.
        rows: rows of the ring (grown when a launch needs more).
    """

    def __init__(self, cp, rows: int = 1 << 14):
        self.cp = cp
        self._kernel = _kernel()
        self._alloc(int(rows))
        self._check()

    def _check(self) -> None:
        """Copies rows of every alignment once on this device and compares them with the
        source: a kernel that would move bytes wrongly here is refused before any message
        (ValueError), and the caller copies without it."""
        cp = self.cp
        src = cp.arange(4096, dtype=cp.uint8)
        dst = cp.zeros(4096, cp.uint8)
        rows = [(0, 0, 1000), (1001, 1003, 77), (1100, 1116, 1024), (2200, 2205, 333),
                (2600, 2602, 2), (2700, 2708, 520), (3300, 3304, 300)]
        stream = cp.cuda.Stream(non_blocking=True)
        self.launch([(dst.data.ptr + d, src.data.ptr + s, n) for s, d, n in rows], stream)
        stream.synchronize()
        want = cp.zeros(4096, cp.uint8)
        for s, d, n in rows:
            want[d:d + n] = src[s:s + n]
        if not bool((dst == want).all()):
            raise ValueError("the row copy kernel's self-check copied other bytes")

    def _alloc(self, rows: int) -> None:
        self.n = rows
        self._pinned = self.cp.cuda.alloc_pinned_memory(24 * rows)
        self.host = np.frombuffer(self._pinned, np.uint64, 3 * rows).reshape(rows, 3)
        self.dev = self.cp.zeros((rows, 3), self.cp.uint64)
        self.at = 0
        self.used: deque = deque()  # (first row, end row, event) of launches, in ring order

    def _reserve(self, k: int) -> int:
        """The first of ``k`` consecutive rows free to write (waiting for the launches that
        still read any of them: with a ring this size, almost never)."""
        if k > self.n:
            for *_, ev in self.used:
                ev.synchronize()
            self._alloc(max(k, 2 * self.n))
        start = self.at if self.at + k <= self.n else 0
        end = start + k
        keep: deque = deque()
        for a, b, ev in self.used:
            if a < end and start < b:
                ev.synchronize()
            else:
                keep.append((a, b, ev))
        self.used = keep
        return start

    def launch(self, items: list[tuple[int, int, int]], stream):
        """Copies each ``(destination address, source address, bytes)`` of ``items`` once
        ``stream`` reaches this launch: an event recorded on ``stream`` behind it (its own: poll
        ``.done``)."""
        k = len(items)
        k0 = self._reserve(k)
        rows = self.host[k0:k0 + k]
        dsts, srcs, sizes = zip(*items)
        rows[:, 0], rows[:, 1], rows[:, 2] = srcs, dsts, sizes
        cp = self.cp
        cp.cuda.runtime.memcpyAsync(self.dev[k0:].data.ptr, rows.ctypes.data, rows.nbytes,
                                    cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
        with stream:
            self._kernel((blocks_per_row(max(sizes)), min(k, 65535)), (_THREADS,),
                         (self.dev[k0:], np.int64(k)))
        event = cp.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        self.used.append((k0, k0 + k, event))
        self.at = k0 + k
        while self.used and self.used[0][2].done:  # passed: nothing to wait for later
            self.used.popleft()
        return event


@functools.lru_cache(maxsize=None)
def _kernel() -> Any:
    import cupy  # only CUDA memory comes here

    k = cupy.RawKernel(kernel_source(), "wb_copy_rows", options=("-std=c++17",))
    k.compile()
    return k
