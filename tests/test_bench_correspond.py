"""The correspondence benchmark's structure: the same blocks give the same cells at any scale.

(Times are not asserted here; `bench/bench_correspond.py` prints them as ratios.)
"""

import importlib.util
import pathlib

import numpy as np

from wb.data.correspondence import correspond

_path = pathlib.Path(__file__).parent.parent / "bench" / "bench_correspond.py"
_spec = importlib.util.spec_from_file_location("bench_correspond", _path)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_cells_do_not_grow_with_elements():
    rows = bench.run(n_tensors=4, repeat=1, scales=(1, 100, 1_000_000))
    assert rows[2]["elements"] == 1_000_000 * rows[0]["elements"]
    assert len({(r["blocks"], r["cells"], r["overlaps"]) for r in rows}) == 1


def test_bench_layouts_are_correct_at_small_scale():
    from wb.testing import correspondence_pairs, overlap_pairs
    trainers, rollouts, numel = bench.layouts(4, 1, t_tp=2, t_dp=1, r_tp=2, r_dp=2)
    corr = correspond(trainers, rollouts)
    assert overlap_pairs(corr) == correspondence_pairs(trainers, rollouts)
    assert int(np.sum(corr.cell_numel)) == numel
