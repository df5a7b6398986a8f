"""The demo behind ``python -m wb demo``: probe two real load paths, find their correspondence.

A JAX trainer (a dp x tp mesh of emulated CPU devices, JAX kernel conventions) and vLLM-style
PyTorch rollouts (TP ranks x replicas, fused qkv/gate_up, stacked experts, padded vocabulary) are
probed through their own load functions; the correspondence between every trainer shard and every
rollout parameter is computed on blocks and checked element by element against a brute-force
oracle. A plan then moves the trainer's real weights in this process (``wb.run_local``) into the
rollouts' own parameters, which must come out bit-identical to what the rollouts' own loader makes
of the same checkpoint. ``--trainer torch --rollout jax`` swaps the sides. Transfers between
processes (UCX) and the sync modes come with later milestones.

The frameworks are imported only when the demo runs: ``import wb`` never imports torch or jax.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
from rich.console import Console
from rich.table import Table

import wb
from wb.layout import BufferSpec, Layout, Worker
from wb.presets import TINY, spec_from_config

__all__ = ["run_demo", "jax_layouts", "torch_layouts"]


def jax_layouts(cfg: dict, *, role: str, dp: int, tp: int, copies: int, first_rank: int,
                node_prefix: str, ckpt: dict) -> tuple[list[Layout], dict, dict]:
    """Layouts of ``copies`` JAX programs on a dp x tp mesh each (one worker per device), their
    buffers after loading ``ckpt`` with the program's own load function, and zeroed buffers.

    Returns ``(layouts, {rank: {key: loaded shard}}, {rank: {key: zeros}})``.
    """
    import wb_jax

    wb_jax.use_cpu_devices(dp * tp)
    from wb_jax.testing import make_load_fn, make_mesh

    spec = spec_from_config(cfg)
    load = make_load_fn(cfg, make_mesh(dp, tp))
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
                  node_prefix: str, ckpt: dict) -> tuple[list[Layout], dict, dict]:
    """Layouts of ``copies`` vLLM-style TP groups (one node each; one worker per TP rank), the
    parameters after ``load_weights(ckpt)``, and the parameters of fresh models (numpy views:
    writing them writes the torch parameters).

    Returns ``(layouts, {rank: {name: loaded}}, {rank: {name: fresh model's parameter view}})``.
    """
    import wb_torch
    from wb_torch.testing import TinyRollout

    spec = spec_from_config(cfg)
    per_rank = []
    for r in range(tp):
        model = TinyRollout(cfg, tp_rank=r, tp_size=tp)
        dtypes = {n: wb.dtypes.canonical_dtype(p.dtype) for n, p in model.named_parameters()}
        per_rank.append({n: BufferSpec(sm, dtypes[n])
                         for n, sm in wb_torch.probe(model, spec).items() if sm.n_ids})
    out, loaded, fresh = [], {}, {}
    for c in range(copies):
        for r in range(tp):
            worker = Worker(rank=first_rank + len(out), node=f"{node_prefix}{c}", role=role,
                            local_rank=r)
            out.append(Layout(worker, per_rank[r]))
            ref = TinyRollout(cfg, tp_rank=r, tp_size=tp)
            ref.load_weights((n, wb_torch.from_numpy(a)) for n, a in ckpt.items())
            model = TinyRollout(cfg, tp_rank=r, tp_size=tp)
            params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
            loaded[worker.rank] = {n: wb_torch.to_numpy(ref_params[n]) for n in per_rank[r]}
            fresh[worker.rank] = {n: wb_torch.to_numpy(params[n]) for n in per_rank[r]}
    return out, loaded, fresh


def _side(kind: str, role: str, *, replicas: int, tp: int, first_rank: int, ckpt: dict):
    prefix = "trainer" if role == "trainer" else "rollout"
    copies = 1 if role == "trainer" else replicas
    if kind == "jax":
        return jax_layouts(TINY, role=role, dp=2, tp=2, copies=copies, first_rank=first_rank,
                           node_prefix=prefix, ckpt=ckpt)
    # A PyTorch trainer: 2 data-parallel replicas of a TP group (the reference sharding).
    return torch_layouts(TINY, role=role, tp=tp, copies=2 if role == "trainer" else copies,
                         first_rank=first_rank, node_prefix=prefix, ckpt=ckpt)


def _random_checkpoint(seed: int = 0) -> dict[str, np.ndarray]:
    spec = spec_from_config(TINY)
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(spec.shape(n), dtype=np.float32).astype(
        wb.dtypes.dtype_info(spec.dtype(n)).numpy) for n in spec.names}


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
             quiet: bool = False) -> dict:
    """Runs the demo and returns its report (what ``--json`` prints).

    Args:
        trainer: ``"jax"`` or ``"torch"``: the framework of the holders.
        rollout: ``"torch"`` or ``"jax"``: the framework of the needs.
        replicas: rollout replicas, one node each.
        tp: TP degree of a PyTorch side.
        quiet: print nothing (the report is still returned).
    """
    if replicas < 1 or tp < 1:
        raise wb.SpecError(f"--replicas and --tp must be >= 1, got {replicas} and {tp}")
    console = Console(quiet=quiet)
    ckpt = _random_checkpoint()
    t0 = time.perf_counter()
    with console.status(f"probing the {trainer} trainer's load function..."):
        trainers, weights, _ = _side(trainer, "trainer", replicas=replicas, tp=tp, first_rank=0,
                                     ckpt=ckpt)
    with console.status(f"probing the {rollout} rollouts' load_weights..."):
        rollouts, expected, targets = _side(rollout, "rollout", replicas=replicas, tp=tp,
                                            first_rank=len(trainers), ckpt=ckpt)
    probe_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    corr = wb.correspond(trainers, rollouts)
    correspond_s = time.perf_counter() - t1
    with console.status("checking the correspondence element by element..."):
        from wb.testing.oracle import correspondence_pairs, overlap_pairs

        exact = overlap_pairs(corr) == correspondence_pairs(trainers, rollouts)
    with console.status("planning and running the transfer in this process..."):
        t2 = time.perf_counter()
        p = wb.plan(trainers, rollouts)
        p.verify()
        plan_s = time.perf_counter() - t2
        from wb.planner import traffic_ratio

        ratio = traffic_ratio(p)
        wb.run_local(p, weights, targets)
        identical = all(_same_bits(targets[r][k], expected[r][k])
                        for r in targets for k in targets[r])
    verified = exact and identical

    tt, ttot = _worker_table(f"{trainer} trainer: buffers held (per worker)", trainers)
    rt, rtot = _worker_table(f"{rollout} rollouts: buffers needed (per worker)", rollouts)
    console.print(tt)
    console.print(rt)
    from wb.planner import bound_parts

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
    summary.add_row("distinct bytes needed (M, the trainers' lower bound)", f"{needed['M']:,}")
    for node, b in needed["nodes"].items():
        summary.add_row(f"distinct bytes node {node} needs (M_v)", f"{b:,}")
    summary.add_row("checked against the per-element oracle",
                    "[green]exact[/green]" if exact else "[red]MISMATCH[/red]")
    summary.add_row("plan: transfers / traffic vs lower bound",
                    f"{p.transfers.piece.size:,} / {ratio:.4f}")
    summary.add_row(f"weights moved in-process into the {rollout} parameters; equal to the "
                    f"rollouts' own load of the checkpoint",
                    "[green]bit-identical[/green]" if identical else "[red]DIFFERENT[/red]")
    summary.add_row("probe / correspondence / plan time",
                    f"{probe_s:.2f} s / {correspond_s * 1e3:.1f} ms / {plan_s * 1e3:.1f} ms")
    console.print(summary)
    console.print("The transfer ran in this process (wb.run_local); the UCX data plane between "
                  "processes and the sync modes are not built yet: see README.")
    return {
        "verified": bool(verified), "trainer": trainer, "rollout": rollout,
        "trainer_workers": len(trainers), "rollout_workers": len(rollouts),
        "elements": int(elements), "map_entries": int(entries),
        "blocks": int(ttot["blocks"] + rtot["blocks"]), "cells": int(corr.cell_id0.size),
        "overlaps": int(ov.src_slot.size), "needed_bytes": int(needed["M"]),
        "node_needed_bytes": needed["nodes"], "probe_s": round(probe_s, 3),
        "correspond_s": round(correspond_s, 4), "correspondence_exact": bool(exact),
        "weights_bit_identical": bool(identical), "traffic_ratio": ratio,
        "plan_s": round(plan_s, 4), "transfer": "in-process (wb.run_local); UCX not built yet",
    }


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


