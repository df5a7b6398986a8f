"""Element dtypes by name: numpy dtype, size, and the largest integer each holds exactly.

Names follow PyTorch/JAX spelling (``"bfloat16"``, ``"float8_e4m3fn"``). numpy has no bfloat16 or
float8, so those come from ``ml_dtypes``, the same package JAX uses.
"""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np

from wb.errors import SpecError

__all__ = ["DType", "dtype_info", "canonical_dtype", "known_dtype"]


class DType(NamedTuple):
    name: str
    numpy: np.dtype
    itemsize: int  # bytes per element
    exact_int_max: int  # every integer in [0, exact_int_max] is representable exactly


def _float_exact(mantissa_bits: int) -> int:
    # A float with m explicit mantissa bits holds every integer up to 2**(m+1) exactly.
    return 2 ** (mantissa_bits + 1)


_TABLE: dict[str, DType] = {}
for _name, _np, _exact in [
    ("float64", np.dtype(np.float64), _float_exact(52)),
    ("float32", np.dtype(np.float32), _float_exact(23)),
    ("float16", np.dtype(np.float16), _float_exact(10)),
    ("bfloat16", np.dtype(ml_dtypes.bfloat16), _float_exact(7)),
    ("float8_e4m3fn", np.dtype(ml_dtypes.float8_e4m3fn), _float_exact(3)),
    ("float8_e5m2", np.dtype(ml_dtypes.float8_e5m2), _float_exact(2)),
    ("int64", np.dtype(np.int64), 2**62),
    ("int32", np.dtype(np.int32), 2**31 - 1),
    ("int16", np.dtype(np.int16), 2**15 - 1),
    ("int8", np.dtype(np.int8), 2**7 - 1),
    ("uint8", np.dtype(np.uint8), 2**8 - 1),
    ("bool", np.dtype(np.bool_), 1),
]:
    _TABLE[_name] = DType(_name, _np, _np.itemsize, _exact)

_ALIASES = {"float": "float32", "half": "float16", "double": "float64", "bf16": "bfloat16",
            "fp32": "float32", "fp16": "float16", "fp8": "float8_e4m3fn"}


def canonical_dtype(dtype: object) -> str:
    """Returns the canonical name of ``dtype`` (a name, a numpy dtype, or a torch/jax dtype).

    Examples:
        >>> canonical_dtype("bf16"), canonical_dtype("torch.float16"), canonical_dtype(np.float32)
        ('bfloat16', 'float16', 'float32')
    """
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.").removeprefix("jnp.")
    else:
        try:
            name = np.dtype(dtype).name  # numpy, ml_dtypes and jax dtypes
        except TypeError:
            name = str(dtype).removeprefix("torch.")  # torch.dtype prints as torch.bfloat16
    name = _ALIASES.get(name, name)
    if name not in _TABLE:
        raise SpecError(f"dtype {dtype!r} is not supported; use one of {sorted(_TABLE)}")
    return name


def dtype_info(dtype: object) -> DType:
    """Returns the :class:`DType` of ``dtype``.

    Examples:
        >>> dtype_info("bfloat16").itemsize, dtype_info("bfloat16").exact_int_max
        (2, 256)
        >>> dtype_info("float8_e4m3fn").exact_int_max
        16
    """
    return _TABLE[canonical_dtype(dtype)]


def known_dtype(dtype: object) -> str | None:
    """:func:`canonical_dtype` of ``dtype``, or ``None`` where wb does not know it.

    Examples:
        >>> known_dtype("bf16"), known_dtype("complex64")
        ('bfloat16', None)
    """
    try:
        return canonical_dtype(dtype)
    except SpecError:
        return None
