"""Device probe: JAX memory exportability and the cost of making jax.Arrays of wb's memory."""
import time, ctypes, sys
import numpy as np, cupy, jax, jax.numpy as jnp
sys.path.insert(0, ".")  # run from the repository root
from wb.runtime.transport.memory import CudaMemory
from wb.runtime.engine import dlpack
print("jax", jax.__version__, jax.devices())
dev = jax.devices()[0]
mem = CudaMemory(0)
xs = [jnp.ones((n,), jnp.bfloat16) + i for i, n in enumerate([1024, 4096, 1 << 20, 1 << 22, 16, 3 << 20])]
for x in xs:
    x.block_until_ready()
    p = x.unsafe_buffer_pointer()
    d = mem._describe(p)
    try:
        h = cupy.cuda.runtime.ipcGetMemHandle(p); err = "ok"
    except Exception as e:
        err = repr(e)[:120]
    print("jax array", x.nbytes, hex(p), "describe", d and (hex(d[0]), d[1]), "ipc", err, "export", mem.export(dlpack.Export(p, x.shape, "bfloat16", x.__dlpack_device__(), x)) is not None)
# attributes that make views of device memory
from jax._src.lib import xla_client as xc
names = [n for n in dir(xc._xla) if "view" in n.lower() or "dlpack" in n.lower()]
print("xla_client._xla:", names)
cl = dev.client
print("client:", [n for n in dir(cl) if "view" in n.lower() or "dlpack" in n.lower() or "buffer" in n.lower()])
# from_dlpack cost, 40 leaves
bufs = [cupy.zeros((2048, 2048) if i % 3 else (2048,), cupy.uint16) for i in range(40)]
exps = [dlpack.export(b, "bfloat16", dlpack.Holds()) for b in bufs]
def t(name, fn, reps=5):
    best = 1e9
    for _ in range(reps):
        t0 = time.perf_counter(); out = fn(); best = min(best, time.perf_counter() - t0)
    print(f"{name}: {best*1e3:.3f} ms for 40 ({best/40*1e6:.1f} us each)")
    return out
t("Export.__dlpack__ only", lambda: [e.__dlpack__() for e in exps])
t("jax.dlpack.from_dlpack(Export)", lambda: [jax.dlpack.from_dlpack(e, device=dev, copy=False) for e in exps])
t("jax.dlpack.from_dlpack(Export) no device", lambda: [jax.dlpack.from_dlpack(e) for e in exps])
t("jax.dlpack.from_dlpack(cupy)", lambda: [jax.dlpack.from_dlpack(b) for b in bufs])
for n in names:
    print("xla fn", n, getattr(xc._xla, n).__doc__)
if hasattr(cl, "create_view_of_device_buffer"):
    t("client.create_view_of_device_buffer", lambda: [cl.create_view_of_device_buffer(b.data.ptr, b.shape, np.dtype('uint16'), dev, None) for b in bufs])
import inspect
try:
    src = inspect.getsource(jax.dlpack.from_dlpack)
    print(src[:3000])
    from jax._src import dlpack as jd
    print(inspect.getsource(jd._from_dlpack)[:3000] if hasattr(jd, "_from_dlpack") else [n for n in dir(jd)])
except Exception as e:
    print("src", e)
