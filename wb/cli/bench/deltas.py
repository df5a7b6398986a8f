"""``python -m wb bench --delta LR``: versions as a trainer makes them, sent dense and as deltas.

Every worker's weights follow :class:`wb.testing.versions.AdamById` (float32 masters stepped by
Adam at learning rate ``LR``, cast to each buffer's dtype per version; every worker computes the
same values for an id, so a rollout knows what it must hold). Per version, wb's plans run in one
rotation over the same emulated links: dense (``wb``, the plan of a dense job) and as deltas
(``wb-delta``, the plan of a delta job, ``agree_parts(delta=True)``'s: every range below a piece
packed; each unit as what changed since the version its receiver holds,
:mod:`wb.runtime.engine.deltas.units`), each into its own rollout buffers, both checked bit for
bit. The first version is dense in both
(nobody holds one yet). A rollout's dense buffers are checked against Adam's values on a
sample of their elements, its delta buffers against the dense ones in full (see
:func:`run_deltas`).

Reported per version: the fraction of the rollouts' elements that changed, the bytes that reached
the rollouts each way, what the changed values themselves take (their elements' bytes), and both
EWTTs.
"""

from __future__ import annotations

import time

import numpy as np

from wb.data.dtypes import dtype_info

__all__ = ["run_deltas", "summarize_deltas", "print_deltas", "METHODS", "SAMPLE"]

METHODS = ("wb", "wb-delta")
#: A rollout checks its dense buffers against Adam's values on one element in this many.
SAMPLE = 16
#: Staging budget of both methods' updates (41 processes share the host's memory).
STAGING_BYTES = 32 << 20


def run_deltas(c, barrier_start, result: dict) -> None:
    """One worker's part (``c``: its :class:`~wb.cli.bench.workers._Ctx`; ``barrier_start``:
    the common start of a timed step): appends a record per version and method to
    ``result["delta"]``.

    Trainers step Adam over every element they hold. A rollout (41 processes share the host's
    memory) steps it over one element in :data:`SAMPLE` of each buffer: its dense buffers must
    equal those values there, and its delta buffers the dense ones everywhere, bit for bit."""
    from wb.runtime.engine.deltas.units import DeltaPlan
    from wb.runtime.engine.program import Program
    from wb.testing.versions import AdamById

    job, xp = c.job, c.xp
    # each method's part of its plan: deltas go by the plan a delta job makes (every range below
    # a piece packed, as agree_parts(delta=True)), dense updates by the dense one
    parts = {"wb": c.plans["wb"], "wb-delta": c.plans.get("wb-delta") or c.plans["wb"]}
    part = parts["wb"]
    lay = part.layout if part is not None else None
    role = lay.worker.role.value if lay is not None else None
    step = 1 if role == "trainer" else SAMPLE
    gens = ({k: AdamById(b.sourcemap.to_indices().reshape(-1)[::step], lr=job["delta_lr"],
                         seed=job["delta_seed"], dtype=b.dtype)
             for k, b in lay.buffers.items()} if lay is not None else {})
    kept = {}
    for method in METHODS:  # each with its own transports, program and rollout buffers
        t = c.transport(f"delta/{method}", parts[method], checksums=True)
        bufs = ({k: _here(xp, g.weights()).reshape(lay.buffers[k].shape) for k, g in gens.items()}
                if role == "trainer" else
                {k: _here(xp, np.zeros(b.shape, dtype_info(b.dtype).numpy))
                 for k, b in lay.buffers.items()} if role == "rollout" else {})
        kept[method] = (t, None if t is None else Program(parts[method], checksums=True), bufs)
    dense = kept["wb"][2]
    records = result.setdefault("delta", [])
    for v in range(job["delta_versions"]):
        if v:
            for g in gens.values():
                g.step()
        if role == "trainer":
            for _, _, bufs in kept.values():
                for k, g in gens.items():
                    bufs[k].reshape(-1)[...] = _here(xp, g.weights())
            if xp is not np:
                xp.cuda.get_current_stream().synchronize()
        before = {k: _host(a) for k, a in dense.items()} if role == "rollout" else {}
        times = {}
        for method in METHODS[v % 2:] + METHODS[:v % 2]:
            t, program, bufs = kept[method]
            peers = (frozenset(parts[method].peers) if (part is not None and v)
                     else frozenset())
            plan = DeltaPlan(v, peers, peers) if method == "wb-delta" else None
            t0 = barrier_start(f"delta/{v}/{method}")
            stats = (program.run(bufs, t, tag_base=(v + 1) << 32, timeout=c.timeout,
                                 staging_bytes=STAGING_BYTES, delta=plan)
                     if program is not None else None)
            times[method] = (t0, time.time(), stats.bytes_received if stats else 0)
            c.barrier(f"delta/{v}/{method}/done")
        ok = {m: None for m in METHODS}
        diff = {}
        if role == "rollout":
            now = {k: _host(a) for k, a in dense.items()}
            ok["wb"] = all(np.array_equal(
                np.ascontiguousarray(now[k].reshape(-1)[::SAMPLE]).view(np.uint8),
                g.weights().view(np.uint8)) for k, g in gens.items())
            ok["wb-delta"] = all(np.array_equal(_host(kept["wb-delta"][2][k]).view(np.uint8),
                                                a.view(np.uint8)) for k, a in now.items())
            diff = {k: int(np.count_nonzero(before[k].view(f"u{a.itemsize}")
                                            != a.view(f"u{a.itemsize}")))
                    for k, a in now.items()}
        changed = sum(n * dense[k].itemsize for k, n in diff.items())
        for method, (t0, end, got) in times.items():
            records.append({"version": v, "method": method, "t0": t0, "end": end,
                            "ok": ok[method], "role": role, "received": got,
                            "changed_bytes": changed, "changed": sum(diff.values()),
                            "elements": sum(a.size for a in dense.values())
                            if role == "rollout" else 0})
    for t, program, _ in kept.values():
        if t is not None:
            t.close()
            program.release()


