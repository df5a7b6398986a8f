#!/usr/bin/env bash
# One call on the H200 device machine (see README "Benchmarks"): the GPU correctness test, then the
# executor benchmark with several processes sharing the GPU through UCX CUDA IPC. Needs the ucxx
# wheels for Python 3.12 in .whl/ (carried); writes JSON results to $OUT.
set -uo pipefail
source bench/gpu_common.sh
python3 -c "import ucxx, cupy, numpy; print('ucxx', ucxx.__version__, 'cupy', cupy.__version__, 'numpy', numpy.__version__)"
python3 -m pytest -q -p no:cacheprovider --override-ini addopts= tests/test_transfer_cuda.py 2>&1 | tail -3 | tee "$OUT/gpu_test.txt"
for chunk in ${CHUNKS:-8 64}; do
  for shape in single tp2; do
    python3 bench/bench_transfer.py --cuda 0 --shape $shape --hidden 2048 --layers 8 --experts 64 \
      --repeat 3 --chunk-mb $chunk --json --out "$OUT/h200_${shape}_${chunk}mb.json" 2>/dev/null | tail -1 |
      python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print({k: (round(v,4) if isinstance(v,float) else v) for k,v in r.items() if k not in ('ewtt_runs_s','time')})"
  done
done
