#!/usr/bin/env bash
# One call on the H200 device machine: the checksum GPU tests, then the BF16 update of
# bench/bench_fp8.py at 9.5 GB with checksums off, then on (--checksums compare), side by side.
# Needs the ucxx and crc32c wheels for Python 3.12 in .whl/ (carried; see
# bench/results/checksums/COMMAND.md); writes its files to $OUT.
#   LAYERS (default 12), REPEAT (2), MPS="0 1" (default 0), SKIP_TESTS=1, BENCH_TIMEOUT (s),
#   TRACE=1: per-message traces of each run too ($OUT/trace<mps>/bf16_{off,on}/trace_<run>.json),
#   HASHED="1 0 1024:1024": one run per value of WB_COPY_HASHED (1: receives copied and hashed
#   in one pass; stretch:threads: the same, the kernel shaped so; 0: copied, then hashed;
#   default "1 0"), TEST_TIMEOUT (s).
set -uo pipefail
source bench/gpu_common.sh
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider --override-ini addopts= \
    tests/test_checksums_cuda.py tests/test_transfer_cuda.py tests/test_crc.py 2>&1 | tail -6 \
    | tee "$OUT/checksum_tests.txt"
fi
timeout 120 python3 bench/bench_crc.py --json > "$OUT/crc_kernel.json" 2>&1; cat "$OUT/crc_kernel.json"
for M in ${MPS:-0}; do
  tag=""; if [ "$M" = 1 ]; then mps_on; tag="_mps"; fi
  for H in ${HASHED:-1 0}; do
    name=checksums_${LAYERS:-12}l${tag}_copyhashed${H//:/x}
    echo "== $name"
    WB_COPY_HASHED=$H timeout ${BENCH_TIMEOUT:-400} python3 bench/bench_fp8.py --cuda 0 --hidden 2048 \
      --layers ${LAYERS:-12} --experts 64 --repeat ${REPEAT:-2} --warmup 1 --checksums compare \
      --out "$OUT/$name.json" ${TRACE:+--trace "$OUT/trace$tag"} 2>&1 \
      | grep -v "WbWarning\|transport = UcxTransport" | tail -6
  done
  if [ "$M" = 1 ]; then mps_off; fi
done
