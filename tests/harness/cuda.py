"""The CUDA child process of ``tests/test_transfer_cuda.py``: wb_torch.Sender -> wb_torch.Receiver.

Imports without CUDA (and without torch): the framework imports are inside the child, which the
test spawns only when a GPU is present.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

__all__ = ["cuda_sender_receiver_child", "cuda_jax_receiver_child", "cupy_or_skip", "run_pair"]


def cupy_or_skip():
    """CuPy, or a skip of the calling test module when CuPy or a CUDA device is missing."""
    import pytest

    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError
    except Exception:  # noqa: BLE001 - no driver, no device: the same answer
        pytest.skip("no CUDA device", allow_module_level=True)
    return cupy


def run_pair(child, tmp_path, options: dict, timeout: float = 240) -> list[dict]:
    """Spawns ``child(rank, store_dir, result_dir, options)`` for ranks 0 and 1 and returns
    their results (``{rank}.json``), each with ``ok``."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    (tmp_path / "res").mkdir()
    ps = [ctx.Process(target=child, args=(r, str(tmp_path / "store"), str(tmp_path / "res"),
                                          options))
          for r in range(2)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(timeout)
    return [json.loads((tmp_path / "res" / f"{r}.json").read_text()) for r in range(2)]


def cuda_sender_receiver_child(rank: int, store_dir: str, result_dir: str, options: dict) -> None:
    """wb_torch.Sender (rank 0) -> wb_torch.Receiver (rank 1) on CUDA tensors (spawned): a small
    bf16 model, ``versions`` updates (``w <- -2 w`` in place), the receiver checked after each.

    Args:
        rank: 0 (the sender) or 1 (the receiver).
        store_dir: directory of the :class:`wb.runtime.transport.stores.DirectoryStore` both ranks share.
        result_dir: where ``{rank}.json`` is written (``ok``, ``checks``, ``same_ptr``, ``error``).
        options: ``{"staging": bool, "versions": int}``.
    """
    import torch

    import wb
    import wb_torch
    from wb.runtime.transport.stores import DirectoryStore
    from wb.runtime.transport.ucx import UcxTransport

    result: dict = {"rank": rank, "checks": [], "same_ptr": []}
    try:
        spec = wb.CheckpointSpec({"a": ((256, 512), "bfloat16"), "b": ((300,), "float32")})
        torch.manual_seed(0)
        full = {n: torch.randn(spec.shape(n)).to(getattr(torch, spec.dtype(n))).cuda()
                for n in spec.names}
        workers = [wb.Worker(0, "t0", "trainer"), wb.Worker(1, "r0", "rollout")]
        me = workers[rank]
        params = {n: (t.clone() if rank == 0 else torch.zeros_like(t)) for n, t in full.items()}
        (lay,) = wb_torch.checkpoint_layouts(params, spec, me.rank, node=me.node,
                                             role=me.role.value)
        store = DirectoryStore(store_dir)
        plan = wb.agree_parts(store, [lay], world=2)
        kw = dict(store=store, staging=options["staging"], timeout=60,
                  transports=UcxTransport(rank, store, cuda_device=0))
        if rank == 0:
            tx = wb_torch.Sender(params, plan, 0, **kw)
            for _ in range(options["versions"]):
                with torch.no_grad():
                    for t in params.values():
                        t.mul_(-2)
                torch.cuda.synchronize()
                tx.push()
            tx.close()
        else:
            ptrs = {n: t.data_ptr() for n, t in params.items()}
            rx = wb_torch.Receiver(params, plan, 1, **kw)
            for v in range(1, options["versions"] + 1):
                assert rx.apply() is params and rx.version == v
                result["checks"].append(all(torch.equal(params[n], full[n] * (-2) ** v)
                                            for n in spec.names))
                result["same_ptr"].append(all(params[n].data_ptr() == ptrs[n] for n in ptrs))
            rx.close()
        result["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test
        result.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
    Path(result_dir, f"{rank}.json").write_text(json.dumps(result))


def _heavy(x):
    """Long GPU work reading ``x`` (~tens of ms on an H200): hundreds of dependent matmuls."""
    import jax
    import jax.numpy as jnp

    f = x.astype(jnp.float32) * 1e-2
    return jax.lax.fori_loop(0, 400, lambda i, y: jnp.tanh(y @ f), f)


def cuda_jax_receiver_child(rank: int, store_dir: str, result_dir: str, options: dict) -> None:
    """A CuPy ``wb.Sender`` (rank 0) -> a ``wb_jax.Receiver`` on a GPU (rank 1), spawned: the
    receiver's versions land in recycled sets of wb's memory, handed to JAX without a copy.

    The receiver keeps version 1's params through versions 2 and 3 (they must never be written
    again), drops them, and takes version 4 (it must land in a freed set: no new memory); it
    starts long GPU work on version 4's params, takes version 5, drops version 4 while the work
    may still run, and takes version 6, which lands in version 4's set if JAX has let it go:
    the work must see version 4's values whole (wb never writes memory JAX still reads).

    Args:
        rank, store_dir, result_dir: as :func:`cuda_sender_receiver_child`.
        options: ``{"staging": bool}`` (both ends).
    """
    import numpy as np

    import wb
    from wb.data.dtypes import dtype_info
    from wb.runtime.transport.stores import DirectoryStore
    from wb.runtime.transport.ucx import UcxTransport

    versions = 6
    result: dict = {"rank": rank}
    try:
        spec = wb.CheckpointSpec({"a": ((1024, 1024), "bfloat16"), "b": ((300,), "float32")})
        rng = np.random.default_rng(0)
        full = {n: rng.standard_normal(spec.shape(n)).astype(
            dtype_info(spec.dtype(n)).numpy) for n in spec.names}

        def values(v):  # version v's weights: exact in bf16 (powers of two)
            return {n: (a.astype(np.float32) * (-2.0) ** v).astype(a.dtype)
                    for n, a in full.items()}

        store = DirectoryStore(store_dir)
        kw = dict(store=store, staging=options["staging"], timeout=60)
        transport = UcxTransport(rank, store, cuda_device=0)
        if rank == 0:
            import cupy

            lay = wb.Layout(wb.Worker(0, "t0", "trainer"), {
                n: wb.BufferSpec(wb.SourceMap.from_indices(spec.ids(n)), spec.dtype(n))
                for n in spec.names})
            plan = wb.agree_parts(store, [lay], world=2)
            bufs = {n: cupy.asarray(a.view(np.uint16) if a.dtype.itemsize == 2 and
                                    spec.dtype(n) == "bfloat16" else a)
                    for n, a in full.items()}
            tx = wb.Sender(plan, 0, bufs, transport=transport, **kw)
            for v in range(1, versions + 1):
                if v in (4, 6):  # after the receiver let go of older versions (with receiver
                    store.get(f"go/{v}", 120)  # staging it takes memory as a version comes)
                for n, a in values(v).items():
                    bufs[n][...] = cupy.asarray(a.view(np.uint16) if spec.dtype(n) == "bfloat16"
                                                else a)
                cupy.cuda.runtime.deviceSynchronize()
                tx.push()
                tx.wait()
            tx.close()
        else:
            import jax
            import jax.numpy as jnp

            import wb_jax
            from wb.runtime.engine.buffers import address

            dev = jax.devices("gpu")[0]
            params = {n: jax.device_put(jnp.zeros(a.shape, a.dtype), dev)
                      for n, a in full.items()}
            (lay,) = wb_jax.checkpoint_layouts(params, spec, 1, node="r0", role="rollout")
            plan = wb.agree_parts(store, [lay], world=2)
            rx = wb_jax.Receiver(params, plan, 1, transports=transport, **kw)
            (worker,) = rx.workers.values()
            key = "['a']"  # the buffer of leaf "a"

            def take(v):
                p = rx.apply()
                got = {n: np.asarray(p[n]) for n in spec.names}
                want = values(v)
                ok = all(np.array_equal(got[n].view(np.uint8), want[n].view(np.uint8))
                         for n in spec.names)
                # zero-copy: the array JAX hands back is the memory wb wrote
                same = p["a"].unsafe_buffer_pointer() == address(worker.buffers[key])
                return p, ok, same

            p1, ok1, z1 = take(1)
            p2, ok2, z2 = take(2)
            p3, ok3, z3 = take(3)
            kept = np.asarray(p1["a"])
            where = {p1["a"].unsafe_buffer_pointer(), p2["a"].unsafe_buffer_pointer()}
            result["kept_v1_intact"] = bool(np.array_equal(
                kept.view(np.uint8), values(1)["a"].view(np.uint8)))
            result["three_sets"] = len(worker._target.sets) == 3
            del p1, p2
            store.set("go/4", b"1")
            p4, ok4, z4 = take(4)
            where4 = p4["a"].unsafe_buffer_pointer()
            result["v4_reused_a_freed_set"] = where4 in where
            result["sets_after_v4"] = len(worker._target.sets)
            y = _heavy(p4["a"])  # queued on the GPU, reading version 4's memory...
            p5, ok5, z5 = take(5)
            del p4  # ... which JAX may now release: version 6 lands in its set
            store.set("go/6", b"1")
            p6, ok6, z6 = take(6)
            result["v6_in_v4s_set"] = p6["a"].unsafe_buffer_pointer() == where4
            want4 = np.asarray(_heavy(jax.device_put(jnp.asarray(values(4)["a"]), dev)))
            result["work_saw_v4_whole"] = bool(np.array_equal(np.asarray(y), want4))
            result["checks"] = [ok1, ok2, ok3, ok4, ok5, ok6]
            result["zero_copy"] = [z1, z2, z3, z4, z5, z6]
            del p3, p5, p6
            rx.close()
        result["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test
        result.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
    Path(result_dir, f"{rank}.json").write_text(json.dumps(result))
