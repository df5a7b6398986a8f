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

A *transposed* region (its rows run down the buffer: step 1 between rows, a longer one between
columns, as a PyTorch ``[out, in]`` message lies in a JAX ``[in, out]`` kernel) goes through
shared memory in tiles of :data:`TILE` x :data:`TILE` elements, read and written along whichever
index is contiguous on each side. Element by element, every thread of a warp would touch another
32-byte sector of the buffer: an 8 MiB bfloat16 message took ~110 us to unpack on an H100, 15x
a straight copy. Such regions are cut into whole rows only, :data:`PAIRED` of them at least.
Two-byte elements (bfloat16, the common case) whose pairs are word-aligned on both sides move in
tiles of :data:`PAIRED` x :data:`PAIRED`, a 4-byte word (two elements) a thread on either side:
a warp then reads and writes 128 bytes at a time instead of 64.

Several messages packed at once share a launch (:func:`stacked`): a launch costs ~15-20 us of
the caller's time, and a JAX trainer packs every message it sends.

The kernel's source (:func:`kernel_source`) is also compiled for the host and checked against
numpy in ``tests/test_gather_kernel_host.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Regions", "table", "stacked", "copy", "kernel_source", "PIECE", "FIELDS", "TILE",
           "PAIRED", "STAGES"]

#: Most elements one row of a table copies (longer regions are cut at row or element bounds).
PIECE = 1 << 16
#: The table's rows, in order: buffer slot, first element, rows, columns, row step, column step
#: (in elements of the buffer), where the region's first element sits in the message, and which
#: of a launch's staging buffers holds that message.
FIELDS = ("slot", "f0", "na", "nb", "fa", "fb", "at", "stage")
#: Staging buffers one launch fills or empties at most (a table row's ``stage`` picks one).
STAGES = 8
#: Rows and columns of the tiles a transposed region moves in.
TILE = 32
#: The same for 2-byte elements whose pairs are word-aligned on both sides (two a thread).
PAIRED = 64
_THREADS = 256
_BLOCKS_PER_ROW = 16  # CUDA blocks along a row of the table (PIECE / 256 / 16 = 16 per thread)
_BLOCKS, _MAX_BLOCKS_PER_ROW = 2048, 256  # blocks a launch has at least, as rows allow


class Regions(NamedTuple):
    """A message's regions of the buffers as one thing a kernel writes element by element (a
    delta applied where a unit received packed lies, with no gathering into staging and no
    unpacking after: :func:`wb.runtime.engine.deltas.tables.apply_many`).

    Attributes:
        table: the regions' device table in message order (:func:`table`; elements of the
            message's width).
        ptrs: the device array of the buffers' addresses by the table's slots.
        nbytes: the bytes of the message the regions hold.
        itemsize: the bytes of an element of the table (the message's travelling dtype's).
    """

    table: Any
    ptrs: Any
    nbytes: int
    itemsize: int


