"""The CUDA source of the delta codec's kernels (:mod:`wb.runtime.engine.deltas.device` launches
them), one block of :data:`THREADS` threads per :data:`~wb.algorithms.delta.BLOCK` of elements:

- ``wb_delta_count_W``: a message's changes counted per block (elements of ``W`` bytes);
- ``wb_delta_compact_W``: their values and places written in order (optionally advancing the
  base to the new bytes as it reads them);
- ``wb_delta_count_many``, ``wb_delta_compact_many``: the same for several messages by one
  launch each, from a table of them (the compaction writing whole BLOCKS deltas: header, values,
  counts and places);
- ``wb_delta_positions``, ``wb_delta_scatter_W``: one delta's places checked, then applied;
- ``wb_delta_check_many``, ``wb_delta_scatter_many``: several deltas checked and applied by one
  launch each, from a table of them, each delta's header read on the device (the host reads
  nothing before it applies them).

The tests compile the same source for the host (one thread a block).
"""

from __future__ import annotations

import functools

__all__ = ["THREADS", "kernel_source", "module", "kernels"]

#: Threads of a block of the kernels; a block of them takes one :data:`~wb.algorithms.delta.BLOCK`
#: of elements.
THREADS = 1024

_SOURCE = r"""
#define WB_WARPS ((blockDim.x + 31) >> 5)
template <typename T>
__device__ void count_changes(const T* a, const T* b, long long n, long long blk,
                              unsigned int* out) {
    long long start = blk * 65536, end = start + 65536 < n ? start + 65536 : n;
    unsigned int c = 0;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) c += a[i] != b[i];
    for (int o = 16; o > 0; o >>= 1) c += __shfl_down_sync(0xffffffffu, c, o);
    __shared__ unsigned int warp[32];
    if ((threadIdx.x & 31) == 0) warp[threadIdx.x >> 5] = c;
    __syncthreads();
    if (threadIdx.x < 32) {
        c = threadIdx.x < WB_WARPS ? warp[threadIdx.x] : 0;
        for (int o = 16; o > 0; o >>= 1) c += __shfl_down_sync(0xffffffffu, c, o);
        if (threadIdx.x == 0) *out = c;
    }
}
// The changes of one block of 65536 elements, in order: the block walks them a row of
// blockDim.x at a time; each change's rank in its row is its warp's changes before it (a
// ballot) plus those of the warps before (the first warp scans the warps' counts). With
// ``advance`` the base takes each changed element's new value as it is read (then it holds the
// new bytes, as a copy would leave it, writing only the changes).
template <typename T>
__device__ void compact_changes(T* a, const T* b, long long n, long long blk, long long at,
                                T* values, unsigned short* places, int advance) {
    long long start = blk * 65536, end = start + 65536 < n ? start + 65536 : n;
    __shared__ unsigned int warp[32];
    __shared__ unsigned int row_total;
    unsigned int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    for (long long row = start; row < end; row += blockDim.x) {
        long long i = row + threadIdx.x;
        T x = 0;
        bool changed = false;
        if (i < end) {
            x = b[i];
            changed = a[i] != x;
        }
        unsigned int ballot = __ballot_sync(0xffffffffu, changed);
        unsigned int before = __popc(ballot & ((1u << lane) - 1u));
        if (lane == 0) warp[w] = __popc(ballot);
        __syncthreads();
        if (w == 0) {
            unsigned int t = lane < WB_WARPS ? warp[lane] : 0, s = t;
            for (int o = 1; o < 32; o <<= 1) {
                unsigned int y = __shfl_up_sync(0xffffffffu, s, o);
                if (lane >= (unsigned int)o) s += y;
            }
            if (lane < WB_WARPS) warp[lane] = s - t;
            if (lane == WB_WARPS - 1) row_total = s;
        }
        __syncthreads();
        if (changed) {
            long long p = at + warp[w] + before;
            values[p] = x;
            places[p] = (unsigned short)(i - start);
            if (advance) a[i] = x;
        }
        at += row_total;
        __syncthreads();
    }
}
// Each change's place checked (ascending within its block, inside the message) and its position
// written; block b's changes are starts[b] .. starts[b + 1] - 1, and the counts' total must be
// the header's k (the last of the nb blocks checks it). A bad one sets ``bad``, which the scatter
// reads: a malformed delta writes nothing.
extern "C" __global__ void wb_delta_positions(const unsigned short* places,
        const long long* starts, long long n, long long nb, long long k, long long* pos,
        unsigned int* bad) {
    long long s = starts[blockIdx.x], e = starts[blockIdx.x + 1];
    long long first = (long long)blockIdx.x * 65536;
    if (threadIdx.x == 0 && (long long)blockIdx.x == nb - 1 && e != k) atomicOr(bad, 1u);
    if (e > k) e = k;
    for (long long j = s + threadIdx.x; j < e; j += blockDim.x) {
        long long p = first + places[j];
        if (p >= n || (j > s && places[j] <= places[j - 1])) atomicOr(bad, 1u);
        pos[j] = p;
    }
}
template <typename T>
__device__ void scatter_changes(T* target, const T* values, const long long* pos, long long k,
                                const unsigned int* bad) {
    if (*bad) return;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < k;
         j += (long long)gridDim.x * blockDim.x)
        target[pos[j]] = values[j];
}
#define WB_DELTA_KERNELS(T, W) \
extern "C" __global__ void wb_delta_count_##W(const T* a, const T* b, long long n, \
                                              unsigned int* counts) { \
    count_changes<T>(a, b, n, blockIdx.x, counts + blockIdx.x); } \
extern "C" __global__ void wb_delta_compact_##W(T* a, const T* b, long long n, \
        const long long* starts, T* values, unsigned short* places, int advance) { \
    compact_changes<T>(a, b, n, blockIdx.x, starts[blockIdx.x], values, places, advance); } \
extern "C" __global__ void wb_delta_scatter_##W(T* target, const T* values, \
        const long long* pos, long long k, const unsigned int* bad) { \
    scatter_changes<T>(target, values, pos, k, bad); }
WB_DELTA_KERNELS(unsigned char, 1)
WB_DELTA_KERNELS(unsigned short, 2)
WB_DELTA_KERNELS(unsigned int, 4)
WB_DELTA_KERNELS(unsigned long long, 8)
// Several messages' changes counted by one launch over all their blocks (block_job: each global
// block's message). A message's row of ``tab``: its base's address, its new bytes', elements n,
// element bytes w, its first block.
#define WB_COUNT_TAB 5
#define WB_WIDTHS(CALL) switch (w) { \
    case 1: CALL(unsigned char); break; case 2: CALL(unsigned short); break; \
    case 4: CALL(unsigned int); break; default: CALL(unsigned long long); }
extern "C" __global__ void wb_delta_count_many(const long long* tab, const int* block_job,
                                               unsigned int* counts) {
    const long long* r = tab + (long long)block_job[blockIdx.x] * WB_COUNT_TAB;
    long long n = r[2], w = r[3], blk = (long long)blockIdx.x - r[4];
#define WB_COUNT(T) count_changes<T>((const T*)r[0], (const T*)r[1], n, blk, counts + blockIdx.x)
    WB_WIDTHS(WB_COUNT)
}
// Several BLOCKS deltas written by one launch over all their blocks, each base advanced. A
// delta's row of ``tab``: its base's address, its new bytes', n, w, the delta's address, its
// first block, where its counts and places start, its header (four words), where its values end
// (zeros from there to the counts), and its first block in the counting launch's ``counts``;
// ``starts``: each block's first change in its message.
#define WB_COMPACT_TAB 14
extern "C" __global__ void wb_delta_compact_many(const long long* tab, const int* block_job,
        const long long* starts, const unsigned int* counts) {
    const long long* r = tab + (long long)block_job[blockIdx.x] * WB_COMPACT_TAB;
    long long n = r[2], w = r[3], blk = (long long)blockIdx.x - r[5];
    unsigned char* d = (unsigned char*)r[4];
    if (threadIdx.x == 0) {
        ((unsigned int*)(d + r[6]))[blk] = counts[r[13] + blk];
        if (blk == 0) {
            for (int i = 0; i < 4; ++i) ((long long*)d)[i] = r[8 + i];
            for (long long i = r[12]; i < r[6]; ++i) d[i] = 0;
        }
    }
    unsigned short* places = (unsigned short*)(d + r[7]);
#define WB_COMPACT(T) compact_changes<T>((T*)r[0], (const T*)r[1], n, blk, starts[blockIdx.x], \
                                         (T*)(d + 32), places, 1)
    WB_WIDTHS(WB_COMPACT)
}
// Several BLOCKS deltas applied by two launches over all their blocks (block_job: each global
// block's delta), each reading its delta's header where it lies, so that the host reads nothing
// first. A delta's row of ``tab``: its address, its target's, the target's bytes, the bytes its
// receive holds, its blocks nb (of the element width the host expects), its flag in ``bad`` and
// its size in ``sizes``, its first block. The check reads the header (wb_head: 2 where it is not
// a BLOCKS delta of nb blocks for this target, for the host to apply; 1 where its sizes
// disagree), finds each block's first change (the counts before it, summed by the block), checks
// its places and the counts' total, and keeps the start; the scatter then writes the changes of
// every delta whose flag stayed clear. Block 0 of a good header writes its size. A target that is
// regions of buffers rather than one range (a unit received packed) has its regions' gather
// table (wb.runtime.engine.gather: fields slot, f0, na, nb, fa, fb, at, a row each, rows in
// message order), its row count and the buffers' addresses by slot in the row's last three
// words, and the table's element width in place of the target's address (no table: zero rows;
// a delta of another width is the host's to apply: 2).
#define WB_TAB 10
struct WbHead { long long w, n, k, size, at; };
__device__ unsigned int wb_head(const long long* r, WbHead* h) {
    const unsigned char* d = (const unsigned char*)r[0];
    const long long* q = (const long long*)d;
    if (r[3] < 32) return 1;
    long long w = d[1], t = r[2];
    h->size = q[1]; h->n = q[2]; h->k = q[3]; h->w = w;
    if (d[0] != 3) return 2;
    if (!(w == 1 || w == 2 || w == 4 || w == 8) || h->n < 0 || h->n > t || h->n * w != t
        || h->k < 0 || h->k > h->n) return 1;
    long long nb = (h->n + 65535) / 65536;
    if (nb != r[4] || (r[8] && w != r[1])) return 2;
    h->at = 32 + h->k * w + (4 - (32 + h->k * w) % 4) % 4;
    if (h->size != h->at + 4 * nb + 2 * h->k || h->size > r[3]) return 1;
    return 0;
}
__device__ long long wb_block_start(const unsigned int* counts, long long b, long long* part) {
    long long acc = 0;
    for (long long i = threadIdx.x; i < b; i += blockDim.x) acc += counts[i];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        long long t = 0;
        for (unsigned int j = 0; j < WB_WARPS; ++j) t += part[j];
        part[32] = t;
    }
    __syncthreads();
    return part[32];
}
extern "C" __global__ void wb_delta_check_many(const long long* tab, const int* block_job,
        long long* starts, unsigned int* bad, long long* sizes) {
    __shared__ long long part[33];
    const long long* r = tab + (long long)block_job[blockIdx.x] * WB_TAB;
    long long b = (long long)blockIdx.x - r[6], nb = r[4];
    WbHead h;
    unsigned int code = wb_head(r, &h);  // the same for every thread of the block
    if (code) {
        if (threadIdx.x == 0) atomicOr(bad + r[5], code);
        return;
    }
    const unsigned char* d = (const unsigned char*)r[0];
    long long n = h.n, k = h.k;
    if (threadIdx.x == 0 && b == 0) sizes[r[5]] = h.size;
    const unsigned int* counts = (const unsigned int*)(d + h.at);
    const unsigned short* places = (const unsigned short*)(d + h.at + 4 * nb);
    long long s = wb_block_start(counts, b, part), e = s + counts[b];
    if (threadIdx.x == 0) {
        if ((b == nb - 1 && e != k) || e > k) atomicOr(bad + r[5], 1u);
        starts[blockIdx.x] = s;
    }
    if (e > k) e = k;
    long long first = b * 65536;
    for (long long j = s + threadIdx.x; j < e; j += blockDim.x)
        if (first + places[j] >= n || (j > s && places[j] <= places[j - 1]))
            atomicOr(bad + r[5], 1u);
}
// Where element p of a message lies in regions of buffers (a gather table of ``rows`` rows,
// ``ptrs`` the buffers' addresses by slot; elements of w bytes): the last row that starts at or
// before p (``*row``: -1 to search for it, else a row at or before it to walk on from, a few
// rows, then searching the rest).
__device__ unsigned char* wb_region(const long long* tab, long long rows,
                                    const unsigned long long* ptrs, long long p, long long* row,
                                    long long w) {
    const long long* at = tab + 6 * rows;
    long long k = *row;
    if (k < 0) {
        long long lo = 0, hi = rows - 1;
        while (lo < hi) {
            long long mid = (lo + hi + 1) / 2;
            if (at[mid] <= p) lo = mid; else hi = mid - 1;
        }
        k = lo;
    }
    for (int step = 0; step < 8 && k + 1 < rows && at[k + 1] <= p; ++step) ++k;
    if (k + 1 < rows && at[k + 1] <= p) {  // far on (a thread's elements lie blockDim apart)
        long long lo = k + 1, hi = rows - 1;
        while (lo < hi) {
            long long mid = (lo + hi + 1) / 2;
            if (at[mid] <= p) lo = mid; else hi = mid - 1;
        }
        k = lo;
    }
    *row = k;
    long long q = p - at[k], nb = tab[3 * rows + k];
    return (unsigned char*)ptrs[tab[k]]
        + (tab[rows + k] + q / nb * tab[4 * rows + k] + q % nb * tab[5 * rows + k]) * w;
}
extern "C" __global__ void wb_delta_scatter_many(const long long* tab, const int* block_job,
        const long long* starts, const unsigned int* bad) {
    const long long* r = tab + (long long)block_job[blockIdx.x] * WB_TAB;
    if (bad[r[5]]) return;
    WbHead h;
    wb_head(r, &h);  // good: its flag is clear
    const unsigned char* d = (const unsigned char*)r[0];
    unsigned char* t = (unsigned char*)r[1];
    long long k = h.k, w = h.w, b = (long long)blockIdx.x - r[6];
    const unsigned int* counts = (const unsigned int*)(d + h.at);
    const unsigned short* places = (const unsigned short*)(d + h.at + 4 * r[4]);
    long long s = starts[blockIdx.x], e = s + counts[b], first = b * 65536;
    if (e > k) e = k;
    const long long* rt = (const long long*)r[7];
    long long rows = r[8], row = -1;
    for (long long j = s + threadIdx.x; j < e; j += blockDim.x) {
        long long p = first + places[j];
        if (rows) {  // a thread's places ascend: its row found once, then walked forward
            t = wb_region(rt, rows, (const unsigned long long*)r[9], p, &row, w);
            p = 0;
        }
        switch (w) {
            case 1: t[p] = d[32 + j]; break;
            case 2: ((unsigned short*)t)[p] = ((const unsigned short*)(d + 32))[j]; break;
            case 4: ((unsigned int*)t)[p] = ((const unsigned int*)(d + 32))[j]; break;
            default: ((unsigned long long*)t)[p] = ((const unsigned long long*)(d + 32))[j];
        }
    }
}
"""


def kernel_source() -> str:
    """The CUDA source of the codec's kernels; also compiled for the host by the tests."""
    return _SOURCE


@functools.lru_cache(maxsize=None)
def module():
    """The kernels compiled for the current CUDA device (once per process)."""
    import cupy  # only CUDA buffers come here

    return cupy.RawModule(code=_SOURCE, options=("-std=c++14",))


def kernels(itemsize: int):
    """``(count, compact)`` for elements of ``itemsize`` bytes."""
    m = module()
    return (m.get_function(f"wb_delta_count_{itemsize}"),
            m.get_function(f"wb_delta_compact_{itemsize}"))
