"""``wb.algorithms.locate``: where sampled checkpoint ids lie in a buffer, solved in its source
map's blocks, equals the brute force over the decoded map (every element, ``np.nonzero``), for
maps of slices, transposes, strided and interleaved steps, repeats and holes."""

import numpy as np
from hypothesis import given, settings, strategies as st

import wb
from wb.algorithms.locate import locate


def _brute(ids_map, ids):
    flat = ids_map.reshape(-1)
    pairs = [(k, int(p)) for k, x in enumerate(ids) for p in np.flatnonzero(flat == x)]
    pairs.sort(key=lambda t: t[1])
    return [k for k, _ in pairs], [p for _, p in pairs]


@st.composite
def _maps(draw):
    rows, cols = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    kind = draw(st.sampled_from(["slice", "transpose", "strided", "interleaved", "random",
                                 "repeat", "one"]))
    base = draw(st.integers(0, 1000))
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    if kind == "slice":
        m = base + r * draw(st.integers(cols, 3 * cols)) + c
    elif kind == "transpose":
        m = base + c * draw(st.integers(rows, 3 * rows)) + r
    elif kind == "strided":
        m = base + r * draw(st.integers(cols * 3, cols * 5)) + c * 3
    elif kind == "interleaved":  # steps 3 and 2: rows' ids cross
        m = base + r * 3 + c * 7
    elif kind == "random":
        m = base + np.random.default_rng(draw(st.integers(0, 99))).permutation(rows * cols) \
            .reshape(rows, cols)
    elif kind == "repeat":  # a row repeated (a replicated tensor): ids held twice
        m = np.broadcast_to(base + c, (rows, cols)).copy()
    else:  # one id everywhere
        m = np.full((rows, cols), base)
    if draw(st.booleans()):
        m = m.copy()
        m[draw(st.integers(0, rows - 1))] = -1  # a hole: not from the checkpoint
    return m.astype(np.int64)


@settings(max_examples=150, deadline=None)
@given(_maps(), st.data())
def test_locate_equals_the_brute_force(m, data):
    held = np.unique(m[m >= 0])
    pick = data.draw(st.lists(st.sampled_from(held.tolist()), max_size=10)) if held.size else []
    extra = data.draw(st.lists(st.integers(0, 3000), max_size=5))
    ids = np.unique(np.array(pick + extra, np.int64))
    which, flat = locate(wb.SourceMap.from_indices(m), ids)
    want_which, want_flat = _brute(m, ids)
    assert flat.tolist() == want_flat and which.tolist() == want_which
