"""Sealed artefacts and bad input: the cases a new user met flipping bits in what wb saves and
shares, and passing values the public API cannot take. Each gets a ``wb`` error that names the
file, key or value and says what to do; nothing corrupt loads (the fuzz suite is
``property_tests/test_fuzz_artefacts.py``)."""

from __future__ import annotations

import io

import numpy as np
import pytest

import wb
from wb.data.sealed import seal, seal_json, unseal, unseal_json
from wb.runtime.membership.records import fetch_part, publish_parts
from wb.runtime.transport.stores import MemoryStore, get_record, set_large, set_record


def _lay(rank, role, ids, node="n0"):
    return wb.Layout(wb.Worker(rank, node, role), {"w": wb.BufferSpec(
        wb.SourceMap.from_indices(ids), "bfloat16")})


@pytest.fixture(scope="module")
def plan():
    ids = np.arange(64 * 48).reshape(64, 48)
    trainers = [_lay(0, "trainer", ids[:32]), _lay(1, "trainer", ids[32:])]
    rollouts = [_lay(2, "rollout", ids[:, :24].copy(), "r0"),
                _lay(3, "rollout", ids[:, 24:].copy(), "r1")]
    return wb.plan(trainers, rollouts, chunk_bytes=512)


def _flips(data: bytes, n: int, lo: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        b = bytearray(data)
        i = int(rng.integers(lo, len(b)))
        b[i] ^= 1 << int(rng.integers(0, 8))
        yield bytes(b)


def test_single_bit_flips_in_a_part_never_load_as_another_part(plan):
    """Of 300 flips in the second half of a part's bytes (where its JSON index sat unchecked
    before: roles, buffer names, the fingerprint), every one is a PlanError naming the key."""
    data = wb.RankPlan.of(plan, 2).to_bytes()
    for bad in _flips(data, 300, len(data) // 2):
        with pytest.raises(wb.PlanError, match=r"store key `wb/part/2` is corrupt.*make the plan "
                                               r"again"):
            wb.RankPlan.from_bytes(bad, where="store key `wb/part/2`")


def test_a_corrupt_part_in_the_store_is_refused_with_its_key(plan):
    store = MemoryStore()
    publish_parts(store, plan, name="job")
    good = store.get("job/part/3#0", 1)
    store.set("job/part/3#0", good[:-1] + bytes([good[-1] ^ 4]))
    with pytest.raises(wb.PlanError, match="store key `job/part/3` is corrupt"):
        fetch_part(store, 3, name="job", timeout=1)
    assert fetch_part(store, 2, name="job", timeout=1) == wb.RankPlan.of(plan, 2)


def test_single_bit_flips_in_a_saved_plan_name_the_file(plan, tmp_path):
    path = tmp_path / "plan.npz"
    plan.save(path)
    data = path.read_bytes()
    for bad in _flips(data, 30, 0, seed=1):
        path.write_bytes(bad)
        with pytest.raises(wb.PlanError, match=rf"plan file `{path}` .*make the plan again"):
            wb.Plan.load(path)
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(wb.PlanError, match="is cut short"):
        wb.Plan.load(path)
    path.write_bytes(data)
    assert wb.Plan.load(path) == plan


def test_a_plan_saved_under_a_bare_name_loads_by_that_name(plan, tmp_path):
    plan.save(tmp_path / "p")  # numpy's rule, kept: .npz is added
    assert (tmp_path / "p.npz").exists()
    assert wb.Plan.load(tmp_path / "p") == wb.Plan.load(tmp_path / "p.npz") == plan


def test_an_unsealed_npz_plan_of_an_older_wb_is_refused_with_the_fix(plan, tmp_path):
    path = tmp_path / "old.npz"
    np.savez(path, header=np.frombuffer(b'{"version": 3}', np.uint8))
    with pytest.raises(wb.PlanError, match="not a plan sealed by this wb.*make the plan again"):
        wb.Plan.load(path)


def test_ids_below_minus_one_are_refused():
    with pytest.raises(wb.SpecError, match=r"ids must be >= -1.*found -5 at index \(1,\)"):
        wb.SourceMap.from_indices(np.array([0, -5, 3]))
    assert wb.SourceMap.from_indices(np.array([0, -1, 3])).to_indices().tolist() == [0, -1, 3]


def test_records_in_the_store_are_sealed():
    store = MemoryStore()
    set_record(store, "wb/v/1/final", {"epoch": 1, "dead": [3]})
    assert get_record(store, "wb/v/1/final", 1) == {"epoch": 1, "dead": [3]}
    raw = store.get("wb/v/1/final", 1)
    store.set("wb/v/1/final", raw.replace(b"3", b"4"))
    with pytest.raises(wb.TransferError, match=r"key `wb/v/1/final` is corrupt.*store is "
                                               r"corrupt"):
        get_record(store, "wb/v/1/final", 1)
    store.set("wb/x", b'{"epoch": 1}')  # a bare JSON value, not a record
    with pytest.raises(wb.TransferError, match="not a record sealed by this wb"):
        get_record(store, "wb/x", 1)


def test_a_chunked_values_header_is_sealed():
    store = MemoryStore()
    set_large(store, "k", b"x" * 100, max_value_bytes=30)
    head = store.get("k", 1)
    store.set("k", head.replace(b'"chunks":4', b'"chunks":9'))
    with pytest.raises(wb.TransferError, match="key `k` is corrupt"):
        from wb.runtime.transport.stores import get_large
        get_large(store, "k", 0.05)  # refused at once, not after waiting for chunks 4..8


def test_seal_refuses_another_kind_and_non_bytes():
    data = seal("record", b"{}")
    with pytest.raises(wb.PlanError, match="is a sealed 'record', not a plan"):
        unseal("plan", data, where="x", error=wb.PlanError)
    with pytest.raises(wb.TransferError, match="must be bytes"):
        unseal("record", "text", where="x")
    with pytest.raises(wb.TransferError, match="not JSON"):
        unseal_json("record", seal("record", b"{nope"), where="x")
    assert unseal_json("r", seal_json("r", [1, "a"]), where="x") == [1, "a"]


@pytest.mark.parametrize("call, error, match", [
    (lambda: wb.RankPlan.of("plan.npz", 0), wb.PlanError, "RankPlan.of takes a wb.Plan"),
    (lambda: wb.run_local(None, {}, {}), wb.PlanError, "run_local takes a wb.Plan"),
    (lambda: wb.simulate([1, 2]), wb.PlanError, "simulate takes a wb.Plan"),
    (lambda: wb.DirectoryStore(3), wb.TransferError, "needs a directory's path"),
    (lambda: wb.FP8Blocks(3), wb.SpecError, "must name at least one tensor"),
    (lambda: wb.agree_parts(MemoryStore(), [], world=0), wb.TransferError, "world must be"),
    (lambda: wb.agree_parts(MemoryStore(), [3], world=1), wb.TransferError, "wb.Layout"),
    (lambda: wb.CheckpointSpec([("w", ((2,), "bfloat16"))]), wb.SpecError, "takes {name"),
    (lambda: wb.Worker("0", "n0", "trainer"), wb.SpecError, "Worker.rank must be an int"),
    (lambda: wb.Worker(0, 7, "trainer"), wb.SpecError, "Worker.node must be a str"),
    (lambda: wb.Layout(wb.Worker(0, "n", "trainer"), [1]), wb.SpecError, "Layout.buffers"),
    (lambda: wb.probe({"w": ((2,), "bfloat16")}, lambda c: c), wb.SpecError,
     "probe takes a wb.CheckpointSpec"),
    (lambda: wb.Plan.load(3), wb.PlanError, "file name or a readable binary file"),
    (lambda: wb.RankPlan.from_bytes("text"), wb.PlanError, "must be bytes"),
])
def test_bad_values_get_wb_errors_that_name_them(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_run_local_names_buffers_it_cannot_take(plan):
    tb = {lay.worker.rank: {"w": np.zeros(lay.buffers["w"].shape, np.float32)}
          for lay in plan.trainers}
    with pytest.raises(wb.PlanError, match=r"rollout_buffers must be \{rank"):
        wb.run_local(plan, tb, [1])
    with pytest.raises(wb.PlanError, match=r"run_local needs buffer `w` of rollout rank 2"):
        wb.run_local(plan, tb, {})
    rb = {lay.worker.rank: {"w": np.zeros((3, 3), np.float32)} for lay in plan.rollouts}
    with pytest.raises(wb.PlanError, match=r"rollout rank 2 buffer `w` has shape \(3, 3\)"):
        wb.run_local(plan, tb, rb)


def test_simulate_refuses_a_negative_message_cost(plan):
    with pytest.raises(wb.PlanError, match="message_s must be >= 0"):
        wb.simulate(plan, message_s=-1e-6)
    with pytest.raises(wb.PlanError, match="cluster must be a wb.Cluster"):
        wb.simulate(plan, {"nic_gbps": 400})


def test_plan_save_to_a_file_object_round_trips(plan):
    f = io.BytesIO()
    plan.save(f)
    f.seek(0)
    assert wb.Plan.load(f) == plan
