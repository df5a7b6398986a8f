# One device call (see COMMAND.md): the GPU tests first (the batched packs had never run on a
# GPU), then the four pairings traced, then the 12-layer BF16 update.
source bench/gpu_common.sh
T0=$(date +%s)
git log --oneline -1 > $OUT/code.txt
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_jax_cuda.py tests/test_transfer_cuda.py \
  tests/test_ipc_cuda.py tests/test_fp8_cuda.py tests/test_casts_cuda.py 2>&1 | tail -15 > $OUT/tests.txt
cat $OUT/tests.txt
B="python3 bench/bench_frameworks.py --cuda --hidden 2048 --layers 2 --experts 16 --steps 4 --modes sync"
left=$((570 - $(date +%s) + T0)); echo "left $left s"
PYTHONPATH=$PWD/bench/results/jax_gpu/diag_site:$PYTHONPATH WB_DIAG=$OUT/c_trace.jsonl timeout $((left > 200 ? 200 : left)) $B > $OUT/c.json 2> $OUT/c.err
python3 -c "
import json
d=json.load(open('$OUT/c.json'))
for p,o in d['pairs'].items(): print(p,o['wall_s'],o.get('ewtt_over_torch'),{m:v['ewtt_s'] for m,v in o['modes'].items()}, o['verified'])
" || tail -20 $OUT/c.err
left=$((570 - $(date +%s) + T0)); echo "left $left s"
[ $left -gt 60 ] && timeout $left python3 bench/bench_fp8.py --cuda 0 --hidden 2048 --layers 12 --experts 64 --warmup 1 --repeat 2 --only bf16 --out $OUT/fp8_12l_bf16.json 2>&1 | grep -E "ratio|ewtt|ideal" | tail -5
