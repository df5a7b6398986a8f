#!/usr/bin/env bash
# One call on the H200 device machine: bench/bench_fp8.py with this tree's `wb` (A) and with
# another version's (B), alternating A B A B on the one machine, so that a difference between
# two commits is told apart from a difference between machines. B is a copy of the other
# commit's package made here before the call, e.g.
#   mkdir -p S/b && git archive REV wb | tar -x -C S/b      # then carry [".whl", "S"]
# Needs the ucxx wheels for Python 3.12 in .whl/ (see bench/results/h200_transfer/COMMAND.md).
# Writes $OUT/all.tgz ({A,B}{1..ROUNDS}.json) and prints each run's ratios.
#   B_DIR (S/b), LAYERS (12), ROUNDS (2), REPEAT (1), IPC (cuda), ARGS (more bench_fp8 flags).
set -uo pipefail
source bench/gpu_common.sh
B_DIR=${B_DIR:-S/b}
[ -d "$B_DIR/wb" ] || { echo "no package in $B_DIR/wb"; exit 1; }
for i in $(seq ${ROUNDS:-2}); do
  for side in A B; do
    pp=/tmp/site:$PWD
    [ $side = B ] && pp=/tmp/site:$PWD/$B_DIR:$PWD
    echo "== $side$i"
    PYTHONPATH=$pp WB_IPC=${IPC:-cuda} timeout ${BENCH_TIMEOUT:-240} python3 bench/bench_fp8.py \
      --cuda 0 --hidden 2048 --layers ${LAYERS:-12} --experts 64 --warmup 1 \
      --repeat ${REPEAT:-1} ${ARGS:-} --out "$OUT/$side$i.json" 2>&1 | grep -E "ratio|ewtt" | tail -4
  done
done
cd "$OUT" && tar czf all.tgz ./*.json && rm -f ./*.json
