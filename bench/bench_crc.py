"""The CRC32C kernel's throughput on a CUDA device (``wb.runtime.engine.crc``), beside a device
copy of the same bytes: one 1 GiB buffer, and 128 messages of 8 MiB in one launch (how an update
hashes a turn's messages). Times from CUDA events, best of ``--repeat``.

    python bench/bench_crc.py [--repeat 10] [--json]
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    import cupy
    from wb.runtime.engine import crc

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    big = cupy.random.randint(0, 256, 1 << 30, dtype=cupy.uint8)
    out = cupy.zeros(256, cupy.uint32)
    lz = crc.Launcher(cupy, 256 * (a.repeat + 1) * 2)
    cases = {"1 x 1 GiB": [(big.data.ptr, big.nbytes, 0)],
             "128 x 8 MiB": [(big.data.ptr + k * (8 << 20), 8 << 20, k) for k in range(128)]}
    rep = {}
    for name, bufs in cases.items():
        best = best_copy = float("inf")
        for _ in range(a.repeat):
            out.fill(0)
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            lz.launch(bufs, out)
            end.record()
            end.synchronize()
            best = min(best, cupy.cuda.get_elapsed_time(start, end) / 1e3)
            dst = cupy.empty_like(big)
            start.record()
            dst[...] = big
            end.record()
            end.synchronize()
            best_copy = min(best_copy, cupy.cuda.get_elapsed_time(start, end) / 1e3)
        got = int(out[0].get())
        want = crc.host(cupy.asnumpy(big[:bufs[0][1]]))
        rep[name] = {"crc_GBps": big.nbytes / best / 1e9, "copy_GBps": 2 * big.nbytes / best_copy / 1e9,
                     "right": got == want}
        lz.reset()
    print(json.dumps(rep) if a.json else "\n".join(
        f"{k}: CRC32C {v['crc_GBps']:.0f} GB/s (a device copy moves {v['copy_GBps']:.0f} GB/s, "
        f"read + write), value {'right' if v['right'] else 'WRONG'}" for k, v in rep.items()))


if __name__ == "__main__":
    main()
