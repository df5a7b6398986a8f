#!/usr/bin/env bash
# One call on the H200 device machine: the GPU fault and transfer tests over one-sided CUDA
# messages and UCX tags, then a cProfile of every process of bench/bench_fp8.py's BF16 update
# (the top functions of a trainer and a rollout by own time), then the FP8 update alone with a
# short stall timeout (what it waits for, should it stall). Needs the ucxx wheels for Python
# 3.12 in .whl/ (see bench/results/h200_transfer/COMMAND.md); writes its files to $OUT.
#   LAYERS (12), IPC (cuda), SKIP_TESTS=1, SKIP_FP8=1, FP8_IPC (off), FP8_TIMEOUT (20 s).
set -uo pipefail
source bench/gpu_common.sh
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider --override-ini addopts= \
    tests/test_survive_cuda.py tests/test_ipc_cuda.py tests/test_transfer_cuda.py 2>&1 \
    | tail -15 | cut -c1-3000 | tee "$OUT/tests.txt"
fi
echo "== bf16 profile ipc=${IPC:-cuda}"
WB_IPC=${IPC:-cuda} timeout 180 python3 bench/bench_fp8.py --cuda 0 --hidden 2048 \
  --layers ${LAYERS:-12} --experts 64 --repeat 1 --warmup 1 --only bf16 --profile "$OUT/prof" \
  --trace "$OUT/trace" --out "$OUT/bf16_profiled.json" 2>&1 | tail -4
for r in 0 4; do
  python3 -c "import pstats,sys; pstats.Stats(sys.argv[1]).sort_stats('tottime').print_stats(40)" \
    "$OUT/prof/bf16/0_r$r.prof" > "$OUT/prof_top_r$r.txt" 2>&1
  python3 -c "import pstats,sys; pstats.Stats(sys.argv[1]).sort_stats('cumulative').print_stats(40)" \
    "$OUT/prof/bf16/0_r$r.prof" > "$OUT/prof_cum_r$r.txt" 2>&1
done
gzip -f "$OUT"/trace/bf16/*.json 2>/dev/null
if [ -z "${SKIP_FP8:-}" ]; then
  echo "== fp8 alone ipc=${FP8_IPC:-off}"
  WB_IPC=${FP8_IPC:-off} timeout 200 python3 bench/bench_fp8.py --cuda 0 --hidden 2048 \
    --layers ${LAYERS:-12} --experts 64 --repeat 1 --warmup 1 --only fp8 \
    --timeout ${FP8_TIMEOUT:-20} --out "$OUT/fp8_alone.json" 2>&1 | tail -6 | cut -c1-4000
fi
