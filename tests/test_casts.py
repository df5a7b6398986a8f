"""Conversion in flight: a rollout that needs a weight in another float dtype than the trainers
hold it gets it converted once (narrowed by the sender, widened by the receiver), bit for bit as
``torch.Tensor.to`` converts, and the plan's traffic is the bound counted in travelling bytes."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import wb
from wb.data.plan import RankPlan
from wb.algorithms.planner import lower_bound, traffic_ratio
from wb.data.dtypes import CODES, FLOATS, convert, dtype_info
from wb.testing import strategies as wbst

FLOAT_LIST = sorted(FLOATS)


def _values(dtype: str, n: int = 20000, seed: int = 0) -> np.ndarray:
    """Every kind of value a conversion meets: normal, subnormal, exact ties of every narrower
    dtype, overflow, signed zeros and infinities (as ``dtype``)."""
    rng = np.random.default_rng(seed)
    mags = [rng.standard_normal(n) * 10.0 ** rng.integers(-12, 12, n),
            rng.standard_normal(n) * 2.0 ** rng.integers(-150, 130, n)]
    # ties: a value halfway between neighbours of a narrower dtype (mantissa 1 + k/2^m + 1/2^(m+1))
    for m in (2, 3, 7, 10):
        k = rng.integers(0, 2 ** m, n)
        e = rng.integers(-20, 20, n)
        mags.append((1 + k / 2.0 ** m + 2.0 ** -(m + 1)) * 2.0 ** e * rng.choice([-1, 1], n))
    mags.append(np.array([0.0, -0.0, np.inf, -np.inf, 448.0, 464.0, 465.0, 480.0, 57344.0,
                          61440.0, 65504.0, 65520.0, 1e39, -1e39, 2.0 ** -9, 2.0 ** -10,
                          3 * 2.0 ** -11, 2.0 ** -16, 2.0 ** -17, 2.0 ** -24, 2.0 ** -25]))
    with np.errstate(all="ignore"):
        return np.concatenate(mags).astype(dtype_info(dtype).numpy)


@pytest.mark.parametrize("src", ["float64", "float32", "bfloat16", "float16"])
def test_host_conversion_is_torch_to_bit_for_bit(src):
    torch = pytest.importorskip("torch")
    x = _values(src, n=50000)
    tx = torch.from_numpy(x.view(f"u{x.itemsize}").astype(np.int64)).to(
        {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.itemsize]).view(getattr(torch, src))
    for dst in FLOAT_LIST:
        info = dtype_info(dst)
        out = np.empty(x.shape, info.numpy)
        convert(out, x)
        ref = tx.to(getattr(torch, dst)).view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                                              8: torch.int64}[info.itemsize]).numpy()
        got, ref = out.view(f"u{info.itemsize}"), ref.view(f"u{info.itemsize}")
        nan = np.isnan(x.astype(np.float64))
        assert np.isnan(out[nan].astype(np.float64)).all()  # NaN stays NaN (payload not kept)
        bad = np.flatnonzero((got != ref) & ~nan)
        assert bad.size == 0, (src, dst, x[bad[:5]], got[bad[:5]], ref[bad[:5]])


def test_e4m3_saturates_and_the_others_overflow_to_infinity():
    x = np.array([500.0, -1e30, np.inf, 70000.0], np.float32)
    for dst, want in [("float8_e4m3fn", [448, -448, 448, 448]),
                      ("float16", [500, -np.inf, np.inf, np.inf]),
                      ("float8_e5m2", [512, -np.inf, np.inf, np.inf])]:
        out = np.empty(4, dtype_info(dst).numpy)
        convert(out, x)
        assert out.astype(np.float64).tolist() == want, dst


def _oracle(case, weights_by_id, held: str):
    """What every rollout buffer must hold: the trainers' value of each id, converted once."""
    out = {}
    for lay in case.rollouts:
        for k, b in lay.buffers.items():
            ids = b.sourcemap.to_indices()
            want = np.zeros(ids.shape, dtype_info(b.dtype).numpy)
            conv = np.empty(ids.shape, dtype_info(b.dtype).numpy)
            convert(conv, weights_by_id[np.maximum(ids, 0)])
            want[ids >= 0] = conv[ids >= 0]
            out[lay.worker.rank, k] = want
    return out


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["float32", "bfloat16", "float16"]).flatmap(
    lambda held: st.tuples(st.just(held), wbst.layouts(dtype=held, rollout_dtypes=tuple(FLOAT_LIST)))),
    st.integers(64, 4096))
