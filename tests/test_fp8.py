"""Block-scaled FP8 rollouts fed by BF16/FP32 trainers: the declaration and its spec, the
quantiser against a plain reference, block assignment, plans at the bound, and real transfers."""

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import wb
from harness.fp8 import deployment, expected, fp8_checkpoint, lay, trainer_buffers, values
from wb.algorithms.fp8.tasks import (partial_amax, quantize_all, quantize_buffers,
                                      quantize_layouts, tasks_for)
from wb.algorithms.planner import lower_bound
from wb.data.fp8 import FP8Blocks, quantize_tensor
from wb.data.dtypes import convert, dtype_info
from wb.testing.oracle import quantize_reference
from wb.runtime.transport.local import LocalHub, LocalTransport

F8 = "float8_e4m3fn"


# --- the rule --------------------------------------------------------------------------------
def _hard_values(draw, shape, dtype):
    """Values that stress the rule: wide magnitudes per block, subnormals, zeros, exact ties."""
    n = math.prod(shape)
    kind = draw(st.sampled_from(["spread", "tiny", "zeros", "ties", "nonfinite"]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if kind == "spread":
        x = rng.standard_normal(n) * np.exp2(rng.integers(-140, 30, n))
    elif kind == "tiny":  # subnormal float32 / bfloat16 values: scales round to subnormals or 0
        x = rng.standard_normal(n) * 2.0**-135
    elif kind == "zeros":
        x = np.where(rng.random(n) < 0.7, 0.0, rng.standard_normal(n))
    elif kind == "ties":  # amax 448: x / scale is x, so e4m3 ties (odd multiples of half a step)
        x = rng.integers(-896, 897, n) / 2.0
        x[0] = 448.0
    else:  # infinities and NaNs in some blocks
        x = rng.standard_normal(n)
        x[rng.random(n) < 0.05] = np.inf
        x[rng.random(n) < 0.05] = -np.inf
        x[rng.random(n) < 0.05] = np.nan
    a = np.empty(shape, dtype_info(dtype).numpy)
    with np.errstate(all="ignore"):
        convert(a, x.reshape(shape))
    return a


@st.composite
def tensors(draw):
    shape = (draw(st.integers(1, 40)), draw(st.integers(1, 40)))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "float16", "float64"]))
    block = (draw(st.integers(1, 16)), draw(st.integers(1, 16)))
    return _hard_values(draw, shape, dtype), block


