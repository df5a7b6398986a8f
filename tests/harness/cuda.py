"""The CUDA child process of ``tests/test_transfer_cuda.py``: wb_torch.Sender -> wb_torch.Receiver.

Imports without CUDA (and without torch): the framework imports are inside the child, which the
test spawns only when a GPU is present.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

__all__ = ["cuda_sender_receiver_child", "cupy_or_skip"]


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


def cuda_sender_receiver_child(rank: int, store_dir: str, result_dir: str, options: dict) -> None:
    """wb_torch.Sender (rank 0) -> wb_torch.Receiver (rank 1) on CUDA tensors (spawned): a small
    bf16 model, ``versions`` updates (``w <- -2 w`` in place), the receiver checked after each.

    Args:
        rank: 0 (the sender) or 1 (the receiver).
        store_dir: directory of the :class:`wb.runtime.rendezvous.DirectoryStore` both ranks share.
        result_dir: where ``{rank}.json`` is written (``ok``, ``checks``, ``same_ptr``, ``error``).
        options: ``{"staging": bool, "versions": int}``.
    """
    import torch

    import wb
    import wb_torch
    from wb.runtime.rendezvous import DirectoryStore
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
        plan = wb.agree_plan(store, [lay], world=2)
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