def test_every_rollout_buffer_is_its_conversion_and_traffic_is_the_bound(held_case, chunk):
    held, case = held_case
    p = wb.plan(case.trainers, case.rollouts, chunk_bytes=chunk)
    p.verify()
    # traffic: the bound, counted in the bytes that travel
    lb, t = lower_bound(case.trainers, case.rollouts), p.traffic()
    assert t.trainer_total == lb.trainer_total
    assert {k: v for k, v in t.node_in.items() if v} == lb.node_in
    assert traffic_ratio(p) == pytest.approx(1.0) or lb.trainer_total == 0
    # values: every rollout element is the trainers' value converted once
    rng = np.random.default_rng(chunk)
    with np.errstate(all="ignore"):
        weights = (rng.standard_normal(case.spec.numel)
                   * 10.0 ** rng.integers(-6, 4, case.spec.numel)).astype(dtype_info(held).numpy)
    tb = {lay.worker.rank: {k: weights[b.sourcemap.to_indices()] for k, b in lay.buffers.items()}
          for lay in case.trainers}
    rb = {lay.worker.rank: {k: np.zeros(b.shape, dtype_info(b.dtype).numpy)
                            for k, b in lay.buffers.items()} for lay in case.rollouts}
    out = wb.run_local(p, tb, rb)
    for (r, k), want in _oracle(case, weights, held).items():
        got = out[r][k]
        assert got.view(f"u{got.itemsize}").tolist() == want.view(f"u{want.itemsize}").tolist(), (r, k)


def test_narrowing_halves_the_trainer_bytes_and_each_id_travels_once_per_dtype():
    W = np.arange(256 * 64).reshape(256, 64)
    lay = lambda r, node, role, ids, dt: wb.Layout(  # noqa: E731
        wb.Worker(r, node, role), {"w": wb.BufferSpec(wb.SourceMap.from_indices(ids), dt)})
    trainers = [lay(0, "t", "trainer", W, "float32")]
    same = wb.plan(trainers, [lay(1 + i, f"r{i}", "rollout", W, "float32") for i in range(3)])
    bf16 = wb.plan(trainers, [lay(1 + i, f"r{i}", "rollout", W, "bfloat16") for i in range(3)])
    assert bf16.traffic().trainer_total * 2 == same.traffic().trainer_total
    assert all(v * 2 == same.traffic().node_in[n] for n, v in bf16.traffic().node_in.items())
    # one fp32 and two bf16 nodes: the ids leave the trainer once in each dtype, no more
    mixed = wb.plan(trainers, [lay(1, "r0", "rollout", W, "float32"),
                               lay(2, "r1", "rollout", W, "bfloat16"),
                               lay(3, "r2", "rollout", W, "bfloat16")])
    mixed.verify()
    assert mixed.traffic().trainer_total == W.size * (4 + 2)
    assert mixed.traffic().node_in == {"r0": W.size * 4, "r1": W.size * 2, "r2": W.size * 2}
    # a plan that converts saves and loads with its travelling dtypes
    import io
    f = io.BytesIO()
    mixed.save(f)
    f.seek(0)
    back = wb.Plan.load(f)
    assert back == mixed and back.fingerprint == mixed.fingerprint
    assert {CODES[d] for d in back.pieces.dtype} == {"float32", "bfloat16"}


def test_a_message_travels_in_one_dtype_and_converting_sides_are_never_zero_copy():
    from wb.runtime.engine.program import Program

    W = np.arange(64 * 64).reshape(64, 64)
    held = wb.Layout(wb.Worker(0, "t", "trainer"), {
        "a": wb.BufferSpec(wb.SourceMap.from_indices(W[:32]), "float32"),
        "b": wb.BufferSpec(wb.SourceMap.from_indices(W[32:]), "bfloat16")})
    need = wb.Layout(wb.Worker(1, "r", "rollout"), {  # one fp32 buffer fed from both dtypes
        "w": wb.BufferSpec(wb.SourceMap.from_indices(W), "float32")})
    p = wb.plan([held], [need], chunk_bytes=1 << 20)
    p.verify()
    msgs = Program(RankPlan.of(p, 1)).messages.values()
    assert {g.wire for g in msgs} == {"float32", "bfloat16"}
    for g in msgs:  # the bf16 part is widened by the receiver, the fp32 part lands in place
        assert g.conv == (g.wire == "bfloat16") and g.zc_dst == (g.wire == "float32")
    sends = Program(RankPlan.of(p, 0)).messages.values()
    assert all(not g.conv for g in sends)  # the trainer sends both as it holds them


