# The batched unpacks' check on a GPU: the JAX and transfer GPU tests, the pack/unpack kernel's
# speed (bench_gather.py), then PyTorch -> PyTorch
# and PyTorch -> JAX without MPS (what they changed), traced.
source bench/gpu_common.sh
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_jax_cuda.py tests/test_transfer_cuda.py 2>&1 | tail -3 | tee $OUT/tests2.txt
timeout 60 python3 bench/bench_gather.py --json > $OUT/gather.txt 2>&1; cat $OUT/gather.txt | head -12
PYTHONPATH=$PWD/bench/results/jax_gpu/diag_site:$PYTHONPATH WB_DIAG=$OUT/unpacks_trace.jsonl timeout 110 \
  python3 bench/bench_frameworks.py --cuda --hidden 2048 --layers 2 --experts 16 --steps 4 --modes sync \
  --pairs torch:torch torch:jax --out $OUT/unpacks.json 2> $OUT/unpacks.err
grep -E "torch:|jax:|verified" $OUT/unpacks.err | tail -8
