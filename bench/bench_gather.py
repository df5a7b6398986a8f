"""How fast the pack/unpack kernel (:mod:`wb.runtime.engine.gather`) moves a message's regions on
one GPU, beside a plain device copy of the same bytes: what a JAX trainer's packs and a JAX
rollout's unpacks cost (PyTorch ``[out, in]`` rows against JAX ``[in, out]`` kernels: transposed
regions, through shared-memory tiles), one message a launch and
:data:`~wb.runtime.engine.gather.STAGES` a launch, and contiguous regions for reference. TB/s of
payload (each byte read once and written once), best of ``--repeat`` by CUDA events.

    python bench/bench_gather.py [--rows 2048 --cols 2048] [--messages 8] [--repeat 20]
        [--kernel-from FILE] [--json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048, help="a weight's rows (PyTorch [out, in])")
    ap.add_argument("--cols", type=int, default=2048, help="its columns")
    ap.add_argument("--messages", type=int, default=8, help="weights, one message each")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--kernel-from", metavar="FILE",
                    help="time the gather module of this file instead (another version of it)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    import cupy

    from wb.runtime.engine import gather

    if a.kernel_from:
        import importlib.util

        spec = importlib.util.spec_from_file_location("gather_from_file", a.kernel_from)
        gather = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(gather)

    R, C, M = a.rows, a.cols, min(a.messages, gather.STAGES)
    n = R * C
    bufs = [cupy.arange(n, dtype=cupy.uint16).reshape(C, R) + k for k in range(M)]  # JAX [in, out]
    stages = [cupy.empty(n, cupy.uint16) for _ in range(M)]
    ptrs = cupy.asarray(np.array([b.data.ptr for b in bufs], np.uint64))
    # message k: weight k in PyTorch order, element (o, i) at buffer k's flat[i * R + o]
    transposed = [gather.table([(k, 0, R, C, 1, R)]) for k in range(M)]
    contiguous = [gather.table([(k, 0, C, R, R, 1)]) for k in range(M)]

    def timed(fn) -> float:
        fn()
        best = float("inf")
        for _ in range(a.repeat):
            t0, t1 = cupy.cuda.Event(), cupy.cuda.Event()
            t0.record()
            fn()
            t1.record()
            t1.synchronize()
            best = min(best, cupy.cuda.get_elapsed_time(t0, t1) * 1e-3)
        return best

    out: dict = {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                 "message_bytes": 2 * n, "messages": M, "tb_per_s": {}}
    payload = 2 * n * M
    for name, tabs in (("transposed", transposed), ("contiguous", contiguous)):
        one = [cupy.asarray(t) for t in tabs]
        many = cupy.asarray(gather.stacked(tabs))
        for scatter in (False, True):
            what = f"{name}_{'unpack' if scatter else 'pack'}"
            s1 = timed(lambda: [gather.copy(ptrs, t, st, 2, scatter=scatter)
                                for t, st in zip(one, stages)])
            s8 = timed(lambda: gather.copy(ptrs, many, stages, 2, scatter=scatter))
            out["tb_per_s"][f"{what}_one_a_launch"] = round(payload / s1 / 1e12, 3)
            out["tb_per_s"][f"{what}_{M}_a_launch"] = round(payload / s8 / 1e12, 3)
    # the kernel's packs checked against numpy (a benchmark of wrong bytes says nothing)
    gather.copy(ptrs, cupy.asarray(gather.stacked(transposed)), stages, 2, scatter=False)
    for k in range(M):
        want = cupy.asnumpy(bufs[k]).T.reshape(-1)
        if not np.array_equal(cupy.asnumpy(stages[k]), want):
            raise SystemExit(f"message {k}: packed bytes differ from the weight's transpose")
    copy = timed(lambda: [cupy.copyto(st, b.reshape(-1)) for st, b in zip(stages, bufs)])
    out["tb_per_s"]["device_copy"] = round(payload / copy / 1e12, 3)
    for k, v in out["tb_per_s"].items():
        print(f"{k:>40}: {v:.3f} TB/s")
    if a.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
