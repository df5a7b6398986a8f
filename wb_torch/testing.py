"""A tiny vLLM-style rollout model for one tensor-parallel rank, and its numpy oracle.

:class:`TinyRollout` behaves like a vLLM model class: its parameters are already sharded for one
TP rank, and its own :meth:`TinyRollout.load_weights` takes *full* Hugging Face checkpoint tensors
(names as :func:`wb.layouts.presets.spec_from_config` gives them) and copies the right slices into its
parameters in place, through vLLM's ``stacked_params_mapping`` (q/k/v into ``qkv_proj``, gate/up
into ``gate_up_proj``), the fused-MoE expert mapping (gate/up into ``w13``, down into ``w2``) and a
``weight_loader`` function attached to each parameter. It is what probing and transfer tests run
against when no vLLM is installed.

:func:`expected_maps` is an independent pure-numpy statement of the same layout: for every
parameter, the global checkpoint id each element must hold. Tests compare the two.

Layout decisions that follow vLLM (``tp`` = ``tp_size``, ``r`` = ``tp_rank``):

- Embedding and LM head rows are padded to a multiple of 64 (``VocabParallelEmbedding``), then
  split evenly; padding rows are never written.
- When ``tp > num_key_value_heads`` the kv heads are replicated: rank ``r`` holds kv head
  ``r // (tp // num_key_value_heads)`` (``QKVParallelLinear``).
- Experts are split over the TP ranks (expert parallelism, ``enable_expert_parallel``), each
  expert whole: rank ``r`` owns experts ``[r*E/tp, (r+1)*E/tp)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch
from torch import nn

import wb
from wb.layouts import TINY, VOCAB_PADDING, ModelDims, spec_from_config
from wb_torch.tiny_layers import Model, vocab_parallel

__all__ = ["TinyRollout", "expected_maps", "checkpoint_tensors"]


# --- arguments -----------------------------------------------------------------------------------
def _check_args(cfg: Mapping, tp_rank: int, tp_size: int) -> ModelDims:
    """The dimensions of ``cfg``, after checking that it is a qwen3_moe config that ``tp_size``
    ranks can split (ValueError, or its subclass SpecError, otherwise)."""
    if cfg.get("architecture") != "qwen3_moe":
        raise ValueError(f"`cfg['architecture']` is {cfg.get('architecture')!r}; TinyRollout only "
                         f"models 'qwen3_moe' (use wb.layouts.presets.TINY or a copy of it)")
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"`tp_size` must be a positive int, got {tp_size!r}")
    if not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"`tp_rank` must be an int in [0, {tp_size}) for tp_size={tp_size}, "
                         f"got {tp_rank!r}")
    d = ModelDims.of(cfg)
    nh, kv = d.heads, d.kv_heads
    if nh % tp_size:
        raise ValueError(f"`tp_size`={tp_size} must divide num_attention_heads={nh}; "
                         f"pick a tp_size among the divisors of {nh}")
    if kv % tp_size and tp_size % kv:
        raise ValueError(f"`tp_size`={tp_size} and num_key_value_heads={kv} must divide one "
                         f"another (kv heads are split when tp_size <= {kv} and replicated when "
                         f"tp_size is a multiple of {kv})")
    E = d.experts
    if d.has_moe and E % tp_size:
        raise ValueError(f"`tp_size`={tp_size} must divide num_experts={E} (experts are split "
                         f"whole over the TP ranks); pick a tp_size among the divisors of {E}")
    if d.n_dense and d.intermediate % tp_size:
        raise ValueError(f"`tp_size`={tp_size} must divide intermediate_size={d.intermediate} "
                         f"(the dense MLP layers are split over the TP ranks)")
    vp = d.padded_vocab(VOCAB_PADDING)
    if vp % tp_size:
        raise ValueError(f"`tp_size`={tp_size} must divide the padded vocabulary {vp} "
                         f"(vocab_size={d.vocab} rounded up to a multiple of {VOCAB_PADDING})")
    return d


# (parameter, checkpoint name part, shard id), as in vLLM's Qwen3MoeModel.load_weights.
_STACKED_PARAMS = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
                   ("qkv_proj", "v_proj", "v"), ("gate_up_proj", "gate_proj", 0),
                   ("gate_up_proj", "up_proj", 1))


def _expert_params_mapping(num_experts: int) -> list[tuple[str, str, int, str]]:
    """vLLM's ``FusedMoE.make_expert_params_mapping``: (param prefix, ckpt part, expert, shard)."""
    return [("experts.routed_experts.w13_" if shard in ("w1", "w3")
             else "experts.routed_experts.w2_",
             f"experts.{e}.{ckpt}.", e, shard)
            for e in range(num_experts)
            for shard, ckpt in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))]


