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


@pytest.mark.parametrize("density", [1.0, 0.05])
def test_versions_written_in_place_are_the_versions_a_brute_force_hash_makes(density,
                                                                              monkeypatch):
    """The benchmarks' versions, a chunk at a time into the buffers, against each element hashed
    on its own (chunks smaller than the buffers, so the chunking is crossed)."""
    import numpy as np

    from wb.cli.bench import weights as w
    monkeypatch.setattr(w, "_CHUNK", 1000)
    rng = np.random.default_rng(0)
    base = {"a": rng.integers(0, 2**16, 5000, dtype=np.uint16).reshape(50, 100),
            "b": rng.integers(0, 255, 333, dtype=np.uint8)}
    mapped = {"a": rng.random((50, 100)) < 0.9, "b": rng.random(333) < 0.5}
    bufs = {k: a.copy() for k, a in base.items()}
    for v in range(4):
        want = {}
        for k, a in base.items():
            u, steps = a.reshape(-1).astype(np.uint64), np.zeros(a.size, np.uint64)
            for step in range(1, v + 1):
                h = [(int(x) * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9) % (1 << 64)
                     for x in u]
                steps += np.array([density >= 1 or (x >> 40) & ((1 << 20) - 1)
                                   < int(density * (1 << 20)) for x in h], np.uint64)
            want[k] = (u + steps * mapped[k].reshape(-1)).astype(a.dtype).reshape(a.shape)
        made = w.version_bits(base, v, mapped, density=density)
        assert all(np.array_equal(made[k], want[k]) for k in base)
        before = {k: a.copy() for k, a in bufs.items()}
        n = w.version_into(bufs, base, v, mapped, density=density)
        assert all(np.array_equal(bufs[k], want[k]) for k in base)
        assert n == sum(int((before[k] != want[k]).sum()) for k in base)
        assert w.version_matches(bufs, base, v, mapped, density=density)
        bufs["a"][3, 7] ^= 1
        assert not w.version_matches(bufs, base, v, mapped, density=density)
        bufs["a"][3, 7] ^= 1
    with pytest.raises(ValueError, match="contiguous"):
        w.version_into({"a": bufs["a"][:, ::2], "b": bufs["b"]}, base, 1, mapped)
