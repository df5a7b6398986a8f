"""Raw UCX send of 256 MiB between two processes on one GPU, buffers from cupy / jax / torch."""
import json, os, sys, time, tempfile, multiprocessing as mp
N = 256 << 20

def child(rank, kind, d, q, fresh):
    if kind == "jaxplat":
        os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] = "platform"
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    import numpy as np, cupy as cp
    from wb.runtime.rendezvous import DirectoryStore
    from wb.runtime.transport.ucx import UcxTransport
    from wb.runtime.buffers import as_array
    info = {}
    def make():
        if kind.startswith("jax"):
            import jax, jax.numpy as jnp
            info["platform"] = jax.devices()[0].platform
            a = jnp.full((N,), rank + 1, dtype=jnp.uint8, device=jax.devices()[0]).block_until_ready()
            return a, as_array("x", a, rank=rank)[1]
        if kind == "torch":
            import torch
            a = torch.full((N,), rank + 1, dtype=torch.uint8, device="cuda:0")
            return a, as_array("x", a, rank=rank)[1]
        a = cp.full(N, rank + 1, dtype=cp.uint8)
        return a, a
    keep = []
    owner, view = make(); keep.append(owner)
    try:
        cp.cuda.runtime.ipcGetMemHandle(view.data.ptr); info["ipc"] = True
    except Exception as e:
        info["ipc"] = repr(e)[:120]
    store = DirectoryStore(d)
    t = UcxTransport(rank, store, cuda_device=0, session=f"m{kind}{fresh}")
    t.connect([1 - rank])
    times = []
    for i in range(6):
        if fresh and i:
            owner, view = make(); keep.append(owner)
        store.set(f"b{kind}{fresh}/{i}/{rank}", b"1"); store.get(f"b{kind}{fresh}/{i}/{1-rank}", 60)
        t0 = time.perf_counter()
        req = (t.send if rank == 0 else t.recv)(1 - rank, view, 100 + i)
        while not req.done():
            pass
        times.append(round(time.perf_counter() - t0, 5))
    ok = bool((view[:16] == 1).all()) if rank == 1 else True
    t.close()
    q.put((rank, kind, fresh, info, times, ok))

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    for kind in sys.argv[1:]:
        for fresh in (0, 1):
            d = tempfile.mkdtemp(); q = ctx.Queue()
            ps = [ctx.Process(target=child, args=(r, kind, d, q, fresh)) for r in (0, 1)]
            [p.start() for p in ps]
            out = [q.get(timeout=180) for _ in ps]
            [p.join(30) for p in ps]
            print(json.dumps(sorted(out)), flush=True)
