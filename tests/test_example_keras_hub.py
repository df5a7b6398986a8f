"""``examples/keras_hub_rollout.py``: a KerasHub backbone on JAX, probed through KerasHub's own
Hugging Face converter, receives a trainer's weights bit-identical to ``from_preset`` of them.
Runs where ``keras-hub`` installs (it pulls TensorFlow, so not in this project's CI; the
command: ``pip install keras-hub safetensors 'jax[cpu]'`` in a venv with wb, then this test)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("keras_hub")
pytest.importorskip("safetensors")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_keras_hub_rollout_example(tmp_path):
    env = dict(os.environ, KERAS_BACKEND="jax")
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "keras_hub_rollout.py")],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "36 of 36 variables mapped" in out.stdout
    assert "equal to from_preset of the trainer's weights: True" in out.stdout
