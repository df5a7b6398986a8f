"""Property: block-level correspondence equals the brute-force per-element oracle."""

import numpy as np
from hypothesis import given, strategies as st

import wb
from wb.testing import correspondence_pairs, overlap_pairs, strategies as wbst
from wb.data.correspondence import correspond


@given(wbst.layouts())
def test_correspondence_equals_oracle(case):
    corr = correspond(case.trainers, case.rollouts)
    assert overlap_pairs(corr) == correspondence_pairs(case.trainers, case.rollouts)


@given(wbst.layouts())
def test_cells_partition_every_buffer_exactly(case):
    corr = correspond(case.trainers, case.rollouts)
    seen = {}
    for k in range(corr.inc_cell.size):
        c, s = corr.inc_cell[k], corr.slots[corr.inc_slot[k]]
        lays = case.trainers if s.role == "trainer" else case.rollouts
        ids = lays[s.layout].buffers[s.buffer].sourcemap.to_indices().reshape(-1)
        i, j = np.meshgrid(np.arange(corr.cell_na[c]), np.arange(corr.cell_nb[c]), indexing="ij")
        f = corr.inc_f0[k] + i * corr.inc_fa[k] + j * corr.inc_fb[k]
        np.testing.assert_array_equal(ids[f], corr.cell_id0[c] + i * corr.cell_S[c] + j)
        for x in f.reshape(-1).tolist():
            key = (s.role, s.layout, s.buffer, x)
            assert key not in seen
            seen[key] = True
    for role, lays in (("trainer", case.trainers), ("rollout", case.rollouts)):
        for li, lay in enumerate(lays):
            for name, buf in lay.buffers.items():
                n = int((buf.sourcemap.to_indices() >= 0).sum())
                assert sum(1 for key in seen if key[:3] == (role, li, name)) == n


@given(wbst.layouts(), st.data())
def test_dropping_a_holder_reports_a_missing_id_exactly_when_one_is_missing(case, data):
    drop = data.draw(st.integers(0, len(case.trainers) - 1))
    trainers = case.trainers[:drop] + case.trainers[drop + 1:]
    held = set()
    for t in trainers:
        for b in t.buffers.values():
            held.update(b.sourcemap.to_indices().reshape(-1).tolist())
    needed = set()
    for r in case.rollouts:
        for b in r.buffers.values():
            needed.update(b.sourcemap.to_indices().reshape(-1).tolist())
    missing = sorted(needed - held - {-1})
    try:
        correspond(trainers, case.rollouts)
    except wb.PlanError as e:
        assert missing and f"first missing id {missing[0]})" in str(e)
    else:
        assert not missing
