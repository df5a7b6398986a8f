"""A worker's buffers as the runtime takes them: numpy, CuPy or any DLPack array, host or CUDA, checked
against the plan before any byte moves, viewed without copying, copied on their own device.

Every function here is shared by the executor (which checks and flattens a rank's buffers once
per update, or once for all updates with the same arrays) and by the Sender / Receiver (which
check at set-up, keep the live buffers and make staging copies of them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from wb.data.dtypes import canonical_dtype, dtype_info
from wb.data.layout import Layout
from wb.errors import TransferError
from wb.runtime.engine import dlpack

__all__ = ["as_array", "address", "check_buffers", "fixed_memory", "copy", "copy_of",
           "settle", "aligned_empty"]


def as_array(name: str, buf: Any, *, rank: int) -> tuple[Any, Any]:
    """``(array module, array)`` of any array wb takes, without copying.

    Args:
        name: the buffer's name (for the error message).
        buf: a numpy or CuPy array; any array that exports DLPack (``__dlpack__``: PyTorch, JAX,
            CuPy, numpy, ...), on the host or a CUDA device, read by :mod:`wb.runtime.engine.dlpack`
            without importing its framework; else a CUDA array (``__cuda_array_interface__``) or
            anything ``np.asarray`` takes.
        rank: the worker's rank (for the error message).

    Returns:
        ``(numpy, ndarray)`` for host memory (bfloat16 / float8 as ml_dtypes dtypes),
        ``(cupy, cupy.ndarray)`` on the buffer's own device for CUDA memory (bfloat16 / float8 as
        same-width unsigned integers); both share memory with ``buf``.

    Raises:
        TransferError: ``buf`` is in CUDA memory and CuPy is not installed, lives on a device
            wb does not move, or its DLPack export fails (a tensor that requires grad: detach it).

    Examples:
        >>> xp, a = as_array("w", np.zeros(3, np.float32), rank=0)
        >>> xp is np, a.shape
        (True, (3,))
    """
    if isinstance(buf, np.ndarray):
        return np, buf
    t = type(buf)
    if t.__name__ == "ndarray" and t.__module__.startswith("cupy"):
        import cupy

        return cupy, buf  # never cupy.asarray: it copies to the thread's current device
    if hasattr(buf, "__dlpack__") and hasattr(buf, "__dlpack_device__"):
        kind = int(buf.__dlpack_device__()[0])
        # an Export says what its capsule would, without one (a JAX array's __dlpack__ costs
        # ~0.3 ms on a GPU: per buffer per update, as JAX makes new arrays every step)
        read = (buf.tensor if isinstance(buf, dlpack.Export)
                else lambda: dlpack.read(buf, f"rank {rank}: buffer `{name}`"))
        if kind in dlpack.HOST:
            return np, dlpack.host_view(read())
        if kind in dlpack.CUDA:
            return _cupy(name, rank), dlpack.cuda_view(read(), _cupy(name, rank))
        raise TransferError(f"rank {rank}: buffer `{name}` is on DLPack device type {kind}; wb "
                            f"moves host and CUDA memory")
    if hasattr(buf, "__cuda_array_interface__"):  # a CUDA array without DLPack
        cupy = _cupy(name, rank)
        ptr = int(buf.__cuda_array_interface__["data"][0])
        dev = cupy.cuda.runtime.pointerGetAttributes(ptr).device if ptr else None
        if dev is None or dev < 0:
            return cupy, cupy.asarray(buf)
        with cupy.cuda.Device(dev):  # from its own device, not the thread's current one
            return cupy, cupy.asarray(buf)
    return np, np.asarray(buf)


def address(buf: Any) -> int:
    """The address of ``buf``'s first element, as wb sees it (host or device memory): two arrays
    with the same address share memory, so tests check zero-copy hand-offs with it.

    Args:
        buf: any array :func:`as_array` takes.

    Returns:
        The address (0 for an empty array).

    Examples:
        >>> a = np.zeros(4, np.float32)
        >>> address(a[1:]) - address(a)
        4
    """
    xp, a = as_array("buffer", buf, rank=-1)
    return int(a.ctypes.data) if xp is np else int(a.data.ptr)


def _cupy(name: str, rank: int):
    try:
        import cupy
    except ImportError as e:
        raise TransferError(f"rank {rank}: buffer `{name}` is in CUDA memory; moving it needs "
                            f"CuPy (pip install cupy-cuda12x / cupy-cuda13x)") from e
    return cupy


def check_buffers(mine: Layout, buffers: Mapping[str, Any], *,
                  layout: Layout | None = None) -> tuple[dict[str, Any], Any]:
    """Checks a worker's buffers against its layout in the plan; flattens them (no copy).

    Args:
        mine: the worker's layout in the plan (``part.layout``).
        buffers: ``{name: array}`` (see :func:`as_array`); every buffer of ``mine`` must be there.
        layout: the worker's own layout as it probed it: refused if the plan's differs.

    Returns:
        ``({name: 1-D view}, array module)``: the module is ``numpy``, or CuPy when every buffer
        is a CUDA array.

    Raises:
        TransferError: a buffer is missing, has another shape or dtype, or is not C-contiguous,
            or ``layout`` is not the plan's (before any byte moves).
    """
    rank = mine.worker.rank
    if layout is not None:
        if set(layout.buffers) != set(mine.buffers) or any(
                layout.buffers[n].sourcemap != b.sourcemap or layout.buffers[n].dtype != b.dtype
                for n, b in mine.buffers.items()):
            raise TransferError(
                f"rank {rank}: the plan was made for different layouts than this worker's "
                f"(buffers or source maps differ); plan again with every worker's current layout")
    flat: dict[str, Any] = {}
    xps = set()
    for name, spec in mine.buffers.items():
        if name not in buffers:
            raise TransferError(f"rank {rank}: buffer `{name}` of the plan was not given "
                                f"(given: {sorted(buffers)[:5]}...)")
        xp, a = as_array(name, buffers[name], rank=rank)
        if tuple(a.shape) != spec.shape:
            raise TransferError(f"rank {rank}: buffer `{name}` has shape {tuple(a.shape)}, the "
                                f"plan needs {spec.shape}; refusing before any byte moves")
        try:
            dt = canonical_dtype(a.dtype)
        except Exception:  # noqa: BLE001 - an unknown dtype is simply a mismatch
            dt = str(a.dtype)
        if dt != spec.dtype and not _raw_bits_ok(xp, a.dtype, spec.dtype):
            raise TransferError(f"rank {rank}: buffer `{name}` is {dt}, the plan needs "
                                f"{spec.dtype}; refusing before any byte moves")
        if not a.flags.c_contiguous:
            raise TransferError(f"rank {rank}: buffer `{name}` must be C-contiguous")
        flat[name] = a.reshape(-1)
        xps.add(xp)
    return flat, (xps.pop() if len(xps) == 1 else np)


def _raw_bits_ok(xp, dtype, want: str) -> bool:
    """CUDA arrays of bf16/fp8 travel as same-width integers (CuPy has no such dtypes, and torch's
    ``__cuda_array_interface__`` refuses them): accept exactly that case, nothing else."""
    return (xp is not np and want in dlpack.RAW_BITS and np.dtype(dtype).kind in "ui"
            and np.dtype(dtype).itemsize == dtype_info(want).itemsize)


def fixed_memory(a: Any) -> bool:
    """Whether ``a`` is a numpy or CuPy array: its data cannot move to other memory while the
    object lives (a framework tensor's storage can be swapped under the same object)."""
    t = type(a)
    return t is np.ndarray or (t.__name__ == "ndarray" and t.__module__.startswith("cupy"))


def copy(xp, dst, src) -> None:
    """``dst[...] = src`` on ``dst``'s own device, finished when this returns."""
    if xp is np:
        np.copyto(dst, src)
    else:
        with dst.device:  # CuPy's current device is per thread
            dst[...] = src
            xp.cuda.get_current_stream().synchronize()


def copy_of(live: Mapping[str, tuple[Any, Any]]) -> dict[str, Any]:
    """A copy of ``{name: (array module, array)}`` (each on its own device): staging for a
    transfer, which writes only the elements the plan maps, while the others (padding, elements
    no checkpoint id reaches) must keep their live values."""
    out = {}
    for n, (xp, a) in live.items():
        if xp is np:
            out[n] = np.empty_like(a)
        else:
            with a.device:  # on the buffer's own device, whatever this thread's is
                out[n] = xp.empty_like(a)
        copy(xp, out[n], a)
    return out


def settle(live: Mapping[str, tuple[Any, Any]]) -> None:
    """Waits until every device of ``{name: (array module, array)}`` has finished the work
    queued on it (by any stream of this process: a framework's, which wb cannot name)."""
    devices = {int(a.device.id): xp for xp, a in live.values() if xp is not np}
    for dev, xp in devices.items():
        with xp.cuda.Device(dev):
            xp.cuda.runtime.deviceSynchronize()


def aligned_empty(shape, dtype: str, *, align: int = 64) -> np.ndarray:
    """An uninitialised host array whose data starts on an ``align``-byte boundary (XLA's CPU
    client aliases such arrays instead of copying them).

    Args:
        shape: the array's shape.
        dtype: a dtype name of :mod:`wb.data.dtypes` (``"bfloat16"``, ``"float32"``, ...).
        align: the alignment of the first element, in bytes.

    Returns:
        The array (contents undefined).

    Examples:
        >>> a = aligned_empty((3, 5), "float32")
        >>> a.shape, a.ctypes.data % 64
        ((3, 5), 0)
    """
    dt = np.dtype(dtype_info(dtype).numpy)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    raw = np.empty(n + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + n].view(dt).reshape(shape)
