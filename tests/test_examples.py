"""The examples under examples/ run as scripts and check their own results."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]


def test_notebook_session_example(tmp_path):
    png = tmp_path / "links.png"
    env = dict(os.environ, WB_EXAMPLE_PLOT=str(png))
    env.pop("XLA_FLAGS", None)  # the example asks JAX for its own devices
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "notebook_session.py")],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "every rollout parameter bit-identical: True" in out.stdout
    assert "= lower bound" in out.stdout
    assert png.stat().st_size > 1000
