#!/usr/bin/env bash
# One call on the H200 device machine: the GPU tests (executor, wb_torch Sender/Receiver on CUDA
# tensors), then `python -m wb bench` with every process's buffers on the GPU (CUDA IPC between
# processes). Needs the ucxx wheels for Python 3.12 in .whl/ (carried); writes results to $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD UCX_WARN_UNUSED_ENV_VARS=n PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/device.txt"
python3 -c "import ucxx, cupy, numpy, torch; print('ucxx', ucxx.__version__, 'cupy', cupy.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__)" | tee -a "$OUT/device.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -p no:cacheprovider --override-ini addopts= tests/test_transfer_cuda.py 2>&1 | tail -3 | tee "$OUT/gpu_test.txt"
fi
python3 -m wb bench --cuda 0 --profile gpu --replicas ${REPLICAS:-1 2 4} --out "$OUT/bench_gpu" --json \
  2> "$OUT/bench_gpu_stderr.txt" | grep -v "WARN\|flush.c\|endpoint.cpp\|UCX  ERROR\|UCXX ERROR" > "$OUT/bench_gpu_stdout.txt"
tail -c 2500 "$OUT/bench_gpu_stdout.txt"
