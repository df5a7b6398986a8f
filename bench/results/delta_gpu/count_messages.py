"""Messages per rank of the bench model's plans (``bench/bench_fp8.py``'s, ``--hidden 2048
--experts 64``), a rank's sends and receives an update, from the plans alone (no device).

Deltas (default): with the ranges of 1 MiB and more each in a message of its own (the delta plan
of before) and with every range below the 128 MiB pieces packed
(``agree_parts(..., delta=True)``'s).
``--dense``: the dense plan with pieces (and packing) of 8 MiB (``wb.plan``'s pieces; ranges
below 1 MiB packed), 32 MiB and 64 MiB (``bench_fp8.py --chunk-mb N --pack-mb N``).

    python bench/results/delta_gpu/count_messages.py [layers] [--dense]
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/
import wb  # noqa: E402
from bench_transfer import build, model  # noqa: E402
from wb.algorithms.planner import (DEFAULT_CHUNK_BYTES, DELTA_CHUNK_BYTES,  # noqa: E402
                                   DELTA_PACK_BELOW, SMALL_RUN_BYTES)

args = [a for a in sys.argv[1:] if a != "--dense"]
layers = int(args[0]) if args else 12
trainers, rollouts = build(model(2048, layers, 64), 2, "tp2")
cases = ([("8 MiB pieces, ranges below 1 MiB packed", DEFAULT_CHUNK_BYTES, SMALL_RUN_BYTES),
          ("32 MiB pieces, ranges below them packed", 32 << 20, 32 << 20),
          ("64 MiB pieces, ranges below them packed", 64 << 20, 64 << 20)]
         if "--dense" in sys.argv else
         [("ranges of 1 MiB and more apart", DELTA_CHUNK_BYTES, SMALL_RUN_BYTES),
          ("every range below the pieces packed", DELTA_CHUNK_BYTES, DELTA_PACK_BELOW)])
for name, chunk, pack in cases:
    p = wb.plan(trainers, rollouts, chunk_bytes=chunk, pack_below=pack)
    M = p.messages
    per = {r: int(((M.dst_rank == r) | (M.src_rank == r)).sum()) for r in p.ranks}
    roll = [per[lay.worker.rank] for lay in p.rollouts]
    tr = [per[lay.worker.rank] for lay in p.trainers]
    print(f"{name}: {M.stage.size} messages (by stage {np.bincount(M.stage)[1:].tolist()}); "
          f"a rollout rank's {min(roll)}-{max(roll)}, a trainer's {min(tr)}-{max(tr)}")
