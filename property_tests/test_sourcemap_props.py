"""Properties of SourceMap: exact round trips for any map; compact encodings for slice copies."""

import numpy as np
import pytest
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

import wb
from wb.data.sourcemap import MAX_ID
from wb.testing import strategies as wbst

shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=7)


@given(hnp.arrays(np.int64, shapes, elements=st.integers(-1, 2**63 - 1)))
def test_round_trip_any_int64_map(ids):
    sm = wb.SourceMap.from_indices(ids)
    assert np.array_equal(sm.to_indices(), ids)
    assert wb.SourceMap.from_blocks(ids.shape, sm.blocks) == sm


@given(hnp.arrays(np.int64, shapes.filter(lambda s: np.prod(s) > 0),
                  elements=st.integers(-2**63, 2**63 - 1)))
def test_ids_below_minus_one_are_always_refused(ids):
    if ids.min() < -1:
        with pytest.raises(wb.SpecError, match="ids must be >= -1"):
            wb.SourceMap.from_indices(ids)
    else:
        assert np.array_equal(wb.SourceMap.from_indices(ids).to_indices(), ids)


@given(hnp.arrays(np.int64, shapes, elements=st.integers(-1, MAX_ID)))
def test_round_trip_any_id_map(ids):
    sm = wb.SourceMap.from_indices(ids)
    back = sm.to_indices()
    assert back.shape == ids.shape and np.array_equal(back, ids)
    assert wb.SourceMap.from_blocks(ids.shape, sm.blocks) == sm


@given(hnp.arrays(np.int64, shapes, elements=st.integers(-1, 40)))
def test_round_trip_small_ids_with_many_repeats(ids):
    sm = wb.SourceMap.from_indices(ids)
    assert np.array_equal(sm.to_indices(), ids)
    assert sm.blocks.numel == int((ids >= 0).sum())


@given(wbst.slice_copy_maps())
def test_slice_copies_round_trip_and_stay_compact(case):
    spec, ids = case
    sm = wb.SourceMap.from_indices(ids)
    assert np.array_equal(sm.to_indices(), ids)
    assert sm.nnz <= 16 * sm.blocks.count
    assert sm.blocks.numel == int((ids >= 0).sum())
