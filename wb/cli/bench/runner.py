"""``python -m wb bench``: wb against the broadcast and naive-P2P baselines, measured in one run.

A real model config (``qwen3-30b-a3b`` by default) is scaled to fit the machine (fewer layers,
experts and vocabulary; the other shapes are the model's). A Megatron trainer on one node (TP2, EP
over the node) feeds 1, 2 and 4 vLLM rollout replicas of one node each (TP and EP over the node).
Every worker is its own spawned process over UCX, and all three methods run the same executor and
transport, in one run, in a rotating order:

- **wb**: :func:`wb.plan`.
- **naive P2P**: :func:`wb.cli.bench.baselines.p2p_plan`.
- **broadcast**: :func:`wb.cli.bench.baselines.broadcast_plans` (gather at one trainer rank, then whole
  tensors to every rollout worker, which cuts its slices with its loader).

One machine has no per-GPU NICs: every process shares the same cores and loopback. So the links
of the cluster are emulated (:class:`wb.cli.bench.shaped.ShapedTransport`): each worker's NIC and
NVLink run at the given rates, chosen well below what the machine can carry in aggregate, and a
probe in the same run measures them as the executor sees them. The ideal is the plan's lower
bound over those measured rates. AGST is measured through :class:`wb.Sender` /
:class:`wb.Receiver` in each sync mode; the baselines are synchronous (trainers and rollouts wait
for the whole update), so their AGST is their EWTT.
"""

from __future__ import annotations

import glob
import json
import multiprocessing as mp
import secrets
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import wb
from wb.cli.bench.baselines import broadcast_plans, needed_tensors, p2p_plan
from wb.cli.bench.plot import plot
from wb.layouts import megatron_trainer, vllm_rollout
from wb.data.layout import Cluster
from wb.data.plan import parts
from wb.algorithms.planner import traffic_ratio
from wb.layouts.presets import TINY, load_config, spec_from_config
from wb.algorithms.simulate import ideal_s, simulate
from wb.runtime.endpoints.stats import UpdateStats

__all__ = ["run_bench", "PROFILES"]

#: Sizes of a run: ``quick`` for CI and smoke tests, ``cpu`` for the 2-core machine, ``gpu`` for an
#: H200 (CUDA buffers, every process sharing the GPU through CUDA IPC).
PROFILES: dict[str, dict] = {
    "quick": dict(preset="tiny", gpus_per_node=2, scale={}, nic_MBps=20.0, nvlink_MBps=200.0,
                  chunk_kib=16, repeats=1, steps=2, train_s=0.2, gen_s=0.01),
    "cpu": dict(preset="qwen3-30b-a3b", gpus_per_node=8,
                scale=dict(num_hidden_layers=1, num_experts=8, vocab_size=4096),
                nic_MBps=8.0, nvlink_MBps=80.0, chunk_kib=256, repeats=3, steps=3,
                train_s=6.0, gen_s=0.05),
    # the same with 4 GPUs per node (21 processes with 4 replicas instead of 41)
    "cpu4": dict(preset="qwen3-30b-a3b", gpus_per_node=4,
                 scale=dict(num_hidden_layers=1, num_experts=8, vocab_size=4096),
                 nic_MBps=12.0, nvlink_MBps=120.0, chunk_kib=512, repeats=3, steps=3,
                 train_s=6.0, gen_s=0.05),
    "gpu": dict(preset="qwen3-30b-a3b", gpus_per_node=8,
                scale=dict(num_hidden_layers=4, num_experts=32, vocab_size=32768),
                nic_MBps=2000.0, nvlink_MBps=18000.0, chunk_kib=4096, repeats=3, steps=3,
                train_s=2.0, gen_s=0.02, polling=False),
    # real links on a machine with two GPUs (--devices role --links real): bigger pieces, fewer
    # processes; the broadcast (a whole copy of the model per rollout GPU) does not fit there
    "gpu-nvlink": dict(preset="qwen3-30b-a3b", gpus_per_node=4,
                       scale=dict(num_hidden_layers=8, num_experts=32, vocab_size=32768),
                       nic_MBps=2000.0, nvlink_MBps=18000.0, chunk_kib=65536, repeats=4,
                       steps=2, train_s=1.0, gen_s=0.02, methods=("wb", "p2p")),
    # the same with 4x the layers (11.6 GB): per-message costs weigh less against the transfer
    "gpu-nvlink-large": dict(preset="qwen3-30b-a3b", gpus_per_node=4,
                             scale=dict(num_hidden_layers=32, num_experts=32, vocab_size=32768),
                             nic_MBps=2000.0, nvlink_MBps=18000.0, chunk_kib=65536, repeats=4,
                             steps=2, train_s=1.0, gen_s=0.02, methods=("wb", "p2p")),
}


