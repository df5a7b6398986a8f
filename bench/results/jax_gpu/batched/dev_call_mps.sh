# The second device call (see COMMAND.md): the four pairings under CUDA MPS (traced), then,
# with the time left, PyTorch -> PyTorch and JAX -> JAX without MPS (the first call ran out
# of time before JAX -> JAX).
source bench/gpu_common.sh
T0=$(date +%s)
git log --oneline -1 > $OUT/code.txt
B="python3 bench/bench_frameworks.py --cuda --hidden 2048 --layers 2 --experts 16 --steps 4 --modes sync"
show() { python3 -c "
import json
d=json.load(open('$1'))
for p,o in d['pairs'].items(): print(p,o['wall_s'],o.get('ewtt_over_torch'),{m:v['ewtt_s'] for m,v in o['modes'].items()}, o['verified'])
" || tail -12 $2; }
mps_on
PYTHONPATH=$PWD/bench/results/jax_gpu/diag_site:$PYTHONPATH WB_DIAG=$OUT/mps_trace.jsonl timeout 220 $B > $OUT/mps.json 2> $OUT/mps.err
show $OUT/mps.json $OUT/mps.err
mps_off
left=$((320 - $(date +%s) + T0)); echo "left $left s"
[ $left -gt 60 ] && timeout $left $B --pairs torch:torch jax:jax > $OUT/no_mps_jaxjax.json 2> $OUT/no_mps_jaxjax.err
show $OUT/no_mps_jaxjax.json $OUT/no_mps_jaxjax.err
