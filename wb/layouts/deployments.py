"""Trainer and rollout layouts of real frameworks, and four paper-scale deployments built from them.

A *layout generator* turns a model config (as :func:`wb.layouts.presets.load_config` returns it) and a
parallelism plan into one :class:`~wb.data.layout.Layout` per GPU, with the buffer names, shapes and
shards each framework really uses:

- :func:`megatron_trainer`: Megatron-core (Transformer Engine spec) with TP, PP, EP, expert TP, DP.
- :func:`fsdp_trainer`: PyTorch FSDP1 flat parameters, one per decoder layer.
- :func:`jax_trainer`: a JAX ``(dp, fsdp, tp)`` device mesh with transposed ``[in, out]`` kernels.
- :func:`vllm_rollout`: vLLM replicas with TP attention (data-parallel attention when a replica
  has more GPUs than ``tp``) and expert parallelism for routed experts.

Every source map is built from affine block descriptions only (:meth:`SourceMap.from_blocks`):
nothing is O(elements), so a 1T-parameter deployment builds in seconds. Identical shards (data
parallel copies, rollout replicas, replicated norms) share one :class:`~wb.data.layout.BufferSpec`
object; only the :class:`~wb.data.layout.Worker` differs.

Conventions used in the block helpers: a checkpoint tensor of shape ``S`` is viewed as ``[A, B]``
(``A = prod(S[:-1])``, ``B = S[-1]``) and its element ``(a, b)`` has id ``offset + a * B + b``;
a buffer is viewed the same way (see :mod:`wb.data.sourcemap`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from wb.errors import SpecError
from wb.data.layout import BufferSpec, Layout, Role, Worker
from wb.layouts.presets import TINY, load_config, spec_from_config
from wb.data.sourcemap import Blocks, SourceMap
from wb.data.spec import CheckpointSpec

__all__ = ["Deployment", "DEPLOYMENTS", "deployment", "megatron_trainer", "fsdp_trainer",
           "jax_trainer", "vllm_rollout"]


# --- model dimensions --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Dims:
    """The config numbers the generators need, read once (names as in ``models/README.md``)."""

    arch: str  # "qwen3_moe" or "deepseek_v3"
    dtype: str
    V: int  # vocab_size
    h: int  # hidden_size
    L: int  # num_hidden_layers
    n_dense: int  # first_k_dense_replace: layers i < n_dense have a dense MLP
    inter: int  # intermediate_size of dense layers (0 without dense layers)
    E: int  # routed experts
    mi: int  # moe_intermediate_size
    n_shared: int  # shared experts (their MLP is mi * n_shared wide)
    nh: int  # attention heads
    kv: int  # qwen3_moe: key/value heads
    hd: int  # qwen3_moe: head_dim
    q_lora: int  # deepseek_v3: q_lora_rank (0: plain q_proj)
    kv_lora: int  # deepseek_v3: kv_lora_rank
    nope: int  # deepseek_v3: qk_nope_head_dim
    rope: int  # deepseek_v3: qk_rope_head_dim
    vh: int  # deepseek_v3: v_head_dim
    tied: bool  # tie_word_embeddings: no lm_head.weight in the checkpoint

    @classmethod
    def of(cls, cfg: Mapping) -> _Dims:
        arch = cfg.get("architecture")
        if arch not in ("qwen3_moe", "deepseek_v3"):
            raise SpecError(f"cfg['architecture'] is {arch!r}; the layout generators support "
                            f"'qwen3_moe' and 'deepseek_v3'")
        n_dense = int(cfg.get("first_k_dense_replace", 0) or 0)
        mla = arch == "deepseek_v3"
        return cls(
            arch=arch, dtype=str(cfg.get("dtype", "bfloat16")), V=int(cfg["vocab_size"]),
            h=int(cfg["hidden_size"]), L=int(cfg["num_hidden_layers"]), n_dense=n_dense,
            inter=int(cfg["intermediate_size"]) if n_dense else 0,
            E=int(cfg.get("num_experts", cfg.get("n_routed_experts", 0)) or 0),
            mi=int(cfg["moe_intermediate_size"]), n_shared=int(cfg.get("n_shared_experts", 0) or 0),
            nh=int(cfg["num_attention_heads"]),
            kv=0 if mla else int(cfg["num_key_value_heads"]), hd=0 if mla else int(cfg["head_dim"]),
            q_lora=int(cfg.get("q_lora_rank") or 0) if mla else 0,
            kv_lora=int(cfg["kv_lora_rank"]) if mla else 0,
            nope=int(cfg["qk_nope_head_dim"]) if mla else 0,
            rope=int(cfg["qk_rope_head_dim"]) if mla else 0,
            vh=int(cfg["v_head_dim"]) if mla else 0,
            tied=bool(cfg.get("tie_word_embeddings", False)))

    @property
    def mla(self) -> bool:
        return self.arch == "deepseek_v3"

    @property
    def shared(self) -> int:
        """Width of the shared-expert MLP (0: none)."""
        return self.mi * self.n_shared


# --- block helpers -----------------------------------------------------------------------------
def _blocks(r0, nr, c0, nc, id0, sr, sc) -> Blocks:
    """Blocks from broadcastable fields (scalars or arrays), flattened to ``(n,) int64``."""
    f = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (r0, nr, c0, nc, id0, sr, sc)))
    return Blocks(*(np.ascontiguousarray(x.reshape(-1)) for x in f))


def _view(shape: Sequence[int]) -> tuple[int, int]:
    return (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)


def _copy(spec: CheckpointSpec, name: str, rows: tuple[int, int] | None = None,
          cols: tuple[int, int] | None = None, at: tuple[int, int] = (0, 0)) -> Blocks:
    """Rows ``[a0, a1)`` x cols ``[b0, b1)`` of tensor ``name`` copied to buffer ``(R, C)`` onward.

    An empty range (a shard made only of padding) gives no block.
    """
    A, B = _view(spec.shape(name))
    a0, a1 = rows or (0, A)
    b0, b1 = cols or (0, B)
    a1, b1 = min(a1, A), min(b1, B)
    if a1 <= a0 or b1 <= b0:
        return Blocks.empty()
    return _blocks(at[0], a1 - a0, at[1], b1 - b0, spec.offset(name) + a0 * B + b0, B, 1)


def _copy_t(spec: CheckpointSpec, name: str, out: tuple[int, int] | None = None,
            inp: tuple[int, int] | None = None, at: tuple[int, int] = (0, 0)) -> Blocks:
    """A transposed ``[in, out]`` kernel shard: buffer ``(R + i, C + o)`` = HF ``(o0 + o, i0 + i)``.

    ``out`` are rows of the PyTorch ``[out, in]`` weight, ``inp`` its columns.
    """
    A, B = _view(spec.shape(name))
    o0, o1 = out or (0, A)
    i0, i1 = inp or (0, B)
    o1, i1 = min(o1, A), min(i1, B)
    if o1 <= o0 or i1 <= i0:
        return Blocks.empty()
    return _blocks(at[0], i1 - i0, at[1], o1 - o0, spec.offset(name) + o0 * B + i0, 1, B)


def _buffer(shape: Sequence[int], parts: Sequence[Blocks] | Blocks, dtype: str) -> BufferSpec:
    """A buffer of ``shape`` holding the given blocks (``-1`` elsewhere).

    ``check=False``: the generators place shards side by side by construction, and the overlap
    sweep would cost more than building the map; the tests compare every map with an oracle.
    """
    if isinstance(parts, Blocks):
        b = parts
    else:
        parts = [p for p in parts if p.count]
        b = (Blocks(*(np.concatenate(f) for f in zip(*parts))) if len(parts) > 1
             else parts[0] if parts else Blocks.empty())
    return BufferSpec(SourceMap.from_blocks(tuple(int(s) for s in shape), b, check=False), dtype)


def _expert_offsets(spec: CheckpointSpec, layer: int, E: int) -> tuple[np.ndarray, ...]:
    """``(gate, up, down)`` first ids of every routed expert of ``layer``, ``(E,) int64`` each."""
    p = f"model.layers.{layer}.mlp.experts."
    return tuple(np.fromiter((spec.offset(f"{p}{e}.{w}_proj.weight") for e in range(E)),
                             dtype=np.int64, count=E) for w in ("gate", "up", "down"))


def _stacked_fc1(gate: np.ndarray, up: np.ndarray, m: tuple[int, int], h: int) -> Blocks:
    """``[n, 2 * m, h]`` PyTorch-layout stack: expert ``j`` = gate rows ``m`` then up rows ``m``.

    ``gate``/``up`` are the first ids of the experts in the stack, ``(n,) int64``.
    """
    m0, m1 = m
    w = m1 - m0
    j = np.arange(gate.size, dtype=np.int64)
    r0 = np.stack([j * 2 * w, j * 2 * w + w], axis=1)  # (n, 2): gate rows, then up rows
    id0 = np.stack([gate, up], axis=1) + m0 * h
    return _blocks(r0, w, 0, h, id0, h, 1)


def _stacked_fc2(down: np.ndarray, m: tuple[int, int], h: int, mi: int) -> Blocks:
    """``[n, h, m]`` PyTorch-layout stack of down_proj column shards ``[m0, m1)``."""
    j = np.arange(down.size, dtype=np.int64)
    return _blocks(j * h, h, 0, m[1] - m[0], down + m[0], mi, 1)


#: One buffer of a layer: the same BufferSpec on every shard (replicated), or built per shard index.
_Entry = tuple[str, "BufferSpec | Callable[[int], BufferSpec]"]


def _shards(entries: Sequence[_Entry], n: int) -> list[dict[str, BufferSpec]]:
    """The ``n`` shards' buffers, sharing the replicated BufferSpec objects."""
    out: list[dict[str, BufferSpec]] = [{} for _ in range(n)]
    for name, v in entries:
        for k in range(n):
            out[k][name] = v if isinstance(v, BufferSpec) else v(k)
    return out


