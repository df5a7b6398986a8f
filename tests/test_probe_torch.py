"""wb_torch.probe on the reference vLLM-style rollout model: exact for every dtype and TP rank."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

torch = pytest.importorskip("torch")

import wb  # noqa: E402
import wb_torch  # noqa: E402
from wb_torch.probing import DeviceArrays, check_digit, run_marks  # noqa: E402
from harness.feeds import FEED_CASES, SKIPS, feed_mismatches  # noqa: E402
from wb.layouts.presets import TINY, spec_from_config  # noqa: E402
from wb_torch.testing import TinyRollout, expected_maps  # noqa: E402

SPEC = spec_from_config(TINY)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tp, rank", [(1, 0), (2, 0), (2, 1), (4, 3)])
def test_probe_equals_oracle(dtype, tp, rank):
    model = TinyRollout(TINY, tp_rank=rank, tp_size=tp, dtype=dtype)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    maps = wb_torch.probe(model, SPEC)
    want = expected_maps(TINY, tp_rank=rank, tp_size=tp)
    assert set(maps) == set(want)
    for name, ids in want.items():
        np.testing.assert_array_equal(maps[name].to_indices(), ids, err_msg=name)
    assert ptrs == {n: p.data_ptr() for n, p in model.named_parameters()}
    # k_scale is not from the checkpoint; padded vocab rows of the last shard are -1.
    assert (maps["model.layers.0.self_attn.attn.k_scale"].to_indices() == -1).all()


def test_maps_are_compact():
    maps = wb_torch.probe(TinyRollout(TINY, tp_rank=1, tp_size=2), SPEC)
    qkv = maps["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.blocks.count == 3 and qkv.nnz <= 48  # q rows, k rows, v rows
    w13 = maps["model.layers.1.mlp.experts.routed_experts.w13_weight"]
    assert w13.blocks.count <= 4 and w13.nnz <= 64  # 2 local experts x (gate, up), adjacent ids merge


def test_scaling_load_weights_is_refused_with_the_parameter_named():
    model = TinyRollout(TINY, dtype=torch.float32)

    def scaled(weights):
        return model.load_weights((n, t * 3) if "o_proj" in n else (n, t) for n, t in weights)
    with pytest.raises(wb.ProbeError, match=r"buffer `model\.layers\.\d\.self_attn\.o_proj\.weight`"):
        wb_torch.probe(model, SPEC, load_weights=scaled)


def test_raising_load_weights_names_the_checkpoint_tensor():
    model = TinyRollout(TINY)
    bad = spec_from_config(dict(TINY, hidden_size=16))  # shapes the model does not expect
    with pytest.raises(wb.ProbeError, match=r"checkpoint tensor `model\.embed_tokens\.weight`"):
        wb_torch.probe(model, bad)


def test_model_without_load_weights():
    with pytest.raises(wb.ProbeError, match="no load_weights"):
        wb_torch.probe(torch.nn.Linear(2, 2), SPEC)


def test_numpy_round_trip_keeps_dtype():
    for dt in DTYPES:
        t = torch.arange(6, dtype=torch.float32).to(dt)
        back = wb_torch.from_numpy(wb_torch.to_numpy(t))
        assert back.dtype == dt and torch.equal(back.float(), t.float())


# --- the device implementation (what runs on a GPU), exercised on CPU tensors -------------------
def device_arrays():
    return DeviceArrays(torch.device("cpu"), chunk=1 << 12)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tp, rank", [(1, 0), (4, 3)])
def test_device_probe_equals_oracle(dtype, tp, rank):
    model = TinyRollout(TINY, tp_rank=rank, tp_size=tp, dtype=dtype)
    maps = wb_torch.probe(model, SPEC, arrays=device_arrays())
    want = expected_maps(TINY, tp_rank=rank, tp_size=tp)
    assert set(maps) == set(want)
    for name, ids in want.items():
        np.testing.assert_array_equal(maps[name].to_indices(), ids, err_msg=name)


@pytest.mark.parametrize("dtype, pass_index", FEED_CASES)
@pytest.mark.parametrize("skip", SKIPS)
def test_device_feed_equals_the_host_feed(dtype, pass_index, skip):
    assert list(feed_mismatches(dtype, pass_index, skip, device_arrays().feed,
                                wb_torch.to_numpy)) == []


@pytest.mark.parametrize("base", [16, 256, 2048, 2**24, 1000])
def test_device_check_digit_equals_the_core_one(base):
    from wb.algorithms.probing.idcode import check_digit as core_check_digit

    ids = np.random.default_rng(base).integers(0, 2**40, 50_000)
    got = check_digit(torch.from_numpy(ids), base).numpy()
    np.testing.assert_array_equal(got, core_check_digit(ids.copy(), base))


def test_device_probe_refuses_a_scaling_load_naming_the_parameter():
    model = TinyRollout(TINY, dtype=torch.float32)

    def scaled(weights):
        return model.load_weights((n, t * 3) if "o_proj" in n else (n, t) for n, t in weights)
    with pytest.raises(wb.ProbeError, match=r"buffer `model\.layers\.\d\.self_attn\.o_proj\.weight`"
                       r" element \(\d+, \d+\)"):
        wb_torch.probe(model, SPEC, load_weights=scaled, arrays=device_arrays())


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(1, 40), st.integers(0, 2**32))
def test_device_run_marks_equal_the_core_ones(cols, rows, seed):
    """On random maps mixing runs, steps, wrapping ids and -1 holes, the marks torch finds are
    the core's, and the runs they give rebuild the ids exactly."""
    from wb.data import sourcemap as sm

    rng = np.random.default_rng(seed)
    n = cols * rows
    kind = rng.integers(0, 3, n)
    steps = rng.choice([1, -1, 0, 7, 2**62], n)
    v = np.cumsum(np.where(kind == 0, steps, rng.integers(-5, 5, n)))
    v[kind == 2] = -1
    v[rng.random(n) < 0.05] = np.iinfo(np.int64).max  # neighbours' differences wrap
    want = sm.run_marks(v.copy(), cols)
    got = run_marks(torch.from_numpy(v.copy()), cols)
    for a, b, field in zip(got, want, sm.RunMarks._fields):
        np.testing.assert_array_equal(a, b, err_msg=field)
    runs = sm.runs_from_marks(got, n, cols, 0)
    back = wb.SourceMap.from_runs((rows, cols), runs).to_indices()
    np.testing.assert_array_equal(back, v.reshape(rows, cols))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_probe_is_exact_and_its_extra_memory_is_bounded():
    """The bound of wb_torch.probing's docstring, measured with the CUDA allocator: kept bytes
    per rank element, TRANSIENT_BYTES per element of the largest tensor (or decode chunk), and
    the checkpoint tensors load_weights holds (one at a time, two while the allocator recycles)."""
    from wb.algorithms.probing.idcode import digit_base
    from wb.layouts.presets import load_config
    from wb_torch.probing import TRANSIENT_BYTES

    cfg = dict(load_config("qwen3-30b-a3b"), num_hidden_layers=1, num_experts=8)
    spec = spec_from_config(cfg)
    model = TinyRollout(cfg, tp_rank=1, tp_size=8, dtype=torch.bfloat16, device="cuda")
    rank = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    passes = math.ceil(math.log(spec.numel, digit_base(spec.dtypes))) + 1
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    maps = wb_torch.probe(model, spec)  # DeviceArrays on the parameters' GPU
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    for name, ids in expected_maps(cfg, tp_rank=1, tp_size=8).items():
        np.testing.assert_array_equal(maps[name].to_indices(), ids, err_msg=name)
    bound = ((1 + passes) * rank + TRANSIENT_BYTES * largest
             + 2 * max(spec.size(n) * 2 for n in spec) + (64 << 20))  # bf16 checkpoint
    assert extra <= bound, (extra, bound, extra / rank)
