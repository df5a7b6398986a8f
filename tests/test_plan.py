"""Plans: bound, verify (including corrupted plans), serialisation, per-worker views, run_local."""

import io

import numpy as np
import pytest

import wb
from wb.data.plan import RankPlan, Transfers

W = np.arange(32 * 24, dtype=np.int64).reshape(32, 24)  # a weight [out, in]
N = W.size + np.arange(24)  # a norm


def lay(rank, node, role, bufs, local_rank=0):
    return wb.Layout(wb.Worker(rank, node, role, local_rank),
                     {k: wb.BufferSpec(wb.SourceMap.from_indices(v), "bfloat16") for k, v in bufs.items()})


def deployment():
    """2 trainer replicas x TP 2 (transposed shards) -> 3 rollout nodes x TP 2 (+ norm)."""
    trainers = [lay(d * 2 + t, f"t{d}", "trainer", {"w": W[:, 12 * t:12 * (t + 1)].T, "n": N}, t)
                for d in range(2) for t in range(2)]
    rollouts = [lay(4 + v * 2 + t, f"r{v}", "rollout", {"w": W[16 * t:16 * (t + 1)], "n": N}, t)
                for v in range(3) for t in range(2)]
    return trainers, rollouts


@pytest.fixture(scope="module")
def good():
    trainers, rollouts = deployment()
    return wb.plan(trainers, rollouts, chunk_bytes=256)


def test_traffic_equals_the_lower_bound(good):
    trainers, rollouts = deployment()
    t, lb = good.traffic(), wb.lower_bound(trainers, rollouts)
    M = (W.size + N.size) * 2
    assert t.trainer_total == lb.trainer_total == M
    assert t.node_in == lb.node_in == {"r0": M, "r1": M, "r2": M}
    assert sum(t.node_out.get(f"r{v}", 0) for v in range(3)) == 2 * M  # stage 2 feeds 2 of 3
    good.verify()


def test_holders_are_balanced_over_replicas(good):
    out = good.traffic().trainer_out
    assert max(out.values()) <= 1.3 * min(out.values())


def _drop(plan, t):
    """The plan without transfer t (a leaf), indices and messages kept consistent."""
    T = plan.transfers
    assert not (T.after == t).any()
    keep = np.arange(T.piece.size) != t
    remap = np.cumsum(keep) - 1
    after = np.where(T.after[keep] >= 0, remap[np.maximum(T.after[keep], 0)], -1)
    fields = {f: getattr(T, f)[keep] for f in T._fields}
    fields["after"] = after
    return plan.replace(transfers=Transfers(**fields))


def _leaf(plan):
    T = plan.transfers
    used = set(T.after[T.after >= 0].tolist())
    return max(t for t in range(T.piece.size) if t not in used)


def test_verify_rejects_a_dropped_chunk(good):
    with pytest.raises(wb.PlanError, match="never delivered"):
        _drop(good, _leaf(good)).verify()


def test_verify_rejects_a_wrong_source(good):
    T = good.transfers
    t = int(np.flatnonzero(T.stage == 1)[0])
    # the other TP shard's trainer buffer (same rank layout index differs): holds other ids
    wrong = T.src_inc.copy()
    corr = good.corr
    cands = np.flatnonzero((good.corr.slot_role[corr.inc_slot] == 0)
                           & (corr.inc_cell != good.pieces.cell[T.piece[t]]))
    wrong[t] = cands[0]
    slot = T.src_slot.copy()
    slot[t] = corr.inc_slot[cands[0]]
    with pytest.raises(wb.PlanError, match="source buffer does not hold"):
        good.replace(transfers=T._replace(src_inc=wrong, src_slot=slot)).verify()


def test_verify_rejects_a_wrong_region(good):
    T = good.transfers
    f0 = T.dst_f0.copy()
    f0[3] += 1
    with pytest.raises(wb.PlanError, match="destination region"):
        good.replace(transfers=T._replace(dst_f0=f0)).verify()


def test_verify_rejects_a_duplicated_send(good):
    T = good.transfers
    t = _leaf(good)
    dup = Transfers(*(np.r_[f, f[t]] for f in T))
    with pytest.raises(wb.PlanError, match="delivered twice"):
        good.replace(transfers=dup).verify()


def test_verify_rejects_a_stage_order_violation(good):
    T = good.transfers
    child = int(np.flatnonzero(T.after >= 0)[0])
    parent = int(T.after[child])
    after = T.after.copy()
    after[child] = child + 1 if child + 1 < T.piece.size else child  # points at a later transfer
    with pytest.raises(wb.PlanError, match="stage order"):
        good.replace(transfers=T._replace(after=after)).verify()
    assert parent < child


def test_verify_rejects_a_plan_for_other_layouts(good):
    trainers, rollouts = deployment()
    other = [lay(4, "r0", "rollout", {"w": W[:8]})]
    with pytest.raises(wb.PlanError, match="other layouts"):
        good.replace(rollouts=tuple(other)).verify()


