"""The JAX reference trainer (wb_jax.testing) against its numpy oracle, with no probing machinery.

Each checkpoint element is fed as its own id + 1 in float32 (TINY's ids are < 2**24, so exact), so a
params leaf minus 1 *is* its id map, padding (zeros) reading as -1 like the oracle's padding.
"""

import os

# Emulated CPU devices must be requested before JAX initialises its backend; when another test
# module got there first, the jax.config route below fails and mesh tests skip if too few devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax = pytest.importorskip("jax")
try:
    jax.config.update("jax_num_cpu_devices", 8)
except RuntimeError:
    pass  # backend already initialised: whatever device count it has stands

from jax.sharding import PartitionSpec as P  # noqa: E402

from wb.errors import SpecError  # noqa: E402
from wb.layouts.presets import TINY, spec_from_config  # noqa: E402
from wb_jax.testing import (  # noqa: E402
    checkpoint_arrays,
    expected_maps,
    make_load_fn,
    make_mesh,
)

TINY32 = dict(TINY, dtype="float32")
MESHES = [None, (2, 2), (1, 4)]

needs_4_devices = pytest.mark.skipif(
    len(jax.devices()) < 4, reason="needs >= 4 JAX devices (XLA_FLAGS was set too late)")


def _mesh(axes):
    return None if axes is None else make_mesh(*axes)


def _id_checkpoint(cfg):
    """Every element holds its global id + 1, as float32 (0 is left for padding)."""
    spec = spec_from_config(cfg)
    assert spec.numel + 1 < 2**24, "ids would not be exact in float32"
    return {n: (spec.ids(n) + 1).astype(np.float32) for n in spec.names}


def _leaves(params):
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}


def _expected_pspec(key, cfg, tp):
    """The PartitionSpec of each leaf, written out from the layout table (not from the module)."""
    layer_specs = {
        "['input_norm']": P(), "['post_norm']": P(),
        "['attn']['q']": P("dp", "tp", None), "['attn']['o']": P("tp", None, "dp"),
        "['attn']['q_norm']": P(), "['attn']['k_norm']": P(),
    }
    kv = P(None, "tp", None) if cfg["num_key_value_heads"] % tp == 0 else P()
    if key == "['embed']":
        return P("tp", None)
    if key == "['lm_head']":
        return P(None, "tp")
    if key == "['final_norm']":
        return P()
    layer = int(key.split("][")[1].split("]")[0])  # "['layers'][i]..."
    rest = key[len(f"['layers'][{layer}]"):]
    if rest in ("['attn']['k']", "['attn']['v']"):
        return kv
    if rest in layer_specs:
        return layer_specs[rest]
    dense = layer < cfg["first_k_dense_replace"]
    mlp = ({"['mlp']['gate_up']": P(None, "dp", "tp"), "['mlp']['down']": P("tp", None)} if dense
           else {"['mlp']['router']": P(), "['mlp']['gate_up']": P(None, "tp", None, None),
                 "['mlp']['down']": P("tp", "dp", None)})
    return mlp[rest]


