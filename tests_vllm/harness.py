"""Processes of the vLLM backend test: real vLLM model classes on CPU (vLLM's own TP over gloo),
a trainer (PyTorch or JAX) and vLLM's four control calls relayed through the store.

Each vLLM worker builds its model as vLLM does (``initialize_model`` under the engine config,
``load_format="dummy"``), loads the trainer's version 0 and post-processes it
(``process_weights_after_loading``, as vLLM's loader does), makes the ``weightbridge`` engine
vLLM's factory returns, and serves the control calls the trainer's client writes to the store
(what vLLM's RPC does in a real engine). After each update it checks every parameter against
what vLLM's own in-place reload (load_weights, then post-processing) makes of the same checkpoint.

The CPU build cannot post-process MoE experts (``_C.prepack_moe_weight`` is missing), so the
workers stand a GPU backend in for it (:data:`MOE_PWAL`); everything else is vLLM's own.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

import numpy as np

CFGS = {
    "qwen3_moe": {"name": "tiny-moe", "architecture": "qwen3_moe", "vocab_size": 100,
                  "hidden_size": 32, "num_hidden_layers": 3, "first_k_dense_replace": 1,
                  "intermediate_size": 48, "num_experts": 4, "moe_intermediate_size": 16,
                  "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 8, "tie_word_embeddings": False, "dtype": "bfloat16"},
    "deepseek_v3": {"name": "tiny-dsv3", "architecture": "deepseek_v3", "vocab_size": 100,
                    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
                    "num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 4,
                    "n_shared_experts": 1, "num_experts_per_tok": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16,
                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                    "tie_word_embeddings": False, "dtype": "bfloat16"},
    # dense Qwen3 (vLLM's Qwen3ForCausalLM): wb's qwen3_moe spec with every layer dense
    "qwen3": {"name": "tiny-qwen3", "architecture": "qwen3_moe", "vocab_size": 100,
              "hidden_size": 32, "num_hidden_layers": 2, "first_k_dense_replace": 2,
              "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 8, "tie_word_embeddings": False, "dtype": "bfloat16"},
}
CFG = CFGS["qwen3_moe"]
#: The vLLM class each kind builds.
ARCHS = {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
         "qwen3": "Qwen3ForCausalLM"}


def write_hf_config(path: str, kind: str = "qwen3_moe") -> str:
    """A Hugging Face config.json of ``CFGS[kind]`` (what vLLM reads)."""
    c = CFGS[kind]
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        Qwen3MoeConfig(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                       intermediate_size=c["intermediate_size"],
                       moe_intermediate_size=c["moe_intermediate_size"],
                       num_hidden_layers=c["num_hidden_layers"],
                       num_attention_heads=c["num_attention_heads"],
                       num_key_value_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                       num_experts=c["num_experts"],
                       num_experts_per_tok=c["num_experts_per_tok"],
                       mlp_only_layers=list(range(c["first_k_dense_replace"])),
                       tie_word_embeddings=False, torch_dtype="bfloat16",
                       architectures=["Qwen3MoeForCausalLM"]).save_pretrained(path)
    elif kind == "qwen3":
        from transformers import Qwen3Config

        Qwen3Config(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                    intermediate_size=c["intermediate_size"],
                    num_hidden_layers=c["num_hidden_layers"],
                    num_attention_heads=c["num_attention_heads"],
                    num_key_value_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                    tie_word_embeddings=False, torch_dtype="bfloat16",
                    architectures=["Qwen3ForCausalLM"]).save_pretrained(path)
    else:
        from transformers import DeepseekV3Config

        DeepseekV3Config(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                         intermediate_size=c["intermediate_size"],
                         moe_intermediate_size=c["moe_intermediate_size"],
                         num_hidden_layers=c["num_hidden_layers"],
                         num_attention_heads=c["num_attention_heads"],
                         num_key_value_heads=c["num_key_value_heads"],
                         n_shared_experts=c["n_shared_experts"],
                         n_routed_experts=c["n_routed_experts"],
                         kv_lora_rank=c["kv_lora_rank"], q_lora_rank=c["q_lora_rank"],
                         qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"],
                         qk_nope_head_dim=c["qk_nope_head_dim"], n_group=1, topk_group=1,
                         num_experts_per_tok=c["num_experts_per_tok"],
                         first_k_dense_replace=c["first_k_dense_replace"],
                         tie_word_embeddings=False, dtype="bfloat16",
                         topk_method="noaux_tc",  # as DeepSeek-V3's own config: the router bias
                         architectures=["DeepseekV3ForCausalLM"]).save_pretrained(path)
    return path


def _swap_gate_up(self, layer) -> None:
    """FlashInfer-CUTLASS's post-processing of unquantized experts (vLLM 0.33,
    ``convert_to_unquantized_kernel_format``): ``w13_weight``'s gate and up halves swapped."""
    from vllm.model_executor.layers.quantization.utils.flashinfer_utils import swap_w13_to_w31
    from vllm.model_executor.layers.quantization.utils.layer_utils import replace_parameter

    replace_parameter(layer, "w13_weight", swap_w13_to_w31(layer.w13_weight))


