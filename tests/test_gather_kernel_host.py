"""The fused pack/unpack kernel (``wb.runtime.engine.gather``), its CUDA source compiled for the host with
one thread and one block (its loops then visit every element in order), against numpy: packing
regions of several buffers gives the elements of numpy's strided views of them, in order, and
unpacking writes each back where numpy's assignment would. The table's cutting of long regions
into pieces is checked on the way (small pieces), and transposed regions (moved in tiles through
shared memory, which one thread fills and then empties) over several tiles, edges included. On a GPU, ``tests/test_transfer_cuda.py`` and
``tests/test_jax_cuda.py`` run the same source through real transfers."""

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from wb.runtime.engine.gather import FIELDS, PAIRED, STAGES, TILE, kernel_source, stacked, table

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")

_HOST = r"""
#define __global__
#define __shared__
#define __align__(n) alignas(n)
#define __syncthreads()
struct D3 { long long x, y; };
struct uint4 { unsigned int x, y, z, w; };
static D3 threadIdx, blockIdx, gridDim, blockDim;
"""
_RUN = r"""
extern "C" void run(const unsigned long long* ptrs, const long long* tab, long long rows,
                    ELEM** s, int scatter) {
    threadIdx.x = threadIdx.y = blockIdx.x = blockIdx.y = 0;
    gridDim.x = gridDim.y = blockDim.x = blockDim.y = 1;
    wb_gather(ptrs, tab, rows, s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], scatter);
}
"""


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    d = tmp_path_factory.mktemp("gather")
    out = {}
    for size in (1, 2, 4, 8):
        src = kernel_source(size).replace('extern "C" __global__ void wb_gather',
                                          "static void wb_gather")
        cpp, so = d / f"g{size}.cpp", d / f"g{size}.so"
        cpp.write_text(_HOST + src + _RUN)
        subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-o", str(so), str(cpp)], check=True)
        out[size] = ctypes.CDLL(str(so))
    return out


def _region(flat, f0, na, nb, fa, fb):
    return np.lib.stride_tricks.as_strided(flat[f0:], shape=(na, nb),
                                           strides=(fa * flat.itemsize, fb * flat.itemsize))


@st.composite
def _spans(draw):
    """Regions inside buffers of 200 elements: (slot, f0, na, nb, fa, fb) with steps >= 1 (a
    transposed region has fa < fb), no two elements in one place (as a plan's: every element is
    written once)."""
    out = []
    taken: set[tuple[int, int]] = set()
    for _ in range(draw(st.integers(1, 8))):
        na, nb = draw(st.integers(1, 6)), draw(st.integers(1, 9))
        fb = draw(st.integers(1, 4))
        fa = draw(st.integers(1, 30))
        span = (na - 1) * fa + (nb - 1) * fb
        if span >= 200:
            continue
        f0, slot = draw(st.integers(0, 199 - span)), draw(st.integers(0, 2))
        at = {(slot, f0 + i * fa + j * fb) for i in range(na) for j in range(nb)}
        if len(at) < na * nb or at & taken:
            continue
        taken |= at
        out.append((slot, f0, na, nb, fa, fb))
    return out


def _run(lib, bufs, spans, stage, *, scatter, piece):
    tab = table(spans, piece=piece)
    assert tab.shape == (len(FIELDS), tab.shape[1]) and tab.dtype == np.int64
    _launch(lib, bufs, tab, [stage], scatter=scatter)
    return tab


def _launch(lib, bufs, tab, stages, *, scatter):
    ptrs = np.array([b.ctypes.data for b in bufs], np.uint64)
    s = np.array([a.ctypes.data for a in stages] * STAGES, np.uint64)[:STAGES]
    tab = np.ascontiguousarray(tab)
    lib.run(ptrs.ctypes.data_as(ctypes.c_void_p), tab.ctypes.data_as(ctypes.c_void_p),
            ctypes.c_longlong(tab.shape[1]), s.ctypes.data_as(ctypes.c_void_p),
            ctypes.c_int(int(scatter)))


