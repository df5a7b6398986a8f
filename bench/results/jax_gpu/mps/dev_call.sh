# One device call (see COMMAND.md): the four pairings under CUDA MPS, traced; then, without MPS,
# the 12-layer BF16 and FP8 update (bench_fp8's update_ratio) on the same card.
source bench/gpu_common.sh
git log --oneline -1 > $OUT/code.txt
mps_on
PYTHONPATH=$PWD/bench/results/jax_gpu/diag_site:$PYTHONPATH WB_DIAG=$OUT/mps_trace.jsonl timeout 280 \
  python3 bench/bench_frameworks.py --cuda --hidden 2048 --layers 2 --experts 16 --steps 4 --modes sync \
  --pairs torch:torch jax:torch torch:jax jax:jax --out $OUT/mps.json 2> $OUT/mps.err
grep -E "torch:|jax:|ewtt_s|verified" $OUT/mps.err | tail -24
mps_off
timeout 170 python3 bench/bench_fp8.py --cuda 0 --hidden 2048 --layers 12 --experts 64 --warmup 1 \
  --repeat 2 --json --out $OUT/fp8_12l.json > $OUT/fp8_12l.out 2> $OUT/fp8_12l.err
tail -c 1500 $OUT/fp8_12l.out
