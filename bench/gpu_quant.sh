#!/usr/bin/env bash
# One call on the H200 device machine: the FP8 quantiser and one-sided GPU tests, the quantiser
# alone against a device copy (bench/bench_quant.py), then bench/bench_fp8.py at LAYERS_SMALL
# layers with checksums off and on and one traced BF16 run (summarised by bench/trace_summary.py),
# and at LAYERS layers BF16 and FP8 side by side. Needs the ucxx wheels for Python 3.12 in .whl/
# (see bench/results/h200_transfer/COMMAND.md). The device returns few files: everything goes
# into $OUT/all.tgz.
#   LAYERS (12), LAYERS_SMALL (4), REPEAT (2), IPC (cuda), SKIP_TESTS=1.
set -uo pipefail
source bench/gpu_common.sh
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 170 python3 -m pytest -q -p no:cacheprovider --override-ini addopts= \
    tests/test_fp8_cuda.py tests/test_checksums_cuda.py tests/test_ipc_cuda.py 2>&1 \
    | tail -5 | cut -c1-3000 | tee "$OUT/tests.txt"
fi
timeout 100 python3 bench/bench_quant.py --out "$OUT/quant.json" 2>&1 | tail -3
F="--cuda 0 --hidden 2048 --experts 64 --warmup 1"
S=${LAYERS_SMALL:-4}
echo "== $S layers, checksums off and on"
WB_IPC=${IPC:-cuda} timeout 100 python3 bench/bench_fp8.py $F --layers $S --repeat ${REPEAT:-2} \
  --checksums compare --out "$OUT/checksums_${S}l.json" 2>&1 | tail -1
echo "== $S layers, BF16 traced"
WB_IPC=${IPC:-cuda} timeout 90 python3 bench/bench_fp8.py $F --layers $S --repeat 1 --only bf16 \
  --trace "$OUT/trace" --out "$OUT/bf16_${S}l_traced.json" 2>&1 | tail -1
python3 bench/trace_summary.py "$OUT"/trace/bf16/trace_0.json > "$OUT/bf16_${S}l_trace_summary.txt" 2>&1
gzip -f "$OUT"/trace/bf16/*.json
echo "== ${LAYERS:-12} layers, BF16 and FP8"
WB_IPC=${IPC:-cuda} timeout 280 python3 bench/bench_fp8.py $F --layers ${LAYERS:-12} \
  --repeat ${REPEAT:-2} --out "$OUT/fp8_${LAYERS:-12}l.json" 2>&1 | grep -v -i warn | tail -9
cd "$OUT" && tar czf all.tgz ./*.json ./*.txt trace && rm -rf ./*.json trace
