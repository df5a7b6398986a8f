"""SGLang's own model classes on a CPU-only machine, one TP rank per process (run in the SGLang
venv: ``tests_sglang/install.sh``).

SGLang needs two modules its model classes import but never call while building or loading
(``torchvision``, ``sgl_kernel``: their PyPI wheels are CUDA builds that fail on a CPU torch): a
finder answers them with stubs, after transformers has decided that there is no torchvision.
Then, per process: gloo's distributed environment, SGLang's runtime context, its model-parallel
groups, and the class built as SGLang builds it (``cls(hf_config, quant_config=None)``).

    python tests_sglang/harness.py MODEL TP RANK PORT OUT.json [CACHE_DIR]

probes the rank's model with ``wb_torch.probe`` through SGLang's own ``load_weights`` (with
``CACHE_DIR``: from the map cache when there, timed), loads a seeded random checkpoint through
that same ``load_weights`` and writes, per state entry, whether every element the map names
holds that checkpoint element (SGLang's own loader, element by element), whether each map equals
the per-element oracle written from SGLang's layout rules (:func:`oracle_ids`), and the
checkpoint ids the rank holds (``OUT.ids.npy``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import time
import types
from pathlib import Path

STUBBED = ("torchvision", "sgl_kernel")


class _Stub(types.ModuleType):
    """A module (and package) whose every attribute is another stub."""

    def __init__(self, name: str):
        super().__init__(name)
        self.__path__ = []

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        return None


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Stub(spec.name)

    def exec_module(self, module):
        pass


def prepare_sglang() -> None:
    """What must happen before SGLang's model modules are imported (see the module doc)."""
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    import transformers.utils.import_utils as iu

    iu.is_torchvision_available()  # cached False before the stub exists
    if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder())


def init_tp(tp: int, rank: int, port: int) -> None:
    """SGLang's distributed state for TP rank ``rank`` of ``tp`` (gloo over localhost)."""
    from sglang.srt import runtime_context as rc
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.server_args import ServerArgs

    ps.init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
    rc.reset_context()
    rc.publish(ServerArgs(model_path="dummy", tp_size=tp, ep_size=1, pp_size=1, device="cpu"),
               role="test", ranks=rc.SpawnRanks(world_rank=rank))
    rc.get_parallel().override_permanently(world_group=ps._WORLD)
    ps.initialize_model_parallel(backend="gloo")  # its sizes: the published server args


def hf_config(model: str):
    """A small configuration of ``model`` (``llama``, ``qwen3``, ``qwen3-moe``) and SGLang's class."""
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=128, tie_word_embeddings=False)
    if model == "llama":
        from sglang.srt.models.llama import LlamaForCausalLM

        return tf.LlamaConfig(**common), LlamaForCausalLM
    if model == "qwen3":
        from sglang.srt.models.qwen3 import Qwen3ForCausalLM

        return tf.Qwen3Config(**common), Qwen3ForCausalLM
    if model == "qwen3-moe":
        from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

        return tf.Qwen3MoeConfig(**common, moe_intermediate_size=32, num_experts=4,
                                 num_experts_per_tok=2, decoder_sparse_step=1,
                                 mlp_only_layers=[]), Qwen3MoeForCausalLM
    raise SystemExit(f"unknown model {model!r}")


