"""Device probe: making jax.Arrays of wb's CUDA memory, public path against a cached one."""
import time, sys
import numpy as np, cupy, jax, jax.numpy as jnp
sys.path.insert(0, ".")  # run from the repository root
from wb.runtime.engine import dlpack
from jax._src.lib import _jax, jaxlib_extension_version
from jax._src import xla_bridge
print("jax", jax.__version__, "ext", jaxlib_extension_version)
dev = jax.devices()[0]
bufs = [cupy.zeros((2048, 2048) if i % 3 else (2048,), cupy.uint16) for i in range(60)]
h = dlpack.Holds()
def t(name, fn, reps=7):
    best = 1e9
    for _ in range(reps):
        exps = [dlpack.export(b, "bfloat16", h) for b in bufs]
        t0 = time.perf_counter(); out = fn(exps); best = min(best, time.perf_counter() - t0)
        del out
    print(f"{name}: {best*1e3:.3f} ms for 60 ({best/60*1e6:.1f} us each)")
t("public from_dlpack(Export, device)", lambda es: [jax.dlpack.from_dlpack(e, device=dev, copy=False) for e in es])
backend = xla_bridge.get_backend("cuda")
ddev = backend.device_from_local_hardware_id(0)
stream = ddev.get_stream_for_external_ready_events()
t("get_stream x60", lambda es: [ddev.get_stream_for_external_ready_events() for e in es])
t("capsules x60", lambda es: [e.__dlpack__(stream=stream) for e in es])
def direct(es):
    return [_jax.dlpack_managed_tensor_to_buffer(e.__dlpack__(stream=stream), ddev, stream, False, 2) for e in es]
out = direct([dlpack.export(b, "bfloat16", h) for b in bufs[:2]])
print(type(out[0]), out[0].dtype, out[0].shape, out[0].unsafe_buffer_pointer() == bufs[0].data.ptr, isinstance(out[0], jax.Array))
t("direct cached stream", direct)
def direct_none(es):
    return [_jax.dlpack_managed_tensor_to_buffer(e.__dlpack__(), ddev, None, False, 2) for e in es]
t("direct stream None", direct_none)
x = jnp.ones(4); x.block_until_ready()
