"""Casts in flight: the same deployment with rollouts in the trainers' dtype and in a narrower
one, measured side by side in one run (``bench/bench_transfer.py``'s harness: spawned processes
over UCX, raw UCX throughput measured beside each, every rollout buffer checked bit for bit
against the converted weights).

The trainers hold float32; the rollouts need float32 (no conversion) or bfloat16 (the trainers
narrow while packing: half the bytes on the wire). Reported: bytes between processes and EWTT of
each, their ratios, and each EWTT against its own ideal.

    python bench/bench_casts.py [--cuda 0] [--json] [--hidden 2048 --layers 4 --experts 32]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_transfer import run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--narrow", default="bfloat16", help="the rollouts' dtype in the second run")
    ap.add_argument("--cuda", type=int, default=None, metavar="DEVICE")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    kw = dict(hidden=a.hidden, layers=a.layers, experts=a.experts, replicas=a.replicas,
              repeat=a.repeat, cuda_device=a.cuda)
    same = run(dtypes=("float32", "float32"), **kw)
    narrow = run(dtypes=("float32", a.narrow), **kw)
    rep = {"same": same, "narrow": narrow, "narrow_dtype": a.narrow,
           "bytes_ratio": narrow["bytes_between_processes"] / same["bytes_between_processes"],
           "ewtt_ratio": narrow["ewtt_s"] / same["ewtt_s"],
           "same_over_ideal": same["ewtt_over_ideal"],
           "narrow_over_ideal": narrow["ewtt_over_ideal"]}
    if a.out:
        Path(a.out).write_text(json.dumps(rep, indent=1))
    if a.json:
        print(json.dumps(rep))
        return
    for k in ("bytes_ratio", "ewtt_ratio", "same_over_ideal", "narrow_over_ideal"):
        print(f"{k:>20}: {rep[k]:.3f}")
    print(f"{'ewtt float32':>20}: {same['ewtt_s']:.4f} s, {a.narrow}: {narrow['ewtt_s']:.4f} s")


if __name__ == "__main__":
    main()
