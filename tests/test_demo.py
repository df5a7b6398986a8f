"""The README's main job: `python -m wb demo` runs in both directions and verifies exactly."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")


@pytest.mark.parametrize("args", [[], ["--trainer", "torch", "--rollout", "jax"]])
def test_demo_json_last_line(args):
    out = subprocess.run([sys.executable, "-m", "wb", "demo", "--json", *args],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["verified"] is True
    # TINY in bf16: every rollout node needs the whole model once; M is its size in bytes.
    from wb.presets import TINY, spec_from_config
    nbytes = spec_from_config(TINY).nbytes
    assert report["needed_bytes"] == nbytes
    assert set(report["node_needed_bytes"].values()) == {nbytes}
    assert report["map_entries"] * 20 < report["elements"]
    assert report["weights_bit_identical"] is True and report["traffic_ratio"] == 1.0


def test_demo_check_fails_when_no_bytes_move(monkeypatch):
    import wb
    import wb.demo
    monkeypatch.setattr(wb, "run_local", lambda plan, t, r: r)  # a transfer that moves nothing
    report = wb.demo.run_demo(quiet=True)
    assert report["correspondence_exact"] is True
    assert report["weights_bit_identical"] is False and report["verified"] is False


def test_demo_refuses_bad_arguments():
    out = subprocess.run([sys.executable, "-m", "wb", "demo", "--replicas", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--replicas" in out.stderr
