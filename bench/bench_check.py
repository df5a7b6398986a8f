"""The weight check's own time on a Kimi-K2 deployment (1T parameters; Megatron trainers, vLLM
rollouts): per rank, what :meth:`wb.Receiver.check` and :meth:`wb.Sender.claim` do besides
reading the sampled elements and the store: draw the sample (:func:`wb.runtime.endpoints.checks.
sample`) and find it in the rank's buffers through their source maps
(:func:`wb.algorithms.locate.locate`). No buffer is made: a K2 rank's weights do not fit this
machine; the reads are ``per_tensor`` elements per tensor.

    python bench/bench_check.py [--preset kimi-k2] [--per-tensor 64] [--ranks 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import time



def main() -> None:
    from wb.algorithms.locate import locate
    from wb.layouts.deployments import deployment
    from wb.runtime.endpoints.checks import sample

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="kimi-k2")
    ap.add_argument("--per-tensor", type=int, default=64)
    ap.add_argument("--ranks", type=int, default=4, help="rollout and trainer ranks timed each")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    t = time.perf_counter()
    dep = deployment(a.preset)
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    ids = sample(dep.spec, "wb/check/1", a.per_tensor)
    sample_s = time.perf_counter() - t
    rows = []
    for role, lays in (("rollout", dep.rollouts), ("trainer", dep.trainers)):
        step = max(1, len(lays) // a.ranks)
        for lay in lays[::step][:a.ranks]:
            t = time.perf_counter()
            found = sum(locate(b.sourcemap, ids)[0].size for b in lay.buffers.values())
            rows.append({"role": role, "rank": lay.worker.rank, "buffers": len(lay.buffers),
                         "elements": int(sum(b.sourcemap.numel for b in lay.buffers.values())),
                         "found": int(found), "locate_s": time.perf_counter() - t})
    rep = {"preset": a.preset, "tensors": len(dep.spec.names), "sampled": int(ids.size),
           "sample_s": sample_s, "deployment_build_s": build_s, "ranks": rows,
           "worst_rank_s": sample_s + max(r["locate_s"] for r in rows)}
    if a.json:
        print(json.dumps(rep))
        return
    print(f"{a.preset}: {rep['tensors']:,} tensors, {rep['sampled']:,} elements sampled in "
          f"{sample_s:.2f} s")
    for r in rows:
        print(f"  {r['role']} rank {r['rank']}: {r['buffers']} buffers, {r['elements']:,} "
              f"elements, {r['found']:,} sampled ones found in {r['locate_s']:.2f} s")
    print(f"worst rank: {rep['worst_rank_s']:.2f} s (sampling and finding)")


if __name__ == "__main__":
    main()
