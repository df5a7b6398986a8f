# Call 2 (after call1.sh, on the same warm machine): the cost of a message with CUDA buffers
# through the one-sided channel (bench_executor), then the 12-layer update: BF16, and FP8
# with its quantising inside (update_ratio).
source bench/gpu_common.sh
timeout 150 python3 bench/bench_executor.py --cuda 0 --json --out $OUT/executor.json 2>&1 | tail -12
timeout 380 python3 bench/bench_fp8.py --cuda 0 --hidden 2048 --layers 12 --experts 64 --repeat 2 --warmup 1 \
  --json --out $OUT/fp8_12l.json > $OUT/fp8_12l.out 2> $OUT/fp8_12l.err
tail -c 1500 $OUT/fp8_12l.out; grep -iE "error|Traceback" $OUT/fp8_12l.err | tail -5
