"""wb_jax.probe on the reference JAX trainer: exact global maps and per-device shard maps."""

import collections
import logging

import numpy as np
import pytest
from wb.data.dtypes import dtype_info

jax = pytest.importorskip("jax")

import wb  # noqa: E402
import wb_jax  # noqa: E402
from wb_jax.probing import DeviceArrays  # noqa: E402
from harness.feeds import FEED_CASES, SKIPS, feed_mismatches  # noqa: E402
from wb.layouts.presets import TINY, spec_from_config  # noqa: E402
from wb_jax.testing import checkpoint_arrays, expected_maps, make_load_fn, make_mesh  # noqa: E402

needs4 = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (emulated) devices")


@needs4
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_probe_equals_oracle_on_a_2x2_mesh(dtype):
    cfg = dict(TINY, dtype=dtype)
    maps = wb_jax.probe(make_load_fn(cfg, make_mesh(2, 2)), spec_from_config(cfg))
    want = expected_maps(cfg, tp=2)
    assert set(maps) == set(want)
    for key, ids in want.items():
        np.testing.assert_array_equal(maps[key].to_indices(), ids, err_msg=key)
    # Reshaped attention kernels: one block per input row at most; stacked gate/up: 2 x E blocks.
    assert maps["['layers'][0]['attn']['q']"].blocks.count <= TINY["hidden_size"]
    assert maps["['layers'][1]['mlp']['gate_up']"].blocks.count == 2 * TINY["num_experts"]


@needs4
def test_shard_maps_follow_each_arrays_sharding():
    mesh = make_mesh(2, 2)
    load = make_load_fn(TINY, mesh)
    spec = spec_from_config(TINY)
    maps = wb_jax.probe(load, spec)
    params = load(checkpoint_arrays(spec))
    per_device = wb_jax.device_maps(params, maps)
    assert len(per_device) == 4
    leaves = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    for dev, bufs in per_device.items():
        for key, (sm, dtype) in bufs.items():
            shard = next(s for s in leaves[key].addressable_shards if s.device == dev)
            np.testing.assert_array_equal(sm.to_indices(), maps[key].to_indices()[shard.index])
            assert dtype == "bfloat16"


def test_impure_jax_load_is_refused():
    spec = wb.CheckpointSpec({"w": ((8, 4), "float32")})
    with pytest.raises(wb.ProbeError, match=r"buffer `\['w'\]`"):
        wb_jax.probe(lambda ck: {"w": jax.numpy.asarray(ck["w"]) * 2.0}, spec)


# --- the device implementation (what runs on an accelerator), exercised on JAX's CPU device -----
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # float16: the feed test below
def test_device_probe_equals_oracle(dtype):
    cfg = dict(TINY, dtype=dtype)
    maps = wb_jax.probe(make_load_fn(cfg), spec_from_config(cfg), arrays=DeviceArrays(chunk=1 << 10))
    want = expected_maps(cfg, tp=1)
    assert set(maps) == set(want)
    for key, ids in want.items():
        np.testing.assert_array_equal(maps[key].to_indices(), ids, err_msg=key)


@pytest.mark.parametrize("tp, rank", [(2, 1), (4, 2)])
def test_device_probe_of_one_tp_shard_equals_oracle(tp, rank):
    maps = wb_jax.probe(make_load_fn(TINY, tp_shard=(rank, tp)), spec_from_config(TINY),
                        arrays=DeviceArrays(chunk=1 << 10))
    want = expected_maps(TINY, tp, tp_rank=rank, as_maps=True)
    assert set(maps) == set(want)
    for key, sm in want.items():
        assert maps[key] == sm, key


@needs4
def test_device_probe_of_sharded_leaves_equals_oracle():
    maps = wb_jax.probe(make_load_fn(TINY, make_mesh(2, 2)), spec_from_config(TINY),
                        arrays=DeviceArrays(chunk=1 << 10))
    for key, ids in expected_maps(TINY, tp=2).items():
        np.testing.assert_array_equal(maps[key].to_indices(), ids, err_msg=key)


@pytest.mark.parametrize("dtype, pass_index", FEED_CASES)
@pytest.mark.parametrize("skip", SKIPS)
def test_device_feed_equals_the_host_feed(dtype, pass_index, skip):
    assert list(feed_mismatches(dtype, pass_index, skip, DeviceArrays().feed, np.asarray)) == []


@pytest.mark.parametrize("dtype, pass_index", FEED_CASES)
@pytest.mark.parametrize("skip", SKIPS)
def test_device_feed_with_its_arguments_on_the_device_equals_the_host_feed(dtype, pass_index, skip):
    arrays, begun = DeviceArrays(), []

    def feed(spec, name, base, k):  # as a probe feeds: begin() first, once per spec
        if spec not in begun:
            arrays.begin(spec, base, 5)
            begun.append(spec)
        return arrays.feed(spec, name, base, k)
    assert list(feed_mismatches(dtype, pass_index, skip, feed, np.asarray)) == []


def test_device_probe_compiles_each_step_once_per_shape(caplog):
    # begin() compiles every step ahead from shapes; a call whose signature (shapes, placement,
    # x64 mode) differs from the ahead-of-time one would compile it a second time
    spec = spec_from_config(TINY)
    leaves = [x for x in jax.tree_util.tree_leaves(jax.eval_shape(
        make_load_fn(TINY), {n: jax.ShapeDtypeStruct(s, dtype_info(d).numpy)
                             for n, (s, d) in spec.items()}))]
    jax.clear_caches()
    with caplog.at_level(logging.DEBUG, logger="jax"), jax.log_compiles(True):
        maps = wb_jax.probe(make_load_fn(TINY), spec, arrays=DeviceArrays(chunk=1 << 10))
    for key, ids in expected_maps(TINY, tp=1).items():
        np.testing.assert_array_equal(maps[key].to_indices(), ids, err_msg=key)
    compiled = collections.Counter(
        m.split()[1] for m in (r.getMessage() for r in caplog.records)
        if m.startswith("Compiling jit(_"))
    assert compiled["jit(_feed)"] == len({(s, d) for _, (s, d) in spec.items()})
    assert compiled["jit(_read)"] == len({(x.shape, x.dtype) for x in leaves})
    assert compiled["jit(_runs_chunk)"] == len({x.shape for x in leaves})


def test_device_probe_refuses_an_impure_load():
    spec = wb.CheckpointSpec({"w": ((8, 4), "float32")})
    with pytest.raises(wb.ProbeError, match=r"buffer `\['w'\]` element \(\d+, \d+\)"):
        wb_jax.probe(lambda ck: {"w": jax.numpy.asarray(ck["w"]) * 2.0}, spec,
                     arrays=DeviceArrays(chunk=1 << 10))