@settings(max_examples=150, deadline=None)
@given(spans=_spans(), size=st.sampled_from([1, 2, 4, 8]), piece=st.sampled_from([1, 3, 7, 64]))
def test_packing_and_unpacking_match_numpy_views(kernels, spans, size, piece):
    assume(spans)
    dt = np.dtype(f"u{size}")
    rng = np.random.default_rng(len(spans) * 31 + piece)
    bufs = [rng.integers(0, np.iinfo(dt).max, 200, dtype=dt, endpoint=True) for _ in range(3)]
    want = np.concatenate([_region(bufs[sp[0]], *sp[1:]).reshape(-1) for sp in spans])
    stage = np.zeros(want.size, dt)
    tab = _run(kernels[size], bufs, spans, stage, scatter=False, piece=piece)
    np.testing.assert_array_equal(stage, want)
    transposed = (tab[4] == 1) & (tab[5] != 1)
    # no piece longer than asked, but transposed ones: whole rows, TILE of them or all
    assert (tab[2] * tab[3])[~transposed].max(initial=0) <= max(piece, 1)
    assert ((tab[2] % TILE == 0) | (tab[2] == _rows_of(spans, tab)))[transposed].all()
    # unpacking: each region gets its stretch of the message, in order (later ones win)
    fresh = rng.integers(0, np.iinfo(dt).max, want.size, dtype=dt, endpoint=True)
    got = [b.copy() for b in bufs]
    ref = [b.copy() for b in bufs]
    at = 0
    for s, f0, na, nb, fa, fb in spans:
        _region(ref[s], f0, na, nb, fa, fb)[...] = fresh[at:at + na * nb].reshape(na, nb)
        at += na * nb
    _run(kernels[size], got, spans, fresh, scatter=True, piece=piece)
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(g, r)


def _rows_of(spans, tab):
    """Per table row: the rows of the region it was cut from (the last region starting at or
    before its message position)."""
    starts = np.cumsum([0] + [sp[2] * sp[3] for sp in spans])[:-1]
    nas = np.array([sp[2] for sp in spans])
    return nas[np.searchsorted(starts, tab[6], side="right") - 1]


@settings(max_examples=40, deadline=None)
@given(na=st.integers(2, 80), nb=st.integers(2, 80), pad=st.integers(0, 5),
       size=st.sampled_from([1, 2, 4, 8]), piece=st.sampled_from([1, 64, 1 << 16]))
def test_transposed_regions_move_in_tiles_like_numpy(kernels, na, nb, pad, size, piece):
    """A region whose rows run down the buffer (a ``[out, in]`` message in an ``[in, out]``
    array, with ``pad`` elements between its columns), across several tiles and partial ones:
    packed, it is the numpy view's elements in order; unpacked, it writes them there and leaves
    every other element alone."""
    dt = np.dtype(f"u{size}")
    rng = np.random.default_rng(na * 1000 + nb * 10 + pad)
    fb = na + pad
    buf = rng.integers(0, np.iinfo(dt).max, 3 + fb * nb, dtype=dt, endpoint=True)
    spans = [(0, 3, na, nb, 1, fb)]
    want = _region(buf, 3, na, nb, 1, fb).reshape(-1).copy()
    stage = np.zeros(na * nb, dt)
    tab = _run(kernels[size], [buf], spans, stage, scatter=False, piece=piece)
    np.testing.assert_array_equal(stage, want)
    assert (tab[3] == nb).all() and tab[2].sum() == na  # whole rows only
    fresh = rng.integers(0, np.iinfo(dt).max, na * nb, dtype=dt, endpoint=True)
    ref, got = buf.copy(), buf.copy()
    _region(ref, 3, na, nb, 1, fb)[...] = fresh.reshape(na, nb)
    _run(kernels[size], [got], spans, fresh, scatter=True, piece=piece)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("na, nb, pad, f0", [(65, 66, 0, 2), (130, 64, 2, 0), (64, 130, 4, 4),
                                          (3, 2, 0, 2), (127, 2, 2, 0), (2, 200, 6, 2),
                                          (65, 66, 1, 2), (64, 64, 0, 1)])
@pytest.mark.parametrize("piece", [1, 1 << 16])
def test_transposed_bfloat16_regions_move_two_elements_a_thread(kernels, na, nb, pad, f0, piece):
    """Two-byte elements whose pairs are word-aligned on both sides (``f0``, the column step and
    ``nb`` even) go through the wider tiles, a word a thread: edges of odd and partial tiles
    included; the others (an odd column step or start) through the narrow ones. Packed and
    unpacked like numpy's view either way."""
    rng = np.random.default_rng(na * 7 + nb + pad + f0)
    fb = na + pad
    buf = rng.integers(0, 1 << 16, f0 + fb * nb, dtype=np.uint16)
    spans = [(0, f0, na, nb, 1, fb)]
    want = _region(buf, f0, na, nb, 1, fb).reshape(-1).copy()
    stage = np.zeros(na * nb, np.uint16)
    tab = _run(kernels[2], [buf], spans, stage, scatter=False, piece=piece)
    np.testing.assert_array_equal(stage, want)
    assert (tab[2][:-1] % PAIRED == 0).all() and tab[2].sum() == na  # whole tiles of rows
    fresh = rng.integers(0, 1 << 16, na * nb, dtype=np.uint16)
    ref, got = buf.copy(), buf.copy()
    _region(ref, f0, na, nb, 1, fb)[...] = fresh.reshape(na, nb)
    _run(kernels[2], [got], spans, fresh, scatter=True, piece=piece)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("size", [1, 2, 4, 8])
