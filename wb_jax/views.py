"""``jax.Array`` s that are wb's own CUDA memory, made without a copy: :func:`array_of`.

``jax.dlpack.from_dlpack`` costs ~44 us per array on a GPU (an H100, measured; ~160 us on the
2-core CPU machine), most of it around the one call that makes the array: it looks the backend
and device up again and asks the device for a stream to order the producer's work behind, every
time. A JAX rollout makes one array per leaf per version (dozens), so :func:`array_of` calls
JAX's own conversion directly (~12 us per array on the GPU, ~55 us on the CPU machine), with no
stream: wb's memory is fully written when it is handed over. Where this JAX's internals differ,
or the array it gives is not exactly the memory asked for, it uses ``jax.dlpack.from_dlpack``
(logged once).
"""

from __future__ import annotations

import logging
from typing import Any

import jax

from wb.runtime.engine import dlpack

__all__ = ["array_of"]

log = logging.getLogger(__name__)

_direct: Any = None  # JAX's conversion (None: not looked up yet; False: not usable here)


def _conversion():
    """JAX's DLPack-to-array call of the signature this module passes, or ``False``."""
    global _direct
    if _direct is None:
        try:
            from jax._src.lib import _jax, jaxlib_extension_version

            _direct = _jax.dlpack_managed_tensor_to_buffer if jaxlib_extension_version >= 467 \
                else False
        except (ImportError, AttributeError):
            _direct = False
    return _direct


def _give_up(why: str) -> None:
    global _direct
    _direct = False
    log.info("jax arrays of wb's memory go through jax.dlpack.from_dlpack from now on (%s)", why)


def array_of(buf: dlpack.Export, device: Any) -> jax.Array:
    """``buf`` (wb's memory, fully written) as a ``jax.Array`` on ``device``, no copy: what
    ``jax.dlpack.from_dlpack(buf, device=device, copy=False)`` gives.

    Examples:
        >>> from wb.runtime.engine.buffers import aligned_empty
        >>> a = aligned_empty((4,), "float32")  # XLA takes 64-byte aligned memory as it is
        >>> a[:] = range(4)
        >>> x = array_of(dlpack.export(a, "float32", dlpack.Holds()), jax.devices("cpu")[0])
        >>> x.tolist()
        [0.0, 1.0, 2.0, 3.0]
    """
    convert = _conversion()
    if convert:
        try:
            arr = convert(buf.__dlpack__(), device, None, False, buf.device[0])
        except Exception as e:  # noqa: BLE001 - another JAX: the public call from now on
            _give_up(f"{type(e).__name__}: {e}")
        else:  # 64-bit values without x64 fall through: the public call converts them
            if arr.dtype == jax.dtypes.canonicalize_dtype(arr.dtype):
                if arr.unsafe_buffer_pointer() == buf.ptr and arr.shape == buf.shape:
                    return arr
                _give_up("the array JAX made is not the memory given")
    return jax.dlpack.from_dlpack(buf, device=device, copy=False)
