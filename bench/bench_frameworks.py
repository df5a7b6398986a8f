"""EWTT of every trainer -> rollout pairing of frameworks (PyTorch, JAX), measured in one run.

Each pairing runs the demo's processes (:func:`wb.cli.demo.runner.run_processes`: each side
probes its own load function, they agree on a plan and run ``--steps`` updates per sync mode over
UCX) on a qwen3_moe-style model scaled by ``--hidden``, ``--layers`` and ``--experts``; every
rollout buffer is checked bit for bit against the rollout's own load of the trainer's checkpoint
after every update, and both ends are checked to move the frameworks' own memory (the address of
every buffer wb reads or writes is the array's own). With ``--cuda`` every process is on the
GPUs: PyTorch tensors and JAX arrays alike, several processes sharing a GPU.

    python bench/bench_frameworks.py [--cuda] [--hidden 2048 --layers 4 --experts 16] \\
        [--pairs torch:torch jax:torch torch:jax jax:jax] [--out FILE.json]

The last line is one JSON object: per pairing and sync mode the EWTT (median over the updates
after the first, which also warms every path up), and each pairing's EWTT over the PyTorch ->
PyTorch one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_transfer import model  # noqa: E402 - the same scaled qwen3_moe-style model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cuda", action="store_true", help="every process on the GPUs")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4, help="updates per sync mode (default 4)")
    ap.add_argument("--modes", nargs="+", default=["sync", "both"])
    ap.add_argument("--pairs", nargs="+", default=["torch:torch", "jax:torch", "torch:jax",
                                                   "jax:jax"])
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args(argv)
    from rich.console import Console

    from wb.cli.demo.runner import run_processes
    from wb.data.dtypes import dtype_info
    from wb.layouts.presets import spec_from_config

    cfg = dict(model(a.hidden, a.layers, a.experts), name="bench-frameworks")
    spec = spec_from_config(cfg)
    nbytes = sum(int(np.prod(spec.shape(n))) * dtype_info(spec.dtype(n)).itemsize
                 for n in spec.names)
    console = Console(stderr=True)
    console.log(f"{cfg['name']}: {nbytes / 2**20:,.0f} MiB of bf16 weights, "
                f"{'GPU' if a.cuda else 'CPU'} processes, pairs {a.pairs}")
    out = {"model": cfg, "checkpoint_bytes": nbytes, "cuda": a.cuda, "steps": a.steps,
           "pairs": {}}
    for pair in a.pairs:
        trainer, rollout = pair.split(":")
        t0 = time.perf_counter()
        r = run_processes(trainer, rollout, replicas=1, tp=1, modes=a.modes, steps=a.steps,
                          train_s=0.2, gen_s=0.005, cuda=a.cuda, cfg=cfg, timeout=1200)
        one = {"verified": r["transfers_verified"], "wall_s": round(time.perf_counter() - t0, 1),
               "errors": r.get("errors", {}), "modes": {}}
        for mode, m in r["modes"].items():
            per_v = [e for v, e in sorted(m.get("ewtt_per_version_s", {}).items())]
            one["modes"][mode] = {k: m.get(k) for k in ("agst_s", "checks", "mismatches",
                                                        "verified")}
            one["modes"][mode].update(  # the first update also warms every path up
                ewtt_s=float(np.median(per_v[1:] if len(per_v) > 1 else per_v)) if per_v else None,
                ewtt_per_version_s=per_v)
        out["pairs"][pair] = one
        console.log(pair, json.dumps(one["modes"]), "verified" if one["verified"] else "FAILED")
    base = out["pairs"].get("torch:torch")
    if base and base["verified"]:
        for pair, one in out["pairs"].items():
            one["ewtt_over_torch"] = {
                m: round(v["ewtt_s"] / base["modes"][m]["ewtt_s"], 3)
                for m, v in one["modes"].items()
                if v.get("ewtt_s") and base["modes"].get(m, {}).get("ewtt_s")}
    out["all_verified"] = all(p["verified"] for p in out["pairs"].values())
    line = json.dumps(out)
    if a.out:
        Path(a.out).write_text(line + "\n")
    print(line)
    return 0 if out["all_verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