def _divides(what: str, n: int, by: int, arg: str, fix: str) -> None:
    if by <= 0 or n % by:
        raise SpecError(f"`{arg}`={by} must divide {what} ({n}); {fix}")


def _world(fn: str, nodes: Sequence[str], gpus_per_node: int) -> int:
    if isinstance(nodes, str) or not nodes:
        raise SpecError(f"{fn}: `nodes` must be a non-empty list of node names, got {nodes!r}")
    if len(set(nodes)) != len(nodes):
        raise SpecError(f"{fn}: `nodes` has repeated names: {list(nodes)!r}")
    if gpus_per_node < 1:
        raise SpecError(f"{fn}: `gpus_per_node` must be >= 1, got {gpus_per_node}")
    return len(nodes) * gpus_per_node


def _positive(fn: str, **sizes: int) -> None:
    for k, v in sizes.items():
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise SpecError(f"{fn}: `{k}` must be an integer >= 1, got {v!r}")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pp_stages(L: int, pp: int) -> list[range]:
    """Contiguous layer ranges; with ``L % pp`` left over, the first stages take one more layer."""
    base, extra = divmod(L, pp)
    starts = [s * base + min(s, extra) for s in range(pp + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(pp)]


def _layouts(per_rank: Sequence[Mapping[str, BufferSpec]], role: Role, first_rank: int,
             node_of: Callable[[int], tuple[str, int]]) -> list[Layout]:
    out = []
    for g, bufs in enumerate(per_rank):
        node, local = node_of(g)
        worker = Worker(rank=first_rank + g, node=node, role=role, local_rank=local)
        out.append(Layout(worker, bufs))
    return out


# --- Megatron-core ------------------------------------------------------------------------------
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
    - The vocabulary is padded to a multiple of ``128 * tp`` and split in rows over TP; padding
      rows hold ``-1``.
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
        cfg: model config (``wb.layouts.presets.load_config``), architecture qwen3_moe or deepseek_v3.
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
        >>> lays = megatron_trainer(TINY, tp=2, pp=1, ep=2, nodes=["trainer0"], gpus_per_node=4)
        >>> lays[1].buffers["decoder.layers.0.self_attention.linear_qkv.weight"].shape
        (32, 32)
        >>> lays[0].buffers["embedding.word_embeddings.weight"] is lays[2].buffers[
        ...     "embedding.word_embeddings.weight"]   # data-parallel copies share the BufferSpec
        True
    """
    fn = "megatron_trainer"
    d = _Dims.of(cfg)
    spec = spec_from_config(cfg)
    world = _world(fn, nodes, gpus_per_node)
    _positive(fn, tp=tp, pp=pp, ep=ep, etp=etp)
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
    if d.L < pp:
        raise SpecError(f"{fn}: `pp`={pp} exceeds the {d.L} layers of the model")
    fix = "pick a tensor parallel size that divides it"
    if d.mla:
        _divides("num_attention_heads", d.nh, tp, "tp", fix)
    else:
        _divides("num_key_value_heads (Megatron-core splits query groups over TP)", d.kv, tp,
                 "tp", fix)
    if d.n_dense:
        _divides("intermediate_size", d.inter, tp, "tp", fix)
    if d.n_shared and d.L > d.n_dense:
        _divides("the shared-expert width", d.shared, tp, "tp", fix)
    if d.L > d.n_dense:
        _divides("the number of routed experts", d.E, ep, "ep", "Megatron-core places E / ep "
                 "experts on every EP rank")
        _divides("moe_intermediate_size", d.mi, etp, "etp",
                 "pick an expert TP size that divides it")

    dt, h = d.dtype, d.h
    Vp = _round_up(d.V, 128 * tp)  # make-vocab-size-divisible-by 128, times TP
    vl = Vp // tp
    stages = _pp_stages(d.L, pp)
    last = pp - 1

    def vocab(name: str) -> Callable[[int], BufferSpec]:
        return lambda t: _buffer((vl, h), _copy(spec, name, rows=(t * vl, (t + 1) * vl)), dt)

    def rep(name: str) -> BufferSpec:
        return _buffer(spec.shape(name), _copy(spec, name), dt)

    per_rank: list[dict[str, BufferSpec]] = [{} for _ in range(world)]
    for p, layers in enumerate(stages):
        head: list[_Entry] = []
        if p == 0:
            head.append(("embedding.word_embeddings.weight", vocab("model.embed_tokens.weight")))
        tail: list[_Entry] = []
        if p == last:
            tail.append(("decoder.final_layernorm.weight", rep("model.norm.weight")))
            if not d.tied:
                tail.append(("output_layer.weight", vocab("lm_head.weight")))
            elif pp > 1:  # Megatron keeps a copy of the tied embedding on the last stage
                tail.append(("output_layer.weight", vocab("model.embed_tokens.weight")))
        # In module order: (shards, True) is indexed by TP rank, (shards, False) by expert shard.
        segments = [(_shards(head, tp), True)]
        for i in layers:
            pre, post = _megatron_layer(spec, d, i, tp, rep)
            segments.append((_shards(pre, tp), True))
            if i >= d.n_dense:
                segments.append((_shards(_megatron_experts(spec, d, i, ep, etp), ep * etp), False))
            segments.append((_shards(post, tp), True))
        segments.append((_shards(tail, tp), True))
        for within in range(tp * dp):
            bufs = per_rank[p * tp * dp + within]
            t, x = within % tp, within % (etp * ep)  # x = etp_rank + etp * ep_rank
            for shards, by_tp in segments:
                bufs.update(shards[t if by_tp else x])
    return _layouts(per_rank, Role.TRAINER, first_rank,
                    lambda g: (nodes[g // gpus_per_node], g % gpus_per_node))


def _megatron_layer(spec: CheckpointSpec, d: _Dims, i: int, tp: int,
                    rep: Callable[[str], BufferSpec]) -> tuple[list[_Entry], list[_Entry]]:
    """Non routed-expert buffers of Megatron layer ``i`` (replicated or per TP rank): those
    before the routed experts in module order, and the shared experts after them."""
    P, H = f"decoder.layers.{i}.", f"model.layers.{i}."
    a, dt, h = H + "self_attn.", d.dtype, d.h
    out: list[_Entry] = []
    if d.mla:
        hq = d.nh // tp
        qk, kvw = d.nope + d.rope, d.nope + d.vh
        out.append((P + "input_layernorm.weight", rep(H + "input_layernorm.weight")))
        if d.q_lora:
            out.append((P + "self_attention.linear_q_down_proj.weight", rep(a + "q_a_proj.weight")))
            out.append((P + "self_attention.linear_q_up_proj.layer_norm_weight",
                        rep(a + "q_a_layernorm.weight")))
            out.append((P + "self_attention.linear_q_up_proj.weight", lambda t: _buffer(
                (hq * qk, d.q_lora), _copy(spec, a + "q_b_proj.weight",
                                           rows=(t * hq * qk, (t + 1) * hq * qk)), dt)))
        else:
            out.append((P + "self_attention.linear_q_proj.weight", lambda t: _buffer(
                (hq * qk, h), _copy(spec, a + "q_proj.weight",
                                    rows=(t * hq * qk, (t + 1) * hq * qk)), dt)))
        out.append((P + "self_attention.linear_kv_down_proj.weight",
                    rep(a + "kv_a_proj_with_mqa.weight")))
        out.append((P + "self_attention.linear_kv_up_proj.layer_norm_weight",
                    rep(a + "kv_a_layernorm.weight")))
        out.append((P + "self_attention.linear_kv_up_proj.weight", lambda t: _buffer(
            (hq * kvw, d.kv_lora), _copy(spec, a + "kv_b_proj.weight",
                                         rows=(t * hq * kvw, (t + 1) * hq * kvw)), dt)))
        ow = hq * d.vh
    else:
        hd, qpg, gl = d.hd, d.nh // d.kv, d.kv // tp

        def qkv(t: int) -> BufferSpec:
            parts, row = [], 0
            for g in range(t * gl, (t + 1) * gl):  # Megatron's grouped [q heads of g; k_g; v_g]
                parts.append(_copy(spec, a + "q_proj.weight",
                                   rows=(g * qpg * hd, (g + 1) * qpg * hd), at=(row, 0)))
                row += qpg * hd
                for w in ("k", "v"):
                    parts.append(_copy(spec, a + f"{w}_proj.weight", rows=(g * hd, (g + 1) * hd),
                                       at=(row, 0)))
                    row += hd
            return _buffer((row, h), parts, dt)

        out.append((P + "self_attention.linear_qkv.layer_norm_weight",
                    rep(H + "input_layernorm.weight")))
        out.append((P + "self_attention.linear_qkv.weight", qkv))
        out.append((P + "self_attention.q_layernorm.weight", rep(a + "q_norm.weight")))
        out.append((P + "self_attention.k_layernorm.weight", rep(a + "k_norm.weight")))
        ow = d.nh * hd // tp
    out.append((P + "self_attention.linear_proj.weight", lambda t: _buffer(
        (h, ow), _copy(spec, a + "o_proj.weight", cols=(t * ow, (t + 1) * ow)), dt)))
    if i < d.n_dense:
        out.append((P + "mlp.linear_fc1.layer_norm_weight",
                    rep(H + "post_attention_layernorm.weight")))
        out += _tp_mlp(spec, H + "mlp.", (P + "mlp.linear_fc1.weight", P + "mlp.linear_fc2.weight"),
                       d.inter // tp, h, dt)
    else:
        out.append((P + "pre_mlp_layernorm.weight", rep(H + "post_attention_layernorm.weight")))
        out.append((P + "mlp.router.weight", rep(H + "mlp.gate.weight")))
        if d.mla:
            out.append((P + "mlp.router.expert_bias", rep(H + "mlp.gate.e_score_correction_bias")))
        if d.n_shared:
            sh = P + "mlp.shared_experts."
            return out, _tp_mlp(spec, H + "mlp.shared_experts.",
                                (sh + "linear_fc1.weight", sh + "linear_fc2.weight"),
                                d.shared // tp, h, dt)
    return out, []


def _tp_mlp(spec: CheckpointSpec, hf: str, names: tuple[str, str], w: int, h: int, dt: str
            ) -> list[_Entry]:
    """TP-split dense MLP, as Megatron (``linear_fc1/2``) and vLLM (``gate_up_proj``/``down_proj``)
    both lay it out: fc1 = [gate rows; up rows] of the shard (``w`` rows each), fc2 = down columns."""
    def fc1(t: int) -> BufferSpec:
        return _buffer((2 * w, h), [
            _copy(spec, hf + "gate_proj.weight", rows=(t * w, (t + 1) * w)),
            _copy(spec, hf + "up_proj.weight", rows=(t * w, (t + 1) * w), at=(w, 0))], dt)

    return [(names[0], fc1), (names[1], lambda t: _buffer(
        (h, w), _copy(spec, hf + "down_proj.weight", cols=(t * w, (t + 1) * w)), dt))]


def _megatron_experts(spec: CheckpointSpec, d: _Dims, i: int, ep: int, etp: int) -> list[_Entry]:
    """Grouped routed-expert buffers of layer ``i``, indexed by ``etp_rank + etp * ep_rank``."""
    gate, up, down = _expert_offsets(spec, i, d.E)
    el, ml, P = d.E // ep, d.mi // etp, f"decoder.layers.{i}.mlp.experts."

    def fc1(x: int) -> BufferSpec:
        s, k = x % etp, x // etp
        e = slice(k * el, (k + 1) * el)
        return _buffer((el, 2 * ml, d.h), _stacked_fc1(gate[e], up[e], (s * ml, (s + 1) * ml), d.h),
                       d.dtype)

    def fc2(x: int) -> BufferSpec:
        s, k = x % etp, x // etp
        return _buffer((el, d.h, ml), _stacked_fc2(down[k * el:(k + 1) * el],
                                                   (s * ml, (s + 1) * ml), d.h, d.mi), d.dtype)

    return [(P + "linear_fc1.weight", fc1), (P + "linear_fc2.weight", fc2)]


# --- FSDP1 --------------------------------------------------------------------------------------
_FSDP_ROOT = "_fsdp_wrapped_module._flat_param"
_FSDP_LAYER = "_fsdp_wrapped_module.model.layers.{i}._fsdp_wrapped_module._flat_param"


def fsdp_trainer(cfg: Mapping, *, nodes: Sequence[str], gpus_per_node: int = 8,
                 first_rank: int = 0, unit: str = "layer") -> list[Layout]:
    """PyTorch FSDP1 (``use_orig_params=False``, FULL_SHARD) trainer layouts, one per GPU.

    Each wrapped unit flattens its tensors (in checkpoint order) into one ``FlatParameter``,
    pads it to a multiple of the world size and gives every rank one equal 1-D shard; padding
    elements hold ``-1``. A shard may span several tensors: one block per tensor piece.

    - ``unit="layer"`` (transformer auto-wrap policy): every decoder layer is a unit,
      ``_fsdp_wrapped_module.model.layers.{i}._fsdp_wrapped_module._flat_param``; the root unit
      ``_fsdp_wrapped_module._flat_param`` holds the rest (embeddings, final norm, lm_head).
    - ``unit="model"``: no auto-wrap, the root unit holds the whole model.

    Args:
        cfg: model config (``wb.layouts.presets.load_config``).
        nodes: trainer node names; the world is ``len(nodes) * gpus_per_node`` GPUs.
        gpus_per_node: GPUs per node.
        first_rank: global rank of the first GPU; ranks are consecutive.
        unit: ``"layer"`` or ``"model"``.

    Returns:
        One trainer :class:`~wb.data.layout.Layout` per GPU, in rank order.

    Raises:
        SpecError: ``unit`` is unknown, or the node arguments are malformed.

    Examples:
        >>> lays = fsdp_trainer(TINY, nodes=["trainer0"], gpus_per_node=3)
        >>> lays[0].buffers["_fsdp_wrapped_module._flat_param"].shape  # (100*32*2 + 32) / 3
        (2144,)
    """
    fn = "fsdp_trainer"
    d = _Dims.of(cfg)
    spec = spec_from_config(cfg)
    world = _world(fn, nodes, gpus_per_node)
    if unit not in ("layer", "model"):
        raise SpecError(f"{fn}: `unit` must be 'layer' (one flat parameter per decoder layer) or "
                        f"'model' (one for the whole model), got {unit!r}")
    sizes = np.diff(spec.offsets)
    if unit == "model":
        units = {_FSDP_ROOT: np.arange(len(spec))}
    else:
        root, layer_of = [], {}
        for k, n in enumerate(spec.names):
            if n.startswith("model.layers."):
                layer_of.setdefault(int(n.split(".", 3)[2]), []).append(k)
            else:
                root.append(k)
        units = {_FSDP_ROOT: np.asarray(root, dtype=np.int64)}
        units.update({_FSDP_LAYER.format(i=i): np.asarray(layer_of[i], dtype=np.int64)
                      for i in range(d.L)})
    per_rank: list[dict[str, BufferSpec]] = [{} for _ in range(world)]
    for name, tensors in units.items():
        toff = spec.offsets[tensors]  # (n,) first id of each tensor of the unit
        tlen = sizes[tensors]
        end = np.cumsum(tlen)  # (n,) flat end of each tensor in the unit
        start = end - tlen
        shard = -(-int(end[-1]) // world) if end.size else 0
        for r in range(world):
            a, b = r * shard, (r + 1) * shard
            k0, k1 = np.searchsorted(end, a, side="right"), np.searchsorted(start, b, side="left")
            lo, hi = np.maximum(start[k0:k1], a), np.minimum(end[k0:k1], b)
            keep = hi > lo  # empty tensors take no block
            lo, hi = lo[keep], hi[keep]
            blk = _blocks(0, 1, lo - a, hi - lo, toff[k0:k1][keep] + lo - start[k0:k1][keep], 0, 1)
            per_rank[r][name] = _buffer((shard,), blk, d.dtype)
    return _layouts(per_rank, Role.TRAINER, first_rank,
                    lambda g: (nodes[g // gpus_per_node], g % gpus_per_node))


# --- JAX mesh -----------------------------------------------------------------------------------
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
        cfg: model config (``wb.layouts.presets.load_config``).
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
        >>> lays = jax_trainer(TINY, dp=1, fsdp=2, tp=2, nodes=["trainer0"], gpus_per_node=4)
        >>> lays[3].buffers["params/layers_1/mlp/experts/wi_0"].shape   # [E/tp, h/fsdp, mi]
        (2, 16, 16)
    """
    fn = "jax_trainer"
    d = _Dims.of(cfg)
    spec = spec_from_config(cfg)
    world = _world(fn, nodes, gpus_per_node)
    _positive(fn, dp=dp, fsdp=fsdp, tp=tp)
    if dp * fsdp * tp != world:
        raise SpecError(f"{fn}: the mesh dp * fsdp * tp = {dp} * {fsdp} * {tp} must equal the "
                        f"{world} devices of `nodes` ({len(nodes)} x {gpus_per_node})")
    fix_f, fix_t = "change the fsdp axis", "change the tp axis"
    _divides("hidden_size", d.h, fsdp, "fsdp", fix_f)
    _divides("num_attention_heads", d.nh, tp, "tp", fix_t)
    if d.mla:
        if d.q_lora:
            _divides("q_lora_rank", d.q_lora, fsdp, "fsdp", fix_f)
        _divides("kv_lora_rank", d.kv_lora, fsdp, "fsdp", fix_f)
    if d.n_dense:
        _divides("intermediate_size", d.inter, tp, "tp", fix_t)
    if d.L > d.n_dense:
        _divides("the number of routed experts", d.E, tp, "tp", fix_t)
        _divides("moe_intermediate_size", d.mi, fsdp, "fsdp", fix_f)
        if d.n_shared:
            _divides("the shared-expert width", d.shared, tp, "tp", fix_t)
    dt, h = d.dtype, d.h
    hl, Vp = h // fsdp, _round_up(d.V, tp)
    vl = Vp // tp
    n = fsdp * tp  # distinct shards; x = fsdp_i * tp + tp_i

    def rep(name: str) -> BufferSpec:
        return _buffer(spec.shape(name), _copy(spec, name), dt)

    def kernel(name: str, split: str) -> Callable[[int], BufferSpec]:
        """``[in, out]`` kernel of HF weight ``name``: ``split`` "ft" = (fsdp, tp), "tf" =
        (tp, fsdp), "f-" = (fsdp, None)."""
        O, I_ = spec.shape(name)
        ax_in, ax_out = {"ft": (fsdp, tp), "tf": (tp, fsdp), "f-": (fsdp, 1)}[split]
        il, ol = I_ // ax_in, O // ax_out

        def build(x: int) -> BufferSpec:
            f, t = divmod(x, tp)
            i_idx, o_idx = {"ft": (f, t), "tf": (t, f), "f-": (f, 0)}[split]
            return _buffer((il, ol), _copy_t(spec, name, out=(o_idx * ol, (o_idx + 1) * ol),
                                             inp=(i_idx * il, (i_idx + 1) * il)), dt)
        return build

    def heads_in(name: str, heads: int, over_tp: bool) -> Callable[[int], BufferSpec]:
        """``[h, heads, hd]`` = HF ``[heads * hd, h]`` transposed, P(fsdp, tp or None, None)."""
        hd = d.hd
        nl = heads // tp if over_tp else heads

        def build(x: int) -> BufferSpec:
            f, t = divmod(x, tp)
            n0 = t * nl if over_tp else 0
            base = spec.offset(name) + n0 * hd * h + f * hl
            if nl == 1:  # one head: the rows of the 2-D view are consecutive inputs
                blk = _blocks(0, hl, 0, hd, base, 1, h)
            else:  # one block per input row i: rows (i, n) for the nl local heads
                i = np.arange(hl, dtype=np.int64)
                blk = _blocks(i * nl, nl, 0, hd, base + i, hd * h, h)
            return _buffer((hl, nl, hd), blk, dt)
        return build

    def o_kernel(name: str) -> Callable[[int], BufferSpec]:
        """``[nh, hd, h]`` of HF o_proj ``[h, nh * hd]``, P(tp, None, fsdp): one block."""
        nl = d.nh // tp

        def build(x: int) -> BufferSpec:
            f, t = divmod(x, tp)
            base = spec.offset(name) + f * hl * d.nh * d.hd + t * nl * d.hd
            return _buffer((nl, d.hd, hl), _blocks(0, nl * d.hd, 0, hl, base, 1, d.nh * d.hd), dt)
        return build

    def vocab(name: str, transposed: bool) -> Callable[[int], BufferSpec]:
        def build(x: int) -> BufferSpec:
            f, t = divmod(x, tp)
            v, c = (t * vl, (t + 1) * vl), (f * hl, (f + 1) * hl)
            if transposed:
                return _buffer((hl, vl), _copy_t(spec, name, out=v, inp=c), dt)
            return _buffer((vl, hl), _copy(spec, name, rows=v, cols=c), dt)
        return build

    def experts(i: int) -> list[_Entry]:
        gate, up, down = _expert_offsets(spec, i, d.E)
        el, ml = d.E // tp, d.mi // fsdp
        P = f"params/layers_{i}/mlp/experts/"

        def wi(off: np.ndarray) -> Callable[[int], BufferSpec]:
            def build(x: int) -> BufferSpec:
                f, t = divmod(x, tp)
                j = np.arange(el, dtype=np.int64)
                return _buffer((el, hl, d.mi), _blocks(j * hl, hl, 0, d.mi,
                                                       off[t * el:(t + 1) * el] + f * hl, 1, h), dt)
            return build

        def wo(x: int) -> BufferSpec:
            f, t = divmod(x, tp)
            j = np.arange(el, dtype=np.int64)
            return _buffer((el, ml, h), _blocks(j * ml, ml, 0, h,
                                                down[t * el:(t + 1) * el] + f * ml, 1, d.mi), dt)
        return [(P + "wi_0", wi(gate)), (P + "wi_1", wi(up)), (P + "wo", wo)]

    entries: list[_Entry] = [("params/embed/embedding", vocab("model.embed_tokens.weight", False))]
    for i in range(d.L):
        P, H = f"params/layers_{i}/", f"model.layers.{i}."
        a = H + "self_attn."
        entries.append((P + "input_norm/scale", rep(H + "input_layernorm.weight")))
        if d.mla:
            if d.q_lora:
                entries += [(P + "attn/wq_a/kernel", kernel(a + "q_a_proj.weight", "f-")),
                            (P + "attn/q_norm/scale", rep(a + "q_a_layernorm.weight")),
                            (P + "attn/wq_b/kernel", kernel(a + "q_b_proj.weight", "ft"))]
            else:
                entries.append((P + "attn/wq/kernel", kernel(a + "q_proj.weight", "ft")))
            entries += [(P + "attn/wkv_a/kernel", kernel(a + "kv_a_proj_with_mqa.weight", "f-")),
                        (P + "attn/kv_norm/scale", rep(a + "kv_a_layernorm.weight")),
                        (P + "attn/wkv_b/kernel", kernel(a + "kv_b_proj.weight", "ft")),
                        (P + "attn/out/kernel", kernel(a + "o_proj.weight", "tf"))]
        else:
            kv_tp = d.kv % tp == 0
            entries += [(P + "attn/q/kernel", heads_in(a + "q_proj.weight", d.nh, True)),
                        (P + "attn/k/kernel", heads_in(a + "k_proj.weight", d.kv, kv_tp)),
                        (P + "attn/v/kernel", heads_in(a + "v_proj.weight", d.kv, kv_tp)),
                        (P + "attn/o/kernel", o_kernel(a + "o_proj.weight")),
                        (P + "attn/q_norm/scale", rep(a + "q_norm.weight")),
                        (P + "attn/k_norm/scale", rep(a + "k_norm.weight"))]
        entries.append((P + "post_norm/scale", rep(H + "post_attention_layernorm.weight")))
        m = H + "mlp."
        if i < d.n_dense:
            entries += [(P + "mlp/wi_0/kernel", kernel(m + "gate_proj.weight", "ft")),
                        (P + "mlp/wi_1/kernel", kernel(m + "up_proj.weight", "ft")),
                        (P + "mlp/wo/kernel", kernel(m + "down_proj.weight", "tf"))]
        else:
            entries.append((P + "mlp/router/kernel", kernel(m + "gate.weight", "f-")))
            if d.mla:
                entries.append((P + "mlp/router/bias", rep(m + "gate.e_score_correction_bias")))
            entries += experts(i)
            if d.n_shared:
                s, j = m + "shared_experts.", P + "mlp/shared_experts/"
                entries += [(j + "wi_0/kernel", kernel(s + "gate_proj.weight", "ft")),
                            (j + "wi_1/kernel", kernel(s + "up_proj.weight", "ft")),
                            (j + "wo/kernel", kernel(s + "down_proj.weight", "tf"))]
    entries.append(("params/final_norm/scale", rep("model.norm.weight")))
    if not d.tied:
        entries.append(("params/lm_head/kernel", vocab("lm_head.weight", True)))
    shards = _shards(entries, n)
    return _layouts([shards[g % n] for g in range(world)], Role.TRAINER, first_rank,
                    lambda g: (nodes[g // gpus_per_node], g % gpus_per_node))


# --- vLLM ---------------------------------------------------------------------------------------
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
      replicated; ``mlp.experts.w13_weight`` ``[E_local, 2 * mi_local, h]`` (expert ``j``: gate
      rows then up rows), ``mlp.experts.w2_weight`` ``[E_local, h, mi_local]``;
      ``mlp.shared_experts.{gate_up_proj,down_proj}.weight`` TP-split like a dense MLP.
    - ``model.layers.{i}.{input,post_attention}_layernorm.weight``, ``model.norm.weight``
      replicated.

    One replica is built; the others reuse its BufferSpec objects (only the Worker differs).

    Args:
        cfg: model config (``wb.layouts.presets.load_config``).
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
        >>> lays = vllm_rollout(TINY, tp=2, ep=2, replicas=2, gpus_per_replica=2,
        ...                     gpus_per_node=4, first_rank=4)
        >>> [(w.worker.rank, w.worker.node, w.worker.local_rank) for w in lays]
        [(4, 'rollout0', 0), (5, 'rollout0', 1), (6, 'rollout0', 2), (7, 'rollout0', 3)]
        >>> lays[1].buffers["model.layers.1.mlp.experts.w13_weight"].shape   # [E/ep, 2*mi, h]
        (2, 32, 32)
    """
    fn = "vllm_rollout"
    d = _Dims.of(cfg)
    spec = spec_from_config(cfg)
    _positive(fn, tp=tp, ep=ep, replicas=replicas, nodes_per_replica=nodes_per_replica,
              gpus_per_node=gpus_per_node)
    if gpus_per_replica is None:
        G = nodes_per_replica * gpus_per_node
    else:
        _positive(fn, gpus_per_replica=gpus_per_replica)
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
    _divides("num_attention_heads", d.nh, tp, "tp", fix)
    if not d.mla and d.kv % tp and tp % d.kv:
        raise SpecError(f"{fn}: `tp`={tp} and num_key_value_heads={d.kv}: one must divide the "
                        f"other (vLLM splits or replicates kv heads)")
    if d.n_dense:
        _divides("intermediate_size", d.inter, tp, "tp", fix)
    moe = d.L > d.n_dense
    if moe and d.n_shared:
        _divides("the shared-expert width", d.shared, tp, "tp", fix)
    if moe and ep == 1:
        _divides("moe_intermediate_size (experts TP-split over the replica)", d.mi, G,
                 "gpus of a replica", "use ep equal to the replica's GPU count")
    dt, h = d.dtype, d.h
    Vp = _round_up(d.V, 64)  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
    _divides("the vocabulary padded to a multiple of 64", Vp, tp, "tp", fix)
    vl = Vp // tp

    def rep(name: str) -> BufferSpec:
        return _buffer(spec.shape(name), _copy(spec, name), dt)

    def vocab(name: str) -> Callable[[int], BufferSpec]:
        return lambda t: _buffer((vl, h), _copy(spec, name, rows=(t * vl, (t + 1) * vl)), dt)

    def mlp(hf: str, w: int) -> list[_Entry]:
        return _tp_mlp(spec, hf, (hf + "gate_up_proj.weight", hf + "down_proj.weight"), w, h, dt)

    def attention(a: str) -> list[_Entry]:
        hq = d.nh // tp
        if d.mla:
            qk, kvw = d.nope + d.rope, d.nope + d.vh
            out: list[_Entry] = []
            if d.q_lora:
                r = d.q_lora
                kva = d.kv_lora + d.rope
                out.append((a + "fused_qkv_a_proj.weight", _buffer((r + kva, h), [
                    _copy(spec, a + "q_a_proj.weight"),
                    _copy(spec, a + "kv_a_proj_with_mqa.weight", at=(r, 0))], dt)))
                out.append((a + "q_a_layernorm.weight", rep(a + "q_a_layernorm.weight")))
                out.append((a + "q_b_proj.weight", lambda t: _buffer(
                    (hq * qk, r), _copy(spec, a + "q_b_proj.weight",
                                        rows=(t * hq * qk, (t + 1) * hq * qk)), dt)))
            else:
                out.append((a + "q_proj.weight", lambda t: _buffer(
                    (hq * qk, h), _copy(spec, a + "q_proj.weight",
                                        rows=(t * hq * qk, (t + 1) * hq * qk)), dt)))
                out.append((a + "kv_a_proj_with_mqa.weight", rep(a + "kv_a_proj_with_mqa.weight")))
            out.append((a + "kv_a_layernorm.weight", rep(a + "kv_a_layernorm.weight")))
            out.append((a + "kv_b_proj.weight", lambda t: _buffer(
                (hq * kvw, d.kv_lora), _copy(spec, a + "kv_b_proj.weight",
                                             rows=(t * hq * kvw, (t + 1) * hq * kvw)), dt)))
            ow = hq * d.vh
        else:
            hd = d.hd
            kl = max(1, d.kv // tp)

            def qkv(t: int) -> BufferSpec:
                k0 = t * kl if tp <= d.kv else t // (tp // d.kv)  # replicated kv head when tp > kv
                return _buffer(((hq + 2 * kl) * hd, h), [
                    _copy(spec, a + "q_proj.weight", rows=(t * hq * hd, (t + 1) * hq * hd)),
                    _copy(spec, a + "k_proj.weight", rows=(k0 * hd, (k0 + kl) * hd),
                          at=(hq * hd, 0)),
                    _copy(spec, a + "v_proj.weight", rows=(k0 * hd, (k0 + kl) * hd),
                          at=((hq + kl) * hd, 0))], dt)
            out = [(a + "qkv_proj.weight", qkv)]
            ow = hq * hd
        out.append((a + "o_proj.weight", lambda t: _buffer(
            (h, ow), _copy(spec, a + "o_proj.weight", cols=(t * ow, (t + 1) * ow)), dt)))
        if not d.mla:
            out += [(a + "q_norm.weight", rep(a + "q_norm.weight")),
                    (a + "k_norm.weight", rep(a + "k_norm.weight"))]
        return out

    def experts(i: int) -> list[_Entry]:
        gate, up, down = _expert_offsets(spec, i, d.E)
        m = f"model.layers.{i}.mlp.experts."
        if ep == 1:  # every expert TP-split over the G GPUs of the replica
            ml = d.mi // G
            return [(m + "w13_weight", lambda g: _buffer(
                        (d.E, 2 * ml, h), _stacked_fc1(gate, up, (g * ml, (g + 1) * ml), h), dt)),
                    (m + "w2_weight", lambda g: _buffer(
                        (d.E, h, ml), _stacked_fc2(down, (g * ml, (g + 1) * ml), h, d.mi), dt))]
        base, extra = divmod(d.E, G)

        def local(g: int) -> slice:
            e0 = g * base + min(g, extra)
            return slice(e0, e0 + base + (g < extra))

        def w13(g: int) -> BufferSpec:
            e = local(g)
            return _buffer((e.stop - e.start, 2 * d.mi, h),
                           _stacked_fc1(gate[e], up[e], (0, d.mi), h), dt)

        def w2(g: int) -> BufferSpec:
            e = local(g)
            return _buffer((e.stop - e.start, h, d.mi),
                           _stacked_fc2(down[e], (0, d.mi), h, d.mi), dt)
        return [(m + "w13_weight", w13), (m + "w2_weight", w2)]

    segments = [(_shards([("model.embed_tokens.weight", vocab("model.embed_tokens.weight"))], tp),
                 True)]
    for i in range(d.L):
        H = f"model.layers.{i}."
        dense: list[_Entry] = [(H + "input_layernorm.weight", rep(H + "input_layernorm.weight"))]
        dense += attention(H + "self_attn.")
        dense.append((H + "post_attention_layernorm.weight",
                      rep(H + "post_attention_layernorm.weight")))
        if i < d.n_dense:
            dense += mlp(H + "mlp.", d.inter // tp)
        else:
            dense.append((H + "mlp.gate.weight", rep(H + "mlp.gate.weight")))
            if d.mla:
                dense.append((H + "mlp.gate.e_score_correction_bias",
                              rep(H + "mlp.gate.e_score_correction_bias")))
        # In module order: (shards, True) is indexed by TP rank, (shards, False) by replica GPU.
        segments.append((_shards(dense, tp), True))
        if i >= d.n_dense:
            segments.append((_shards(experts(i), G), False))
            if d.n_shared:
                segments.append((_shards(mlp(H + "mlp.shared_experts.", d.shared // tp), tp), True))
    tail: list[_Entry] = [("model.norm.weight", rep("model.norm.weight"))]
    if not d.tied:  # tied: vLLM's lm_head shares embed_tokens, no buffer of its own
        tail.append(("lm_head.weight", vocab("lm_head.weight")))
    segments.append((_shards(tail, tp), True))
    replica: list[dict[str, BufferSpec]] = []
    for g in range(G):
        bufs: dict[str, BufferSpec] = {}
        for shards, by_tp in segments:
            bufs.update(shards[g % tp if by_tp else g])
        replica.append(bufs)
    return _layouts([replica[q % G] for q in range(replicas * G)], Role.ROLLOUT, first_rank,
                    lambda q: (f"{node_prefix}{q // gpus_per_node}", q % gpus_per_node))


# --- deployments --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Deployment:
    """A model on trainer nodes and rollout nodes: every GPU's layout and a description.

    Attributes:
        name: the deployment's name (see :data:`DEPLOYMENTS`).
        spec: the checkpoint spec (HF names) every source map refers to.
        trainers: one trainer Layout per trainer GPU (buffers hold ids), in rank order.
        rollouts: one rollout Layout per rollout GPU (buffers need ids), in rank order, replica
            after replica (``description["rollout"]["gpus_per_replica"]`` GPUs each).
        description: JSON-able: model, node and GPU counts, trainer and rollout parallelism.
    """

    name: str
    spec: CheckpointSpec = field(repr=False)
    trainers: list[Layout] = field(repr=False)
    rollouts: list[Layout] = field(repr=False)
    description: dict = field(repr=False)

    @property
    def replicas(self) -> list[list[Layout]]:
        """The rollout Layouts grouped by replica."""
        g = int(self.description["rollout"]["gpus_per_replica"])
        return [self.rollouts[k:k + g] for k in range(0, len(self.rollouts), g)]

    def __repr__(self) -> str:
        return (f"Deployment({self.name!r}, {self.spec!r}, {len(self.trainers)} trainer GPUs, "
                f"{len(self.rollouts)} rollout GPUs)")


@dataclass(frozen=True, slots=True)
class _Plan:
    """One deployment's numbers: Megatron trainer and vLLM rollout, separate nodes."""

    model: str  # config name, or "tiny" for wb.layouts.presets.TINY
    gpus_per_node: int
    trainer_nodes: int
    tp: int
    pp: int
    ep: int
    etp: int
    r_tp: int
    r_ep: int
    replicas: int
    nodes_per_replica: int
    gpus_per_replica: int


_PLANS: dict[str, _Plan] = {
    # 16B: 1 trainer node (TP2, dense DP4, EP8) + 1 rollout node of 4 engines of 2 GPUs.
    "moonlight-16b-a3b": _Plan("moonlight-16b-a3b", 8, 1, tp=2, pp=1, ep=8, etp=1, r_tp=2, r_ep=2,
                               replicas=4, nodes_per_replica=1, gpus_per_replica=2),
    # 235B: 4 trainer nodes (TP4 PP4 EP8, DP2) + 4 one-node engines (TP8 EP8).
    "qwen3-235b-a22b": _Plan("qwen3-235b-a22b", 8, 4, tp=4, pp=4, ep=8, etp=1, r_tp=8, r_ep=8,
                             replicas=4, nodes_per_replica=1, gpus_per_replica=8),
    # 671B: 16 trainer nodes (TP2 PP8 EP16, DP8) + 8 two-node engines (TP8 attention x DP2, EP16).
    "deepseek-v3": _Plan("deepseek-v3", 8, 16, tp=2, pp=8, ep=16, etp=1, r_tp=8, r_ep=16,
                         replicas=8, nodes_per_replica=2, gpus_per_replica=16),
    # 1T: 32 trainer nodes (TP4 PP8 EP32, DP8) + 8 four-node engines (TP8 attention x DP4, EP32).
    "kimi-k2": _Plan("kimi-k2", 8, 32, tp=4, pp=8, ep=32, etp=1, r_tp=8, r_ep=32, replicas=8,
                     nodes_per_replica=4, gpus_per_replica=32),
    # wb.layouts.presets.TINY: 1 trainer node of 4 GPUs (TP2, DP2, EP2) + 1 rollout node, 2 engines of 2.
    "tiny": _Plan("tiny", 4, 1, tp=2, pp=1, ep=2, etp=1, r_tp=2, r_ep=2, replicas=2,
                  nodes_per_replica=1, gpus_per_replica=2),
}

#: Names :func:`deployment` accepts.
DEPLOYMENTS: tuple[str, ...] = tuple(_PLANS)


def deployment(name: str, *, models_dir: Path | str | None = None) -> Deployment:
    """Builds one of the :data:`DEPLOYMENTS`: Megatron-core trainers and vLLM rollouts.

    Trainer and rollout GPUs are on separate nodes (``trainer{i}``, ``rollout{i}``); trainer
    ranks come first, rollout ranks follow, all consecutive. Builds from block descriptions
    only: ``"kimi-k2"`` (1T parameters, 512 GPUs) takes a few seconds.

    Args:
        name: one of :data:`DEPLOYMENTS`.
        models_dir: where the model JSON files are (default ``wb.layouts.presets.MODELS_DIR``).

    Returns:
        The :class:`Deployment`.

    Raises:
        SpecError: unknown ``name``, or the model config is not found.

    Examples:
        >>> dep = deployment("tiny")
        >>> len(dep.trainers), len(dep.rollouts), dep.description["trainer"]["dp"]
        (4, 4, 2)
    """
    plan = _PLANS.get(name)
    if plan is None:
        raise SpecError(f"unknown deployment {name!r}; choose one of {list(DEPLOYMENTS)}")
    cfg = dict(TINY) if plan.model == "tiny" else load_config(plan.model, models_dir)
    gpn = plan.gpus_per_node
    trainer_nodes = [f"trainer{i}" for i in range(plan.trainer_nodes)]
    trainers = megatron_trainer(cfg, tp=plan.tp, pp=plan.pp, ep=plan.ep, etp=plan.etp,
                                nodes=trainer_nodes, gpus_per_node=gpn, first_rank=0)
    rollouts = vllm_rollout(cfg, tp=plan.r_tp, ep=plan.r_ep, replicas=plan.replicas,
                            nodes_per_replica=plan.nodes_per_replica,
                            gpus_per_replica=plan.gpus_per_replica, gpus_per_node=gpn,
                            first_rank=len(trainers))
    spec = spec_from_config(cfg)
    d = _Dims.of(cfg)
    world = len(trainers)
    rollout_nodes = -(-len(rollouts) // gpn)
    description = {
        "name": name,
        "model": cfg.get("name", plan.model),
        "architecture": d.arch,
        "params": spec.numel,
        "bytes": spec.nbytes,
        "dtype": d.dtype,
        "nodes": plan.trainer_nodes + rollout_nodes,
        "gpus_per_node": gpn,
        "trainer": {
            "framework": "megatron-core", "nodes": plan.trainer_nodes, "gpus": world,
            "tp": plan.tp, "pp": plan.pp, "ep": plan.ep, "etp": plan.etp,
            "dp": world // (plan.tp * plan.pp),
            "edp": world // (plan.pp * plan.etp * plan.ep),
            "layers_per_stage": [len(r) for r in _pp_stages(d.L, plan.pp)],
            "padded_vocab": _round_up(d.V, 128 * plan.tp),
        },
        "rollout": {
            "framework": "vllm", "nodes": rollout_nodes, "gpus": len(rollouts),
            "tp": plan.r_tp, "ep": plan.r_ep, "replicas": plan.replicas,
            "nodes_per_replica": plan.gpus_per_replica / gpn if plan.gpus_per_replica < gpn
            else plan.gpus_per_replica // gpn,
            "gpus_per_replica": plan.gpus_per_replica,
            "attention_dp": plan.gpus_per_replica // plan.r_tp,
            "padded_vocab": _round_up(d.V, 64),
        },
    }
    return Deployment(name, spec, trainers, rollouts, description)
