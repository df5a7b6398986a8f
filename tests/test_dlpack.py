"""wb.runtime.engine.dlpack and as_array: any DLPack array, viewed without a copy, its metadata checked."""

import gc

import ml_dtypes
import numpy as np
import pytest

import wb
from wb.runtime.engine import dlpack
from wb.runtime.engine.buffers import as_array, check_buffers
from wb.data.dtypes import canonical_dtype

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
         "int64": torch.int64, "uint8": torch.uint8, "bool": torch.bool,
         "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("dtype", list(TORCH))
def test_torch_cpu_tensors_are_viewed_in_place_with_their_dtype(dtype):
    t = torch.arange(12).reshape(3, 4).to(TORCH[dtype])
    xp, a = as_array("w", t, rank=0)
    assert xp is np and a.shape == (3, 4) and a.ctypes.data == t.data_ptr()
    assert canonical_dtype(a.dtype) == dtype
    np.testing.assert_array_equal(a.astype(np.float32), t.float().numpy())
    a[2, 3] = a[0, 1]  # the same memory, both ways
    assert t[2, 3].item() == t[0, 1].item()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_and_numpy_arrays_are_viewed_too(dtype):
    x = jax.device_put(np.arange(6).reshape(2, 3).astype(dtype), jax.devices("cpu")[0])
    t = dlpack.read(x)
    assert (t.device_type, t.shape, t.dtype) == (1, (2, 3), dtype)
    np.testing.assert_array_equal(dlpack.host_view(t).astype(np.float32), np.arange(6.).reshape(2, 3))
    assert dlpack.read(np.ones(4, np.float16)).dtype == "float16"
    with pytest.raises(wb.TransferError, match="DLPack"):  # numpy cannot export ml_dtypes
        dlpack.read(np.ones(4, ml_dtypes.bfloat16))
    xp, a = as_array("b", np.ones(4, ml_dtypes.bfloat16), rank=0)  # numpy: taken as it is
    assert xp is np and a.dtype == ml_dtypes.bfloat16


def test_a_view_keeps_the_producers_memory_alive():
    t = torch.arange(1 << 20, dtype=torch.float32)
    _, a = as_array("w", t, rank=0)
    del t
    gc.collect()
    assert a[-1] == (1 << 20) - 1


def test_strides_come_from_the_metadata_and_non_contiguous_buffers_are_refused():
    t = torch.arange(12.).reshape(3, 4)[:, 1:3]
    d = dlpack.read(t)
    assert d.strides == (4, 1) and not d.contiguous
    np.testing.assert_array_equal(dlpack.host_view(d), t.numpy())
    lay = wb.Layout(wb.Worker(0, "n", "trainer"),
                    {"w": wb.BufferSpec(wb.SourceMap.from_indices(np.arange(6).reshape(3, 2)),
                                        "float32")})
    with pytest.raises(wb.TransferError, match="C-contiguous"):
        check_buffers(lay, {"w": t})
    flat, xp = check_buffers(lay, {"w": t.contiguous()})
    assert xp is np and flat["w"].shape == (6,)


def test_shape_and_dtype_mismatches_are_refused_from_the_metadata():
    lay = wb.Layout(wb.Worker(0, "n", "trainer"),
                    {"w": wb.BufferSpec(wb.SourceMap.from_indices(np.arange(6)), "bfloat16")})
    with pytest.raises(wb.TransferError, match="is float32, the plan needs bfloat16"):
        check_buffers(lay, {"w": torch.zeros(6)})
    with pytest.raises(wb.TransferError, match=r"shape \(5,\)"):
        check_buffers(lay, {"w": torch.zeros(5, dtype=torch.bfloat16)})
    flat, _ = check_buffers(lay, {"w": torch.zeros(6, dtype=torch.bfloat16)})
    assert flat["w"].dtype == ml_dtypes.bfloat16


def test_a_tensor_that_requires_grad_is_refused_with_the_fix():
    with pytest.raises(wb.TransferError, match="DLPack"):
        as_array("w", torch.zeros(3, requires_grad=True), rank=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_cuda_tensors_and_jax_gpu_arrays_are_viewed_on_their_device(dtype):
    cupy = pytest.importorskip("cupy")
    t = torch.arange(12, device="cuda").reshape(3, 4).to(TORCH[dtype])
    xp, a = as_array("w", t, rank=0)
    assert xp is cupy and a.data.ptr == t.data_ptr() and a.shape == (3, 4)
    assert a.dtype.itemsize == t.element_size()
    src = t.view(torch.uint8 if t.element_size() == 1 else torch.int16 if t.element_size() == 2
                 else torch.int32)
    assert cupy.asnumpy(a).tobytes() == src.cpu().numpy().tobytes()
    gpu = [d for d in jax.devices() if d.platform == "gpu"]
    if gpu and dtype != "float8_e4m3fn":
        x = jax.device_put(jax.numpy.arange(6, dtype=dtype), gpu[0])
        xp, a = as_array("x", x, rank=0)
        assert xp is cupy and a.shape == (6,) and a.dtype.itemsize == x.dtype.itemsize


def test_capsules_are_released_while_the_interpreter_exits(monkeypatch):
    """A consumer may let go of wb's memory after this module's globals were cleared (arrays
    alive at exit): the deleters still release what they held, raising nothing."""
    import sys

    from wb.runtime.engine import dlpack

    raised = []
    monkeypatch.setattr(sys, "unraisablehook", raised.append)
    a = np.arange(6, dtype=np.float32)
    holds = dlpack.Holds()
    taken = np.from_dlpack(dlpack.export(a, "float32", holds))  # consumed: the deleter runs
    never = dlpack.export(a, "float32", holds).__dlpack__()  # unconsumed: the destructor runs
    assert holds.count == 2
    for name in ("_DLManagedTensor", "_decref", "_capsule_valid", "_capsule_pointer",
                 "_delete"):
        monkeypatch.setattr(dlpack, name, None)  # as module teardown leaves them
    monkeypatch.setattr(dlpack, "ctypes", None)
    del taken, never
    assert holds.count == 0 and raised == []
