"""The one-sided row copy kernel (``wb.runtime.transport.copy_kernel``), its CUDA source compiled
for the host, run over every (block, thread) of a launch in turn (each thread's elements are its
own, so running them one after another does what the GPU does at once), against numpy: every
row's bytes land where they belong whatever the alignment of either address (16-byte words,
narrower ones, unaligned heads and tails), and no byte outside them changes. On a GPU,
``tests/test_ipc_cuda.py`` runs the same source through real one-sided transfers."""

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from wb.runtime.transport.copy_kernel import blocks_per_row, kernel_source

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")

_HOST = r"""
#define __global__
#define __device__
struct uint4 { unsigned int x, y, z, w; };
struct D3 { long long x, y; };
static D3 threadIdx, blockIdx, gridDim, blockDim;
"""
_RUN = r"""
extern "C" void run(const unsigned long long* tab, long long rows, long long gx, long long gy,
                    long long threads) {
    gridDim.x = gx; gridDim.y = gy; blockDim.x = threads;
    for (long long by = 0; by < gy; by++)
        for (long long bx = 0; bx < gx; bx++)
            for (long long t = 0; t < threads; t++) {
                blockIdx.x = bx; blockIdx.y = by; threadIdx.x = t;
                wb_copy_rows(tab, rows);
            }
}
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    d = tmp_path_factory.mktemp("copy")
    src = kernel_source().replace('extern "C" __global__ void wb_copy_rows',
                                  "static void wb_copy_rows")
    cpp, so = d / "copy.cpp", d / "copy.so"
    cpp.write_text(_HOST + src + _RUN)
    subprocess.run(["g++", "-O1", "-std=c++17", "-shared", "-fPIC", "-o", str(so), str(cpp)],
                   check=True)
    lib = ctypes.CDLL(str(so))
    lib.run.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong,
                        ctypes.c_longlong, ctypes.c_longlong]
    return lib


@st.composite
def _rows(draw):
    """Rows (source offset, destination offset, bytes) in buffers of 4 KiB, the destinations
    apart (as a group's: every destination byte written once)."""
    out, taken = [], np.zeros(4096, bool)
    for _ in range(draw(st.integers(1, 6))):
        n = draw(st.sampled_from([0, 1, 2, 3, 15, 16, 17, 31, 64, 100, 255, 512, 1000]))
        s = draw(st.integers(0, 4096 - n))
        # aligned alike, or not: the kernel's word width follows the two addresses
        d = draw(st.one_of(st.integers(0, 4096 - n),
                           st.integers(0, (4096 - n) // 16).map(lambda k: 16 * k + s % 16)))
        d = min(d, 4096 - n)
        if taken[d:d + n].any():
            continue
        taken[d:d + n] = True
        out.append((s, d, n))
    return out


@settings(max_examples=150, deadline=None)
@given(rows=_rows(), gx=st.integers(1, 3), gy=st.integers(1, 4), threads=st.integers(1, 5))
def test_rows_land_exactly_whatever_the_alignment(kernel, rows, gx, gy, threads):
    rng = np.random.default_rng(len(rows))
    src = rng.integers(0, 256, 4096 + 64, dtype=np.uint8)
    dst = rng.integers(0, 256, 4096 + 64, dtype=np.uint8)
    # both buffers start 16-byte aligned, so the offsets alone set each row's alignment
    sb = src[-src.ctypes.data % 16:][:4096]
    db = dst[-dst.ctypes.data % 16:][:4096]
    want = db.copy()
    for s, d, n in rows:
        want[d:d + n] = sb[s:s + n]
    tab = np.array([(sb.ctypes.data + s, db.ctypes.data + d, n) for s, d, n in rows], np.uint64)
    kernel.run(tab.ctypes.data, len(rows), gx, gy, threads)
    assert (db == want).all()


def test_blocks_per_row_follow_the_longest_row():
    assert blocks_per_row(0) == blocks_per_row(100) == 1
    assert blocks_per_row(1 << 20) == 64 and blocks_per_row(1 << 30) == 64
    assert blocks_per_row(256 << 10) == 16