def _here(xp, a: np.ndarray):
    """Host array ``a`` where the worker's buffers are (a device keeps bfloat16 as raw bits)."""
    return a if xp is np else xp.asarray(a.view(f"u{a.itemsize}"))


def _host(a) -> np.ndarray:
    """A copy of ``a`` on the host, as raw bits where it is a device's."""
    return a.copy() if isinstance(a, np.ndarray) else a.get()


def summarize_deltas(res: dict) -> dict:
    """The run's figures per version from every worker's records (see the module doc)."""
    recs = [r for x in res.values() for r in x.get("delta", [])]
    out = []
    for v in sorted({r["version"] for r in recs}):
        row: dict = {"version": v}
        for method in METHODS:
            rs = [r for r in recs if r["version"] == v and r["method"] == method]
            rolls = [r for r in rs if r["role"] == "rollout"]
            row[method] = {"ewtt_s": max(r["end"] for r in rs) - min(r["t0"] for r in rs),
                           "bytes": sum(r["received"] for r in rolls),
                           "verified": all(r["ok"] for r in rolls)}
        rolls = [r for r in recs if r["version"] == v and r["method"] == "wb" and
                 r["role"] == "rollout"]
        changed = sum(r["changed_bytes"] for r in rolls)
        d, w = row["wb-delta"], row["wb"]
        row.update(changed_fraction=sum(r["changed"] for r in rolls)
                   / max(sum(r["elements"] for r in rolls), 1),
                   changed_value_bytes=changed,
                   bytes_over_dense=d["bytes"] / max(w["bytes"], 1),
                   bytes_over_changed=d["bytes"] / changed if changed else None,
                   ewtt_over_dense=d["ewtt_s"] / w["ewtt_s"])
        out.append(row)
    later = [r for r in out if r["version"] > 0]
    return {"versions": out,
            "verified": all(r[m]["verified"] for r in out for m in METHODS),
            "worst_bytes_over_changed": max((r["bytes_over_changed"] for r in later
                                             if r["bytes_over_changed"] is not None),
                                            default=None),
            "worst_ewtt_over_dense": max((r["ewtt_over_dense"] for r in later), default=None)}


def print_deltas(d: dict, replicas: int, console) -> None:
    """The report's ``delta`` (:func:`summarize_deltas`) as a table on ``console``."""
    from rich.table import Table

    a = Table(title=f"Adam at LR {d['lr']:g}, {replicas} replicas: each version "
                    f"dense and as deltas (MB to the rollouts, EWTT in s), in one run")
    for col in ("v", "changed", "MB\ndense", "MB\ndeltas", "deltas/\nchanged",
                "EWTT\ndense", "EWTT\ndeltas", "deltas/\ndense", "exact"):
        a.add_column(col, justify="right")
    for row in d["versions"]:
        w, x = row["wb"], row["wb-delta"]
        a.add_row(str(row["version"]), f"{row['changed_fraction']:.2%}",
                  f"{w['bytes'] / 1e6:.2f}", f"{x['bytes'] / 1e6:.2f}",
                  f"{row['bytes_over_changed']:.2f}x" if row["bytes_over_changed"] else "-",
                  f"{w['ewtt_s']:.3f}", f"{x['ewtt_s']:.3f}",
                  f"{row['ewtt_over_dense']:.2f}x",
                  "[green]yes[/green]" if w["verified"] and x["verified"] else "[red]NO[/red]")
    console.print(a)
