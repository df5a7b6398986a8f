import pickle
import tracemalloc

import numpy as np
import pytest

import wb
from wb.data.sourcemap import Blocks


def _ids(*shape, off=0):
    return off + np.arange(np.prod(shape), dtype=np.int64).reshape(shape)


def _brute_blocks(sm):
    """Decode the blocks element by element (the oracle of `blocks`)."""
    rows, cols = sm.view2d
    out = np.full((rows, cols), -1, np.int64)
    b = sm.blocks
    for k in range(b.count):
        i, j = np.meshgrid(np.arange(b.nr[k]), np.arange(b.nc[k]), indexing="ij")
        tile = out[b.r0[k]:b.r0[k] + b.nr[k], b.c0[k]:b.c0[k] + b.nc[k]]
        assert (tile == -1).all(), "blocks overlap"
        tile[...] = b.id0[k] + i * b.sr[k] + j * b.sc[k]
    return out.reshape(sm.shape)


W = _ids(16, 24)  # a [out, in] linear weight
Q, K, V = _ids(32, 8), _ids(8, 8, off=1000), _ids(8, 8, off=2000)
EXPERTS = [_ids(6, 8, off=5000 + 100 * e) for e in range(4)]

# (name, index array, number of slice-copy rectangles in it)
SLICE_COPIES = [
    ("column shard", W[:, 6:12], 1),
    ("row shard", W[8:16], 1),
    ("full copy", W.copy(), 1),
    ("transpose (JAX kernel [in, out])", W.T, 1),
    ("fused qkv with GQA", np.concatenate([Q[8:16], K[0:2], V[0:2]]), 3),
    ("fused gate_up", np.concatenate([W[0:4], W[8:12] + 10_000]), 2),
    ("stacked experts", np.stack(EXPERTS[2:4]), 2),
    ("stacked gate/up on a new axis (JAX [2, E, in, out])",
     np.stack([np.stack([e.T for e in EXPERTS[:2]]), np.stack([e.T + 50_000 for e in EXPERTS[:2]])]), 4),
    ("padded vocabulary shard", np.concatenate([W[12:16], np.full((4, 24), -1)]), 1),
    ("reshaped JAX attention kernel [d, heads, head_dim]", W.T.reshape(24, 4, 4), 24),
    ("replicated kv head (tp > kv heads)", np.concatenate([Q[0:4], K[0:2], V[0:2]]), 3),
]


@pytest.mark.parametrize("name, ids, rects", SLICE_COPIES, ids=[s[0] for s in SLICE_COPIES])
def test_slice_copies_store_at_most_16_entries_per_rectangle(name, ids, rects):
    sm = wb.SourceMap.from_indices(ids)
    np.testing.assert_array_equal(sm.to_indices(), ids)
    np.testing.assert_array_equal(_brute_blocks(sm), ids)
    assert sm.nnz <= 16 * rects
    assert sm.blocks.count <= rects


def test_large_column_shard_is_O1_and_encoding_memory_is_bounded():
    full_cols = 2 * 16384
    ids = np.arange(8192, dtype=np.int64)[:, None] * full_cols + 16384 + np.arange(16384)
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        sm = wb.SourceMap.from_indices(ids)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sm.shape == (8192, 16384) and sm.nnz <= 16 and sm.blocks.count == 1
    assert peak - base <= 2 * ids.nbytes  # extra space while encoding (here it is ~1/16 of it)
    b = sm.blocks
    assert (b.id0[0], b.sr[0], b.sc[0], b.nr[0], b.nc[0]) == (16384, full_cols, 1, 8192, 16384)


def test_blocks_and_diff2_agree_whichever_way_the_map_was_built():
    ids = np.concatenate([W[:, 4:8].T, np.full((2, 16), -1), W[0:3, 0:16]])
    a = wb.SourceMap.from_indices(ids)
    b = wb.SourceMap.from_blocks(ids.shape, a.blocks)
    c = wb.SourceMap.from_diff2(ids.shape, *a.diff2())
    assert a == b == c
    np.testing.assert_array_equal(c.to_indices(), ids)
    assert c.blocks.numel == (ids >= 0).sum() == a.n_ids


def test_from_blocks_rejects_overlaps_and_out_of_view():
    with pytest.raises(wb.SpecError, match="overlap"):
        wb.SourceMap.from_blocks((4, 4), Blocks.of((0, 2, 0, 2, 0, 4, 1), (1, 2, 1, 2, 100, 4, 1)))
    with pytest.raises(wb.SpecError, match="inside"):
        wb.SourceMap.from_blocks((4, 4), Blocks.of((3, 2, 0, 1, 0, 4, 1)))


@pytest.mark.parametrize("bad", [np.array([0.5]), np.array([2**64 - 1], dtype=np.uint64)])
def test_non_int64_ids_are_refused(bad):
    with pytest.raises(wb.SpecError):
        wb.SourceMap.from_indices(bad)


def test_extreme_int64_values_round_trip_but_layouts_refuse_them():
    ids = np.array([[2**62 + 7, 2**63 - 1, -1, 0], [-1, 2**62, 2**63 - 2, 1]])
    sm = wb.SourceMap.from_indices(ids)
    np.testing.assert_array_equal(sm.to_indices(), ids)
    with pytest.raises(wb.SpecError, match="ids must be"):
        wb.BufferSpec(sm, "bfloat16")
    for low in (-2, -5, -2**63):  # below -1: meaningless, refused where the map is made
        with pytest.raises(wb.SpecError, match=f"ids must be >= -1.*found {low}"):
            wb.SourceMap.from_indices(np.array([[0, 1], [low, 3]]))


def test_slicing_pickle_and_arrays_round_trip():
    sm = wb.SourceMap.from_indices(W.T.reshape(24, 4, 4))
    np.testing.assert_array_equal(sm[:, 1:3].to_indices(), W.T.reshape(24, 4, 4)[:, 1:3])
    assert pickle.loads(pickle.dumps(sm)) == sm
    back = wb.SourceMap.from_arrays(dict(np.load(_savez(sm))))
    assert back == sm and back.blocks == sm.blocks


def _savez(sm):
    import io
    f = io.BytesIO()
    np.savez(f, **sm.to_arrays())
    f.seek(0)
    return f


def test_golden_encoding():
    # The diff2 entries of a 3x4 column shard of a [3, 8] tensor: stable on-disk format.
    sm = wb.SourceMap.from_indices(_ids(3, 8)[:, 2:6])
    pos, val = sm.diff2()
    assert pos.tolist() == [0, 1, 4, 5]
    assert val.tolist() == [3, -2, 5, -6]  # checked by hand: Δr²Δc² of ids+1
    assert sm.to_arrays()["shape"].tolist() == [3, 4]


def test_empty_and_scalar_maps():
    for ids in (np.zeros((0, 3), np.int64), np.array(7), np.full((2, 2), -1)):
        sm = wb.SourceMap.from_indices(ids)
        np.testing.assert_array_equal(sm.to_indices(), ids)
