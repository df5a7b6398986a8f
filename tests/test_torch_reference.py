"""TinyRollout (the vLLM-style reference model) against its numpy oracle, without probing.

Loading each checkpoint tensor's own global ids (exact in float64) makes every parameter element
show which id it received, so the model's load path can be compared with ``expected_maps``.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from wb.layouts.presets import TINY, spec_from_config  # noqa: E402
from wb_torch.testing import TinyRollout, checkpoint_tensors, expected_maps  # noqa: E402

# tp > kv (1 kv head, replicated on every rank) with more experts than ranks.
ONE_KV = {**TINY, "name": "tiny-one-kv", "num_key_value_heads": 1, "num_experts": 8}
TIED = {**TINY, "name": "tiny-tied", "tie_word_embeddings": True}

CASES = [(TINY, tp, r) for tp in (1, 2, 4) for r in range(tp)] + [
    (ONE_KV, tp, r) for tp in (2, 4) for r in range(tp)] + [(TIED, 2, 1)]


def _id_tensors(spec, order=None):
    names = list(spec.names) if order is None else order
    return ((n, torch.from_numpy(spec.ids(n).astype(np.float64))) for n in names)


def _filled_model(cfg, tp, r):
    model = TinyRollout(cfg, tp_rank=r, tp_size=tp, dtype=torch.float64)
    for p in model.parameters():
        p.data.fill_(-1)
    return model


@pytest.mark.parametrize("shuffle", [False, True], ids=["spec-order", "shuffled"])
@pytest.mark.parametrize("cfg,tp,r", CASES,
                         ids=[f"{c['name']}-tp{tp}-r{r}" for c, tp, r in CASES])
def test_load_weights_matches_oracle(cfg, tp, r, shuffle):
    spec = spec_from_config(cfg)
    order = list(spec.names)
    if shuffle:
        random.Random(tp * 10 + r).shuffle(order)
    model = _filled_model(cfg, tp, r)
    model.load_weights(_id_tensors(spec, order))
    want = expected_maps(cfg, tp_rank=r, tp_size=tp)
    got = {n: p.detach().numpy() for n, p in model.named_parameters()}
    assert sorted(got) == sorted(want)
    for name, ids in want.items():
        assert got[name].shape == ids.shape, name
        # k_scale is never loaded and vocab padding never written: both still hold the -1 fill.
        np.testing.assert_array_equal(got[name], ids.astype(np.float64), err_msg=name)


@pytest.mark.parametrize("cfg", [TINY, ONE_KV], ids=["tiny", "one-kv"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_oracle_ranks_cover_every_checkpoint_id(cfg, tp):
    spec = spec_from_config(cfg)
    held = np.concatenate([m.ravel() for r in range(tp)
                           for m in expected_maps(cfg, tp_rank=r, tp_size=tp).values()])
    np.testing.assert_array_equal(np.unique(held[held >= 0]), np.arange(spec.numel))


def test_replicated_kv_heads_pick_head_by_rank_group():
    spec = spec_from_config(TINY)  # 2 kv heads over 4 ranks: ranks 0,1 -> head 0; 2,3 -> head 1
    k = spec.ids("model.layers.0.self_attn.k_proj.weight")
    hd, nq = TINY["head_dim"], TINY["num_attention_heads"] // 4
    for r, head in [(0, 0), (1, 0), (2, 1), (3, 1)]:
        qkv = expected_maps(TINY, tp_rank=r, tp_size=4)["model.layers.0.self_attn.qkv_proj.weight"]
        np.testing.assert_array_equal(qkv[nq * hd:(nq + 1) * hd], k[head * hd:(head + 1) * hd])


def test_load_weights_keeps_parameter_storage():
    model = TinyRollout(tp_rank=1, tp_size=2)
    before = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
    model.load_weights(checkpoint_tensors(model.spec).items())
    after = dict(model.named_parameters())
    for n, (p, ptr) in before.items():
        assert after[n] is p and after[n].data_ptr() == ptr, n


def test_tied_embeddings_share_one_parameter():
    model = TinyRollout(TIED)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.float8_e4m3fn])
def test_dtypes_construct_and_load(dtype):
    model = TinyRollout(tp_rank=1, tp_size=2, dtype=dtype)
    tensors = checkpoint_tensors(model.spec, dtype=dtype)
    assert model.load_weights(tensors.items()) == {
        n for n in expected_maps(tp_rank=1, tp_size=2) if not n.endswith("k_scale")}
    want = expected_maps(tp_rank=1, tp_size=2)
    for name, p in model.named_parameters():
        assert tuple(p.shape) == want[name].shape, name
        assert p.dtype == (torch.float32 if name.endswith("k_scale") else dtype), name
    # One value end to end: layer 1's expert 3 (rank 1's second expert) up_proj row 0.
    w13 = model.model.layers[1].mlp.experts.routed_experts.w13_weight
    up = tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    assert torch.equal(w13[1, TINY["moe_intermediate_size"]].float(), up[0].float())
    assert model.model.layers[0].self_attn.attn.k_scale.item() == 1.0


def test_checkpoint_tensors_are_seeded():
    spec = spec_from_config(TINY)
    a, b = checkpoint_tensors(spec), checkpoint_tensors(spec)
    assert list(a) == list(spec.names)
    assert all(torch.equal(a[n], b[n]) and tuple(a[n].shape) == spec.shape(n) for n in spec.names)
    c = checkpoint_tensors(spec, np.random.default_rng(1))
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_unknown_name_raises_key_error():
    model = TinyRollout()
    with pytest.raises(KeyError, match=r"model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight"):
        # Layer 0 is dense in TINY: no experts there.
        model.load_weights([("model.layers.0.mlp.experts.0.gate_proj.weight",
                             torch.zeros(16, 32))])


def test_wrong_full_shape_raises_value_error():
    model = TinyRollout(tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match=r"shape \(16, 32\), but the checkpoint shape is \(32, "):
        # A pre-sharded q_proj (what a trainer shard looks like) instead of the full tensor.
        model.load_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(16, 32))])


@pytest.mark.parametrize("cfg,kw,match", [
    (TINY, dict(tp_size=3), r"tp_size`=3 must divide num_attention_heads=4"),
    ({**TINY, "num_attention_heads": 6}, dict(tp_size=3),
     r"tp_size`=3 and num_key_value_heads=2 must divide one another"),
    ({**TINY, "num_experts": 6}, dict(tp_size=4), r"tp_size`=4 must divide num_experts=6"),
    ({**TINY, "intermediate_size": 50}, dict(tp_size=4),
     r"tp_size`=4 must divide intermediate_size=50"),
    (TINY, dict(tp_rank=2, tp_size=2), r"tp_rank` must be an int in \[0, 2\)"),
    (TINY, dict(tp_size=0), r"tp_size` must be a positive int, got 0"),
    ({**TINY, "architecture": "deepseek_v3"}, {}, r"only models 'qwen3_moe'"),
])
def test_invalid_arguments_raise(cfg, kw, match):
    with pytest.raises(ValueError, match=match):
        TinyRollout(cfg, **kw)
    with pytest.raises(ValueError, match=match):
        expected_maps(cfg, **kw)


def test_non_float_dtype_raises():
    with pytest.raises(ValueError, match=r"`dtype` must be a floating torch.dtype, got torch.int"):
        TinyRollout(dtype=torch.int32)


def test_forward_is_not_implemented():
    with pytest.raises(NotImplementedError):
        TinyRollout()(torch.zeros(1, dtype=torch.long))
