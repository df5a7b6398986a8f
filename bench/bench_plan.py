"""Planner scale: time and peak memory to build maps and plan, by model size and by GPU count.

Each case runs in a fresh process (so peak RSS is its own): the four preset deployments
(Moonlight-16B on 2 nodes .. Kimi-K2 1T on 64 nodes), then Kimi-K2 with 1, 2, 4 and 8 rollout
replicas (32 .. 256 rollout GPUs) against the same 256 trainer GPUs. Reported per case: maps + plan
seconds, peak RSS, traffic / lower bound, simulated EWTT / ideal, the simulated speed-ups over
the broadcast and naive-P2P baselines, and the saved plan's bytes and save/load seconds (the set-up
of every rank through a store is ``python -m wb plan --preset NAME --setup``).

    python bench/bench_plan.py [--quick] [--json] [--out bench/results/plan_scale/cpu.json]
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import subprocess
import sys
import time

PRESETS = ("moonlight-16b-a3b", "qwen3-235b-a22b", "deepseek-v3", "kimi-k2")


def one_case(preset: str, replicas: int | None) -> dict:
    """Runs in the child: build maps, plan, simulate; report."""
    import wb
    from wb.algorithms.planner import traffic_ratio
    from wb.algorithms.simulate import simulate, simulate_broadcast, simulate_p2p
    from wb.layouts import deployment

    t0 = time.perf_counter()
    dep = deployment(preset, replicas=replicas)  # None: the preset's own replica count
    trainers, rollouts = dep.trainers, dep.rollouts
    maps_s = time.perf_counter() - t0
    p = wb.plan(trainers, rollouts)
    plan_s = time.perf_counter() - t0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    f = io.BytesIO()
    t1 = time.perf_counter()
    p.save(f)  # what a planner writes (the whole plan; ranks get their parts, see --setup)
    save_s = time.perf_counter() - t1
    f.seek(0)
    t1 = time.perf_counter()
    wb.Plan.load(f)
    load_s = time.perf_counter() - t1
    sim, bc, p2p = simulate(p), simulate_broadcast(p), simulate_p2p(p)
    return {"preset": preset, "replicas": replicas, "trainer_gpus": len(trainers),
            "rollout_gpus": len(rollouts), "maps_s": maps_s, "plan_s": plan_s,
            "peak_rss_mb": rss_mb, "traffic_ratio": traffic_ratio(p),
            "ewtt_s": sim.ewtt_s, "ideal_s": sim.ideal_s, "ewtt_over_ideal": sim.ratio,
            "speedup_vs_broadcast": bc.ewtt_s / sim.ewtt_s, "speedup_vs_p2p": p2p.ewtt_s / sim.ewtt_s,
            "transfers": int(p.transfers.piece.size), "plan_bytes": f.getbuffer().nbytes,
            "save_s": save_s, "load_s": load_s}


def run(quick: bool = False) -> list[dict]:
    cases = [(p, None) for p in (PRESETS[:2] if quick else PRESETS)]
    if not quick:
        cases += [("kimi-k2", r) for r in (1, 2, 4, 8)]
    rows = []
    for preset, replicas in cases:
        out = subprocess.run([sys.executable, __file__, "--case", preset,
                              "--replicas", str(replicas or 0)],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the two smaller presets only")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="also write the rows to this JSON file")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--replicas", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(one_case(args.case, args.replicas or None)))
        return
    rows = run(args.quick)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python bench/bench_plan.py --out " + args.out,
                       "machine": "2-core CPU, no GPU", "rows": rows}, f, indent=1)
    if args.json:
        print(json.dumps(rows))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title="maps + plan: time and memory by model size and GPU count")
    for c in ("deployment", "GPUs (t -> r)", "maps+plan", "peak RSS", "traffic/bound",
              "EWTT/ideal", "vs broadcast", "vs p2p", "transfers", "plan MB save/load"):
        t.add_column(c, justify="right")
    for r in rows:
        name = r["preset"] + (f" x{r['replicas']} replicas" if r["replicas"] else "")
        t.add_row(name, f"{r['trainer_gpus']} -> {r['rollout_gpus']}", f"{r['plan_s']:.1f} s",
                  f"{r['peak_rss_mb']:,.0f} MB", f"{r['traffic_ratio']:.4f}",
                  f"{r['ewtt_over_ideal']:.4f}", f"{r['speedup_vs_broadcast']:.1f}x",
                  f"{r['speedup_vs_p2p']:.2f}x", f"{r['transfers']:,}",
                  f"{r['plan_bytes'] / 1e6:,.0f} / {r['save_s']:.1f} s / {r['load_s']:.1f} s")
    Console().print(t)


if __name__ == "__main__":
    main()
