"""How long the delta codec takes on one GPU (:mod:`wb.runtime.engine.deltas.device`, CuPy):
encode (compare with the base, gather the changes, count them per block), the same with the base
advanced to the new bytes (what an update runs: ``advance_many``) and apply (scatter) of
one message of bfloat16 at several densities, beside a device copy of the message's bytes (what
a dense message costs its sender at least). Best of ``--repeat`` by CUDA events and the host's
clock (the encode reads the count of changes back: the host waits for it). Every delta is
checked against the host codec's bytes, and every apply against the new bytes.

    python bench/bench_delta_device.py [--mib 128] [--densities 0.0005 0.02 0.0424 0.2] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=128, help="message size (a delta job's pieces)")
    ap.add_argument("--densities", type=float, nargs="+", default=[0.0005, 0.02, 0.0424, 0.2])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    import cupy

    from wb.algorithms import delta as codec
    from wb.runtime.engine.deltas import device as dev
    from wb.runtime.engine.deltas import tables as many

    n = (a.mib << 20) // 2
    rng = np.random.default_rng(0)
    base_h = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    base = cupy.asarray(base_h).view(cupy.uint8)
    out: dict = {"device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                 "message_bytes": int(base.nbytes), "by_density": {}}

    def timed(fn) -> float:
        fn()
        best = float("inf")
        for _ in range(a.repeat):
            cupy.cuda.Device().synchronize()
            t0 = time.perf_counter()
            fn()
            cupy.cuda.Device().synchronize()
            best = min(best, time.perf_counter() - t0)
        return best

    scratch = cupy.empty_like(base)
    copy_s = timed(lambda: cupy.copyto(scratch, base))
    out["copy_ms"] = round(copy_s * 1e3, 3)
    for density in a.densities:
        new_h = base_h.copy()
        hit = np.flatnonzero(rng.random(n) < density)
        new_h[hit] ^= 1
        new = cupy.asarray(new_h).view(cupy.uint8)
        d = dev.encode(base, new, itemsize=2, xp=cupy)
        want = codec.encode(base_h.view(np.uint8), new_h.view(np.uint8), itemsize=2)
        if cupy.asnumpy(d).tobytes() != want.tobytes():
            raise SystemExit(f"density {density}: the device's delta differs from the host's")
        enc_s = timed(lambda: dev.encode(base, new, itemsize=2, xp=cupy))

        def advance():  # what an update runs: the base advanced by the compaction, no copy
            cupy.copyto(scratch, base)
            many.advance_many([(scratch, new, 2)], xp=cupy)
        adv_s = timed(advance) - copy_s
        if cupy.asnumpy(scratch).tobytes() != new_h.tobytes():
            raise SystemExit(f"density {density}: the advanced base differs from the new bytes")

        def apply():
            cupy.copyto(scratch, base)
            dev.apply(scratch, d, xp=cupy)
        app_s = timed(apply) - copy_s
        if cupy.asnumpy(scratch).tobytes() != new_h.tobytes():
            raise SystemExit(f"density {density}: applied bytes differ from the new ones")
        row = {"changed": round(hit.size / n, 5), "kind": codec.kind_of(want),
               "delta_over_dense": round(d.nbytes / base.nbytes, 4),
               "encode_ms": round(enc_s * 1e3, 3), "advance_ms": round(adv_s * 1e3, 3),
               "apply_ms": round(app_s * 1e3, 3),
               "encode_over_copy": round(enc_s / copy_s, 2),
               "apply_over_copy": round(app_s / copy_s, 2)}
        out["by_density"][str(density)] = row
        print(f"density {density:>7}: {row}")
    print(f"device copy of {base.nbytes >> 20} MiB: {out['copy_ms']} ms")
    if a.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
