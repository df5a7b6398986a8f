"""vLLM rollout layouts: identical engine replicas with TP attention (data-parallel attention when a
replica has more GPUs than ``tp``) and expert parallelism for routed experts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from wb.data.layout import BufferSpec, Layout, Role
from wb.errors import SpecError
from wb.layouts.blocks import buffer_spec, expert_offsets, slice_block, stacked_fc1, stacked_fc2
from wb.layouts.dims import ModelDims
from wb.layouts.presets import spec_from_config
from wb.layouts.shards import (Entry, check_divides, check_positive, shard_buffers, tp_mlp,
                               worker_layouts)

__all__ = ["vllm_rollout", "VOCAB_PADDING"]

#: vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: ``VocabParallelEmbedding`` pads the vocabulary to a
#: multiple of it before splitting the rows over TP.
VOCAB_PADDING = 64


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
    fn = "vllm_rollout"
    d = ModelDims.of(cfg)
    spec = spec_from_config(cfg)
    check_positive(fn, tp=tp, ep=ep, replicas=replicas, nodes_per_replica=nodes_per_replica,
              gpus_per_node=gpus_per_node)
    if gpus_per_replica is None:
        G = nodes_per_replica * gpus_per_node
    else:
        check_positive(fn, gpus_per_replica=gpus_per_replica)
        G = gpus_per_replica
        if G != nodes_per_replica * gpus_per_node and (nodes_per_replica != 1
                                                       or gpus_per_node % G):
            raise SpecError(f"{fn}: `gpus_per_replica`={G} packs several replicas on a node, so it "
                            f"must divide `gpus_per_node`={gpus_per_node} with "
                            f"`nodes_per_replica`=1 (got {nodes_per_replica}); for replicas of "
                            f"whole nodes pass `nodes_per_replica` only")
    if G % tp:
        raise SpecError(f"{fn}: `tp`={tp} must divide the {G} GPUs of a replica (the rest of the "
                        f"replica's GPUs are data-parallel attention)")
    if ep not in (1, G):
        raise SpecError(f"{fn}: `ep`={ep} must be the replica's GPU count {G} (vLLM expert "
                        f"parallelism spans TP x DP) or 1 (experts TP-split over the {G} GPUs)")
    fix = "pick a tensor parallel size that divides it"
    check_divides("num_attention_heads", d.heads, tp, "tp", fix)
    if not d.mla and d.kv_heads % tp and tp % d.kv_heads:
        raise SpecError(f"{fn}: `tp`={tp} and num_key_value_heads={d.kv_heads}: one must divide "
                        f"the other (vLLM splits or replicates kv heads)")
    if d.n_dense:
        check_divides("intermediate_size", d.intermediate, tp, "tp", fix)
    moe = d.layers > d.n_dense
    if moe and d.n_shared:
        check_divides("the shared-expert width", d.shared_width, tp, "tp", fix)
    if moe and ep == 1:
        check_divides("moe_intermediate_size (experts TP-split over the replica)",
                      d.moe_intermediate, G, "gpus of a replica",
                      "use ep equal to the replica's GPU count")
    dt, h = d.dtype, d.hidden
    Vp = d.padded_vocab(VOCAB_PADDING)
    check_divides(f"the vocabulary padded to a multiple of {VOCAB_PADDING}", Vp, tp, "tp", fix)
    vl = Vp // tp

    def rep(name: str) -> BufferSpec:  # whole, in the checkpoint tensor's own dtype
        return buffer_spec(spec.shape(name), slice_block(spec, name), spec.dtype(name))

    def vocab(name: str) -> Callable[[int], BufferSpec]:
        return lambda t: buffer_spec((vl, h), slice_block(spec, name, rows=(t * vl, (t + 1) * vl)),
                                     dt)

    def mlp(hf: str, w: int) -> list[Entry]:
        return tp_mlp(spec, hf, (hf + "gate_up_proj.weight", hf + "down_proj.weight"), w, h, dt)

    def attention(a: str) -> list[Entry]:
        hq = d.heads // tp
        if d.mla:
            qk, kvw = d.qk_nope_dim + d.qk_rope_dim, d.qk_nope_dim + d.v_head_dim
            out: list[Entry] = []
            if d.q_lora_rank:
                r = d.q_lora_rank
                kva = d.kv_lora_rank + d.qk_rope_dim
                out.append((a + "fused_qkv_a_proj.weight", buffer_spec((r + kva, h), [
                    slice_block(spec, a + "q_a_proj.weight"),
                    slice_block(spec, a + "kv_a_proj_with_mqa.weight", at=(r, 0))], dt)))
                out.append((a + "q_a_layernorm.weight", rep(a + "q_a_layernorm.weight")))
                out.append((a + "q_b_proj.weight", lambda t: buffer_spec(
                    (hq * qk, r), slice_block(spec, a + "q_b_proj.weight",
                                              rows=(t * hq * qk, (t + 1) * hq * qk)), dt)))
            else:
                out.append((a + "q_proj.weight", lambda t: buffer_spec(
                    (hq * qk, h), slice_block(spec, a + "q_proj.weight",
                                              rows=(t * hq * qk, (t + 1) * hq * qk)), dt)))
                out.append((a + "kv_a_proj_with_mqa.weight", rep(a + "kv_a_proj_with_mqa.weight")))
            out.append((a + "kv_a_layernorm.weight", rep(a + "kv_a_layernorm.weight")))
            out.append((a + "kv_b_proj.weight", lambda t: buffer_spec(
                (hq * kvw, d.kv_lora_rank), slice_block(spec, a + "kv_b_proj.weight",
                                                        rows=(t * hq * kvw, (t + 1) * hq * kvw)),
                dt)))
            ow = hq * d.v_head_dim
        else:
            hd, kv = d.head_dim, d.kv_heads
            kl = max(1, kv // tp)

            def qkv(t: int) -> BufferSpec:
                k0 = t * kl if tp <= kv else t // (tp // kv)  # replicated kv head when tp > kv
                return buffer_spec(((hq + 2 * kl) * hd, h), [
                    slice_block(spec, a + "q_proj.weight", rows=(t * hq * hd, (t + 1) * hq * hd)),
                    slice_block(spec, a + "k_proj.weight", rows=(k0 * hd, (k0 + kl) * hd),
                                at=(hq * hd, 0)),
                    slice_block(spec, a + "v_proj.weight", rows=(k0 * hd, (k0 + kl) * hd),
                                at=((hq + kl) * hd, 0))], dt)
            out = [(a + "qkv_proj.weight", qkv)]
            ow = hq * hd
        out.append((a + "o_proj.weight", lambda t: buffer_spec(
            (h, ow), slice_block(spec, a + "o_proj.weight", cols=(t * ow, (t + 1) * ow)), dt)))
        if not d.mla:
            out += [(a + "q_norm.weight", rep(a + "q_norm.weight")),
                    (a + "k_norm.weight", rep(a + "k_norm.weight"))]
        return out

    def experts(i: int) -> list[Entry]:
        E, mi = d.experts, d.moe_intermediate
        gate, up, down = expert_offsets(spec, i, E)
        m = f"model.layers.{i}.mlp.experts.routed_experts."
        if ep == 1:  # every expert TP-split over the G GPUs of the replica
            ml = mi // G
            return [(m + "w13_weight", lambda g: buffer_spec(
                        (E, 2 * ml, h), stacked_fc1(gate, up, (g * ml, (g + 1) * ml), h), dt)),
                    (m + "w2_weight", lambda g: buffer_spec(
                        (E, h, ml), stacked_fc2(down, (g * ml, (g + 1) * ml), h, mi), dt))]
        base, extra = divmod(E, G)

        def local(g: int) -> slice:
            e0 = g * base + min(g, extra)
            return slice(e0, e0 + base + (g < extra))

        def w13(g: int) -> BufferSpec:
            e = local(g)
            return buffer_spec((e.stop - e.start, 2 * mi, h),
                               stacked_fc1(gate[e], up[e], (0, mi), h), dt)

        def w2(g: int) -> BufferSpec:
            e = local(g)
            return buffer_spec((e.stop - e.start, h, mi), stacked_fc2(down[e], (0, mi), h, mi), dt)
        return [(m + "w13_weight", w13), (m + "w2_weight", w2)]

    embed: list[Entry] = [("model.embed_tokens.weight", vocab("model.embed_tokens.weight"))]
    segments = [(shard_buffers(embed, tp), True)]
    for i in range(d.layers):
        H = f"model.layers.{i}."
        dense: list[Entry] = [(H + "input_layernorm.weight", rep(H + "input_layernorm.weight"))]
        dense += attention(H + "self_attn.")
        dense.append((H + "post_attention_layernorm.weight",
                      rep(H + "post_attention_layernorm.weight")))
        if i < d.n_dense:
            dense += mlp(H + "mlp.", d.intermediate // tp)
        else:
            dense.append((H + "mlp.gate.weight", rep(H + "mlp.gate.weight")))
            if d.mla:
                dense.append((H + "mlp.gate.e_score_correction_bias",
                              rep(H + "mlp.gate.e_score_correction_bias")))
        # In module order: (shards, True) is indexed by TP rank, (shards, False) by replica GPU.
        segments.append((shard_buffers(dense, tp), True))
        if i >= d.n_dense:
            segments.append((shard_buffers(experts(i), G), False))
            if d.n_shared:
                shared = mlp(H + "mlp.shared_experts.", d.shared_width // tp)
                segments.append((shard_buffers(shared, tp), True))
    tail: list[Entry] = [("model.norm.weight", rep("model.norm.weight"))]
    if not d.tied:  # tied: vLLM's lm_head shares embed_tokens, no buffer of its own
        tail.append(("lm_head.weight", vocab("lm_head.weight")))
    segments.append((shard_buffers(tail, tp), True))
    replica: list[dict[str, BufferSpec]] = []
    for g in range(G):
        bufs: dict[str, BufferSpec] = {}
        for shards, by_tp in segments:
            bufs.update(shards[g % tp if by_tp else g])
        replica.append(bufs)
    return worker_layouts([replica[q % G] for q in range(replicas * G)], Role.ROLLOUT, first_rank,
                          lambda q: (f"{node_prefix}{q // gpus_per_node}", q % gpus_per_node))
