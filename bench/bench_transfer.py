"""Executor EWTT over UCX against the raw UCX throughput measured in the same run.

A qwen3_moe-style model scaled to fit (``--hidden``, ``--layers``, ``--experts``) is held by
Megatron-style trainers (TP2 EP2, 2 DP replicas = 4 processes) and needed by vLLM-style rollouts
(``--replicas`` nodes x TP2/EP2 = 2 processes each). Every process is spawned on this host and runs
its part of the plan (``wb.runtime.engine.executor.execute``) over ``UcxTransport``; EWTT is from the common start
(a barrier) to the last rollout buffer complete, median of ``--repeat`` runs. Rollout buffers are
checked bit for bit after every run.

Raw throughput is measured in the same run with plain UCX sends of 64 MiB (256 MiB on a GPU; no
packing; 4 messages in flight, as the executor keeps several): one sender->receiver pair, and as
many concurrent pairs as the plan has concurrently busy links.
Two ideals follow:

- per link: the plan's busiest link (the most bytes one process sends or receives) / one pair's
  throughput: the physical bound when every process has its own NIC;
- per host: all bytes the plan moves between processes / the concurrent pairs' aggregate
  throughput: the bound when, as here, every "link" is the same few cores and memory.

``ideal`` is the larger; ``ewtt_over_ideal`` is what the executor adds (packing, forwarding,
messages, progress threads). Each repeat measures raw throughput and then the executor back to back
and takes their ratio; the run with the median ratio is reported (all runs are in ``runs``).

    python bench/bench_transfer.py [--quick] [--json] [--tls tcp,posix,sysv,self]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from wb.algorithms.fp8.tasks import quantize_layouts


def model(hidden: int, layers: int, experts: int) -> dict:
    from wb.layouts.presets import TINY

    return dict(TINY, name="bench-moe", vocab_size=32000, hidden_size=hidden, num_hidden_layers=layers,
                first_k_dense_replace=1, intermediate_size=4 * hidden, num_experts=experts,
                moe_intermediate_size=hidden // 2, num_attention_heads=16, num_key_value_heads=4,
                head_dim=hidden // 16)


def build(cfg: dict, replicas: int, shape: str = "tp2"):
    from wb.layouts import megatron_trainer, vllm_rollout

    if shape == "single":  # one link: the executor's own overhead against raw UCX
        trainers = megatron_trainer(cfg, tp=1, pp=1, ep=1, nodes=["trainer0"], gpus_per_node=1)
        rollouts = vllm_rollout(cfg, tp=1, ep=1, replicas=1, nodes_per_replica=1,
                                gpus_per_replica=1, gpus_per_node=1, first_rank=1)
        return trainers, rollouts
    trainers = megatron_trainer(cfg, tp=2, pp=1, ep=2, nodes=["trainer0"], gpus_per_node=4)
    rollouts = vllm_rollout(cfg, tp=2, ep=2, replicas=replicas, nodes_per_replica=1,
                            gpus_per_replica=2, gpus_per_node=2, first_rank=len(trainers))
    return trainers, rollouts


def retyped(layouts, dtype: str):
    """The same layouts with every buffer of ``dtype``."""
    import wb

    return [wb.Layout(lay.worker, {k: wb.BufferSpec(b.sourcemap, dtype)
                                   for k, b in lay.buffers.items()}) for lay in layouts]


def run(*, hidden=1024, layers=4, experts=16, replicas=2, repeat=3, tls=None, chunk=8 << 20,
        staging=None, cuda_device=None, shape="tp2", dtypes=None, fp8=None, before=False,
        trace_out=None, warmup=0, polling=None, checksums=True, timeout=120.0,
        profile_out=None, versions=None, pack_below=None) -> dict:
    """``dtypes``: ``(trainers', rollouts')`` buffer dtypes instead of the model's (a plan that
    converts when they differ; rollouts are checked against the converted weights). ``fp8``: an
    :class:`wb.FP8Blocks`: the rollouts serve those tensors block-scaled (their layouts from
    :func:`wb.layouts.fp8.fp8_rollouts`), each trainer quantises its blocks inside the measured
    update (as ``Sender.push`` does: queued on the device, each buffer sent once written; the
    EWTT runs from the quantiser's start: ``quantize_in_ewtt``), timed alone before it too
    (``quantize_s``), and rollouts are checked against the quantised weights; ``before``: each
    trainer quantises before the measured update instead (its transfer alone: where an update's
    time goes). ``trace_out``: a folder for each run's per-message trace (``trace_<run>.json``:
    per rank, :class:`wb.runtime.engine.update.TraceEntry` rows; read with
    ``bench/trace_summary.py``).
    ``warmup``: updates each process runs before the measured one, over the same connections (as
    a Sender's later updates run; ``first_ewtt_s`` is the first one's). ``polling``: the UCX
    progress threads' mode (:class:`wb.UcxTransport`'s ``polling``; None: its default).
    ``checksums``: every message checked against its sender's CRC32C (wb's default), or not.
    ``timeout``: seconds an update may go without progress before it fails, naming what it
    waits for. ``profile_out``: a folder for each process's :mod:`cProfile` of its measured
    update (``<run>_r<rank>.prof``; read with :mod:`pstats`). ``versions``: instead, successive
    versions (``{"count", "density", "delta"}``: :mod:`harness.versions_run`), each timed on its
    own; returns :func:`_versions_report`. ``pack_below``: the plan's (``wb.plan``; None: its
    default)."""
    import wb

    # the multi-process harness of the tests (tests/harness) runs the plan's ranks
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from harness.multiproc import raw_throughput, run_ranks

    cfg = model(hidden, layers, experts)
    trainers, rollouts = build(cfg, replicas, shape)
    if dtypes:
        trainers, rollouts = retyped(trainers, dtypes[0]), retyped(rollouts, dtypes[1])
    fp8_opt, own = None, trainers
    if fp8 is not None:
        from wb.layouts.presets import spec_from_config
        from wb.layouts.fp8 import fp8_rollouts

        scaled = fp8.bind(spec_from_config(cfg))
        rollouts = fp8_rollouts(rollouts, scaled)
        q = quantize_layouts(trainers, scaled)
        trainers = list(q.trainers)
        fp8_opt = {"quantized": q, "own": {t.worker.rank: t for t in own},
                   "held": own[0].buffers[next(iter(own[0].buffers))].dtype, "before": before}
    p = wb.plan(trainers, rollouts, chunk_bytes=chunk,
                **({} if pack_below is None else {"pack_below": pack_below}))
    work = Path(tempfile.mkdtemp(prefix="wb-bench-"))
    p.save(work / "plan.npz")
    ranks = [lay.worker.rank for lay in (*trainers, *rollouts)]
    M = p.messages
    between = M.src_rank != M.dst_rank
    nbytes = M.nbytes[between].astype(np.float64)
    out_b = np.bincount(M.src_rank[between], weights=nbytes, minlength=len(ranks))
    in_b = np.bincount(M.dst_rank[between], weights=nbytes, minlength=len(ranks))
    busiest = float(max(out_b.max(), in_b.max()))
    total = float(nbytes.sum())
    senders = int((out_b > 0).sum())
    big = 256 << 20 if cuda_device is not None else 64 << 20
    pairs = min(senders, len(ranks) // 2)
    # raw pairs: sender on the trainers' device, receiver on the rollouts'
    raw_dev = ((cuda_device["trainer"], cuda_device["rollout"]) if isinstance(cuda_device, dict)
               else cuda_device)
    if versions is not None:
        r = run_ranks(str(work / "plan.npz"), ranks, str(work / "versions"),
                      options={"timeout": timeout, "staging_bytes": staging,
                               "cuda_device": cuda_device, "polling": polling,
                               "checksums": checksums, "versions": versions},
                      join_timeout=600)
        return _versions_report(r.results, ranks, len(trainers), versions, total)
    rows = []
    for k in range(repeat):
        # raw throughput and the executor run back to back, so each ratio compares like with like
        raw1 = raw_throughput(1, big, 12, str(work / f"raw1_{k}"), tls=tls, cuda_device=raw_dev)
        rawk = raw_throughput(pairs, big, 8, str(work / f"rawk_{k}"), tls=tls,
                              cuda_device=raw_dev)
        r = run_ranks(str(work / "plan.npz"), ranks, str(work / f"run{k}"),
                            options={"timeout": timeout, "barrier": True, "tls": tls,
                               "profile": (str(Path(profile_out, f"{k}")) if profile_out
                                           else None),
                               "staging_bytes": staging, "cuda_device": cuda_device,
                               "held": dtypes[0] if dtypes else None, "fp8": fp8_opt,
                               "trace": trace_out is not None, "warmup": warmup,
                               "polling": polling, "checksums": checksums},
                      join_timeout=600)
        res = r.results
        bad = [x for x in ranks if not (res[x] and res[x]["ok"])]
        if bad:
            raise RuntimeError(f"ranks {bad} failed: {[res[x] for x in bad][:2]}")
        if not all(res[x]["bit_identical"] for x in ranks if x >= len(trainers)):
            raise RuntimeError("a rollout buffer is not bit-identical")
        t0 = min(res[x]["start_s"] for x in ranks)
        ewtt = max(res[x]["end_s"] for x in ranks) - t0
        if trace_out is not None:
            Path(trace_out).mkdir(parents=True, exist_ok=True)
            Path(trace_out, f"trace_{k}.json").write_text(json.dumps(
                {str(x): {"t0": t0, "messages": res[x].get("trace", [])} for x in ranks}))
        p2p, agg = raw1["aggregate_Bps"], rawk["aggregate_Bps"]
        if pairs == 1:  # two samples of the same single pair: the faster is the bound
            p2p = agg = max(p2p, agg)
        ideal = max(busiest / p2p, total / agg)
        quant = [res[x]["quantize_s"] for x in ranks if "quantize_s" in res[x]]
        inside = any(res[x].get("quantize_in_ewtt") for x in ranks)
        first = (max(res[x]["warmup"][0][1] for x in ranks)
                 - min(res[x]["warmup"][0][0] for x in ranks)) if warmup else ewtt
        rows.append({"ewtt_s": ewtt, "first_ewtt_s": first,
                     "quantize_s": max(quant) if quant else 0.0, "quantize_in_ewtt": inside,
                     "raw_p2p_GBps": p2p / 1e9, "raw_aggregate_GBps": agg / 1e9,
                     "ideal_link_s": busiest / p2p, "ideal_host_s": total / agg,
                     "ideal_s": ideal, "ratio": ewtt / ideal,
                     # per rank: its start and end, seconds after the first start
                     "ranks": {str(x): [round(res[x]["start_s"] - t0, 5),
                                        round(res[x]["end_s"] - t0, 5)] for x in ranks}})
    mid = sorted(rows, key=lambda x: x["ratio"])[len(rows) // 2]  # the run with the median ratio
    return {"model_bytes": int(wb.lower_bound(trainers, rollouts).trainer_total),
            "device": ("cuda: trainers GPU %d, rollouts GPU %d" % (cuda_device["trainer"],
                                                                 cuda_device["rollout"])
                       if isinstance(cuda_device, dict) else
                       "cuda" if cuda_device is not None else "cpu"),
            "processes": len(ranks), "replicas": replicas, "bytes_between_processes": int(total),
            "busiest_link_bytes": int(busiest), "raw_p2p_GBps": mid["raw_p2p_GBps"],
            "raw_concurrent_pairs": pairs, "raw_aggregate_GBps": mid["raw_aggregate_GBps"],
            "ewtt_s": mid["ewtt_s"], "first_ewtt_s": mid["first_ewtt_s"], "warmup": warmup,
            "quantize_s": mid["quantize_s"], "quantize_in_ewtt": mid["quantize_in_ewtt"],
            "fp8": fp8.to_json() if fp8 is not None else None,
            "ideal_link_s": mid["ideal_link_s"],
            "ideal_host_s": mid["ideal_host_s"], "ideal_s": mid["ideal_s"],
            "ewtt_over_ideal": mid["ratio"], "runs": rows,
            "shape": shape, "chunk_bytes": chunk, "dtypes": list(dtypes) if dtypes else None, "messages": int(between.sum()),
            "tls": tls or "default", "polling": polling, "bit_identical": True, "time": time.strftime("%Y-%m-%d %H:%M")}


def _versions_report(res: dict, ranks: list, n_trainers: int, versions: dict,
                     total: float) -> dict:
    """Per version of a ``versions`` run: its EWTT (first start to last end over the ranks), the
    bytes the rollouts received, and the fraction of the trainers' elements it changed."""
    bad = [x for x in ranks if not (res[x] and res[x]["ok"])]
    if bad:
        raise RuntimeError(f"ranks {bad} failed: {[res[x] for x in bad][:2]}")
    if not all(res[x]["bit_identical"] for x in ranks[n_trainers:]):
        raise RuntimeError("a rollout buffer is not bit-identical at some version")
    trainers, rollouts = ranks[:n_trainers], ranks[n_trainers:]
    elements = sum(res[x]["elements"] for x in trainers)
    out = []
    for v in range(versions["count"]):
        rows = [res[x]["versions"][v] for x in ranks]
        out.append({"version": v,
                    "ewtt_s": max(r["end_s"] for r in rows) - min(r["start_s"] for r in rows),
                    "received": sum(res[x]["versions"][v]["received"] for x in rollouts),
                    "changed": sum(res[x]["versions"][v]["changed"] for x in trainers)
                    / max(elements, 1)})
    return {"versions": out, "delta": bool(versions["delta"]),
            "density": versions["density"], "bytes_between_processes": int(total),
            "bit_identical": True, "processes": len(ranks)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller model, one run")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--chunk-mb", type=float, default=8.0, help="plan piece size (MiB)")
    ap.add_argument("--tls", default=None)
    ap.add_argument("--cuda", type=int, default=None, metavar="DEVICE",
                    help="buffers on this CUDA device (all processes share it: CUDA IPC)")
    ap.add_argument("--cuda-split", action="store_true",
                    help="trainers on GPU 0, rollouts on GPU 1 (bytes cross NVLink)")
    ap.add_argument("--shape", choices=("tp2", "single"), default="tp2",
                    help="single: one trainer process -> one rollout process (one link)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.quick:
        a.hidden, a.layers, a.experts, a.repeat = 512, 2, 8, 1
    dev = {"trainer": 0, "rollout": 1} if a.cuda_split else a.cuda
    rep = run(hidden=a.hidden, layers=a.layers, experts=a.experts, replicas=a.replicas,
              repeat=a.repeat, tls=a.tls, cuda_device=dev, shape=a.shape,
              chunk=int(a.chunk_mb * 2**20))
    if a.out:
        Path(a.out).write_text(json.dumps(rep, indent=1))
    if a.json:
        print(json.dumps(rep))
        return
    for k, v in rep.items():
        print(f"{k:>26}: {v:.4g}" if isinstance(v, float) else f"{k:>26}: {v}")


if __name__ == "__main__":
    main()
