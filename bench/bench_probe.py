"""Probe time per checkpoint element: ``wb_torch.probe`` now and before (dc0dd51), side by side.

With ``--framework jax``, ``wb_jax.probe`` of the reference JAX trainer's ``load_fn``
(``wb_jax.testing.make_load_fn``: transposes, reshapes, stacks) on JAX's default device: with
``--tp 1`` every checkpoint element lands in a leaf; with ``--tp 8`` the leaves are what one device
of a (1, 8) mesh holds (``tp_shard``). The load function is first run once on a checkpoint of
zeros, timed apart (``load_fn_first_run_s``: the compiles of its own eager operations, which a
trainer pays when it loads its real checkpoint with it); ``--cold-load`` skips that, so they count
in the probe.

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
    python bench/bench_probe.py --framework jax     # wb_jax.probe on JAX's default device

The last line is JSON: ``ns_per_ckpt_element`` (current), ``ns_per_ckpt_element_before``,
``speedup``, ``passes``, ``ckpt_elements``, ``rank_elements``, ``cache_hit_s``, ``exact``,
``peak_extra_bytes_per_rank_element`` (measured in the run that fills the cache: the GPU's peak
allocation above what was allocated before it, or numpy's peak under tracemalloc on a CPU, over
the rank's elements) and ``extrapolated_s``: per preset, the time one rank's probe takes at this
rate (a rank's load is fed every checkpoint element, whatever its share).
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
import tracemalloc
import types
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

import wb
import wb_torch
from wb.algorithms.probing.idcode import digit_base
from wb.layouts.presets import load_config, spec_from_config
from wb_torch.testing import TinyRollout, expected_maps
from wb.data.dtypes import dtype_info

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
    """Every map equals the oracle's: its ids (an array) or its SourceMap (equal diff2 entries,
    which is equal ids)."""
    return set(maps) == set(want) and all(
        maps[n] == w if isinstance(w, wb.SourceMap) else np.array_equal(maps[n].to_indices(), w)
        for n, w in want.items())


def presets() -> list[str]:
    return sorted(p.stem for p in (ROOT / "wb" / "layouts" / "models").glob("*.json"))


class Peak:
    """Peak extra memory of one run: the GPU allocator's (torch or JAX) or numpy's (tracemalloc)."""

    def __init__(self, framework: str, device: str):
        self.framework, self.device = framework, device

    def __enter__(self):
        if self.framework == "jax":
            import jax

            self._dev = jax.devices()[0]
            stats = self._dev.memory_stats() or {}
            self.base = stats.get("bytes_in_use")
        elif self.device != "cpu":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            tracemalloc.start()
            self.base = tracemalloc.get_traced_memory()[0]
        return self

    def __exit__(self, *exc):
        if self.framework == "jax":
            stats = self._dev.memory_stats() or {}
            # JAX's peak is since the process started: its params exist only during the probe
            peak = stats.get("peak_bytes_in_use")
            self.extra = None if peak is None or self.base is None else peak - self.base
        elif self.device != "cpu":
            torch.cuda.synchronize()
            self.extra = torch.cuda.max_memory_allocated() - self.base
        else:
            self.extra = tracemalloc.get_traced_memory()[1] - self.base
            tracemalloc.stop()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--framework", choices=["torch", "jax"], default="torch")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tp", type=int, default=8,
                    help="the TP degree of the rank probed (torch: TinyRollout's; JAX: the "
                         "reference trainer's leaves as device --rank of a (1, tp) mesh holds them)")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu", help="torch: where the model's parameters live")
    ap.add_argument("--arrays", choices=["default", "device"], default="default",
                    help="default: the shim's choice (numpy for CPU parameters, the device's "
                         "framework for GPU ones); device: the device implementation even on a CPU")
    ap.add_argument("--before", default=BEFORE, help="git commit of the probe to compare with")
    ap.add_argument("--no-before", action="store_true")
    ap.add_argument("--cold-load", action="store_true",
                    help="JAX: do not run the load function once before the probe (its own "
                         "first-run compiles then count in the probe's time)")
    args = ap.parse_args(argv)

    cfg = dict(load_config(args.preset), num_hidden_layers=args.layers,
               num_experts=args.experts)
    if args.framework == "jax":
        cfg["dtype"] = args.dtype
    spec = spec_from_config(cfg)
    if args.framework == "jax":
        import jax

        import wb_jax
        from wb_jax import testing as jt

        args.no_before, args.device = True, jax.default_backend()
        # JAX compiles each shape once per process; a persistent cache (JAX_COMPILATION_CACHE_DIR)
        # shares the compiles between ranks and restarts
        compile_cache = jax.config.jax_compilation_cache_dir
        # int64 ids of every leaf at once would not fit: SourceMaps, one leaf at a time
        want = jt.expected_maps(cfg, tp=args.tp, tp_rank=args.rank if args.tp > 1 else None,
                                as_maps=True)
        load_fn = jt.make_load_fn(cfg, tp_shard=(args.rank, args.tp) if args.tp > 1 else None)
        arrays = wb_jax.probing.DeviceArrays if args.arrays == "device" else lambda: None
        rank_elements = sum(math.prod(s) for s in _leaf_shapes(load_fn, spec))

        def run(**kw):
            return wb_jax.probe(load_fn, spec, arrays=arrays(), **kw)

        def sync():
            pass

        if not args.cold_load:  # the trainer runs its load once anyway, on its real checkpoint
            t = time.perf_counter()
            jax.block_until_ready(load_fn(_Zeros(spec)))
            load_first_s = time.perf_counter() - t
            print(f"load_fn's first run (zeros; its own compiles): {load_first_s:.2f} s",
                  flush=True)
    else:
        dtype = getattr(torch, args.dtype)
        want = expected_maps(cfg, tp_rank=args.rank, tp_size=args.tp)

        def fresh():
            return TinyRollout(cfg, tp_rank=args.rank, tp_size=args.tp, dtype=dtype,
                               device=args.device)

        rank_elements = sum(p.numel() for p in fresh().parameters())

        def arrays():
            return wb_torch.probing.DeviceArrays(args.device) if args.arrays == "device" else None

        def run(model=None, **kw):
            return wb_torch.probe(model or fresh(), spec, arrays=arrays(), **kw)

        def sync():
            if args.device != "cpu":
                torch.cuda.synchronize()
    base = digit_base({*spec.dtypes, args.dtype})
    passes = math.ceil(math.log(spec.numel, base)) + 1
    print(f"{args.framework}: {args.preset} x{args.layers} layers x{args.experts} experts, "
          f"TP={args.tp} rank {args.rank}: {spec.numel / 1e9:.3f} G checkpoint elements, "
          f"{rank_elements / 1e6:.1f} M rank elements, {passes} passes", flush=True)

    out = {"framework": args.framework, "preset": args.preset, "layers": args.layers,
           "jax_compilation_cache_dir": compile_cache if args.framework == "jax" else None,
           "load_fn_first_run_s": (None if args.framework == "torch" or args.cold_load
                                   else round(load_first_s, 3)),
           "experts": args.experts, "tp": args.tp, "rank": args.rank, "dtype": args.dtype,
           "device": args.device, "arrays": args.arrays, "passes": passes,
           "ckpt_elements": spec.numel, "rank_elements": rank_elements}
    model = fresh() if args.framework == "torch" else None
    sync()
    t = time.perf_counter()
    maps = run(model) if model is not None else run()
    sync()
    now = time.perf_counter() - t
    ok = exact(maps, want)
    del maps
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
        del old_maps
        out["ns_per_ckpt_element_before"] = before / spec.numel * 1e9
        out["speedup"] = before / now
        out["exact_before"] = ok_before
        print(f"before: {before:7.2f} s  {out['ns_per_ckpt_element_before']:6.2f} ns/element  "
              f"exact={ok_before}  ({args.before})", flush=True)
    key = {"tp": args.tp, "rank": args.rank}
    with tempfile.TemporaryDirectory() as tmp:
        model = fresh() if args.framework == "torch" else None
        with Peak(args.framework, args.device) as peak:
            t = time.perf_counter()
            run(model, cache=tmp, key=key) if model is not None else run(cache=tmp, key=key)
            sync()
            second = time.perf_counter() - t
        out["ns_per_ckpt_element_second_run"] = second / spec.numel * 1e9
        out["peak_extra_bytes_per_rank_element"] = (
            None if peak.extra is None else peak.extra / rank_elements)
        model = fresh() if args.framework == "torch" else None
        t = time.perf_counter()
        cached = run(model, cache=tmp, key=key) if model is not None else run(cache=tmp, key=key)
        out["cache_hit_s"] = time.perf_counter() - t
        ok = ok and exact(cached, want)
    out["exact"] = ok
    out["extrapolated_s"] = {
        p: round(out["ns_per_ckpt_element"] * spec_from_config(load_config(p)).numel / 1e9, 1)
        for p in presets()}
    print(f"second run (fills the cache): {second:.2f} s, peak extra "
          f"{out['peak_extra_bytes_per_rank_element']} bytes per rank element; cache hit "
          f"{out['cache_hit_s']:.3f} s", flush=True)
    print("extrapolated per rank: " + ", ".join(f"{p} {s:.0f} s"
                                                for p, s in out["extrapolated_s"].items()))
    print(json.dumps(out))
    return out


class _Zeros(Mapping):
    """A checkpoint of zeros on JAX's first device (committed there, as the probe's tensors are:
    JAX compiles committed and uncommitted arguments apart), each tensor made when read."""

    def __init__(self, spec):
        self.spec = spec

    def __getitem__(self, name):
        import jax
        import jax.numpy as jnp

        return jax.device_put(jnp.zeros(self.spec.shape(name),
                                        dtype_info(self.spec.dtype(name)).numpy),
                              jax.devices()[0])

    def __iter__(self):
        return iter(self.spec.names)

    def __len__(self):
        return len(self.spec)


def _leaf_shapes(load_fn, spec):
    import jax

    abstract = {n: jax.ShapeDtypeStruct(s, dtype_info(d).numpy)
                for n, (s, d) in spec.items()}
    return [x.shape for x in jax.tree_util.tree_leaves(jax.eval_shape(load_fn, abstract))]


if __name__ == "__main__":
    sys.exit(0 if main()["exact"] else 1)
