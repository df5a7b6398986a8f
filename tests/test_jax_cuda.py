"""JAX on GPUs: the demo's processes with every side on the GPU (JAX arrays and PyTorch tensors
sharing it), bit-identical after every update and zero-copy on both ends: each buffer wb reads
(a JAX trainer's device shards) or writes (the arrays a JAX rollout's new params are made of) has
the framework array's own address. Skips without a GPU, CuPy, UCX or a CUDA build of JAX."""

import importlib.metadata

import pytest

from harness.cuda import cupy_or_skip

cupy_or_skip()
pytest.importorskip("ucxx")
if not any(d.metadata["Name"].lower().startswith(("jax-cuda", "jax_cuda"))
           for d in importlib.metadata.distributions()):
    pytest.skip("JAX has no CUDA plugin here", allow_module_level=True)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("trainer,rollout", [("jax", "torch"), ("torch", "jax"), ("jax", "jax")])
def test_jax_on_the_gpu_feeds_and_is_fed_zero_copy(trainer, rollout):
    from wb.cli.demo.runner import run_processes

    out = run_processes(trainer, rollout, replicas=1, tp=1, modes=["sync", "both"], steps=2,
                        train_s=0.05, gen_s=0.005, cuda=True)
    assert not out.get("errors"), out.get("errors")
    for mode, m in out["modes"].items():
        # checks: rollout buffers compared bit for bit (and, for JAX rollouts and every
        # trainer, the addresses of the buffers wb moved); none may fail
        assert m["verified"] and m["checks"] > 0 and m["mismatches"] == 0, (mode, m)
    assert out["transfers_verified"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("staging", [True, False])
def test_a_jax_rollout_receives_into_recycled_memory_without_a_copy(tmp_path, staging):
    """wb_jax.Receiver on a GPU: versions land in wb's own memory, which JAX arrays are made of
    (same address); arrays the caller keeps are never written again, freed sets are reused, and
    work JAX queued on a version it then dropped sees that version whole."""
    from harness.cuda import cuda_jax_receiver_child, run_pair

    res = run_pair(cuda_jax_receiver_child, tmp_path, {"staging": staging})
    assert all(r["ok"] for r in res), res
    rx = res[1]
    assert rx["checks"] == [True] * 6 and rx["zero_copy"] == [True] * 6, rx
    assert rx["kept_v1_intact"] and rx["three_sets"], rx
    assert rx["v4_reused_a_freed_set"] and rx["sets_after_v4"] == 3, rx
    # (whether version 6 went into version 4's set depends on when JAX lets go of memory that
    # queued work reads: at once, or once the work is done; either way the work saw version 4)
    assert rx["work_saw_v4_whole"], rx
    print("version 6 landed in version 4's set:", rx["v6_in_v4s_set"])
