"""Checkpoint specs of real model architectures, built from their config numbers (no weights).

Names and shapes follow the Hugging Face checkpoints of the ``deepseek_v3`` and ``qwen3_moe``
architectures (PyTorch ``[out, in]`` linear weights). Nothing of model size is ever allocated: a
spec is names, shapes and dtypes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from wb.data.spec import CheckpointSpec
from wb.errors import SpecError
from wb.layouts.dims import ModelDims

__all__ = ["spec_from_config", "load_config", "MODELS_DIR", "TINY"]

#: The model config JSON files shipped with the package (``kimi-k2.json``, ...).
MODELS_DIR = Path(__file__).resolve().parent / "models"


def load_config(name: str, models_dir: Path | str | None = None) -> dict:
    """Reads a model config: ``{models_dir}/{name}.json``.

    Args:
        name: the model, e.g. ``"kimi-k2"`` (the files of :data:`MODELS_DIR`).
        models_dir: where the JSON files are (default :data:`MODELS_DIR`).

    Returns:
        The config dict (Hugging Face config keys, plus ``name`` and ``architecture``).

    Raises:
        SpecError: there is no such file.
    """
    path = Path(models_dir or MODELS_DIR) / f"{name}.json"
    if not path.exists():
        raise SpecError(f"no model config `{name}` at {path}; pass models_dir= to point at it")
    return json.loads(path.read_text())


def spec_from_config(cfg: Mapping) -> CheckpointSpec:
    """Builds the checkpoint spec of an architecture from its config fields.

    Supported ``cfg["architecture"]``: ``"qwen3_moe"`` and ``"deepseek_v3"``. ``qwen3_moe`` also
    accepts ``first_k_dense_replace`` and ``intermediate_size`` (dense MLP in the first layers),
    which the tiny reference models use to exercise fused dense ``gate_up``. The numbers are read
    by :meth:`wb.layouts.dims.ModelDims.of`.

    Args:
        cfg: a model config (:func:`load_config`, :data:`TINY`).

    Returns:
        The :class:`~wb.data.spec.CheckpointSpec`: HF names, shapes and dtypes, in checkpoint order.

    Raises:
        SpecError: the architecture is not supported or a field it needs is missing.

    Examples:
        >>> tiny = dict(architecture="qwen3_moe", vocab_size=10, hidden_size=4, num_hidden_layers=1,
        ...             num_attention_heads=2, num_key_value_heads=1, head_dim=2, num_experts=2,
        ...             moe_intermediate_size=3, dtype="bfloat16")
        >>> spec = spec_from_config(tiny)
        >>> spec.names[:3], spec.shape("model.layers.0.self_attn.k_proj.weight")
        (('model.embed_tokens.weight', 'model.layers.0.input_layernorm.weight', 'model.layers.0.self_attn.q_proj.weight'), (2, 4))
    """
    d = ModelDims.of(cfg)
    dt, h = d.dtype, d.hidden
    t: dict[str, tuple[tuple[int, ...], str]] = {"model.embed_tokens.weight": ((d.vocab, h), dt)}
    for i in range(d.layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = ((h,), dt)
        t.update(_attention(d, p + "self_attn."))
        t[p + "post_attention_layernorm.weight"] = ((h,), dt)
        if i < d.n_dense:
            t.update(_mlp(p + "mlp.", h, d.intermediate, dt))
        else:
            E = d.experts
            t[p + "mlp.gate.weight"] = ((E, h), dt)
            if d.mla:
                # float32 whatever the weights' dtype, as real checkpoints and engines keep it
                t[p + "mlp.gate.e_score_correction_bias"] = ((E,), "float32")
            for e in range(E):
                t.update(_mlp(p + f"mlp.experts.{e}.", h, d.moe_intermediate, dt))
            if d.n_shared:
                t.update(_mlp(p + "mlp.shared_experts.", h, d.shared_width, dt))
    t["model.norm.weight"] = ((h,), dt)
    if not d.tied:
        t["lm_head.weight"] = ((d.vocab, h), dt)
    return CheckpointSpec(t)


def _mlp(p: str, h: int, inter: int, dt: str) -> dict:
    return {p + "gate_proj.weight": ((inter, h), dt), p + "up_proj.weight": ((inter, h), dt),
            p + "down_proj.weight": ((h, inter), dt)}


def _attention(d: ModelDims, p: str) -> dict:
    h, nh, dt = d.hidden, d.heads, d.dtype
    if not d.mla:
        kv, hd = d.kv_heads, d.head_dim
        return {p + "q_proj.weight": ((nh * hd, h), dt), p + "k_proj.weight": ((kv * hd, h), dt),
                p + "v_proj.weight": ((kv * hd, h), dt), p + "o_proj.weight": ((h, nh * hd), dt),
                p + "q_norm.weight": ((hd,), dt), p + "k_norm.weight": ((hd,), dt)}
    nope, rope, vh = d.qk_nope_dim, d.qk_rope_dim, d.v_head_dim
    kvr, qr = d.kv_lora_rank, d.q_lora_rank
    out: dict = {}
    if qr:
        out[p + "q_a_proj.weight"] = ((qr, h), dt)
        out[p + "q_a_layernorm.weight"] = ((qr,), dt)
        out[p + "q_b_proj.weight"] = ((nh * (nope + rope), qr), dt)
    else:
        out[p + "q_proj.weight"] = ((nh * (nope + rope), h), dt)
    out[p + "kv_a_proj_with_mqa.weight"] = ((kvr + rope, h), dt)
    out[p + "kv_a_layernorm.weight"] = ((kvr,), dt)
    out[p + "kv_b_proj.weight"] = ((nh * (nope + vh), kvr), dt)
    out[p + "o_proj.weight"] = ((h, nh * vh), dt)
    return out


#: A tiny qwen3_moe-style architecture for tests, the demo and notebooks: GQA attention with
#: per-head norms, one dense layer (fused gate_up) then MoE layers, untied embeddings, vocabulary
#: not a multiple of 64 (so rollout shards are padded).
TINY: dict = dict(
    name="tiny-moe", architecture="qwen3_moe", vocab_size=100, hidden_size=32,
    num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=48,
    num_experts=4, moe_intermediate_size=16, num_experts_per_tok=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    tie_word_embeddings=False, dtype="bfloat16",
)