def test_save_load_round_trip_without_pickle(good):
    f = io.BytesIO()
    good.save(f)
    f.seek(0)
    back = wb.Plan.load(f)
    assert back == good
    back.verify()
    packed = wb.plan(*deployment(), chunk_bytes=64, pack_below=64)  # what it packs comes back
    f2 = io.BytesIO()
    packed.save(f2)
    f2.seek(0)
    again = wb.Plan.load(f2)
    assert again == packed and again.pack_below == 64 and again != good.replace(pack_below=64)
    from wb.data.sealed import unseal
    payload = unseal("plan", f.getvalue(), where="test")  # the sealed file holds an npz
    with np.load(io.BytesIO(payload), allow_pickle=False) as z:
        assert all(z[k].dtype != object for k in z.files)


def test_each_rank_s_part_holds_exactly_its_messages(good):
    m = good.messages
    sends = 0
    for r in good.ranks:
        part = wb.RankPlan.of(good, r)
        mine = np.flatnonzero((m.src_rank == r) | (m.dst_rank == r))  # the oracle
        np.testing.assert_array_equal(part.index, mine)
        sends += int((part.messages.src_rank == r).sum())
    assert sends == m.stage.size  # every message is sent by exactly one part


def test_run_local_fills_rollouts_bit_exactly(good):
    trainers, rollouts = deployment()
    rng = np.random.default_rng(0)
    weights = rng.standard_normal(W.size + N.size).astype(np.float32)
    tb = {lay.worker.rank: {k: weights[b.sourcemap.to_indices()] for k, b in lay.buffers.items()}
          for lay in trainers}
    rb = {lay.worker.rank: {k: np.zeros(b.shape, np.float32) for k, b in lay.buffers.items()}
          for lay in rollouts}
    out = wb.run_local(good, tb, rb)
    for lay in rollouts:
        for k, b in lay.buffers.items():
            np.testing.assert_array_equal(out[lay.worker.rank][k], weights[b.sourcemap.to_indices()])


def test_run_local_refuses_wrong_shapes(good):
    with pytest.raises(wb.PlanError, match="shape"):
        wb.run_local(good, {r: {"w": np.zeros((2, 2)), "n": np.zeros(24)} for r in range(4)}, {})


def test_missing_ids_raise_plan_error_naming_buffer_and_id():
    trainers = [lay(0, "t", "trainer", {"w": W[:20]})]
    rollouts = [lay(1, "r", "rollout", {"w": W[16:]})]
    with pytest.raises(wb.PlanError, match=r"buffer `w`.*first missing id 480"):
        wb.plan(trainers, rollouts)


def test_colocated_gpu_uses_a_local_copy_only():
    t = lay(0, "n0", "trainer", {"w": W})
    r = lay(1, "n0", "rollout", {"w": W[:, :12]})
    p = wb.plan([t], [r])
    p.verify()
    tr = p.traffic()
    assert tr.trainer_total == 0 and tr.node_in == {} and tr.intra_node == {}
    assert wb.lower_bound([t], [r]).trainer_total == 0


# --- fast save/load (format 2: layouts and slots as arrays) ---------------------------------------
def _layouts_equal(a, b):
    return [x.worker for x in a] == [y.worker for y in b] and all(
        dict(x.buffers) == dict(y.buffers) and list(x.buffers) == list(y.buffers)
        for x, y in zip(a, b))


def test_save_load_keeps_layouts_and_shared_specs(good):
    f = io.BytesIO()
    good.save(f)
    f.seek(0)
    back = wb.Plan.load(f)
    assert _layouts_equal(good.trainers, back.trainers)
    assert _layouts_equal(good.rollouts, back.rollouts)
    assert back.corr.slots == good.corr.slots


def test_layouts_bytes_share_one_spec_between_replicas():
    from wb.data.layout import layouts_from_bytes, layouts_to_bytes
    spec = wb.BufferSpec(wb.SourceMap.from_indices(W[:, :5]), "bfloat16")
    other = wb.BufferSpec(wb.SourceMap.from_indices(N[::-1]), "float32")
    lays = [wb.Layout(wb.Worker(r, f"n{r // 2}", "rollout", r % 2), {"w": spec, "n": other})
            for r in range(4)]
    back = layouts_from_bytes(layouts_to_bytes(lays))
    assert _layouts_equal(lays, back)
    assert all(b.buffers["w"] is back[0].buffers["w"] for b in back)  # sharing restored
    assert back[0].buffers["n"].sourcemap.to_indices().tolist() == N[::-1].tolist()


