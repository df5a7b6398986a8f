"""The demo behind ``python -m wb demo``: probe two real load paths, find their correspondence.

A JAX trainer (a dp x tp mesh of emulated CPU devices, JAX kernel conventions) and vLLM-style
PyTorch rollouts (TP ranks x replicas, fused qkv/gate_up, stacked experts, padded vocabulary) are
probed through their own load functions; the correspondence between every trainer shard and every
rollout parameter is computed on blocks and checked element by element against a brute-force
oracle. A plan then moves the trainer's real weights in this process (``wb.run_local``) into the
rollouts' own parameters, which must come out bit-identical to what the rollouts' own loader makes
of the same checkpoint. ``--trainer torch --rollout jax`` swaps the sides. Transfers between
processes then do it for real: spawned trainer and rollout processes probe their own load
paths, agree on a plan, and run a few training steps in each of the four sync modes over UCX,
checking every rollout buffer after every update (see :mod:`wb.cli.demo.workers`).

The frameworks are imported only when the demo runs: ``import wb`` never imports torch or jax.
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Sequence

import numpy as np
from rich.console import Console
from rich.table import Table

import wb
from wb.cli.demo.checkpoint import random_checkpoint
from wb.data.layout import BufferSpec, Layout, Worker
from wb.layouts.presets import TINY, spec_from_config
from wb.algorithms.fp8.tasks import quantize_layouts
from wb.data.correspondence import correspond
from wb.runtime.endpoints.stats import UpdateStats

__all__ = ["run_demo", "run_processes", "jax_layouts", "torch_layouts"]


def jax_layouts(cfg: dict, *, role: str, dp: int, tp: int, copies: int, first_rank: int,
                node_prefix: str, ckpt: dict, fp8=None) -> tuple[list[Layout], dict, dict]:
    """Layouts of ``copies`` JAX programs on a dp x tp mesh each (one worker per device), their
    buffers after loading ``ckpt`` with the program's own load function, and zeroed buffers.
    ``fp8``: a :class:`wb.FP8Blocks`: the programs load that FP8 checkpoint (of ``ckpt``,
    quantised by the reference quantiser).

    Returns ``(layouts, {rank: {key: loaded shard}}, {rank: {key: zeros}})``.
    """
    # the demo's JAX side runs on emulated CPU devices, GPUs or not (as its worker processes do)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import wb_jax

    wb_jax.use_cpu_devices(dp * tp)
    from wb_jax.testing import make_load_fn, make_mesh

    spec = spec_from_config(cfg)
    if fp8 is not None:
        from wb.cli.demo.checkpoint import fp8_checkpoint

        spec, ckpt = fp8.bind(spec).spec, fp8_checkpoint(ckpt, fp8)
    load = make_load_fn(cfg, make_mesh(dp, tp), fp8=fp8)
    maps = wb_jax.probe(load, spec)
    params = load(ckpt)
    per_device = wb_jax.device_maps(params, maps)
    arrays = wb_jax.device_arrays(params)
    out, loaded, empty = [], {}, {}
    for c in range(copies):
        for local, (dev, bufs) in enumerate(per_device.items()):
            worker = Worker(rank=first_rank + len(out), node=f"{node_prefix}{c}", role=role,
                            local_rank=local)
            keep = {k: BufferSpec(sm, dt) for k, (sm, dt) in bufs.items() if sm.n_ids}
            out.append(Layout(worker, keep))
            loaded[worker.rank] = {k: arrays[dev][k] for k in keep}
            empty[worker.rank] = {k: np.zeros_like(arrays[dev][k]) for k in keep}
    return out, loaded, empty


def torch_layouts(cfg: dict, *, role: str, tp: int, copies: int, first_rank: int,
                  node_prefix: str, ckpt: dict, dtype: str | None = None, fp8=None
                  ) -> tuple[list[Layout], dict, dict]:
    """Layouts of ``copies`` vLLM-style TP groups (one node each; one worker per TP rank), the
    parameters after ``load_weights(ckpt)``, and the parameters of fresh models (numpy views:
    writing them writes the torch parameters). ``dtype``: the models' parameter dtype (default
    the reference rollout's, bfloat16). ``fp8``: a :class:`wb.FP8Blocks`: the models serve
    that FP8 checkpoint (probed against it; ``loaded`` is their load of ``ckpt`` quantised by
    the reference quantiser).

    Returns ``(layouts, {rank: {name: loaded}}, {rank: {name: fresh model's parameter view}})``.
    """
    import torch
    import wb_torch
    from wb_torch.testing import TinyRollout

    kw = {"dtype": getattr(torch, dtype)} if dtype else {}
    if fp8 is not None:
        from wb.cli.demo.checkpoint import fp8_checkpoint

        kw["fp8"], ckpt = fp8, fp8_checkpoint(ckpt, fp8)
    per_rank = []
    for r in range(tp):
        model = TinyRollout(cfg, tp_rank=r, tp_size=tp, **kw)
        dtypes = {n: wb.data.dtypes.canonical_dtype(p.dtype) for n, p in model.named_parameters()}
        per_rank.append({n: BufferSpec(sm, dtypes[n])
                         for n, sm in wb_torch.probe(model, model.spec).items() if sm.n_ids})
    out, loaded, fresh = [], {}, {}
    for c in range(copies):
        for r in range(tp):
            worker = Worker(rank=first_rank + len(out), node=f"{node_prefix}{c}", role=role,
                            local_rank=r)
            out.append(Layout(worker, per_rank[r]))
            ref = TinyRollout(cfg, tp_rank=r, tp_size=tp, **kw)
            ref.load_weights((n, wb_torch.from_numpy(a)) for n, a in ckpt.items())
            model = TinyRollout(cfg, tp_rank=r, tp_size=tp, **kw)
            params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
            loaded[worker.rank] = {n: wb_torch.to_numpy(ref_params[n]) for n in per_rank[r]}
            fresh[worker.rank] = {n: wb_torch.to_numpy(params[n]) for n in per_rank[r]}
    return out, loaded, fresh


def _side(kind: str, role: str, *, replicas: int, tp: int, first_rank: int, ckpt: dict,
          dtype: str | None = None, fp8=None):
    prefix = "trainer" if role == "trainer" else "rollout"
    copies = 1 if role == "trainer" else replicas
    if kind == "jax":
        return jax_layouts(TINY, role=role, dp=2, tp=2, copies=copies, first_rank=first_rank,
                           node_prefix=prefix, ckpt=ckpt, fp8=fp8)
    # A PyTorch trainer: 2 data-parallel replicas of a TP group (the reference sharding).
    return torch_layouts(TINY, role=role, tp=tp, copies=2 if role == "trainer" else copies,
                         first_rank=first_rank, node_prefix=prefix, ckpt=ckpt, dtype=dtype,
                         fp8=fp8)


def _worker_table(title: str, layouts: Sequence[Layout]) -> tuple[Table, dict]:
    t = Table(title=title)
    for col in ("rank", "node", "buffers", "elements", "bytes", "blocks", "map entries"):
        t.add_column(col, justify="right" if col not in ("node",) else "left")
    tot = dict(elements=0, nbytes=0, blocks=0, nnz=0, buffers=0)
    for lay in layouts:
        el = sum(b.sourcemap.numel for b in lay.buffers.values())
        nb = sum(b.sourcemap.numel * b.itemsize for b in lay.buffers.values())
        bl = sum(b.sourcemap.blocks.count for b in lay.buffers.values())
        nz = sum(b.sourcemap.nnz for b in lay.buffers.values())
        t.add_row(str(lay.worker.rank), lay.worker.node, str(len(lay.buffers)), f"{el:,}",
                  f"{nb:,}", f"{bl:,}", f"{nz:,}")
        for k, v in zip(("elements", "nbytes", "blocks", "nnz", "buffers"),
                        (el, nb, bl, nz, len(lay.buffers))):
            tot[k] += v
    return t, tot


def run_demo(*, trainer: str = "jax", rollout: str = "torch", replicas: int = 2, tp: int = 2,
             quiet: bool = False, modes: Sequence[str] | None = None, steps: int = 3,
             train_s: float = 0.3, gen_s: float = 0.02, processes: bool = True,
             cuda: bool = False, rollout_dtype: str | None = None,
             check: bool = False, delta: bool = False) -> dict:
    """Runs the demo and returns its report (what ``--json`` prints).

    Args:
        trainer: ``"jax"`` or ``"torch"``: the framework of the holders.
        rollout: ``"torch"`` or ``"jax"``: the framework of the needs.
        replicas: rollout replicas, one node each.
        tp: TP degree of a PyTorch side.
        quiet: print nothing (the report is still returned).
        modes: sync modes to run between processes (default all four, :data:`wb.MODES`).
        steps: training steps (updates) per mode.
        train_s: emulated compute of a training step, seconds.
        gen_s: emulated compute of a rollout decode step, seconds.
        processes: run the multi-process part (UCX); ``False`` runs only the in-process checks.
        cuda: in the processes, PyTorch models live on CUDA devices (local rank ``r`` on device
            ``r`` mod the device count: a node's workers spread over the GPUs, so stage 3 crosses
            NVLink) and the JAX side on the GPUs too (a JAX trainer on a 1 x min(2, GPUs) mesh, a
            JAX rollout on ``tp`` of them), every process sharing them; both ends are checked
            to move the frameworks' own memory (addresses). In-process checks stay on the CPU.
        rollout_dtype: the PyTorch rollouts' parameter dtype (``"float32"``, ``"float16"``,
            ...; default bfloat16, the checkpoint's): wb converts in flight, and every rollout
            buffer is still checked against the rollout's own load of the checkpoint.
        check: after every update the trainers claim it and every rollout checks its live
            buffers against the claim through its source maps (:meth:`wb.Receiver.check`,
            every element): ``weight_checks`` in the report.
        delta: the trainers' step changes about one element in 32
            (:func:`wb.testing.versions.sparse_step`) and they send deltas
            (``wb.Sender(delta=True)``): each mode's ``received_per_version`` (bytes that reached
            the rollouts) falls after its first version. JAX rollouts land every version in new
            memory and so get dense bytes.
    """
    if replicas < 1 or tp < 1:
        raise wb.SpecError(f"--replicas and --tp must be >= 1, got {replicas} and {tp}")
    modes = list(wb.MODES) if modes is None else list(modes)
    bad = [m for m in modes if m not in wb.MODES]
    if bad or steps < 1:
        raise wb.SpecError(f"modes must be among {list(wb.MODES)} and steps >= 1; got {modes}, "
                           f"{steps}")
    fp8 = None
    if rollout_dtype is not None:
        from wb.data.dtypes import FLOATS, canonical_dtype

        rollout_dtype = canonical_dtype(rollout_dtype)
        if rollout_dtype == "float8_e4m3fn":  # block-scaled, as FP8 checkpoints are
            from wb.cli.demo.checkpoint import DEMO_FP8

            fp8 = wb.FP8Blocks.from_json(DEMO_FP8)
            dtype_ok = True
        else:
            dtype_ok = rollout_dtype in FLOATS - {"float8_e5m2"}
        if not dtype_ok or (rollout != "torch" and fp8 is None):
            raise wb.SpecError(
                f"--rollout-dtype {rollout_dtype}: a dtype of float64, float32, float16 or "
                f"bfloat16 needs PyTorch rollouts (the JAX reference load function never casts); "
                f"float8_e4m3fn (block-scaled) works with both")
    gpus = _gpus()
    if cuda and not gpus:
        raise wb.SpecError("--cuda needs a machine with CUDA devices (none found)")
    if cuda and rollout == "jax" and tp > gpus:
        raise wb.SpecError(f"--cuda puts each JAX rollout on {tp} GPUs (--tp) but this machine "
                           f"has {gpus}; give --tp {gpus} or less")
    console = Console(quiet=quiet)
    ckpt = random_checkpoint()
    t0 = time.perf_counter()
    with console.status(f"probing the {trainer} trainer's load function..."):
        trainers, weights, _ = _side(trainer, "trainer", replicas=replicas, tp=tp, first_rank=0,
                                     ckpt=ckpt)
    with console.status(f"probing the {rollout} rollouts' load_weights..."):
        rollouts, expected, targets = _side(rollout, "rollout", replicas=replicas, tp=tp,
                                            first_rank=len(trainers), ckpt=ckpt,
                                            dtype=None if fp8 else rollout_dtype, fp8=fp8)
    probe_s = time.perf_counter() - t0
    holders = trainers
    if fp8 is not None:  # the trainers quantise: they hold the FP8 checkpoint's ids
        quantized = quantize_layouts(trainers, fp8.bind(spec_from_config(TINY)))
        holders = list(quantized.trainers)
        from wb.algorithms.fp8.tasks import quantize_buffers

        weights = {r: {**w, **quantize_buffers(quantized, r, w)} for r, w in weights.items()}
    t1 = time.perf_counter()
    corr = correspond(holders, rollouts)
    correspond_s = time.perf_counter() - t1
    with console.status("checking the correspondence element by element..."):
        from wb.testing.oracle import correspondence_pairs, overlap_pairs

        exact = overlap_pairs(corr) == correspondence_pairs(holders, rollouts)
    with console.status("planning and running the transfer in this process..."):
        t2 = time.perf_counter()
        p = wb.plan(holders, rollouts)
        p.verify()
        plan_s = time.perf_counter() - t2
        from wb.algorithms.planner import traffic_ratio

        ratio = traffic_ratio(p)
        wb.run_local(p, weights, targets)
        identical = all(_same_bits(targets[r][k], expected[r][k])
                        for r in targets for k in targets[r])
    verified = exact and identical

    tt, ttot = _worker_table(f"{trainer} trainer: buffers held (per worker)", trainers)
    rt, rtot = _worker_table(f"{rollout} rollouts: buffers needed (per worker)", rollouts)
    console.print(tt)
    console.print(rt)
    from wb.algorithms.planner import bound_parts

    bound = bound_parts(p.corr, *p.table)  # M and each node's M_v, from the plan's cells
    needed = {"M": int((bound["sends"] * bound["cell_bytes"]).sum()), "nodes": bound["node_in"]}
    ov = corr.overlaps()
    elements = ttot["elements"] + rtot["elements"]
    entries = ttot["nnz"] + rtot["nnz"]
    summary = Table(title="correspondence", show_header=False)
    summary.add_column("what")
    summary.add_column("value", justify="right")
    summary.add_row("source-map entries stored / elements mapped",
                    f"{entries:,} / {elements:,} ({elements / max(entries, 1):,.0f}x smaller)")
    summary.add_row("affine blocks (trainer + rollout)", f"{ttot['blocks'] + rtot['blocks']:,}")
    summary.add_row("cells of ids / holder->need overlaps", f"{corr.cell_id0.size:,} / "
                    f"{ov.src_slot.size:,}")
    summary.add_row("bytes rollouts need, with repeats", f"{rtot['nbytes']:,}")
    summary.add_row("distinct bytes needed (M, the lower bound)", f"{needed['M']:,}")
    for node, b in needed["nodes"].items():
        summary.add_row(f"distinct bytes node {node} needs (M_v)", f"{b:,}")
    summary.add_row("checked against the per-element oracle",
                    "[green]exact[/green]" if exact else "[red]MISMATCH[/red]")
    summary.add_row("plan: transfers / traffic vs lower bound",
                    f"{p.transfers.piece.size:,} / {ratio:.4f}")
    summary.add_row(f"in-process copy vs {rollout}'s own load",
                    "[green]bit-identical[/green]" if identical else "[red]DIFFERENT[/red]")
    summary.add_row("probe / correspondence / plan time",
                    f"{probe_s:.2f} s / {correspond_s * 1e3:.1f} ms / {plan_s * 1e3:.1f} ms")
    console.print(summary)
    report = {
        "verified": bool(verified), "trainer": trainer, "rollout": rollout,
        "trainer_workers": len(trainers), "rollout_workers": len(rollouts),
        "elements": int(elements), "map_entries": int(entries),
        "blocks": int(ttot["blocks"] + rtot["blocks"]), "cells": int(corr.cell_id0.size),
        "overlaps": int(ov.src_slot.size), "needed_bytes": int(needed["M"]),
        "node_needed_bytes": needed["nodes"], "probe_s": round(probe_s, 3),
        "correspond_s": round(correspond_s, 4), "correspondence_exact": bool(exact),
        "weights_bit_identical": bool(identical), "traffic_ratio": ratio,
        "plan_s": round(plan_s, 4), "transfer": "in-process (wb.run_local)",
        "rollout_dtype": rollout_dtype or "bfloat16",
        "bytes_on_wire": p.traffic().trainer_total,
    }
    if fp8 is not None:  # the same deployment without conversion, for comparison
        plain, _, _ = _side(rollout, "rollout", replicas=replicas, tp=tp,
                            first_rank=len(trainers), ckpt=ckpt)
        report["bytes_on_wire_bf16"] = wb.plan(trainers, plain).traffic().trainer_total
        report["fp8"] = fp8.to_json()
    if processes:
        report.update(run_processes(trainer, rollout, replicas=replicas, tp=tp, modes=modes,
                                     steps=steps, train_s=train_s, gen_s=gen_s, console=console,
                                     cuda=cuda, rollout_dtype=rollout_dtype, check=check,
                                     delta=delta))
        report["verified"] = bool(verified and report["transfers_verified"])
    return report


def _gpus() -> int:
    """How many CUDA devices this machine has (without importing a framework)."""
    return len(glob.glob("/dev/nvidia[0-9]*"))


def _jobs(trainer, rollout, *, replicas, tp, common) -> list[dict]:
    jobs = []
    if trainer == "jax":  # a 2 x 2 mesh of CPU devices, or 1 x (up to 2) GPUs
        dp, jtp = (1, min(2, _gpus())) if common["cuda"] else (2, 2)
        jobs.append(dict(common, name="trainer", role="trainer", kind="jax", dp=dp, tp=jtp))
    else:
        jobs += [dict(common, name=f"trainer-tp{r}", role="trainer", kind="torch", tp=tp,
                      local_rank=r) for r in range(tp)]
    for c in range(replicas):
        if rollout == "torch":
            jobs += [dict(common, name=f"rollout{c}-tp{r}", role="rollout", kind="torch", tp=tp,
                          local_rank=r, first_rank=c * tp + r, node=f"rollout{c}")
                     for r in range(tp)]
        else:
            jobs.append(dict(common, name=f"rollout{c}", role="rollout", kind="jax", tp=tp,
                             first_rank=c * tp, node=f"rollout{c}"))
    return jobs


def run_processes(trainer: str, rollout: str, *, replicas: int, tp: int, modes: Sequence[str],
                  steps: int, train_s: float, gen_s: float, console: Console | None = None,
                  timeout: float = 900.0, expect_offset: int = 0, cuda: bool = False,
                  rollout_dtype: str | None = None, cfg: dict = TINY,
                  check: bool = False, delta: bool = False) -> dict:
    """Spawns the trainer and rollout processes and runs ``steps`` updates in each sync mode over
    UCX; returns what they measured and checked (the demo's second half; benches call it with a
    larger ``cfg``, a model config of :mod:`wb.layouts.presets`). Other arguments as
    :func:`run_demo`; ``expect_offset`` makes the rollouts expect the weights of another step
    (tests use it to see the check fail)."""
    console = console or Console(quiet=True)
    try:
        import ucxx  # noqa: F401 - only to fail here, clearly, rather than in every child
    except ImportError as e:
        raise wb.TransferError("the demo's processes talk over UCX: pip install "
                               "'weightbridge[ucx]' (or run with processes=False)") from e
    import json
    import multiprocessing as mp
    import secrets
    import tempfile
    from pathlib import Path

    from rich.progress import Progress

    from wb.cli.demo.workers import worker_main
    from wb.algorithms.planner import traffic_ratio

    with tempfile.TemporaryDirectory(prefix="wb-demo-") as tmp:
        work = Path(tmp)
        (work / "results").mkdir()
        common = dict(cfg=cfg, store_dir=str(work / "store"), result_dir=str(work / "results"),
                      modes=list(modes), steps=steps, train_s=train_s, gen_s=gen_s,
                      rollout_workers=replicas * tp, plan_path=str(work / "plan.npz"),
                      expect_offset=expect_offset, cuda=bool(cuda), rollout_dtype=rollout_dtype,
                      check=bool(check), job_key=secrets.token_hex(16), delta=bool(delta))
        jobs = _jobs(trainer, rollout, replicas=replicas, tp=tp, common=common)
        n_roll = sum(j["role"] == "rollout" for j in jobs)
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=worker_main, args=(j,), name=j["name"]) for j in jobs]
        t0 = time.perf_counter()
        for pr in procs:
            pr.start()
        total = len(modes) * steps * n_roll
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task(f"{len(procs)} processes over UCX: {trainer} trainer -> "
                                f"{rollout} rollouts, {len(modes)} sync modes", total=total)
            while any(pr.is_alive() for pr in procs) and time.perf_counter() - t0 < timeout:
                bar.update(task, completed=len(glob.glob(str(work / "store" /
                                                             "demo%progress%*"))))
                time.sleep(0.1)
        for pr in procs:
            pr.join(1)
            if pr.is_alive():
                pr.kill()
        wall = time.perf_counter() - t0
        results = []
        for j in jobs:
            f = work / "results" / f"{j['name']}.json"
            results.append(json.loads(f.read_text()) if f.exists()
                           else {"name": j["name"], "ok": False, "error": "no result (killed "
                                 "or timed out)", "modes": {}})
        p = wb.Plan.load(common["plan_path"]) if Path(common["plan_path"]).exists() else None
    errors = {r["name"]: r["error"] for r in results if not r["ok"]}
    per_mode, all_ok = {}, not errors
    workers = replicas * tp
    for mode in modes:
        stats = [UpdateStats.from_json(x) for r in results
                 for x in r["modes"].get(mode, {}).get("stats", [])]
        checks = sum(r["modes"].get(mode, {}).get("checks", 0) for r in results)
        bad = sum(r["modes"].get(mode, {}).get("bad", 0) for r in results)
        updates = {s.version for s in stats if s.role == "rollout"}
        rollout_records = sum(s.role == "rollout" for s in stats)
        ok = (not errors and bad == 0 and checks > 0 and updates == set(range(1, steps + 1))
              and rollout_records == steps * workers)
        all_ok &= ok
        if stats:
            sm = wb.summarize(stats)
            per_mode[mode] = {"sender_staging": wb.MODES[mode][0],
                              "receiver_staging": wb.MODES[mode][1],
                              "ewtt_s": round(sm.ewtt_s, 4), "agst_s": round(sm.agst_s, 4),
                              "ewtt_per_version_s": {v: round(e, 5) for v, e in
                                                     sm.ewtt_per_version.items()},
                              "trainer_stall_s": round(sm.trainer_stall_s, 4),
                              "rollout_stall_s": round(sm.rollout_stall_s, 4),
                              "updates": len(updates), "rollout_records": rollout_records,
                              "checks": checks, "mismatches": int(bad), "verified": ok,
                              "received_per_version": {
                                  v: sum(s.bytes_received for s in stats
                                         if s.role == "rollout" and s.version == v)
                                  for v in sorted(updates)}}
        else:
            per_mode[mode] = {"verified": False}
    # two-line headers and one staging column keep the table within 80 columns
    table = Table(title=f"{steps} updates per sync mode, {len(jobs)} processes over UCX "
                        f"(emulated step: train {train_s:g} s, decode {gen_s:g} s)")
    for col in ("mode", "staging\nsend/recv", "EWTT", "AGST", "trainer\nstall", "rollout\nstall",
                "identical\n(checks)"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    on = {True: "on", False: "off"}
    for mode, m in per_mode.items():
        if "ewtt_s" not in m:
            table.add_row(mode, *[""] * 5, "[red]FAILED[/red]")
            continue
        table.add_row(mode, f"{on[bool(m['sender_staging'])]}/{on[bool(m['receiver_staging'])]}",
                      f"{m['ewtt_s'] * 1e3:.1f} ms",
                      f"{m['agst_s'] * 1e3:.1f} ms", f"{m['trainer_stall_s'] * 1e3:.1f} ms",
                      f"{m['rollout_stall_s'] * 1e3:.1f} ms",
                      f"[green]yes[/green] ({m['checks']})" if m["verified"]
                      else "[red]NO[/red]")
    console.print(table)
    if delta:
        for mode, m in per_mode.items():
            if "received_per_version" in m:
                console.print(f"{mode}: kB to the rollouts per version, as deltas: " + ", ".join(
                    f"v{v} {b / 1e3:,.1f}" for v, b in m["received_per_version"].items()))
    out = {"transfer": "UCX between spawned processes", "processes": len(jobs),
           "torch_device": "cuda" if cuda else "cpu",
           "process_rollout_workers": workers,
           "processes_s": round(wall, 2), "modes": per_mode, "transfers_verified": bool(all_ok)}
    done = [m for m in per_mode.values() if "ewtt_s" in m]
    if done:
        out["ewtt_s"] = round(float(np.median([m["ewtt_s"] for m in done])), 4)
    if "sync" in per_mode and "both" in per_mode and per_mode["both"].get("agst_s"):
        r = per_mode["sync"]["agst_s"] / per_mode["both"]["agst_s"]
        out["agst_sync_over_both"] = round(r, 2)
        console.print(f"Staging on both sides stalled the workers {r:.1f}x less than the fully "
                      f"synchronous mode (AGST {per_mode['both']['agst_s'] * 1e3:.1f} ms vs "
                      f"{per_mode['sync']['agst_s'] * 1e3:.1f} ms per update).")
    if check:  # every rollout rank's weight check after every update (wb.Receiver.check)
        reps = [c for r in results for m in r["modes"].values() for c in m.get("weight_checks",
                                                                               [])]
        out["weight_checks"] = {"reports": len(reps), "ok": sum(c["ok"] for c in reps),
                                "mismatched": sorted({n for c in reps for n in c["mismatched"]}),
                                "max_s": max((c["seconds"] for c in reps), default=None)}
        all_ok &= bool(reps) and all(c["ok"] for c in reps)
        out["transfers_verified"] = bool(all_ok)
        console.print(f"Weight checks: {out['weight_checks']['ok']} of {len(reps)} rollout "
                      f"reports found every element the trainers claimed.")
    if p is not None:
        out["traffic_ratio_processes"] = traffic_ratio(p)
    for name, err in errors.items():
        console.print(f"[red]{name} failed:[/red] {err}")
    if errors:
        out["errors"] = errors
    return out


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


