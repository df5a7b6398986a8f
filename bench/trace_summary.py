"""Where an update's time went: reads a ``trace_rR.json`` (or ``.json.gz``) written by
``python -m wb bench ... --out DIR --trace`` and prints, per rank, when its messages were ready,
posted and done, and per stage when the receives landed. Times are ms after the run's start (every
rank starts at one instant; see ``wb.cli.bench.workers.barrier``).

    python bench/trace_summary.py bench/results/h200x2_bench/large_trace_r1.json.gz
"""

from __future__ import annotations

import gzip
import json
import sys

import numpy as np


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def summarize(traces: dict) -> list[str]:
    t0 = min(v["t0"] for v in traces.values())
    lines = []
    rows = []
    sent_done: dict[int, float] = {}
    recv_done: dict[int, float] = {}
    for rank, v in sorted(traces.items(), key=lambda kv: int(kv[0])):
        msgs = v["messages"]
        if not msgs:
            continue
        # wb.runtime.engine.update.TraceEntry: (message, stage, peer, outgoing, nbytes, ready, posted,
        # done), a list in JSON
        ready, posted, done = (np.array([m[i] for m in msgs], float) - t0 for i in (5, 6, 7))
        nbytes = sum(m[4] for m in msgs)
        n_out = sum(bool(m[3]) for m in msgs)
        lines.append(f"rank {rank:>3}: {len(msgs):4d} messages ({n_out} out), "
                     f"{nbytes / 1e9:6.2f} GB; first ready {ready.min() * 1e3:5.1f} ms, posted "
                     f"{posted.min() * 1e3:5.1f}-{posted.max() * 1e3:5.1f} ms, done "
                     f"{done.min() * 1e3:5.1f}-{done.max() * 1e3:5.1f} ms")
        rows += [(m[1], bool(m[3]), m[4], m[5] - t0, m[6] - t0, m[7] - t0) for m in msgs]
        for m in msgs:  # message -> when its sender, and when its receiver, saw it done
            (sent_done if m[3] else recv_done)[m[0]] = m[7]
    for stage in sorted({r[0] for r in rows}):
        got = [r for r in rows if r[0] == stage and not r[1]]
        if not got:
            continue
        d = np.array([r[5] for r in got]) * 1e3
        lines.append(f"stage {stage}: {len(got)} receives, {sum(r[2] for r in got) / 1e9:.2f} GB; "
                     f"landed p10/p50/p90/last {np.percentile(d, 10):.1f} / "
                     f"{np.percentile(d, 50):.1f} / {np.percentile(d, 90):.1f} / {d.max():.1f} ms")
    fwd = [r for r in rows if r[1] and r[0] > 1]
    if fwd:
        wait = np.array([r[4] - r[3] for r in fwd]) * 1e3
        lines.append(f"forwards: {len(fwd)}; posted after their data landed: p50 "
                     f"{np.percentile(wait, 50):.2f} ms, p90 {np.percentile(wait, 90):.2f} ms, "
                     f"max {wait.max():.2f} ms")
    both = [m for m in recv_done if m in sent_done]
    if both:  # one-sided: a send is done once its receiver's copy is; the receiver's loop then
        # still has to see it (how far behind its own copies a receiver's loop runs)
        lag = np.array([recv_done[m] - sent_done[m] for m in both]) * 1e3
        lines.append(f"receives seen done after their send was: p10/p50/p90 "
                     f"{np.percentile(lag, 10):.2f} / {np.percentile(lag, 50):.2f} / "
                     f"{np.percentile(lag, 90):.2f} ms")
    return lines


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print("\n".join(summarize(load(sys.argv[1]))))
