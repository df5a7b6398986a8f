"""An experiment, not a bench: ``bench/bench_fp8.py`` with the planner packing every contiguous
range below N MiB into staged messages (``wb.algorithms.planner.messages.SMALL_RUN_BYTES``, 1 MiB by
default), for fewer, larger messages.

    python3 bench/results/fp8/pack_below.py N [bench_fp8.py options]
"""

import runpy
import sys

import wb.algorithms.planner.messages as messages

messages.SMALL_RUN_BYTES = int(float(sys.argv[1]) * 2**20)
print("SMALL_RUN_BYTES", messages.SMALL_RUN_BYTES, flush=True)
sys.argv = ["bench/bench_fp8.py"] + sys.argv[2:]
runpy.run_path("bench/bench_fp8.py", run_name="__main__")