def _config(preset: str, scale: dict) -> dict:
    cfg = dict(TINY) if preset == "tiny" else dict(load_config(preset))
    cfg.update(scale)
    if scale:
        cfg["name"] = f"{cfg['name']} (scaled: " + ", ".join(f"{k}={v}" for k, v in scale.items()) + ")"
    return cfg


def _deployment(cfg: dict, *, gpus: int, replicas: int):
    trainers = megatron_trainer(cfg, tp=2, pp=1, ep=gpus, nodes=["trainer0"], gpus_per_node=gpus)
    rollouts = vllm_rollout(cfg, tp=gpus, ep=gpus, replicas=replicas, gpus_per_node=gpus,
                            first_rank=gpus + 1)
    return trainers, rollouts


def run_bench(*, profile: str = "cpu", replicas=(1, 2, 4), cuda: int | None = None,
              devices: str = "one", links: str = "shaped", modes=None, quiet: bool = False,
              out_dir: str | None = None, timeout: float = 900.0, trace: bool = False,
              checksums: str = "on", delta_lr: float | None = None, delta_versions: int = 4,
              **overrides) -> dict:
    """Runs the benchmark; returns its report (what ``--json`` prints last).

    Args:
        profile: a key of :data:`PROFILES` (sizes, link rates, repeats).
        replicas: rollout replica counts to run (one node each).
        cuda: CUDA device for every process's buffers (``None``: host memory).
        devices: with ``cuda``, where processes go: ``"one"`` (all on device ``cuda``),
            ``"spread"`` (rank ``r`` on device ``r % n``: less contention, same emulated links)
            or ``"role"`` (trainers and the gather rank on device 0, rollouts on device 1: the
            trainer -> rollout bytes cross the real NVLink).
        links: ``"shaped"`` (emulated per-GPU links) or ``"real"`` (whatever the machine has;
            the ideal then comes from probes of the real links between and within devices).
        modes: sync modes for AGST (default all four).
        quiet: print nothing.
        out_dir: also write ``bench.json`` (and ``bench.png`` with matplotlib) there.
        timeout: seconds allowed per replica count.
        trace: with ``out_dir``, also write ``trace_r{R}.json``: every rank's per-message times in
            its last wb run (:func:`wb.runtime.engine.executor.execute`'s ``trace``), for finding where an
            update's time goes.
        checksums: ``"on"``: wb checks every message against its sender's CRC32C (its
            default); ``"compare"``: also runs the same plan without (``wb-unchecked``, in the
            rotation) and reports ``checksums_ratio``, wb's EWTT over that.
        delta_lr: also run ``delta_versions`` versions made by Adam at this learning rate, dense
            and as deltas (:mod:`wb.cli.bench.deltas`; host buffers); the report's ``delta``.
        overrides: any :data:`PROFILES` field.
    """
    if devices not in ("one", "spread", "role") or links not in ("shaped", "real"):
        raise wb.SpecError(f"devices must be one/spread/role and links shaped/real, got "
                           f"{devices!r}, {links!r}")
    if trace and not out_dir:
        raise wb.SpecError("trace needs out_dir (the traces are written there)")
    if profile not in PROFILES:
        raise wb.SpecError(f"profile must be one of {sorted(PROFILES)}, got {profile!r}")
    prof = dict(PROFILES[profile], **overrides)
    if checksums not in ("on", "compare"):
        raise wb.SpecError(f"checksums must be on or compare, got {checksums!r}")
    if delta_lr is not None and (not delta_lr > 0 or delta_versions < 2):
        raise wb.SpecError(f"delta: a positive learning rate and at least 2 versions; got lr "
                           f"{delta_lr}, {delta_versions} versions")
    prof["delta"] = (delta_lr, delta_versions) if delta_lr is not None else None
    if checksums == "compare":
        prof["methods"] = (*prof.get("methods", ("wb", "p2p", "broadcast")), "wb-unchecked")
    modes = list(wb.MODES) if modes is None else list(modes)
    # --json keeps stdout for the JSON line; the tables and progress then go to stderr
    # no source path beside every log line: an 80-column terminal has no room for it
    console = Console(stderr=True, log_path=False) if quiet else Console(log_path=False)
    cfg = _config(prof["preset"], prof["scale"])
    spec = spec_from_config(cfg)
    G = prof["gpus_per_node"]
    cluster = Cluster(nic_gbps=prof["nic_MBps"] * 8e6 / 1e9, nvlink_GBps=prof["nvlink_MBps"] / 1e3)
    report: dict = {"model": cfg["name"], "model_bytes": int(spec.nbytes), "profile": profile,
                    "gpus_per_node": G, "emulated_nic_MBps": prof["nic_MBps"],
                    "emulated_nvlink_MBps": prof["nvlink_MBps"], "links": links,
                    "device": "host" if cuda is None else f"cuda ({devices})",
                    "by_replicas": {}}
    console.print(f"[bold]{cfg['name']}[/bold]: {spec.nbytes / 1e6:,.1f} MB; trainer 1 node x {G} "
                  f"(Megatron TP2 EP{G}); rollout replicas of 1 node x {G} (vLLM TP{G} EP{G}); "
                  f"emulated links: NIC {prof['nic_MBps']:g} MB/s, NVLink "
                  f"{prof['nvlink_MBps']:g} MB/s per GPU")
    for R in replicas:
        console.log(f"{R} replica(s): planning")
        one = report["by_replicas"][str(R)] = _one(cfg, spec, G, R, prof, cluster, modes, cuda,
                                                   console, timeout, devices=devices, links=links,
                                                   trace=trace)
        traces = one.pop("traces", None)
        if traces:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            Path(out_dir, f"trace_r{R}.json").write_text(json.dumps(traces))
        if one.get("ewtt_s"):
            console.log(f"{R} replica(s): wb {one['ewtt_s']['wb']:.3f} s, ideal "
                        f"{one['ideal_s']:.3f} s ({one['ewtt_over_ideal']:.2f}x), bit-identical: "
                        f"{'yes' if one['verified'] else 'NO'}")
        if one.get("checksums_ratio"):
            console.log(f"{R} replica(s): wb without checksums "
                        f"{one['ewtt_s']['wb-unchecked']:.3f} s: checksums_ratio "
                        f"{one['checksums_ratio']:.3f}")
        if out_dir:  # what is measured so far survives a later replica count that times out
            _save(report, out_dir)
    last = report["by_replicas"][str(max(replicas))]
    report.update({k: last.get(k) for k in ("speedup_vs_broadcast", "speedup_vs_p2p",
                                            "ewtt_over_ideal", "checksums_ratio", "agst_s",
                                            "agst_broadcast_over_both", "verified", "delta")})
    report["verified"] = all(r["verified"] for r in report["by_replicas"].values())
    _print(report, console)
    if out_dir:
        _save(report, out_dir)
        plot(report, Path(out_dir, "bench.png"))
    return report


