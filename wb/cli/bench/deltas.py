"""``python -m wb bench --delta LR``: versions as a trainer makes them, sent dense and as deltas.

Every worker's weights follow :class:`wb.testing.versions.AdamById` (float32 masters stepped by
Adam at learning rate ``LR``, cast to each buffer's dtype per version; every worker computes the
same values for an id, so a rollout knows what it must hold). Per version, wb's plan runs twice
in one rotation over the same emulated links: dense (``wb``) and as deltas (``wb-delta``: each
unit as what changed since the version its receiver holds, :mod:`wb.runtime.engine.deltas`),
each into its own rollout buffers, both checked bit for bit. The first version is dense in both
(nobody holds one yet).

Reported per version: the fraction of the rollouts' elements that changed, the bytes that reached
the rollouts each way, what the changed values themselves take (their elements' bytes), and both
EWTTs.
"""

from __future__ import annotations

import time

import numpy as np

__all__ = ["run_deltas", "summarize_deltas", "print_deltas", "METHODS"]

METHODS = ("wb", "wb-delta")


def run_deltas(c, barrier_start, result: dict) -> None:
    """One worker's part (``c``: its :class:`~wb.cli.bench.workers._Ctx`; ``barrier_start``:
    the common start of a timed step): appends a record per version and method to
    ``result["delta"]``."""
    from wb.runtime.engine.deltas import DeltaPlan
    from wb.runtime.engine.program import Program
    from wb.testing.versions import AdamById

    job = c.job
    part = c.plans["wb"]
    lay = part.layout if part is not None else None
    role = lay.worker.role.value if lay is not None else None
    gens = ({k: AdamById(b.sourcemap.to_indices(), lr=job["delta_lr"], seed=job["delta_seed"],
                         dtype=b.dtype) for k, b in lay.buffers.items()} if lay is not None else {})
    now = {k: g.weights() for k, g in gens.items()}
    kept = {}
    for method in METHODS:  # each with its own transports, program and rollout buffers
        t = c.transport(f"delta/{method}", part, checksums=True)
        bufs = ({k: a.copy() for k, a in now.items()} if role == "trainer"
                else {k: np.zeros_like(a) for k, a in now.items()})
        kept[method] = (t, None if t is None else Program(part, checksums=True), bufs)
    records = result.setdefault("delta", [])
    for v in range(job["delta_versions"]):
        before = now
        if v:
            for g in gens.values():
                g.step()
            now = {k: g.weights() for k, g in gens.items()}
        diff = {k: int(np.count_nonzero(before[k].view(f"u{a.itemsize}")
                                        != a.view(f"u{a.itemsize}"))) for k, a in now.items()}
        changed = sum(n * now[k].itemsize for k, n in diff.items())
        for method in METHODS[v % 2:] + METHODS[:v % 2]:
            t, program, bufs = kept[method]
            if role == "trainer":
                for k, a in now.items():
                    bufs[k][...] = a
            peers = frozenset(part.peers) if (part is not None and v) else frozenset()
            plan = DeltaPlan(v, peers, peers) if method == "wb-delta" else None
            t0 = barrier_start(f"delta/{v}/{method}")
            stats = (program.run(bufs, t, tag_base=(v + 1) << 32, timeout=c.timeout,
                                 staging_bytes=job["staging_bytes"], delta=plan)
                     if program is not None else None)
            end = time.time()
            ok = (all(np.array_equal(bufs[k].view(np.uint8), now[k].view(np.uint8)) for k in now)
                  if role == "rollout" else None)
            records.append({"version": v, "method": method, "t0": t0, "end": end, "ok": ok,
                            "role": role, "received": stats.bytes_received if stats else 0,
                            "changed_bytes": changed if role == "rollout" else 0,
                            "elements": sum(a.size for a in now.values())
                            if role == "rollout" else 0,
                            "changed": sum(diff.values()) if role == "rollout" else 0})
            c.barrier(f"delta/{v}/{method}/done")
    for t, _, _ in kept.values():
        if t is not None:
            t.close()


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