def checkpoint_spec(cfg):
    """The checkpoint as it is on disk (its names, shapes; float32 here): transformers' own
    module on the meta device, its in-memory fused experts (``mlp.experts.gate_up_proj``,
    ``down_proj``) cut into the on-disk per-expert tensors SGLang's loader takes."""
    import torch
    from transformers import AutoModelForCausalLM

    import wb

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
    tensors = {}
    for n, t in hf.state_dict().items():
        shape = tuple(t.shape)
        if n.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H] -> gate, up [I, H] per expert
            e, i2, h = shape
            for k in range(e):
                for part in ("gate_proj", "up_proj"):
                    tensors[n.replace("gate_up_proj", f"{k}.{part}.weight")] = ((i2 // 2, h),
                                                                                "float32")
        elif n.endswith("mlp.experts.down_proj"):  # [E, H, I] -> down [H, I] per expert
            e, h, i = shape
            for k in range(e):
                tensors[n.replace("down_proj", f"{k}.down_proj.weight")] = ((h, i), "float32")
        else:
            tensors[n] = (shape, "float32")
    return wb.CheckpointSpec(tensors)


def oracle_ids(model: str, cfg, spec, tp: int, t: int) -> dict:
    """What TP rank ``t`` of ``tp`` holds of the checkpoint, written plainly from SGLang's layout
    rules (not from any probe): ``{state entry: ids}``. Column-parallel weights hold row block
    ``t``; row-parallel ones column block ``t``; ``qkv_proj`` = cat(q, k, v) blocks (KV heads
    split while there are as many as ranks), ``gate_up_proj`` = cat(gate, up); experts (EP 1)
    stack every expert's TP blocks: ``w13_weight`` [E, 2I/tp, H], ``w2_weight`` [E, H, I/tp];
    embeddings and the head split by vocabulary rows; norms and the router whole."""
    import numpy as np

    I = spec.ids

    def part(ids, axis=0):
        return np.split(ids, tp, axis=axis)[t]

    out = {"model.embed_tokens.weight": part(I("model.embed_tokens.weight")),
           "model.norm.weight": I("model.norm.weight"), "lm_head.weight": part(I("lm_head.weight"))}
    kv = cfg.num_key_value_heads
    for i in range(cfg.num_hidden_layers):
        h = f"model.layers.{i}."
        a, m = h + "self_attn.", h + "mlp."
        k_ids, v_ids = I(a + "k_proj.weight"), I(a + "v_proj.weight")
        if tp > kv:  # each KV head on tp // kv ranks
            k_ids = np.split(k_ids, kv)[t // (tp // kv)]
            v_ids = np.split(v_ids, kv)[t // (tp // kv)]
        else:
            k_ids, v_ids = part(k_ids), part(v_ids)
        out[a + "qkv_proj.weight"] = np.concatenate([part(I(a + "q_proj.weight")), k_ids, v_ids])
        out[a + "o_proj.weight"] = part(I(a + "o_proj.weight"), axis=1)
        if model != "llama":
            out[a + "q_norm.weight"] = I(a + "q_norm.weight")
            out[a + "k_norm.weight"] = I(a + "k_norm.weight")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[h + norm + ".weight"] = I(h + norm + ".weight")
        if model == "qwen3-moe":
            x = m + "experts."
            out[m + "gate.weight"] = I(m + "gate.weight")
            out[x + "w13_weight"] = np.stack([np.concatenate(
                [part(I(f"{x}{e}.gate_proj.weight")), part(I(f"{x}{e}.up_proj.weight"))])
                for e in range(cfg.num_experts)])
            out[x + "w2_weight"] = np.stack([part(I(f"{x}{e}.down_proj.weight"), axis=1)
                                             for e in range(cfg.num_experts)])
        else:
            out[m + "gate_up_proj.weight"] = np.concatenate(
                [part(I(m + "gate_proj.weight")), part(I(m + "up_proj.weight"))])
            out[m + "down_proj.weight"] = part(I(m + "down_proj.weight"), axis=1)
    return out


def main(model: str, tp: int, rank: int, port: int, out: str, cache: str | None = None) -> None:
    prepare_sglang()
    import numpy as np
    import torch

    import wb_torch

    init_tp(tp, rank, port)
    cfg, cls = hf_config(model)
    with torch.device("cpu"):
        m = cls(cfg, quant_config=None)
    spec = checkpoint_spec(cfg)
    t0 = time.perf_counter()
    maps = wb_torch.probe(m, spec, cache=cache, key={"model": model, "tp": tp, "rank": rank})
    probe_s = time.perf_counter() - t0
    rng = np.random.default_rng(7)
    ck = {n: rng.standard_normal(spec.shape(n)).astype(np.float32) for n in spec.names}
    m.load_weights((n, torch.from_numpy(a)) for n, a in ck.items())  # SGLang's own loader
    flat = np.concatenate([ck[n].ravel() for n in spec.names])  # element id -> its value
    state = m.state_dict()
    bad, held, elements, covered = [], 0, 0, []
    for n, p in state.items():
        ids = maps[n].to_indices()
        covered.append(np.unique(ids[ids >= 0]))
        got = p.detach().numpy()
        mapped = ids >= 0
        held += int(mapped.sum())
        elements += ids.size
        if not np.array_equal(got[mapped], flat[ids[mapped]]):
            bad.append(n)
    np.save(Path(out).with_suffix(".ids.npy"), np.unique(np.concatenate(covered)))
    want = oracle_ids(model, cfg, spec, tp, rank)
    oracle_bad = sorted(n for n in set(want) | set(maps) if n not in want or n not in maps
                        or not np.array_equal(maps[n].to_indices(), want[n]))
    Path(out).write_text(json.dumps({
        "model": model, "tp": tp, "rank": rank, "entries": len(state),
        "mapped_entries": len(maps), "unmapped_entries": sorted(set(state) - set(maps)),
        "bad": bad, "oracle_bad": oracle_bad, "held_elements": held, "elements": elements, "probe_s": probe_s,
        "checkpoint_elements": int(flat.size)}))


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], int(a[1]), int(a[2]), int(a[3]), a[4], a[5] if len(a) > 5 else None)
