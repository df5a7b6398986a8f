#!/usr/bin/env bash
# One call on the H200 device machine: bench/bench_copies.py (how fast the GPU copies pieces by
# each way a one-sided receiver could: memcpy per piece, batched, one kernel per batch; alone and
# in pairs of processes through CUDA IPC, without and under MPS), then the BF16 update of
# bench/bench_fp8.py with checksums off and on, traced. Needs the ucxx wheels in .whl/ (see
# bench/results/h200_transfer/COMMAND.md); writes $OUT/all.tgz.
#   LAYERS (12), PIECES ("4 0.5"), BENCH_TIMEOUT (200 s), SKIP_FP8=1.
set -uo pipefail
source bench/gpu_common.sh
for mb in ${PIECES:-4 0.5}; do
  echo "== copies ${mb} MiB"
  timeout 300 python3 bench/bench_copies.py --piece-mb $mb --total-gb 2 --pairs 4 --json \
    | tee "$OUT/copies_${mb}mb.json"
done
mps_on
echo "== copies 4 MiB under MPS"
timeout 300 python3 bench/bench_copies.py --piece-mb 4 --total-gb 2 --pairs 4 --json \
  | tee "$OUT/copies_4mb_mps.json"
mps_off
if [ -z "${SKIP_FP8:-}" ]; then
  for C in off on; do
    echo "== bf16 checksums $C"
    timeout ${BENCH_TIMEOUT:-200} python3 bench/bench_fp8.py --cuda 0 --hidden 2048 \
      --layers ${LAYERS:-12} --experts 64 --repeat 1 --warmup 1 --only bf16 --checksums $C \
      --trace "$OUT/trace_$C" --out "$OUT/bf16_$C.json" 2>&1 | tail -3
    python3 bench/trace_summary.py "$OUT"/trace_$C/bf16/trace_0.json > "$OUT/bf16_${C}_trace_summary.txt" 2>&1
    cat "$OUT/bf16_${C}_trace_summary.txt" | tail -6
    gzip -f "$OUT"/trace_$C/bf16/*.json 2>/dev/null
  done
fi
cd "$OUT" && tar czf all.tgz ./*.txt ./*.json trace_* 2>/dev/null && rm -rf ./*.json trace_* ./*_summary.txt
