# The second device call (see COMMAND.md): the four pairings under CUDA MPS (traced), then
# PyTorch -> PyTorch and JAX -> PyTorch under MPS with checksums off (WB_CHECKSUMS=0).
source bench/gpu_common.sh
T0=$(date +%s)
git log --oneline -1 > $OUT/code.txt
B="python3 bench/bench_frameworks.py --cuda --hidden 2048 --layers 2 --experts 16 --steps 4 --modes sync"
show() { python3 -c "
import json
d=json.load(open('$1'))
for p,o in d['pairs'].items(): print(p,o['wall_s'],o.get('ewtt_over_torch'),{m:v['ewtt_s'] for m,v in o['modes'].items()}, o['verified'])
" || tail -5 $2; }
mps_on
PYTHONPATH=$PWD/bench/results/jax_gpu/diag_site:$PYTHONPATH WB_DIAG=$OUT/mps_trace.jsonl timeout 240 $B > $OUT/mps.json 2> $OUT/mps.err
show $OUT/mps.json $OUT/mps.err
left=$((400 - $(date +%s) + T0)); echo "left $left s"
[ $left -gt 60 ] && WB_CHECKSUMS=0 timeout $left $B --pairs torch:torch jax:torch > $OUT/mps_nosums.json 2> $OUT/mps_nosums.err
show $OUT/mps_nosums.json $OUT/mps_nosums.err
mps_off