def _save(report: dict, out_dir: str) -> None:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    Path(out_dir, "bench.json").write_text(json.dumps(report, indent=1))


def _device_of(rank: int, role: str, cuda, devices: str):
    if cuda is None:
        return None
    if devices == "one":
        return cuda
    import cupy

    n = cupy.cuda.runtime.getDeviceCount()
    if devices == "spread":
        return rank % n
    if n < 2:
        raise wb.SpecError("devices='role' needs two CUDA devices")
    return 0 if role == "trainer" else 1


def _one(cfg, spec, G, R, prof, cluster, modes, cuda, console, timeout, *, devices="one",
         links="shaped", trace=False) -> dict:
    trainers, rollouts = _deployment(cfg, gpus=G, replicas=R)
    chunk = prof["chunk_kib"] << 10
    gather_rank = G
    plans = {"wb": wb.plan(trainers, rollouts, cluster, chunk_bytes=chunk),
             "p2p": p2p_plan(trainers, rollouts, cluster, chunk_bytes=chunk)}
    plans["gather"], plans["bcast"] = broadcast_plans(spec, trainers, rollouts, cluster,
                                                      gather_rank=gather_rank, chunk_bytes=chunk)
    if prof.get("delta"):  # as agree_parts(delta=True) plans: every range below a piece packed
        plans["wb-delta"] = wb.plan(trainers, rollouts, cluster, chunk_bytes=chunk,
                                    pack_below=chunk)
    plans["wb"].verify()
    console.log(f"plans ready: {plans['wb'].messages.nbytes.size:,} wb messages, "
                f"{plans['bcast'].messages.nbytes.size:,} broadcast messages")
    ranks = [lay.worker.rank for lay in trainers] + [gather_rank] + [
        lay.worker.rank for lay in rollouts]
    gpu_of = {lay.worker.rank: (lay.worker.node, lay.worker.local_rank)
              for lay in (*trainers, *rollouts)}
    gpu_of[gather_rank] = gpu_of[trainers[0].worker.rank]
    with tempfile.TemporaryDirectory(prefix="wb-bench-") as tmp:
        work = Path(tmp)
        (work / "results").mkdir()
        # every rank loads only its part of each plan, as after wb.agree_parts
        paths = {}
        for k, p in plans.items():
            paths[k] = str(work / f"{k}.{{rank}}.part")
            for part in parts(p):
                Path(paths[k].format(rank=part.rank)).write_bytes(part.to_bytes())
        common = dict(cfg=cfg, store_dir=str(work / "store"), result_dir=str(work / "results"),
                      plans=paths, all_ranks=ranks, gpu_of={str(r): g for r, g in gpu_of.items()},
                      gather_rank=gather_rank, bcast_names=needed_tensors(spec, rollouts),
                      nic_Bps=prof["nic_MBps"] * 1e6, nvlink_Bps=prof["nvlink_MBps"] * 1e6,
                      methods=list(prof.get("methods", ("wb", "p2p", "broadcast"))),
                      repeats=prof["repeats"], steps=prof["steps"], train_s=prof["train_s"],
                      gen_s=prof["gen_s"], modes=modes, staging_bytes=None,
                      timeout=max(60.0, timeout / 3), cuda=cuda, polling=prof.get("polling"),
                      probe_pairs=_probe_pairs(trainers, rollouts, links), links=links,
                      probe_bytes=chunk, probe_reps=_probe_reps(prof, chunk, links, cuda),
                      trace=trace, job_key=secrets.token_hex(16),
                      delta_lr=(prof.get("delta") or (None,))[0],
                      delta_versions=(prof.get("delta") or (0, 0))[1], delta_seed=R)
        from wb.cli.bench.workers import bench_main

        ctx = mp.get_context("spawn")
        role = {r: "trainer" for r in ranks[:G + 1]}
        procs = [ctx.Process(target=bench_main, daemon=True, args=(dict(
            common, rank=r, cuda=_device_of(r, role.get(r, "rollout"), cuda, devices)),))
            for r in ranks]
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        # the barriers each rank passes (bench_workers._run): the probe's set-up and phases, two
        # per run, one after the runs, two per sync mode
        phases = {k.split(":")[0] for k in common["probe_pairs"]}
        n_steps = (1 + len(phases) + 2 * len(common["methods"]) * prof["repeats"] + 1
                   + 2 * len(modes) + (4 * common["delta_versions"] + 1 if common["delta_lr"]
                                       else 0))
        failed = None
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task(f"{R} replica(s): {len(procs)} processes", total=n_steps)
            while any(p.is_alive() for p in procs) and time.perf_counter() - t0 < timeout:
                done = len(_barrier_files(work / "store", ranks[-1]))
                bar.update(task, completed=min(done, n_steps))
                # the others would wait for it in a barrier until their timeout
                if (failed := _failed(dict(zip(ranks, procs)), work / "results")) is not None:
                    break
                time.sleep(0.2)
        late = time.perf_counter() - t0 >= timeout
        console.log(f"rank {failed[0]} failed ({failed[1]}); the others stopped" if failed
                    else f"processes {'timed out' if late else 'done'}",
                    f"in {time.perf_counter() - t0:.1f} s")
        for p in procs:
            p.join(1)
            if p.is_alive():
                p.kill()
        res = {}
        for r in ranks:
            f = work / "results" / f"{r}.json"
            why = (f"stopped after rank {failed[0]} failed" if failed is not None
                   else "timed out" if late else "exited")
            res[r] = json.loads(f.read_text()) if f.exists() else {
                "ok": False, "error": f"no result ({why}; last barrier passed: "
                                      f"{_last_barrier(work / 'store', r)})"}
    out = _summarize(plans, res, ranks, R, modes, prof, links)
    if common["delta_lr"] and not out.get("errors"):
        from wb.cli.bench.deltas import summarize_deltas

        out["delta"] = dict(summarize_deltas(res), lr=common["delta_lr"])
        out["verified"] = out["verified"] and out["delta"]["verified"]
    if trace:
        out["traces"] = {str(r): x["msg_trace"] for r, x in res.items() if x.get("msg_trace")}
    return out


