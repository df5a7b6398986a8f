"""Correspondence on blocks equals the per-element oracle; missing ids and dtype clashes raise."""

import numpy as np
import pytest

import wb
from wb.testing import correspondence_pairs, overlap_pairs
from wb.data.correspondence import correspond


def lay(rank, node, role, bufs, dtype="bfloat16"):
    return wb.Layout(wb.Worker(rank=rank, node=node, role=role),
                     {n: wb.BufferSpec(wb.SourceMap.from_indices(ids), dtype) for n, ids in bufs.items()})


W = np.arange(64 * 48, dtype=np.int64).reshape(64, 48)  # one [out, in] weight
N = np.arange(48, dtype=np.int64) + W.size  # a norm


def test_tp_to_tp_with_transposes_fsdp_and_replicas_matches_oracle():
    trainers = [  # JAX-style transposed column shards (2 replicas), and an FSDP flat shard pair
        lay(0, "t0", "trainer", {"w": W[:32].T, "n": N}),
        lay(1, "t0", "trainer", {"w": W[32:].T}),
        lay(2, "t1", "trainer", {"flat": np.concatenate([W.reshape(-1), N])[:1000]}),
        lay(3, "t1", "trainer", {"flat": np.concatenate([W.reshape(-1), N])[1000:]}),
    ]
    rollouts = [  # TP=3 row-parallel column shards, twice (2 replicas), plus replicated norm
        lay(4 + r, f"n{r // 3}", "rollout", {"w": W[:, 16 * (r % 3):16 * (r % 3 + 1)], "n": N})
        for r in range(6)
    ]
    corr = correspond(trainers, rollouts)
    assert overlap_pairs(corr) == correspondence_pairs(trainers, rollouts)
    # every rollout element appears in exactly one cell per holder region that holds it
    assert corr.cell_numel.sum() <= W.size + N.size


def test_reference_backends_jax_trainer_to_torch_rollout():
    jax = pytest.importorskip("jax")
    pytest.importorskip("torch")
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 emulated devices")
    import wb_jax
    import wb_torch
    from wb.layouts.presets import TINY, spec_from_config
    from wb_jax.testing import checkpoint_arrays, make_load_fn, make_mesh
    from wb_torch.testing import TinyRollout

    spec = spec_from_config(TINY)
    load = make_load_fn(TINY, make_mesh(2, 2))
    jmaps = wb_jax.probe(load, spec)
    per_dev = wb_jax.device_maps(load(checkpoint_arrays(spec)), jmaps)
    trainers = [wb.Layout(wb.Worker(rank=i, node="trainer0", role="trainer", local_rank=i),
                          {k: wb.BufferSpec(sm, dt) for k, (sm, dt) in bufs.items()})
                for i, bufs in enumerate(per_dev.values())]
    rollouts = []
    for replica in range(2):
        for tp_rank in range(2):
            maps = wb_torch.probe(TinyRollout(TINY, tp_rank=tp_rank, tp_size=2), spec)
            rollouts.append(wb.Layout(
                wb.Worker(rank=4 + 2 * replica + tp_rank, node=f"rollout{replica}", role="rollout",
                          local_rank=tp_rank),
                {k: wb.BufferSpec(sm, "bfloat16") for k, sm in maps.items() if sm.n_ids}))
    corr = correspond(trainers, rollouts)
    assert overlap_pairs(corr) == correspondence_pairs(trainers, rollouts)


def test_missing_id_names_rollout_buffer_and_first_id():
    trainers = [lay(0, "t", "trainer", {"w": W[:, :40]})]
    rollouts = [lay(1, "r", "rollout", {"ok": W[:, :8]}),
                lay(2, "r", "rollout", {"qkv": np.concatenate([W[:4, 30:46], W[8:10, 30:46]])})]
    with pytest.raises(wb.PlanError, match=r"rollouts\[1\] \(rank 2\) needs 36 elements of buffer `qkv`.*first missing id 40\)"):
        correspond(trainers, rollouts)


def test_dtype_clash_beyond_a_float_conversion_is_refused():
    trainers = [lay(0, "t", "trainer", {"w": W}, dtype="float32")]
    rollouts = [lay(1, "r", "rollout", {"w": W[:3]}, dtype="int32")]
    with pytest.raises(wb.PlanError, match="`w` is int32 but the trainers hold its id 0 as "
                                           "float32; wb converts only between float dtypes"):
        correspond(trainers, rollouts)


def test_trainers_holding_one_id_in_two_dtypes_are_refused():
    trainers = [lay(0, "t", "trainer", {"w": W}, dtype="float32"),
                lay(1, "t", "trainer", {"w": W[:2]}, dtype="bfloat16")]
    with pytest.raises(wb.PlanError, match="hold id 0 both as float32 and as bfloat16"):
        correspond(trainers, [lay(2, "r", "rollout", {"w": W[:3]})])


def test_needs_in_two_travelling_dtypes_split_the_cell():
    trainers = [lay(0, "t", "trainer", {"w": W}, dtype="float32")]
    rollouts = [lay(1, "r0", "rollout", {"w": W[:4]}, dtype="bfloat16"),
                lay(2, "r1", "rollout", {"w": W[:4]}, dtype="float32"),
                lay(3, "r2", "rollout", {"w": W[:4]}, dtype="float64")]
    corr = correspond(trainers, rollouts)
    assert overlap_pairs(corr) == correspondence_pairs(trainers, rollouts)
    from wb.data.dtypes import CODES
    role = corr.slot_role[corr.inc_slot]
    for c in np.unique(corr.inc_cell[role == 1]):
        needs = [corr.slots[s].rank for s in corr.inc_slot[(corr.inc_cell == c) & (role == 1)]]
        # bfloat16 travels as bfloat16; float32 and float64 needs share the float32 copy
        assert (CODES[corr.cell_dtype[c]], sorted(needs)) in (("bfloat16", [1]),
                                                              ("float32", [2, 3]))
        assert ((corr.inc_cell == c) & (role == 0)).sum() == 1  # the holder is in every copy


def test_layouts_in_the_wrong_list_are_refused():
    t = lay(0, "t", "trainer", {"w": W})
    with pytest.raises(wb.PlanError, match=r"rollouts\[0\] is a layout of a trainer"):
        correspond([t], [t])
