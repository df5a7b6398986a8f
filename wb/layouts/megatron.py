"""Megatron-core trainer layouts (GPT model, Transformer Engine layer spec), one per GPU.

:func:`megatron_trainer` gives every GPU of a TP x PP x DP world (with EP and expert TP for the
routed experts) its parameters by their Megatron names; :func:`pipeline_stages` is how it spreads
layers over pipeline stages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from wb.data.layout import BufferSpec, Layout, Role
from wb.data.spec import CheckpointSpec
from wb.errors import SpecError
from wb.layouts.blocks import buffer_spec, expert_offsets, slice_block, stacked_fc1, stacked_fc2
from wb.layouts.dims import ModelDims
from wb.layouts.presets import spec_from_config
from wb.layouts.shards import (Entry, check_divides, check_positive, check_world, shard_buffers,
                               tp_mlp, worker_layouts)

__all__ = ["megatron_trainer", "pipeline_stages", "VOCAB_MULTIPLE"]

#: Megatron pads the vocabulary to a multiple of ``VOCAB_MULTIPLE * tp`` rows
#: (``--make-vocab-size-divisible-by`` 128, times TP) so every TP shard is equal.
VOCAB_MULTIPLE = 128


def pipeline_stages(layers: int, pp: int) -> list[range]:
    """The decoder layers of each pipeline stage: contiguous ranges; with ``layers % pp`` left
    over, the first stages take one more layer.

    Args:
        layers: the model's decoder layers.
        pp: pipeline parallel size.

    Returns:
        ``pp`` ranges of layer indices.

    Examples:
        >>> pipeline_stages(5, 3)
        [range(0, 2), range(2, 4), range(4, 5)]
    """
    base, extra = divmod(layers, pp)
    starts = [s * base + min(s, extra) for s in range(pp + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(pp)]


def megatron_trainer(cfg: Mapping, *, tp: int, pp: int, ep: int, etp: int = 1,
                     nodes: Sequence[str], gpus_per_node: int = 8,
                     first_rank: int = 0) -> list[Layout]:
    """Megatron-core trainer layouts (GPT model, Transformer Engine layer spec), one per GPU.

    Buffers are the bf16 parameters by their Megatron names with *global* layer numbers
    (``decoder.layers.{i}.…``). The world of ``len(nodes) * gpus_per_node`` GPUs is ordered
    Megatron's default way: ``rank = tp_rank + tp * (dp_rank + dp * pp_rank)`` for dense
    parameters; within a pipeline stage, the same rank is ``etp_rank + etp * (ep_rank + ep *
    edp_rank)`` for routed experts. Data-parallel copies hold identical parameters (the
    distributed optimizer shards only fp32 state) and share BufferSpec objects.

    - Pipeline stages own contiguous layers; when ``L % pp != 0`` the first stages take one more.
      ``embedding.word_embeddings.weight`` lives on the first stage, ``decoder.final_layernorm``
      and ``output_layer.weight`` on the last (with tied embeddings and ``pp > 1`` the last stage's
      ``output_layer.weight`` is Megatron's copy of the embedding; with ``pp == 1`` there is none).
    - The vocabulary is padded to a multiple of ``128 * tp`` (:data:`VOCAB_MULTIPLE`) and split
      in rows over TP; padding rows hold ``-1``.
    - GQA (``qwen3_moe``): ``self_attention.linear_qkv.weight`` uses Megatron's grouped layout,
      for each of the rank's query groups ``g``: the ``nh / kv`` q heads of ``g``, k head ``g``,
      v head ``g``. Megatron-core requires ``kv % tp == 0`` (it splits query groups, never
      replicates them), and so does this generator. ``linear_qkv.layer_norm_weight`` is
      input_layernorm (fused by TE); ``q_layernorm``/``k_layernorm`` are replicated.
    - MLA (``deepseek_v3``): ``linear_q_down_proj`` (q_a_proj) and ``linear_kv_down_proj``
      (kv_a_proj_with_mqa) are replicated; ``linear_q_up_proj`` (q_b_proj), ``linear_q_proj``
      (q_proj without q LoRA) and ``linear_kv_up_proj`` (kv_b_proj) are split by heads;
      q_a/kv_a layernorms are the fused ``linear_{q,kv}_up_proj.layer_norm_weight``;
      ``input_layernorm.weight`` is separate.
    - ``linear_proj`` (o_proj) is split over its input columns (heads).
    - Dense MLP: ``mlp.linear_fc1.weight`` = [gate shard; up shard] (``2 * I / tp`` rows),
      ``mlp.linear_fc2.weight`` ``[h, I / tp]``; post_attention_layernorm is the fused
      ``mlp.linear_fc1.layer_norm_weight`` (TE) in dense layers and ``pre_mlp_layernorm.weight``
      in MoE layers.
    - MoE: ``mlp.router.weight`` ``[E, h]`` (and ``mlp.router.expert_bias`` for deepseek_v3)
      replicated; local experts ``[k * E / ep, (k + 1) * E / ep)`` of EP rank ``k`` as grouped
      buffers ``mlp.experts.linear_fc1.weight`` ``[E / ep, 2 * mi / etp, h]`` and
      ``mlp.experts.linear_fc2.weight`` ``[E / ep, h, mi / etp]``; shared experts
      ``mlp.shared_experts.linear_fc{1,2}.weight`` split by TP like a dense MLP.

    Args:
        cfg: model config (:func:`wb.layouts.presets.load_config`), architecture qwen3_moe or
            deepseek_v3.
        tp: tensor parallel size (attention heads, MLP columns, vocabulary).
        pp: pipeline parallel size.
        ep: expert parallel size (routed experts).
        etp: expert tensor parallel size (splits each routed expert's MLP).
        nodes: trainer node names; the world is ``len(nodes) * gpus_per_node`` GPUs.
        gpus_per_node: GPUs per node.
        first_rank: global rank of the first GPU; ranks are consecutive.

    Returns:
        One trainer :class:`~wb.data.layout.Layout` per GPU, in rank order.

    Raises:
        SpecError: (a ``ValueError``) the world is not a multiple of ``tp * pp``, a stage's
            ``world / pp`` GPUs are not a multiple of ``etp * ep``, or a size does not divide
            what it splits (heads, query groups, MLP widths, experts).

    Examples:
        >>> from wb.layouts.presets import TINY
        >>> lays = megatron_trainer(TINY, tp=2, pp=1, ep=2, nodes=["trainer0"], gpus_per_node=4)
        >>> lays[1].buffers["decoder.layers.0.self_attention.linear_qkv.weight"].shape
        (32, 32)
        >>> lays[0].buffers["embedding.word_embeddings.weight"] is lays[2].buffers[
        ...     "embedding.word_embeddings.weight"]   # data-parallel copies share the BufferSpec
        True
    """
    fn = "megatron_trainer"
    d = ModelDims.of(cfg)
    spec = spec_from_config(cfg)
    world = check_world(fn, nodes, gpus_per_node)
    check_positive(fn, tp=tp, pp=pp, ep=ep, etp=etp)
    if world % (tp * pp):
        raise SpecError(f"{fn}: the world of {world} GPUs ({len(nodes)} nodes x {gpus_per_node}) "
                        f"must be a multiple of tp * pp = {tp} * {pp}; change `tp`, `pp` or "
                        f"`nodes`")
    dp = world // (tp * pp)
    stage = world // pp
    if stage % (etp * ep):
        raise SpecError(f"{fn}: each pipeline stage's {stage} GPUs must be a multiple of "
                        f"etp * ep = {etp} * {ep} (expert data parallel fills the rest); change "
                        f"`ep`, `etp` or `nodes`")
    if d.layers < pp:
        raise SpecError(f"{fn}: `pp`={pp} exceeds the {d.layers} layers of the model")
    fix = "pick a tensor parallel size that divides it"
    if d.mla:
        check_divides("num_attention_heads", d.heads, tp, "tp", fix)
    else:
        check_divides("num_key_value_heads (Megatron-core splits query groups over TP)",
                      d.kv_heads, tp, "tp", fix)
    if d.n_dense:
        check_divides("intermediate_size", d.intermediate, tp, "tp", fix)
    if d.n_shared and d.layers > d.n_dense:
        check_divides("the shared-expert width", d.shared_width, tp, "tp", fix)
    if d.layers > d.n_dense:
        check_divides("the number of routed experts", d.experts, ep, "ep",
                      "Megatron-core places E / ep experts on every EP rank")
        check_divides("moe_intermediate_size", d.moe_intermediate, etp, "etp",
                      "pick an expert TP size that divides it")

    dt, h = d.dtype, d.hidden
    Vp = d.padded_vocab(VOCAB_MULTIPLE * tp)
    vl = Vp // tp
    stages = pipeline_stages(d.layers, pp)
    last = pp - 1

    def vocab(name: str) -> Callable[[int], BufferSpec]:
        return lambda t: buffer_spec((vl, h), slice_block(spec, name, rows=(t * vl, (t + 1) * vl)),
                                     dt)

    def rep(name: str) -> BufferSpec:  # whole, in the checkpoint tensor's own dtype
        return buffer_spec(spec.shape(name), slice_block(spec, name), spec.dtype(name))

    per_rank: list[dict[str, BufferSpec]] = [{} for _ in range(world)]
    for p, layers in enumerate(stages):
        head: list[Entry] = []
        if p == 0:
            head.append(("embedding.word_embeddings.weight", vocab("model.embed_tokens.weight")))
        tail: list[Entry] = []
        if p == last:
            tail.append(("decoder.final_layernorm.weight", rep("model.norm.weight")))
            if not d.tied:
                tail.append(("output_layer.weight", vocab("lm_head.weight")))
            elif pp > 1:  # Megatron keeps a copy of the tied embedding on the last stage
                tail.append(("output_layer.weight", vocab("model.embed_tokens.weight")))
        # In module order: (shards, True) is indexed by TP rank, (shards, False) by expert shard.
        segments = [(shard_buffers(head, tp), True)]
        for i in layers:
            pre, post = _megatron_layer(spec, d, i, tp, rep)
            segments.append((shard_buffers(pre, tp), True))
            if i >= d.n_dense:
                experts = _megatron_experts(spec, d, i, ep, etp)
                segments.append((shard_buffers(experts, ep * etp), False))
            segments.append((shard_buffers(post, tp), True))
        segments.append((shard_buffers(tail, tp), True))
        for within in range(tp * dp):
            bufs = per_rank[p * tp * dp + within]
            t, x = within % tp, within % (etp * ep)  # x = etp_rank + etp * ep_rank
            for shards, by_tp in segments:
                bufs.update(shards[t if by_tp else x])
    return worker_layouts(per_rank, Role.TRAINER, first_rank,
                          lambda g: (nodes[g // gpus_per_node], g % gpus_per_node))


def _megatron_layer(spec: CheckpointSpec, d: ModelDims, i: int, tp: int,
                    rep: Callable[[str], BufferSpec]) -> tuple[list[Entry], list[Entry]]:
    """Non routed-expert buffers of Megatron layer ``i`` (replicated or per TP rank): those
    before the routed experts in module order, and the shared experts after them."""
    P, H = f"decoder.layers.{i}.", f"model.layers.{i}."
    a, dt, h = H + "self_attn.", d.dtype, d.hidden
    out: list[Entry] = []
    if d.mla:
        hq = d.heads // tp
        qk, kvw = d.qk_nope_dim + d.qk_rope_dim, d.qk_nope_dim + d.v_head_dim
        out.append((P + "input_layernorm.weight", rep(H + "input_layernorm.weight")))
        if d.q_lora_rank:
            out.append((P + "self_attention.linear_q_down_proj.weight", rep(a + "q_a_proj.weight")))
            out.append((P + "self_attention.linear_q_up_proj.layer_norm_weight",
                        rep(a + "q_a_layernorm.weight")))
            out.append((P + "self_attention.linear_q_up_proj.weight", lambda t: buffer_spec(
                (hq * qk, d.q_lora_rank), slice_block(spec, a + "q_b_proj.weight",
                                                      rows=(t * hq * qk, (t + 1) * hq * qk)), dt)))
        else:
            out.append((P + "self_attention.linear_q_proj.weight", lambda t: buffer_spec(
                (hq * qk, h), slice_block(spec, a + "q_proj.weight",
                                          rows=(t * hq * qk, (t + 1) * hq * qk)), dt)))
        out.append((P + "self_attention.linear_kv_down_proj.weight",
                    rep(a + "kv_a_proj_with_mqa.weight")))
        out.append((P + "self_attention.linear_kv_up_proj.layer_norm_weight",
                    rep(a + "kv_a_layernorm.weight")))
        out.append((P + "self_attention.linear_kv_up_proj.weight", lambda t: buffer_spec(
            (hq * kvw, d.kv_lora_rank), slice_block(spec, a + "kv_b_proj.weight",
                                                    rows=(t * hq * kvw, (t + 1) * hq * kvw)), dt)))
        ow = hq * d.v_head_dim
    else:
        hd, qpg, gl = d.head_dim, d.heads // d.kv_heads, d.kv_heads // tp

        def qkv(t: int) -> BufferSpec:
            parts, row = [], 0
            for g in range(t * gl, (t + 1) * gl):  # Megatron's grouped [q heads of g; k_g; v_g]
                parts.append(slice_block(spec, a + "q_proj.weight",
                                         rows=(g * qpg * hd, (g + 1) * qpg * hd), at=(row, 0)))
                row += qpg * hd
                for w in ("k", "v"):
                    parts.append(slice_block(spec, a + f"{w}_proj.weight",
                                             rows=(g * hd, (g + 1) * hd), at=(row, 0)))
                    row += hd
            return buffer_spec((row, h), parts, dt)

        out.append((P + "self_attention.linear_qkv.layer_norm_weight",
                    rep(H + "input_layernorm.weight")))
        out.append((P + "self_attention.linear_qkv.weight", qkv))
        out.append((P + "self_attention.q_layernorm.weight", rep(a + "q_norm.weight")))
        out.append((P + "self_attention.k_layernorm.weight", rep(a + "k_norm.weight")))
        ow = d.heads * hd // tp
    out.append((P + "self_attention.linear_proj.weight", lambda t: buffer_spec(
        (h, ow), slice_block(spec, a + "o_proj.weight", cols=(t * ow, (t + 1) * ow)), dt)))
    if i < d.n_dense:
        out.append((P + "mlp.linear_fc1.layer_norm_weight",
                    rep(H + "post_attention_layernorm.weight")))
        out += tp_mlp(spec, H + "mlp.", (P + "mlp.linear_fc1.weight", P + "mlp.linear_fc2.weight"),
                      d.intermediate // tp, h, dt)
    else:
        out.append((P + "pre_mlp_layernorm.weight", rep(H + "post_attention_layernorm.weight")))
        out.append((P + "mlp.router.weight", rep(H + "mlp.gate.weight")))
        if d.mla:
            out.append((P + "mlp.router.expert_bias", rep(H + "mlp.gate.e_score_correction_bias")))
        if d.n_shared:
            sh = P + "mlp.shared_experts."
            return out, tp_mlp(spec, H + "mlp.shared_experts.",
                               (sh + "linear_fc1.weight", sh + "linear_fc2.weight"),
                               d.shared_width // tp, h, dt)
    return out, []


def _megatron_experts(spec: CheckpointSpec, d: ModelDims, i: int, ep: int, etp: int
                      ) -> list[Entry]:
    """Grouped routed-expert buffers of layer ``i``, indexed by ``etp_rank + etp * ep_rank``."""
    gate, up, down = expert_offsets(spec, i, d.experts)
    el, ml, P = d.experts // ep, d.moe_intermediate // etp, f"decoder.layers.{i}.mlp.experts."
    h, mi = d.hidden, d.moe_intermediate

    def fc1(x: int) -> BufferSpec:
        s, k = x % etp, x // etp
        e = slice(k * el, (k + 1) * el)
        return buffer_spec((el, 2 * ml, h), stacked_fc1(gate[e], up[e], (s * ml, (s + 1) * ml), h),
                           d.dtype)

    def fc2(x: int) -> BufferSpec:
        s, k = x % etp, x // etp
        return buffer_spec((el, h, ml), stacked_fc2(down[k * el:(k + 1) * el],
                                                    (s * ml, (s + 1) * ml), h, mi), d.dtype)

    return [(P + "linear_fc1.weight", fc1), (P + "linear_fc2.weight", fc2)]
