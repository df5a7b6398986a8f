# Call 1. Receives unpacked from the sender's memory (WB_UNPACK_IN_PLACE=1) on a GPU: the GPU
# tests of transfers (the new one included) and JAX, then framework pairings with it, traced
# (PAIRS, default PyTorch -> PyTorch and PyTorch -> JAX), and without it where WITH_OFF is set.
source bench/gpu_common.sh
[ -z "$SKIP_TESTS" ] && timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_transfer_cuda.py \
  tests/test_jax_cuda.py 2>&1 | tail -4 | tee $OUT/tests.txt
FW="python3 bench/bench_frameworks.py --cuda --hidden 2048 --layers 2 --experts 16 --steps ${STEPS:-8} --modes sync"
PYTHONPATH=$PWD/bench/results/jax_gpu/diag_site:$PYTHONPATH WB_DIAG=$OUT/on_trace.jsonl WB_UNPACK_IN_PLACE=1 \
  timeout ${FW_TIMEOUT:-130} $FW --pairs ${PAIRS:-torch:torch torch:jax} --out $OUT/on.json 2> $OUT/on.err
[ -n "$WITH_OFF" ] && WB_UNPACK_IN_PLACE=0 timeout ${FW_TIMEOUT:-100} $FW --pairs ${PAIRS:-torch:torch torch:jax} --out $OUT/off.json 2> $OUT/off.err
python3 - <<'PY'
import json, os
for f in ("on", "off"):
    try:
        d = json.load(open(os.environ["OUT"] + f"/{f}.json"))
    except Exception as e:
        print(f, "missing", e); continue
    for k, v in d["pairs"].items():
        m = v["modes"].get("sync", {})
        print(f, k, v.get("verified"), m.get("ewtt_s"), m.get("ewtt_per_version_s"), v.get("ewtt_over_torch"), v.get("errors"))
PY
