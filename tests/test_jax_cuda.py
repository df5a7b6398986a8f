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
