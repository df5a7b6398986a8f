"""A message's regions packed into staging, or unpacked from it, by one CUDA kernel launch.

Where the two sides lay a tensor out differently (a JAX model's ``[in, out]`` kernels against a
PyTorch model's ``[out, in]`` weights, experts stacked or not), a message is hundreds of regions
of its buffers: one CuPy copy per region costs tens of microseconds of Python and launch each,
half a second per update for a 578 MiB model (measured on an H200). Here a message's regions are
a table made once (:func:`table`: each region's buffer slot, start, shape and steps, and where
its elements sit in the message, long regions cut into pieces of at most :data:`PIECE` elements
so that blocks share the work), and every update copies them all in one launch (:func:`copy`):
CUDA blocks over the table's rows, threads over a row's elements. Elements move as raw bits of
their width: no conversion here (:mod:`wb.runtime.engine.casts` converts).

The kernel's source (:func:`kernel_source`) is also compiled for the host and checked against
numpy in ``tests/test_gather_kernel_host.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["table", "copy", "kernel_source", "PIECE", "FIELDS"]

#: Most elements one row of a table copies (longer regions are cut at row or element bounds).
PIECE = 1 << 16
#: The table's rows, in order: buffer slot, first element, rows, columns, row step, column step
#: (in elements of the buffer), and where the region's first element sits in the message.
FIELDS = ("slot", "f0", "na", "nb", "fa", "fb", "at")
_THREADS = 256
_BLOCKS_PER_ROW = 16  # CUDA blocks along a row of the table (PIECE / 256 / 16 = 16 per thread)

_SOURCE = r"""
extern "C" __global__ void wb_gather(const unsigned long long* ptrs, const long long* tab,
        long long rows, ELEM* stage, int scatter) {
    for (long long k = blockIdx.y; k < rows; k += gridDim.y) {
        long long f0 = tab[rows + k], na = tab[2 * rows + k], nb = tab[3 * rows + k];
        long long fa = tab[4 * rows + k], fb = tab[5 * rows + k], at = tab[6 * rows + k];
        ELEM* base = (ELEM*)ptrs[tab[k]];
        long long n = na * nb;
        bool run = (nb == 1 || fb == 1) && (na == 1 || fa == nb);
        for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n;
             e += (long long)gridDim.x * blockDim.x) {
            long long p;
            if (run) p = f0 + e;
            else if (nb == 1) p = f0 + e * fa;
            else { long long i = e / nb; p = f0 + i * fa + (e - i * nb) * fb; }
            if (scatter) base[p] = stage[at + e]; else stage[at + e] = base[p];
        }
    }
}
"""


def kernel_source(itemsize: int) -> str:
    """The CUDA source of the copy kernel for elements of ``itemsize`` bytes."""
    elem = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int",
            8: "unsigned long long"}[int(itemsize)]
    return f"#define ELEM {elem}\n" + _SOURCE


def table(spans: Sequence, piece: int = PIECE) -> np.ndarray:
    """The ``(7, rows)`` int64 table (:data:`FIELDS`) of a message's regions in message order
    (:class:`wb.runtime.engine.program.Span`, or any tuples starting ``slot, f0, na, nb, fa, fb``), each
    cut into pieces of at most ``piece`` elements: whole rows at a time, or stretches of one row
    when a row is longer."""
    out: list[tuple[int, ...]] = []
    at = 0
    for sp in spans:
        slot, f0, na, nb, fa, fb = (int(x) for x in sp[:6])
        if na * nb <= piece:
            out.append((slot, f0, na, nb, fa, fb, at))
        elif nb <= piece:  # groups of whole rows
            per = piece // nb
            for i in range(0, na, per):
                out.append((slot, f0 + i * fa, min(per, na - i), nb, fa, fb, at + i * nb))
        else:  # stretches of each row
            for i in range(na):
                for j in range(0, nb, piece):
                    out.append((slot, f0 + i * fa + j * fb, 1, min(piece, nb - j), fa, fb,
                                at + i * nb + j))
        at += na * nb
    return np.ascontiguousarray(np.array(out, np.int64).reshape(-1, len(FIELDS)).T)


def copy(ptrs: Any, tab: Any, stage: Any, itemsize: int, *, scatter: bool) -> None:
    """One launch on CuPy's current device and stream: the regions of device table ``tab``
    (:func:`table`, as a CuPy array) in the buffers whose addresses ``ptrs`` gives by slot (a CuPy
    ``uint64`` array) into ``stage`` (a CuPy array of the message's bytes), or back with
    ``scatter``."""
    rows = tab.shape[1]
    if rows == 0:
        return
    grid = (_BLOCKS_PER_ROW, min(rows, 65535))
    _kernel(int(itemsize))(grid, (_THREADS,), (ptrs, tab, np.int64(rows),
                                               stage.view(f"u{itemsize}"), np.int32(scatter)))


@functools.lru_cache(maxsize=None)
def _kernel(itemsize: int):
    import cupy  # only CUDA buffers come here

    k = cupy.RawKernel(kernel_source(itemsize), "wb_gather")
    k.compile()
    return k
