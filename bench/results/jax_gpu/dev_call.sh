source bench/gpu_common.sh
T0=$(date +%s)
git log --oneline -1 > $OUT/code.txt; git diff --stat >> $OUT/code.txt
export PYTHONPATH=$PWD/bench/results/jax_gpu/diag_site:$PYTHONPATH
B="python3 bench/bench_frameworks.py --cuda --hidden 2048 --layers 2 --experts 16 --steps 4 --modes sync"
WB_DIAG=$OUT/c_trace.jsonl timeout 230 $B > $OUT/c.json 2> $OUT/c.err
WB_STAGING_BYTES=$((4<<30)) timeout 230 $B > $OUT/d.json 2> $OUT/d.err
WB_FLUSH_ROWS=8 WB_DIAG=$OUT/e_trace.jsonl timeout 60 $B --pairs torch:torch > $OUT/e.json 2> $OUT/e.err
left=$((570 - $(date +%s) + T0)); echo "left $left s for tests"
[ $left -gt 40 ] && timeout $left python3 -m pytest -q -x tests/test_jax_cuda.py 2>&1 | tail -4 > $OUT/tests.txt; cat $OUT/tests.txt
for f in c d e; do python3 -c "
import json,sys
d=json.load(open('$OUT/$f.json'))
for p,o in d['pairs'].items(): print('$f',p,o['wall_s'],o.get('ewtt_over_torch'),{m:v['ewtt_s'] for m,v in o['modes'].items()}, o['verified'])
"; done
