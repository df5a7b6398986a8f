"""Probe time per checkpoint element: ``wb_torch.probe`` now and before (dc0dd51), side by side.

The rank probed is a ``TinyRollout`` TP rank (vLLM-style load_weights) of a preset's dimensions with
few layers and experts (default: qwen3-30b-a3b, 2 layers, 8 experts, TP=8 rank 0: 0.74 G
checkpoint elements). The earlier probe is read from git (``--before``, the commit before issue
13's work) and run through the same load closure that ``wb_torch.probe`` used. Both runs start
from a freshly built model; both sets of maps are checked against ``expected_maps``, the
per-element oracle. A third run reads the maps back from a cache (``cache=``).

Usage::

    python bench/bench_probe.py                     # before and after, one JSON line last
    python bench/bench_probe.py --no-before         # only the current probe
    python bench/bench_probe.py --arrays device     # the torch device implementation, here on CPU
    python bench/bench_probe.py --device cuda       # parameters on a GPU (probed there)

The last line is JSON: ``ns_per_ckpt_element`` (current), ``ns_per_ckpt_element_before``,
``speedup``, ``passes``, ``ckpt_elements``, ``rank_elements``, ``cache_hit_s``, ``exact``.
Times are wall-clock on whatever else the machine runs: compare the two numbers of one run.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch

import wb
import wb_torch
from wb.algorithms.probe import digit_base
from wb.layouts.presets import load_config, spec_from_config
from wb_torch.testing import TinyRollout, expected_maps

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "dc0dd51"  # the last commit before issue 13's probe work


def legacy_probe_module(commit: str) -> types.ModuleType:
    """``wb/algorithms/probe.py`` as it was at ``commit``, as a module."""
    src = subprocess.run(["git", "show", f"{commit}:wb/algorithms/probe.py"], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout
    mod = types.ModuleType("legacy_probe")
    exec(compile(src, f"{commit}:wb/algorithms/probe.py", "exec"), mod.__dict__)
    return mod


def legacy_torch_probe(core, model, spec):
    """``wb_torch.probe`` before issue 13: parameters read once, numpy views, the old core."""
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device

    raw = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)

    def load(ckpt):
        with torch.no_grad():
            for p in params.values():
                p.view(torch.uint8).zero_() if p.dtype in raw else p.zero_()
            model.load_weights((n, wb_torch.from_numpy(ckpt[n], device)) for n in ckpt)
        return {n: wb_torch.to_numpy(p) for n, p in params.items()}
    return core.probe(spec, load)


def exact(maps, want) -> bool:
    return set(maps) == set(want) and all(
        np.array_equal(maps[n].to_indices(), ids) for n, ids in want.items())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu", help="where the model's parameters live")
    ap.add_argument("--arrays", choices=["default", "device"], default="default",
                    help="default: wb_torch.probe's choice (numpy for CPU parameters, torch on "
                         "the device for GPU ones); device: torch on the device even on a CPU")
    ap.add_argument("--before", default=BEFORE, help="git commit of the probe to compare with")
    ap.add_argument("--no-before", action="store_true")
    args = ap.parse_args(argv)

    cfg = dict(load_config(args.preset), num_hidden_layers=args.layers,
               num_experts=args.experts)
    spec = spec_from_config(cfg)
    dtype = getattr(torch, args.dtype)
    want = expected_maps(cfg, tp_rank=args.rank, tp_size=args.tp)

    def fresh():
        return TinyRollout(cfg, tp_rank=args.rank, tp_size=args.tp, dtype=dtype,
                           device=args.device)

    model = fresh()
    rank_elements = sum(p.numel() for p in model.parameters())
    base = digit_base({*spec.dtypes, wb.dtypes.canonical_dtype(dtype)})
    passes = math.ceil(math.log(spec.numel, base)) + 1
    print(f"{args.preset} x{args.layers} layers x{args.experts} experts, TP={args.tp} rank "
          f"{args.rank}: {spec.numel / 1e9:.3f} G checkpoint elements, "
          f"{rank_elements / 1e6:.1f} M rank elements, {passes} passes", flush=True)

    arrays = (wb_torch._DeviceArrays(torch.device(args.device)) if args.arrays == "device"
              else None)
    out = {"preset": args.preset, "layers": args.layers, "experts": args.experts, "tp": args.tp,
           "rank": args.rank, "dtype": args.dtype, "device": args.device, "arrays": args.arrays,
           "passes": passes,
           "ckpt_elements": spec.numel, "rank_elements": rank_elements}
    t = time.perf_counter()
    maps = wb_torch.probe(model, spec, arrays=arrays)
    if args.device != "cpu":
        torch.cuda.synchronize()
    now = time.perf_counter() - t
    ok = exact(maps, want)
    out["ns_per_ckpt_element"] = now / spec.numel * 1e9
    print(f"now:    {now:7.2f} s  {out['ns_per_ckpt_element']:6.2f} ns/element  exact={ok}",
          flush=True)
    if not args.no_before:
        core = legacy_probe_module(args.before)
        model = fresh()
        t = time.perf_counter()
        old_maps = legacy_torch_probe(core, model, spec)
        before = time.perf_counter() - t
        ok_before = exact(old_maps, want)
        out["ns_per_ckpt_element_before"] = before / spec.numel * 1e9
        out["speedup"] = before / now
        out["exact_before"] = ok_before
        print(f"before: {before:7.2f} s  {out['ns_per_ckpt_element_before']:6.2f} ns/element  "
              f"exact={ok_before}  ({args.before})", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        wb_torch.probe(fresh(), spec, cache=tmp, key={"tp": args.tp, "rank": args.rank})
        model = fresh()
        t = time.perf_counter()
        cached = wb_torch.probe(model, spec, cache=tmp, key={"tp": args.tp, "rank": args.rank})
        out["cache_hit_s"] = time.perf_counter() - t
        ok = ok and exact(cached, want)
    out["exact"] = ok
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    sys.exit(0 if main()["exact"] else 1)