#: Stand-ins for ``UnquantizedFusedMoEMethod.process_weights_after_loading`` on CPU.
MOE_PWAL = {"flashinfer_cutlass": _swap_gate_up}


def checkpoint(version: int, kind: str = "qwen3_moe") -> dict[str, np.ndarray]:
    """The trainer's weights at ``version`` (numpy, in the spec's dtypes; ml_dtypes bfloat16)."""
    from wb.data.dtypes import dtype_info
    from wb.layouts.presets import spec_from_config

    spec = spec_from_config(CFGS[kind])
    rng = np.random.default_rng(version)
    return {n: rng.standard_normal(spec.shape(n), dtype=np.float32).astype(
        dtype_info(spec.dtype(n)).numpy) for n in spec.names}


# --- the relay of vLLM's control calls ------------------------------------------------------------
class StoreClient:
    """A ``VLLMWeightSyncClient`` writing each call to the store and waiting for every worker
    to acknowledge it (what vLLM's HTTP routes or Ray calls do in a real engine)."""

    def __init__(self, store, workers: int, timeout: float = 300.0):
        self.store, self.workers, self.timeout, self.n = store, workers, timeout, 0

    def _call(self, method: str, arg=None) -> None:
        n = self.n
        self.n += 1
        self.store.set(f"rpc/{n}", json.dumps([method, arg]).encode())
        for w in range(self.workers):
            reply = json.loads(self.store.get(f"ack/{n}/{w}", self.timeout))
            if reply != "ok":
                raise RuntimeError(f"worker {w}: {method} failed: {reply}")

    def init_weight_transfer_engine(self, init_info):
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self):
        self._call("start_weight_update")

    def update_weights(self, update_info):
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version=None):
        self._call("finish_weight_update")


