#!/usr/bin/env bash
# One call on the H200 device machine: the FP8 GPU tests, then bench/bench_fp8.py at 9.5 GB of
# BF16 weights (8 processes on the one GPU). Needs the ucxx wheels for Python 3.12 in .whl/
# (carried; see bench/results/h200_transfer/COMMAND.md); writes its files to $OUT.
#   LAYERS (default 12), REPEAT (2), CHUNK_MB (plan piece size, default the bench's 8),
#   MPS="0 1" (default 0): 1 runs the bench under the CUDA MPS daemon (bench/gpu_common.sh),
#   PROGRESS="polling caller" (default: the transport's own): WB_UCX_PROGRESS, who progresses
#   UCX (wb.UcxTransport's progress=); SKIP_TESTS=1, TEST_TIMEOUT, BENCH_TIMEOUT (s, per run).
set -uo pipefail
source bench/gpu_common.sh
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider --override-ini addopts= tests/test_fp8_cuda.py \
    2>&1 | tail -4 | tee "$OUT/fp8_tests.txt"
fi
for M in ${MPS:-0}; do
  tag=""; if [ "$M" = 1 ]; then mps_on; tag="_mps"; fi
  for C in ${CHUNK_MB:-8}; do for P in ${PROGRESS:-default}; do
    name=fp8_${LAYERS:-12}l_${C}mb$tag
    if [ "$P" != default ]; then export WB_UCX_PROGRESS=$P; name=${name}_$P; fi
    echo "== $name"
    timeout ${BENCH_TIMEOUT:-420} python3 bench/bench_fp8.py --cuda 0 --hidden 2048 --layers ${LAYERS:-12} \
      --experts 64 --repeat ${REPEAT:-2} --warmup 1 --chunk-mb $C --out "$OUT/$name.json" 2>&1 | tail -12
    unset WB_UCX_PROGRESS
  done; done
  if [ "$M" = 1 ]; then mps_off; fi
done
