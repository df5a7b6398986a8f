"""vLLM rollout layouts: identical engine replicas with TP attention (data-parallel attention when a
replica has more GPUs than ``tp``) and expert parallelism for routed experts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from wb.data.layout import BufferSpec, Layout, Role
from wb.data.spec import CheckpointSpec
from wb.errors import SpecError
from wb.layouts.blocks import (buffer_spec, expert_offsets, slice_block, stacked_fc1, stacked_fc2,
                               whole_tensor)
from wb.layouts.dims import ModelDims
from wb.layouts.presets import spec_from_config
from wb.layouts.shards import (Entry, check_divides, check_positive, shard_buffers, tp_mlp,
                               worker_layouts)

__all__ = ["vllm_rollout", "VOCAB_PADDING"]

#: vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: ``VocabParallelEmbedding`` pads the vocabulary to a
#: multiple of it before splitting the rows over TP.
VOCAB_PADDING = 64

_FN = "vllm_rollout"  # the generator that error messages name
_FIX_TP = "pick a tensor parallel size that divides it"

#: The buffers of one stretch of modules, as ``n`` shards (``n`` = ``tp`` or the replica's GPU
#: count): replica GPU ``g`` takes shard ``g % n``, which is its TP rank when ``n = tp`` because
#: the TP ranks of a group are consecutive GPUs.
_Segment = list[dict[str, BufferSpec]]


def vllm_rollout(cfg: Mapping, *, tp: int, ep: int, replicas: int, nodes_per_replica: int = 1,
                 gpus_per_replica: int | None = None, node_prefix: str = "rollout",
                 gpus_per_node: int = 8, first_rank: int) -> list[Layout]:
    """vLLM rollout layouts: ``replicas`` identical engines, one Layout per GPU.

    A replica has ``G = nodes_per_replica * gpus_per_node`` GPUs (or ``gpus_per_replica`` when
    several replicas share a node). Replica ``k`` uses rollout GPUs ``[k * G, (k + 1) * G)``;
    rollout GPU ``q`` is on node ``f"{node_prefix}{q // gpus_per_node}"``. Within a replica, GPU
    ``g`` is TP rank ``g % tp`` of attention, dense MLPs, shared experts and embeddings (TP ranks
    are consecutive GPUs; with ``G > tp`` the ``G / tp`` groups hold identical copies:
    data-parallel attention). Routed experts follow vLLM's ``FusedMoEParallelConfig``: with
    ``ep == G`` (``enable_expert_parallel``) GPU ``g`` holds whole experts
    ``[g * E // G + min(g, E % G) …)`` (vLLM's linear placement; the first ``E % G`` ranks get one
    more); with ``ep == 1`` every expert is TP-split over all ``G`` GPUs (TP flattened across DP).

    Buffers (vLLM parameter names):

    - ``model.embed_tokens.weight``, ``lm_head.weight``: ``[Vp / tp, h]``, ``Vp`` = vocabulary
      rounded up to a multiple of 64; padding rows hold ``-1``.
    - qwen3_moe: ``self_attn.qkv_proj.weight`` ``[(nh / tp + 2 * max(1, kv / tp)) * hd, h]`` =
      the rank's q heads, then its k heads, then its v heads (with ``tp > kv`` rank ``r`` uses kv
      head ``r // (tp // kv)``, replicated); ``self_attn.o_proj.weight`` ``[h, nh * hd / tp]``;
      ``self_attn.{q,k}_norm.weight`` replicated.
    - deepseek_v3: ``self_attn.fused_qkv_a_proj.weight`` = [q_a_proj; kv_a_proj_with_mqa] rows,
      replicated (without q LoRA: ``self_attn.q_proj.weight`` TP-split on heads and
      ``self_attn.kv_a_proj_with_mqa.weight`` replicated); ``self_attn.{q_a,kv_a}_layernorm.weight``
      replicated; ``self_attn.{q_b,kv_b}_proj.weight`` TP-split on heads;
      ``self_attn.o_proj.weight`` ``[h, nh * v_head / tp]``.
    - dense layers: ``mlp.gate_up_proj.weight`` ``[2 * I / tp, h]`` (gate shard, then up shard),
      ``mlp.down_proj.weight`` ``[h, I / tp]``.
    - MoE layers: ``mlp.gate.weight`` ``[E, h]`` (and ``mlp.gate.e_score_correction_bias``)
      replicated; ``mlp.experts.routed_experts.w13_weight`` ``[E_local, 2 * mi_local, h]`` (expert ``j``: gate
      rows then up rows), ``mlp.experts.routed_experts.w2_weight`` ``[E_local, h, mi_local]``;
      ``mlp.shared_experts.{gate_up_proj,down_proj}.weight`` TP-split like a dense MLP.
    - ``model.layers.{i}.{input,post_attention}_layernorm.weight``, ``model.norm.weight``
      replicated.

    One replica is built; the others reuse its BufferSpec objects (only the Worker differs).

    Args:
        cfg: model config (:func:`wb.layouts.presets.load_config`).
        tp: tensor parallel size of attention / dense layers (divides the replica's GPUs).
        ep: expert parallel size: the replica's GPU count, or 1 (experts TP-split instead).
        replicas: number of engines.
        nodes_per_replica: nodes per replica (when ``gpus_per_replica`` is not given).
        gpus_per_replica: GPUs per replica when several replicas share a node (must divide
            ``gpus_per_node``; then ``nodes_per_replica`` must be 1).
        node_prefix: node names are ``f"{node_prefix}{index}"``, indices from 0.
        gpus_per_node: GPUs per node.
        first_rank: global rank of the first rollout GPU; ranks are consecutive.

    Returns:
        ``replicas * G`` rollout Layouts in rank order, replica after replica.

    Raises:
        SpecError: a size does not divide what it splits, or ``ep`` is neither 1 nor ``G``.

    Examples:
        >>> from wb.layouts.presets import TINY
        >>> lays = vllm_rollout(TINY, tp=2, ep=2, replicas=2, gpus_per_replica=2,
        ...                     gpus_per_node=4, first_rank=4)
        >>> [(w.worker.rank, w.worker.node, w.worker.local_rank) for w in lays]
        [(4, 'rollout0', 0), (5, 'rollout0', 1), (6, 'rollout0', 2), (7, 'rollout0', 3)]
        >>> lays[1].buffers["model.layers.1.mlp.experts.routed_experts.w13_weight"].shape   # [E/ep, 2*mi, h]
        (2, 32, 32)
    """
    dims = ModelDims.of(cfg)
    spec = spec_from_config(cfg)
    gpus = _replica_gpus(tp=tp, ep=ep, replicas=replicas, nodes_per_replica=nodes_per_replica,
                         gpus_per_replica=gpus_per_replica, gpus_per_node=gpus_per_node)
    _check_model_splits(dims, tp=tp, ep=ep, gpus=gpus)
    replica = _ReplicaShards(spec, dims, tp=tp, ep=ep, gpus=gpus)
    segments = [replica.embedding(),
                *(segment for i in range(dims.layers) for segment in replica.decoder_layer(i)),
                replica.head()]
    per_gpu = [_gpu_buffers(segments, g) for g in range(gpus)]
    # every replica reuses the first one's BufferSpec objects: only the Worker differs
    return worker_layouts([per_gpu[q % gpus] for q in range(replicas * gpus)], Role.ROLLOUT,
                          first_rank,
                          lambda q: (f"{node_prefix}{q // gpus_per_node}", q % gpus_per_node))


def _replica_gpus(*, tp: int, ep: int, replicas: int, nodes_per_replica: int,
                  gpus_per_replica: int | None, gpus_per_node: int) -> int:
    """The GPU count of one replica, after checking the parallel sizes against each other."""
    check_positive(_FN, tp=tp, ep=ep, replicas=replicas, nodes_per_replica=nodes_per_replica,
                   gpus_per_node=gpus_per_node)
    if gpus_per_replica is None:
        gpus = nodes_per_replica * gpus_per_node
    else:
        check_positive(_FN, gpus_per_replica=gpus_per_replica)
        gpus = gpus_per_replica
        if gpus != nodes_per_replica * gpus_per_node and (nodes_per_replica != 1
                                                          or gpus_per_node % gpus):
            raise SpecError(f"{_FN}: `gpus_per_replica`={gpus} packs several replicas on a node, "
                            f"so it must divide `gpus_per_node`={gpus_per_node} with "
                            f"`nodes_per_replica`=1 (got {nodes_per_replica}); for replicas of "
                            f"whole nodes pass `nodes_per_replica` only")
    if gpus % tp:
        raise SpecError(f"{_FN}: `tp`={tp} must divide the {gpus} GPUs of a replica (the rest of "
                        f"the replica's GPUs are data-parallel attention)")
    if ep not in (1, gpus):
        raise SpecError(f"{_FN}: `ep`={ep} must be the replica's GPU count {gpus} (vLLM expert "
                        f"parallelism spans TP x DP) or 1 (experts TP-split over the {gpus} GPUs)")
    return gpus


def _check_model_splits(dims: ModelDims, *, tp: int, ep: int, gpus: int) -> None:
    """Checks that ``tp`` (and, with ``ep == 1``, the replica's ``gpus``) split the model evenly."""
    check_divides("num_attention_heads", dims.heads, tp, "tp", _FIX_TP)
    if not dims.mla and dims.kv_heads % tp and tp % dims.kv_heads:
        raise SpecError(f"{_FN}: `tp`={tp} and num_key_value_heads={dims.kv_heads}: one must "
                        f"divide the other (vLLM splits or replicates kv heads)")
    if dims.n_dense:
        check_divides("intermediate_size", dims.intermediate, tp, "tp", _FIX_TP)
    if dims.has_moe and dims.n_shared:
        check_divides("the shared-expert width", dims.shared_width, tp, "tp", _FIX_TP)
    if dims.has_moe and ep == 1:
        check_divides("moe_intermediate_size (experts TP-split over the replica)",
                      dims.moe_intermediate, gpus, "gpus of a replica",
                      "use ep equal to the replica's GPU count")
    check_divides(f"the vocabulary padded to a multiple of {VOCAB_PADDING}",
                  dims.padded_vocab(VOCAB_PADDING), tp, "tp", _FIX_TP)


def _gpu_buffers(segments: Sequence[_Segment], g: int) -> dict[str, BufferSpec]:
    """Replica GPU ``g``'s buffers in module order: shard ``g % n`` of each ``n``-shard segment."""
    buffers: dict[str, BufferSpec] = {}
    for shards in segments:
        buffers.update(shards[g % len(shards)])
    return buffers


@dataclass(frozen=True, slots=True)
class _ReplicaShards:
    """The buffers of one vLLM replica, one method per kind of tensor.

    ``embedding``, ``decoder_layer`` and ``head`` give the segments of the replica in module
    order; the other methods give :data:`~wb.layouts.shards.Entry` lists, and the ``*_shard``
    methods the BufferSpec of one TP rank ``t`` or replica GPU ``g``.
    """

    spec: CheckpointSpec
    dims: ModelDims
    tp: int  # TP size of attention, dense MLPs, shared experts and the vocabulary
    ep: int  # 1 (every routed expert split over the replica's GPUs) or `gpus` (whole experts)
    gpus: int  # GPUs of one replica

    def embedding(self) -> _Segment:
        """``model.embed_tokens.weight``, padded vocabulary rows split over TP."""
        return shard_buffers([self.tp_rows("model.embed_tokens.weight", self.padded_vocab)],
                             self.tp)

    def decoder_layer(self, i: int) -> list[_Segment]:
        """Layer ``i``: attention, norms, MLP or router over TP; experts over the GPUs."""
        layer = f"model.layers.{i}."
        entries = [self.whole(layer + "input_layernorm.weight"),
                   *self.attention(layer + "self_attn."),
                   self.whole(layer + "post_attention_layernorm.weight")]
        if i < self.dims.n_dense:
            return [shard_buffers(entries + self.dense_mlp(layer + "mlp.", self.dims.intermediate),
                                  self.tp)]
        segments = [shard_buffers(entries + self.router(layer + "mlp."), self.tp),
                    shard_buffers(self.routed_experts(i), self.gpus)]
        if self.dims.n_shared:
            shared = self.dense_mlp(layer + "mlp.shared_experts.", self.dims.shared_width)
            segments.append(shard_buffers(shared, self.tp))
        return segments

    def head(self) -> _Segment:
        """``model.norm.weight`` and ``lm_head.weight`` (padded vocabulary rows split over TP)."""
        entries = [self.whole("model.norm.weight")]
        if not self.dims.tied:  # tied: vLLM's lm_head shares embed_tokens, no buffer of its own
            entries.append(self.tp_rows("lm_head.weight", self.padded_vocab))
        return shard_buffers(entries, self.tp)

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding and the LM head: the vocabulary padded as vLLM pads it."""
        return self.dims.padded_vocab(VOCAB_PADDING)

    def whole(self, name: str) -> Entry:
        """Tensor ``name``, replicated on every rank."""
        return name, whole_tensor(self.spec, name)

    def tp_rows(self, name: str, rows: int | None = None) -> Entry:
        """Tensor ``name`` split in rows over TP (``rows``: the padded row count, if padded)."""
        rows = self.spec.shape(name)[0] if rows is None else rows
        return name, partial(self.row_shard, name, rows // self.tp)

    def tp_columns(self, name: str) -> Entry:
        """Tensor ``name`` split in columns over TP."""
        return name, partial(self.column_shard, name, self.spec.shape(name)[1] // self.tp)

    def row_shard(self, name: str, rows: int, t: int) -> BufferSpec:
        """Rows ``[t * rows, (t + 1) * rows)`` of tensor ``name`` (past its end: padding)."""
        return buffer_spec((rows, self.spec.shape(name)[1]),
                           slice_block(self.spec, name, rows=(t * rows, (t + 1) * rows)),
                           self.dims.dtype)

    def column_shard(self, name: str, cols: int, t: int) -> BufferSpec:
        """Columns ``[t * cols, (t + 1) * cols)`` of tensor ``name``."""
        return buffer_spec((self.spec.shape(name)[0], cols),
                           slice_block(self.spec, name, cols=(t * cols, (t + 1) * cols)),
                           self.dims.dtype)

    def attention(self, prefix: str) -> list[Entry]:
        """The ``self_attn.`` buffers of one layer."""
        return self.mla_attention(prefix) if self.dims.mla else self.gqa_attention(prefix)

    def gqa_attention(self, prefix: str) -> list[Entry]:
        """qwen3_moe: ``qkv_proj`` and ``o_proj`` split on heads, the per-head norms whole."""
        return [(prefix + "qkv_proj.weight", partial(self.qkv_shard, prefix)),
                self.tp_columns(prefix + "o_proj.weight"),
                self.whole(prefix + "q_norm.weight"), self.whole(prefix + "k_norm.weight")]

    def qkv_shard(self, prefix: str, t: int) -> BufferSpec:
        """TP rank ``t``'s ``qkv_proj``: its q heads, then its k heads, then its v heads."""
        d, h = self.dims, self.dims.hidden
        hd, q_heads, kv_heads = d.head_dim, d.heads // self.tp, max(1, d.kv_heads // self.tp)
        # with tp > kv, kv head k serves the tp // kv consecutive ranks that replicate it
        k0 = t * kv_heads if self.tp <= d.kv_heads else t // (self.tp // d.kv_heads)
        kv_rows = (k0 * hd, (k0 + kv_heads) * hd)
        return buffer_spec(((q_heads + 2 * kv_heads) * hd, h), [
            slice_block(self.spec, prefix + "q_proj.weight",
                        rows=(t * q_heads * hd, (t + 1) * q_heads * hd)),
            slice_block(self.spec, prefix + "k_proj.weight", rows=kv_rows, at=(q_heads * hd, 0)),
            slice_block(self.spec, prefix + "v_proj.weight", rows=kv_rows,
                        at=((q_heads + kv_heads) * hd, 0))], d.dtype)

    def mla_attention(self, prefix: str) -> list[Entry]:
        """deepseek_v3: down-projections and latent norms whole, the rest split on heads."""
        if self.dims.q_lora_rank:
            queries = [(prefix + "fused_qkv_a_proj.weight", self.fused_qkv_a(prefix)),
                       self.whole(prefix + "q_a_layernorm.weight"),
                       self.tp_rows(prefix + "q_b_proj.weight")]
        else:
            queries = [self.tp_rows(prefix + "q_proj.weight"),
                       self.whole(prefix + "kv_a_proj_with_mqa.weight")]
        return [*queries, self.whole(prefix + "kv_a_layernorm.weight"),
                self.tp_rows(prefix + "kv_b_proj.weight"),
                self.tp_columns(prefix + "o_proj.weight")]

    def fused_qkv_a(self, prefix: str) -> BufferSpec:
        """``fused_qkv_a_proj`` = [q_a_proj; kv_a_proj_with_mqa] rows, whole."""
        q_rank = self.dims.q_lora_rank
        kv_a_rows = self.dims.kv_lora_rank + self.dims.qk_rope_dim
        return buffer_spec((q_rank + kv_a_rows, self.dims.hidden), [
            slice_block(self.spec, prefix + "q_a_proj.weight"),
            slice_block(self.spec, prefix + "kv_a_proj_with_mqa.weight", at=(q_rank, 0))],
            self.dims.dtype)

    def dense_mlp(self, prefix: str, width: int) -> list[Entry]:
        """A ``width``-wide MLP as ``gate_up_proj`` and ``down_proj``, split over TP."""
        return tp_mlp(self.spec, prefix, (prefix + "gate_up_proj.weight",
                                          prefix + "down_proj.weight"),
                      width // self.tp, self.dims.hidden, self.dims.dtype)

    def router(self, prefix: str) -> list[Entry]:
        """``gate.weight`` (and deepseek_v3's ``gate.e_score_correction_bias``), whole."""
        entries = [self.whole(prefix + "gate.weight")]
        if self.dims.mla:
            entries.append(self.whole(prefix + "gate.e_score_correction_bias"))
        return entries

    def routed_experts(self, i: int) -> list[Entry]:
        """Layer ``i``'s ``w13_weight`` and ``w2_weight`` stacks, one per replica GPU."""
        gate, up, down = expert_offsets(self.spec, i, self.dims.experts)
        prefix = f"model.layers.{i}.mlp.experts.routed_experts."
        return [(prefix + "w13_weight", partial(self.w13_shard, gate, up)),
                (prefix + "w2_weight", partial(self.w2_shard, down))]

    def expert_share(self, g: int) -> tuple[slice, tuple[int, int]]:
        """GPU ``g``'s routed experts and its rows ``[m0, m1)`` of each one's width."""
        experts, width = self.dims.experts, self.dims.moe_intermediate
        if self.ep == 1:  # every expert TP-split over the replica's GPUs
            rows = width // self.gpus
            return slice(0, experts), (g * rows, (g + 1) * rows)
        # vLLM's linear placement: the first `experts % gpus` GPUs hold one expert more
        base, extra = divmod(experts, self.gpus)
        first = g * base + min(g, extra)
        return slice(first, first + base + (g < extra)), (0, width)

    def w13_shard(self, gate: np.ndarray, up: np.ndarray, g: int) -> BufferSpec:
        """GPU ``g``'s ``[experts, 2 * rows, h]`` stack: each expert's gate rows, then up rows."""
        experts, rows = self.expert_share(g)
        h = self.dims.hidden
        return buffer_spec((experts.stop - experts.start, 2 * (rows[1] - rows[0]), h),
                           stacked_fc1(gate[experts], up[experts], rows, h), self.dims.dtype)

    def w2_shard(self, down: np.ndarray, g: int) -> BufferSpec:
        """GPU ``g``'s ``[experts, h, rows]`` stack of down_proj column shards."""
        experts, rows = self.expert_share(g)
        h = self.dims.hidden
        return buffer_spec((experts.stop - experts.start, h, rows[1] - rows[0]),
                           stacked_fc2(down[experts], rows, h, self.dims.moe_intermediate),
                           self.dims.dtype)