class TinyRollout(nn.Module):
    """A qwen3_moe rollout model for one TP rank, loading weights the way vLLM does.

    The parameters (``named_parameters()``) are this rank's shards; :meth:`load_weights` receives
    full checkpoint tensors and copies slices into them in place. There is no compute.

    Args:
        cfg: a ``qwen3_moe`` config (see :data:`wb.layouts.presets.TINY`); dense MLP layers for
            ``i < first_k_dense_replace``.
        tp_rank: this rank, in ``[0, tp_size)``.
        tp_size: tensor-parallel degree; experts are split whole over the same ranks.
        dtype: dtype of every parameter except the float32 ``k_scale``s (float64, float32,
            bfloat16, float16 and float8_e4m3fn all work; loading casts).
        device: where the parameters live.
        fp8: a :class:`wb.FP8Blocks` of every ``*_proj.weight`` tensor: the model serves the
            FP8 checkpoint it declares (:attr:`spec` is then ``fp8.bind(...).spec``): each
            projection weight in float8_e4m3fn beside a float32 ``weight_scale_inv`` (one scale
            per block; TP shards must split into whole blocks), as vLLM's block-FP8 layers.

    Attributes:
        spec: the checkpoint spec ``load_weights`` accepts (``spec_from_config(cfg)``, or the
            FP8 checkpoint's with ``fp8``).

    Raises:
        ValueError: ``cfg`` is not qwen3_moe, ``tp_rank`` is out of range, or ``tp_size`` does not
            divide the heads, experts, dense intermediate size or padded vocabulary (kv heads may
            instead divide ``tp_size``, and are then replicated).

    Examples:
        >>> model = TinyRollout(tp_rank=1, tp_size=2)
        >>> model.model.layers[0].self_attn.qkv_proj.weight.shape  # 2 q heads, 1 k, 1 v, of 8
        torch.Size([32, 32])
        >>> model.model.embed_tokens.weight.shape  # vocab 100 padded to 128, split in 2
        torch.Size([64, 32])
    """

    def __init__(self, cfg: Mapping = TINY, *, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.bfloat16, device="cpu", fp8=None):
        super().__init__()
        d = _check_args(cfg, tp_rank, tp_size)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"`dtype` must be a floating torch.dtype, got {dtype!r}")
        self.spec: wb.CheckpointSpec = spec_from_config(cfg)
        block = None
        if fp8 is not None:  # the FP8 checkpoint: every projection block-scaled
            scaled = fp8.bind(self.spec)
            proj = {n for n in self.spec.names if n.endswith("_proj.weight")}
            if set(scaled.names) != proj:
                raise ValueError(f"TinyRollout serves FP8 for every projection weight (the "
                                 f"*_proj.weight tensors) and nothing else; the declaration "
                                 f"covers {len(scaled.names)} tensors, not those {len(proj)}")
            self.spec, block = scaled.spec, fp8.block
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._num_experts = d.experts
        kw = dict(dtype=dtype, device=device)
        self.model = Model(d, tp_rank, tp_size, fp8=block, **kw)
        self.lm_head = vocab_parallel(d, tp_rank, tp_size, **kw)
        if d.tied:
            # As vLLM does: one parameter, listed once by named_parameters() as embed_tokens.
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, *args, **kwargs):
        raise NotImplementedError("TinyRollout only loads weights; it has no forward pass")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies this rank's slices of full checkpoint tensors into the parameters, in place.

        Tensors may come in any order and any subset; parameter storage is never replaced.

        Args:
            weights: ``(checkpoint name, full tensor)`` pairs, names and shapes as in
                :attr:`spec`; any dtype and device (``copy_`` casts and moves).

        Returns:
            The names of the parameters the tensors were routed to; an expert tensor for another
            rank's expert adds nothing (vLLM skips it the same way).

        Raises:
            KeyError: a name is not a tensor of the checkpoint.
            ValueError: a tensor's shape is not the checkpoint shape of its name.
        """
        params = dict(self.named_parameters())
        expert_mapping = _expert_params_mapping(self._num_experts)
        loaded_params: set[str] = set()
        for name, loaded in weights:
            if name not in self.spec:
                raise KeyError(f"`{name}` is not a tensor of this model's checkpoint "
                               f"({len(self.spec)} tensors, e.g. {self.spec.names[0]!r}); check "
                               f"that the trainer and TinyRollout were built from the same config")
            if tuple(loaded.shape) != self.spec.shape(name):
                raise ValueError(f"`{name}` has shape {tuple(loaded.shape)}, but the checkpoint "
                                 f"shape is {self.spec.shape(name)}; pass the full, unsharded "
                                 f"tensor")
            for param_name, weight_name, shard_id in _STACKED_PARAMS:
                # Expert gate/up names contain "gate_proj"/"up_proj" too; they go to w13 below.
                if weight_name not in name or "mlp.experts" in name:
                    continue
                target = name.replace(weight_name, param_name)
                params[target].weight_loader(params[target], loaded, shard_id)
                loaded_params.add(target)
                break
            else:
                for param_name, weight_name, expert_id, shard_id in expert_mapping:
                    if weight_name not in name:
                        continue
                    target = name.replace(weight_name, param_name)
                    if params[target].weight_loader(params[target], loaded, name,
                                                    shard_id=shard_id, expert_id=expert_id):
                        loaded_params.add(target)
                    break
                else:
                    params[name].weight_loader(params[name], loaded)
                    loaded_params.add(name)
        return loaded_params


# --- the oracle ----------------------------------------------------------------------------------
def expected_maps(cfg: Mapping = TINY, *, tp_rank: int = 0,
                  tp_size: int = 1) -> dict[str, np.ndarray]:
    """The global checkpoint id each element of each :class:`TinyRollout` parameter must hold.

    Pure numpy, written from the layout (module docstring), not from the model: slices and
    concatenations of ``spec.ids(name)``.

    Args:
        cfg: as for :class:`TinyRollout`.
        tp_rank: as for :class:`TinyRollout`.
        tp_size: as for :class:`TinyRollout`.

    Returns:
        ``{parameter name: int64 array of the parameter's shape}``, ``-1`` where an element comes
        from no checkpoint tensor (vocab padding rows, ``k_scale``).

    Raises:
        ValueError: as for :class:`TinyRollout`.

    Examples:
        >>> maps = expected_maps(tp_rank=1, tp_size=2)
        >>> maps["model.embed_tokens.weight"][35:39, 0]  # rows 99..102 of the padded 128
        array([3168,   -1,   -1,   -1])
    """
    d = _check_args(cfg, tp_rank, tp_size)
    spec = spec_from_config(cfg)
    r, tp = tp_rank, tp_size
    kv, hd = d.kv_heads, d.head_dim
    out: dict[str, np.ndarray] = {}

    def vocab_rows(name: str) -> np.ndarray:
        ids = spec.ids(name)
        padded = np.full((d.padded_vocab(VOCAB_PADDING), ids.shape[1]), -1, dtype=np.int64)
        padded[:ids.shape[0]] = ids
        return np.split(padded, tp)[r]

    def kv_rows(name: str) -> np.ndarray:
        heads = spec.ids(name).reshape(kv, hd, -1)
        mine = [r // (tp // kv)] if tp >= kv else range(r * kv // tp, (r + 1) * kv // tp)
        return np.concatenate([heads[g] for g in mine])

    out["model.embed_tokens.weight"] = vocab_rows("model.embed_tokens.weight")
    for i in range(d.layers):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm",
                     "self_attn.k_norm"):
            out[p + norm + ".weight"] = spec.ids(p + norm + ".weight")
        out[p + "self_attn.qkv_proj.weight"] = np.concatenate([
            np.split(spec.ids(p + "self_attn.q_proj.weight"), tp)[r],
            kv_rows(p + "self_attn.k_proj.weight"), kv_rows(p + "self_attn.v_proj.weight")])
        out[p + "self_attn.o_proj.weight"] = np.split(spec.ids(p + "self_attn.o_proj.weight"), tp,
                                                      axis=1)[r]
        out[p + "self_attn.attn.k_scale"] = np.full((1,), -1, dtype=np.int64)
        if i < d.n_dense:
            out[p + "mlp.gate_up_proj.weight"] = np.concatenate([
                np.split(spec.ids(p + "mlp.gate_proj.weight"), tp)[r],
                np.split(spec.ids(p + "mlp.up_proj.weight"), tp)[r]])
            out[p + "mlp.down_proj.weight"] = np.split(spec.ids(p + "mlp.down_proj.weight"), tp,
                                                       axis=1)[r]
        else:
            out[p + "mlp.gate.weight"] = spec.ids(p + "mlp.gate.weight")
            E = d.experts
            mine = range(r * E // tp, (r + 1) * E // tp)
            e, f = p + "mlp.experts.", p + "mlp.experts.routed_experts."
            out[f + "w13_weight"] = np.stack([
                np.concatenate([spec.ids(f"{e}{j}.gate_proj.weight"),
                                spec.ids(f"{e}{j}.up_proj.weight")]) for j in mine])
            out[f + "w2_weight"] = np.stack([spec.ids(f"{e}{j}.down_proj.weight") for j in mine])
    out["model.norm.weight"] = spec.ids("model.norm.weight")
    if "lm_head.weight" in spec:  # absent when tied: the model then has one shared parameter
        out["lm_head.weight"] = vocab_rows("lm_head.weight")
    return out


def checkpoint_tensors(spec: wb.CheckpointSpec, rng: np.random.Generator | None = None,
                       dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random full checkpoint tensors for demos: standard normal values, cast to ``dtype``.

    Args:
        spec: names and shapes of the tensors.
        rng: source of the values; ``np.random.default_rng(0)`` when None, so runs repeat.
        dtype: dtype of every tensor.

    Returns:
        ``{name: tensor of spec.shape(name)}`` in spec order, on the CPU.

    Examples:
        >>> t = checkpoint_tensors(spec_from_config(TINY))
        >>> t["lm_head.weight"].shape, t["lm_head.weight"].dtype
        (torch.Size([100, 32]), torch.bfloat16)
    """
    rng = np.random.default_rng(0) if rng is None else rng
    return {name: torch.from_numpy(rng.standard_normal(spec.shape(name), dtype=np.float32))
            .to(dtype) for name in spec.names}


def spread_device(local_rank: int) -> int:
    """The CUDA device for a node's worker of ``local_rank``: ``local_rank`` mod the number of
    devices, so a node's workers spread over the GPUs (and its stage 3 crosses NVLink).

    Raises:
        RuntimeError: torch sees no CUDA device.
    """
    n = torch.cuda.device_count()
    if n == 0:
        raise RuntimeError("no CUDA device torch can use (--cuda needs GPUs)")
    return int(local_rank) % n


def sparse_train_step_(model: nn.Module, step: int) -> None:
    """:func:`wb.testing.versions.sparse_step` on every parameter, in place: about one element in
    :data:`~wb.testing.versions.SPARSE_EVERY` changes (what ``python -m wb demo --delta``
    trains with)."""
    from wb.testing import SPARSE_EVERY

    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    with torch.no_grad():
        for p in model.parameters():
            b = p.data.view(ints[p.element_size()])
            pick = ((b ^ (b >> 7)) & (SPARSE_EVERY - 1)) == (step & (SPARSE_EVERY - 1))
            p.copy_(torch.where(pick, p * -2.0, p))


def train_step_(model: nn.Module, factor: float = -2.0) -> None:
    """The reference trainer's update, in place like an optimizer's: ``w <- factor * w`` for every
    parameter (exact in any float dtype for a power of two), so a receiver can predict the weights
    of any step from the checkpoint alone."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(factor)
