"""The examples that need packages the project's own venv does not install (transformers)."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def test_a_hugging_face_model_probed_through_from_pretrained_receives_bit_identical():
    import hf_transformers_rollout

    assert hf_transformers_rollout.main() is True
