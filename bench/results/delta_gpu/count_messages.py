"""Messages per rank of the delta bench's plans (``bench/bench_fp8.py --delta``'s model), with the
ranges of 1 MiB and more each in a message of its own (the delta plan of before) and with every
range below the 128 MiB pieces packed (``agree_parts(..., delta=True)``'s): a rank's sends and
receives an update, from the plans alone (no device).

    python bench/results/delta_gpu/count_messages.py [layers]
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/
import wb  # noqa: E402
from bench_transfer import build, model  # noqa: E402
from wb.algorithms.planner import DELTA_CHUNK_BYTES, DELTA_PACK_BELOW, SMALL_RUN_BYTES  # noqa: E402

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 12
trainers, rollouts = build(model(2048, layers, 64), 2, "tp2")
for name, pack in (("ranges of 1 MiB and more apart", SMALL_RUN_BYTES),
                   ("every range below the pieces packed", DELTA_PACK_BELOW)):
    p = wb.plan(trainers, rollouts, chunk_bytes=DELTA_CHUNK_BYTES, pack_below=pack)
    M = p.messages
    per = {r: int(((M.dst_rank == r) | (M.src_rank == r)).sum()) for r in p.ranks}
    roll = [per[lay.worker.rank] for lay in p.rollouts]
    tr = [per[lay.worker.rank] for lay in p.trainers]
    print(f"{name}: {M.stage.size} messages (by stage {np.bincount(M.stage)[1:].tolist()}); "
          f"a rollout rank's {min(roll)}-{max(roll)}, a trainer's {min(tr)}-{max(tr)}")
