"""A block-scaled FP8 deployment for tests: trainers sharded at block multiples (or not), rollouts
cut anywhere, values per version, and the reference FP8 checkpoint each rollout must end up with."""

from __future__ import annotations

import faulthandler
import json
import traceback
from pathlib import Path

import numpy as np

import wb
from wb.data.fp8 import FP8Blocks
from wb.data.dtypes import convert, dtype_info
from wb.testing.oracle import quantize_reference


def lay(rank, node, role, bufs, local_rank=0):
    return wb.Layout(wb.Worker(rank, node, role, local_rank),
                     {k: wb.BufferSpec(wb.SourceMap.from_indices(np.asarray(v)), d)
                      for k, (v, d) in bufs.items()})


def values(spec: wb.CheckpointSpec, seed: int) -> dict[str, np.ndarray]:
    """Trainer values: normal with a wide spread of magnitudes per row, some all-zero blocks."""
    rng = np.random.default_rng(seed)
    out = {}
    for n, (shape, dt) in spec.items():
        x = rng.standard_normal(shape) * np.exp(rng.uniform(-12, 4, shape[:1] + (1,) * (len(shape) - 1)))
        x[rng.random(shape) < 0.05] = 0
        a = np.empty(shape, dtype_info(dt).numpy)
        convert(a, x)
        out[n] = a
    return out


def fp8_checkpoint(scaled, vals: dict[str, np.ndarray]) -> np.ndarray:
    """The FP8 checkpoint (reference quantiser) as one float64 array indexed by FP8-spec id."""
    ck = dict(vals)
    for t, n in enumerate(scaled.names):
        ck[n], ck[scaled.scale_name(t)] = quantize_reference(vals[n], scaled.decl.block)
    return np.concatenate([np.asarray(ck[n]).astype(np.float64).reshape(-1) for n in scaled.spec])


def trainer_buffers(layout: wb.Layout, spec, vals) -> dict[str, np.ndarray]:
    """A trainer's buffers holding ``vals`` (``{name: array}`` of ``spec``)."""
    return expected(layout, np.concatenate([vals[n].astype(np.float64).reshape(-1) for n in spec]))


def expected(layout: wb.Layout, flat: np.ndarray) -> dict[str, np.ndarray]:
    """A layout's buffers holding ``flat[id]`` at each mapped element (0 elsewhere)."""
    out = {}
    for k, b in layout.buffers.items():
        ids = b.sourcemap.to_indices()
        a = np.empty(b.shape, dtype_info(b.dtype).numpy)
        convert(a, np.where(ids >= 0, flat[np.maximum(ids, 0)], 0.0))
        out[k] = a
    return out


def deployment(block=(4, 8), split=False):
    """Two trainer replicas of two TP ranks (rows of `w` at block multiples, or with ``split``
    at row 6, inside a block; `u` whole on one), three rollouts on two nodes: FP8 weights cut
    anywhere (one transposed), scales, a norm."""
    spec = wb.CheckpointSpec({"w": ((12, 24), "bfloat16"), "norm": ((24,), "float32"),
                              "u": ((10, 16), "bfloat16")})
    scaled = FP8Blocks(("w", "u"), block=block).bind(spec)
    ids = {n: spec.ids(n).reshape(spec.shape(n)) for n in spec}
    f = {n: scaled.spec.ids(n).reshape(scaled.spec.shape(n)) for n in scaled.spec}
    trainers = []
    cut = 6 if split else 8
    for rep in range(2):
        trainers += [lay(2 * rep, f"t{rep}", "trainer", {"w": (ids["w"][:cut], "bfloat16"),
                                                        "norm": (ids["norm"], "float32")}),
                     lay(2 * rep + 1, f"t{rep}", "trainer", {"w": (ids["w"][cut:], "bfloat16"),
                                                            "u": (ids["u"], "bfloat16")},
                         local_rank=1)]
    fp8 = "float8_e4m3fn"
    rollouts = [
        lay(4, "r0", "rollout", {"w": (f["w"][:, :13], fp8), "ws": (f["w_scale_inv"], "float32"),
                                 "norm": (f["norm"], "bfloat16")}),
        lay(5, "r0", "rollout", {"w": (f["w"][:, 13:].T, fp8), "u": (f["u"][3:], fp8),
                                 "us": (f["u_scale_inv"], "float32")}, local_rank=1),
        lay(6, "r1", "rollout", {"w": (f["w"], fp8), "ws": (f["w_scale_inv"], "float32"),
                                 "u": (f["u"], fp8), "us": (f["u_scale_inv"], "float32")}),
    ]
    return spec, scaled, trainers, rollouts


def child(rank: int, plan_path: str, quantized, spec, own, store_dir: str, result_dir: str,
          options: dict) -> None:
    """One worker of a multi-version FP8 run through wb.Sender / wb.Receiver (spawned); ``own``:
    a trainer's layout as it holds its weights (the plan's has the declared ids taken out)."""
    faulthandler.enable()
    from wb.runtime.transport.stores import DirectoryStore
    from wb.runtime.transport.ucx import UcxTransport

    result: dict = {"rank": rank, "checks": []}
    try:
        cuda = options.get("cuda")  # every buffer on that GPU (CuPy), else numpy
        if cuda is not None:
            import cupy

            from wb.runtime.engine.casts import xp_dtype

            cupy.cuda.Device(cuda).use()

            def dev(a, dtype):
                return cupy.asarray(a.view(f"u{a.itemsize}")).view(xp_dtype(cupy, dtype))
        else:
            def dev(a, dtype):
                return a
        plan = wb.Plan.load(plan_path)
        layout = plan.layout_of(rank)
        store = DirectoryStore(store_dir)
        kw = dict(transport=UcxTransport(rank, store, timeout=30, cuda_device=cuda), store=store,
                  timeout=30, wait_timeout=30)
        versions = options["versions"]
        if layout.worker.role == "trainer":
            bufs = {k: dev(a, own.buffers[k].dtype)
                    for k, a in trainer_buffers(own, spec, values(spec, 0)).items()}
            tx = wb.Sender(plan, rank, bufs, staging=options["sender_staging"],
                           quantize=quantized, **kw)
            for v in range(1, versions + 1):
                for k, a in trainer_buffers(own, spec, values(spec, v)).items():
                    bufs[k][...] = dev(a, own.buffers[k].dtype)  # the training step
                tx.push()
            tx.close()
            result["bytes_sent"] = [st.bytes_sent for st in tx.stats]
        else:
            bufs = {k: dev(np.zeros(b.shape, dtype_info(b.dtype).numpy), b.dtype)
                    for k, b in layout.buffers.items()}
            rx = wb.Receiver(plan, rank, bufs, staging=options["receiver_staging"], **kw)
            for _ in range(versions):
                v = rx.apply()
                want = expected(layout, fp8_checkpoint(quantized.scaled, values(spec, v)))
                host = {k: a if cuda is None else cupy.asnumpy(a) for k, a in bufs.items()}
                bad = [k for k in bufs if host[k].tobytes() != want[k].tobytes()]
                result["checks"].append(not bad)
                result.setdefault("mismatched", []).append(bad)
            rx.close()
        result["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test
        result.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
    Path(result_dir, f"{rank}.json").write_text(json.dumps(result))
