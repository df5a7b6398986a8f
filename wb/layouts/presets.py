"""Checkpoint specs of real model architectures, built from their config numbers (no weights).

Names and shapes follow the models' Hugging Face checkpoints (PyTorch ``[out, in]`` linear weights),
as ``shared/models/README.md`` describes for the ``deepseek_v3`` and ``qwen3_moe`` architectures.
Nothing of model size is ever allocated: a spec is names, shapes and dtypes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from wb.errors import SpecError
from wb.data.spec import CheckpointSpec

__all__ = ["spec_from_config", "load_config", "MODELS_DIR", "TINY"]

#: The model architecture JSON files (copies of ``shared/models``, shipped with the package).
MODELS_DIR = Path(__file__).resolve().parent / "models"



def load_config(name: str, models_dir: Path | None = None) -> dict:
    """Reads ``{models_dir}/{name}.json`` (for example ``"kimi-k2"``)."""
    path = Path(models_dir or MODELS_DIR) / f"{name}.json"
    if not path.exists():
        raise SpecError(f"no model config `{name}` at {path}; pass models_dir= to point at it")
    return json.loads(path.read_text())


def spec_from_config(cfg: Mapping) -> CheckpointSpec:
    """Builds the checkpoint spec of an architecture from its config fields.

    Supported ``cfg["architecture"]``: ``"qwen3_moe"`` and ``"deepseek_v3"``. ``qwen3_moe`` also
    accepts ``first_k_dense_replace`` and ``intermediate_size`` (dense MLP in the first layers), which
    the tiny reference models use to exercise fused dense ``gate_up``.

    Examples:
        >>> tiny = dict(architecture="qwen3_moe", vocab_size=10, hidden_size=4, num_hidden_layers=1,
        ...             num_attention_heads=2, num_key_value_heads=1, head_dim=2, num_experts=2,
        ...             moe_intermediate_size=3, dtype="bfloat16")
        >>> spec = spec_from_config(tiny)
        >>> spec.names[:3], spec.shape("model.layers.0.self_attn.k_proj.weight")
        (('model.embed_tokens.weight', 'model.layers.0.input_layernorm.weight', 'model.layers.0.self_attn.q_proj.weight'), (2, 4))
    """
    arch = cfg.get("architecture")
    if arch not in ("qwen3_moe", "deepseek_v3"):
        raise SpecError(f"architecture {arch!r} is not supported; use 'qwen3_moe' or 'deepseek_v3'")
    dt = cfg.get("dtype", "bfloat16")
    h, L = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    vocab = int(cfg["vocab_size"])
    t: dict[str, tuple[tuple[int, ...], str]] = {"model.embed_tokens.weight": ((vocab, h), dt)}
    n_dense = int(cfg.get("first_k_dense_replace", 0))
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = ((h,), dt)
        t.update(_attention(cfg, p + "self_attn.", h, dt, arch))
        t[p + "post_attention_layernorm.weight"] = ((h,), dt)
        if i < n_dense:
            inter = int(cfg["intermediate_size"])
            t.update(_mlp(p + "mlp.", h, inter, dt))
        else:
            E, mi = int(cfg.get("num_experts", cfg.get("n_routed_experts", 0))), int(
                cfg["moe_intermediate_size"])
            t[p + "mlp.gate.weight"] = ((E, h), dt)
            if arch == "deepseek_v3":
                t[p + "mlp.gate.e_score_correction_bias"] = ((E,), dt)
            for e in range(E):
                t.update(_mlp(p + f"mlp.experts.{e}.", h, mi, dt))
            n_shared = int(cfg.get("n_shared_experts", 0) or 0)
            if n_shared:
                t.update(_mlp(p + "mlp.shared_experts.", h, mi * n_shared, dt))
    t["model.norm.weight"] = ((h,), dt)
    if not cfg.get("tie_word_embeddings", False):
        t["lm_head.weight"] = ((vocab, h), dt)
    return CheckpointSpec(t)


def _mlp(p: str, h: int, inter: int, dt: str) -> dict:
    return {p + "gate_proj.weight": ((inter, h), dt), p + "up_proj.weight": ((inter, h), dt),
            p + "down_proj.weight": ((h, inter), dt)}


def _attention(cfg: Mapping, p: str, h: int, dt: str, arch: str) -> dict:
    nh = int(cfg["num_attention_heads"])
    if arch == "qwen3_moe":
        kv, hd = int(cfg["num_key_value_heads"]), int(cfg["head_dim"])
        return {p + "q_proj.weight": ((nh * hd, h), dt), p + "k_proj.weight": ((kv * hd, h), dt),
                p + "v_proj.weight": ((kv * hd, h), dt), p + "o_proj.weight": ((h, nh * hd), dt),
                p + "q_norm.weight": ((hd,), dt), p + "k_norm.weight": ((hd,), dt)}
    nope, rope, vh = (int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]),
                      int(cfg["v_head_dim"]))
    kvr, qr = int(cfg["kv_lora_rank"]), cfg.get("q_lora_rank")
    out: dict = {}
    if qr:
        out[p + "q_a_proj.weight"] = ((int(qr), h), dt)
        out[p + "q_a_layernorm.weight"] = ((int(qr),), dt)
        out[p + "q_b_proj.weight"] = ((nh * (nope + rope), int(qr)), dt)
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
