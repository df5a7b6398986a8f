"""Correspondence cost grows with blocks, not elements: the same layouts at 1x .. 10,000x elements.

A model of ``--tensors`` weight matrices ``[A*s, B*s]`` (``s`` = sqrt(scale)) is held by a JAX-style
trainer (2 replicas x TP 4, transposed ``[in, out]`` column shards) and needed by vLLM-style rollouts
(4 replicas x TP 8 row shards, plus a fused pair of tensors per rank). Maps are built from blocks
(no element is ever allocated), so a 10,000x larger model has exactly the same blocks and cells.
The ratio column is the time against the 1x run, measured side by side in this run.

    python bench/bench_correspond.py [--tensors 64] [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import wb
from wb.data.sourcemap import Blocks
from wb.data.correspondence import correspond


def _rows(off, A, B, a0, a1):  # rows [a0, a1) of an [A, B] tensor, as an [a1-a0, B] buffer
    return (a1 - a0, B), Blocks.of((0, a1 - a0, 0, B, off + a0 * B, B, 1))


def _cols_T(off, A, B, b0, b1):  # columns [b0, b1) transposed: a JAX [in, out] kernel shard
    return (b1 - b0, A), Blocks.of((0, b1 - b0, 0, A, off + b0, 1, B))


def layouts(n_tensors: int, scale: int, *, t_tp=4, t_dp=2, r_tp=8, r_dp=4):
    s = int(round(scale ** 0.5))
    A, B = 64 * s, 32 * s
    offs = [k * A * B for k in range(n_tensors)]
    trainers, rollouts = [], []
    for d in range(t_dp):
        for r in range(t_tp):
            bufs = {}
            for k, off in enumerate(offs):
                shape, b = _cols_T(off, A, B, r * B // t_tp, (r + 1) * B // t_tp)
                bufs[f"t{k}"] = wb.BufferSpec(wb.SourceMap.from_blocks(shape, b), "bfloat16")
            trainers.append(wb.Layout(wb.Worker(len(trainers), f"t{d}", "trainer", r), bufs))
    for d in range(r_dp):
        for r in range(r_tp):
            bufs = {}
            for k in range(0, n_tensors, 2):  # fused pairs: rows of tensor k then of tensor k+1
                parts = [_rows(offs[j], A, B, r * A // r_tp, (r + 1) * A // r_tp)
                         for j in (k, k + 1) if j < n_tensors]
                rows = sum(p[0][0] for p in parts)
                blocks = Blocks(*(np.concatenate(f) for f in zip(*[p[1] for p in parts])))
                blocks = blocks._replace(r0=np.cumsum([0] + [p[0][0] for p in parts[:-1]]))
                sm = wb.SourceMap.from_blocks((rows, B), blocks)
                bufs[f"fused{k}"] = wb.BufferSpec(sm, "bfloat16")
            rollouts.append(wb.Layout(wb.Worker(len(trainers) + len(rollouts), f"r{d}",
                                                "rollout", r), bufs))
    return trainers, rollouts, n_tensors * A * B


def run(n_tensors: int = 64, repeat: int = 5, scales=(1, 100, 10_000)) -> list[dict]:
    """Times ``wb.data.correspondence`` at each scale; scales alternate inside every repeat, so a noisy
    neighbour on the machine slows all of them alike."""
    cases = {s: layouts(n_tensors, s) for s in scales}
    times: dict[int, list[float]] = {s: [] for s in scales}
    corrs = {}
    for _ in range(repeat):
        for scale, (trainers, rollouts, _) in cases.items():
            t0 = time.perf_counter()
            corrs[scale] = correspond(trainers, rollouts)
            times[scale].append(time.perf_counter() - t0)
    out = []
    base = statistics.median(times[scales[0]])
    for scale, (trainers, rollouts, numel) in cases.items():
        med = statistics.median(times[scale])
        blocks = sum(b.sourcemap.blocks.count for lay in trainers + rollouts
                     for b in lay.buffers.values())
        corr = corrs[scale]
        out.append(dict(scale=scale, elements=numel, blocks=blocks, cells=int(corr.cell_id0.size),
                        overlaps=int(corr.overlaps().src_slot.size), median_s=med,
                        ratio_to_1x=med / base))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = run(args.tensors, args.repeat)
    if args.json:
        print(json.dumps(rows))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title="correspondence cost vs model size (same blocks)")
    for c in ("scale", "elements", "blocks", "cells", "overlaps", "median time", "vs 1x"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(f"{r['scale']:,}x", f"{r['elements']:,}", f"{r['blocks']:,}", f"{r['cells']:,}",
                  f"{r['overlaps']:,}", f"{r['median_s'] * 1e3:.1f} ms", f"{r['ratio_to_1x']:.2f}x")
    Console().print(t)


if __name__ == "__main__":
    main()
