#!/usr/bin/env bash
# Early cross-GPU data on nvidia-h200-x2 (groundwork for the multi-GPU issue): trainer processes
# on GPU 0, rollout processes on GPU 1, so every byte crosses NVLink through UCX CUDA IPC.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 etc. are the machine's defaults; nothing here
# uses multicast).
set -uo pipefail
source bench/gpu_common.sh
nvidia-smi topo -m | tee "$OUT/topo.txt"
for shape in single tp2; do
  python3 bench/bench_transfer.py --cuda-split --shape $shape --hidden 2048 --layers 8 --experts 64 \
    --repeat 3 --chunk-mb 64 --json --out "$OUT/h200x2_${shape}_64mb.json" 2>/dev/null | tail -1 |
    python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print({k: (round(v,4) if isinstance(v,float) else v) for k,v in r.items() if k not in ('runs','time')})"
done
