"""Model dimensions: the numbers of a model config, read once, checked once.

Every place that needs a config number (the checkpoint spec, the layout generators, the reference
models of :mod:`wb_torch.testing` and :mod:`wb_jax.testing`) reads it through :class:`ModelDims`,
so a missing or inconsistent field fails the same way everywhere. Field names follow the Hugging
Face config keys (``wb/layouts/models/*.json``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from wb.errors import SpecError

__all__ = ["ModelDims", "ARCHITECTURES"]

#: The architectures whose checkpoint and layouts the catalogue knows.
ARCHITECTURES = ("qwen3_moe", "deepseek_v3")


@dataclass(frozen=True, slots=True)
class ModelDims:
    """The config numbers of a ``qwen3_moe`` or ``deepseek_v3`` model.

    Fields that an architecture does not have are 0: GQA fields (``kv_heads``, ``head_dim``) for
    ``deepseek_v3``, MLA fields (``q_lora_rank`` ... ``v_head_dim``) for ``qwen3_moe``,
    ``intermediate`` without dense layers, ``experts`` and ``moe_intermediate`` without MoE layers.

    Examples:
        >>> from wb.layouts.presets import TINY
        >>> d = ModelDims.of(TINY)
        >>> d.vocab, d.hidden, d.layers, d.n_dense, d.experts, d.has_moe
        (100, 32, 3, 1, 4, True)
        >>> d.padded_vocab(64)
        128
    """

    arch: str  # "qwen3_moe" or "deepseek_v3"
    dtype: str  # dtype of every tensor, e.g. "bfloat16"
    vocab: int  # vocab_size (rows of embed_tokens and lm_head)
    hidden: int  # hidden_size
    layers: int  # num_hidden_layers
    n_dense: int  # first_k_dense_replace (at most `layers`): layers i < n_dense have a dense MLP
    intermediate: int  # intermediate_size of the dense MLPs (0 without dense layers)
    experts: int  # num_experts / n_routed_experts: routed experts (0 without MoE layers)
    moe_intermediate: int  # moe_intermediate_size (0 without MoE layers)
    n_shared: int  # n_shared_experts (their MLP is moe_intermediate * n_shared wide)
    heads: int  # num_attention_heads
    kv_heads: int  # qwen3_moe: num_key_value_heads
    head_dim: int  # qwen3_moe: head_dim
    q_lora_rank: int  # deepseek_v3: q_lora_rank (0: a plain q_proj)
    kv_lora_rank: int  # deepseek_v3: kv_lora_rank
    qk_nope_dim: int  # deepseek_v3: qk_nope_head_dim
    qk_rope_dim: int  # deepseek_v3: qk_rope_head_dim
    v_head_dim: int  # deepseek_v3: v_head_dim
    tied: bool  # tie_word_embeddings: no lm_head.weight in the checkpoint

    @classmethod
    def of(cls, cfg: Mapping) -> ModelDims:
        """Reads the dimensions of a model config.

        Args:
            cfg: a model config (:func:`wb.layouts.presets.load_config`, or
                :data:`wb.layouts.presets.TINY`); ``num_experts`` may be spelled
                ``n_routed_experts``.

        Returns:
            The :class:`ModelDims`.

        Raises:
            SpecError: the architecture is not one of :data:`ARCHITECTURES`, a field the
                architecture needs is missing, or a model with MoE layers has no experts.
        """
        arch = cfg.get("architecture")
        if arch not in ARCHITECTURES:
            raise SpecError(f"`cfg['architecture']` is {arch!r}; the catalogue supports "
                            f"{' and '.join(map(repr, ARCHITECTURES))}")

        def num(key: str, *spellings: str) -> int:
            for k in (key, *spellings):
                if k in cfg:
                    return int(cfg[k])
            raise SpecError(f"`cfg` has no `{key}`, which a {arch} model needs; add it to the "
                            f"config (see the files in wb/layouts/models)")

        mla = arch == "deepseek_v3"
        layers = num("num_hidden_layers")
        n_dense = min(int(cfg.get("first_k_dense_replace", 0) or 0), layers)
        has_moe = n_dense < layers
        experts = int(cfg.get("num_experts", cfg.get("n_routed_experts", 0)) or 0) if has_moe else 0
        if has_moe and experts < 1:
            raise SpecError(
                f"`cfg` has MoE layers ({n_dense}..{layers - 1}) but `num_experts` is {experts}; "
                f"give at least 1 expert or set first_k_dense_replace={layers}")
        return cls(
            arch=arch, dtype=str(cfg.get("dtype", "bfloat16")), vocab=num("vocab_size"),
            hidden=num("hidden_size"), layers=layers, n_dense=n_dense,
            intermediate=num("intermediate_size") if n_dense else 0,
            experts=experts, moe_intermediate=num("moe_intermediate_size") if has_moe else 0,
            n_shared=int(cfg.get("n_shared_experts", 0) or 0),
            heads=num("num_attention_heads"),
            kv_heads=0 if mla else num("num_key_value_heads"),
            head_dim=0 if mla else num("head_dim"),
            q_lora_rank=int(cfg.get("q_lora_rank") or 0) if mla else 0,
            kv_lora_rank=num("kv_lora_rank") if mla else 0,
            qk_nope_dim=num("qk_nope_head_dim") if mla else 0,
            qk_rope_dim=num("qk_rope_head_dim") if mla else 0,
            v_head_dim=num("v_head_dim") if mla else 0,
            tied=bool(cfg.get("tie_word_embeddings", False)))

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (``deepseek_v3``), else GQA with per-head norms."""
        return self.arch == "deepseek_v3"

    @property
    def has_moe(self) -> bool:
        """Whether some layers (``n_dense`` onward) are mixture-of-experts layers."""
        return self.n_dense < self.layers

    @property
    def shared_width(self) -> int:
        """Width of the shared-expert MLP (0: none)."""
        return self.moe_intermediate * self.n_shared

    def padded_vocab(self, multiple: int) -> int:
        """The vocabulary rounded up to a multiple of ``multiple`` (frameworks pad the embedding
        and the LM head so their shards are equal; padding rows hold no checkpoint element).

        Args:
            multiple: e.g. ``128 * tp`` (Megatron), 64 (vLLM), ``tp`` (the JAX mesh generator).

        Returns:
            The padded row count, ``>= vocab``.

        Raises:
            SpecError: ``multiple`` is below 1.
        """
        if multiple < 1:
            raise SpecError(f"padded_vocab: `multiple` must be >= 1, got {multiple}")
        return -(-self.vocab // multiple) * multiple
