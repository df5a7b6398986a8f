"""DLPack, read with ctypes: any array that exports ``__dlpack__`` (numpy, PyTorch, JAX, CuPy), on
the host or on a CUDA device, viewed without copying and without importing its framework.

:func:`read` takes the capsule an array exports, reads the ``DLTensor`` it points to (device,
data pointer, shape, strides, dtype) and returns a :class:`Tensor`; :func:`host_view` and
:func:`cuda_view` make a numpy or CuPy array of the same memory, which keeps the capsule (and so
the producer's memory) alive as long as the view lives. The capsule is never marked consumed: its
own destructor then releases the producer's tensor, as the DLPack protocol has it.

bfloat16 and float8 are read as :mod:`ml_dtypes` dtypes on the host; on a CUDA device, where CuPy
has no such dtypes, as unsigned integers of the same width (the executor moves raw bits).
"""

from __future__ import annotations

import ctypes
import math
import types
from typing import Any, NamedTuple

import numpy as np

from wb.data.dtypes import dtype_info
from wb.errors import TransferError

__all__ = ["Tensor", "read", "host_view", "cuda_view", "HOST", "CUDA", "RAW_BITS"]

#: DLPack device types whose memory the host reads (CPU, CUDA pinned host memory).
HOST = (1, 3)
#: DLPack device types of CUDA device memory (device, managed).
CUDA = (2, 13)
#: dtypes numpy knows only through ml_dtypes and CuPy not at all: moved as raw bits.
RAW_BITS = ("bfloat16", "float8_e4m3fn", "float8_e5m2")

# DLDataTypeCode -> wb dtype name, by (code, bits) (DLPack 1.1's dlpack.h)
_DTYPES = types.MappingProxyType({
    (0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64",
    (1, 8): "uint8", (1, 16): "uint16", (1, 32): "uint32", (1, 64): "uint64",
    (2, 16): "float16", (2, 32): "float32", (2, 64): "float64",
    (4, 16): "bfloat16", (6, 8): "bool",
    (10, 8): "float8_e4m3fn", (12, 8): "float8_e5m2",
})


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class Tensor(NamedTuple):
    """What a DLPack capsule says about an array's memory."""

    device_type: int  # DLPack device type (1 CPU, 2 CUDA, 3 CUDA host, 13 CUDA managed, ...)
    device_id: int
    ptr: int  # address of element 0 (data + byte_offset)
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None  # in elements; None: C-contiguous
    dtype: str  # a wb dtype name
    owner: Any  # the capsule: keeps the producer's memory alive

    @property
    def contiguous(self) -> bool:
        """Whether the elements are one dense C-order block."""
        if self.strides is None:
            return True
        want = 1
        for n, s in zip(reversed(self.shape), reversed(self.strides)):
            if n != 1 and s != want:
                return False
            want *= n
        return True


def read(x: Any, name: str = "buffer") -> Tensor:
    """The :class:`Tensor` of an array that exports ``__dlpack__``.

    Args:
        x: the array.
        name: what to call it in errors.

    Returns:
        The capsule's device, pointer, shape, strides and dtype.

    Raises:
        TransferError: the export fails, or its dtype is not one wb moves.

    Examples:
        >>> t = read(np.arange(6, dtype=np.float32).reshape(2, 3))
        >>> t.device_type, t.shape, t.dtype, t.contiguous
        (1, (2, 3), 'float32', True)
    """
    try:
        capsule = x.__dlpack__()
    except Exception as e:  # noqa: BLE001 - any export failure is the caller's type problem
        raise TransferError(f"`{name}` ({type(x).__name__}) could not be exported through "
                            f"DLPack: {e}") from e
    try:
        t = _DLTensor.from_address(_get_pointer(capsule, b"dltensor"))
    except (ValueError, TypeError) as e:
        raise TransferError(f"`{name}` exported a DLPack capsule wb cannot read ({e})") from e
    key = (t.dtype.code, t.dtype.bits)
    if key not in _DTYPES or t.dtype.lanes != 1:
        raise TransferError(f"`{name}` has DLPack dtype code {t.dtype.code}, {t.dtype.bits} bits, "
                            f"{t.dtype.lanes} lanes, which wb does not move")
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    strides = (tuple(int(t.strides[i]) for i in range(t.ndim)) if t.strides else None)
    return Tensor(int(t.device.device_type), int(t.device.device_id),
                  int(t.data or 0) + int(t.byte_offset), shape, strides, _DTYPES[key], capsule)


class _Interface:
    """Exposes memory through numpy's or CUDA's array interface, keeping its owner alive."""

    def __init__(self, attr: str, interface: dict, owner: Any):
        setattr(self, attr, interface)
        self.owner = owner


def _interface(t: Tensor, typestr: str, itemsize: int) -> dict:
    return {"shape": t.shape, "typestr": typestr, "data": (t.ptr, False), "version": 3,
            "strides": None if t.strides is None else tuple(s * itemsize for s in t.strides)}


def host_view(t: Tensor) -> np.ndarray:
    """A numpy array of host memory ``t`` describes (bfloat16 / float8 as ml_dtypes dtypes)."""
    dt = np.dtype(dtype_info(t.dtype).numpy)
    raw = f"|V{dt.itemsize}" if t.dtype in RAW_BITS else dt.str
    if math.prod(t.shape) == 0:
        return np.empty(t.shape, dt)
    a = np.asarray(_Interface("__array_interface__", _interface(t, raw, dt.itemsize), t.owner))
    return a if a.dtype == dt else a.view(dt)


def cuda_view(t: Tensor, cupy: Any) -> Any:
    """A CuPy array of the CUDA memory ``t`` describes, on its own device (bfloat16 / float8 as
    same-width unsigned integers)."""
    dt = np.dtype(dtype_info(t.dtype).numpy)
    typestr = np.dtype(f"u{dt.itemsize}").str if t.dtype in RAW_BITS else dt.str
    iface = _interface(t, typestr, dt.itemsize)
    iface["stream"] = None  # the producer's work was ordered by __dlpack__
    with cupy.cuda.Device(t.device_id):
        return cupy.asarray(_Interface("__cuda_array_interface__", iface, t.owner))
