"""An experiment, not a bench: ``bench/bench_fp8.py --delta`` whose *delta* run's plan packs every
contiguous range below N MiB into staged messages (``wb.algorithms.planner.messages.
SMALL_RUN_BYTES``, 1 MiB by default), for fewer, larger messages; the dense run's plan stays as
it is. A message costs a rank tens of microseconds of host work whatever it carries; a delta
carries a few percent of its unit, so the deltas' host work follows the message count.

    python3 bench/results/delta_gpu/delta_packed.py N [bench_fp8.py options]
"""

import runpy
import sys
from pathlib import Path

import wb.algorithms.planner.messages as messages

sys.path.insert(0, str(Path("bench").resolve()))
import bench_transfer  # noqa: E402

N = int(float(sys.argv[1]) * 2**20)
_run = bench_transfer.run


def run(**kw):
    if not (kw.get("versions") or {}).get("delta"):
        return _run(**kw)
    was, messages.SMALL_RUN_BYTES = messages.SMALL_RUN_BYTES, N
    try:
        return _run(**kw)
    finally:
        messages.SMALL_RUN_BYTES = was


bench_transfer.run = run
print("delta run: SMALL_RUN_BYTES", N, flush=True)
sys.argv = ["bench/bench_fp8.py"] + sys.argv[2:]
runpy.run_path("bench/bench_fp8.py", run_name="__main__")
