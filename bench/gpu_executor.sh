#!/usr/bin/env bash
# One call on the H200 device machine: the GPU tests (CUDA buffers, CuPy kernels, JAX on the GPU),
# then bench/bench_executor.py with CUDA buffers. Needs the ucxx wheels for Python 3.12 in .whl/
# (carried; see bench/results/h200_transfer/COMMAND.md); writes its files to $OUT.
set -uo pipefail
source bench/gpu_common.sh
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider --override-ini addopts= \
    tests/test_transfer_cuda.py tests/test_casts_cuda.py tests/test_fp8_cuda.py tests/test_jax_cuda.py \
    tests/test_dlpack.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
fi
timeout ${BENCH_TIMEOUT:-240} python3 bench/bench_executor.py --cuda 0 --json --out "$OUT/executor_h200.json" ${BENCH_ARGS:-} 2>&1 | tail -3
