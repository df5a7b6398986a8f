"""``python -m wb bench``'s figure: EWTT by replica count against the ideal, and AGST by mode."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot"]


def plot(report: dict, path: Path) -> None:
    """Draws ``report`` (:func:`~wb.cli.bench.runner.run_bench`'s) into ``path`` (PNG), if
    matplotlib is there."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(int(R), r) for R, r in report["by_replicas"].items() if not r.get("errors")]
    if not rows:
        return
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    xs = [R for R, _ in rows]
    for key, label in (("wb", "wb"), ("p2p", "naive P2P"), ("broadcast", "broadcast")):
        if key not in rows[0][1]["ewtt_s"]:
            continue
        ax[0].plot(xs, [r["ewtt_s"][key] for _, r in rows], "o-", label=label)
    ax[0].plot(xs, [r["ideal_s"] for _, r in rows], "k--", label="ideal (lower bound)")
    ax[0].set_xlabel("rollout replicas")
    ax[0].set_ylabel("EWTT (s)")
    ax[0].set_xticks(xs)
    ax[0].legend()
    last = rows[-1][1]
    names = list(last["agst_s"])
    ax[1].bar(range(len(names)), [last["agst_s"][n] for n in names])
    ax[1].set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax[1].set_yscale("log")
    ax[1].set_ylabel(f"AGST (s), {last['replicas']} replicas")
    fig.suptitle(f"{report['model']}, {report['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
