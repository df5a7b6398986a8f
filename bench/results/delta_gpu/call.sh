# Needs the ucxx wheels and crc32c's for Python 3.12 in .whl/ (carried; ../h200_transfer/COMMAND.md, with crc32c==2.9.post0 added).
# Deltas on a GPU, one device call: the device codec's and the delta update's GPU tests, the
# codec against a device copy, then the 12-layer update as versions dense and as deltas
# (bench_fp8 --delta), and (where time is left: GPU_BENCH=1) the emulated links of
# `python -m wb bench --cuda 0 --profile gpu --delta` under MPS.
source bench/gpu_common.sh
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -x -p no:cacheprovider tests/test_delta_cuda.py \
  tests/test_transfer_cuda.py -k "delta" 2>&1 | tail -15 | tee $OUT/tests.txt
timeout 90 python3 bench/bench_delta_device.py --json > $OUT/codec.txt 2>&1; tail -7 $OUT/codec.txt
# 12 layers (9.5 GB) keep ~100 GB on the GPU with the bench's references: 4 on an 80 GB card
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
[ -z "$LAYERS" ] && { [ "${MEM:-0}" -gt 100000 ] && LAYERS=12 || LAYERS=4; }
echo "layers $LAYERS (GPU memory $MEM MiB)" | tee -a $OUT/device.txt
timeout ${FP8_TIMEOUT:-300} python3 bench/bench_fp8.py --cuda 0 --hidden 2048 --layers $LAYERS \
  --experts 64 --delta 1e-6 --versions ${VERSIONS:-3} --json --out $OUT/fp8_delta.json \
  > $OUT/fp8_delta.out 2> $OUT/fp8_delta.err
tail -c 1500 $OUT/fp8_delta.out; grep -iE "error|Traceback" $OUT/fp8_delta.err | tail -5
if [ -n "$GPU_BENCH" ]; then
  mps_on
  timeout ${BENCH_TIMEOUT:-250} python3 -m wb bench --cuda 0 --profile gpu --replicas 4 --delta 1e-6 \
    --json --out $OUT/gpu_bench_delta > $OUT/gpu_bench.out 2> $OUT/gpu_bench.err
  tail -c 1500 $OUT/gpu_bench.out; grep -iE "error|Traceback" $OUT/gpu_bench.err | tail -5
  mps_off
fi
