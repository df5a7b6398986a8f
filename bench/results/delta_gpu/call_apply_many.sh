# Needs the ucxx wheels and crc32c's for Python 3.12 in .whl/ (carried).
# The delta GPU tests, then bench_fp8 --delta with the diagnostics site at 4 layers (time-sliced
# and under MPS), then 12 layers where the GPU has room (time-sliced, then MPS). Next call (the
# delta job's plan packs every range below its pieces; deltas land where packed units lie; a
# name holding "pack1" runs the delta plan of before, ranges of 1 MiB and more each a message):
#   TEST_TIMEOUT=130 FP8_TIMEOUT=200 VERSIONS=4 RUNS="12:l12_timesliced 12:l12_mps" \
#     bash bench/results/delta_gpu/call_apply_many.sh
# then SKIP_TESTS=1 RUNS="12:l12_pack1_mps 12:l12_prof_mps" bash ..., and
# SKIP_TESTS=1 RUNS=" " GPU_BENCH_REPLICAS="1 4" bash ... (the emulated links)
source bench/gpu_common.sh
# TESTS: a pytest -k expression over them (default: every delta test)
[ -n "$SKIP_TESTS" ] || timeout ${TEST_TIMEOUT:-100} python3 -m pytest -q -x -p no:cacheprovider tests/test_delta_cuda.py \
  tests/test_transfer_cuda.py -k "${TESTS:-delta}" 2>&1 | tail -4 | tee $OUT/tests.txt
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
script() {  # a name holding "pack<N>": the delta run's plan packs ranges below N MiB
  case $1 in *pack*) N=${1##*pack}; echo bench/bench_fp8.py --delta-pack-mb ${N%%_*};;
    *) echo bench/bench_fp8.py;; esac
}
run() {  # $1 layers, $2 name
PYTHONPATH=$PWD/bench/results/delta_gpu/diag_site:$PYTHONPATH WB_DIAG=$OUT/diag_$2.jsonl \
  WB_PROF=$(case $2 in *prof*) echo $OUT/prof_$2;; esac) \
  timeout ${FP8_TIMEOUT:-150} python3 $(script $2) --cuda 0 --hidden 2048 --layers $1 \
  --experts 64 --delta 1e-6 --versions ${VERSIONS:-3} --json --out $OUT/fp8_delta_$2.json \
  > $OUT/fp8_delta_$2.out 2> $OUT/fp8_delta_$2.err
NAME=$2 python3 - <<'PY'
import json, os
o, n = os.environ["OUT"], os.environ["NAME"]
try:
    d = json.load(open(f"{o}/fp8_delta_{n}.json"))
except Exception as e:
    print(n, "no result", e); raise SystemExit
for r in d["by_version"]:
    print(n, r["version"], round(r["dense_ewtt_s"], 4), round(r["delta_ewtt_s"], 4), round(r["ewtt_over_dense"], 2), d["bit_identical"])
for line in open(f"{o}/diag_{n}.jsonl"):  # the delta run's processes: their last update's times
    x = json.loads(line)
    if not any(k.startswith("delta") for k in x["t"]) or not x.get("runs"):
        continue
    last = sorted(x["runs"][-1].items(), key=lambda kv: -kv[1][1])
    print(" ", x["pid"], " ".join(f"{k}={v[0]}/{v[1]}" for k, v in last[:9]))
PY
grep -iE "error|Traceback" $OUT/fp8_delta_$2.err | tail -3
}
# RUNS: "layers:name" pairs; a name ending in _mps runs under MPS (default: 4 layers both ways,
# then 12 where the card has room). SKIP_TESTS=1 skips the GPU tests. A run whose name holds
# "prof" writes a profile of each process's later delta updates (prof_<name>_<pid>.txt).
if [ -z "${RUNS+set}" ]; then
  RUNS="4:l4_timesliced 4:l4_mps"
  [ "${MEM:-0}" -gt 100000 ] && RUNS="$RUNS 12:l12_timesliced 12:l12_mps"
fi
for r in $RUNS; do
  case ${r#*:} in *_mps) mps_on; run ${r%%:*} ${r#*:}; mps_off;; *) run ${r%%:*} ${r#*:};; esac
done
# GPU_BENCH_REPLICAS="1 4": `python -m wb bench --cuda 0 --profile gpu --delta 1e-6` under MPS
# (the emulated links; the issue's <= 0.3x dense), one run per replica count
for R in $GPU_BENCH_REPLICAS; do
  mps_on
  timeout ${BENCH_TIMEOUT:-240} python3 -m wb bench --cuda 0 --profile gpu --replicas $R \
    --delta 1e-6 --json --out $OUT/gpu_bench_delta_r$R > $OUT/gpu_bench_delta_r$R.out \
    2> $OUT/gpu_bench_delta_r$R.err
  mps_off
  tail -c 1500 $OUT/gpu_bench_delta_r$R.out; grep -iE "error|Traceback" $OUT/gpu_bench_delta_r$R.err | tail -3
done
# what comes back is a few files: the runs' files in one archive
(cd $OUT && tar czf runs.tgz --exclude=runs.tgz --exclude=device.txt . && \
  find . -type f ! -name runs.tgz ! -name device.txt -delete)