_SOURCE = r"""
#define TILE 32
#define PAIRED 64
extern "C" __global__ void wb_gather(const unsigned long long* ptrs, const long long* tab,
        long long rows, ELEM* s0, ELEM* s1, ELEM* s2, ELEM* s3, ELEM* s4, ELEM* s5, ELEM* s6,
        ELEM* s7, int scatter) {
    __shared__ ELEM tile[TILE][TILE + 1];
    for (long long k = blockIdx.y; k < rows; k += gridDim.y) {
        long long f0 = tab[rows + k], na = tab[2 * rows + k], nb = tab[3 * rows + k];
        long long fa = tab[4 * rows + k], fb = tab[5 * rows + k], at = tab[6 * rows + k];
        long long w = tab[7 * rows + k];
        ELEM* base = (ELEM*)ptrs[tab[k]];
        ELEM* stage = w == 0 ? s0 : w == 1 ? s1 : w == 2 ? s2 : w == 3 ? s3 : w == 4 ? s4
                    : w == 5 ? s5 : w == 6 ? s6 : s7;
#if ELEM_BYTES == 2
        if (na > 1 && nb > 1 && fa == 1 && fb != 1 && ((f0 | fb | at | nb) & 1) == 0
                && (((unsigned long long)base | (unsigned long long)stage) & 3) == 0) {
            /* transposed, 2-byte elements, every pair of them word-aligned on both sides:
               tiles of PAIRED x PAIRED, moved two elements (one 4-byte word) a thread on each
               side: along i in the buffer, along j in the staging */
            __shared__ __align__(16) unsigned short pt[PAIRED][PAIRED + 2];  /* word access */
            long long tj = (nb + PAIRED - 1) / PAIRED, tiles = (na + PAIRED - 1) / PAIRED * tj;
            for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
                long long i0 = t / tj * PAIRED, j0 = t % tj * PAIRED;
                for (int q = threadIdx.x; q < PAIRED * PAIRED / 2; q += blockDim.x) {
                    int a = q / (PAIRED / 2), p = 2 * (q % (PAIRED / 2));
                    if (scatter) {  /* staging row i0 + a, its elements j0 + p and the next */
                        long long i = i0 + a, j = j0 + p;
                        if (i < na && j + 1 < nb) {
                            unsigned int w = *(const unsigned int*)&stage[at + i * nb + j];
                            pt[p][a] = (unsigned short)w; pt[p + 1][a] = (unsigned short)(w >> 16);
                        } else if (i < na && j < nb) {
                            pt[p][a] = stage[at + i * nb + j];
                        }
                    } else {  /* buffer column j0 + a, its elements i0 + p and the next */
                        long long i = i0 + p, j = j0 + a;
                        if (j < nb && i + 1 < na) {
                            *(unsigned int*)&pt[a][p] = *(const unsigned int*)&base[f0 + i + j * fb];
                        } else if (j < nb && i < na) {
                            pt[a][p] = base[f0 + i + j * fb];
                        }
                    }
                }
                __syncthreads();
                for (int q = threadIdx.x; q < PAIRED * PAIRED / 2; q += blockDim.x) {
                    int a = q / (PAIRED / 2), p = 2 * (q % (PAIRED / 2));
                    if (scatter) {  /* buffer column j0 + a, its elements i0 + p and the next */
                        long long i = i0 + p, j = j0 + a;
                        if (j < nb && i + 1 < na) {
                            *(unsigned int*)&base[f0 + i + j * fb] = *(const unsigned int*)&pt[a][p];
                        } else if (j < nb && i < na) {
                            base[f0 + i + j * fb] = pt[a][p];
                        }
                    } else {  /* staging row i0 + a, its elements j0 + p and the next */
                        long long i = i0 + a, j = j0 + p;
                        if (i < na && j + 1 < nb) {
                            *(unsigned int*)&stage[at + i * nb + j] =
                                (unsigned int)pt[p][a] | ((unsigned int)pt[p + 1][a] << 16);
                        } else if (i < na && j < nb) {
                            stage[at + i * nb + j] = pt[p][a];
                        }
                    }
                }
                __syncthreads();
            }
            continue;
        }
#endif
        if (na > 1 && nb > 1 && fa == 1 && fb != 1) {
            /* transposed: element (i, j) at base[f0 + i + j * fb] and stage[at + i * nb + j];
               a tile is read along j from the staging and along i from the buffer */
            long long tj = (nb + TILE - 1) / TILE, tiles = (na + TILE - 1) / TILE * tj;
            for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {
                long long i0 = t / tj * TILE, j0 = t % tj * TILE;
                for (int q = threadIdx.x; q < TILE * TILE; q += blockDim.x) {
                    int a = q / TILE, b = q % TILE;
                    if (scatter) {
                        if (i0 + a < na && j0 + b < nb)
                            tile[a][b] = stage[at + (i0 + a) * nb + j0 + b];
                    } else if (i0 + b < na && j0 + a < nb) {
                        tile[b][a] = base[f0 + i0 + b + (j0 + a) * fb];
                    }
                }
                __syncthreads();
                for (int q = threadIdx.x; q < TILE * TILE; q += blockDim.x) {
                    int a = q / TILE, b = q % TILE;
                    if (scatter) {
                        if (i0 + b < na && j0 + a < nb)
                            base[f0 + i0 + b + (j0 + a) * fb] = tile[b][a];
                    } else if (i0 + a < na && j0 + b < nb) {
                        stage[at + (i0 + a) * nb + j0 + b] = tile[a][b];
                    }
                }
                __syncthreads();
            }
            continue;
        }
        long long n = na * nb;
        bool run = (nb == 1 || fb == 1) && (na == 1 || fa == nb);
        const long long S = sizeof(ELEM);
        if (run && (((f0 * S) | (at * S) | (n * S)) & 15) == 0
                && (((unsigned long long)base | (unsigned long long)stage) & 15) == 0) {
            /* one contiguous stretch on both sides, 16-byte aligned: 16-byte words */
            uint4* b4 = (uint4*)(base + f0);
            uint4* s4 = (uint4*)(stage + at);
            for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n * S / 16;
                 e += (long long)gridDim.x * blockDim.x) {
                if (scatter) b4[e] = s4[e]; else s4[e] = b4[e];
            }
            continue;
        }
        for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n;
             e += (long long)gridDim.x * blockDim.x) {
            long long p;
            if (run) p = f0 + e;
            else if (nb == 1) p = f0 + e * fa;
            else if (n < 2147483648LL) {  /* a 32-bit division: a 64-bit one costs far more */
                long long i = (unsigned int)e / (unsigned int)nb;
                p = f0 + i * fa + (e - i * nb) * fb;
            } else { long long i = e / nb; p = f0 + i * fa + (e - i * nb) * fb; }
            if (scatter) base[p] = stage[at + e]; else stage[at + e] = base[p];
        }
    }
}
"""


