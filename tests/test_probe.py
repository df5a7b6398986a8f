"""wb.probe on plain numpy load functions: exactness, pass counts, and refusing impure loads."""

import math

import ml_dtypes
import numpy as np
import pytest

import wb
from harness.threads import counting
from wb.algorithms.probing.idcode import digit_base

SPEC = wb.CheckpointSpec({"embed": ((10, 6), "bfloat16"), "q": ((8, 6), "bfloat16"),
                          "k": ((4, 6), "bfloat16"), "norm": ((6,), "bfloat16")})


def fused_load(ck):
    """A vLLM-like loader: fused q/k rows (shard of rank 1 of 2), padded vocab, a non-checkpoint buffer."""
    q, k = np.asarray(ck["q"]), np.asarray(ck["k"])
    embed = np.zeros((8, 6), dtype=ml_dtypes.bfloat16)  # rows 5..9 of 10, padded to 8
    embed[:5] = np.asarray(ck["embed"])[5:]
    return {"qk": np.concatenate([q[4:], k[2:]]), "embed": embed,
            "norm_T": np.asarray(ck["norm"])[::-1].copy(), "scale": np.zeros(1, np.float32)}


def expected():
    ids = {n: SPEC.ids(n) for n in SPEC}
    embed = np.full((8, 6), -1)
    embed[:5] = ids["embed"][5:]
    return {"qk": np.concatenate([ids["q"][4:], ids["k"][2:]]), "embed": embed,
            "norm_T": ids["norm"][::-1], "scale": np.array([-1])}


def test_probe_is_exact_and_unwritten_elements_are_minus_one():
    load, calls = counting(fused_load)
    maps = wb.probe(SPEC, load)
    for name, ids in expected().items():
        np.testing.assert_array_equal(maps[name].to_indices(), ids, err_msg=name)
    # 138 ids fit in one bf16 digit (base 256): one pass plus the check pass.
    assert len(calls) == 2


@pytest.mark.parametrize("dtype, base", [("bfloat16", 256), ("float16", 2048), ("float32", 2**24),
                                         ("float8_e4m3fn", 16)])
def test_passes_follow_from_id_bits_and_narrowest_dtype(dtype, base):
    spec = wb.CheckpointSpec({"a": ((300, 70), dtype)})  # 21,000 ids: 15 bits
    load, calls = counting(lambda ck: {"x": np.asarray(ck["a"])[:, 3:9].T})
    maps = wb.probe(spec, load)
    np.testing.assert_array_equal(maps["x"].to_indices(), spec.ids("a")[:, 3:9].T)
    assert digit_base([dtype]) == base
    assert len(calls) == math.ceil(15 / math.log2(base)) + 1


def test_a_narrower_buffer_dtype_restarts_with_a_smaller_base():
    spec = wb.CheckpointSpec({"a": ((40, 10), "bfloat16")})
    load, calls = counting(lambda ck: {"fp8": np.asarray(ck["a"]).astype(ml_dtypes.float8_e4m3fn)})
    maps = wb.probe(spec, load)
    np.testing.assert_array_equal(maps["fp8"].to_indices(), spec.ids("a"))
    # first pass at base 256 sees an fp8 buffer; then 400 ids in base 16 = 3 passes + check.
    assert len(calls) == 1 + 3 + 1


@pytest.mark.parametrize("transform, what", [
    (lambda a: a.astype(np.float32) * 2, "scales"),
    (lambda a: a.astype(np.float32) * 0.5, "scales"),
    (lambda a: a.astype(np.float32) + 1, "adds"),
    (lambda a: a.astype(np.float32) - 3, "adds"),
    (lambda a: a.astype(ml_dtypes.float8_e4m3fn).astype(np.float32), "quantises"),
    (lambda a: np.round(a.astype(np.float32) / 4) * 4, "quantises"),
])
def test_impure_loads_raise_naming_buffer_and_element(transform, what):
    spec = wb.CheckpointSpec({"w": ((64, 40), "bfloat16")})
    with pytest.raises(wb.ProbeError, match=r"buffer `out` element \(\d+, \d+\)"):
        wb.probe(spec, lambda ck: {"out": transform(np.asarray(ck["w"]))})


def test_load_that_writes_an_element_only_sometimes_is_refused():
    spec = wb.CheckpointSpec({"w": ((64, 40), "bfloat16")})  # 2 digit passes

    def flaky(ck):
        w = np.asarray(ck["w"]).astype(np.float32)
        w[w == 1] = 0  # drops the elements whose digit is 0 in this pass: differs across passes
        return {"out": w}
    with pytest.raises(wb.ProbeError, match="written in some passes|disagrees"):
        wb.probe(spec, flaky)


def test_raising_load_is_reported_with_the_tensor_it_was_fed():
    def broken(ck):
        out = {"q": np.asarray(ck["q"])}
        out["k"] = np.asarray(ck["k"]).reshape(5, 5)  # wrong shape: raises
        return out
    with pytest.raises(wb.ProbeError, match=r"ValueError.*checkpoint tensor `k` \(shape \(4, 6\), bfloat16\)"):
        wb.probe(SPEC, broken)


def test_load_returning_garbage_is_refused():
    with pytest.raises(wb.ProbeError, match="mapping"):
        wb.probe(SPEC, lambda ck: [np.asarray(ck["q"])])
    with pytest.raises(wb.ProbeError, match="empty"):
        wb.probe(wb.CheckpointSpec({}), lambda ck: {})


def test_large_ids_take_several_passes_and_stay_exact():
    # 2**20 ids in bf16: 3 digit passes; a shard in the middle of the id range.
    spec = wb.CheckpointSpec({"big": ((1024, 1024), "bfloat16"), "tail": ((3,), "bfloat16")})
    load, calls = counting(lambda ck: {"x": np.asarray(ck["big"])[500:600, 7:900],
                                       "t": np.asarray(ck["tail"])})
    maps = wb.probe(spec, load)
    np.testing.assert_array_equal(maps["x"].to_indices(), spec.ids("big")[500:600, 7:900])
    np.testing.assert_array_equal(maps["t"].to_indices(), spec.ids("tail"))
    assert len(calls) == 3 + 1 and maps["x"].nnz <= 16


def test_extra_memory_is_one_checkpoint_tensor_plus_a_constant_per_buffer_element():
    """The bound the module docstring states, measured: numpy reports its allocations to
    tracemalloc. The probe before issue 13 took ~14 bytes per *checkpoint* element here (int64 ids)."""
    import tracemalloc

    from wb.algorithms.probing import TRANSIENT_BYTES_PER_ELEMENT

    spec = wb.CheckpointSpec({"big": ((2048, 2048), "bfloat16"), "small": ((1000,), "bfloat16")})
    rows = slice(512, 576)  # 64 x 2048 = 131072 buffer elements of 4.2 M checkpoint elements
    load = lambda ck: {"x": np.asarray(ck["big"])[rows], "s": np.asarray(ck["small"])}  # noqa: E731
    n = 64 * 2048 + 1000
    passes = 3  # 2**22 ids in base 256, plus the check pass
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        maps = wb.probe(spec, load)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(maps["x"].to_indices(), spec.ids("big")[rows])
    kept = 1 + (passes + 1) * 1
    bound = spec.nbytes + n * (kept + TRANSIENT_BYTES_PER_ELEMENT) + (1 << 20)
    assert peak <= bound, (peak, bound)
    assert peak < 4 * spec.numel  # the int64 ids of the earlier probe alone were 8 bytes per element
