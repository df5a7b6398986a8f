# The second device call (see COMMAND.md): the four pairings under CUDA MPS, traced.
source bench/gpu_common.sh
git log --oneline -1 > $OUT/code.txt
mps_on
PYTHONPATH=$PWD/bench/results/jax_gpu/diag_site:$PYTHONPATH WB_DIAG=$OUT/mps_trace.jsonl timeout 300 \
  python3 bench/bench_frameworks.py --cuda --hidden 2048 --layers 2 --experts 16 --steps 4 --modes sync \
  --pairs torch:torch jax:torch torch:jax jax:jax > $OUT/mps.json 2> $OUT/mps.err
grep -E "torch:|jax:|ewtt_s|verified" $OUT/mps.err | tail -20
mps_off
