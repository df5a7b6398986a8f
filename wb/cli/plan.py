"""``python -m wb plan --preset NAME``: build a preset deployment's maps and plan, report, plot."""

from __future__ import annotations

import resource
import time

import numpy as np
from rich.console import Console
from rich.table import Table

from wb.data.layout import Cluster

__all__ = ["run_plan", "run_setup", "plot_links"]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_plan(preset: str, *, plot: str | None = None, verify: bool = True, quiet: bool = False,
             models_dir=None, delta_density: float | None = None) -> dict:
    """Builds the preset's maps and plan, simulates it and the baselines (and, with
    ``delta_density``, every message as a delta: :func:`wb.simulate`); returns the report."""
    from wb.layouts.deployments import deployment
    from wb.algorithms import planner
    from wb.algorithms.simulate import MESSAGE_S, simulate, simulate_broadcast, simulate_p2p

    console = Console(quiet=quiet)
    t0 = time.perf_counter()
    with console.status(f"building the source maps of {preset}..."):
        dep = deployment(preset, models_dir=models_dir)
    maps_s = time.perf_counter() - t0
    cluster = Cluster()
    with console.status(f"planning {len(dep.trainers)} trainers -> {len(dep.rollouts)} rollouts..."):
        p = planner.plan(dep.trainers, dep.rollouts, cluster)
    plan_s = time.perf_counter() - t0
    rss = _peak_rss_mb()
    with console.status("simulating the plan and the baselines..."):
        ratio = planner.traffic_ratio(p)
        sim, bc, p2p = simulate(p), simulate_broadcast(p), simulate_p2p(p)
    delta = None
    if delta_density is not None:  # as a job that sends deltas plans it: agree_parts(delta=True)
        with console.status("planning and simulating it as deltas..."):
            pd = planner.plan(dep.trainers, dep.rollouts, cluster,
                              chunk_bytes=planner.DELTA_CHUNK_BYTES,
                              pack_below=planner.DELTA_PACK_BELOW)
            delta, delta_dense = simulate(pd, delta_density=delta_density), simulate(pd)
            delta_here = simulate(p, delta_density=delta_density)
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
        # messages at the measured cost each (simulate's MESSAGE_S), and free
        "message_s": MESSAGE_S, "control_s": sim.control_s,
        "ewtt_free_messages_s": sim.free_messages_s,
        "ewtt_free_messages_over_ideal": sim.free_messages_s / sim.ideal_s,
        "baselines": {"broadcast": {"ewtt_s": bc.ewtt_s}, "p2p": {"ewtt_s": p2p.ewtt_s}},
        "speedup_vs_broadcast": bc.ewtt_s / sim.ewtt_s, "speedup_vs_p2p": p2p.ewtt_s / sim.ewtt_s,
        "verified": verify_s is not None, "verify_s": None if verify_s is None else round(verify_s, 3),
        "pieces": summary["pieces"], "transfers": summary["transfers"],
        "messages": summary["messages"], "bytes_by_stage": summary["bytes_by_stage"],
    }
    if delta is not None:
        report.update({  # the delta job's plan (larger pieces) and, after it, this plan's
            "delta_density": delta_density, "delta_chunk_bytes": pd.chunk_bytes,
            "delta_messages": pd.summary()["messages"], "delta_ewtt_s": delta.ewtt_s,
            "delta_busiest": delta.busiest, "delta_control_s": delta.control_s,
            "delta_ewtt_free_messages_s": delta.free_messages_s,
            "delta_link_ratio": ((delta.free_messages_s - delta.pipeline_s)
                                 / (sim.free_messages_s - sim.pipeline_s)),
            "delta_ewtt_over_dense": delta.ewtt_s / sim.ewtt_s,
            "delta_plan_dense_ewtt_s": delta_dense.ewtt_s,
            "delta_plan_dense_over_ideal": delta_dense.ewtt_s / delta_dense.ideal_s,
            "delta_default_chunk_ewtt_s": delta_here.ewtt_s,
            "delta_default_chunk_busiest": delta_here.busiest})
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
        ("simulated EWTT (what bounds it)", f"{sim.ewtt_s:.3f} s ({sim.busiest})"),
        ("ideal EWTT / ratio", f"{sim.ideal_s:.3f} s / {sim.ratio:.3f}x"),
        ("busiest worker's messages", f"{sim.control_s:.3f} s (at {MESSAGE_S * 1e6:.1f} us each)"),
        ("EWTT with free messages / ratio", f"{sim.free_messages_s:.3f} s / "
                                            f"{sim.free_messages_s / sim.ideal_s:.3f}x"),
        *([] if delta is None else [
            (f"as deltas, {delta_density:.2%} changed ({pd.chunk_bytes >> 20} MiB pieces)",
             f"{delta.ewtt_s:.3f} s ({delta.busiest}; {delta.free_messages_s:.3f} s with free "
             f"messages)"),
            ("  its dense versions (first, joiners)", f"{delta_dense.ewtt_s:.3f} s "
                                                       f"({delta_dense.ewtt_s / sim.ideal_s:.3f}x)"),
            (f"  as deltas with {p.chunk_bytes >> 20} MiB pieces", f"{delta_here.ewtt_s:.3f} s "
                                                                  f"({delta_here.busiest})")]),
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