@settings(max_examples=150, deadline=None)
@given(tensors())
def test_quantiser_equals_the_plain_reference_bit_for_bit(case):
    x, block = case
    q, s = quantize_tensor(x, block)
    with np.errstate(all="ignore"):  # the reference widens float64 by astype (overflow to inf)
        qr, sr = quantize_reference(x.astype(np.float32) if x.dtype == np.float64 else x, block)
    assert q.dtype == ml_dtypes.float8_e4m3fn and s.dtype == np.float32
    assert s.shape == (-(-x.shape[0] // block[0]), -(-x.shape[1] // block[1]))
    assert s.tobytes() == sr.tobytes()
    assert q.tobytes() == qr.tobytes()


def test_the_rule_on_numbers_worked_by_hand():
    x = np.array([[448.0, -224.0], [1.0, 0.0]], np.float32)
    q, s = quantize_tensor(x, (2, 2))
    assert s.tolist() == [[1.0]]
    assert q.astype(np.float32).tolist() == [[448.0, -224.0], [1.0, 0.0]]
    q, s = quantize_tensor(np.array([[896.0, 17.0]], np.float32), (1, 2))  # scale 2
    assert s.tolist() == [[2.0]]
    assert q.astype(np.float32).tolist() == [[448.0, 8.0]]  # 8.5 -> 8: ties to even
    q, s = quantize_tensor(np.zeros((3, 3), np.float32), (2, 2))
    assert s.tolist() == [[0, 0], [0, 0]] and not q.astype(np.float32).any()
    q, s = quantize_tensor(np.array([[1.0, np.inf, 2.0]], np.float32), (1, 2))
    assert s[0, 0] == np.inf and s[0, 1] == np.float32(2 / 448)
    assert q.view(np.uint8).tolist() == [[0x7F, 0x7F, 0x7E]]  # NaN, NaN, 448


# --- the declaration -------------------------------------------------------------------------
def test_declaration_derives_the_fp8_spec_and_round_trips_json():
    spec = wb.CheckpointSpec({"a.weight": ((256, 300), "bfloat16"), "n": ((300,), "float32"),
                              "b.weight": ((129, 128), "float32")})
    decl = FP8Blocks(("*.weight",))
    sc = decl.bind(spec)
    assert sc.names == ("a.weight", "b.weight")
    assert [(n, s, d) for n, (s, d) in sc.spec.items()] == [
        ("a.weight", (256, 300), F8), ("n", (300,), "float32"), ("b.weight", (129, 128), F8),
        ("a.weight_scale_inv", (2, 3), "float32"), ("b.weight_scale_inv", (2, 1), "float32")]
    assert all(sc.spec.offset(n) == spec.offset(n) for n in spec)  # weights keep their ids
    assert FP8Blocks.from_json(decl.to_json()) == decl


@pytest.mark.parametrize("kw, match", [
    (dict(tensors=("w",), format="float8_e5m2"), "format 'float8_e5m2'"),
    (dict(tensors=("w",), rounding="stochastic"), "rounding"),
    (dict(tensors=("w",), block=(128, 0)), "two positive ints"),
    (dict(tensors=()), "at least one tensor"),
])
def test_bad_declarations_are_refused(kw, match):
    with pytest.raises(wb.SpecError, match=match):
        FP8Blocks(**kw)


@pytest.mark.parametrize("tensors, match", [
    (("nope*",), "matches no tensor"), (("v",), "needs 2-D tensors: `v`"),
    (("i",), "quantises floats: `i`"), (("w",), "already has"),
])
def test_declarations_a_spec_cannot_take_are_refused(tensors, match):
    spec = wb.CheckpointSpec({"w": ((4, 4), "bfloat16"), "w_scale_inv": ((1,), "float32"),
                              "v": ((8,), "float32"), "i": ((4, 4), "int32")})
    with pytest.raises(wb.SpecError, match=match):
        FP8Blocks(tensors).bind(spec)


# --- planning and executing ------------------------------------------------------------------
def _run_local(plan, q, trainers, rollouts, spec, vals):
    own = {t.worker.rank: trainer_buffers(t, spec, vals) for t in trainers}
    quantized = quantize_all(q, own)
    tb = {r: {**own[r], **quantized[r]} for r in own}
    rb = {r.worker.rank: {k: np.zeros(b.shape, dtype_info(b.dtype).numpy)
                          for k, b in r.buffers.items()} for r in rollouts}
    return wb.run_local(plan, tb, rb)


def test_every_block_has_one_quantiser_and_the_plan_is_at_the_bound():
    spec, sc, trainers, rollouts = deployment()
    q = quantize_layouts(trainers, sc)
    blocks = {}
    for r, tasks in q.tasks.items():
        for t in tasks:
            for b in t.blocks.tolist():
                assert (t.tensor, b) not in blocks, "a block quantised twice"
                blocks[(t.tensor, b)] = r
    grid = [math.prod(sc.spec.shape(sc.scale_name(t))) for t in range(len(sc.names))]
    assert len(blocks) == sum(grid)
    assert {r for r in blocks.values()} == {0, 1, 2, 3}  # the replicas share the work
    p = wb.plan(q.trainers, rollouts)
    p.verify()
    bound = lower_bound(q.trainers, rollouts)
    assert p.traffic().trainer_total == bound.trainer_total
    assert p.traffic().node_in == bound.node_in
    out = _run_local(p, q, trainers, rollouts, spec, values(spec, 7))
    flat = fp8_checkpoint(sc, values(spec, 7))
    for r in rollouts:
        want = expected(r, flat)
        for k in r.buffers:
            assert out[r.worker.rank][k].tobytes() == want[k].tobytes(), (r.worker.rank, k)


@st.composite
def fp8_deployments(draw):
    """A random spec of 2-D tensors (some declared) and a norm; trainers: replicas of TP ranks
    cutting rows or columns (at block multiples, or anywhere: blocks split between ranks), or
    FSDP-like flat shards (cut at block bands, or anywhere); rollouts: random rectangles (some
    transposed) of each FP8 tensor and of its scales, and the norm in a random float dtype."""
    bh, bw = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    n_t = draw(st.integers(1, 3))
    shapes = [(bh * draw(st.integers(1, 4)) - draw(st.integers(0, bh - 1)),
               bw * draw(st.integers(1, 4)) - draw(st.integers(0, bw - 1))) for _ in range(n_t)]
    held = draw(st.sampled_from(["bfloat16", "float32"]))
    tensors = {f"t{i}": (s, held) for i, s in enumerate(shapes)}
    tensors["norm"] = ((7,), "float32")
    spec = wb.CheckpointSpec(tensors)
    declared = [n for n in spec if n != "norm" and draw(st.booleans())] or ["t0"]
    sc = FP8Blocks(tuple(declared), block=(bh, bw)).bind(spec)
    ids = {n: spec.ids(n).reshape(spec.shape(n)) for n in spec}
    f = {n: sc.spec.ids(n).reshape(sc.spec.shape(n)) for n in sc.spec}
    trainers, rank = [], 0
    aligned = draw(st.sampled_from([True, False, False]))  # False: blocks may be split
    for rep in range(draw(st.integers(1, 2))):
        if draw(st.booleans()):  # FSDP-like: flat shards of the 2-D tensors, cut at block bands
            end = spec.offset("norm")  # the norm (float32) is a buffer of its own
            cuts = {0, end}
            for n in sc.names:
                step = bh * spec.shape(n)[1] if aligned else 1
                cuts |= {spec.offset(n) + step * draw(st.integers(0, spec.size(n) // step))
                         for _ in range(draw(st.integers(0, 3)))} - {spec.offset(n) + spec.size(n)}
            bounds = sorted(cuts)
            pick = sorted(set(draw(st.lists(st.sampled_from(bounds), max_size=3))) | {0, end})
            flat = np.arange(end)
            for k, (lo, hi) in enumerate(zip(pick, pick[1:])):
                bufs = {"flat": (flat[lo:hi], held)}
                if k == 0:
                    bufs["norm"] = (ids["norm"], "float32")
                trainers.append(lay(rank, f"t{rep}", "trainer", bufs, local_rank=k))
                rank += 1
            continue
        tp = draw(st.integers(1, 3))
        parts = [dict() for _ in range(tp)]
        for n in spec:
            if n == "norm":
                parts[0]["norm"] = (ids["norm"], "float32")
                continue
            axis = draw(st.integers(0, 1))
            b = (bh, bw)[axis] if aligned else 1
            nb = -(-spec.shape(n)[axis] // b)
            cuts = sorted({0, spec.shape(n)[axis], *[min(b * draw(st.integers(0, nb)),
                                                         spec.shape(n)[axis])
                                                      for _ in range(tp - 1)]})
            for k, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
                piece = ids[n][lo:hi] if axis == 0 else ids[n][:, lo:hi]
                how = draw(st.sampled_from(["as is", "transposed", "rows reversed"]))
                piece = {"as is": piece, "transposed": piece.T, "rows reversed": piece[::-1]}[how]
                parts[k % tp][n] = (piece, held)
        for k, bufs in enumerate(parts):
            if bufs:
                trainers.append(lay(rank, f"t{rep}", "trainer", bufs, local_rank=k))
                rank += 1
    rollouts = []
    for k in range(draw(st.integers(1, 3))):
        bufs = {}
        for n in sc.spec:
            if n == "norm":
                bufs[n] = (f[n], draw(st.sampled_from(["bfloat16", "float32", "float16"])))
                continue
            rows, cols = sc.spec.shape(n)
            r0, c0 = draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1))
            r1, c1 = draw(st.integers(r0 + 1, rows)), draw(st.integers(c0 + 1, cols))
            piece = f[n][r0:r1, c0:c1]
            bufs[n] = (piece.T if draw(st.booleans()) else piece, sc.spec.dtype(n))
        rollouts.append(lay(rank + k, f"r{k % 2}", "rollout", bufs, local_rank=k // 2))
    return spec, sc, trainers, rollouts, draw(st.integers(0, 2**31))


@settings(max_examples=60, deadline=None)
@given(fp8_deployments())
def test_random_fp8_deployments_are_bit_identical_and_at_the_bound(case):
    spec, sc, trainers, rollouts, seed = case
    q = quantize_layouts(trainers, sc)
    for own, planned in zip(trainers, q.trainers):  # what each trainer rebuilds for itself
        mine = tasks_for(sc, own, planned).tasks[own.worker.rank]
        want = q.tasks[own.worker.rank]
        key = lambda t: (t.scales, t.tensor)  # noqa: E731 - the order may differ
        mine, want = sorted(mine, key=key), sorted(want, key=key)
        assert [t[:4] + (t.part,) for t in mine] == [t[:4] + (t.part,) for t in want]
        assert all(np.array_equal(a.blocks, b.blocks) and np.array_equal(a.gather, b.gather)
                   and np.array_equal(a.at, b.at)
                   and np.array_equal(a.windows(*sc.decl.block), b.windows(*sc.decl.block))
                   for a, b in zip(mine, want))
    p = wb.plan(q.trainers, rollouts)
    p.verify()
    bound = lower_bound(q.trainers, rollouts)
    assert p.traffic().trainer_total == bound.trainer_total
    assert p.traffic().node_in == bound.node_in
    vals = values(spec, seed)
    out = _run_local(p, q, trainers, rollouts, spec, vals)
    flat = fp8_checkpoint(sc, vals)
    for r in rollouts:
        want = expected(r, flat)
        for k in r.buffers:
            assert out[r.worker.rank][k].tobytes() == want[k].tobytes(), (r.worker.rank, k)


def test_fp8_rollouts_take_about_half_the_bytes_of_bf16_ones():
    # 128 x 128 blocks, as the formats have them: weights halve, scales add 4 / 16384 per byte
    spec = wb.CheckpointSpec({"w": ((1024, 2048), "bfloat16"), "u": ((512, 2048), "bfloat16")})
    sc = FP8Blocks(("w", "u")).bind(spec)
    ids = {n: spec.ids(n).reshape(spec.shape(n)) for n in spec}
    f = {n: sc.spec.ids(n).reshape(sc.spec.shape(n)) for n in sc.spec}
    trainers = [lay(k, "t", "trainer", {n: (ids[n][:, k * 1024:(k + 1) * 1024], "bfloat16")
                                        for n in spec}, local_rank=k) for k in range(2)]
    fp8 = [lay(2 + k, f"r{k}", "rollout", {**{n: (f[n], F8) for n in spec},
                                            **{n + "s": (f[n + "_scale_inv"], "float32")
                                               for n in spec}}) for k in range(2)]
    bf16 = [lay(2 + k, f"r{k}", "rollout", {n: (ids[n], "bfloat16") for n in spec})
            for k in range(2)]
    q = quantize_layouts(trainers, sc)
    sent_fp8 = wb.plan(q.trainers, fp8).traffic().trainer_total
    sent_bf16 = wb.plan(trainers, bf16).traffic().trainer_total
    assert sent_fp8 / sent_bf16 == pytest.approx(0.5 + 4 / (2 * 128 * 128))
    assert sent_fp8 / sent_bf16 <= 0.52


def _split_rows(cut, block=(4, 4)):
    """``w`` (8 x 8) held by two TP ranks cut at row ``cut`` (a block row split between them)
    and one rollout serving all of it in FP8 with its scales."""
    spec = wb.CheckpointSpec({"w": ((8, 8), "bfloat16")})
    sc = FP8Blocks(("w",), block=block).bind(spec)
    ids = spec.ids("w").reshape(8, 8)
    trainers = [lay(0, "t", "trainer", {"w": (ids[:cut], "bfloat16")}),
                lay(1, "t", "trainer", {"w": (ids[cut:].T, "bfloat16")}, local_rank=1)]
    f = {n: sc.spec.ids(n).reshape(sc.spec.shape(n)) for n in sc.spec}
    rollouts = [lay(2, "r", "rollout", {"w": (f["w"], F8),
                                        "s": (f["w_scale_inv"], "float32")})]
    return spec, sc, trainers, rollouts


def test_a_block_held_in_parts_is_quantised_by_its_holders_with_the_whole_blocks_scale():
    # rows 0-2 on rank 0, rows 3-7 (transposed) on rank 1: block row 0 is split between them
    spec, sc, trainers, rollouts = _split_rows(3)
    q = quantize_layouts(trainers, sc)
    parts = {r: [t for t in ts if t.part] for r, ts in q.tasks.items()}
    assert [t.blocks.tolist() for t in parts[0]] == [[0, 1]]
    assert [t.blocks.tolist() for t in parts[1]] == [[0, 1]]
    assert q.peers == {0: (1,), 1: (0,)}
    vals = values(spec, 3)
    vals["w"][0, 0] = 100.0  # block (0, 0)'s amax is on rank 0, and rank 1 must use it
    own = {t.worker.rank: trainer_buffers(t, spec, vals) for t in trainers}
    with pytest.raises(ValueError, match="amax over the whole block is needed"):
        quantize_buffers(q, 1, own[1])
    k1, a1 = partial_amax(q, 1, own[1])
    assert a1[0] < 100.0  # its own part alone would give another scale
    p = wb.plan(q.trainers, rollouts)
    p.verify()
    bound = lower_bound(q.trainers, rollouts)
    assert p.traffic().trainer_total == bound.trainer_total  # no gather: FP8 bytes only
    out = _run_local(p, q, trainers, rollouts, spec, vals)
    want = expected(rollouts[0], fp8_checkpoint(sc, vals))
    assert all(out[2][k].tobytes() == want[k].tobytes() for k in want)


def test_a_block_its_holders_do_not_cover_is_refused_naming_the_tensor():
    spec, sc, trainers, rollouts = _split_rows(3)
    ids = spec.ids("w").reshape(8, 8)
    trainers[1] = lay(1, "t", "trainer", {"w": (ids[4:], "bfloat16")}, local_rank=1)  # no row 3
    with pytest.raises(wb.PlanError, match=r"block \(0, 0\) of `w`.*held only in parts.*do not "
                                           r"cover it"):
        quantize_layouts(trainers, sc)


def test_an_fp8_rollout_without_a_declaration_is_refused():
    spec, sc, trainers, rollouts = deployment()
    with pytest.raises(wb.PlanError, match=r"no trainer holds.*need the conversion declared "
                                           r"\(wb.FP8Blocks"):
        wb.plan(trainers, rollouts)  # the scales exist only in the FP8 checkpoint


def run_fp8_over_ucx(tmp_path, options: dict) -> dict:
    """The deployment of harness.fp8 (``options["split"]``: blocks split between trainers),
    planned and run over UCX (spawned processes): results."""
    import json
    import multiprocessing as mp

    from harness.fp8 import child

    spec, sc, trainers, rollouts = deployment(split=options.get("split", False))
    q = quantize_layouts(trainers, sc)
    p = wb.plan(q.trainers, rollouts, chunk_bytes=64)
    p.save(tmp_path / "plan.npz")
    (tmp_path / "store").mkdir()
    (tmp_path / "res").mkdir()
    ctx = mp.get_context("spawn")
    own = {t.worker.rank: t for t in trainers}
    procs = [ctx.Process(target=child, args=(r, str(tmp_path / "plan.npz"), q, spec, own.get(r),
                                             str(tmp_path / "store"), str(tmp_path / "res"),
                                             options))
             for r in p.ranks]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join(150)
        if pr.is_alive():
            pr.kill()
    res = {r: json.loads((tmp_path / "res" / f"{r}.json").read_text()) for r in p.ranks}
    assert all(v["ok"] for v in res.values()), res
    assert all(res[r.worker.rank]["checks"] == [True] * options["versions"] for r in rollouts), {
        r.worker.rank: res[r.worker.rank] for r in rollouts}
    M = p.messages
    for t in trainers:
        r = t.worker.rank
        sent = int(M.nbytes[(M.src_rank == r) & (M.dst_rank != r)].sum())
        assert res[r]["bytes_sent"] == [sent] * options["versions"]
    return res


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sender_staging, receiver_staging, split",
                         [(True, True, False), (False, False, True)])
def test_fp8_over_ucx_with_sync_modes_is_bit_identical(tmp_path, sender_staging, receiver_staging,
                                                        split):
    pytest.importorskip("ucxx")
    run_fp8_over_ucx(tmp_path, {"versions": 2, "sender_staging": sender_staging,
                                "receiver_staging": receiver_staging, "split": split})


@pytest.mark.parametrize("split", [False, True])
def test_agreed_parts_and_senders_given_the_declaration_are_bit_identical(split):
    # a real job's set-up: every worker publishes its own layout; the planner quantises the
    # trainers' layouts; each trainer's Sender rebuilds its tasks from its own layout and part
    # (split: blocks held in parts, whose amax the trainers exchange through the store)
    import threading

    spec, sc, trainers, rollouts = deployment(split=split)
    store, hub = wb.MemoryStore(), LocalHub()
    world = len(trainers) + len(rollouts)
    vals = values(spec, 5)
    got, errors = {}, []

    def worker(lay):
        r = lay.worker.rank
        try:
            part = wb.agree_parts(store, [lay], world=world, quantize=sc, timeout=30)[r]
            kw = dict(transport=LocalTransport(r, hub), store=store, timeout=30,
                      wait_timeout=30)
            if lay.worker.role == "trainer":
                with wb.Sender(part, r, trainer_buffers(lay, spec, vals), quantize=sc,
                               layout=lay, **kw) as tx:
                    tx.push()
            else:
                bufs = {k: np.zeros(b.shape, dtype_info(b.dtype).numpy)
                        for k, b in lay.buffers.items()}
                with wb.Receiver(part, r, bufs, **kw) as rx:
                    rx.apply()
                got[r] = bufs
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append((r, e))

    threads = [threading.Thread(target=worker, args=(lay,)) for lay in (*trainers, *rollouts)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    flat = fp8_checkpoint(sc, vals)
    for lay in rollouts:
        want = expected(lay, flat)
        for k in lay.buffers:
            assert got[lay.worker.rank][k].tobytes() == want[k].tobytes(), (lay.worker.rank, k)


def test_a_sender_given_a_declaration_needs_its_own_layout():
    spec, sc, trainers, rollouts = deployment()
    q = quantize_layouts(trainers, sc)
    p = wb.plan(q.trainers, rollouts)
    with pytest.raises(wb.TransferError, match="needs layout="):
        wb.Sender(p, 0, trainer_buffers(trainers[0], spec, values(spec, 0)), quantize=sc,
                  transport=LocalTransport(0, LocalHub()), store=wb.MemoryStore())


def test_blocks_a_buffer_holds_in_several_rectangles_are_quantised_by_it():
    # rows 2-3 then rows 0-1 of the tensor: the block is whole in the buffer, in two rectangles
    spec = wb.CheckpointSpec({"w": ((4, 8), "bfloat16")})
    sc = FP8Blocks(("w",), block=(4, 8)).bind(spec)
    ids = spec.ids("w").reshape(4, 8)
    trainers = [lay(0, "t", "trainer", {"w": (np.concatenate([ids[2:], ids[:2]]), "bfloat16")})]
    rollouts = [lay(1, "r", "rollout", {"w": (ids.T, F8),
                                        "s": (sc.spec.ids("w_scale_inv").reshape(1, 1), "float32")})]
    q = quantize_layouts(trainers, sc)
    (task,) = q.tasks[0]
    assert task.at[:, 0].tolist() == [-1] and task.gather.size == 32  # listed, not affine
    p = wb.plan(q.trainers, rollouts)
    vals = values(spec, 11)
    out = _run_local(p, q, trainers, rollouts, spec, vals)
    want = expected(rollouts[0], fp8_checkpoint(sc, vals))
    assert all(out[1][k].tobytes() == want[k].tobytes() for k in want)


def test_replicas_quantise_whole_tensors():
    """Two trainers holding the same 6 declared tensors whole split the work tensor by tensor
    (3 each, none cut between them), not block rows of every tensor."""
    names = [f"l{i}.w" for i in range(6)]
    spec = wb.CheckpointSpec({n: ((256, 256), "bfloat16") for n in names})
    sc = wb.FP8Blocks(("*.w",)).bind(spec)
    sm = {n: wb.BufferSpec(wb.SourceMap.from_indices(spec.ids(n)), "bfloat16") for n in names}
    trainers = [wb.Layout(wb.Worker(r, "t", "trainer", r), sm) for r in range(2)]
    q = quantize_layouts(trainers, sc)
    owner = {}
    for r, tasks in q.tasks.items():
        for t in tasks:
            owner.setdefault(t.tensor, set()).add(r)
    assert all(len(rs) == 1 for rs in owner.values()), owner
    assert sorted(len([t for t, rs in owner.items() if r in rs]) for r in (0, 1)) == [3, 3]


@settings(max_examples=40, deadline=None)
@given(fp8_deployments())
def test_the_benchs_fp8_check_equals_the_per_element_oracle(case):
    """``wb.cli.bench.weights.fp8_expected`` (what every FP8 rollout of a bench or UCX test is
    checked against, built one source-map block at a time) equals the oracle here: the
    reference-quantised checkpoint of the same weights, read element by element."""
    from wb.cli.bench.weights import fp8_expected, weight_bits

    spec, sc, _, rollouts, _ = case
    held = spec.dtype("t0")
    hd = dtype_info(held).numpy
    vals = {n: weight_bits(spec.ids(n), hd).view(hd).reshape(spec.shape(n)) for n in spec}
    with np.errstate(under="ignore"):  # the bench's float32 weights reach subnormal scales
        flat = fp8_checkpoint(sc, vals)
    for r in rollouts:
        got, want = fp8_expected(r, sc, held), expected(r, flat)
        assert set(got) == set(want)
        for k in want:
            assert got[k].tobytes() == want[k].tobytes(), (r.worker.rank, k)
