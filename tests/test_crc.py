"""CRC32C (``wb.runtime.engine.crc``): the device kernel's CUDA source compiled for the host (one
thread and one block: its loop visits every stretch in turn; its tables in four copies) against the ``crc32c`` library, over
buffers of any length and alignment, many in one launch, with stretches of a few bytes (so that
the combining of stretches is what is checked); and the combine identity the kernel rests on. On a
GPU, ``tests/test_checksums_cuda.py`` runs the same source on the device."""

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from wb.runtime.engine import crc

needs_cxx = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")

_HOST = r"""
#define __global__
#define __launch_bounds__(n)
#define __device__ static
#define WB_COPIES 4
#define WB_SHARED static unsigned int wb_T[4 * 256 * WB_COPIES];
struct uint4 { unsigned int x, y, z, w; };
struct D3 { long long x; };
static D3 threadIdx, blockIdx, gridDim, blockDim;
static void __syncthreads() {}
static void atomicXor(unsigned int* p, unsigned int v) { *p ^= v; }
"""
_RUN = r"""
extern "C" void run_rows(const long long* rows, long long n, long long total, long long sub,
                         const unsigned int* tabs, const unsigned int* zeros, unsigned int* out) {
    threadIdx.x = blockIdx.x = 0;
    gridDim.x = blockDim.x = 1;
    wb_crc32c_rows(rows, n, total, sub, tabs, zeros, out);
}
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    d = tmp_path_factory.mktemp("crc")
    src = crc.kernel_source().replace('extern "C" __global__ void __launch_bounds__(1024) wb_crc32c_rows(',
                                      "static void wb_crc32c_rows(")
    cpp, so = d / "crc.cpp", d / "crc.so"
    cpp.write_text(_HOST + src + _RUN)
    subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-o", str(so), str(cpp)], check=True)
    return ctypes.CDLL(str(so))


def _launch(lib, bufs, sub, dsts=None):
    """The kernel over views ``bufs`` (uint8 arrays), each into its own slot, from the rows a
    :class:`crc.Launcher` writes (pointer, length, slot, first stretch, destination; buffers of
    no bytes left out, as it leaves them out); ``dsts``: views each buffer is copied to."""
    n = len(bufs)
    slots = np.arange(n, dtype=np.int64)[::-1].copy()  # slots need not follow the buffers
    live = [k for k, b in enumerate(bufs) if b.nbytes]
    rows = np.zeros((max(len(live), 1), 5), np.int64)
    for i, k in enumerate(live):
        rows[i, :3] = (bufs[k].ctypes.data, bufs[k].nbytes, slots[k])
        if dsts is not None:
            rows[i, 4] = dsts[k].ctypes.data
    stretches = -(-rows[:, 1] // sub)
    rows[:, 3] = np.cumsum(stretches) - stretches
    out = np.zeros(n, np.uint32)
    tabs = crc.tables().reshape(-1).copy()
    zeros = crc.shifts(int(stretches.max()) + 1, sub)
    total = int(stretches.sum()) if live else 0
    p = ctypes.c_void_p
    lib.run_rows(p(rows.ctypes.data), ctypes.c_longlong(len(live)),
                 ctypes.c_longlong(total), ctypes.c_longlong(sub),
                 p(tabs.ctypes.data), p(zeros.ctypes.data), p(out.ctypes.data))
    return [int(out[slots[k]]) for k in range(n)]


@needs_cxx
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 7)), min_size=1, max_size=6),
       st.sampled_from([1, 3, 8, 13, 64, 256, 1024, 4096]), st.integers(0, 2**32 - 1))
def test_kernel_equals_the_library(kernel, shapes, sub, seed):
    rng = np.random.default_rng(seed)
    backing = rng.integers(0, 256, sum(n + off for n, off in shapes) + 8, dtype=np.uint8)
    bufs, at = [], 0
    for n, off in shapes:  # views at every alignment
        bufs.append(backing[at + off:at + off + n])
        at += n + off
    assert _launch(kernel, bufs, sub) == [crc.host(b) for b in bufs]


@needs_cxx
def test_kernel_sees_one_flipped_bit_anywhere(kernel):
    a = np.random.default_rng(1).integers(0, 256, 10_000, dtype=np.uint8)
    clean = crc.host(a)
    for i in (0, 7, 4095, 4096, 9999):
        b = a.copy()
        b[i] ^= 1 << (i % 8)
        assert _launch(kernel, [b], 4096) == [crc.host(b)] != [clean]
        assert _launch(kernel, [b], 256) == [crc.host(b)]


@needs_cxx
def test_groups_of_words_at_any_alignment(kernel):
    """Stretches holding whole groups of 16 words (their loads issued at once) at 16-byte aligned
    addresses and not, short first stretches and not, in one launch."""
    rng = np.random.default_rng(3)
    backing = rng.integers(0, 256, 8192 + 64, dtype=np.uint8)
    start = (-backing.ctypes.data) % 16
    bufs = [backing[start:start + 4096], backing[start + 1:start + 1 + 4096],
            backing[start:start + 4000], backing[start + 16:start + 16 + 256]]
    assert _launch(kernel, bufs, 256) == [crc.host(b) for b in bufs]
    assert _launch(kernel, bufs, 1024) == [crc.host(b) for b in bufs]


@needs_cxx
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 15), st.integers(0, 15)),
                min_size=1, max_size=6),
       st.sampled_from([1, 3, 13, 64, 256, 1024]), st.integers(0, 2**32 - 1))
def test_a_row_with_a_destination_is_copied_as_it_is_hashed(kernel, shapes, sub, seed):
    """Source and destination at every pair of alignments (every width of word the copy may
    take): each destination holds its source's bytes, the CRCs are the library's, and not one
    byte around a destination is written."""
    rng = np.random.default_rng(seed)
    backing = rng.integers(0, 256, sum(n + a for n, a, _ in shapes) + 32, dtype=np.uint8)
    target = rng.integers(0, 256, sum(n + b for n, _, b in shapes) + 64, dtype=np.uint8)
    before = target.copy()
    s0 = (-backing.ctypes.data) % 16
    t0 = (-target.ctypes.data) % 16
    bufs, dsts, at, to = [], [], s0, t0
    for n, a, b in shapes:
        bufs.append(backing[at + a:at + a + n])
        dsts.append(target[to + b:to + b + n])
        at, to = at + a + n, to + b + n
    assert _launch(kernel, bufs, sub, dsts) == [crc.host(b) for b in bufs]
    want = before.copy()
    for src, dst in zip(bufs, dsts):
        off = dst.ctypes.data - target.ctypes.data
        want[off:off + dst.size] = src
    np.testing.assert_array_equal(target, want)


def test_known_value_and_combine():
    assert crc.host(b"123456789") == 0xE3069283  # CRC32C's check value
    assert crc.host(b"") == 0
    rng = np.random.default_rng(2)
    for n1, n2 in [(0, 5), (5, 0), (1000, 4097), (3, 1)]:
        a, b = rng.integers(0, 256, n1, dtype=np.uint8), rng.integers(0, 256, n2, dtype=np.uint8)
        assert crc.combine(crc.host(a), crc.host(b), n2) == crc.host(np.concatenate([a, b]))


def test_combine_over_shifts_of_any_length():
    """Shifts past 2**29 bytes and more (CRC32C's x**(2**32) is not x): the library streamed over
    zeros (no such buffer is made) against combine."""
    import crc32c

    head = np.random.default_rng(4).integers(0, 256, 100, dtype=np.uint8)
    zeros = np.zeros(1 << 24, np.uint8)
    for n in ((1 << 29) - 1, 1 << 29, (1 << 29) + 3, (1 << 30) + 17):
        whole, tail = crc32c.crc32c(head), 0
        for k in range(0, n, zeros.size):
            chunk = zeros[:min(zeros.size, n - k)]
            whole, tail = crc32c.crc32c(chunk, whole), crc32c.crc32c(chunk, tail)
        assert crc.combine(crc.host(head), tail, n) == whole, n


def test_shift_table_against_the_library():
    """The kernel's table of shifts past ``j`` whole stretches (doubled, vectorised): shifting
    ``crc(A)`` past ``n`` bytes is ``crc(A + B) ^ crc(B)`` for any ``B`` of ``n`` bytes (here
    zeros), the library's values."""
    a = np.random.default_rng(5).integers(0, 256, 50, dtype=np.uint8)
    for sub in (1, 7, 1024):
        z = crc.shifts(37, sub)
        for j in (0, 1, 2, 5, 16, 36):
            b = np.zeros(j * sub, np.uint8)
            want = crc.host(np.concatenate([a, b])) ^ crc.host(b)
            assert crc._multmodp(int(z[j]), crc.host(a)) == want, (sub, j)


class _DevArray(np.ndarray):
    """Host memory standing in for a CuPy array: ``.data.ptr`` and ``.device.id``."""

    @property
    def data(self):
        return type("Ptr", (), {"ptr": self.ctypes.data})()

    @property
    def device(self):
        return type("Device", (), {"id": 0})()


class _Stream:
    ptr = 0

    def __init__(self, **_):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


class _FakeCupy:
    """As much of CuPy as :class:`crc.Launcher` uses, over host memory (work done when queued)."""

    class cuda:  # noqa: N801 (CuPy's name)
        Stream = _Stream

        class runtime:  # noqa: N801
            memcpyHostToDevice = 1

            @staticmethod
            def memcpyAsync(dst, src, n, _kind, _stream):  # noqa: N802 (CUDA's name)
                ctypes.memmove(dst, src, n)

        @staticmethod
        def alloc_pinned_memory(n):
            return bytearray(n)

        @staticmethod
        def get_current_stream():
            return _Stream()

    int64 = np.int64

    @staticmethod
    def zeros(shape, dtype):
        return np.zeros(shape, dtype).view(_DevArray)

    @staticmethod
    def asarray(a):
        return np.array(a).view(_DevArray)


@needs_cxx
def test_the_launcher_s_rows_over_launches_of_mixed_rows(kernel, monkeypatch):
    """:class:`crc.Launcher` itself (the rows it writes, their first stretches, its shift table
    grown for longer buffers, rows with and without a destination in one launch and apart,
    launches on given streams), its kernel the host build (one thread visits every stretch)."""
    def run(grid, block, args, shared_mem=0):
        rows, k, total, sub, tabs, zeros, out = args
        p = ctypes.c_void_p
        kernel.run_rows(p(rows.ctypes.data), ctypes.c_longlong(int(k)),
                        ctypes.c_longlong(int(total)), ctypes.c_longlong(int(sub)),
                        p(tabs.ctypes.data), p(zeros.ctypes.data), p(out.ctypes.data))

    monkeypatch.setattr(crc, "_kernel", lambda *a: (run, 0, 1))
    crc._device_tables.cache_clear()
    try:
        rng = np.random.default_rng(5)
        src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
        dst = np.zeros(src.size, np.uint8)
        lz = crc.Launcher(_FakeCupy, 12, sub=100, threads=64)
        out = _FakeCupy.zeros(12, np.uint32)
        cuts = [(0, 5, None), (7, 300, 9), (500, 0, None), (1000, 4099, 1003),
                (9000, 20_000, None), (40_000, 77_777, 40_005), (200_000, 1, 200_001),
                (300_000, 250_000, 300_016)]
        launches = [cuts[:2], cuts[2:4], cuts[4:5], cuts[5:]]  # mixed, copies alone, hashes alone
        slot = {c: 11 - i for i, c in enumerate(cuts)}
        for batch in launches:
            lz.launch([(src.ctypes.data + a, n, slot[(a, n, d)]) + (
                () if d is None else (dst.ctypes.data + d,)) for a, n, d in batch], out,
                _Stream())
        want = np.zeros(src.size, np.uint8)
        for a, n, d in cuts:
            got = int(out[slot[(a, n, d)]])
            assert got == crc.host(src[a:a + n]), (a, n)
            if d is not None:
                want[d:d + n] = src[a:a + n]
        np.testing.assert_array_equal(dst, want)
        assert lz.used == 7  # the empty buffer takes no row
    finally:
        crc._device_tables.cache_clear()
