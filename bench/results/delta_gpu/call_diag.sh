# Needs the ucxx wheels and crc32c's for Python 3.12 in .whl/ (carried).
# Where a delta update's time goes on a GPU: bench_fp8 --delta with the diagnostics site
# (diag_site/: per process, the time in each step of the update), then (WITH_CALL2=1) #36's
# call 2 on the same machine; WITH_MPS=1: the delta run again under MPS (the message cost with CUDA buffers, the 12-layer BF16 and FP8 update).
source bench/gpu_common.sh
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
[ -z "$LAYERS" ] && { [ "${MEM:-0}" -gt 100000 ] && LAYERS=12 || LAYERS=4; }
echo "layers $LAYERS (GPU memory $MEM MiB)" | tee -a $OUT/device.txt
delta_run() {  # $1: a name for the files
PYTHONPATH=$PWD/bench/results/delta_gpu/diag_site:$PYTHONPATH WB_DIAG=$OUT/diag_$1.jsonl \
  timeout ${FP8_TIMEOUT:-200} python3 bench/bench_fp8.py --cuda 0 --hidden 2048 --layers $LAYERS \
  --experts 64 --delta 1e-6 --versions ${VERSIONS:-4} --json --out $OUT/fp8_delta_$1.json \
  > $OUT/fp8_delta_$1.out 2> $OUT/fp8_delta_$1.err
NAME=$1 python3 - <<'PY'
import json, os
o, n = os.environ["OUT"], os.environ["NAME"]
d = json.load(open(f"{o}/fp8_delta_{n}.json"))
for r in d["by_version"]:
    print(n, r["version"], round(r["dense_ewtt_s"], 4), round(r["delta_ewtt_s"], 4), round(r["ewtt_over_dense"], 2))
for line in open(f"{o}/diag_{n}.jsonl"):
    x = json.loads(line)
    if not any(k.startswith("deltas.") for k in x["t"]):
        continue
    t = sorted(x["t"].items(), key=lambda kv: -kv[1][1])
    print(x["pid"], " ".join(f"{k}={v[0]}/{v[1]}/{v[2]}" for k, v in t[:12]))
PY
grep -iE "error|Traceback" $OUT/fp8_delta_$1.err | tail -5
}
delta_run timesliced
[ -n "$WITH_MPS" ] && { mps_on; delta_run mps; mps_off; }
if [ -n "$WITH_CALL2" ]; then
  timeout 100 python3 bench/bench_executor.py --cuda 0 --json --out $OUT/executor.json 2>&1 | tail -6
  timeout ${FP8_12_TIMEOUT:-280} python3 bench/bench_fp8.py --cuda 0 --hidden 2048 --layers 12 --experts 64 \
    --repeat 2 --warmup 1 --json --out $OUT/fp8_12l.json > $OUT/fp8_12l.out 2> $OUT/fp8_12l.err
  tail -c 1200 $OUT/fp8_12l.out; grep -iE "error|Traceback" $OUT/fp8_12l.err | tail -5
fi