def _failed(procs: dict, results: Path) -> tuple[int, str] | None:
    """The first rank whose process ended in failure, and why: its result says so (its error's
    first line), or it left none (killed: by the kernel out of memory, say). A worker ends only
    after the last barrier, so the others would wait for a failed one until their timeout."""
    for r, p in procs.items():
        if p.is_alive() or p.exitcode is None:
            continue
        f = results / f"{r}.json"  # written whole (a rename)
        if not f.exists():
            return r, f"exit code {p.exitcode}, no result"
        if not (res := json.loads(f.read_text())).get("ok"):
            return r, (str(res.get("error")) or "?").splitlines()[0][:200]
    return None


def _barrier_files(store_dir: Path, rank: int) -> list[str]:
    """The files of the barriers (``bench_workers._Ctx.barrier``) that ``rank`` reached."""
    return glob.glob(str(store_dir / f"b%*%{rank}"))  # DirectoryStore: "/" in a key is "%"


def _last_barrier(store_dir: Path, rank: int) -> str:
    """The newest barrier key that ``rank`` reached (where a run that timed out got stuck)."""
    files = _barrier_files(store_dir, rank)
    if not files:
        return "none"
    key = Path(max(files, key=lambda f: Path(f).stat().st_mtime)).name
    return key[len("b%"):-len(f"%{rank}")].replace("%", "/")


