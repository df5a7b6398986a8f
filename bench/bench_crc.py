"""The CRC32C kernel's throughput on a CUDA device (``wb.runtime.engine.crc``), beside a device
copy of the same bytes: one 1 GiB buffer, 128 messages of 8 MiB in one launch (how an update
hashes a turn's messages) and 4096 of 64 KiB at 16-byte aligned addresses and not; for each
number of copies of its tables and of words loaded at once (``--variants copies:group,...``).
Times from CUDA events, best of ``--repeat``.

Then a receive's one-sided copy hashed as it goes, against the row copy kernel alone and the
copy followed by the CRC (``--fused stretch:threads,...``).

    python bench/bench_crc.py [--repeat 10] [--variants 32:8,32:16,16:8] [--fused ...] [--json]
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
    ap.add_argument("--fused", default="512:256,1024:1024,512:512,256:256,1024:256",
                    help="stretch:threads variants of the copy hashed as it goes, timed against "
                         "the row copy kernel alone and followed by the CRC ('' skips them)")
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
    if a.fused:
        rep.update(_fused(cupy, crc, big, dst, timed, a.fused))
    print(json.dumps(rep) if a.json else "\n".join(
        [f"a device copy moves {rep.pop('copy_GBps'):.0f} GB/s (read + write)"]
        + [f"{k}: {v.get('crc_GBps', v.get('GBps')):.0f} GB/s"
           + ("" if "right" not in v else ", right" if v["right"] else ", WRONG")
           for k, v in rep.items()]))


def _fused(cupy, crc, big, dst, timed, variants: str) -> dict:
    """A receive's one-sided copy as the transport groups them (8 messages of 8 MiB, one of 64
    MiB, one of 8 MiB), each way: the row copy kernel alone, the copy then the CRC, and the
    copy that hashes as it goes (``stretch:threads`` variants); GB/s of message bytes, and
    whether the fused copy's bytes and CRCs are right."""
    from wb.runtime.transport.copy_kernel import PieceCopier

    out = cupy.zeros(16, cupy.uint32)
    mib = 1 << 20
    cases = {"8 x 8 MiB": [(k * 8 * mib + 16 * k, 8 * mib) for k in range(8)],
             "1 x 64 MiB": [(0, 64 * mib)], "1 x 8 MiB": [(0, 8 * mib)]}
    copier, rep = PieceCopier(cupy), {}
    stream = cupy.cuda.get_current_stream()
    for name, msgs in cases.items():
        nbytes = sum(n for _, n in msgs)
        rows = [(dst.data.ptr + at, big.data.ptr + at, n) for at, n in msgs]
        copy_s = timed(lambda: copier.launch(rows, stream))
        plain = crc.Launcher(cupy, 1 << 12)
        both_s = timed(lambda: (copier.launch(rows, stream), plain.reset(),
                                plain.launch([(d, n, k) for k, (d, _, n) in enumerate(rows)],
                                             out)))
        rep[f"{name}: row copy"] = {"GBps": nbytes / copy_s / 1e9}
        rep[f"{name}: row copy, then CRC"] = {"GBps": nbytes / both_s / 1e9}
        want = [crc.host(cupy.asnumpy(big[at:at + n])) for at, n in msgs]
        for variant in variants.split(","):
            sub, threads = (int(x) for x in variant.split(":"))
            lz = crc.Launcher(cupy, 1 << 12, sub=sub, threads=threads)
            dst.fill(0)
            s = timed(lambda: (out.fill(0), lz.reset(),
                               lz.launch([(src, n, k, d) for k, (d, src, n) in enumerate(rows)],
                                         out, stream)))
            right = out[:len(msgs)].get().tolist() == want and all(
                bool((dst[at:at + n] == big[at:at + n]).all()) for at, n in msgs)
            rep[f"{name}: copy hashed as it goes, stretches {sub}, blocks of {threads}"] = {
                "GBps": nbytes / s / 1e9, "right": right}
    return rep


if __name__ == "__main__":
    main()
