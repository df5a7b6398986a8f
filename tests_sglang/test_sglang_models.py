"""wb_torch.probe on SGLang 0.5.23's own model classes (CPU, TP over gloo, one process per rank):
every map equal to a per-element oracle written from SGLang's layout rules and exact against
SGLang's own ``load_weights`` of a random checkpoint, the ranks together
holding every checkpoint element, and a second start reading its maps from the cache."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sglang")

HARNESS = Path(__file__).resolve().parent / "harness.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(model: str, tp: int, out: Path, cache: Path | None = None) -> list[dict]:
    """The TP ranks of ``model``, one process each; their reports."""
    port = _port()
    procs = [subprocess.Popen([sys.executable, str(HARNESS), model, str(tp), str(r), str(port),
                               str(out / f"r{r}.json"), *([str(cache / f"r{r}")] if cache else [])],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(tp)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return [json.loads((out / f"r{r}.json").read_text()) for r in range(tp)]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model", ["llama", "qwen3", "qwen3-moe"])
def test_probe_is_exact_against_sglangs_own_loader(model, tp, tmp_path):
    reps = _run(model, tp, tmp_path)
    for rep in reps:
        # every state entry of the rank has a map, every element of it a checkpoint id, and
        # each holds after SGLang's own load of a random checkpoint the element its map names
        assert rep["unmapped_entries"] == [] and rep["mapped_entries"] == rep["entries"]
        assert rep["held_elements"] == rep["elements"] and rep["bad"] == []
        assert rep["oracle_bad"] == []  # each map is the per-element oracle's ids, exactly
    ids = [np.load(tmp_path / f"r{r}.ids.npy") for r in range(tp)]
    n = reps[0]["checkpoint_elements"]
    # the ranks together hold the whole checkpoint; with TP=2 each holds a part of it
    assert np.array_equal(np.unique(np.concatenate(ids)), np.arange(n))
    if tp == 2:
        assert all(len(x) < n for x in ids)


def test_a_second_start_reads_its_maps_from_the_cache(tmp_path):
    cache, a, b = tmp_path / "cache", tmp_path / "a", tmp_path / "b"
    for d in (cache, a, b):
        d.mkdir()
    first = _run("qwen3-moe", 2, a, cache)
    stamp = {f: f.stat().st_mtime_ns for f in cache.iterdir()}
    assert len(stamp) == 2  # a cache per rank, written by the first start
    second = _run("qwen3-moe", 2, b, cache)
    assert {f: f.stat().st_mtime_ns for f in cache.iterdir()} == stamp  # read, not written
    for x, y in zip(first, second):
        assert y["bad"] == [] and y["held_elements"] == x["held_elements"]
        assert y["probe_s"] < 1.0
