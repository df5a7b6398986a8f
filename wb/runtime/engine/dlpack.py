"""DLPack, read with ctypes: any array that exports ``__dlpack__`` (numpy, PyTorch, JAX, CuPy), on
the host or on a CUDA device, viewed without copying and without importing its framework.

:func:`read` takes the capsule an array exports, reads the ``DLTensor`` it points to (device,
data pointer, shape, strides, dtype) and returns a :class:`Tensor`; :func:`host_view` and
:func:`cuda_view` make a numpy or CuPy array of the same memory, which keeps the capsule (and so
the producer's memory) alive as long as the view lives. The capsule is never marked consumed: its
own destructor then releases the producer's tensor, as the DLPack protocol has it.

:func:`export` goes the other way: memory of wb's own handed to a framework (``jax.dlpack.
from_dlpack``, ``torch.from_dlpack``, ``np.from_dlpack``), which makes its array of the same
memory; a :class:`Holds` counts the capsules a consumer still holds, so wb knows when the
framework has freed every array made of it and the memory may be written again.

bfloat16 and float8 are read as :mod:`ml_dtypes` dtypes on the host; on a CUDA device, where CuPy
has no such dtypes, as unsigned integers of the same width (the executor moves raw bits).
"""

from __future__ import annotations

import ctypes
import math
import threading
import types
from typing import Any, NamedTuple

import numpy as np

from wb.data.dtypes import dtype_info
from wb.errors import TransferError

__all__ = ["Tensor", "read", "host_view", "cuda_view", "cuda_dtype", "Holds", "Export", "export", "HOST",
           "CUDA", "RAW_BITS"]

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


def cuda_dtype(dtype: str) -> np.dtype:
    """The numpy dtype CuPy holds a wb dtype as: itself, or for bfloat16 and float8 (which CuPy
    lacks) the unsigned integer of the same width.

    >>> cuda_dtype("bfloat16"), cuda_dtype("float32")
    (dtype('uint16'), dtype('float32'))
    """
    dt = np.dtype(dtype_info(dtype).numpy)
    return np.dtype(f"u{dt.itemsize}") if dtype in RAW_BITS else dt


def cuda_view(t: Tensor, cupy: Any) -> Any:
    """A CuPy array of the CUDA memory ``t`` describes, on its own device (bfloat16 / float8 as
    same-width unsigned integers)."""
    dt = np.dtype(dtype_info(t.dtype).numpy)
    iface = _interface(t, cuda_dtype(t.dtype).str, dt.itemsize)
    iface["stream"] = None  # the producer's work was ordered by __dlpack__
    with cupy.cuda.Device(t.device_id):
        return cupy.asarray(_Interface("__cuda_array_interface__", iface, t.owner))


# --- exporting wb's own memory ----------------------------------------------------------------
_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", _DELETER)]


_CODES = types.MappingProxyType({name: key for key, name in _DTYPES.items()})
_NAME = ctypes.create_string_buffer(b"dltensor")  # a capsule keeps a pointer to its name
# prototypes of their own (ctypes.pythonapi's function objects are shared: setting their
# argtypes here would change read()'s PyCapsule_GetPointer); the destructor gets the capsule as
# an address
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_void_p)(("PyCapsule_New", ctypes.pythonapi))
_capsule_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))

_incref = ctypes.pythonapi.Py_IncRef
_decref = ctypes.pythonapi.Py_DecRef


# The deleters below take what they use as default arguments: a consumer may release its arrays
# while the interpreter exits, after this module's globals were cleared.
@_DELETER
def _delete(addr: int, _struct=_DLManagedTensor, _cast=ctypes.cast, _obj=ctypes.py_object,
            _dec=_decref) -> None:
    """The DLManagedTensor's deleter: the consumer is done with the memory (called once). Its
    ``manager_ctx`` is a reference to ``(struct, shape array, owner, holds)``, taken when the
    capsule was made (the consumer holds only the struct's address): dropped here, last."""
    entry = _cast(_struct.from_address(addr).manager_ctx, _obj)
    entry.value[3].drop()
    _dec(entry)


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(capsule: int, _valid=_capsule_valid, _pointer=_capsule_pointer,
                        _release=_delete) -> None:
    # a consumer renames the capsule it takes ("used_dltensor") and calls the deleter itself
    # when done; a capsule still named "dltensor" was never consumed: release it here
    if _valid(capsule, b"dltensor"):
        _release(_pointer(capsule, b"dltensor"))


