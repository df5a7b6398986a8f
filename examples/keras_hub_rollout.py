"""A KerasHub model on JAX as a rollout: probed through KerasHub's own Hugging Face converter.

The probe's load function writes each pass's id-encoded checkpoint as a Hugging Face folder
(``config.json`` and ``model.safetensors``) and loads it with ``Qwen3MoeBackbone.from_preset``,
the path a KerasHub user runs: the converter transposes every projection, reshapes attention
kernels per head, and stacks each layer's experts (gate and up concatenated) into one batched
kernel. The maps say where every checkpoint element lands in the backbone's variables. A plan
then moves a trainer's weights into the buffers of a backbone made from other weights, and every
variable is checked against ``from_preset`` of the trainer's weights.

    python examples/keras_hub_rollout.py   # needs keras-hub, jax, safetensors (KERAS_BACKEND=jax)
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

import wb  # noqa: E402
import wb_jax  # noqa: E402
from wb.cli.demo.checkpoint import random_checkpoint  # noqa: E402
from wb.layouts.presets import TINY, spec_from_config  # noqa: E402

#: TINY with every layer a mixture of experts (KerasHub's converter reads no dense first layers).
CONFIG = dict(TINY, first_k_dense_replace=0)


def hf_folder(ckpt: dict, folder: Path, cfg: dict) -> Path:
    """The checkpoint ``ckpt`` (numpy arrays) as a Hugging Face Qwen3-MoE folder."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": cfg["vocab_size"], "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "moe_intermediate_size": cfg["moe_intermediate_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"], "head_dim": cfg["head_dim"],
        "num_experts": cfg["num_experts"], "num_experts_per_tok": cfg["num_experts_per_tok"],
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rms_norm_eps": 1e-6, "rope_theta": 1e6, "sliding_window": None,
        "router_aux_loss_coef": 0.001, "tie_word_embeddings": cfg["tie_word_embeddings"],
        "torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({n: np.ascontiguousarray(a) for n, a in ckpt.items()},
              str(folder / "model.safetensors"))
    return folder


def from_preset(ckpt: dict, folder: Path, cfg: dict):
    """``Qwen3MoeBackbone.from_preset`` of the checkpoint ``ckpt``, in bfloat16 (Keras's name
    counters reset first: every build names its layers, and so its variables, alike)."""
    import keras
    import keras_hub

    keras.backend.clear_session()
    return keras_hub.models.Qwen3MoeBackbone.from_preset(str(hf_folder(ckpt, folder, cfg)),
                                                         dtype="bfloat16")


def variables(backbone) -> dict:
    """The backbone's variables as a pytree: ``{path: jax.Array}``."""
    return {v.path: v.value for v in backbone.weights}


def main(cfg: dict = CONFIG) -> bool:
    spec = spec_from_config(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        passes = iter(range(1000))

        def load(ck):  # the probe's load: from_preset of the id-encoded checkpoint
            return variables(from_preset({n: np.asarray(ck[n]) for n in ck},
                                         tmp / f"p{next(passes)}", cfg))

        maps = wb_jax.probe(load, spec)
        rollout = variables(from_preset(random_checkpoint(1, cfg), tmp / "rollout", cfg))
        (lay,) = wb_jax.layouts(rollout, maps, 1, node="r0", role="rollout")
        trainer = wb.Layout(wb.Worker(0, "t0", "trainer"), {
            n: wb.BufferSpec(wb.SourceMap.from_indices(spec.ids(n).reshape(spec.shape(n))),
                             spec.dtype(n)) for n in spec})
        plan = wb.plan([trainer], [lay])
        weights = random_checkpoint(2, cfg)
        # JAX arrays are immutable: the rollout's buffers here are numpy copies of its shards
        bufs = {n: np.array(a) for n, a in wb_jax.buffers(rollout, 1)[1].items()
                if n in lay.buffers}
        wb.run_local(plan, {0: weights}, {1: bufs})
        want = wb_jax.buffers(variables(from_preset(weights, tmp / "want", cfg)), 1)[1]
        same = all(np.array_equal(bufs[n].view(np.uint8), np.asarray(want[n]).view(np.uint8))
                   for n in lay.buffers)
        print(f"Qwen3MoeBackbone (KerasHub, JAX): {len(lay.buffers)} of {len(rollout)} variables "
              f"mapped "
              f"({sorted(lay.buffers)[:2]}...); after the transfer, equal to from_preset of the "
              f"trainer's weights: {same}")
        return same


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