def converting_deployment():
    """bf16 trainers (one sharing a GPU with a rollout) feeding fp32 and fp8 rollouts on two nodes:
    receivers widen, forwarders narrow what they hold back to bf16, the trainers narrow to fp8
    (also in a local copy)."""
    W = np.arange(96 * 64).reshape(96, 64)

    def lay(r, node, role, bufs, local_rank=0):
        return wb.Layout(wb.Worker(r, node, role, local_rank), {
            k: wb.BufferSpec(wb.SourceMap.from_indices(ids), dt) for k, (ids, dt) in bufs.items()})
    trainers = [lay(0, "t", "trainer", {"w": (W, "bfloat16")}),
                lay(1, "r1", "trainer", {"w": (W[:48], "bfloat16")}, local_rank=1)]
    rollouts = [lay(2, "r0", "rollout", {"w": (W, "float32")}),
                lay(3, "r0", "rollout", {"w": (W[:, :32], "float32")}, local_rank=1),
                lay(4, "r1", "rollout", {"w": (W, "float32")}),
                lay(5, "r1", "rollout", {"w": (W.T, "float8_e4m3fn"), "x": (W[:8], "bfloat16")},
                    local_rank=1)]
    return trainers, rollouts


@pytest.mark.timeout(180)
def test_converting_plan_over_ucx_is_bit_identical(tmp_path):
    pytest.importorskip("ucxx")
    from harness.multiproc import run_ranks

    p = wb.plan(*converting_deployment(), chunk_bytes=2048)
    p.verify()
    assert set(p.transfers.stage.tolist()) == {1, 2, 3}
    p.save(tmp_path / "plan.npz")
    run = run_ranks(str(tmp_path / "plan.npz"), list(range(6)), str(tmp_path / "run"),
                    options={"timeout": 30, "held": "bfloat16"})
    assert all(run.results[r] and run.results[r]["ok"] for r in range(6)), run.results
    assert all(run.results[r]["bit_identical"] for r in range(2, 6))
    M = p.messages
    for r in range(2):  # what the plan says, in travelling bytes (its GPU's other rank included)
        assert run.results[r]["bytes_sent"] == M.nbytes[(M.src_rank == r) & (M.dst_rank != r)].sum()
    assert p.traffic().trainer_total == lower_bound(*converting_deployment()).trainer_total


def test_a_bf16_trainer_feeds_deepseek_v3_rollouts_that_keep_the_router_bias_in_fp32():
    """The issue's case: a trainer keeping every weight in bfloat16 against vLLM-style DeepSeek-V3
    rollouts whose e_score_correction_bias is float32 (as real checkpoints and engines keep it):
    refused before, now planned, widened on arrival, at the bound."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from test_deployments import MLA

    from wb.layouts import megatron_trainer, vllm_rollout

    trainers = [wb.Layout(lay.worker, {k: wb.BufferSpec(b.sourcemap, "bfloat16")
                                       for k, b in lay.buffers.items()})
                for lay in megatron_trainer(MLA, tp=2, pp=1, ep=2, nodes=["t0"], gpus_per_node=4)]
    rollouts = vllm_rollout(MLA, tp=2, ep=2, replicas=2, nodes_per_replica=1, gpus_per_replica=2,
                            gpus_per_node=2, first_rank=len(trainers))
    assert {b.dtype for lay in rollouts for k, b in lay.buffers.items()
            if "e_score_correction_bias" in k} == {"float32"}
    p = wb.plan(trainers, rollouts)
    p.verify()
    assert traffic_ratio(p) == pytest.approx(1.0)
    assert {CODES[d] for d in p.pieces.dtype} == {"bfloat16"}  # the fp32 need widens on arrival
