"""Element dtypes by name: numpy dtype, size, and the largest integer each holds exactly.

Names follow PyTorch/JAX spelling (``"bfloat16"``, ``"float8_e4m3fn"``). numpy has no bfloat16 or
float8, so those come from ``ml_dtypes``, the same package JAX uses, imported when one of them is
first asked for (it takes most of a second: a restarted rollout imports wb before it rejoins).
"""

from __future__ import annotations

import types
from typing import NamedTuple

import numpy as np

from wb.errors import SpecError

__all__ = ["DType", "dtype_info", "canonical_dtype", "known_dtype", "CODES", "CODE", "FLOATS",
           "castable", "wire_dtype"]


class DType(NamedTuple):
    name: str
    itemsize: int  # bytes per element
    exact_int_max: int  # every integer in [0, exact_int_max] is representable exactly

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype (``ml_dtypes``' for bfloat16 and float8: imported here, at first use)."""
        return _numpy(self.name)


def _numpy(name: str) -> np.dtype:
    if name not in _NUMPY:
        import ml_dtypes

        _NUMPY[name] = np.dtype(getattr(ml_dtypes, name))
    return _NUMPY[name]


def _float_exact(mantissa_bits: int) -> int:
    # A float with m explicit mantissa bits holds every integer up to 2**(m+1) exactly.
    return 2 ** (mantissa_bits + 1)


_NUMPY: dict[str, np.dtype] = {}
_TABLE: dict[str, DType] = {}
for _name, _size, _exact in [
    ("float64", 8, _float_exact(52)),
    ("float32", 4, _float_exact(23)),
    ("float16", 2, _float_exact(10)),
    ("bfloat16", 2, _float_exact(7)),  # ml_dtypes'
    ("float8_e4m3fn", 1, _float_exact(3)),
    ("float8_e5m2", 1, _float_exact(2)),
    ("int64", 8, 2**62),
    ("int32", 4, 2**31 - 1),
    ("int16", 2, 2**15 - 1),
    ("int8", 1, 2**7 - 1),
    ("uint8", 1, 2**8 - 1),
    ("bool", 1, 1),
]:
    _TABLE[_name] = DType(_name, _size, _exact)
    if _name not in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        _NUMPY[_name] = np.dtype(_name)

#: Every dtype name, in a fixed order: a dtype's code in plans and correspondences is its index.
CODES: tuple[str, ...] = tuple(_TABLE)
#: The code of each dtype name (its index in :data:`CODES`).
CODE = types.MappingProxyType({n: i for i, n in enumerate(CODES)})
#: The dtypes wb converts between (one to another, round to nearest even).
FLOATS = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})

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


def castable(a: str, b: str) -> bool:
    """Whether wb converts between canonical dtypes ``a`` and ``b`` (the same, or two floats).

    Examples:
        >>> castable("float32", "bfloat16"), castable("int32", "float32")
        (True, False)
    """
    return a == b or (a in FLOATS and b in FLOATS)


def wire_dtype(held: str, needed: str) -> str:
    """The dtype an element held as ``held`` and needed as ``needed`` travels in.

    Narrowing (``needed`` no wider) happens where the data lives, on the sending side, so fewer
    bytes travel; widening happens on the receiving side. Either way the element is rounded at
    most once, and every wider float holds every value of a narrower one exactly (so a forwarder
    can narrow what it received back to the wire dtype without loss).

    Examples:
        >>> wire_dtype("float32", "bfloat16"), wire_dtype("bfloat16", "float32")
        ('bfloat16', 'bfloat16')
        >>> wire_dtype("float16", "bfloat16")  # as wide: converted by the sender
        'bfloat16'
    """
    return needed if _TABLE[needed].itemsize <= _TABLE[held].itemsize else held


#: The largest finite float8_e4m3fn: conversions to it saturate here (as ``torch.Tensor.to``).
E4M3_MAX = 448.0


def convert(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` in ``dst``'s dtype, on the host: how wb converts between floats.

    Rounds to nearest, ties to even (``torch.Tensor.to``, ``ml_dtypes``); widening is exact.
    A value beyond a dtype's largest finite one becomes infinite, except in ``float8_e4m3fn``
    (which has no infinity): there it saturates to +-448, as ``torch.Tensor.to`` does. NaN stays
    NaN (its payload is not kept). float64 goes to a dtype narrower than float32 through
    float32 (rounded twice), as ``torch.Tensor.to`` does. The CUDA kernels of
    :mod:`wb.runtime.engine.casts` do the same.

    Examples:
        >>> out = np.empty(4, dtype_info("float8_e4m3fn").numpy)
        >>> convert(out, np.array([1.0625, 1.1875, 1e6, -np.inf], np.float32)); out.tolist()
        [1.0, 1.25, 448.0, -448.0]
    """
    if dst.dtype == src.dtype:
        dst[...] = src
        return
    if src.dtype == np.float64 and dst.dtype.itemsize < 4:  # as torch: through float32
        with np.errstate(all="ignore"):
            src = src.astype(np.float32)
    if dst.dtype == dtype_info("float8_e4m3fn").numpy:
        src = np.clip(src, -E4M3_MAX, E4M3_MAX)  # NaN stays NaN
    with np.errstate(all="ignore"):  # overflow and underflow are defined above
        dst[...] = src
