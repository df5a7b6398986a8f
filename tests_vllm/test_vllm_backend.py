"""wb as vLLM's ``weightbridge`` weight-transfer backend, against vLLM's real model classes.

Run in a venv with vLLM (see tests_vllm/README.md): ``python -m pytest tests_vllm``. Skips
without vLLM."""

import json
import multiprocessing as mp
import os
import socket
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ucxx")

import harness  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, trainer: str, kind: str = "qwen3_moe", *, ep: bool = False, tp: int = 2,
         versions: int = 2, cache: str | None = None, post_process: bool = True,
         moe_pwal: str = "flashinfer_cutlass", served: bool = True) -> dict:
    """vLLM workers (spawned here) and a trainer; the JAX trainer runs in the interpreter
    ``WB_JAX_PYTHON`` names (a venv with JAX and wb, without vLLM). ``served``: every update
    must match vLLM's own reload of the checkpoint (else: every update must differ from it)."""
    cfg = harness.write_hf_config(str(tmp_path / "cfg"), kind)
    store, res = tmp_path / "store", tmp_path / "res"
    store.mkdir()
    res.mkdir()
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=harness.vllm_worker,
                         args=(r, tp, port, cfg, str(store), str(res), 1 + 3 * versions, kind,
                               ep, moe_pwal))
             for r in range(tp)]
    args = (str(store), str(res), 1 + tp, tp, versions, kind, cache, post_process)
    jax_proc = None
    if trainer == "torch":
        procs.append(ctx.Process(target=harness.torch_trainer, args=args))
    else:
        here = Path(__file__).resolve().parent
        jax_proc = subprocess.Popen(
            [os.environ["WB_JAX_PYTHON"], "-c",
             f"import harness; harness.jax_trainer{args!r}"],
            cwd=here, env=dict(os.environ, PYTHONPATH=f"{here}:{here.parent}"))
    for p in procs:
        p.start()
    for p in procs:
        p.join(800)
        if p.is_alive():
            p.kill()
    if jax_proc is not None:
        jax_proc.wait(300)
    out = {f.stem: json.loads(f.read_text()) for f in res.glob("*.json")}
    assert set(out) == {f"vllm{r}" for r in range(tp)} | {"trainer0"}, out
    assert all(v["ok"] for v in out.values()), {
        k: (v.get("error"), v.get("trace", "")[-1500:]) for k, v in out.items()}
    for r in range(tp):
        w = out[f"vllm{r}"]
        assert w["model"] == harness.ARCHS[kind] and w["engine"] == "WeightBridgeEngine"
        assert w["generator"] == []  # wb.layouts.vllm_rollout's maps are the real model's
        # vLLM's in-place reload (the oracle) makes of version 0 what its start-up load made
        assert w["reload_is_load"] == []
        # each update is what vLLM's own reload makes of the checkpoint, bit for bit
        assert w["checks"] == [served] * versions, w.get("mismatched")
        assert w["same_storage"] == [True] * versions  # in place: CUDA graphs stay valid
    assert out["trainer0"]["sent"] == list(range(1, versions + 1))
    return out


TRAINERS = ["torch", pytest.param("jax", marks=pytest.mark.skipif(
    not os.environ.get("WB_JAX_PYTHON"),
    reason="WB_JAX_PYTHON: an interpreter with JAX and wb (the trainer's venv)"))]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("kind, ep", [("qwen3_moe", False), ("qwen3_moe", True),
                                      ("deepseek_v3", False), ("deepseek_v3", True)])
def test_trainers_feed_real_vllm_models_through_the_backend(tmp_path, trainer, kind, ep):
    _run(tmp_path / "run", trainer, kind, ep=ep)


@pytest.mark.timeout(900)
def test_a_dense_model_is_probed_through_vllms_own_post_processing(tmp_path):
    out = _run(tmp_path, "torch", "qwen3")
    # the linear layers' real process_weights_after_loading ran inside the probe's reloads
    assert all(out[f"vllm{r}"]["pwal_at_init"] > 0 for r in range(2))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("ep", [False, True])
def test_maps_describe_the_experts_after_a_gpu_backends_post_processing(tmp_path, ep):
    """The experts' post-processing swaps w13's gate and up halves (FlashInfer-CUTLASS, stood in
    on CPU): probed through vLLM's reload, the updates are what vLLM serves; probed with
    load_weights alone (post_process=False), every update differs from it in w13 only."""
    out = _run(tmp_path / "on", "torch", ep=ep)
    assert all(out[f"vllm{r}"]["pwal_at_init"] > 0 for r in range(2))
    off = _run(tmp_path / "off", "torch", ep=ep, post_process=False, served=False)
    for r in range(2):
        w = off[f"vllm{r}"]
        assert w["pwal_at_init"] == 0
        assert all(bad and all(n.endswith("experts.routed_experts.w13_weight") for n in bad)
                   for bad in w["mismatched"]), w["mismatched"]


@pytest.mark.timeout(900)
def test_a_second_start_of_the_workers_reuses_their_cached_maps(tmp_path):
    cache = str(tmp_path / "maps")
    first = _run(tmp_path / "first", "torch", cache=cache)
    second = _run(tmp_path / "second", "torch", cache=cache)
    assert [first[f"vllm{r}"]["cache_hits"] for r in range(2)] == [0, 0]
    assert [second[f"vllm{r}"]["cache_hits"] for r in range(2)] == [1, 1], [
        (first[f"vllm{r}"].get("cache_log"), second[f"vllm{r}"].get("cache_log")) for r in range(2)]
