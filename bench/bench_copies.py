"""How fast one GPU copies a message's worth of pieces between processes' buffers, by each way a
one-sided receiver could copy them: ``cudaMemcpyAsync`` per piece (on one stream, or spread over
several), the driver's ``cuMemcpyBatchAsync`` per batch, or one kernel launch per batch that
copies every piece of a table (16-byte words). One process alone, then ``--pairs`` pairs at once
(each receiver copying from its sender's memory through a CUDA IPC handle, as
:mod:`wb.runtime.transport.ipc` does), so that the copies' own speed is told apart from what the
update loop adds. GB/s of bytes copied (each byte is read once and written once); a whole-buffer
copy of the same bytes beside them as the device's own bound.

    python bench/bench_copies.py [--piece-mb 4] [--total-gb 2] [--batch 32] [--pairs 4] [--json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import time

_KERNEL = r"""
extern "C" __global__ void wb_copy_pieces(const unsigned long long* tab, long long n) {
    // tab: (3, n) src address, dst address, bytes; 16-byte words where all three allow
    for (long long k = blockIdx.y; k < n; k += gridDim.y) {
        const unsigned long long s = tab[k], d = tab[n + k], z = tab[2 * n + k];
        long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
        long long step = (long long)gridDim.x * blockDim.x;
        if (((s | d | z) & 15) == 0) {
            const uint4* src = (const uint4*)s; uint4* dst = (uint4*)d;
            long long w = z >> 4;
            for (long long i = t; i < w; i += step) dst[i] = src[i];
        } else {
            const unsigned char* src = (const unsigned char*)s; unsigned char* dst = (unsigned char*)d;
            for (long long i = t; i < (long long)z; i += step) dst[i] = src[i];
        }
    }
}
"""


def _batch_fn(device: int):
    """cuMemcpyBatchAsync (CUDA 13's _v2) or None, with stream-ordered attributes."""
    class Loc(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

    class Attr(ctypes.Structure):
        _fields_ = [("src_access_order", ctypes.c_int), ("src_hint", Loc), ("dst_hint", Loc),
                    ("flags", ctypes.c_uint)]
    lib = ctypes.CDLL("libcuda.so.1")
    p = ctypes.c_void_p
    try:
        fn = lib.cuMemcpyBatchAsync_v2
    except AttributeError:
        return None
    fn.argtypes = [p, p, p, ctypes.c_size_t, p, p, ctypes.c_size_t, p]
    fn.restype = ctypes.c_int
    attr = (Attr * 1)(Attr(1, Loc(1, device), Loc(1, device), 0))
    idx = (ctypes.c_size_t * 1)(0)

    def run(dsts, srcs, sizes, stream):
        n = len(dsts)
        d, s, z = (ctypes.c_uint64 * n)(*dsts), (ctypes.c_uint64 * n)(*srcs), (ctypes.c_size_t * n)(*sizes)
        return fn(d, s, z, n, attr, idx, 1, ctypes.c_void_p(stream.ptr))
    return run


def _methods(cp, src_ptr: int, dst, piece: int, count: int, batch: int, device: int):
    """name -> a function copying ``count`` pieces of ``piece`` bytes (shuffled order) from
    address ``src_ptr`` into ``dst``; each returns once the copies are queued."""
    import numpy as np

    order = np.random.default_rng(0).permutation(count)
    offs = [int(k) * piece for k in order]
    dptr = dst.data.ptr
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(3)]
    kern = cp.RawKernel(_KERNEL, "wb_copy_pieces")
    batches = [offs[i:i + batch] for i in range(0, count, batch)]
    tabs = [cp.asarray(np.array([[src_ptr + o for o in b], [dptr + o for o in b],
                                 [piece] * len(b)], np.uint64)) for b in batches]
    bfn = _batch_fn(device)

    def memcpy1():
        for o in offs:
            cp.cuda.runtime.memcpyAsync(dptr + o, src_ptr + o, piece, 4, streams[0].ptr)

    def memcpy3():
        for k, o in enumerate(offs):
            cp.cuda.runtime.memcpyAsync(dptr + o, src_ptr + o, piece, 4, streams[k % 3].ptr)

    def batched():
        for b in batches:
            assert bfn([dptr + o for o in b], [src_ptr + o for o in b], [piece] * len(b),
                       streams[0]) == 0

    def kernel():
        with streams[0]:
            for t in tabs:
                n = t.shape[1]
                kern((max(1, min(64, piece // (16 * 256 * 4))), min(n, 65535)), (256,),
                     (t, np.int64(n)))

    def whole():
        cp.cuda.runtime.memcpyAsync(dptr, src_ptr, piece * count, 4, streams[0].ptr)

    m = {"memcpy_1_stream": memcpy1, "memcpy_3_streams": memcpy3, "kernel_per_batch": kernel,
         "memcpy_whole": whole}
    if bfn is not None:
        m["memcpy_batch"] = batched
    return m, streams


def _time(cp, fn, streams, reps: int) -> float:
    """Seconds per call, best of ``reps``, from the call to every stream done."""
    best = float("inf")
    for _ in range(reps):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        fn()
        for s in streams:
            s.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def _sender(k: int, nbytes: int, q, go, done):
    import cupy as cp

    src = cp.full(nbytes, k + 1, cp.uint8)
    cp.cuda.Device().synchronize()
    q.put(bytes(cp.cuda.runtime.ipcGetMemHandle(src.data.ptr)))
    done.wait()


def _receiver(k: int, piece: int, count: int, batch: int, reps: int, q, go, res, names):
    import cupy as cp

    handle = q.get(timeout=300)
    src_ptr = cp.cuda.runtime.ipcOpenMemHandle(handle, 1)
    dst = cp.zeros(piece * count, cp.uint8)
    methods, streams = _methods(cp, src_ptr, dst, piece, count, batch, 0)
    out = {}
    for name in names:
        fn = methods.get(name)
        fn and fn()  # warm
        cp.cuda.Device().synchronize()
        go.wait()  # every receiver starts each method together
        out[name] = _time(cp, fn, streams, reps) if fn else None
        go.wait()
    ok = bool((dst[:16] == k + 1).all())
    res.put((k, out, ok))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--piece-mb", type=float, default=4.0)
    ap.add_argument("--total-gb", type=float, default=2.0, help="bytes each receiver copies")
    ap.add_argument("--batch", type=int, default=32, help="pieces per batched call or launch")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    import cupy as cp

    piece = int(a.piece_mb * 2**20)
    count = max(1, int(a.total_gb * 1e9) // piece)
    nbytes = piece * count
    rep = {"piece_bytes": piece, "pieces": count, "bytes": nbytes, "batch": a.batch}
    src = cp.full(nbytes, 7, cp.uint8)
    dst = cp.zeros(nbytes, cp.uint8)
    methods, streams = _methods(cp, src.data.ptr, dst, piece, count, a.batch, 0)
    one = {}
    for name, fn in methods.items():
        fn()
        one[name] = nbytes / _time(cp, fn, streams, a.reps) / 1e9
    cp.copyto(dst, src)
    t = _time(cp, lambda: cp.copyto(dst, src), [cp.cuda.get_current_stream()], a.reps)
    one["cupy_copy_whole"] = nbytes / t / 1e9
    rep["one_process_GBps"] = one
    src = dst = None  # the pairs below need the memory
    names = list(methods)
    if a.pairs:
        ctx = mp.get_context("spawn")
        qs, res = [ctx.Queue() for _ in range(a.pairs)], ctx.Queue()
        go, done = ctx.Barrier(a.pairs), ctx.Event()
        procs = [ctx.Process(target=_sender, args=(k, nbytes, qs[k], go, done)) for k in range(a.pairs)]
        procs += [ctx.Process(target=_receiver, args=(k, piece, count, a.batch, a.reps, qs[k], go,
                                                      res, names)) for k in range(a.pairs)]
        for p in procs:
            p.start()
        outs = [res.get(timeout=600) for _ in range(a.pairs)]
        done.set()
        for p in procs:
            p.join(60)
        agg = {}
        for name in names:
            ts = [o[1][name] for o in outs if o[1].get(name)]
            # each receiver's best; together they ran at once: the slowest bounds the aggregate
            agg[name] = a.pairs * nbytes / max(ts) / 1e9 if ts else None
        rep["pairs"] = a.pairs
        rep["pairs_aggregate_GBps"] = agg
        rep["pairs_ok"] = all(o[2] for o in outs)
    print(json.dumps(rep) if a.json else json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()
