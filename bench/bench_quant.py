"""The CUDA quantiser alone against the memory it must move: one trainer's block-scaled FP8
quantisation (:class:`wb.runtime.engine.fp8.Quantiser`, what an FP8 update runs first) beside a
device copy of the same source bytes, in one run on one GPU.

Two layouts of the same ``--tensors`` tensors of ``--rows`` x ``--cols`` bfloat16: ``rows`` (each
tensor held whole, row-major: the kernel reads whole block rows 16 bytes at once) and
``transposed`` (each held as its transpose: element by element, strided). Reported per layout:
the quantiser's time (min over ``--repeat``, from launch to its last event), the bytes it must
move (reads the source, writes FP8 values and float32 scales), the copy's bandwidth on this GPU
(``dst[...] = src`` of the source, min over the repeats), and ``over_ideal``: the quantiser's time
over those bytes at the copy's bandwidth. Every output is checked bit for bit against the host
quantiser (:func:`wb.algorithms.fp8.tasks.quantize_buffers`) on the first tensor.

    python bench/bench_quant.py [--tensors 8 --rows 4096 --cols 8192] [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import wb
from wb.algorithms.fp8.tasks import quantize_buffers, quantize_layouts
from wb.data.dtypes import convert, dtype_info
from wb.data.fp8 import FP8Blocks
from wb.runtime.engine.casts import xp_dtype
from wb.runtime.engine.fp8 import Quantiser


def _layouts(n: int, rows: int, cols: int, transposed: bool):
    spec = wb.CheckpointSpec({f"w{i}": ((rows, cols), "bfloat16") for i in range(n)})
    bufs = {}
    for name in spec.names:
        ids = spec.ids(name).reshape(rows, cols)
        bufs[name] = wb.BufferSpec(wb.SourceMap.from_indices(ids.T if transposed else ids),
                                   "bfloat16")
    trainer = wb.Layout(wb.Worker(0, "t", "trainer", 0), bufs)
    return quantize_layouts([trainer], FP8Blocks(tuple(spec.names)).bind(spec))


def _timed(cp, fn, repeat: int) -> float:
    """The least wall time of ``fn()`` (device work finished) over ``repeat`` runs after one."""
    fn()
    cp.cuda.runtime.deviceSynchronize()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        cp.cuda.runtime.deviceSynchronize()
        best = min(best, time.perf_counter() - t)
    return best


def _values(cp, rows: int, cols: int, transposed: bool, seed: int):
    """A tensor's bfloat16 values, of magnitudes varying by row, held as the layout holds them
    (numpy, and on the device as raw bits)."""
    rng = np.random.default_rng(seed)
    x = np.empty((rows, cols), dtype_info("bfloat16").numpy)
    convert(x, rng.standard_normal((rows, cols)) * np.exp2(rng.integers(-8, 8, (rows, 1))))
    held = np.ascontiguousarray(x.T) if transposed else x
    return held, cp.asarray(held.view(np.uint16)).view(xp_dtype(cp, "bfloat16"))


def measure(cp, n: int, rows: int, cols: int, repeat: int, transposed: bool) -> dict:
    # bit for bit on one tensor (the host quantiser takes seconds per GB)
    held, dev = _values(cp, rows, cols, transposed, 0)
    one = _layouts(1, rows, cols, transposed)
    qz1 = Quantiser(one, 0, {"w0": (cp, dev)})
    qz1.run({"w0": (cp, dev)})
    host = quantize_buffers(one, 0, {"w0": held})
    identical = all(cp.asnumpy(qz1.buffers[k]).view(np.uint8).tobytes() ==
                    h.view(np.uint8).tobytes() for k, h in host.items())
    del qz1
    q = _layouts(n, rows, cols, transposed)
    live = {f"w{i}": (cp, dev if i == 0 else cp.roll(dev, i)) for i in range(n)}
    qz = Quantiser(q, 0, live)
    quant_s = _timed(cp, lambda: qz.run(live), repeat)
    src = [a for _, a in live.values()]
    dst = [cp.empty_like(a) for a in src]

    def copy():
        for s, d in zip(src, dst):
            d[...] = s
    copy_s = _timed(cp, copy, repeat)
    src_bytes = sum(a.nbytes for a in src)
    out_bytes = sum(b.nbytes for b in qz.buffers.values())
    copy_GBps = 2 * src_bytes / copy_s / 1e9
    ideal_s = (src_bytes + out_bytes) / (copy_GBps * 1e9)
    return {"layout": "transposed" if transposed else "rows", "quant_s": quant_s,
            "source_bytes": src_bytes, "output_bytes": out_bytes, "copy_s": copy_s,
            "copy_GBps": copy_GBps, "quant_GBps": (src_bytes + out_bytes) / quant_s / 1e9,
            "ideal_s": ideal_s, "over_ideal": quant_s / ideal_s, "bit_identical": identical}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cuda", type=int, default=0, metavar="DEVICE")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    import cupy as cp

    cp.cuda.Device(a.cuda).use()
    rep = {"tensors": a.tensors, "shape": [a.rows, a.cols], "dtype": "bfloat16",
           "runs": [measure(cp, a.tensors, a.rows, a.cols, a.repeat, t) for t in (False, True)]}
    if a.out:
        Path(a.out).write_text(json.dumps(rep, indent=1))
    if a.json:
        print(json.dumps(rep))
        return
    for r in rep["runs"]:
        print(f"{r['layout']:>10}: quantiser {r['quant_s'] * 1e3:.2f} ms "
              f"({r['quant_GBps']:.0f} GB/s), "
              f"copy {r['copy_GBps']:.0f} GB/s, over_ideal {r['over_ideal']:.2f}, "
              f"bit_identical {r['bit_identical']}")


if __name__ == "__main__":
    main()
