"""wb_sglang.receive, called as SGLang calls a custom weight loader, in the TP workers of
SGLang's own model classes (CPU, TP=2 over gloo): every version a trainer pushes (numpy arrays
named as on disk; a PyTorch trainer: SGLang's class at TP=1 through wb_torch.Sender; a JAX
trainer in its own venv, WB_JAX_PYTHON: arrays named like the checkpoint) lands in
the parameters' own storage, bit-identical to SGLang's own load_weights of that version."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang")

HERE = Path(__file__).resolve().parent
PROCS = HERE / "receiver.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


JAX = pytest.mark.skipif(not os.environ.get("WB_JAX_PYTHON"),
                         reason="WB_JAX_PYTHON: an interpreter with JAX and wb (the trainer's venv)")


@pytest.mark.parametrize("model, trainer", [
    ("qwen3", "trainer"), ("qwen3-moe", "trainer"), ("qwen3-moe", "torch-trainer"),
    pytest.param("qwen3-moe", "jax-trainer", marks=JAX)])
def test_versions_land_in_place_bit_identical_to_sglangs_own_load(model, trainer, tmp_path):
    tp, versions = 2, 3
    world, store = 1 + tp, tmp_path / "store"
    store.mkdir()
    port = _port()
    if trainer == "jax-trainer":  # in the trainer's own venv, from the spec written here
        spec = tmp_path / "spec.json"
        subprocess.run([sys.executable, str(PROCS), "spec", model, str(spec)], check=True,
                       capture_output=True, timeout=240)
        cmds = [[os.environ["WB_JAX_PYTHON"], str(PROCS), trainer, str(spec), str(store),
                 str(versions), str(tmp_path / "trainer.json"), str(world)]]
    else:
        cmds = [[sys.executable, str(PROCS), trainer, model, str(store), str(versions),
                 str(tmp_path / "trainer.json"), str(world), str(_port())]]
    cmds += [[sys.executable, str(PROCS), "worker", model, str(tp), str(r), str(port), str(store),
              str(versions), str(tmp_path / f"w{r}.json"), str(world)] for r in range(tp)]
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in cmds]
    logs = [p.communicate(timeout=400)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    assert json.loads((tmp_path / "trainer.json").read_text())["pushed"] == versions
    for r in range(tp):
        rep = json.loads((tmp_path / f"w{r}.json").read_text())
        assert [row["version"] for row in rep["rows"]] == list(range(1, versions + 1))
        for row in rep["rows"]:
            assert row["identical"] == row["params"] > 0 and row["moved"] == []
        assert "asked for version 1, holds 3" in rep["stale"]
        assert "carries no `wb_sglang.version` tensor" in rep["foreign"]


def test_trainers_push_through_the_vllm_trainer_api_to_an_engine_of_tp_workers(tmp_path):
    """``wb_vllm.trainer.Trainer`` with a ``wb_sglang.EngineClient``: its set-up asks the engine
    for version 0 (every TP worker probes and takes its part of the plan while the trainer gets
    its own), each ``send_weights`` runs begin -> update(v) -> end beside the push; the workers
    (SGLang's Qwen3-MoE at TP=2, the loader called by the name the request gives) hold every
    version bit-identical to SGLang's own load, in place."""
    tp, versions, model = 2, 3, "qwen3-moe"
    world, store = 1 + tp, tmp_path / "store"
    store.mkdir()
    port = _port()
    cmds = [[sys.executable, str(PROCS), "api-trainer", model, str(store), str(versions),
             str(tmp_path / "trainer.json"), str(world), str(tp)]]
    cmds += [[sys.executable, str(PROCS), "engine-worker", model, str(tp), str(r), str(port),
              str(store), str(versions), str(tmp_path / f"w{r}.json"), str(world)]
             for r in range(tp)]
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in cmds]
    logs = [p.communicate(timeout=400)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    tr = json.loads((tmp_path / "trainer.json").read_text())
    assert tr["pushed"] == list(range(1, versions + 1))
    want = [["update", 0]] + [c for v in range(1, versions + 1)
                              for c in (["begin"], ["update", v], ["end"])]
    assert tr["calls"] == want
    for r in range(tp):
        rows = json.loads((tmp_path / f"w{r}.json").read_text())["rows"]
        assert [row["version"] for row in rows] == list(range(1, versions + 1))
        for row in rows:
            assert row["identical"] == row["params"] > 0 and row["moved"] == []
