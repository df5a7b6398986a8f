"""Two processes (or two threads of one) trading messages through UcxTransport's one-sided channel
(:mod:`wb.runtime.transport.ipc`): random sizes and offsets, some from memory that cannot go
one-sided, receives posted before and after the sends, every byte checked."""

from __future__ import annotations

import json
import multiprocessing as mp
import threading
import time
from pathlib import Path

import numpy as np


def messages(count: int, seed: int = 0):
    """``count`` messages ``(offset at the sender, offset at the receiver, nbytes, from host)``,
    each a range of its own at both ends; sizes from 1 byte to 4 MiB."""
    rng = np.random.default_rng(seed)
    sizes = np.where(rng.random(count) < 0.3, rng.integers(1, 4096, count),
                     rng.integers(1, 4 << 20, count))
    host = rng.random(count) < 0.1
    src = np.concatenate([[0], np.cumsum(sizes + rng.integers(0, 64, count))[:-1]])
    order = rng.permutation(count)  # the receiver's ranges in another order
    dst = np.empty(count, np.int64)
    dst[order] = np.concatenate([[0], np.cumsum(sizes[order] + 16)[:-1]])
    return [(int(a), int(b), int(n), bool(h)) for a, b, n, h in zip(src, dst, sizes, host)]


def pattern(xp, n: int, seed: int):
    return xp.asarray(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


def side(rank: int, store_dir: str, *, ipc: str, count: int, cuda: int | None,
         late: bool, seed: int = 0) -> dict:
    """One side: rank 0 sends every message, rank 1 receives them; receives posted before the
    sends (``late=False``) or a while after. Returns the bytes' check and the channel's counts."""
    from wb.runtime.engine.inflight import DeviceBytes
    from wb.runtime.transport.stores import DirectoryStore
    from wb.runtime.transport.ucx import UcxTransport

    xp = np
    if cuda is not None:
        import cupy as xp

        xp.cuda.Device(cuda).use()
    msgs = messages(count, seed)
    span = max(a + n for a, _, n, _ in msgs) + 64
    t = UcxTransport(rank, DirectoryStore(store_dir), session="ipc", timeout=30,
                     cuda_device=cuda, ipc=ipc)
    t.connect([1 - rank])
    if rank == 0:
        dev, host = pattern(xp, span, seed), pattern(np, span, seed)
    else:
        size = max(b + n for _, b, n, _ in msgs) + 64
        dev, host = xp.zeros(size, np.uint8), np.zeros(size, np.uint8)

    def view(buf, at, n):
        if xp is not np and buf is dev:
            return DeviceBytes(buf, at, n)
        return buf[at:at + n]

    if rank == 1 and late:
        time.sleep(0.5)  # the notes arrive first, and wait for their receives
    reqs = []
    for k, (a, b, n, h) in enumerate(msgs):
        buf = host if h else dev
        reqs.append(t.send(1, view(buf, a, n), 100 + k) if rank == 0
                    else t.recv(0, view(buf, b, n), 100 + k))
    deadline = time.monotonic() + 60
    while reqs:
        reqs = [r for r in reqs if not r.done()]
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: {len(reqs)} messages not done")
    out = {"counts": dict(t._ipc.counts) if t._ipc is not None else None}
    if rank == 1:
        if xp is not np:
            xp.cuda.runtime.deviceSynchronize()
        want_dev, want_host = pattern(np, span, seed), pattern(np, span, seed)
        got_dev = dev.get() if xp is not np else dev
        out["exact"] = all(np.array_equal((host if h else got_dev)[b:b + n],
                                          (want_host if h else want_dev)[a:a + n])
                           for a, b, n, h in msgs)
    t.close()
    return out


def _child(rank, store_dir, result_dir, kw):
    try:
        res = side(rank, store_dir, **kw)
    except Exception as e:  # noqa: BLE001 - reported to the test
        res = {"error": f"{type(e).__name__}: {e}"}
    Path(result_dir, f"{rank}.json").write_text(json.dumps(res))


def run_pair(workdir: str, *, threads: bool = False, **kw) -> list[dict]:
    """Both sides, as two spawned processes (or two threads of this one); their results."""
    store_dir, result_dir = Path(workdir, "store"), Path(workdir, "res")
    store_dir.mkdir(parents=True, exist_ok=True)
    result_dir.mkdir(parents=True, exist_ok=True)
    if threads:
        ws = [threading.Thread(target=_child, args=(r, str(store_dir), str(result_dir), kw))
              for r in range(2)]
    else:
        ctx = mp.get_context("spawn")
        ws = [ctx.Process(target=_child, args=(r, str(store_dir), str(result_dir), kw),
                          daemon=True) for r in range(2)]
    for w in ws:
        w.start()
    for w in ws:
        w.join(120)
    out = [Path(result_dir, f"{r}.json") for r in range(2)]
    return [json.loads(f.read_text()) if f.exists() else {"error": "no result"} for f in out]
