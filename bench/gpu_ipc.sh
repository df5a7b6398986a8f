#!/usr/bin/env bash
# One call on the H200 device machine: UcxTransport's one-sided channel (WB_IPC=cuda, the default with a CUDA device)
# against UCX tag messages (WB_IPC=off), side by side in one run: its GPU
# tests, then bench/bench_executor.py's transport layers (CUDA messages), then bench/bench_fp8.py
# (BF16 and FP8 rollouts, every buffer bit-identical). Needs the ucxx wheels for Python 3.12 in
# .whl/ (carried; see bench/results/h200_transfer/COMMAND.md); writes its files to $OUT.
#   IPC ("cuda off"), LAYERS (4), REPEAT (2), MPS ("0"), MSG_BYTES (8388608), MSGS (1000),
#   SKIP_TESTS=1, SKIP_MSGS=1, TEST_TIMEOUT, BENCH_TIMEOUT (s, per run).
set -uo pipefail
source bench/gpu_common.sh
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider --override-ini addopts= \
    tests/test_ipc_cuda.py tests/test_transfer_cuda.py ${TESTS:-} 2>&1 | tail -8 | tee "$OUT/ipc_tests.txt"
fi
for M in ${MPS:-0}; do
  tag=""; if [ "$M" = 1 ]; then mps_on; tag="_mps"; fi
  for I in ${IPC:-cuda off}; do
    export WB_IPC=$I
    if [ -z "${SKIP_MSGS:-}" ]; then
      echo "== messages ipc=$I$tag"
      timeout 150 python3 bench/bench_executor.py --cuda 0 --json --repeat 1 \
        --message-bytes ${MSG_BYTES:-8388608} --messages ${MSGS:-1000} \
        --out "$OUT/messages_${I}$tag.json" 2>&1 | tail -1 | cut -c1-1500
    fi
    echo "== fp8 ipc=$I$tag"
    timeout ${BENCH_TIMEOUT:-200} python3 bench/bench_fp8.py --cuda 0 --hidden 2048 --layers ${LAYERS:-4} \
      --experts 64 --repeat ${REPEAT:-2} --warmup 1 ${FP8_ARGS:-} --out "$OUT/fp8_${LAYERS:-4}l_${I}$tag.json" 2>&1 | tail -12
  done
  unset WB_IPC
  if [ "$M" = 1 ]; then mps_off; fi
done