def run_setup(preset: str, *, sample: int = 8, quiet: bool = False, models_dir=None,
              store_dir=None) -> dict:
    """Set-up of a preset deployment through a real store, every rank simulated in this process.

    Every rank publishes its layout to a :class:`~wb.runtime.transport.stores.DirectoryStore` (in a temp
    directory unless ``store_dir``); the planner (rank 0) gathers them, plans, and publishes each
    rank's part; every rank's part is fetched (all of them, for the bytes) and ``sample`` of them
    are loaded (the largest parts first, for the load time). The whole plan's ``save``/``load`` is
    timed too, for comparison.

    Args:
        preset: a :func:`wb.layouts.deployments.deployment` name.
        sample: how many ranks' parts to load (the largest ones).
        quiet: print nothing.
        models_dir: where preset configs are looked up.
        store_dir: the store's directory (default: a temporary one, removed after).

    Returns:
        The report: ``layouts_bytes``, ``store_bytes_total``, ``max_rank_part_bytes``,
        ``max_rank_part_load_s``, ``coordinator_s`` (first layout published -> last part
        available), and the steps' times.
    """
    import io
    import tempfile

    from wb.algorithms import planner
    from wb.data.layout import Role
    from wb.data.plan import Plan, RankPlan
    from wb.layouts.deployments import deployment
    from wb.runtime.membership.records import gather_layouts, publish_layouts, publish_parts
    from wb.runtime.transport.stores import CountingStore, DirectoryStore, get_large

    console = Console(quiet=quiet)
    with console.status(f"building the source maps of {preset}..."):
        dep = deployment(preset, models_dir=models_dir)
    layouts = [*dep.trainers, *dep.rollouts]
    world = len(layouts)
    with tempfile.TemporaryDirectory() as tmp:
        store = CountingStore(DirectoryStore(store_dir or tmp))
        t0 = time.perf_counter()
        with console.status(f"{world} ranks publish their layouts..."):
            # each rank would publish its own, at once; here one after another (an upper bound)
            layouts_bytes = sum(publish_layouts(store, [lay], world=world, name="setup")
                                for lay in layouts)
        published_s = time.perf_counter() - t0
        with console.status("the planner gathers the layouts..."):
            everyone = gather_layouts(store, world=world, name="setup", timeout=60)
        gathered_s = time.perf_counter() - t0
        with console.status("planning..."):
            p = planner.plan([x for x in everyone if x.worker.role == Role.TRAINER],
                             [x for x in everyone if x.worker.role == Role.ROLLOUT])
        planned_s = time.perf_counter() - t0
        with console.status(f"cutting and publishing {world} parts..."):
            parts_bytes = publish_parts(store, p, name="setup")
        coordinator_s = time.perf_counter() - t0
        sizes = {}
        t1 = time.perf_counter()
        with console.status(f"{world} ranks fetch their parts..."):
            fetched = {r: get_large(store, f"setup/part/{r}", 60) for r in range(world)}
            sizes = {r: len(b) for r, b in fetched.items()}
        fetch_all_s = time.perf_counter() - t1
        loads = {}
        for r in sorted(sizes, key=lambda r: -sizes[r])[:max(1, sample)]:
            t1 = time.perf_counter()
            part = RankPlan.from_bytes(fetched[r])
            loads[r] = time.perf_counter() - t1
            assert part.rank == r
        del fetched
        with console.status("saving and loading the whole plan, for comparison..."):
            f = io.BytesIO()
            t1 = time.perf_counter()
            p.save(f)
            save_s = time.perf_counter() - t1
            whole_bytes = f.tell()
            f.seek(0)
            t1 = time.perf_counter()
            Plan.load(f)
            load_s = time.perf_counter() - t1
    report = {
        "preset": preset, "ranks": world, "trainer_gpus": len(dep.trainers),
        "rollout_gpus": len(dep.rollouts),
        "layouts_bytes": int(layouts_bytes), "parts_bytes": int(parts_bytes),
        "store_bytes_total": int(store.bytes_set),
        "max_rank_part_bytes": int(max(sizes.values())),
        "mean_rank_part_bytes": int(sum(sizes.values()) / len(sizes)),
        "max_rank_part_load_s": round(max(loads.values()), 4), "sampled_ranks": sorted(loads),
        "coordinator_s": round(coordinator_s, 3), "publish_layouts_s": round(published_s, 3),
        "gather_layouts_s": round(gathered_s - published_s, 3),
        "plan_s": round(planned_s - gathered_s, 3),
        "publish_parts_s": round(coordinator_s - planned_s, 3),
        "fetch_all_parts_s": round(fetch_all_s, 3),
        "whole_plan_bytes": int(whole_bytes), "whole_plan_save_s": round(save_s, 3),
        "whole_plan_load_s": round(load_s, 3), "peak_rss_mb": round(_peak_rss_mb(), 1),
    }
    t = Table(title=f"set-up of {preset} through a directory store", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    mb = 1e6
    for k, v in (("ranks", f"{world}"),
                 ("layouts through the store", f"{layouts_bytes / mb:,.1f} MB"),
                 ("parts through the store", f"{parts_bytes / mb:,.1f} MB"),
                 ("largest part / its load", f"{report['max_rank_part_bytes'] / mb:,.2f} MB / "
                                             f"{report['max_rank_part_load_s']:.3f} s"),
                 ("coordinator (first layout -> last part)", f"{coordinator_s:.1f} s"),
                 ("whole plan: bytes / save / load", f"{whole_bytes / mb:,.0f} MB / {save_s:.1f} s"
                                                     f" / {load_s:.1f} s")):
        t.add_row(k, v)
    console.print(t)
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
