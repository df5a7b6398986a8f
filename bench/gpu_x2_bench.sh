#!/usr/bin/env bash
# One call on the 2-GPU device machine (nvidia-h200-x2). Needs .whl/ (carried); writes to $OUT.
# (1) the demo with PyTorch processes on the GPUs (`--cuda`: local rank r on GPU r mod 2, so its
#     stage 3 crosses NVLink): torch -> torch, then JAX (CPU) -> torch (GPUs);
# (2) real links (`--devices role --links real`): trainers on GPU 0, rollouts on GPU 1, every
#     trainer byte crosses NVLink by UCX cuda_ipc, NVLink measured by concurrent probes in the same
#     run; PROFILE (default gpu-nvlink-large, 11.1 GB) and NVL_REPLICAS (default 1 2 4);
# MPS=1: everything under the CUDA MPS daemon; SKIP_DEMO=1, SKIP_NVLINK=1, SKIP_WARMUP=1 skip parts;
# NVL_MODES: AGST modes of (2) (default all four; none: EWTT only, for the 11.1 GB profile);
# TRACE=1: (2) also writes every rank's per-message times (trace_rR.json); NVL_ARGS: more
# arguments for (2), e.g. --polling off.
# (3) SPREAD=1: the emulated-links GPU profile with processes spread over both GPUs.
# NVLink multicast stays off (UCX's cuda_ipc uses plain peer copies).
set -uo pipefail
source bench/gpu_common.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cpu  # the demo's JAX side runs on CPU
nvidia-smi topo -m >> "$OUT/device.txt" 2>&1
filter() { grep -v "WARN\|flush.c\|endpoint.cpp\|UCX  ERROR\|UCXX ERROR"; }
if [ -n "${MPS:-}" ]; then mps_on; fi
# warm CuPy's kernel cache in a small run first, so that the timed runs' processes do not all
# compile the same kernels at once on a fresh machine
if [ -z "${SKIP_WARMUP:-}" ]; then  # SKIP_WARMUP=1: the machine already ran it (a warm call)
  timeout 120 python3 -m wb bench --quick --cuda 0 --replicas 1 --modes --json 2>/dev/null | tail -c 200
  echo "== warm-up done"
fi
if [ -z "${SKIP_DEMO:-}" ]; then
  for dir in "torch torch" "jax torch"; do
    set -- $dir
    timeout ${TD:-240} python3 -m wb demo --cuda --trainer $1 --rollout $2 --json \
      2> >(filter > "$OUT/demo_cuda_$1_$2_log.txt") | filter > "$OUT/demo_cuda_$1_$2.json"
    echo "== demo --cuda $1 -> $2: rc=$?"; grep "│\|Staging" "$OUT/demo_cuda_$1_$2_log.txt" | tail -8
  done
fi
run() {  # name timeout args...
  local name=$1 t=$2; shift 2
  timeout $t python3 -m wb bench --cuda 0 "$@" --out "$OUT/$name" --json \
    2> >(filter > "$OUT/${name}_log.txt") | filter > "$OUT/${name}.json"
  echo "== $name"; grep "│" "$OUT/${name}_log.txt" | head -12
}
modes=(); if [ "${NVL_MODES:-}" = none ]; then modes=(--modes); elif [ -n "${NVL_MODES:-}" ]; then modes=(--modes $NVL_MODES); fi
[ -z "${SKIP_NVLINK:-}" ] && run nvlink ${T2:-420} --profile ${PROFILE:-gpu-nvlink-large} --devices role --links real --replicas ${NVL_REPLICAS:-1 2 4} "${modes[@]}" ${TRACE:+--trace} ${NVL_ARGS:-}
if [ -n "${SPREAD:-}" ]; then run spread_r4 ${T1:-230} --profile gpu --devices spread --replicas 4; fi
