#!/usr/bin/env bash
# One call on the H200 device machine: the FP8 GPU tests, then bench/bench_fp8.py at 9.5 GB of
# BF16 weights (8 processes on the one GPU). Needs the ucxx wheels for Python 3.12 in .whl/
# (carried; see bench/results/h200_transfer/COMMAND.md); writes its files to $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD UCX_WARN_UNUSED_ENV_VARS=n PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/device.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider --override-ini addopts= tests/test_fp8_cuda.py \
    2>&1 | tail -4 | tee "$OUT/fp8_tests.txt"
fi
timeout ${BENCH_TIMEOUT:-420} python3 bench/bench_fp8.py --cuda 0 --hidden 2048 --layers ${LAYERS:-12} \
  --experts 64 --repeat ${REPEAT:-2} --warmup 1 --out "$OUT/fp8.json" 2>&1 | tail -12 | tee "$OUT/fp8.txt"