def vllm_worker(rank: int, tp: int, port: int, cfg_dir: str, store_dir: str, result_dir: str,
                calls: int, kind: str = "qwen3_moe", ep: bool = False,
                moe_pwal: str = "flashinfer_cutlass") -> None:
    """One vLLM worker (spawned): builds the model, serves ``calls`` control calls. Its MoE
    experts are post-processed by ``MOE_PWAL[moe_pwal]``."""
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    result: dict = {"rank": rank, "checks": [], "same_storage": [], "cache_hits": 0,
                    "pwal_calls": 0}
    import logging

    class Hits(logging.Handler):  # wb.probe says when it read the maps from the cache
        def emit(self, rec):
            result["cache_hits"] += "from the cache" in rec.getMessage()
            if "cache" in rec.getMessage():
                result.setdefault("cache_log", []).append(rec.getMessage()[:300])
    logging.getLogger("wb").addHandler(Hits())
    logging.getLogger("wb").setLevel(logging.INFO)
    try:
        import torch

        # vLLM's PyPI wheel is a CUDA build: on a CPU with AMX its linear layers take SGLang's
        # packed-GEMM path, whose `_C.convert_weight_packed` only its CPU build has. Without
        # AMX they take oneDNN's, which the CUDA wheel's torch has: the weights are the same.
        torch.cpu._is_amx_tile_supported = lambda: False
        from vllm.config import set_current_vllm_config
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.model_loader.utils import (
            initialize_model,
            process_weights_after_loading,
        )
        from vllm.utils.torch_utils import set_default_torch_dtype

        import wb
        import wb_vllm

        UnquantizedFusedMoEMethod.process_weights_after_loading = MOE_PWAL[moe_pwal]
        for cls in (UnquantizedFusedMoEMethod, UnquantizedLinearMethod):  # count the calls
            def counted(self, layer, _pwal=cls.process_weights_after_loading):
                result["pwal_calls"] += 1
                return _pwal(self, layer)
            cls.process_weights_after_loading = counted
        wb_vllm.register()
        vc = EngineArgs(model=cfg_dir, skip_tokenizer_init=True, enforce_eager=True,
                        load_format="dummy", dtype="bfloat16", tensor_parallel_size=tp,
                        enable_expert_parallel=ep).create_engine_config()
        with set_current_vllm_config(vc):
            init_distributed_environment(world_size=tp, rank=rank, local_rank=rank,
                                         distributed_init_method=f"tcp://127.0.0.1:{port}",
                                         backend="gloo")
            initialize_model_parallel(tp, 1)
            with set_default_torch_dtype(vc.model_config.dtype), torch.device("cpu"):
                model = initialize_model(vllm_config=vc)
            result["generator"] = _generator_differs(model, kind, tp, ep, rank)
            # vLLM loads a checkpoint at start-up (its loader zeroes the padding rows of the
            # vocabulary, which wb leaves as they are): the trainer's version 0
            import wb_torch

            model.load_weights((n, wb_torch.from_numpy(a))
                               for n, a in checkpoint(0, kind).items())
            process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
            # the oracle (vLLM's in-place reload) makes of version 0 what the start-up made
            result["reload_is_load"] = _check(vc, model, 0, kind)
            result["model"] = type(model).__name__
            engine = WeightTransferEngineFactory.create_engine(
                WeightTransferConfig(backend="weightbridge"), vc, torch.device("cpu"), model)
            result["engine"] = type(engine).__name__
            store = wb.DirectoryStore(store_dir)
            ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
            for n in range(calls):
                method, arg = json.loads(store.get(f"rpc/{n}", 600))
                try:
                    if method == "init_weight_transfer_engine":
                        before = result["pwal_calls"]
                        engine.init_transfer_engine(engine.parse_init_info(arg))
                        result["pwal_at_init"] = result["pwal_calls"] - before
                    elif method == "update_weights":
                        engine.update_weights(arg)
                        bad = _check(vc, model, arg["version"], kind)
                        result["checks"].append(not bad)
                        result.setdefault("mismatched", []).append(bad[:5])
                        result["same_storage"].append(all(
                            p.data_ptr() == ptrs[k] for k, p in model.named_parameters()))
                    else:
                        getattr(engine, method)()
                    store.set(f"ack/{n}/{rank}", b'"ok"')
                except Exception as e:  # noqa: BLE001 - the trainer and the test hear of it
                    store.set(f"ack/{n}/{rank}", json.dumps(f"{type(e).__name__}: {e}").encode())
                    raise
            engine.shutdown()
        result["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported to the test
        result.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
    Path(result_dir, f"vllm{rank}.json").write_text(json.dumps(result))


def _generator_differs(model, kind: str, tp: int, ep: bool, rank: int) -> list[str]:
    """Buffers where wb's vLLM layout generator (wb.layouts.vllm_rollout) and the probe of the
    real model disagree (names holding ids on one side only, or different maps)."""
    import wb_torch
    from wb.layouts import vllm_rollout
    from wb.layouts.presets import spec_from_config

    cfg = CFGS[kind]
    probed = {n: m for n, m in wb_torch.probe(model, spec_from_config(cfg)).items() if m.n_ids}
    made = vllm_rollout(cfg, tp=tp, ep=tp if ep else 1, replicas=1, gpus_per_replica=tp,
                        gpus_per_node=tp, first_rank=0)[rank]
    made = {n: b.sourcemap for n, b in made.buffers.items() if b.sourcemap.n_ids}
    return sorted(set(probed) ^ set(made)) + sorted(
        n for n in set(probed) & set(made) if probed[n] != made[n])


def _check(vc, model, version: int, kind: str) -> list[str]:
    """The parameters that differ from what vLLM's own in-place reload (the model's
    ``load_weights``, then each layer's ``process_weights_after_loading``, copied into the
    served storage) makes of the checkpoint: none, when the update is right."""
    import torch
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    import wb_torch

    got = {n: p.detach().clone() for n, p in model.named_parameters()}
    reload_weights(vc, model, ((n, wb_torch.from_numpy(a))
                               for n, a in checkpoint(version, kind).items()), None, True)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # bit for bit

    def same(a, b):  # a same-size view works on MLA's transposed W_UV / W_UK_T too
        return torch.equal(a.view(bits[a.element_size()]), b.view(bits[b.element_size()]))
    bad = [n for n, p in model.named_parameters() if not same(got[n], p.detach())]
    with torch.no_grad():  # leave the received weights in place
        for n, p in model.named_parameters():
            p.copy_(got[n])
    return bad


def torch_trainer(store_dir: str, result_dir: str, world: int, workers: int, versions: int,
                  kind: str = "qwen3_moe", cache: str | None = None,
                  post_process: bool = True, trainer_rank: int = 0) -> None:
    """A PyTorch trainer holding the whole checkpoint as tensors named like it (spawned)."""
    result: dict = {"rank": trainer_rank}
    try:
        import wb
        import wb_torch
        from wb.layouts.presets import spec_from_config
        from wb_vllm.engine import WeightBridgeTrainer, WeightBridgeTrainerInitInfo

        spec = spec_from_config(CFGS[kind])
        params = {n: wb_torch.from_numpy(a).clone() for n, a in checkpoint(0, kind).items()}
        layouts = wb_torch.checkpoint_layouts(params, spec, trainer_rank, node="trainer",
                                              role="trainer")
        store = wb.DirectoryStore(store_dir)
        url = f"dir:{store_dir}"

        def make_sender(plan):
            return wb_torch.Sender(params, plan, trainer_rank, store=store,
                                   transports=wb.UcxTransport(trainer_rank, store),
                                   staging=False, name="wb", timeout=120, wait_timeout=300)

        info = WeightBridgeTrainerInitInfo(
            rank=trainer_rank, store=url, world=world, layouts=layouts, make_sender=make_sender,
            rollouts={"spec": spec.to_json(), "first_rank": 1, "cache": cache,
                      "post_process": post_process})
        eng = WeightBridgeTrainer.trainer_init(info, client=StoreClient(store, workers))
        for v in range(1, versions + 1):
            for n, a in checkpoint(v, kind).items():
                params[n].copy_(wb_torch.from_numpy(a))  # the training step
            result.setdefault("sent", []).append(eng.send_weights())
        eng.shutdown()
        result["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported to the test
        result.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
    Path(result_dir, f"trainer{trainer_rank}.json").write_text(json.dumps(result))


def wait_for(paths, timeout: float) -> None:
    end = time.time() + timeout
    while time.time() < end and not all(Path(p).exists() for p in paths):
        time.sleep(0.5)


def jax_trainer(store_dir: str, result_dir: str, world: int, workers: int, versions: int,
                kind: str = "qwen3_moe", cache: str | None = None,
                post_process: bool = True) -> None:
    """A JAX trainer (the reference trainer's load function, one CPU device), in a venv without
    vLLM: it drives vLLM's calls with :class:`wb_vllm.trainer.Trainer`."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    result: dict = {"rank": 0}
    try:
        import jax

        import wb
        import wb_jax
        from wb.layouts.presets import spec_from_config
        from wb_jax.testing import make_load_fn
        from wb_vllm.trainer import Trainer, TrainerSetup

        spec = spec_from_config(CFGS[kind])
        ranks = {jax.devices()[0]: 0}
        if kind == "qwen3_moe":  # the reference trainer: JAX kernel layout, probed
            load = make_load_fn(CFG)
            maps = wb_jax.probe(load, spec)
            layouts = wb_jax.layouts(load(checkpoint(0, kind)), maps, ranks, node="trainer",
                                     role="trainer")
        else:  # arrays named like the checkpoint (any model)
            def load(ck):
                return {n: jax.numpy.asarray(a) for n, a in ck.items()}
            layouts = wb_jax.checkpoint_layouts(load(checkpoint(0, kind)), spec, ranks,
                                                node="trainer", role="trainer")
        params = load(checkpoint(0, kind))
        store = wb.DirectoryStore(store_dir)

        def make_sender(plan):
            return wb_jax.Sender(params, plan, ranks, store=store,
                                 transports={0: wb.UcxTransport(0, store)}, staging=False,
                                 name="wb", timeout=120, wait_timeout=300)

        setup = TrainerSetup(store=f"dir:{store_dir}", world=world, layouts=layouts,
                             make_sender=make_sender,
                             rollouts={"spec": spec.to_json(), "first_rank": 1, "cache": cache,
                                       "post_process": post_process})
        eng = Trainer.trainer_init(setup, client=StoreClient(store, workers))
        for v in range(1, versions + 1):
            result.setdefault("sent", []).append(eng.send_weights(load(checkpoint(v, kind))))
        eng.shutdown()
        result["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported to the test
        result.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
    Path(result_dir, "trainer0.json").write_text(json.dumps(result))
