"""Cached maps (``cache=``): a hit skips the load, anything changed or unreadable re-probes."""

import logging

import numpy as np
import pytest

import wb
from harness.threads import counting
from wb.data.mapcache import MapCache, cache_file, fingerprint

SPEC = wb.CheckpointSpec({"w": ((40, 12), "bfloat16"), "b": ((12,), "float32")})


def shard(ck):
    return {"w": np.asarray(ck["w"])[10:30, 2:].T.copy(), "b": np.asarray(ck["b"])[::-1].copy()}


def assert_same(a, b):
    assert list(a) == list(b)
    for n in a:
        assert a[n] == b[n] and a[n].blocks == b[n].blocks, n
        np.testing.assert_array_equal(a[n].to_indices(), b[n].to_indices())


def test_a_hit_skips_the_load_and_returns_the_probed_maps_exactly(tmp_path):
    path = tmp_path / "maps.npz"
    load, calls = counting(shard)
    first = wb.probe(SPEC, load, cache=path, key={"rank": 0})
    n = len(calls)
    again = wb.probe(SPEC, load, cache=path, key={"rank": 0})
    assert len(calls) == n  # not called again
    assert_same(again, first)
    assert_same(first, wb.probe(SPEC, shard))  # what the cache saved is what a probe finds


@pytest.mark.parametrize("change", ["spec", "key", "buffers"])
def test_anything_changed_re_probes_and_overwrites(tmp_path, change, caplog):
    path = tmp_path / "maps.npz"
    kw = dict(key={"rank": 0}, buffers={"w": ((10, 20), "bfloat16", "cpu")})
    wb.probe(SPEC, shard, cache=path, **kw)
    spec = SPEC
    if change == "spec":
        spec = wb.CheckpointSpec({"w": ((40, 12), "bfloat16"), "b": ((12,), "bfloat16")})
    elif change == "key":
        kw["key"] = {"rank": 1}
    else:
        kw["buffers"] = {"w": ((10, 20), "float32", "cpu")}
    load, calls = counting(shard)
    with caplog.at_level(logging.WARNING, logger="wb.algorithms.probing"):
        maps = wb.probe(spec, load, cache=path, **kw)
    assert calls and "probing again" in caplog.text
    assert MapCache.load(path).fingerprint == fingerprint(spec, **kw)  # overwritten
    load, calls = counting(shard)
    assert_same(wb.probe(spec, load, cache=path, **kw), maps)
    assert not calls


@pytest.mark.parametrize("damage", [b"", b"not a zip file", None])
def test_a_corrupt_file_re_probes(tmp_path, damage, caplog):
    path = tmp_path / "maps.npz"
    want = wb.probe(SPEC, shard, cache=path)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2] if damage is None else damage)
    load, calls = counting(shard)
    with caplog.at_level(logging.WARNING, logger="wb.algorithms.probing"):
        assert_same(wb.probe(SPEC, load, cache=path), want)
    assert calls and "delete it or let the probe overwrite it" in caplog.text
    assert_same(MapCache.load(path).maps, want)  # rewritten whole


def test_a_directory_keeps_one_file_per_key(tmp_path):
    for rank in range(3):
        wb.probe(SPEC, shard, cache=tmp_path, key={"rank": rank})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        cache_file(tmp_path, {"rank": r}).name for r in range(3))
    assert len(set(p.name for p in tmp_path.iterdir())) == 3
    load, calls = counting(shard)
    wb.probe(SPEC, load, cache=str(tmp_path) + "/", key={"rank": 2})
    assert not calls


def test_the_file_holds_no_pickle(tmp_path):
    path = tmp_path / "maps.npz"
    wb.probe(SPEC, shard, cache=path)
    import io

    from wb.data.sealed import unseal
    payload = unseal("map cache", path.read_bytes(), where="test")  # sealed: an npz inside
    with np.load(io.BytesIO(payload), allow_pickle=False) as z:
        assert all(z[k].dtype != object for k in z.files)


def test_a_key_that_is_not_json_is_refused(tmp_path):
    with pytest.raises(wb.SpecError, match="`key` must be JSON-able"):
        wb.probe(SPEC, shard, cache=tmp_path / "m.npz", key=object())


# --- the shims ---------------------------------------------------------------------------------
def test_torch_second_start_skips_load_weights(tmp_path):
    torch = pytest.importorskip("torch")
    import wb_torch
    from wb.layouts.presets import TINY, spec_from_config
    from wb_torch.testing import TinyRollout

    spec = spec_from_config(TINY)
    first = wb_torch.probe(TinyRollout(TINY, tp_rank=1, tp_size=2), spec, cache=tmp_path,
                           key={"tp": 2, "rank": 1})
    model, calls = TinyRollout(TINY, tp_rank=1, tp_size=2), []
    again = wb_torch.probe(model, spec, load_weights=lambda w: calls.append(1), cache=tmp_path,
                           key={"tp": 2, "rank": 1})
    assert not calls
    assert_same(again, first)
    # another dtype is another model: probed again
    model = TinyRollout(TINY, tp_rank=1, tp_size=2, dtype=torch.float32)
    fed = []
    wb_torch.probe(model, spec, load_weights=lambda w: (fed.append(1), model.load_weights(w)),
                   cache=tmp_path, key={"tp": 2, "rank": 1})
    assert fed


def test_jax_second_start_skips_load_fn(tmp_path):
    pytest.importorskip("jax")
    import wb_jax
    from wb.layouts.presets import TINY, spec_from_config
    from wb_jax.testing import make_load_fn

    spec = spec_from_config(TINY)
    load, calls = counting(make_load_fn(TINY))
    first = wb_jax.probe(load, spec, cache=tmp_path / "m.npz")
    n = len(calls)
    assert_same(wb_jax.probe(load, spec, cache=tmp_path / "m.npz"), first)
    assert len(calls) == n
    saved = MapCache.load(tmp_path / "m.npz")
    other = dict(TINY, num_hidden_layers=1)
    load2, calls2 = counting(make_load_fn(other))
    wb_jax.probe(load2, spec_from_config(other), cache=tmp_path / "m.npz")
    assert calls2 and MapCache.load(tmp_path / "m.npz").fingerprint != saved.fingerprint