def _probe_reps(prof: dict, chunk: int, links: str, cuda) -> int:
    """Messages per probe pair: half a second at the emulated NIC rate (shaped links); on real
    links 16 GB per pair between GPUs (~0.25 s per pair when 4 pairs share the ~270 GB/s that wb
    reached over NVLink) or 0.5 GB between host processes, so that the barrier's skew between
    pairs (a few ms) and the first message's set-up weigh little against the probe."""
    if links == "shaped":
        want = prof["nic_MBps"] * 1e6 * 0.5
    else:
        want = 16e9 if cuda is not None else 0.5e9
    return max(8, -(-int(want) // chunk))


def _probe_pairs(trainers, rollouts, links):
    """Which pairs measure which link. Shaped: one pair per emulated link kind. Real (trainers
    and rollouts on different devices): every trainer to a distinct rollout at once ("nic": the
    bytes that cross devices) and rollout pairs of a node at once ("nvlink": within the
    rollouts' device)."""
    t = [lay.worker.rank for lay in trainers]
    r = [lay.worker.rank for lay in rollouts]
    if links == "shaped":
        return {"nic": [(t[0], r[0])], "nvlink": [(r[0], r[1])]}
    k = min(len(t), len(r))
    half = len(r) // 2
    pairs = {"nic": list(zip(t[:k], r[:k])), "nvlink": list(zip(r[:half], r[half:2 * half]))}
    # both at once (kinds "together:..." share one start): the trainer pairs again, with the
    # rollouts they leave free copying among themselves, to see whether the two kinds of traffic
    # slow each other (on two GPUs, several replicas' forwards and NVLink land on one GPU)
    rest = r[k:]
    if len(rest) >= 2:
        pairs["together:nic"] = pairs["nic"]
        pairs["together:nvlink"] = list(zip(rest[:len(rest) // 2], rest[len(rest) // 2:]))
    return pairs


def _aggregate(res, kind) -> float:
    """Bytes/s of all pairs of one probe kind together (senders' bytes over the common span)."""
    recs = [x["probe"][kind] for x in res.values() if kind in x["probe"]]
    sent = [p for p in recs if p["sender"]]
    return sum(p["bytes"] for p in sent) / (max(p["t1"] for p in recs) - min(p["t0"] for p in recs))


def _summarize(plans, res, ranks, R, modes, prof, links="shaped") -> dict:
    errors = {r: x["error"] for r, x in res.items() if not x.get("ok")}
    out: dict = {"replicas": R, "processes": len(ranks), "errors": errors}
    if errors:
        out["verified"] = False
        return out
    runs: dict[tuple[str, int], list] = {}
    for x in res.values():
        for run in x["runs"]:
            runs.setdefault((run["method"], run["rep"]), []).append(run)
    ewtt: dict[str, list[float]] = {}
    verified = True
    failed = []
    for (method, rep), rs in sorted(runs.items()):
        # every rank starts at one instant (bench_workers.barrier), t0; min() in any case
        ewtt.setdefault(method, []).append(max(r["end"] for r in rs) - min(r["t0"] for r in rs))
        verified &= all(r["ok"] is not False for r in rs)
        failed += [f"{method} run {rep}" for r in rs if r["ok"] is False][:1]
    # the busiest worker's emulated link of each kind in each method's last run (shaped links):
    # busy for the ideal's time but spanning longer means it sat idle in between
    usage: dict[str, dict] = {}
    last_rep = {m: max(rep for mm, rep in runs if mm == m) for m, _ in runs}
    for (method, rep), rs in runs.items():
        if rep != last_rep[method]:
            continue
        for k in sorted({k for r in rs for k in r.get("links", {})}):
            top = max((r["links"][k] for r in rs if k in r.get("links", {})),
                      key=lambda v: v["busy_s"])
            usage.setdefault(method, {})[k] = {"busiest_busy_s": top["busy_s"],
                                               "busiest_span_s": top["span_s"]}
    nic, nvl = _aggregate(res, "nic"), _aggregate(res, "nvlink")
    measured = Cluster(nic_gbps=nic * 8 / 1e9, nvlink_GBps=nvl / 1e9)
    if links == "shaped":
        ideal = ideal_s(plans["wb"], measured)
    else:
        # real links: every trainer byte crosses from the trainers' device to the rollouts'
        # (measured all pairs at once), and forwards stay within the rollouts' device
        M = plans["wb"].messages
        cross = int(M.nbytes[M.stage == 1].sum())
        inside = int(M.nbytes[M.stage != 1].sum())
        ideal = max(cross / nic, inside / nvl)
    # a method's first run also sets up its transports' first use (CUDA IPC mappings, ...);
    # the later ones are the steady state of a Sender/Receiver, whose median is the EWTT
    med = {m: float(np.median(v[1:] if len(v) > 1 else v)) for m, v in ewtt.items()}
    together = {k.split(":")[1]: _aggregate(res, k) / 1e6
                for k in ("together:nic", "together:nvlink")
                if any(k in x["probe"] for x in res.values())}
    out.update(ewtt_s=med, ewtt_runs_s=ewtt, ewtt_first_s={m: v[0] for m, v in ewtt.items()},
               ideal_s=ideal, measured_nic_MBps=nic / 1e6,
               measured_nvlink_MBps=nvl / 1e6, measured_together_MBps=together or None,
               speedup_vs_broadcast=med["broadcast"] / med["wb"] if "broadcast" in med else None,
               speedup_vs_p2p=med["p2p"] / med["wb"] if "p2p" in med else None,
               ewtt_over_ideal=med["wb"] / ideal,
               # wb with its checks over the same plan without (--checksums compare)
               checksums_ratio=(med["wb"] / med["wb-unchecked"] if "wb-unchecked" in med
                                else None),
               traffic_ratio=traffic_ratio(plans["wb"]), link_usage=usage,
               # the bandwidth model at the measured link rates (the messages' cost is measured)
               simulated={"wb": simulate(plans["wb"], measured, message_s=0).ewtt_s,
                          "p2p": simulate(plans["p2p"], measured, message_s=0).ewtt_s})
    agst, stalls = {}, {}
    for mode in modes:
        stats = [UpdateStats.from_json(s) for x in res.values()
                 for s in x["modes"].get(mode, {}).get("stats", [])]
        bad = [r for r, x in res.items() if mode in x["modes"] and not x["modes"][mode]["ok"]]
        verified &= not bad
        failed += [f"mode {mode} on ranks {bad}"] if bad else []
        sm = wb.summarize(stats)
        agst[mode] = sm.agst_s
        stalls[mode] = {"trainer_s": sm.trainer_stall_s, "rollout_s": sm.rollout_stall_s,
                        "ewtt_s": sm.ewtt_s}
    # the baselines block every worker for the whole update: their AGST is their EWTT
    if "broadcast" in med:
        agst["broadcast (synchronous)"] = med["broadcast"]
    if "p2p" in med:
        agst["p2p (synchronous)"] = med["p2p"]
    out.update(agst_s=agst, stalls=stalls, verified=bool(verified), failed_checks=failed)
    if "both" in agst and agst["both"] > 0 and "broadcast" in med:
        out["agst_broadcast_over_both"] = med["broadcast"] / agst["both"]
    return out


def _print(report: dict, console: Console) -> None:
    # seconds in the title and two-line headers keep the table within 80 columns
    t = Table(title=f"EWTT in seconds, measured in one run: {report['model']} "
                    f"({report['model_bytes'] / 1e6:,.1f} MB), {report['device']} buffers; "
                    f"wb's speed-up vs broadcast and naive P2P")
    for col in ("replicas", "wb", "naive\nP2P", "broad-\ncast", "ideal", "wb /\nideal",
                "vs\nbcast", "vs\nP2P", "bit-\nexact"):
        t.add_column(col, justify="right")
    for R, r in report["by_replicas"].items():
        if r.get("errors"):
            t.add_row(R, *[""] * 7, "[red]FAILED[/red]")
            continue
        e = r["ewtt_s"]
        bc, pp = "broadcast" in e, "p2p" in e
        t.add_row(R, f"{e['wb']:.3f}", f"{e['p2p']:.3f}" if pp else "-",
                  f"{e['broadcast']:.3f}" if bc else "-",
                  f"{r['ideal_s']:.3f}", f"{r['ewtt_over_ideal']:.2f}x",
                  f"{r['speedup_vs_broadcast']:.1f}x" if bc else "",
                  f"{r['speedup_vs_p2p']:.1f}x" if pp else "",
                  "[green]yes[/green]" if r["verified"] else "[red]NO[/red]")
    console.print(t)
    last = report["by_replicas"][max(report["by_replicas"], key=int)]
    if last.get("agst_s"):
        a = Table(title=f"AGST with {last['replicas']} replicas (mean stall per worker per update)")
        a.add_column("mode")
        a.add_column("AGST", justify="right")
        a.add_column("trainer / rollout stall", justify="right")
        for mode, v in last["agst_s"].items():
            st = last["stalls"].get(mode)
            a.add_row(mode, f"{v * 1e3:.1f} ms", f"{st['trainer_s'] * 1e3:.1f} / "
                      f"{st['rollout_s'] * 1e3:.1f} ms" if st else "whole update")
        console.print(a)
    if last.get("delta"):
        from wb.cli.bench.deltas import print_deltas

        print_deltas(last["delta"], last["replicas"], console)
    for R, r in report["by_replicas"].items():
        for rank, err in r.get("errors", {}).items():
            console.print(f"[red]{R} replicas, rank {rank}:[/red] {err}")
