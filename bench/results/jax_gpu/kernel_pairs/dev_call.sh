# The faster pack/unpack kernel's check on a GPU (needs old_gather.py beside it: main's
# wb/runtime/engine/gather.py, untracked): its speed against the old one's (bench_gather.py), the
# JAX and transfer GPU tests, then three pairings without MPS, traced.
source bench/gpu_common.sh
timeout 40 python3 bench/bench_gather.py --json > $OUT/gather_new.txt 2>&1; head -12 $OUT/gather_new.txt
timeout 40 python3 bench/bench_gather.py --kernel-from old_gather.py --json > $OUT/gather_old.txt 2>&1; head -12 $OUT/gather_old.txt
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_jax_cuda.py tests/test_transfer_cuda.py 2>&1 | tail -3 | tee $OUT/tests3.txt
PYTHONPATH=$PWD/bench/results/jax_gpu/diag_site:$PYTHONPATH WB_DIAG=$OUT/k_trace.jsonl timeout 170 \
  python3 bench/bench_frameworks.py --cuda --hidden 2048 --layers 2 --experts 16 --steps 4 --modes sync \
  --pairs torch:torch torch:jax jax:torch --out $OUT/k.json 2> $OUT/k.err
grep -E "torch:|jax:|verified" $OUT/k.err | tail -8
