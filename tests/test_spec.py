import numpy as np
import pytest

import wb
from wb.layouts.presets import TINY, load_config, spec_from_config


def test_offsets_numel_nbytes():
    spec = wb.CheckpointSpec({"a": ((2, 3), "bfloat16"), "b": ((4,), "float32"), "c": ((), "float16")})
    assert [spec.offset(n) for n in spec] == [0, 6, 10]
    assert spec.numel == 11 and spec.nbytes == 6 * 2 + 4 * 4 + 2
    np.testing.assert_array_equal(spec.ids("b"), [6, 7, 8, 9])
    assert spec.locate(10) == ("c", ())
    np.testing.assert_array_equal(spec.tensor_of(np.arange(11)), [0] * 6 + [1] * 4 + [2])


def test_value_semantics_and_json():
    spec = spec_from_config(TINY)
    again = wb.CheckpointSpec.from_json(spec.to_json())
    assert again == spec and hash(again) == hash(spec)
    assert wb.CheckpointSpec({"a": ((1,), "bf16")}) == wb.CheckpointSpec({"a": ((1,), "bfloat16")})


@pytest.mark.parametrize("bad, match", [
    ({"a": ((-1, 2), "float32")}, "negative"),
    ({"a": ((2,), "complex64")}, "not supported"),
    ({"a": (2, "float32")}, r"\(shape, dtype\)"),
])
def test_bad_specs_say_what_is_wrong(bad, match):
    with pytest.raises(wb.SpecError, match=match):
        wb.CheckpointSpec(bad)


def test_unknown_name_and_out_of_range_id():
    spec = wb.CheckpointSpec({"model.w.weight": ((2,), "float32")})
    with pytest.raises(wb.SpecError, match="not a tensor"):
        spec.offset("model.x.weight")
    with pytest.raises(wb.SpecError, match="outside"):
        spec.locate(2)


# Published sizes (shared/models/README.md): parameters and tensor counts.
@pytest.mark.parametrize("name, params, tensors", [
    ("moonlight-16b-a3b", 15_960_110_208, 5_317),
    ("qwen3-30b-a3b", 30_532_122_624, 18_867),
    ("qwen3-235b-a22b", 235_093_634_560, 36_945),
    ("deepseek-v3", 671_026_419_200, 45_395),
    ("kimi-k2", 1_026_408_232_448, 69_975),
])
def test_model_specs_match_published_sizes(name, params, tensors):
    cfg = load_config(name)  # the configs ship in the package (wb/layouts/models)
    spec = spec_from_config(cfg)
    assert (spec.numel, len(spec)) == (params, tensors)
    assert round(spec.numel / 1e9, 2) == round(cfg["params_b"], 2) or abs(spec.numel / 1e9 - cfg["params_b"]) < 1
