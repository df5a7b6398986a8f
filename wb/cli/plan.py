"""``python -m wb plan --preset NAME``: build a preset deployment's maps and plan, report, plot."""

from __future__ import annotations

import resource
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from wb.data.layout import Cluster

__all__ = ["run_plan", "plot_links"]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_plan(preset: str, *, plot: str | None = None, verify: bool = True, quiet: bool = False,
             models_dir=None) -> dict:
    """Builds the preset's maps and plan, simulates it and the baselines; returns the report."""
    from wb.layouts.deployments import deployment
    from wb.algorithms.planner import plan as make_plan
    from wb.algorithms.planner import traffic_ratio
    from wb.algorithms.simulate import simulate, simulate_broadcast, simulate_p2p

    console = Console(quiet=quiet)
    t0 = time.perf_counter()
    with console.status(f"building the source maps of {preset}..."):
        dep = deployment(preset, models_dir=models_dir)
    maps_s = time.perf_counter() - t0
    cluster = Cluster()
    with console.status(f"planning {len(dep.trainers)} trainers -> {len(dep.rollouts)} rollouts..."):
        p = make_plan(dep.trainers, dep.rollouts, cluster)
    plan_s = time.perf_counter() - t0
    rss = _peak_rss_mb()
    with console.status("simulating the plan and the baselines..."):
        ratio = traffic_ratio(p)
        sim, bc, p2p = simulate(p), simulate_broadcast(p), simulate_p2p(p)
    verify_s = None
    if verify:
        with console.status("verifying the plan against the layouts..."):
            t1 = time.perf_counter()
            p.verify()
            verify_s = time.perf_counter() - t1
    summary = p.summary()
    report = {
        "preset": preset, "description": dep.description,
        "trainer_gpus": len(dep.trainers), "rollout_gpus": len(dep.rollouts),
        "model_bytes": int(dep.spec.nbytes), "plan_s": round(plan_s, 3),
        "maps_s": round(maps_s, 3), "peak_rss_mb": round(rss, 1),
        "traffic_ratio": ratio, "ewtt_s": sim.ewtt_s, "ideal_s": sim.ideal_s,
        "ewtt_over_ideal": sim.ratio, "busiest_link": sim.busiest, "pipeline_s": sim.pipeline_s,
        "baselines": {"broadcast": {"ewtt_s": bc.ewtt_s}, "p2p": {"ewtt_s": p2p.ewtt_s}},
        "speedup_vs_broadcast": bc.ewtt_s / sim.ewtt_s, "speedup_vs_p2p": p2p.ewtt_s / sim.ewtt_s,
        "verified": verify_s is not None, "verify_s": None if verify_s is None else round(verify_s, 3),
        "pieces": summary["pieces"], "transfers": summary["transfers"],
        "messages": summary["messages"], "bytes_by_stage": summary["bytes_by_stage"],
    }
    t = Table(title=f"plan for {preset}", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    gb = 1e9
    rows = [
        ("model", f"{dep.spec.numel / 1e9:,.2f}B parameters, {dep.spec.nbytes / gb:,.1f} GB"),
        ("GPUs (trainer -> rollout)", f"{len(dep.trainers)} -> {len(dep.rollouts)}"),
        ("maps + plan time", f"{plan_s:.1f} s (maps {maps_s:.1f} s)"),
        ("peak RSS", f"{rss:,.0f} MB"),
        ("traffic / lower bound", f"{ratio:.4f}"),
        ("bytes by stage (1 / 2 / 3)", " / ".join(f"{summary['bytes_by_stage'][s] / gb:,.1f} GB"
                                                  for s in (1, 2, 3))),
        ("pieces / transfers / messages", f"{summary['pieces']:,} / {summary['transfers']:,} / "
                                          f"{summary['messages']:,}"),
        ("simulated EWTT (busiest link)", f"{sim.ewtt_s:.3f} s ({sim.busiest})"),
        ("ideal EWTT / ratio", f"{sim.ideal_s:.3f} s / {sim.ratio:.3f}x"),
        ("broadcast baseline EWTT", f"{bc.ewtt_s:.2f} s ({bc.ewtt_s / sim.ewtt_s:.1f}x slower)"),
        ("naive P2P baseline EWTT", f"{p2p.ewtt_s:.2f} s ({p2p.ewtt_s / sim.ewtt_s:.1f}x slower)"),
        ("verified", "yes" if verify_s is not None else "skipped"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    if plot:
        plot_links({"wb": sim, "naive p2p": p2p}, sim.ideal_s, plot, title=preset)
        report["plot"] = plot
        console.print(f"wrote {plot}")
    return report


def plot_links(sims: dict, ideal: float, path: str, *, title: str = "") -> None:
    """Per-GPU load of every link class (seconds at full bandwidth), sorted, against the ideal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = ["trainer_nic_out", "rollout_nic_in", "rollout_nic_out", "nvlink_out", "nvlink_in"]
    fig, axes = plt.subplots(1, len(classes), figsize=(4 * len(classes), 3.6), sharey=True)
    for ax, cls in zip(axes, classes):
        for name, sim in sims.items():
            v = np.sort(sim.link_s.get(cls, np.zeros(0)))[::-1]
            if v.size:
                ax.plot(np.arange(v.size), v, label=name)
        ax.axhline(ideal, color="k", ls="--", lw=1, label="ideal (balanced bound)")
        ax.set_title(cls.replace("_", " "))
        ax.set_xlabel("GPU (sorted by load)")
    axes[0].set_ylabel("seconds at full bandwidth")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"link loads: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
