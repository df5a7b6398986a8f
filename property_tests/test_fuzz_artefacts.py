"""Nothing corrupt ever loads: every artefact wb writes to a file or a store, mutated at random
(bit flips, truncations, appended bytes, swapped byte ranges, another artefact's digest or
payload spliced in), either loads equal to the original or raises a ``wb`` error, never a raw
one and never a different value. Every mutation here changes the bytes, so the seal's digest
refuses every one: the suite checks that too.

Real artefacts: plans and their rank parts from random deployments (row-sharded trainers,
column-sliced rollouts, some converting to float32), the layouts workers publish, membership and
version records, FP8 amax exchanges and probed-map caches. Each test runs ``FUZZ`` mutated
artefacts (2,000 at the CI profile, 20,000 at the thorough one) and checks it ran them all.
A second tier re-seals mutated payloads (what only a writer of another layout could make): the
decoders behind the seal must still raise ``wb`` errors.
"""

from __future__ import annotations

import io
import os
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import wb
from wb.data.layout import layouts_from_bytes, layouts_to_bytes
from wb.data.mapcache import MapCache
from wb.data.plan import parts
from wb.data.sealed import DIGEST_BYTES, MAGIC, seal, unseal
from wb.runtime.engine.fp8 import amax_bytes, amax_from_bytes
from wb.runtime.transport.stores import (MemoryStore, get_large, read_record, set_large,
                                         set_record)

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
#: Mutated artefacts per type.
FUZZ = 20_000 if PROFILE == "thorough" else 2_000
#: Re-sealed mutated payloads per type (second tier).
RESEALED = 2_000 if PROFILE == "thorough" else 300
_SETTINGS = dict(deadline=None, database=None, derandomize=PROFILE != "thorough",
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --- real artefacts ---------------------------------------------------------------------------
def _deployment(seed: int):
    """Trainers holding row blocks of each tensor, rollouts needing column slices (some in
    float32: the plan converts), on 1-3 nodes."""
    rng = np.random.default_rng(seed)
    shapes = {f"t{i}": (int(rng.integers(2, 9)), int(rng.integers(2, 17)))
              for i in range(int(rng.integers(1, 4)))}
    spec = wb.CheckpointSpec({n: (s, "bfloat16") for n, s in shapes.items()})
    n_t, n_r = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    trainers, rollouts = [], []
    for t in range(n_t):
        bufs = {}
        for n, (r, c) in shapes.items():
            ids = spec.offset(n) + np.arange(r * c).reshape(r, c)
            lo, hi = t * r // n_t, (t + 1) * r // n_t
            if hi > lo:
                bufs[n] = wb.BufferSpec(wb.SourceMap.from_indices(ids[lo:hi]), "bfloat16")
        trainers.append(wb.Layout(wb.Worker(t, f"n{t % 2}", "trainer", t // 2), bufs))
    for k in range(n_r):
        bufs = {}
        for n, (r, c) in shapes.items():
            ids = spec.offset(n) + np.arange(r * c).reshape(r, c)
            a = int(rng.integers(0, c))
            b = int(rng.integers(a + 1, c + 1))
            dtype = "float32" if rng.random() < 0.3 else "bfloat16"
            bufs[n] = wb.BufferSpec(wb.SourceMap.from_indices(ids[:, a:b].T.copy()), dtype)
        rollouts.append(wb.Layout(wb.Worker(n_t + k, f"r{k % 2}", "rollout", k // 2), bufs))
    return spec, trainers, rollouts


class _Artefacts:
    """Per seed, built once: the bytes of each artefact and how to load them back."""

    def __init__(self, seeds: int = 6):
        self.plans, self.parts, self.layouts, self.caches = [], [], [], []
        for seed in range(seeds):
            spec, trainers, rollouts = _deployment(seed)
            plan = wb.plan(trainers, rollouts, chunk_bytes=int(64 << seed % 3))
            f = io.BytesIO()
            plan.save(f)
            self.plans.append((f.getvalue(), plan))
            self.parts += [(q.to_bytes(), q) for q in parts(plan)]
            lays = [*trainers, *rollouts][: 1 + seed % 4]
            self.layouts.append((layouts_to_bytes(lays), lays))
            maps = {n: b.sourcemap for n, b in rollouts[0].buffers.items()}
            cache = MapCache(f"{seed:064x}", maps)
            self.caches.append((_cache_bytes(cache), cache))
        rng = np.random.default_rng(7)
        self.amax = []
        for n in (0, 1, 5, 40):
            keys, amax = rng.integers(0, 1 << 40, n), rng.random(n) * 448
            self.amax.append((amax_bytes(keys, amax), (keys, amax)))
        store = MemoryStore()
        records = {
            "wb/roster": {"world": 6, "chunk_bytes": 1 << 20, "quantized": False,
                          "cluster": [400.0, 450.0, {"n1": 100.0}]},
            "wb/v/3/final": {"version": 3, "epoch": 2, "rollouts": [4, 5, 7], "dead": [6]},
            "wb/v/3/attempt/2": {"version": 3, "attempt": 2, "dead": [6], "need": [4, 5],
                                 "detected_s": 1733.25, "planned_ahead": False},
            "wb/joingroup/abc": [8, 9],
            "wb/fp8peers": {"0": [1], "1": [0]},
        }
        self.records = []
        for key, value in records.items():
            set_record(store, key, value)
            self.records.append((store.get(key, 1), (key, value)))
        set_large(store, "wb/big", bytes(range(256)) * 5, max_value_bytes=300)
        self.chunked = (store, store.get("wb/big", 1))


def _cache_bytes(cache: MapCache) -> bytes:
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "maps.npz")
        cache.save(path)
        with open(path, "rb") as f:
            return f.read()


@pytest.fixture(scope="module")
def art():
    return _Artefacts()


# --- mutations ----------------------------------------------------------------------------------
@st.composite
def mutated(draw, data: bytes, others: list[bytes]) -> bytes:
    """``data`` changed one of the ways storage and networks change bytes (never left as it
    was: a change that undoes itself falls back to one flipped bit)."""
    out = draw(_changed(data, others))
    if out == data:
        i = draw(st.integers(0, len(data) - 1))
        out = data[:i] + bytes([data[i] ^ 1 << draw(st.integers(0, 7))]) + data[i + 1:]
    return out


@st.composite
def _changed(draw, data: bytes, others: list[bytes]) -> bytes:
    n = len(data)
    how = draw(st.sampled_from(["flip", "flips", "cut", "append", "swap", "splice"]))
    b = bytearray(data)
    if how in ("flip", "flips"):
        for _ in range(1 if how == "flip" else draw(st.integers(2, 8))):
            i = draw(st.integers(0, n - 1))
            b[i] ^= 1 << draw(st.integers(0, 7))
        return bytes(b)
    if how == "cut":
        return bytes(b[:draw(st.integers(0, n - 1))])
    if how == "append":
        return bytes(b) + draw(st.binary(min_size=1, max_size=64))
    if how == "swap":  # two ranges of the same length change places
        k = draw(st.integers(1, max(1, n // 4)))
        i, j = draw(st.integers(0, n - k)), draw(st.integers(0, n - k))
        lo, hi = sorted((i, j))
        if hi - lo < k:
            return bytes(b)  # overlapping: nothing swapped
        b[lo:lo + k], b[hi:hi + k] = data[hi:hi + k], data[lo:lo + k]
        return bytes(b)
    # another artefact of the same kind: its digest, or its payload, spliced into this one
    other = draw(st.sampled_from(others))
    k = len(MAGIC) + 1 + data[len(MAGIC)]
    d0, d1 = k + 8, k + 8 + DIGEST_BYTES
    if draw(st.booleans()):
        return data[:d0] + other[d0:d1] + data[d1:]
    return data[:d1] + other[d1:]


def _fuzz(art_list, load, same, error, n=FUZZ):
    """Runs ``n`` mutated artefacts: each loads equal to its original or raises ``error``."""
    seen = Counter()
    others = [d for d, _ in art_list]

    @settings(max_examples=n, **_SETTINGS)
    @given(st.data())
    def one(data):
        i = data.draw(st.integers(0, len(art_list) - 1))
        raw, value = art_list[i]
        bad = data.draw(mutated(raw, others))
        try:
            back = load(bad)
        except error:
            seen["refused"] += 1
        else:
            assert same(back, value), "a mutated artefact loaded as a different value"
            seen["equal"] += 1
    one()
    assert sum(seen.values()) >= n, seen
    # every mutation changed the bytes, so the seal refuses every one
    assert seen["refused"] == sum(seen.values()), seen
    return seen


def _resealed(art_list, kind, load, error, n=RESEALED):
    """Payloads mutated and sealed again (digest right, content of another layout): every one
    loads or raises ``error``, never a raw exception."""
    seen = Counter()

    @settings(max_examples=n, **_SETTINGS)
    @given(st.data())
    def one(data):
        raw, _ = art_list[data.draw(st.integers(0, len(art_list) - 1))]
        payload = bytes(unseal(kind, raw, where="test"))
        bad = data.draw(_payload_mutation(payload))
        try:
            load(seal(kind, bad))
            seen["loaded"] += 1
        except error:
            seen["refused"] += 1
    one()
    assert sum(seen.values()) >= n, seen
    return seen


@st.composite
def _payload_mutation(draw, payload: bytes) -> bytes:
    n = len(payload)
    how = draw(st.sampled_from(["flips", "cut", "append"]))
    b = bytearray(payload)
    if how == "flips" and n:
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, n - 1))
            b[i] ^= 1 << draw(st.integers(0, 7))
        return bytes(b)
    if how == "cut" and n:
        return bytes(b[:draw(st.integers(0, n - 1))])
    return bytes(b) + draw(st.binary(min_size=1, max_size=32))


# --- equality of loaded values ----------------------------------------------------------------
def _same_layouts(a, b):
    return len(a) == len(b) and all(x.worker == y.worker and dict(x.buffers) == dict(y.buffers)
                                    for x, y in zip(a, b))


def _same_amax(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def _same_cache(a, b):
    return a.fingerprint == b.fingerprint and dict(a.maps) == dict(b.maps)


def _load_cache(tmp_path):
    path = tmp_path / "maps.npz"

    def load(data):
        path.write_bytes(data)
        return MapCache.load(path)
    return load


# --- the suite ----------------------------------------------------------------------------------
@pytest.mark.timeout(600)
def test_plan_files(art):
    _fuzz(art.plans, lambda d: wb.Plan.load(io.BytesIO(d)), lambda a, b: a == b, wb.PlanError)


@pytest.mark.timeout(600)
def test_rank_parts(art):
    _fuzz(art.parts, lambda d: wb.RankPlan.from_bytes(d, where="store key `wb/part/0`"),
          lambda a, b: a == b, wb.PlanError)


@pytest.mark.timeout(600)
def test_layouts(art):
    _fuzz(art.layouts, layouts_from_bytes, _same_layouts, wb.SpecError)


@pytest.mark.timeout(600)
def test_records(art):
    _fuzz(art.records, lambda d: read_record(d, "wb/some/key"),
          lambda a, b: a == b[1], wb.TransferError)


@pytest.mark.timeout(600)
def test_fp8_amax_exchanges(art):
    _fuzz(art.amax, amax_from_bytes, _same_amax, wb.TransferError)


@pytest.mark.timeout(600)
def test_map_caches(art, tmp_path):
    _fuzz(art.caches, _load_cache(tmp_path), _same_cache, wb.SpecError)


@pytest.mark.timeout(600)
def test_chunked_value_headers(art):
    store, header = art.chunked
    want = bytes(range(256)) * 5

    def load(data):
        store.set("wb/fuzzed", data)
        for i in range(5):
            store.set(f"wb/fuzzed#{i}", store.get(f"wb/big#{i}", 1))
        return get_large(store, "wb/fuzzed", 0.01)
    _fuzz([(header, want)], load, lambda a, b: a == b, wb.TransferError)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("what", ["plan", "rank part", "layout list", "record",
                                  "FP8 amax exchange", "map cache"])
def test_resealed_payloads_raise_wb_errors(art, what, tmp_path):
    loads = {"plan": (art.plans, lambda d: wb.Plan.load(io.BytesIO(d)), wb.PlanError),
             "rank part": (art.parts, wb.RankPlan.from_bytes, wb.PlanError),
             "layout list": (art.layouts, layouts_from_bytes, wb.SpecError),
             "record": (art.records, lambda d: read_record(d, "k"), wb.TransferError),
             "FP8 amax exchange": (art.amax, amax_from_bytes, wb.TransferError),
             "map cache": (art.caches, _load_cache(tmp_path), wb.SpecError)}
    arts, load, error = loads[what]
    _resealed(arts, what, load, error)
