"""JAX trainer layouts on a ``(dp, fsdp, tp)`` device mesh, flax-style names, ``[in, out]`` kernels.

(Named ``jax_mesh``, not ``jax``: the catalogue never imports JAX, and a sibling module called
``jax`` would read as if it did.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from wb.data.layout import BufferSpec, Layout, Role
from wb.errors import SpecError
from wb.layouts.blocks import (broadcast_blocks, buffer_spec, expert_offsets, slice_block,
                               transposed_block)
from wb.layouts.dims import ModelDims
from wb.layouts.presets import spec_from_config
from wb.layouts.shards import (Entry, check_divides, check_positive, check_world, shard_buffers,
                               worker_layouts)

__all__ = ["jax_trainer"]


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
    fn = "jax_trainer"
    d = ModelDims.of(cfg)
    spec = spec_from_config(cfg)
    world = check_world(fn, nodes, gpus_per_node)
    check_positive(fn, dp=dp, fsdp=fsdp, tp=tp)
    if dp * fsdp * tp != world:
        raise SpecError(f"{fn}: the mesh dp * fsdp * tp = {dp} * {fsdp} * {tp} must equal the "
                        f"{world} devices of `nodes` ({len(nodes)} x {gpus_per_node})")
    fix_f, fix_t = "change the fsdp axis", "change the tp axis"
    check_divides("hidden_size", d.hidden, fsdp, "fsdp", fix_f)
    check_divides("num_attention_heads", d.heads, tp, "tp", fix_t)
    if d.mla:
        if d.q_lora_rank:
            check_divides("q_lora_rank", d.q_lora_rank, fsdp, "fsdp", fix_f)
        check_divides("kv_lora_rank", d.kv_lora_rank, fsdp, "fsdp", fix_f)
    if d.n_dense:
        check_divides("intermediate_size", d.intermediate, tp, "tp", fix_t)
    if d.layers > d.n_dense:
        check_divides("the number of routed experts", d.experts, tp, "tp", fix_t)
        check_divides("moe_intermediate_size", d.moe_intermediate, fsdp, "fsdp", fix_f)
        if d.n_shared:
            check_divides("the shared-expert width", d.shared_width, tp, "tp", fix_t)
    dt, h = d.dtype, d.hidden
    hl, Vp = h // fsdp, d.padded_vocab(tp)
    vl = Vp // tp
    n = fsdp * tp  # distinct shards; x = fsdp_i * tp + tp_i

    def rep(name: str) -> BufferSpec:  # whole, in the checkpoint tensor's own dtype
        return buffer_spec(spec.shape(name), slice_block(spec, name), spec.dtype(name))

    def kernel(name: str, split: str) -> Callable[[int], BufferSpec]:
        """``[in, out]`` kernel of HF weight ``name``: ``split`` "ft" = (fsdp, tp), "tf" =
        (tp, fsdp), "f-" = (fsdp, None)."""
        O, I_ = spec.shape(name)
        ax_in, ax_out = {"ft": (fsdp, tp), "tf": (tp, fsdp), "f-": (fsdp, 1)}[split]
        il, ol = I_ // ax_in, O // ax_out

        def build(x: int) -> BufferSpec:
            f, t = divmod(x, tp)
            i_idx, o_idx = {"ft": (f, t), "tf": (t, f), "f-": (f, 0)}[split]
            return buffer_spec((il, ol), transposed_block(
                spec, name, out=(o_idx * ol, (o_idx + 1) * ol),
                inp=(i_idx * il, (i_idx + 1) * il)), dt)
        return build

    def heads_in(name: str, heads: int, over_tp: bool) -> Callable[[int], BufferSpec]:
        """``[h, heads, hd]`` = HF ``[heads * hd, h]`` transposed, P(fsdp, tp or None, None)."""
        hd = d.head_dim
        nl = heads // tp if over_tp else heads

        def build(x: int) -> BufferSpec:
            f, t = divmod(x, tp)
            n0 = t * nl if over_tp else 0
            base = spec.offset(name) + n0 * hd * h + f * hl
            if nl == 1:  # one head: the rows of the 2-D view are consecutive inputs
                blk = broadcast_blocks(0, hl, 0, hd, base, 1, h)
            else:  # one block per input row i: rows (i, n) for the nl local heads
                i = np.arange(hl, dtype=np.int64)
                blk = broadcast_blocks(i * nl, nl, 0, hd, base + i, hd * h, h)
            return buffer_spec((hl, nl, hd), blk, dt)
        return build

    def o_kernel(name: str) -> Callable[[int], BufferSpec]:
        """``[nh, hd, h]`` of HF o_proj ``[h, nh * hd]``, P(tp, None, fsdp): one block."""
        nl, nh, hd = d.heads // tp, d.heads, d.head_dim

        def build(x: int) -> BufferSpec:
            f, t = divmod(x, tp)
            base = spec.offset(name) + f * hl * nh * hd + t * nl * hd
            return buffer_spec((nl, hd, hl), broadcast_blocks(0, nl * hd, 0, hl, base, 1, nh * hd),
                               dt)
        return build

    def vocab(name: str, transposed: bool) -> Callable[[int], BufferSpec]:
        def build(x: int) -> BufferSpec:
            f, t = divmod(x, tp)
            v, c = (t * vl, (t + 1) * vl), (f * hl, (f + 1) * hl)
            if transposed:
                return buffer_spec((hl, vl), transposed_block(spec, name, out=v, inp=c), dt)
            return buffer_spec((vl, hl), slice_block(spec, name, rows=v, cols=c), dt)
        return build

    def experts(i: int) -> list[Entry]:
        gate, up, down = expert_offsets(spec, i, d.experts)
        mi = d.moe_intermediate
        el, ml = d.experts // tp, mi // fsdp
        P = f"params/layers_{i}/mlp/experts/"

        def wi(off: np.ndarray) -> Callable[[int], BufferSpec]:
            def build(x: int) -> BufferSpec:
                f, t = divmod(x, tp)
                j = np.arange(el, dtype=np.int64)
                return buffer_spec((el, hl, mi), broadcast_blocks(
                    j * hl, hl, 0, mi, off[t * el:(t + 1) * el] + f * hl, 1, h), dt)
            return build

        def wo(x: int) -> BufferSpec:
            f, t = divmod(x, tp)
            j = np.arange(el, dtype=np.int64)
            return buffer_spec((el, ml, h), broadcast_blocks(
                j * ml, ml, 0, h, down[t * el:(t + 1) * el] + f * ml, 1, mi), dt)
        return [(P + "wi_0", wi(gate)), (P + "wi_1", wi(up)), (P + "wo", wo)]

    entries: list[Entry] = [("params/embed/embedding", vocab("model.embed_tokens.weight", False))]
    for i in range(d.layers):
        P, H = f"params/layers_{i}/", f"model.layers.{i}."
        a = H + "self_attn."
        entries.append((P + "input_norm/scale", rep(H + "input_layernorm.weight")))
        if d.mla:
            if d.q_lora_rank:
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
            kv_tp = d.kv_heads % tp == 0
            entries += [(P + "attn/q/kernel", heads_in(a + "q_proj.weight", d.heads, True)),
                        (P + "attn/k/kernel", heads_in(a + "k_proj.weight", d.kv_heads, kv_tp)),
                        (P + "attn/v/kernel", heads_in(a + "v_proj.weight", d.kv_heads, kv_tp)),
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
    shards = shard_buffers(entries, n)
    return worker_layouts([shards[g % n] for g in range(world)], Role.TRAINER, first_rank,
                          lambda g: (nodes[g // gpus_per_node], g % gpus_per_node))