# --- the oracle on its own -----------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_oracle_holds_every_id_once_and_pads_the_vocab(tp, tied):
    cfg = dict(TINY, tie_word_embeddings=tied)
    spec = spec_from_config(cfg)
    maps = expected_maps(cfg, tp=tp)
    held = np.concatenate([m.ravel() for m in maps.values()])
    np.testing.assert_array_equal(np.sort(held[held >= 0]), np.arange(spec.numel))
    vp = -(-cfg["vocab_size"] // (8 * tp)) * 8 * tp
    assert maps["['embed']"].shape == (vp, cfg["hidden_size"])
    assert ("['lm_head']" in maps) is not tied
    assert (held < 0).sum() == (vp - cfg["vocab_size"]) * cfg["hidden_size"] * (1 if tied else 2)


def test_oracle_spot_checks_against_the_hf_names():
    spec = spec_from_config(TINY)
    maps = expected_maps(TINY)
    hd = TINY["head_dim"]
    q = spec.ids("model.layers.0.self_attn.q_proj.weight")  # [nh*hd, h]
    assert maps["['layers'][0]['attn']['q']"][5, 3, 2] == q[3 * hd + 2, 5]
    o = spec.ids("model.layers.2.self_attn.o_proj.weight")  # [h, nh*hd]
    assert maps["['layers'][2]['attn']['o']"][1, 7, 30] == o[30, 1 * hd + 7]
    up = spec.ids("model.layers.0.mlp.up_proj.weight")  # [I, h]
    assert maps["['layers'][0]['mlp']['gate_up']"][1, 4, 40] == up[40, 4]
    gate = spec.ids("model.layers.1.mlp.experts.3.gate_proj.weight")  # [mi, h]
    assert maps["['layers'][1]['mlp']['gate_up']"][0, 3, 20, 9] == gate[9, 20]
    down = spec.ids("model.layers.2.mlp.experts.2.down_proj.weight")  # [h, mi]
    assert maps["['layers'][2]['mlp']['down']"][2, 15, 31] == down[31, 15]
    lm = spec.ids("lm_head.weight")  # [V, h]
    assert maps["['lm_head']"][6, 99] == lm[99, 6] and maps["['lm_head']"][6, 100] == -1


# --- load against the oracle ---------------------------------------------------------------------

@pytest.mark.parametrize("axes", MESHES, ids=str)
def test_load_places_every_element_where_the_oracle_says(axes):
    if axes is not None and len(jax.devices()) < 4:
        pytest.skip("needs >= 4 JAX devices (XLA_FLAGS was set too late)")
    tp = 1 if axes is None else axes[1]
    params = make_load_fn(TINY32, _mesh(axes))(_id_checkpoint(TINY32))
    leaves, oracle = _leaves(params), expected_maps(TINY32, tp=tp)
    assert leaves.keys() == oracle.keys()
    for key, leaf in leaves.items():
        assert leaf.dtype == np.float32, key
        got = np.asarray(leaf).astype(np.int64) - 1
        assert got.shape == oracle[key].shape, key
        np.testing.assert_array_equal(got, oracle[key], err_msg=key)


@needs_4_devices
@pytest.mark.parametrize("cfg", [TINY32, dict(TINY32, first_k_dense_replace=1)], ids=["moe", "dense"])
def test_tp_shard_is_what_one_device_of_the_mesh_holds(cfg):
    """make_load_fn(tp_shard=(r, 4)) gives device r's shard of the (1, 4) mesh's leaves, and
    expected_maps(tp_rank=r) those shards of the oracle."""
    ckpt = _id_checkpoint(cfg)
    mesh = make_mesh(1, 4)
    full = _leaves(make_load_fn(cfg, mesh)(ckpt))
    oracle = expected_maps(cfg, tp=4)
    for r in range(4):
        part = _leaves(make_load_fn(cfg, tp_shard=(r, 4))(ckpt))
        part_oracle = expected_maps(cfg, tp=4, tp_rank=r)
        assert part.keys() == full.keys() == part_oracle.keys()
        for key, leaf in full.items():
            shard = next(s for s in leaf.addressable_shards if s.device == mesh.devices[0, r])
            np.testing.assert_array_equal(np.asarray(part[key]), np.asarray(shard.data),
                                          err_msg=key)
            np.testing.assert_array_equal(part_oracle[key], oracle[key][shard.index], err_msg=key)


@pytest.mark.parametrize("axes", MESHES, ids=str)
def test_leaves_carry_the_documented_shardings(axes):
    if axes is not None and len(jax.devices()) < 4:
        pytest.skip("needs >= 4 JAX devices (XLA_FLAGS was set too late)")
    mesh = _mesh(axes)
    leaves = _leaves(make_load_fn(TINY32, mesh)(_id_checkpoint(TINY32)))
    for key, leaf in leaves.items():
        if mesh is None:
            assert len(leaf.sharding.device_set) == 1, key
            continue
        assert leaf.sharding.mesh == mesh, key
        assert leaf.sharding.spec == _expected_pspec(key, TINY32, axes[1]), key
    if mesh is not None:
        # TINY has 2 kv heads: sharded over tp=2, replicated when tp=4 does not divide them.
        k = leaves["['layers'][0]['attn']['k']"]
        assert k.sharding.spec == (P(None, "tp", None) if axes[1] == 2 else P())
        q = leaves["['layers'][0]['attn']['q']"]
        assert {s.data.shape for s in q.addressable_shards} == {(32 // axes[0], 4 // axes[1], 8)}


def test_load_keeps_bfloat16_and_values():
    spec = spec_from_config(TINY)
    ckpt = checkpoint_arrays(spec, seed=3)
    params = make_load_fn(TINY)(ckpt)
    flat = np.concatenate([ckpt[n].ravel() for n in spec.names])  # id order
    for key, leaf in _leaves(params).items():
        assert leaf.dtype == ml_dtypes.bfloat16, key
        ids = expected_maps(TINY)[key]
        want = np.where(ids >= 0, flat[np.maximum(ids, 0)], np.zeros((), flat.dtype))
        np.testing.assert_array_equal(np.asarray(leaf), want, err_msg=key)


def test_load_accepts_jax_arrays_and_tied_embeddings():
    cfg = dict(TINY32, tie_word_embeddings=True)
    ckpt = {n: jax.numpy.asarray(x) for n, x in _id_checkpoint(cfg).items()}
    leaves, oracle = _leaves(make_load_fn(cfg)(ckpt)), expected_maps(cfg)
    assert "['lm_head']" not in leaves and leaves.keys() == oracle.keys()
    for key, leaf in leaves.items():
        np.testing.assert_array_equal(np.asarray(leaf).astype(np.int64) - 1, oracle[key], key)


def test_checkpoint_arrays_follow_the_spec_and_the_seed():
    spec = spec_from_config(dict(TINY, dtype="float8_e4m3fn"))
    a, b, c = (checkpoint_arrays(spec, seed=s) for s in (0, 0, 1))
    assert list(a) == list(spec.names)
    for n in spec.names:
        assert a[n].shape == spec.shape(n) and a[n].dtype == ml_dtypes.float8_e4m3fn
        np.testing.assert_array_equal(a[n].view(np.uint8), b[n].view(np.uint8))
    assert any((a[n].view(np.uint8) != c[n].view(np.uint8)).any() for n in spec.names)
    bf16 = checkpoint_arrays(spec_from_config(TINY))
    assert bf16["model.norm.weight"].dtype == ml_dtypes.bfloat16


# --- errors a person can act on ------------------------------------------------------------------

def test_make_mesh_errors():
    with pytest.raises(ValueError, match=r"needs 4096 devices.*jax_num_cpu_devices.*"
                                         r"xla_force_host_platform_device_count=4096"):
        make_mesh(dp=64, tp=64)
    with pytest.raises(ValueError, match=r"make_mesh\(dp=0, tp=2\).*>= 1"):
        make_mesh(dp=0, tp=2)


@needs_4_devices
@pytest.mark.parametrize("change, axes, match", [
    (dict(num_attention_heads=6), (1, 4),
     r"`cfg\['num_attention_heads'\]` = 6 is not divisible by tp = 4"),
    (dict(num_experts=6), (1, 4), r"`cfg\['num_experts'\]` = 6 is not divisible by tp = 4"),
    (dict(hidden_size=30), (4, 1), r"`cfg\['hidden_size'\]` = 30 is not divisible by dp = 4"),
    (dict(moe_intermediate_size=18), (4, 1), r"`cfg\['moe_intermediate_size'\]` = 18 .* dp = 4"),
    (dict(intermediate_size=50), (1, 4), r"`cfg\['intermediate_size'\]` = 50 .* tp = 4"),
])
def test_config_that_does_not_fit_the_mesh_is_refused(change, axes, match):
    with pytest.raises(SpecError, match=match):
        make_load_fn(dict(TINY, **change), make_mesh(*axes))


@needs_4_devices
def test_every_clash_is_listed_at_once():
    cfg = dict(TINY, num_attention_heads=6, num_experts=6)
    with pytest.raises(ValueError, match=r"num_attention_heads.*num_experts"):
        make_load_fn(cfg, make_mesh(1, 4))


def test_unsupported_configs_and_meshes_are_refused():
    with pytest.raises(SpecError, match=r"'deepseek_v3'.*qwen3_moe"):
        make_load_fn(dict(TINY, architecture="deepseek_v3"))
    with pytest.raises(SpecError, match=r"`cfg` has no `head_dim`"):
        make_load_fn({k: v for k, v in TINY.items() if k != "head_dim"})
    with pytest.raises(SpecError, match=r"num_experts` is 0"):
        make_load_fn(dict(TINY, num_experts=0))
    with pytest.raises(SpecError, match=r"tp must be >= 1"):
        expected_maps(TINY, tp=0)
    other = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    with pytest.raises(SpecError, match=r"axes \('data', 'model'\).*\('dp', 'tp'\)"):
        make_load_fn(TINY, other)


def test_load_refuses_a_checkpoint_that_does_not_match_the_config():
    load, ckpt = make_load_fn(TINY32), _id_checkpoint(TINY32)
    missing = dict(ckpt)
    del missing["model.layers.1.mlp.experts.2.up_proj.weight"]
    with pytest.raises(SpecError, match=r"no tensor `model\.layers\.1\.mlp\.experts\.2\.up_proj"):
        load(missing)
    with pytest.raises(SpecError, match=r"`ckpt\['model\.norm\.weight'\]` has shape \(31,\)"):
        load(dict(ckpt, **{"model.norm.weight": np.zeros(31, np.float32)}))
    with pytest.raises(SpecError, match=r"does not define: \['extra'\]"):
        load(dict(ckpt, extra=np.zeros(1, np.float32)))
    if not jax.config.jax_enable_x64:
        with pytest.raises(SpecError, match=r"is float64 but JAX would store it as float32"):
            load(dict(ckpt, **{"model.norm.weight": np.zeros(32, np.float64)}))
