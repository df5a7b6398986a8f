"""Block-scaled FP8 rollouts against BF16 ones: the same deployment (BF16 Megatron trainers, vLLM
rollouts), measured side by side in one run with ``bench/bench_transfer.py``'s harness (spawned
processes over UCX, raw UCX throughput measured beside each, every rollout buffer checked bit
for bit: the BF16 rollouts against the weights, the FP8 ones against the weights quantised).

The FP8 rollouts serve every ``*_proj.weight`` (attention, dense MLP and expert matrices) as
``float8_e4m3fn`` with one float32 scale per 128 x 128 block; embeddings, norms and routers stay
BF16. Each trainer quantises the blocks it was given inside the measured update, as
``wb.Sender.push`` does (the kernels queued at once, each buffer sent as soon as it is written):
the FP8 EWTT runs from the quantiser's start, and ``update_ratio`` is the FP8 update's EWTT
over the BF16 one's. The quantiser alone (``quantize_s``, the slowest trainer's, one run after
a warm-up) is reported beside it.
Each process runs ``--warmup`` updates before the measured one (``first_ewtt_s``: the first's).
``--delta LR`` measures instead successive BF16 versions sent dense and as deltas (see its help).

    python bench/bench_fp8.py [--cuda 0] [--json] [--hidden 2048 --layers 4 --experts 32]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_transfer import run  # noqa: E402


def main() -> None:
    import wb
    from wb.algorithms.planner import DEFAULT_CHUNK_BYTES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cuda", type=int, default=None, metavar="DEVICE")
    ap.add_argument("--warmup", type=int, default=1,
                    help="updates per process before the measured one (default 1: a first "
                         "update also loads kernels and maps memory; first_ewtt_s has it)")
    ap.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_BYTES / 2**20,
                    help="plan piece size (MiB; default wb.plan's, 8)")
    ap.add_argument("--pack-mb", type=float, default=None,
                    help="the plan packs contiguous ranges below this (MiB; default wb.plan's, "
                         "1): fewer, larger messages, packed and unpacked")
    ap.add_argument("--polling", choices=("auto", "on", "off"), default="auto",
                    help="UCX progress threads busy-poll (on) or wait on events (off); auto: "
                         "wb.UcxTransport's default (with a CUDA device: no thread, the update "
                         "loop progresses UCX; WB_UCX_PROGRESS chooses too)")
    ap.add_argument("--checksums", choices=("on", "off", "compare"), default="on",
                    help="every message checked against its sender's CRC32C (on, wb's default) "
                         "or not; compare: the BF16 update with them off, then on (no FP8 run): "
                         "checksums_ratio is on's EWTT over off's")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--trace", metavar="DIR",
                    help="per-message traces of each run, DIR/{bf16,fp8}/trace_<run>.json "
                         "(read with bench/trace_summary.py)")
    ap.add_argument("--profile", metavar="DIR",
                    help="a cProfile of each process's measured update, "
                         "DIR/{bf16,fp8}/<run>_r<rank>.prof (read with pstats)")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds an update may go without progress before it fails, naming "
                         "what it waits for")
    ap.add_argument("--only", choices=("bf16", "fp8"),
                    help="run only the BF16 or only the FP8 update (no ratios)")
    ap.add_argument("--quantise-before", action="store_true",
                    help="with --only fp8: trainers quantise before the measured update, which "
                         "is then the FP8 transfer alone (not the whole update a user waits for)")
    ap.add_argument("--delta", type=float, metavar="LR",
                    help="instead: BF16 versions changing as many values as Adam at LR changes "
                         "(measured on a sample of a million ids: wb.testing.versions.AdamById; "
                         "placed by hash), sent dense and as deltas, each version timed: per "
                         "version the fraction changed, the bytes and EWTT of deltas over dense")
    ap.add_argument("--versions", type=int, default=4, help="with --delta (the first is dense)")
    ap.add_argument("--delta-pack-mb", type=float, default=None,
                    help="with --delta: the deltas' plan packs contiguous ranges below this "
                         "(MiB; default: what agree_parts(delta=True) plans, DELTA_PACK_BELOW; "
                         "dense: wb.plan's default)")
    ap.add_argument("--delta-chunk-mb", type=float, default=None,
                    help="with --delta: the deltas' plan piece size (default: what "
                         "agree_parts(delta=True) plans, DELTA_CHUNK_BYTES; dense: --chunk-mb)")
    a = ap.parse_args()
    kw = dict(hidden=a.hidden, layers=a.layers, experts=a.experts, replicas=a.replicas,
              repeat=a.repeat, cuda_device=a.cuda, warmup=a.warmup,
              chunk=int(a.chunk_mb * 2**20),
              polling={"auto": None, "on": True, "off": False}[a.polling], timeout=a.timeout)
    if a.pack_mb is not None:
        kw["pack_below"] = int(a.pack_mb * 2**20)
    trace = (lambda name: str(Path(a.trace, name))) if a.trace else (lambda name: None)
    prof = (lambda name: str(Path(a.profile, name))) if a.profile else (lambda name: None)
    if a.checksums == "compare":
        off = run(trace_out=trace("bf16_off"), profile_out=prof("bf16_off"), checksums=False,
                  **kw)
        on = run(trace_out=trace("bf16_on"), profile_out=prof("bf16_on"), checksums=True, **kw)
        rep = {"bf16_checksums_off": off, "bf16_checksums_on": on,
               "checksums_ratio": on["ewtt_s"] / off["ewtt_s"],
               "off_over_ideal": off["ewtt_over_ideal"], "on_over_ideal": on["ewtt_over_ideal"]}
        if a.out:
            Path(a.out).write_text(json.dumps(rep, indent=1))
        print(json.dumps(rep) if a.json else
              f"bf16 ewtt: checksums off {off['ewtt_s']:.4f} s, on {on['ewtt_s']:.4f} s: "
              f"checksums_ratio {rep['checksums_ratio']:.3f}")
        return
    kw["checksums"] = a.checksums == "on"
    if a.delta is not None:
        rep = _deltas(a, kw)
        if a.out:
            Path(a.out).write_text(json.dumps(rep, indent=1))
        print(json.dumps(rep) if a.json else "\n".join(
            f"v{r['version']}: {r['changed']:.2%} changed, bytes {r['bytes_over_dense']:.3f}x "
            f"dense, EWTT {r['delta_ewtt_s']:.4f} s / {r['dense_ewtt_s']:.4f} s = "
            f"{r['ewtt_over_dense']:.3f}x" for r in rep["by_version"]))
        return
    fp8_blocks = wb.FP8Blocks(("*_proj.weight",))
    if a.only:
        one = run(fp8=fp8_blocks if a.only == "fp8" else None, before=a.quantise_before,
                  trace_out=trace(a.only),
                  profile_out=prof(a.only), **kw)
        if a.out:
            Path(a.out).write_text(json.dumps({a.only: one}, indent=1))
        print(json.dumps(one) if a.json else
              f"{a.only}: ewtt {one['ewtt_s']:.4f} s ({one['ewtt_over_ideal']:.2f}x its ideal), "
              f"{one['messages']} messages, quantising alone {one['quantize_s']:.4f} s")
        return
    bf16 = run(trace_out=trace("bf16"), profile_out=prof("bf16"), **kw)
    if a.out:  # a partial report, should the FP8 run not finish
        Path(a.out).write_text(json.dumps({"bf16": bf16}, indent=1))
    print(f"bf16: ewtt {bf16['ewtt_s']:.4f} s, {bf16['messages']} messages", flush=True)
    fp8 = run(fp8=fp8_blocks, trace_out=trace("fp8"), profile_out=prof("fp8"), **kw)
    rep = {"bf16": bf16, "fp8": fp8,
           "bytes_ratio": fp8["bytes_between_processes"] / bf16["bytes_between_processes"],
           "trainer_bytes_ratio": fp8["model_bytes"] / bf16["model_bytes"],
           "ewtt_ratio": fp8["ewtt_s"] / bf16["ewtt_s"],
           "first_ewtt_ratio": fp8["first_ewtt_s"] / bf16["first_ewtt_s"],
           # the whole update: quantising included (inside the EWTT, or before the transfer)
           "update_ratio": (fp8["ewtt_s"] + (0.0 if fp8["quantize_in_ewtt"] else
                                             fp8["quantize_s"])) / bf16["ewtt_s"],
           "bf16_over_ideal": bf16["ewtt_over_ideal"], "fp8_over_ideal": fp8["ewtt_over_ideal"]}
    if a.out:
        Path(a.out).write_text(json.dumps(rep, indent=1))
    if a.json:
        print(json.dumps(rep))
        return
    for k in ("trainer_bytes_ratio", "bytes_ratio", "ewtt_ratio", "first_ewtt_ratio",
              "update_ratio",
              "bf16_over_ideal", "fp8_over_ideal"):
        print(f"{k:>20}: {rep[k]:.3f}")
    print(f"{'ewtt':>20}: bf16 {bf16['ewtt_s']:.4f} s, fp8 {fp8['ewtt_s']:.4f} s (quantising "
          f"inside; alone it takes {fp8['quantize_s']:.4f} s)")


def _deltas(a, kw: dict) -> dict:
    """``--delta LR``: the density Adam at LR gives (its first step, the largest), then the
    same versions dense and as deltas, one run each."""
    import numpy as np

    from wb.testing.versions import AdamById, changed_fraction

    gen = AdamById(np.arange(1 << 20), lr=a.delta)
    first = gen.weights()
    gen.step()
    density = changed_fraction({"w": first}, {"w": gen.weights()})
    from wb.algorithms.planner import DELTA_CHUNK_BYTES, DELTA_PACK_BELOW

    kw = {k: v for k, v in kw.items() if k not in ("repeat", "warmup")}
    dense = run(versions={"count": a.versions, "density": density, "delta": False}, **kw)
    kw["chunk"] = (int(a.delta_chunk_mb * 2**20) if a.delta_chunk_mb is not None
                   else DELTA_CHUNK_BYTES)
    kw["pack_below"] = (int(a.delta_pack_mb * 2**20) if a.delta_pack_mb is not None
                        else DELTA_PACK_BELOW)
    delta = run(versions={"count": a.versions, "density": density, "delta": True}, **kw)
    rows = []
    for d, x in zip(dense["versions"], delta["versions"]):
        rows.append({"version": d["version"], "changed": x["changed"],
                     "dense_ewtt_s": d["ewtt_s"], "delta_ewtt_s": x["ewtt_s"],
                     "ewtt_over_dense": x["ewtt_s"] / d["ewtt_s"],
                     "dense_bytes": d["received"], "delta_bytes": x["received"],
                     "bytes_over_dense": x["received"] / max(d["received"], 1)})
    return {"lr": a.delta, "density": density, "by_version": rows,
            "device": "cuda" if a.cuda is not None else "cpu",
            "dense_chunk_bytes": int(a.chunk_mb * 2**20), "delta_chunk_bytes": kw["chunk"],
            "delta_pack_below": kw["pack_below"],
            "processes": delta["processes"], "bit_identical": True}


if __name__ == "__main__":
    main()
