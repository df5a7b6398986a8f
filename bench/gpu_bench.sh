#!/usr/bin/env bash
# One call on the H200 device machine: the GPU tests (executor, wb_torch Sender/Receiver on CUDA
# tensors), then `python -m wb bench` with every process's buffers on the GPU (CUDA IPC between
# processes), one replica count at a time (4 first). Needs the ucxx wheels for Python 3.12 in .whl/
# (carried); writes results to $OUT.
#   REPLICAS (default "4 1 2"), PROFILE (default gpu), PER_R_TIMEOUT (s, default 300),
#   SKIP_TESTS=1, MPS="0 1" (default 0): 1 runs the bench under the CUDA MPS daemon (started here as
#   this user, pipes in /tmp, stopped after): processes then share the GPU at once instead of
#   time-slicing it. MPS changes no GPU setting.
set -uo pipefail
source bench/gpu_common.sh
python3 -c "import ucxx, cupy, numpy, torch; print('ucxx', ucxx.__version__, 'cupy', cupy.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__)" | tee -a "$OUT/device.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -p no:cacheprovider --override-ini addopts= tests/test_transfer_cuda.py 2>&1 | tail -3 | tee "$OUT/gpu_test.txt"
fi
filter() { grep -v "WARN\|flush.c\|endpoint.cpp\|UCX  ERROR\|UCXX ERROR"; }
for M in ${MPS:-0}; do
  tag=""; if [ "$M" = 1 ]; then mps_on; tag="_mps"; fi
  for R in ${REPLICAS:-4 1 2}; do
    name=bench_${PROFILE:-gpu}_r$R$tag
    timeout ${PER_R_TIMEOUT:-300} python3 -m wb bench --cuda 0 --profile ${PROFILE:-gpu} --replicas $R \
      --out "$OUT/$name" --json 2> >(filter > "$OUT/${name}_log.txt") | filter > "$OUT/${name}.json"
    echo "== $name"; grep "│" "$OUT/${name}_log.txt" | head -14
  done
  if [ "$M" = 1 ]; then mps_off; fi
done