class Holds:
    """How many exported capsules a consumer still holds (thread-safe: consumers release from
    their own threads). ``count`` 0: nothing made of the memory is alive any more."""

    def __init__(self):
        self._lock = threading.Lock()
        self.count = 0
        self.exported = 0  # capsules made in all

    def add(self) -> None:
        with self._lock:
            self.count += 1
            self.exported += 1

    def drop(self) -> None:
        with self._lock:
            self.count -= 1


class Export:
    """Memory as DLPack consumers take it (``__dlpack__``, ``__dlpack_device__``): every
    ``__dlpack__`` call makes a capsule that ``holds`` (if given) counts until the consumer
    releases it (or the capsule dies unconsumed); ``owner`` is kept alive meanwhile. Made by
    :func:`export` for wb's own memory; a shim may also describe a framework's array this way
    when it knows its address cheaply (wb then reads it without a capsule: :meth:`tensor`).

    Attributes:
        ptr: the address of element 0; shape, dtype (a wb dtype name), device: ``(DLPack device
            type, device id)``; owner: what keeps the memory alive; holds: a :class:`Holds` or
            ``None``.
    """

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: str, device: tuple[int, int],
                 owner: Any, holds: Holds | None = None):
        self.ptr, self.shape, self.dtype = int(ptr), tuple(int(n) for n in shape), dtype
        self.device, self.owner, self.holds = (int(device[0]), int(device[1])), owner, holds

    def tensor(self) -> Tensor:
        """What a capsule of it would say (C-contiguous), without making one."""
        return Tensor(*self.device, self.ptr, self.shape, None, self.dtype, self)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: bool | None = None) -> Any:
        # stream: wb's writes are finished before memory is exported, so nothing to order;
        # max_version: a legacy (unversioned) capsule, which every consumer takes
        del stream, max_version
        if copy:
            raise BufferError("wb exports its own memory without copying (copy=True asked)")
        if dl_device is not None and tuple(dl_device) != self.device:
            raise BufferError(f"wb's memory is on DLPack device {self.device}, not {dl_device}")
        code, bits = _CODES[self.dtype]
        shape = (ctypes.c_int64 * max(len(self.shape), 1))(*self.shape)
        m = _DLManagedTensor()
        m.dl_tensor.data = self.ptr or None
        m.dl_tensor.device = _DLDevice(*self.device)
        m.dl_tensor.ndim = len(self.shape)
        m.dl_tensor.dtype = _DLDataType(code, bits, 1)
        m.dl_tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        m.dl_tensor.strides = None  # C-contiguous
        m.dl_tensor.byte_offset = 0
        m.deleter = _delete
        entry = (m, shape, self.owner, self.holds or Holds())  # alive until the deleter runs
        _incref(ctypes.py_object(entry))
        m.manager_ctx = id(entry)
        entry[3].add()
        return _capsule_new(ctypes.addressof(m), ctypes.addressof(_NAME),
                            ctypes.cast(_capsule_destructor, ctypes.c_void_p))


def export(buf: Any, dtype: str, holds: Holds) -> Export:
    """A C-contiguous numpy or CuPy array of wb's, as an :class:`Export` of ``dtype`` (a wb
    dtype name: bfloat16 and float8 held as same-width integers on a GPU are exported as what
    they are).

    Args:
        buf: the memory (kept alive while any capsule made of it is held).
        dtype: the dtype consumers see (the same width as ``buf``'s elements).
        holds: counts the capsules consumers hold.

    Returns:
        The export (no memory is copied).

    Raises:
        TransferError: ``buf`` is not C-contiguous, or ``dtype`` is not one DLPack names or not
            ``buf``'s width.

    Examples:
        >>> h = Holds()
        >>> a = np.arange(6, dtype=np.float32).reshape(2, 3)
        >>> b = np.from_dlpack(export(a, "float32", h))
        >>> bool(np.shares_memory(a, b)), h.count
        (True, 1)
        >>> del b
        >>> h.count
        0
    """
    if dtype not in _CODES or dtype_info(dtype).itemsize != buf.dtype.itemsize:
        raise TransferError(f"cannot export a {buf.dtype} array as {dtype!r} through DLPack")
    if not buf.flags.c_contiguous:
        raise TransferError("wb exports C-contiguous arrays only")
    if isinstance(buf, np.ndarray):
        return Export(int(buf.ctypes.data), buf.shape, dtype, (1, 0), buf, holds)
    return Export(int(buf.data.ptr), buf.shape, dtype, (2, int(buf.device.id)), buf, holds)