@pytest.mark.parametrize("f0, at, n", [(8, 0, 64), (16, 8, 40), (3, 0, 64), (8, 1, 63), (0, 0, 16)])
def test_contiguous_stretches_move_in_16_byte_words_where_aligned(kernels, size, f0, at, n):
    """A stretch contiguous on both sides, 16-byte aligned there and a multiple of 16 bytes long,
    moves in 16-byte words; any other one element by element. Both like numpy's slices."""
    dt = np.dtype(f"u{size}")
    rng = np.random.default_rng(f0 * 100 + at * 10 + n + size)
    buf = rng.integers(0, np.iinfo(dt).max, 256, dtype=dt, endpoint=True)
    # rows of n // 2 elements back to back (one run), at message position ``at``
    spans = [(0, f0, 2, n // 2, n // 2, 1)] if n % 2 == 0 else [(0, f0, 1, n, 1, 1)]
    stage = np.zeros(at + n, dt)
    tab = table(spans)
    tab[6] += at
    _launch(kernels[size], [buf], tab, [stage], scatter=False)
    np.testing.assert_array_equal(stage[at:], buf[f0:f0 + n])
    assert not stage[:at].any()
    fresh = rng.integers(0, np.iinfo(dt).max, at + n, dtype=dt, endpoint=True)
    ref, got = buf.copy(), buf.copy()
    ref[f0:f0 + n] = fresh[at:]
    _launch(kernels[size], [got], tab, [fresh], scatter=True)
    np.testing.assert_array_equal(got, ref)


@settings(max_examples=60, deadline=None)
@given(messages=st.lists(_spans(), min_size=1, max_size=STAGES), size=st.sampled_from([2, 4]),
       piece=st.sampled_from([3, 64]))
def test_stacked_tables_fill_each_message_s_own_staging(kernels, messages, size, piece):
    """Up to STAGES messages in one launch (a stacked table): each message's staging holds what
    its own table alone packs into it, and unpacking them all writes what unpacking each would
    (messages over other buffers, as each message's regions are its own)."""
    assume(all(messages))
    dt = np.dtype(f"u{size}")
    rng = np.random.default_rng(len(messages) * 7 + piece)
    bufs = [[rng.integers(0, 1000, 200, dtype=dt) for _ in range(3)] for _ in messages]
    flat = [b for per in bufs for b in per]  # message k's slot s is slot 3k + s
    tabs = []
    for k, spans in enumerate(messages):
        t = table(spans, piece=piece)
        t[0] += 3 * k
        tabs.append(t)
    want = [np.concatenate([_region(bufs[k][sp[0]], *sp[1:]).reshape(-1) for sp in spans])
            for k, spans in enumerate(messages)]
    stages = [np.zeros(w.size, dt) for w in want]
    _launch(kernels[size], flat, stacked(tabs), stages, scatter=False)
    for got, w in zip(stages, want):
        np.testing.assert_array_equal(got, w)
    fresh = [rng.integers(0, 1000, w.size, dtype=dt) for w in want]
    ref = [[b.copy() for b in per] for per in bufs]
    for k, spans in enumerate(messages):
        at = 0
        for s, f0, na, nb, fa, fb in spans:
            _region(ref[k][s], f0, na, nb, fa, fb)[...] = fresh[k][at:at + na * nb].reshape(na, nb)
            at += na * nb
    _launch(kernels[size], flat, stacked(tabs), fresh, scatter=True)
    for got, r in zip(flat, [b for per in ref for b in per]):
        np.testing.assert_array_equal(got, r)
    with pytest.raises(ValueError):
        stacked(tabs * (STAGES + 1))


def test_long_regions_are_cut_at_rows_or_within_a_row():
    """Rows are kept whole while they fit a piece; a longer row is cut into stretches; the
    pieces' message positions follow the region's order."""
    tab = table([(0, 10, 4, 3, 5, 1), (1, 0, 2, 10, 10, 1)], piece=7)
    rows = [tuple(int(x) for x in tab[:, k]) for k in range(tab.shape[1])]
    assert rows == [(0, 10, 2, 3, 5, 1, 0, 0), (0, 20, 2, 3, 5, 1, 6, 0),
                    (1, 0, 1, 7, 10, 1, 12, 0), (1, 7, 1, 3, 10, 1, 19, 0),
                    (1, 10, 1, 7, 10, 1, 22, 0), (1, 17, 1, 3, 10, 1, 29, 0)]
    assert table([]).shape == (len(FIELDS), 0)
    # transposed (rows step 1, columns step 100): whole rows, PAIRED at a time, however small
    # the pieces asked
    tab = table([(0, 0, 150, 100, 1, 100)], piece=7)
    assert tab[2].tolist() == [PAIRED, PAIRED, 150 - 2 * PAIRED]
    assert tab[1].tolist() == [0, PAIRED, 2 * PAIRED]
    assert tab[6].tolist() == [0, PAIRED * 100, 2 * PAIRED * 100]
