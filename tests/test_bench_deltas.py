"""``bench/bench_fp8.py --delta LR`` on the host: the same versions dense and as deltas through
spawned processes over UCX, every rollout checked bit for bit at every version (the bench fails
otherwise); the first version dense in both, the later ones a few percent of the bytes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(400)
def test_bench_fp8_delta_reports_each_version_dense_and_as_deltas(tmp_path):
    out = tmp_path / "deltas.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_fp8.py"), "--hidden", "128",
                        "--layers", "1", "--experts", "2", "--delta", "1e-6", "--versions", "3",
                        "--json", "--out", str(out)], capture_output=True, text=True, timeout=380,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["bit_identical"] and 0.01 < rep["density"] < 0.1, rep
    rows = rep["by_version"]
    assert [x["version"] for x in rows] == [0, 1, 2]
    assert rows[0]["changed"] == 0 and rows[0]["bytes_over_dense"] == 1.0  # nobody holds one
    for x in rows[1:]:
        assert 0.5 * rep["density"] < x["changed"] < 2 * rep["density"], x
        assert x["bytes_over_dense"] < 0.25 and x["dense_bytes"] == rows[0]["dense_bytes"], x
        assert x["delta_ewtt_s"] > 0 and x["dense_ewtt_s"] > 0
