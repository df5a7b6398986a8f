"""Layout generators equal a brute-force numpy oracle; the paper deployments cover every id.

The oracles below rebuild every buffer element by element from ``spec.ids(name)`` with numpy
slicing, reshapes and transposes (an independent implementation of each framework's sharding);
the generators build the same maps from affine blocks only.
"""

import json

import numpy as np
import pytest

import wb
from wb.layouts import (DEPLOYMENTS, TINY, deployment, fsdp_trainer, jax_trainer, load_config,
                        megatron_trainer, spec_from_config, vllm_rollout)
from wb.data.correspondence import correspond
from wb.data.layout import Role
from wb.data.sourcemap import Blocks
from harness.presets import real_deployment

#: A tiny deepseek_v3 (MLA with q LoRA, one dense layer, one shared expert); vocab 90 pads
#: everywhere (Megatron 128 * tp, vLLM 64, JAX tp = 4).
MLA = dict(name="tiny-mla", architecture="deepseek_v3", vocab_size=90, hidden_size=16,
           num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=24, n_routed_experts=4,
           moe_intermediate_size=8, n_shared_experts=1, num_experts_per_tok=2,
           num_attention_heads=4, num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=8,
           qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4, tie_word_embeddings=False,
           dtype="bfloat16")
#: The same without q LoRA (plain q_proj, as Moonlight).
MLA_NO_QLORA = {**MLA, "name": "tiny-mla-no-qlora", "q_lora_rank": None}
CONFIGS = {"tiny": TINY, "mla": MLA, "mla-no-qlora": MLA_NO_QLORA}


# --- oracle helpers -----------------------------------------------------------------------------
def part(a: np.ndarray, k: int, n: int, axis: int = 0) -> np.ndarray:
    """The k-th of n equal parts of ``a`` along ``axis``."""
    return np.split(a, n, axis=axis)[k]


def pad_rows(a: np.ndarray, n: int) -> np.ndarray:
    out = np.full((n,) + a.shape[1:], -1, dtype=np.int64)
    out[:a.shape[0]] = a
    return out


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def dims(cfg):
    E = cfg.get("num_experts", cfg.get("n_routed_experts"))
    return (cfg["num_hidden_layers"], cfg.get("first_k_dense_replace", 0), E,
            cfg["architecture"] == "deepseek_v3")


# Kept in float32 whatever the weights' dtype (as real checkpoints and engines keep it).
FLOAT32 = ("e_score_correction_bias", "expert_bias", "router/bias")


def assert_layouts_equal(layouts, expected, role, dtype="bfloat16"):
    assert len(layouts) == len(expected)
    for lay, exp in zip(layouts, expected):
        assert lay.worker.role == role
        assert list(lay.buffers) == list(exp), f"rank {lay.worker.rank}: buffer names differ"
        for name, ids in exp.items():
            buf = lay.buffers[name]
            want = "float32" if any(k in name for k in FLOAT32) else dtype
            assert buf.dtype == want and buf.shape == ids.shape, (lay.worker.rank, name, buf.shape)
            np.testing.assert_array_equal(buf.sourcemap.to_indices(), ids,
                                          err_msg=f"rank {lay.worker.rank} {name}")


def assert_covers(spec, layouts):
    """The layouts' buffers hold (or need) every id of the spec, decoded element by element."""
    ids = np.concatenate([b.sourcemap.to_indices().reshape(-1)
                          for lay in layouts for b in lay.buffers.values()])
    np.testing.assert_array_equal(np.unique(ids[ids >= 0]), np.arange(spec.numel))


