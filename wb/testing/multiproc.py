"""Run a plan across spawned processes over UCX: the harness of multi-process tests and benchmarks.

The parent saves the plan (``Plan.save``); every child loads it, builds its buffers, runs
:func:`wb.executor.execute` over :class:`wb.transport.ucx.UcxTransport` with a
:class:`wb.rendezvous.DirectoryStore`, checks its rollout buffers bit for bit, and writes a JSON
result. Trainer weights are a fixed function of each element's id (:func:`weight_bits`), so every
process can make and check them without shipping arrays. Faults can be injected per rank.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["weight_bits", "buffers_for", "Fault", "run_ranks", "child_main"]


def weight_bits(ids: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Deterministic, finite weight values of checkpoint ids (-1 -> 0), as ``dtype``.

    Bits are a hash of the id with the exponent field kept away from inf/nan.
    """
    item = np.dtype(dtype).itemsize
    h = (ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(17)
    if item == 2:
        bits = (h & np.uint64(0x3FFF)).astype(np.uint16) | np.uint16(0x3C00)
        out = bits.view(dtype)
    elif item == 4:
        bits = (h & np.uint64(0x3FFFFFFF)).astype(np.uint32)
        out = bits.view(dtype)
    elif item == 1:
        out = (h & np.uint64(0x3F)).astype(np.uint8).view(dtype)
    else:
        out = (h & np.uint64(0x3FFFFFFFFFFFFFFF)).astype(np.uint64).view(dtype)
    return np.where(ids >= 0, out, np.zeros((), dtype))


def buffers_for(plan, rank: int, *, fill: bool) -> dict[str, np.ndarray]:
    """This rank's buffers: trainer weights (``fill``) or zeros, in the layouts' dtypes."""
    from wb.dtypes import dtype_info

    lay = next(lay for lay in (*plan.trainers, *plan.rollouts) if lay.worker.rank == rank)
    out = {}
    for name, b in lay.buffers.items():
        dt = dtype_info(b.dtype).numpy
        out[name] = (weight_bits(b.sourcemap.to_indices(), dt) if fill
                     else np.zeros(b.shape, dt))
    return out


@dataclass
class Fault:
    """What to break on one rank: die or hang after ``after`` sends, give it a different plan, or
    a buffer of the wrong shape."""

    die_after: int | None = None
    hang_after: int | None = None
    other_plan: str | None = None  # path of another plan file
    bad_buffer: str | None = None  # name of a buffer to give the wrong shape


class _FaultyTransport:
    def __init__(self, inner, fault: Fault):
        self.inner, self.fault, self.sends = inner, fault, 0
        self.rank = inner.rank

    def connect(self, peers, *, hello=b""):
        return self.inner.connect(peers, hello=hello)

    def send(self, peer, buf, tag):
        f = self.fault
        if f.die_after is not None and self.sends >= f.die_after:
            os._exit(17)  # a crash: no goodbye to anyone
        if f.hang_after is not None and self.sends >= f.hang_after:
            time.sleep(3600)
        self.sends += 1
        return self.inner.send(peer, buf, tag)

    def recv(self, peer, buf, tag):
        return self.inner.recv(peer, buf, tag)

    def describe(self):
        return self.inner.describe()

    def close(self, **kw):
        return self.inner.close(**kw)

    def abort(self):
        return self.inner.abort()


def child_main(rank: int, plan_path: str, store_dir: str, result_dir: str, options: dict) -> None:
    """One worker process (spawned)."""
    from wb.errors import TransferError
    from wb.executor import execute
    from wb.plan import Plan
    from wb.rendezvous import DirectoryStore
    from wb.transport.ucx import UcxTransport

    fault = Fault(**options.get("fault", {}))
    result: dict = {"rank": rank}
    try:
        plan = Plan.load(fault.other_plan or plan_path)
        trainer = any(lay.worker.rank == rank for lay in plan.trainers)
        bufs = buffers_for(plan, rank, fill=trainer)
        if fault.bad_buffer:
            bufs[fault.bad_buffer] = np.zeros(3, bufs[fault.bad_buffer].dtype)
        transport = UcxTransport(rank, DirectoryStore(store_dir), tls=options.get("tls"),
                                 timeout=options.get("timeout", 60.0))
        if fault.die_after is not None or fault.hang_after is not None:
            transport = _FaultyTransport(transport, fault)
        t0 = time.time()
        stats = execute(plan, rank, bufs, transport, timeout=options.get("timeout", 60.0),
                        staging_bytes=options.get("staging_bytes", 256 << 20))
        result.update(asdict(stats), ok=True, connect_s=stats.start_s - t0)
        if not trainer:
            want = buffers_for(plan, rank, fill=True)
            result["bit_identical"] = all(
                np.array_equal(bufs[k].view(np.uint8), want[k].view(np.uint8)) for k in bufs)
    except TransferError as e:
        result.update(ok=False, error=str(e), kind="TransferError")
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test
        result.update(ok=False, error=f"{type(e).__name__}: {e}", kind=type(e).__name__,
                      trace=traceback.format_exc())
    Path(result_dir, f"{rank}.json").write_text(json.dumps(result))


@dataclass
class Run:
    results: dict[int, dict]
    exitcodes: dict[int, int | None]
    wall_s: float
    extra: dict = field(default_factory=dict)


def run_ranks(plan_path: str, ranks: list[int], workdir: str, *, options: dict | None = None,
              faults: dict[int, dict] | None = None, join_timeout: float = 120.0) -> Run:
    """Spawns one process per rank, waits (killing any still alive after ``join_timeout``)."""
    ctx = mp.get_context("spawn")
    store_dir, result_dir = Path(workdir, "store"), Path(workdir, "results")
    store_dir.mkdir(parents=True, exist_ok=True)
    result_dir.mkdir(parents=True, exist_ok=True)
    procs = {}
    t0 = time.time()
    for r in ranks:
        opts = dict(options or {})
        if faults and r in faults:
            opts["fault"] = faults[r]
        procs[r] = ctx.Process(target=child_main, args=(r, plan_path, str(store_dir),
                                                        str(result_dir), opts), daemon=True)
        procs[r].start()
    deadline = t0 + join_timeout
    for p in procs.values():
        p.join(max(0.0, deadline - time.time()))
    for p in procs.values():
        if p.is_alive():
            p.kill()
            p.join(5)
    results = {}
    for r in ranks:
        f = result_dir / f"{r}.json"
        results[r] = json.loads(f.read_text()) if f.exists() else None
    return Run(results, {r: p.exitcode for r, p in procs.items()}, time.time() - t0)
