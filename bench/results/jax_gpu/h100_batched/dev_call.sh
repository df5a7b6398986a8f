# One device call (see COMMAND.md): the four pairings traced, then the JAX GPU tests in what time is left.
source bench/gpu_common.sh
T0=$(date +%s)
B="python3 bench/bench_frameworks.py --cuda --hidden 2048 --layers 2 --experts 16 --steps 4 --modes sync"
PYTHONPATH=$PWD/bench/results/jax_gpu/diag_site:$PYTHONPATH WB_DIAG=$OUT/trace.jsonl timeout ${BENCH_S:-215} $B ${PAIRS:-} > $OUT/frameworks.json 2> $OUT/frameworks.err
python3 -c "
import json
d=json.load(open('$OUT/frameworks.json'))
for p,o in d['pairs'].items(): print(p,o['wall_s'],o.get('ewtt_over_torch'),o['modes']['sync']['ewtt_per_version_s'], o['verified'])
" || tail -5 $OUT/frameworks.err
left=$((${TOTAL_S:-235} - $(date +%s) + T0)); echo "left $left s for tests"
[ $left -gt 55 ] && timeout $left python3 -m pytest -q -x -p no:cacheprovider tests/test_jax_cuda.py 2>&1 | tail -4 > $OUT/tests.txt; cat $OUT/tests.txt 2>/dev/null
