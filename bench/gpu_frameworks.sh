#!/usr/bin/env bash
# One call on the H200 device machine: bench/bench_frameworks.py --cuda (every pairing of
# PyTorch and JAX trainers and rollouts), then, with PROFILE=1, the JAX pairings again under
# cProfile (every process's 25 most expensive functions, appended to $OUT/profiles.txt; the
# profiler's own cost skews those runs' times: read them for where time goes, not how much).
# Needs the ucxx wheels for Python 3.12 in .whl/ (carried); writes its files to $OUT.
set -uo pipefail
source bench/gpu_common.sh
timeout ${BENCH_TIMEOUT:-330} python3 bench/bench_frameworks.py --cuda --hidden 2048 --layers 2 \
  --experts 16 --out "$OUT/frameworks.json" 2> "$OUT/frameworks_log.txt" | tail -1 | python3 -c "
import json, sys
d = json.loads(sys.stdin.read())
for p, v in d['pairs'].items():
    print(p, v['verified'], {m: x['ewtt_s'] for m, x in v['modes'].items()}, v.get('ewtt_over_torch'))"
if [ -n "${PROFILE:-}" ]; then
  export WB_PROFILE_OUT="$OUT/profiles.txt" PYTHONPATH=$PWD/bench/results/jax_gpu/profile_site:$PYTHONPATH
  timeout ${PROFILE_TIMEOUT:-180} python3 bench/bench_frameworks.py --cuda --hidden 2048 --layers 2 \
    --experts 16 --steps 3 --modes sync --pairs torch:jax jax:torch > /dev/null 2>&1
  unset WB_PROFILE_OUT
  ls -la "$OUT"
fi