# --- Megatron -----------------------------------------------------------------------------------
def megatron_oracle(cfg, spec, *, tp, pp, ep, etp, world):
    I = spec.ids
    L, n_dense, E, mla = dims(cfg)
    h = cfg["hidden_size"]
    dp = world // (tp * pp)
    per_stage = [L // pp + (s < L % pp) for s in range(pp)]
    first = np.cumsum([0] + per_stage)
    Vp = round_up(cfg["vocab_size"], 128 * tp)
    out = []
    for rank in range(world):
        p, within = divmod(rank, tp * dp)
        t, s, k = within % tp, within % etp, (within // etp) % ep
        b = {}
        if p == 0:
            b["embedding.word_embeddings.weight"] = part(pad_rows(I("model.embed_tokens.weight"), Vp), t, tp)
        for i in range(first[p], first[p + 1]):
            P, H = f"decoder.layers.{i}.", f"model.layers.{i}."
            a = H + "self_attn."
            if mla:
                b[P + "input_layernorm.weight"] = I(H + "input_layernorm.weight")
                if cfg["q_lora_rank"]:
                    b[P + "self_attention.linear_q_down_proj.weight"] = I(a + "q_a_proj.weight")
                    b[P + "self_attention.linear_q_up_proj.layer_norm_weight"] = I(a + "q_a_layernorm.weight")
                    b[P + "self_attention.linear_q_up_proj.weight"] = part(I(a + "q_b_proj.weight"), t, tp)
                else:
                    b[P + "self_attention.linear_q_proj.weight"] = part(I(a + "q_proj.weight"), t, tp)
                b[P + "self_attention.linear_kv_down_proj.weight"] = I(a + "kv_a_proj_with_mqa.weight")
                b[P + "self_attention.linear_kv_up_proj.layer_norm_weight"] = I(a + "kv_a_layernorm.weight")
                b[P + "self_attention.linear_kv_up_proj.weight"] = part(I(a + "kv_b_proj.weight"), t, tp)
            else:
                kv = cfg["num_key_value_heads"]
                q = I(a + "q_proj.weight").reshape(kv, -1, h)  # [group, q heads of the group * hd, h]
                kk = I(a + "k_proj.weight").reshape(kv, -1, h)
                vv = I(a + "v_proj.weight").reshape(kv, -1, h)
                groups = part(np.arange(kv), t, tp)
                b[P + "self_attention.linear_qkv.layer_norm_weight"] = I(H + "input_layernorm.weight")
                b[P + "self_attention.linear_qkv.weight"] = np.concatenate(
                    [np.concatenate([q[g], kk[g], vv[g]]) for g in groups])
                b[P + "self_attention.q_layernorm.weight"] = I(a + "q_norm.weight")
                b[P + "self_attention.k_layernorm.weight"] = I(a + "k_norm.weight")
            b[P + "self_attention.linear_proj.weight"] = part(I(a + "o_proj.weight"), t, tp, axis=1)
            m = H + "mlp."

            def fc(hf, mg, shard, n):
                b[mg + "linear_fc1.weight"] = np.concatenate(
                    [part(I(hf + "gate_proj.weight"), shard, n), part(I(hf + "up_proj.weight"), shard, n)])
                b[mg + "linear_fc2.weight"] = part(I(hf + "down_proj.weight"), shard, n, axis=1)

            if i < n_dense:
                b[P + "mlp.linear_fc1.layer_norm_weight"] = I(H + "post_attention_layernorm.weight")
                fc(m, P + "mlp.", t, tp)
            else:
                b[P + "pre_mlp_layernorm.weight"] = I(H + "post_attention_layernorm.weight")
                b[P + "mlp.router.weight"] = I(m + "gate.weight")
                if mla:
                    b[P + "mlp.router.expert_bias"] = I(m + "gate.e_score_correction_bias")
                local = part(np.arange(E), k, ep)
                b[P + "mlp.experts.linear_fc1.weight"] = np.stack([np.concatenate(
                    [part(I(m + f"experts.{e}.{w}_proj.weight"), s, etp) for w in ("gate", "up")])
                    for e in local])
                b[P + "mlp.experts.linear_fc2.weight"] = np.stack(
                    [part(I(m + f"experts.{e}.down_proj.weight"), s, etp, axis=1) for e in local])
                if cfg.get("n_shared_experts"):
                    fc(m + "shared_experts.", P + "mlp.shared_experts.", t, tp)
        if p == pp - 1:
            b["decoder.final_layernorm.weight"] = I("model.norm.weight")
            b["output_layer.weight"] = part(pad_rows(I("lm_head.weight"), Vp), t, tp)
        out.append(b)
    return out


MEGATRON = [  # tp, pp, ep, etp, nodes, gpus_per_node
    (1, 1, 1, 1, 1, 1), (2, 1, 2, 1, 1, 4), (2, 2, 2, 1, 2, 4), (1, 2, 4, 1, 1, 8),
    (2, 1, 1, 2, 1, 4), (1, 3, 2, 2, 3, 4),
]


@pytest.mark.parametrize("tp, pp, ep, etp, n_nodes, gpn", MEGATRON)
@pytest.mark.parametrize("model", list(CONFIGS))
def test_megatron_matches_oracle(model, tp, pp, ep, etp, n_nodes, gpn):
    cfg, spec = CONFIGS[model], spec_from_config(CONFIGS[model])
    nodes = [f"trainer{i}" for i in range(n_nodes)]
    lays = megatron_trainer(cfg, tp=tp, pp=pp, ep=ep, etp=etp, nodes=nodes, gpus_per_node=gpn,
                            first_rank=3)
    assert [(w.worker.rank, w.worker.node, w.worker.local_rank) for w in lays] == [
        (3 + g, nodes[g // gpn], g % gpn) for g in range(n_nodes * gpn)]
    assert_layouts_equal(lays, megatron_oracle(cfg, spec, tp=tp, pp=pp, ep=ep, etp=etp,
                                               world=n_nodes * gpn), Role.TRAINER)
    assert_covers(spec, lays)
    # data-parallel copies share BufferSpec objects
    dp = n_nodes * gpn // (tp * pp)
    if dp > 1:
        assert all(lays[0].buffers[n] is lays[tp].buffers[n] for n in lays[0].buffers
                   if "experts.linear" not in n)


def test_megatron_uneven_pipeline_gives_first_stages_one_more_layer():
    cfg = {**TINY, "num_hidden_layers": 5}
    lays = megatron_trainer(cfg, tp=1, pp=3, ep=1, nodes=["t0"], gpus_per_node=3)
    layers = [sorted({int(n.split(".")[2]) for n in lay.buffers if n.startswith("decoder.layers.")})
              for lay in lays]
    assert layers == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("kwargs, match", [
    (dict(tp=3, pp=1, ep=1, nodes=["t0"], gpus_per_node=4), r"multiple of tp \* pp"),
    (dict(tp=2, pp=1, ep=3, nodes=["t0"], gpus_per_node=4), r"multiple of etp \* ep"),
    (dict(tp=4, pp=1, ep=1, nodes=["t0"], gpus_per_node=4), "num_key_value_heads"),
    (dict(tp=1, pp=1, ep=3, nodes=["t0"], gpus_per_node=3), "routed experts"),
    (dict(tp=1, pp=1, ep=1, nodes="t0"), "list of node names"),
])
def test_megatron_errors_say_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        megatron_trainer(TINY, **kwargs)


# --- FSDP ---------------------------------------------------------------------------------------
def fsdp_oracle(spec, *, world, unit, dtype="bfloat16"):
    units = {}
    kept = [n for n in spec.names if spec.dtype(n) != dtype]  # buffers: whole on every rank
    for name in spec.names:
        if name in kept:
            continue
        if unit == "layer" and name.startswith("model.layers."):
            key = f"_fsdp_wrapped_module.model.layers.{name.split('.')[2]}._fsdp_wrapped_module._flat_param"
        else:
            key = "_fsdp_wrapped_module._flat_param"
        units.setdefault(key, []).append(spec.ids(name).reshape(-1))
    out = [{} for _ in range(world)]
    root = units.pop("_fsdp_wrapped_module._flat_param")
    for key, parts in {"_fsdp_wrapped_module._flat_param": root, **units}.items():
        flat = np.concatenate(parts)
        flat = np.concatenate([flat, np.full(round_up(flat.size, world) - flat.size, -1)])
        for r in range(world):
            out[r][key] = part(flat, r, world)
    for r in range(world):
        out[r].update({n: spec.ids(n) for n in kept})
    return out


@pytest.mark.parametrize("world", [1, 3, 8])
@pytest.mark.parametrize("unit", ["layer", "model"])
@pytest.mark.parametrize("model", list(CONFIGS))
def test_fsdp_matches_oracle(model, unit, world):
    spec = spec_from_config(CONFIGS[model])
    lays = fsdp_trainer(CONFIGS[model], nodes=["trainer0"], gpus_per_node=world, unit=unit)
    assert_layouts_equal(lays, fsdp_oracle(spec, world=world, unit=unit), Role.TRAINER)
    assert_covers(spec, lays)


def test_fsdp_rejects_unknown_unit():
    with pytest.raises(ValueError, match="`unit` must be 'layer'"):
        fsdp_trainer(TINY, nodes=["t0"], unit="block")


# --- JAX ----------------------------------------------------------------------------------------
def jax_oracle(cfg, spec, *, dp, fsdp, tp):
    I = spec.ids
    L, n_dense, E, mla = dims(cfg)
    h = cfg["hidden_size"]
    Vp = round_up(cfg["vocab_size"], tp)

    def T(name):  # [in, out] kernel
        return I(name).T

    def ft(a, f, t):  # P(fsdp, tp)
        return part(part(a, f, fsdp, 0), t, tp, 1)

    def tf(a, f, t):  # P(tp, fsdp)
        return part(part(a, t, tp, 0), f, fsdp, 1)

    out = []
    for rank in range(dp * fsdp * tp):
        f, t = (rank // tp) % fsdp, rank % tp
        b = {"params/embed/embedding": tf(pad_rows(I("model.embed_tokens.weight"), Vp), f, t)}
        for i in range(L):
            P, H = f"params/layers_{i}/", f"model.layers.{i}."
            a, m = H + "self_attn.", H + "mlp."
            b[P + "input_norm/scale"] = I(H + "input_layernorm.weight")
            if mla:
                if cfg["q_lora_rank"]:
                    b[P + "attn/wq_a/kernel"] = part(T(a + "q_a_proj.weight"), f, fsdp)
                    b[P + "attn/q_norm/scale"] = I(a + "q_a_layernorm.weight")
                    b[P + "attn/wq_b/kernel"] = ft(T(a + "q_b_proj.weight"), f, t)
                else:
                    b[P + "attn/wq/kernel"] = ft(T(a + "q_proj.weight"), f, t)
                b[P + "attn/wkv_a/kernel"] = part(T(a + "kv_a_proj_with_mqa.weight"), f, fsdp)
                b[P + "attn/kv_norm/scale"] = I(a + "kv_a_layernorm.weight")
                b[P + "attn/wkv_b/kernel"] = ft(T(a + "kv_b_proj.weight"), f, t)
                b[P + "attn/out/kernel"] = tf(T(a + "o_proj.weight"), f, t)
            else:
                nh, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
                b[P + "attn/q/kernel"] = ft(T(a + "q_proj.weight").reshape(h, nh, hd), f, t)
                for w in ("k", "v"):
                    k3 = T(a + f"{w}_proj.weight").reshape(h, kv, hd)
                    b[P + f"attn/{w}/kernel"] = ft(k3, f, t) if kv % tp == 0 else part(k3, f, fsdp)
                o3 = T(a + "o_proj.weight").reshape(nh, hd, h)
                b[P + "attn/o/kernel"] = part(part(o3, t, tp, 0), f, fsdp, 2)
                b[P + "attn/q_norm/scale"] = I(a + "q_norm.weight")
                b[P + "attn/k_norm/scale"] = I(a + "k_norm.weight")
            b[P + "post_norm/scale"] = I(H + "post_attention_layernorm.weight")

            def dense(hf, jx):
                b[jx + "wi_0/kernel"] = ft(T(hf + "gate_proj.weight"), f, t)
                b[jx + "wi_1/kernel"] = ft(T(hf + "up_proj.weight"), f, t)
                b[jx + "wo/kernel"] = tf(T(hf + "down_proj.weight"), f, t)

            if i < n_dense:
                dense(m, P + "mlp/")
            else:
                b[P + "mlp/router/kernel"] = part(T(m + "gate.weight"), f, fsdp)
                if mla:
                    b[P + "mlp/router/bias"] = I(m + "gate.e_score_correction_bias")
                for key, w in (("wi_0", "gate"), ("wi_1", "up"), ("wo", "down")):
                    stack = np.stack([T(m + f"experts.{e}.{w}_proj.weight") for e in range(E)])
                    b[P + f"mlp/experts/{key}"] = part(part(stack, t, tp, 0), f, fsdp, 1)
                if cfg.get("n_shared_experts"):
                    dense(m + "shared_experts.", P + "mlp/shared_experts/")
        b["params/final_norm/scale"] = I("model.norm.weight")
        b["params/lm_head/kernel"] = ft(pad_rows(I("lm_head.weight"), Vp).T, f, t)
        out.append(b)
    return out


@pytest.mark.parametrize("dp, fsdp, tp", [(1, 1, 1), (1, 2, 2), (2, 2, 1), (1, 1, 4), (2, 1, 2),
                                          (1, 4, 2)])
@pytest.mark.parametrize("model", list(CONFIGS))
def test_jax_matches_oracle(model, dp, fsdp, tp):
    cfg, spec = CONFIGS[model], spec_from_config(CONFIGS[model])
    world = dp * fsdp * tp
    lays = jax_trainer(cfg, dp=dp, fsdp=fsdp, tp=tp, nodes=["t0", "t1"], gpus_per_node=world // 2
                       ) if world % 2 == 0 else jax_trainer(cfg, dp=dp, fsdp=fsdp, tp=tp,
                                                             nodes=["t0"], gpus_per_node=world)
    assert_layouts_equal(lays, jax_oracle(cfg, spec, dp=dp, fsdp=fsdp, tp=tp), Role.TRAINER)
    assert_covers(spec, lays)
    if dp > 1:  # replicas share BufferSpec objects
        assert all(lays[0].buffers[n] is lays[fsdp * tp].buffers[n] for n in lays[0].buffers)


def test_jax_mesh_must_fill_the_nodes():
    with pytest.raises(ValueError, match=r"dp \* fsdp \* tp = 1 \* 2 \* 2 must equal the 8"):
        jax_trainer(TINY, dp=1, fsdp=2, tp=2, nodes=["t0"])
    with pytest.raises(ValueError, match="`tp`=8 must divide num_attention_heads"):
        jax_trainer(TINY, dp=1, fsdp=1, tp=8, nodes=["t0"])


# --- vLLM ---------------------------------------------------------------------------------------
def vllm_oracle(cfg, spec, *, tp, ep, G):
    I = spec.ids
    L, n_dense, E, mla = dims(cfg)
    Vp = round_up(cfg["vocab_size"], 64)
    out = []
    for g in range(G):
        t = g % tp
        b = {"model.embed_tokens.weight": part(pad_rows(I("model.embed_tokens.weight"), Vp), t, tp)}
        for i in range(L):
            H = f"model.layers.{i}."
            a, m = H + "self_attn.", H + "mlp."
            b[H + "input_layernorm.weight"] = I(H + "input_layernorm.weight")
            if mla:
                if cfg["q_lora_rank"]:
                    b[a + "fused_qkv_a_proj.weight"] = np.concatenate(
                        [I(a + "q_a_proj.weight"), I(a + "kv_a_proj_with_mqa.weight")])
                    b[a + "q_a_layernorm.weight"] = I(a + "q_a_layernorm.weight")
                    b[a + "q_b_proj.weight"] = part(I(a + "q_b_proj.weight"), t, tp)
                else:
                    b[a + "q_proj.weight"] = part(I(a + "q_proj.weight"), t, tp)
                    b[a + "kv_a_proj_with_mqa.weight"] = I(a + "kv_a_proj_with_mqa.weight")
                b[a + "kv_a_layernorm.weight"] = I(a + "kv_a_layernorm.weight")
                b[a + "kv_b_proj.weight"] = part(I(a + "kv_b_proj.weight"), t, tp)
                b[a + "o_proj.weight"] = part(I(a + "o_proj.weight"), t, tp, axis=1)
            else:
                kv = cfg["num_key_value_heads"]

                def kv_rows(w):
                    ids = I(a + f"{w}_proj.weight")
                    return part(ids, t, tp) if tp <= kv else part(ids, t // (tp // kv), kv)

                b[a + "qkv_proj.weight"] = np.concatenate(
                    [part(I(a + "q_proj.weight"), t, tp), kv_rows("k"), kv_rows("v")])
                b[a + "o_proj.weight"] = part(I(a + "o_proj.weight"), t, tp, axis=1)
                b[a + "q_norm.weight"] = I(a + "q_norm.weight")
                b[a + "k_norm.weight"] = I(a + "k_norm.weight")
            b[H + "post_attention_layernorm.weight"] = I(H + "post_attention_layernorm.weight")

            def dense(hf):
                b[hf + "gate_up_proj.weight"] = np.concatenate(
                    [part(I(hf + "gate_proj.weight"), t, tp), part(I(hf + "up_proj.weight"), t, tp)])
                b[hf + "down_proj.weight"] = part(I(hf + "down_proj.weight"), t, tp, axis=1)

            if i < n_dense:
                dense(m)
                continue
            b[m + "gate.weight"] = I(m + "gate.weight")
            if mla:
                b[m + "gate.e_score_correction_bias"] = I(m + "gate.e_score_correction_bias")
            x, y = m + "experts.", m + "experts.routed_experts."  # vLLM 0.33's names
            if ep == G:  # whole experts; np.array_split gives the first E % G ranks one more
                local = np.array_split(np.arange(E), G)[g]
                b[y + "w13_weight"] = np.stack([np.concatenate(
                    [I(f"{x}{e}.gate_proj.weight"), I(f"{x}{e}.up_proj.weight")]) for e in local])
                b[y + "w2_weight"] = np.stack([I(f"{x}{e}.down_proj.weight") for e in local])
            else:  # every expert TP-split over the replica
                b[y + "w13_weight"] = np.stack([np.concatenate(
                    [part(I(f"{x}{e}.gate_proj.weight"), g, G), part(I(f"{x}{e}.up_proj.weight"), g, G)])
                    for e in range(E)])
                b[y + "w2_weight"] = np.stack(
                    [part(I(f"{x}{e}.down_proj.weight"), g, G, axis=1) for e in range(E)])
            if cfg.get("n_shared_experts"):
                dense(m + "shared_experts.")
        b["model.norm.weight"] = I("model.norm.weight")
        b["lm_head.weight"] = part(pad_rows(I("lm_head.weight"), Vp), t, tp)
        out.append(b)
    return out


VLLM = [(1, 1, 1), (2, 2, 2), (4, 4, 4), (2, 4, 4), (2, 1, 2), (2, 1, 4), (1, 3, 3)]  # tp, ep, G


@pytest.mark.parametrize("tp, ep, G", VLLM)
@pytest.mark.parametrize("model", list(CONFIGS))
def test_vllm_matches_oracle(model, tp, ep, G):
    cfg, spec = CONFIGS[model], spec_from_config(CONFIGS[model])
    replicas = 3
    lays = vllm_rollout(cfg, tp=tp, ep=ep, replicas=replicas, gpus_per_replica=G, gpus_per_node=G,
                        first_rank=10)
    assert [(w.worker.rank, w.worker.node, w.worker.local_rank) for w in lays] == [
        (10 + q, f"rollout{q // G}", q % G) for q in range(replicas * G)]
    one = vllm_oracle(cfg, spec, tp=tp, ep=ep, G=G)
    assert_layouts_equal(lays, one * replicas, Role.ROLLOUT)
    for k in range(replicas):
        assert_covers(spec, lays[k * G:(k + 1) * G])
        assert all(lays[k * G + g].buffers[n] is lays[g].buffers[n]  # built once, reused
                   for g in range(G) for n in lays[g].buffers)


def test_vllm_packs_replicas_on_nodes_and_spans_nodes():
    lays = vllm_rollout(TINY, tp=2, ep=2, replicas=4, gpus_per_replica=2, gpus_per_node=4,
                        first_rank=0)
    assert [w.worker.node for w in lays] == ["rollout0"] * 4 + ["rollout1"] * 4
    lays = vllm_rollout(TINY, tp=2, ep=4, replicas=2, nodes_per_replica=2, gpus_per_node=2,
                        first_rank=0, node_prefix="r")
    assert [(w.worker.node, w.worker.local_rank) for w in lays] == [
        (f"r{q // 2}", q % 2) for q in range(8)]


@pytest.mark.parametrize("kwargs, match", [
    (dict(tp=2, ep=3, replicas=1, gpus_per_replica=4, gpus_per_node=4), "`ep`=3 must be"),
    (dict(tp=3, ep=1, replicas=1, gpus_per_replica=4, gpus_per_node=4), "`tp`=3 must divide the 4"),
    (dict(tp=2, ep=2, replicas=1, gpus_per_replica=3, gpus_per_node=8), "must divide `gpus_per_node`"),
])
def test_vllm_errors_say_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        vllm_rollout(TINY, first_rank=0, **kwargs)


# --- deployments --------------------------------------------------------------------------------
def test_tiny_deployment_matches_oracles():
    dep = deployment("tiny")
    spec = spec_from_config(TINY)
    assert dep.spec == spec and dep.description["nodes"] == 2
    assert_layouts_equal(dep.trainers, megatron_oracle(TINY, spec, tp=2, pp=1, ep=2, etp=1, world=4),
                         Role.TRAINER)
    assert_layouts_equal(dep.rollouts, vllm_oracle(TINY, spec, tp=2, ep=2, G=2) * 2, Role.ROLLOUT)
    assert [w.worker.rank for w in dep.trainers + dep.rollouts] == list(range(8))
    assert_covers(spec, dep.trainers)
    for replica in dep.replicas:
        assert_covers(spec, replica)
    json.dumps(dep.description)


def test_unknown_deployment_lists_the_names():
    with pytest.raises(wb.SpecError, match="kimi-k2"):
        deployment("kimi")


def tensor_rectangles(spec, layouts):
    """Every block of the layouts' (distinct) buffers as a rectangle of its checkpoint tensor.

    Returns ``(tensor, a0, na, b0, nb)`` rows, deduplicated. Megatron and vLLM copy slices without
    transposing, so a block is rows x columns of one tensor's 2-D view (asserted).
    """
    seen, fields = set(), []
    for lay in layouts:
        for buf in lay.buffers.values():
            if id(buf) not in seen:
                seen.add(id(buf))
                fields.append(buf.sourcemap.blocks)
    b = Blocks(*(np.concatenate(f) for f in zip(*fields)))
    k = spec.tensor_of(b.id0)
    cols = np.array([s[-1] if s else 1 for _, (s, _) in spec.items()], dtype=np.int64)
    B = cols[k]
    rel = b.id0 - spec.offsets[k]
    a0, b0 = rel // B, rel % B
    assert ((b.sc == 1) | (b.nc == 1)).all() and ((b.sr == B) | (b.nr == 1)).all()
    assert (b0 + b.nc <= B).all()
    return np.unique(np.stack([k, a0, b.nr, b0, b.nc], axis=1), axis=0)


def assert_tiles(spec, rect):
    """The rectangles tile every tensor exactly: row bands or column bands, end to end."""
    sizes = np.diff(spec.offsets)
    cols = np.array([s[-1] if s else 1 for _, (s, _) in spec.items()], dtype=np.int64)
    rows = sizes // np.maximum(cols, 1)
    k, a0, na, b0, nb = rect.T
    full_w = (b0 == 0) & (nb == cols[k])
    by_rows = np.bincount(k, weights=~full_w, minlength=len(spec)) == 0  # every rect a row band
    use_rows = by_rows[k]
    if not use_rows.all():  # the others must all be column bands
        assert ((a0 == 0) & (na == rows[k]))[~use_rows].all()
    s = np.where(use_rows, a0, b0)
    n = np.where(use_rows, na, nb)
    length = np.where(use_rows, rows[k], cols[k])
    order = np.lexsort((s, k))
    k, s, n, length = k[order], s[order], n[order], length[order]
    first = np.r_[True, k[1:] != k[:-1]]
    last = np.r_[k[1:] != k[:-1], True]
    assert np.array_equal(np.unique(k), np.flatnonzero(sizes > 0)), "a tensor is missing"
    assert (s[first] == 0).all(), "a tensor's first rows/columns are missing"
    assert (s[1:][~first[1:]] == (s + n)[:-1][~first[1:]]).all(), "gap or overlap inside a tensor"
    assert ((s + n)[last] == length[last]).all(), "a tensor's last rows/columns are missing"


REAL = {  # trainer nodes, rollout nodes, replicas, gpus per replica, trainer (tp, pp, ep)
    "moonlight-16b-a3b": (1, 1, 4, 2, (2, 1, 8)),
    "qwen3-235b-a22b": (4, 4, 4, 8, (4, 4, 8)),
    "deepseek-v3": (16, 16, 8, 16, (2, 8, 16)),
    "kimi-k2": (32, 32, 8, 32, (4, 8, 32)),
}


@pytest.mark.parametrize("name", list(REAL))
def test_real_deployment_covers_every_id(name):
    assert name in DEPLOYMENTS
    dep = real_deployment(name)
    t_nodes, r_nodes, replicas, G, (tp, pp, ep) = REAL[name]
    desc = dep.description
    json.dumps(desc)
    assert desc["nodes"] == t_nodes + r_nodes and desc["gpus_per_node"] == 8
    assert (desc["trainer"]["tp"], desc["trainer"]["pp"], desc["trainer"]["ep"]) == (tp, pp, ep)
    assert desc["rollout"]["replicas"] == replicas and desc["rollout"]["gpus_per_replica"] == G
    assert len(dep.trainers) == 8 * t_nodes and len(dep.rollouts) == replicas * G
    workers = [lay.worker for lay in dep.trainers + dep.rollouts]
    assert [w.rank for w in workers] == list(range(len(workers)))
    assert {w.node for w in workers[:8 * t_nodes]} == {f"trainer{i}" for i in range(t_nodes)}
    assert {w.node for w in workers[8 * t_nodes:]} == {f"rollout{i}" for i in range(r_nodes)}
    assert all(w.role == Role.TRAINER for w in workers[:8 * t_nodes])
    assert all(w.role == Role.ROLLOUT for w in workers[8 * t_nodes:])
    assert [w.local_rank for w in workers] == [q % 8 for q in range(len(workers))]
    # trainers hold every id; every rollout replica needs every id (distinct, via tiling)
    assert_tiles(dep.spec, tensor_rectangles(dep.spec, dep.trainers))
    assert_tiles(dep.spec, tensor_rectangles(dep.spec, dep.replicas[0]))
    # replicas are the first one's BufferSpecs again, so they need the same ids
    for replica in dep.replicas[1:]:
        assert all(a.buffers[n] is b.buffers[n] for a, b in zip(dep.replicas[0], replica)
                   for n in a.buffers)
    # within a replica, a replicated tensor appears once per GPU, a TP-split one once per TP group,
    # a routed expert once: the bytes needed add up to that.
    r_tp = desc["rollout"]["tp"]
    needed = sum(b.sourcemap.n_ids for lay in dep.replicas[0] for b in lay.buffers.values())
    copies = np.full(len(dep.spec), G // r_tp)
    for k, n in enumerate(dep.spec.names):
        if n.endswith(("layernorm.weight", "norm.weight", "gate.weight",
                       "e_score_correction_bias", "q_a_proj.weight", "kv_a_proj_with_mqa.weight")):
            copies[k] = G
        elif ".experts." in n:
            copies[k] = 1
        elif n.endswith(("k_proj.weight", "v_proj.weight")):  # GQA kv heads replicated when tp > kv
            copies[k] *= max(1, r_tp // load_config(name)["num_key_value_heads"])
    assert needed == int(np.dot(np.diff(dep.spec.offsets), copies))


# --- cost: blocks, not elements ------------------------------------------------------------------
# Build time and memory are proportional to the blocks and diff2 entries the maps store (wall
# time and peak RSS are measured by bench/bench_plan.py, not asserted here: they depend on the
# machine). These counts are exact and the same everywhere.

def distinct_maps(layouts):
    """The distinct source maps of the layouts (replicas and data-parallel copies share them)."""
    return list({id(b.sourcemap): b.sourcemap for lay in layouts
                 for b in lay.buffers.values()}.values())


def stored(layouts):
    """``(blocks, diff2 entries, ids)`` of the layouts' distinct maps."""
    maps = distinct_maps(layouts)
    return (sum(m.blocks.count for m in maps), sum(m.nnz for m in maps),
            sum(m.n_ids for m in maps))


WIDE = 8  # every width of the model times this: elements grow ~WIDE**2, blocks must not


def widened(cfg):
    # (not the vocabulary: how many TP shards hold only padding would change with it)
    keys = ("hidden_size", "intermediate_size", "moe_intermediate_size",
            "head_dim", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim")
    return {**cfg, **{k: cfg[k] * WIDE for k in keys if cfg.get(k)}}


GENERATORS = {
    "megatron": lambda c: megatron_trainer(c, tp=2, pp=3, ep=2, etp=2, nodes=["t0", "t1"],
                                           gpus_per_node=6),
    "vllm": lambda c: vllm_rollout(c, tp=2, ep=4, replicas=2, gpus_per_replica=4, gpus_per_node=4,
                                   first_rank=0),
    "vllm-ep1": lambda c: vllm_rollout(c, tp=2, ep=1, replicas=1, gpus_per_replica=4,
                                       gpus_per_node=4, first_rank=0),
    "fsdp": lambda c: fsdp_trainer(c, nodes=["t0"], gpus_per_node=3),
    "jax": lambda c: jax_trainer(c, dp=1, fsdp=2, tp=2, nodes=["t0"], gpus_per_node=4),
}


@pytest.mark.parametrize("generator", list(GENERATORS))
@pytest.mark.parametrize("model", list(CONFIGS))
def test_maps_store_blocks_not_elements(model, generator):
    small, wide = (GENERATORS[generator](c) for c in (CONFIGS[model], widened(CONFIGS[model])))
    (b0, n0, ids0), (b1, n1, ids1) = stored(small), stored(wide)
    assert ids1 >= WIDE * ids0  # the wide model really is larger (by ~WIDE**2 in most tensors)
    if generator in ("megatron", "vllm", "vllm-ep1"):  # slices of slices: the same rectangles
        assert (b1, n1) == (b0, n0)
    elif generator == "fsdp":  # a shard boundary cuts one tensor piece in two, wherever it falls
        spec = spec_from_config(CONFIGS[model])
        units, world = CONFIGS[model]["num_hidden_layers"] + 1, 3
        kept = sum(spec.dtype(n) != "bfloat16" for n in spec)  # whole on every rank
        bound = len(spec) + (units + kept) * (world - 1)
        assert b0 <= bound and b1 <= bound
    else:  # JAX: a [h, heads, hd] kernel takes one block per input row: linear in width at most
        assert b1 <= WIDE * b0
    for m in distinct_maps(wide):  # the map's storage: at most 16 diff2 entries per block
        assert m.nnz <= 16 * m.blocks.count


@pytest.mark.parametrize("name", list(REAL))
def test_real_deployment_maps_are_tiny_next_to_the_weights(name):
    dep = real_deployment(name)
    for side in (dep.trainers, dep.rollouts):
        blocks, nnz, _ = stored(side)
        # each tensor is cut into its distinct shards (TP ranks, expert shards): a few blocks per
        # tensor, whatever its size; a Blocks row is 7 int64, a diff2 entry 2
        assert blocks <= 2 * len(dep.spec)
        assert blocks * 7 * 8 + nnz * 2 * 8 <= 1e-4 * dep.spec.nbytes


@pytest.mark.parametrize("trainer", ["megatron", "fsdp", "jax"])
def test_correspondence_from_each_trainer_to_vllm_equals_element_oracle(trainer):
    from wb.testing import correspondence_pairs, overlap_pairs
    rollouts = deployment("tiny").rollouts
    trainers = {
        "megatron": lambda: deployment("tiny").trainers,
        "fsdp": lambda: fsdp_trainer(TINY, nodes=["t0"], gpus_per_node=3),
        "jax": lambda: jax_trainer(TINY, dp=1, fsdp=2, tp=2, nodes=["t0"], gpus_per_node=4),
    }[trainer]()
    corr = correspond(trainers, rollouts)
    assert overlap_pairs(corr) == correspondence_pairs(trainers, rollouts)


def test_tied_embeddings_have_no_lm_head_buffer_except_megatrons_last_stage_copy():
    cfg = {**TINY, "tie_word_embeddings": True}
    spec = spec_from_config(cfg)
    one = megatron_trainer(cfg, tp=1, pp=1, ep=1, nodes=["t0"], gpus_per_node=1)
    assert "output_layer.weight" not in one[0].buffers
    two = megatron_trainer(cfg, tp=1, pp=2, ep=1, nodes=["t0"], gpus_per_node=2)
    assert two[1].buffers["output_layer.weight"] == two[0].buffers["embedding.word_embeddings.weight"]
    rollouts = vllm_rollout(cfg, tp=2, ep=2, replicas=1, gpus_per_replica=2, gpus_per_node=2,
                            first_rank=0)
    assert "lm_head.weight" not in rollouts[0].buffers
    for lays in (one, two, rollouts, fsdp_trainer(cfg, nodes=["t0"], gpus_per_node=2),
                 jax_trainer(cfg, dp=1, fsdp=1, tp=2, nodes=["t0"], gpus_per_node=2)):
        assert_covers(spec, lays)
