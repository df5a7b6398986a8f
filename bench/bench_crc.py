"""The CRC32C kernel's throughput on a CUDA device (``wb.runtime.engine.crc``), beside a device
copy of the same bytes: one 1 GiB buffer, 128 messages of 8 MiB in one launch (how an update
hashes a turn's messages) and 4096 of 64 KiB at 16-byte aligned addresses and not; for each
number of copies of its tables and of words loaded at once (``--variants copies:group,...``).
Times from CUDA events, best of ``--repeat``.

    python bench/bench_crc.py [--repeat 10] [--variants 32:8,32:16,16:8] [--json]
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    import cupy
    from wb.runtime.engine import crc

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--variants", default=f"{crc.COPIES}:{crc.GROUP},32:4,16:8")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    big = cupy.random.randint(0, 256, 1 << 30, dtype=cupy.uint8)
    dst = cupy.empty_like(big)
    out = cupy.zeros(4096, cupy.uint32)
    cases = {"1 x 1 GiB": [(big.data.ptr, big.nbytes, 0)],
             "128 x 8 MiB": [(big.data.ptr + k * (8 << 20), 8 << 20, k) for k in range(128)],
             "4096 x 64 KiB": [(big.data.ptr + k * (64 << 10), 64 << 10, k) for k in range(4096)],
             "4096 x 64 KiB, unaligned": [(big.data.ptr + k * (64 << 10) + 2, (64 << 10) - 6, k)
                                          for k in range(4096)]}
    start, end = cupy.cuda.Event(), cupy.cuda.Event()

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(a.repeat):
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, cupy.cuda.get_elapsed_time(start, end) / 1e3)
        return best

    copy_s = timed(lambda: dst.__setitem__(Ellipsis, big))
    rep = {"copy_GBps": 2 * big.nbytes / copy_s / 1e9}
    for variant in a.variants.split(","):
        copies, group = (int(x) for x in variant.split(":"))
        lz = crc.Launcher(cupy, 4096 * (a.repeat + 2), copies=copies, group=group)
        for name, bufs in cases.items():
            lz.reset()
            s = timed(lambda: (out.fill(0), lz.launch(bufs, out)))
            ptr0, n0, _ = bufs[0]
            first = cupy.ndarray((n0,), cupy.uint8, cupy.cuda.MemoryPointer(
                big.data.mem, ptr0 - big.data.ptr))
            right = int(out[0].get()) == crc.host(cupy.asnumpy(first))
            rep[f"{name}; tables x{copies}, loads of {group}"] = {
                "crc_GBps": sum(b[1] for b in bufs) / s / 1e9, "right": right}
    print(json.dumps(rep) if a.json else "\n".join(
        [f"a device copy moves {rep.pop('copy_GBps'):.0f} GB/s (read + write)"]
        + [f"{k}: CRC32C {v['crc_GBps']:.0f} GB/s, value {'right' if v['right'] else 'WRONG'}"
           for k, v in rep.items()]))


if __name__ == "__main__":
    main()
