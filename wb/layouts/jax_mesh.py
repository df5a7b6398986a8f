"""JAX trainer layouts on a ``(dp, fsdp, tp)`` device mesh, flax-style names, ``[in, out]`` kernels.

(Named ``jax_mesh``, not ``jax``: the catalogue never imports JAX, and a sibling module called
``jax`` would read as if it did.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal

import numpy as np

from wb.data.layout import BufferSpec, Layout, Role
from wb.data.spec import CheckpointSpec
from wb.errors import SpecError
from wb.layouts.blocks import (broadcast_blocks, buffer_spec, expert_offsets, slice_block,
                               transposed_block, whole_tensor)
from wb.layouts.dims import ModelDims
from wb.layouts.presets import spec_from_config
from wb.layouts.shards import (Entry, check_divides, check_positive, check_world, shard_buffers,
                               worker_layouts)

__all__ = ["jax_trainer"]

_FN = "jax_trainer"  # the generator that error messages name
_FIX_FSDP, _FIX_TP = "change the fsdp axis", "change the tp axis"

#: A mesh axis that shards one dimension of a kernel (None: that dimension is whole).
_Axis = Literal["fsdp", "tp"] | None


def jax_trainer(cfg: Mapping, *, dp: int, fsdp: int, tp: int, nodes: Sequence[str],
                gpus_per_node: int = 8, first_rank: int = 0) -> list[Layout]:
    """JAX trainer layouts on a ``Mesh(devices.reshape(dp, fsdp, tp), ("dp", "fsdp", "tp"))``.

    Device ``rank - first_rank = (dp_i * fsdp + fsdp_i) * tp + tp_i``; dp replicas hold identical
    shards (shared BufferSpec objects). Parameters are named like a flax ``params`` tree
    (``params/layers_{i}/attn/q/kernel``); kernels are ``[in, out]`` (the HF weight transposed):

    ======================================  =====================  ==============================
    parameter                               shape                  PartitionSpec
    ======================================  =====================  ==============================
    ``embed/embedding``                     ``[Vp, h]``            ``(tp, fsdp)``
    ``layers_{i}/{input,post}_norm/scale``  ``[h]``                replicated
    ``attn/{q,k,v}/kernel`` (GQA)           ``[h, heads, hd]``     ``(fsdp, tp, None)``
    ``attn/o/kernel`` (GQA)                 ``[nh, hd, h]``        ``(tp, None, fsdp)``
    ``attn/{q,k}_norm/scale`` (GQA)         ``[hd]``               replicated
    ``attn/{wq_a,wkv_a}/kernel`` (MLA)      ``[h, r]``             ``(fsdp, None)``
    ``attn/{wq,wq_b,wkv_b}/kernel`` (MLA)   ``[in, heads * d]``    ``(fsdp, tp)``
    ``attn/out/kernel`` (MLA)               ``[nh * v_head, h]``   ``(tp, fsdp)``
    ``attn/{q,kv}_norm/scale`` (MLA)        ``[r]``                replicated
    ``mlp/{wi_0,wi_1}/kernel`` (gate, up)   ``[h, I]``             ``(fsdp, tp)``
    ``mlp/wo/kernel``                       ``[I, h]``             ``(tp, fsdp)``
    ``mlp/router/kernel``, ``router/bias``  ``[h, E]``, ``[E]``    ``(fsdp, None)``, replicated
    ``mlp/experts/{wi_0,wi_1}``             ``[E, h, mi]``         ``(tp, fsdp, None)``
    ``mlp/experts/wo``                      ``[E, mi, h]``         ``(tp, fsdp, None)``
    ``mlp/shared_experts/...``              as the dense MLP       as the dense MLP
    ``final_norm/scale``                    ``[h]``                replicated
    ``lm_head/kernel``                      ``[h, Vp]``            ``(fsdp, tp)``
    ======================================  =====================  ==============================

    ``Vp`` is the vocabulary rounded up to a multiple of ``tp`` (padding holds ``-1``). GQA k/v
    kernels are split over tp when ``kv % tp == 0`` and replicated over tp otherwise (their
    PartitionSpec is then ``(fsdp, None, None)``). Every other sharded dimension must divide.

    Args:
        cfg: model config (:func:`wb.layouts.presets.load_config`).
        dp: replicas (data parallel, identical parameters).
        fsdp: parameter sharding axis (the ``h`` / inner dimension of kernels).
        tp: tensor parallel axis (heads, MLP width, experts, vocabulary).
        nodes: trainer node names; ``dp * fsdp * tp`` must equal ``len(nodes) * gpus_per_node``.
        gpus_per_node: GPUs per node.
        first_rank: global rank of the first device; ranks are consecutive.

    Returns:
        One trainer :class:`~wb.data.layout.Layout` per device, in rank order.

    Raises:
        SpecError: the mesh does not fill the nodes, or an axis does not divide a dimension.

    Examples:
        >>> from wb.layouts.presets import TINY
        >>> lays = jax_trainer(TINY, dp=1, fsdp=2, tp=2, nodes=["trainer0"], gpus_per_node=4)
        >>> lays[3].buffers["params/layers_1/mlp/experts/wi_0"].shape   # [E/tp, h/fsdp, mi]
        (2, 16, 16)
    """
    dims = ModelDims.of(cfg)
    spec = spec_from_config(cfg)
    world = _check_mesh(dims, dp=dp, fsdp=fsdp, tp=tp, nodes=nodes, gpus_per_node=gpus_per_node)
    mesh = _MeshShards(spec, dims, fsdp=fsdp, tp=tp)
    entries = [*mesh.embedding(),
               *(entry for i in range(dims.layers) for entry in mesh.decoder_layer(i)),
               *mesh.head()]
    distinct = fsdp * tp  # dp replicas share the shards of one (fsdp, tp) plane
    shards = shard_buffers(entries, distinct)
    return worker_layouts([shards[g % distinct] for g in range(world)], Role.TRAINER, first_rank,
                          lambda g: (nodes[g // gpus_per_node], g % gpus_per_node))


def _check_mesh(dims: ModelDims, *, dp: int, fsdp: int, tp: int, nodes: Sequence[str],
                gpus_per_node: int) -> int:
    """The device count of ``nodes``, once the mesh fills it and its axes split the model."""
    world = check_world(_FN, nodes, gpus_per_node)
    check_positive(_FN, dp=dp, fsdp=fsdp, tp=tp)
    if dp * fsdp * tp != world:
        raise SpecError(f"{_FN}: the mesh dp * fsdp * tp = {dp} * {fsdp} * {tp} must equal the "
                        f"{world} devices of `nodes` ({len(nodes)} x {gpus_per_node})")
    check_divides("hidden_size", dims.hidden, fsdp, "fsdp", _FIX_FSDP)
    check_divides("num_attention_heads", dims.heads, tp, "tp", _FIX_TP)
    if dims.mla:
        if dims.q_lora_rank:
            check_divides("q_lora_rank", dims.q_lora_rank, fsdp, "fsdp", _FIX_FSDP)
        check_divides("kv_lora_rank", dims.kv_lora_rank, fsdp, "fsdp", _FIX_FSDP)
    if dims.n_dense:
        check_divides("intermediate_size", dims.intermediate, tp, "tp", _FIX_TP)
    if dims.has_moe:
        check_divides("the number of routed experts", dims.experts, tp, "tp", _FIX_TP)
        check_divides("moe_intermediate_size", dims.moe_intermediate, fsdp, "fsdp", _FIX_FSDP)
        if dims.n_shared:
            check_divides("the shared-expert width", dims.shared_width, tp, "tp", _FIX_TP)
    return world


@dataclass(frozen=True, slots=True)
class _MeshShards:
    """The parameters of one ``(fsdp, tp)`` plane of the mesh, one method per kind of tensor.

    Shard ``x = fsdp_i * tp + tp_i`` is the device at mesh coordinates ``(fsdp_i, tp_i)``.
    ``embedding``, ``decoder_layer`` and ``head`` give :data:`~wb.layouts.shards.Entry` values in
    module order; the ``*_shard`` methods build the BufferSpec of one shard ``x``.
    """

    spec: CheckpointSpec
    dims: ModelDims
    fsdp: int  # the axis that shards h (or the inner dimension of a kernel)
    tp: int  # the axis that shards heads, MLP width, experts and the vocabulary

    def embedding(self) -> list[Entry]:
        """``embed/embedding`` ``[Vp, h]``, P(tp, fsdp)."""
        return [("params/embed/embedding", self.embedding_shard)]

    def decoder_layer(self, i: int) -> list[Entry]:
        """Layer ``i``: norms, attention, and the dense MLP or the MoE block."""
        params, layer = f"params/layers_{i}/", f"model.layers.{i}."
        return [(params + "input_norm/scale", self.whole(layer + "input_layernorm.weight")),
                *self.attention(params + "attn/", layer + "self_attn."),
                (params + "post_norm/scale", self.whole(layer + "post_attention_layernorm.weight")),
                *(self.dense_mlp(params + "mlp/", layer + "mlp.") if i < self.dims.n_dense
                  else self.moe_mlp(i))]

    def head(self) -> list[Entry]:
        """``final_norm/scale`` and (untied) ``lm_head/kernel`` ``[h, Vp]``, P(fsdp, tp)."""
        entries = [("params/final_norm/scale", self.whole("model.norm.weight"))]
        if not self.dims.tied:
            entries.append(("params/lm_head/kernel", self.lm_head_shard))
        return entries

    @property
    def hidden_rows(self) -> int:
        """Rows of ``h`` per fsdp shard."""
        return self.dims.hidden // self.fsdp

    @property
    def vocab_rows(self) -> int:
        """Vocabulary rows per tp shard (the vocabulary padded to a multiple of ``tp``)."""
        return self.dims.padded_vocab(self.tp) // self.tp

    def whole(self, name: str) -> BufferSpec:
        """Tensor ``name``, replicated on every device."""
        return whole_tensor(self.spec, name)

    def embedding_shard(self, x: int) -> BufferSpec:
        """Shard ``x`` of ``embed_tokens`` ``[Vp, h]``: vocabulary rows over tp, h over fsdp."""
        f, t = divmod(x, self.tp)
        v_rows, h_rows = self.vocab_rows, self.hidden_rows
        return buffer_spec((v_rows, h_rows), slice_block(
            self.spec, "model.embed_tokens.weight", rows=(t * v_rows, (t + 1) * v_rows),
            cols=(f * h_rows, (f + 1) * h_rows)), self.dims.dtype)

    def lm_head_shard(self, x: int) -> BufferSpec:
        """Shard ``x`` of the ``[h, Vp]`` kernel of ``lm_head``: h over fsdp, vocabulary over tp."""
        f, t = divmod(x, self.tp)
        v_rows, h_rows = self.vocab_rows, self.hidden_rows
        return buffer_spec((h_rows, v_rows), transposed_block(
            self.spec, "lm_head.weight", out=(t * v_rows, (t + 1) * v_rows),
            inp=(f * h_rows, (f + 1) * h_rows)), self.dims.dtype)

    def kernel(self, name: str, inp: _Axis, out: _Axis) -> partial[BufferSpec]:
        """The ``[in, out]`` kernel of HF weight ``name``, P(``inp``, ``out``), per shard."""
        return partial(self.kernel_shard, name, inp, out)

    def kernel_shard(self, name: str, inp: _Axis, out: _Axis, x: int) -> BufferSpec:
        """Shard ``x`` of the ``[in, out]`` kernel of HF weight ``name`` ``[out, in]``."""
        f, t = divmod(x, self.tp)
        size = {"fsdp": self.fsdp, "tp": self.tp, None: 1}
        index = {"fsdp": f, "tp": t, None: 0}
        out_rows, in_rows = self.spec.shape(name)
        in_local, out_local = in_rows // size[inp], out_rows // size[out]
        i0, o0 = index[inp] * in_local, index[out] * out_local
        return buffer_spec((in_local, out_local), transposed_block(
            self.spec, name, out=(o0, o0 + out_local), inp=(i0, i0 + in_local)), self.dims.dtype)

    def attention(self, params: str, prefix: str) -> list[Entry]:
        """The ``attn/`` parameters of one layer, from HF ``self_attn.`` weights ``prefix``."""
        if self.dims.mla:
            return self.mla_attention(params, prefix)
        return self.gqa_attention(params, prefix)

    def gqa_attention(self, params: str, prefix: str) -> list[Entry]:
        """qwen3_moe: q/k/v ``[h, heads, hd]``, o ``[nh, hd, h]``, per-head norms whole."""
        # k/v split over tp only when it divides the kv heads; otherwise each tp rank holds all
        heads, kv_heads = self.dims.heads, self.dims.kv_heads
        kv_over_tp = kv_heads % self.tp == 0
        return [(params + "q/kernel", self.heads_kernel(prefix + "q_proj.weight", heads, True)),
                (params + "k/kernel",
                 self.heads_kernel(prefix + "k_proj.weight", kv_heads, kv_over_tp)),
                (params + "v/kernel",
                 self.heads_kernel(prefix + "v_proj.weight", kv_heads, kv_over_tp)),
                (params + "o/kernel", partial(self.o_kernel_shard, prefix + "o_proj.weight")),
                (params + "q_norm/scale", self.whole(prefix + "q_norm.weight")),
                (params + "k_norm/scale", self.whole(prefix + "k_norm.weight"))]

    def heads_kernel(self, name: str, heads: int, over_tp: bool) -> partial[BufferSpec]:
        """``[h, heads, hd]`` = HF ``[heads * hd, h]`` transposed, P(fsdp, tp or None, None)."""
        return partial(self.heads_kernel_shard, name, heads // self.tp if over_tp else heads,
                       over_tp)

    def heads_kernel_shard(self, name: str, heads: int, over_tp: bool, x: int) -> BufferSpec:
        """Shard ``x`` of a ``[h, heads, hd]`` kernel holding ``heads`` heads."""
        f, t = divmod(x, self.tp)
        h, hd, h_rows = self.dims.hidden, self.dims.head_dim, self.hidden_rows
        first_head = t * heads if over_tp else 0
        base = self.spec.offset(name) + first_head * hd * h + f * h_rows
        if heads == 1:  # one head: the rows of the 2-D view are consecutive inputs
            blocks = broadcast_blocks(0, h_rows, 0, hd, base, 1, h)
        else:  # one block per input row i: rows (i, n) for the local heads n
            i = np.arange(h_rows, dtype=np.int64)
            blocks = broadcast_blocks(i * heads, heads, 0, hd, base + i, hd * h, h)
        return buffer_spec((h_rows, heads, hd), blocks, self.dims.dtype)

    def o_kernel_shard(self, name: str, x: int) -> BufferSpec:
        """Shard ``x`` of o ``[nh, hd, h]`` (HF ``[h, nh * hd]``), P(tp, None, fsdp)."""
        f, t = divmod(x, self.tp)
        nh, hd, h_rows = self.dims.heads, self.dims.head_dim, self.hidden_rows
        heads = nh // self.tp
        base = self.spec.offset(name) + f * h_rows * nh * hd + t * heads * hd
        return buffer_spec((heads, hd, h_rows),
                           broadcast_blocks(0, heads * hd, 0, h_rows, base, 1, nh * hd),
                           self.dims.dtype)

    def mla_attention(self, params: str, prefix: str) -> list[Entry]:
        """deepseek_v3: down-projections P(fsdp, None), up P(fsdp, tp), out P(tp, fsdp)."""
        if self.dims.q_lora_rank:
            queries = [
                (params + "wq_a/kernel", self.kernel(prefix + "q_a_proj.weight", "fsdp", None)),
                (params + "q_norm/scale", self.whole(prefix + "q_a_layernorm.weight")),
                (params + "wq_b/kernel", self.kernel(prefix + "q_b_proj.weight", "fsdp", "tp"))]
        else:
            queries = [(params + "wq/kernel", self.kernel(prefix + "q_proj.weight", "fsdp", "tp"))]
        return [*queries,
                (params + "wkv_a/kernel",
                 self.kernel(prefix + "kv_a_proj_with_mqa.weight", "fsdp", None)),
                (params + "kv_norm/scale", self.whole(prefix + "kv_a_layernorm.weight")),
                (params + "wkv_b/kernel", self.kernel(prefix + "kv_b_proj.weight", "fsdp", "tp")),
                (params + "out/kernel", self.kernel(prefix + "o_proj.weight", "tp", "fsdp"))]

    def dense_mlp(self, params: str, prefix: str) -> list[Entry]:
        """``wi_0`` (gate), ``wi_1`` (up) P(fsdp, tp) and ``wo`` (down) P(tp, fsdp)."""
        return [(params + "wi_0/kernel", self.kernel(prefix + "gate_proj.weight", "fsdp", "tp")),
                (params + "wi_1/kernel", self.kernel(prefix + "up_proj.weight", "fsdp", "tp")),
                (params + "wo/kernel", self.kernel(prefix + "down_proj.weight", "tp", "fsdp"))]

    def moe_mlp(self, i: int) -> list[Entry]:
        """Layer ``i``'s router (and deepseek_v3's bias), routed and shared experts."""
        params, prefix = f"params/layers_{i}/mlp/", f"model.layers.{i}.mlp."
        entries = [(params + "router/kernel", self.kernel(prefix + "gate.weight", "fsdp", None))]
        if self.dims.mla:
            entries.append((params + "router/bias",
                            self.whole(prefix + "gate.e_score_correction_bias")))
        entries += self.routed_experts(i)
        if self.dims.n_shared:
            entries += self.dense_mlp(params + "shared_experts/", prefix + "shared_experts.")
        return entries

    def routed_experts(self, i: int) -> list[Entry]:
        """Layer ``i``'s experts ``wi_0``, ``wi_1`` and ``wo``, P(tp, fsdp, None)."""
        gate, up, down = expert_offsets(self.spec, i, self.dims.experts)
        params = f"params/layers_{i}/mlp/experts/"
        return [(params + "wi_0", partial(self.experts_in_shard, gate)),
                (params + "wi_1", partial(self.experts_in_shard, up)),
                (params + "wo", partial(self.experts_out_shard, down))]

    def experts_in_shard(self, offsets: np.ndarray, x: int) -> BufferSpec:
        """Shard ``x`` of ``[E, h, mi]`` from gate_proj (or up_proj) first ids ``offsets``."""
        f, t = divmod(x, self.tp)
        h, width, h_rows = self.dims.hidden, self.dims.moe_intermediate, self.hidden_rows
        experts = self.dims.experts // self.tp
        j = np.arange(experts, dtype=np.int64)
        return buffer_spec((experts, h_rows, width), broadcast_blocks(
            j * h_rows, h_rows, 0, width, offsets[t * experts:(t + 1) * experts] + f * h_rows,
            1, h), self.dims.dtype)

    def experts_out_shard(self, down: np.ndarray, x: int) -> BufferSpec:
        """Shard ``x`` of ``[E, mi, h]`` from the down_proj first ids ``down``."""
        f, t = divmod(x, self.tp)
        h, width = self.dims.hidden, self.dims.moe_intermediate
        experts, rows = self.dims.experts // self.tp, width // self.fsdp
        j = np.arange(experts, dtype=np.int64)
        return buffer_spec((experts, rows, h), broadcast_blocks(
            j * rows, rows, 0, h, down[t * experts:(t + 1) * experts] + f * rows, 1, width),
            self.dims.dtype)
