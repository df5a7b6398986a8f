#!/usr/bin/env bash
# One call on the 2-GPU device machine (nvidia-h200-x2): (1) the GPU profile with the processes
# spread over both GPUs (emulated links, half the processes per GPU of the one-GPU run); (2) real
# links: trainers on GPU 0, rollouts on GPU 1, so every trainer byte crosses NVLink (UCX cuda_ipc),
# with NVLink measured by concurrent probes in the same run. Needs .whl/ (carried); writes to $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD UCX_WARN_UNUSED_ENV_VARS=n PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/device.txt"; nvidia-smi topo -m >> "$OUT/device.txt" 2>&1
filter() { grep -v "WARN\|flush.c\|endpoint.cpp\|UCX  ERROR\|UCXX ERROR"; }
run() {  # name timeout args...
  local name=$1 t=$2; shift 2
  timeout $t python3 -m wb bench --cuda 0 "$@" --out "$OUT/$name" --json \
    2> >(filter > "$OUT/${name}_log.txt") | filter > "$OUT/${name}.json"
  echo "== $name"; grep "│" "$OUT/${name}_log.txt" | head -12
}
run spread_r4 ${T1:-230} --profile gpu --devices spread --replicas 4
run nvlink ${T2:-300} --profile gpu-nvlink --devices role --links real --replicas ${NVL_REPLICAS:-1 2 4}