def test_old_plan_format_is_refused_with_a_fix(good, tmp_path):
    import json
    from wb.data.sealed import seal, unseal_stream
    good.save(tmp_path / "p.npz")
    stream = unseal_stream("plan", (tmp_path / "p.npz").read_bytes(), where="test")
    with np.load(stream) as z:
        data = {k: z[k] for k in z.files}
    header = json.loads(bytes(data["header"]).decode())
    header["version"] = 1
    data["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    f = io.BytesIO()
    np.savez(f, **data)
    (tmp_path / "old.npz").write_bytes(seal("plan", f.getvalue()))  # sealed, of format 1
    with pytest.raises(wb.PlanError, match="of format 1, this wb reads format 4; make the plan "
                                           "again"):
        wb.Plan.load(tmp_path / "old.npz")


def test_a_preset_plan_round_trips(tmp_path):
    from wb.layouts.deployments import deployment as make
    dep = make("moonlight-16b-a3b")
    p = wb.plan(dep.trainers, dep.rollouts)
    p.save(tmp_path / "p.npz")
    back = wb.Plan.load(tmp_path / "p.npz")
    assert back == p
    assert _layouts_equal(p.trainers + p.rollouts, back.trainers + back.rollouts)


def test_equal_specs_that_are_distinct_objects_are_stored_once():
    from wb.data.layout import layouts_from_bytes, layouts_to_arrays, layouts_to_bytes
    lays = [wb.Layout(wb.Worker(r, "n0", "rollout", r),
                      {"w": wb.BufferSpec(wb.SourceMap.from_indices(W[:, :5]), "bfloat16")})
            for r in range(3)]  # equal specs, three objects (as read back one layout at a time)
    _, arrays = layouts_to_arrays(lays)
    assert arrays["spec.map"].size == 1 and arrays["map.ndim"].size == 1
    back = layouts_from_bytes(layouts_to_bytes(lays))
    assert _layouts_equal(lays, back)
    assert back[0].buffers["w"] is back[2].buffers["w"]


def test_old_layouts_bytes_are_refused_with_a_fix():
    import json
    from wb.data.layout import layouts_from_bytes
    f = io.BytesIO()
    np.savez(f, header=np.frombuffer(json.dumps([{"rank": 0}]).encode(), np.uint8))
    with pytest.raises(wb.SpecError, match="not a layout list sealed by this wb"):
        layouts_from_bytes(f.getvalue())  # unsealed: written before layouts were sealed
    from wb.data.sealed import seal
    with pytest.raises(wb.SpecError, match="older version"):  # sealed, of format 1
        layouts_from_bytes(seal("layout list", f.getvalue()))


def test_small_ranges_travel_packed_large_ones_in_place():
    """A rollout buffer interleaved from two trainers in rows of 32 bytes gets one packed message
    per trainer, not one per row; ranges of 1 MiB and more still each get a message received in
    place (zero-copy); every element lands where its id says (LocalSession, numpy)."""
    from wb.algorithms.planner import SMALL_RUN_BYTES
    from wb.runtime.engine.program import Program

    rows, cols = 64, 8  # float32: 32-byte rows
    small = np.arange(rows * cols).reshape(rows, cols)
    big_n = SMALL_RUN_BYTES // 4  # float32 elements in one 1 MiB range
    big = small.size + np.arange(2 * big_n)
    f32 = lambda ids: wb.BufferSpec(wb.SourceMap.from_indices(ids), "float32")  # noqa: E731
    trainers = [wb.Layout(wb.Worker(t, f"t{t}", "trainer", 0),
                          {"s": f32(small[t::2]), "b": f32(big[t * big_n:(t + 1) * big_n])})
                for t in range(2)]
    rollout = wb.Layout(wb.Worker(2, "r", "rollout", 0), {"s": f32(small), "b": f32(big)})
    p = wb.plan(trainers, [rollout])
    prog = Program(RankPlan.of(p, 2))
    got = sorted((g.peer, g.zc_dst, g.nbytes) for g in prog.messages.values())
    assert got == [(0, False, small.size * 2), (0, True, SMALL_RUN_BYTES),
                   (1, False, small.size * 2), (1, True, SMALL_RUN_BYTES)]
    values = np.random.default_rng(1).standard_normal(small.size + big.size).astype(np.float32)
    tb = {lay.worker.rank: {k: values[b.sourcemap.to_indices()] for k, b in lay.buffers.items()}
          for lay in trainers}
    rb = {2: {"s": np.zeros((rows, cols), np.float32), "b": np.zeros(big.size, np.float32)}}
    with wb.LocalSession(p, tb, rb) as s:
        s.update()
    np.testing.assert_array_equal(rb[2]["s"], values[small])
    np.testing.assert_array_equal(rb[2]["b"], values[big])
    # packing below 2 MiB (as a job that sends deltas packs below its pieces): one message per
    # trainer, its small rows and its large range together, received packed
    p = wb.plan(trainers, [rollout], pack_below=2 * SMALL_RUN_BYTES)
    prog = Program(RankPlan.of(p, 2))
    got = sorted((g.peer, g.zc_dst, g.nbytes) for g in prog.messages.values())
    assert got == [(0, False, small.size * 2 + SMALL_RUN_BYTES),
                   (1, False, small.size * 2 + SMALL_RUN_BYTES)]
    rb[2] = {k: np.zeros_like(a) for k, a in rb[2].items()}
    with wb.LocalSession(p, tb, rb) as s:
        s.update()
    np.testing.assert_array_equal(rb[2]["s"], values[small])
    np.testing.assert_array_equal(rb[2]["b"], values[big])
    with pytest.raises(wb.PlanError, match="pack_below"):
        wb.plan(trainers, [rollout], pack_below=-1)
