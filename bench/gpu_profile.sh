#!/usr/bin/env bash
# One call on the H200 device machine: the GPU fault and transfer tests over one-sided CUDA
# messages and UCX tags, then, for the BF16 and the FP8 update of bench/bench_fp8.py alone, a
# per-message trace (summarised by bench/trace_summary.py) and a cProfile of every process (the
# top functions of a trainer and a rollout, by own and by cumulative time). Needs the ucxx
# wheels for Python 3.12 in .whl/ (see bench/results/h200_transfer/COMMAND.md); writes its
# files to $OUT/all.tgz (the device returns few files) and tests.txt beside it.
#   LAYERS (12), IPC (cuda), ONLY ("bf16 fp8"), SKIP_TESTS=1, BENCH_TIMEOUT (150 s, per run).
set -uo pipefail
source bench/gpu_common.sh
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider --override-ini addopts= \
    tests/test_survive_cuda.py tests/test_ipc_cuda.py tests/test_transfer_cuda.py 2>&1 \
    | tail -15 | cut -c1-3000 | tee "$OUT/tests.txt"
fi
for U in ${ONLY:-bf16 fp8}; do
  echo "== $U profile ipc=${IPC:-cuda}"
  WB_IPC=${IPC:-cuda} timeout ${BENCH_TIMEOUT:-150} python3 bench/bench_fp8.py --cuda 0 \
    --hidden 2048 --layers ${LAYERS:-12} --experts 64 --repeat 1 --warmup 1 --only $U \
    --profile "$OUT/prof" --trace "$OUT/trace" --out "$OUT/${U}_profiled.json" 2>&1 | tail -4
  python3 bench/trace_summary.py "$OUT"/trace/$U/trace_0.json > "$OUT/${U}_trace_summary.txt" 2>&1
  for r in 0 4; do
    for s in tottime cumulative; do
      python3 -c "import pstats,sys; pstats.Stats(sys.argv[1]).sort_stats(sys.argv[2]).print_stats(45)" \
        "$OUT/prof/$U/0_r$r.prof" "$s" > "$OUT/${U}_prof_${s}_r$r.txt" 2>&1
    done
  done
  gzip -f "$OUT"/trace/$U/*.json 2>/dev/null
done
# the device returns a few files per call: everything as one archive
cd "$OUT" && tar czf all.tgz ./*.txt ./*.json prof trace 2>/dev/null && rm -rf ./*_prof_*.txt ./*.json prof trace