def kernel_source(itemsize: int) -> str:
    """The CUDA source of the copy kernel for elements of ``itemsize`` bytes."""
    elem = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int",
            8: "unsigned long long"}[int(itemsize)]
    return f"#define ELEM {elem}\n#define ELEM_BYTES {int(itemsize)}\n" + _SOURCE


def table(spans: Sequence, piece: int = PIECE) -> np.ndarray:
    """The ``(8, rows)`` int64 table (:data:`FIELDS`) of a message's regions in message order
    (:class:`wb.runtime.engine.program.Span`, or any tuples starting ``slot, f0, na, nb, fa, fb``), each
    cut into pieces of at most ``piece`` elements: whole rows at a time, or stretches of one row
    when a row is longer. A transposed region (``fa == 1``, ``fb != 1``) is cut into whole rows
    only, at least :data:`PAIRED` of them a piece (a multiple of it), whatever ``piece`` says."""
    out: list[tuple[int, ...]] = []
    at = 0
    for sp in spans:
        slot, f0, na, nb, fa, fb = (int(x) for x in sp[:6])
        if na * nb <= piece:
            out.append((slot, f0, na, nb, fa, fb, at, 0))
        elif nb <= piece or (fa == 1 and fb != 1):  # groups of whole rows
            per = max(piece // nb, 1)
            if fa == 1 and fb != 1:  # transposed: whole tiles of rows (of the wider tiles)
                per = max(per // PAIRED, 1) * PAIRED
            for i in range(0, na, per):
                out.append((slot, f0 + i * fa, min(per, na - i), nb, fa, fb, at + i * nb, 0))
        else:  # stretches of each row
            for i in range(na):
                for j in range(0, nb, piece):
                    out.append((slot, f0 + i * fa + j * fb, 1, min(piece, nb - j), fa, fb,
                                at + i * nb + j, 0))
        at += na * nb
    return np.ascontiguousarray(np.array(out, np.int64).reshape(-1, len(FIELDS)).T)


def stacked(tables: Sequence[np.ndarray]) -> np.ndarray:
    """One table of up to :data:`STAGES` messages' tables (:func:`table`), the ``k``-th's rows
    filling or emptying the ``k``-th staging buffer given to :func:`copy`."""
    if not 0 < len(tables) <= STAGES:
        raise ValueError(f"{len(tables)} tables: one launch takes 1 to {STAGES}")
    out = np.concatenate(tables, axis=1)
    out[7] = np.repeat(np.arange(len(tables)), [t.shape[1] for t in tables])
    return out


def copy(ptrs: Any, tab: Any, stage: Any, itemsize: int, *, scatter: bool) -> None:
    """One launch on CuPy's current device and stream: the regions of device table ``tab``
    (:func:`table` or :func:`stacked`, as a CuPy array) in the buffers whose addresses ``ptrs``
    gives by slot (a CuPy ``uint64`` array) into ``stage`` (a CuPy array of the message's bytes;
    for a stacked table, a list of one per message), or back with ``scatter``."""
    rows = tab.shape[1]
    if rows == 0:
        return
    stages = list(stage) if isinstance(stage, list) else [stage]  # passed as their addresses
    stages += [stages[0]] * (STAGES - len(stages))
    # a table of few rows (a long transposed region is one row) still fills the device
    grid = (max(_BLOCKS_PER_ROW, min(_MAX_BLOCKS_PER_ROW, _BLOCKS // rows)), min(rows, 65535))
    _kernel(int(itemsize))(grid, (_THREADS,), (ptrs, tab, np.int64(rows), *stages,
                                               np.int32(scatter)))


@functools.lru_cache(maxsize=None)
def _kernel(itemsize: int):
    import cupy  # only CUDA buffers come here

    k = cupy.RawKernel(kernel_source(itemsize), "wb_gather")
    k.compile()
    return k
