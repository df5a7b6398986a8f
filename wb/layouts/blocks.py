"""Affine block helpers: shards of checkpoint tensors as :class:`~wb.data.sourcemap.Blocks`.

The layout generators (and the broadcast baseline of ``wb bench``) build every source map from
these: nothing is O(elements), so a 1T-parameter deployment builds in seconds.

Conventions: a checkpoint tensor of shape ``S`` is viewed as ``[A, B]`` (``A = prod(S[:-1])``,
``B = S[-1]``, :func:`tensor_view`) and its element ``(a, b)`` has id ``offset + a * B + b``; a
buffer is viewed the same way (see :mod:`wb.data.sourcemap`). A block is a rectangle of the
buffer's view whose ids step by ``sr`` per row and ``sc`` per column.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from wb.data.layout import BufferSpec
from wb.data.sourcemap import Blocks, SourceMap
from wb.data.spec import CheckpointSpec

__all__ = ["broadcast_blocks", "tensor_view", "slice_block", "transposed_block", "buffer_spec",
           "whole_tensor", "expert_offsets", "stacked_fc1", "stacked_fc2"]


def broadcast_blocks(r0, nr, c0, nc, id0, sr, sc) -> Blocks:
    """Blocks from broadcastable fields (scalars or arrays), flattened to ``(n,) int64``.

    Args:
        r0: first buffer row of each block.
        nr: rows of each block.
        c0: first buffer column of each block.
        nc: columns of each block.
        id0: id of each block's first element.
        sr: id step from one row to the next.
        sc: id step from one column to the next.

    Returns:
        The :class:`~wb.data.sourcemap.Blocks`, one per element of the broadcast shape.

    Examples:
        >>> broadcast_blocks([0, 2], 2, 0, 3, [10, 40], 3, 1).id0
        array([10, 40])
    """
    f = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (r0, nr, c0, nc, id0, sr, sc)))
    return Blocks(*(np.ascontiguousarray(x.reshape(-1)) for x in f))


def tensor_view(shape: Sequence[int]) -> tuple[int, int]:
    """The 2-D view ``(A, B)`` of a tensor of ``shape``: ``A = prod(shape[:-1])``, ``B = shape[-1]``
    (``(1, 1)`` for a scalar)."""
    return (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)


def slice_block(spec: CheckpointSpec, name: str, *, rows: tuple[int, int] | None = None,
                cols: tuple[int, int] | None = None, at: tuple[int, int] = (0, 0)) -> Blocks:
    """Rows ``[a0, a1)`` x cols ``[b0, b1)`` of tensor ``name``, copied to buffer ``at`` onward.

    Ranges are clipped to the tensor; an empty range (a shard made only of padding) gives no
    block.

    Args:
        spec: the checkpoint.
        name: a tensor of ``spec``.
        rows: ``(a0, a1)`` rows of the tensor's 2-D view (default: all).
        cols: ``(b0, b1)`` columns of the tensor's 2-D view (default: all).
        at: ``(row, column)`` of the buffer's 2-D view where the slice starts.

    Returns:
        One block (or none).

    Examples:
        >>> spec = CheckpointSpec({"w": ((4, 3), "float32")})
        >>> b = slice_block(spec, "w", rows=(2, 6), at=(0, 0))   # rows 4, 5 are padding
        >>> (int(b.nr[0]), int(b.nc[0]), int(b.id0[0]))
        (2, 3, 6)
    """
    rect = _rectangle(spec, name, rows, cols)
    if rect is None:
        return Blocks.empty()
    id0, na, nb, B = rect
    return broadcast_blocks(at[0], na, at[1], nb, id0, B, 1)


def transposed_block(spec: CheckpointSpec, name: str, *, out: tuple[int, int] | None = None,
                     inp: tuple[int, int] | None = None, at: tuple[int, int] = (0, 0)) -> Blocks:
    """A transposed ``[in, out]`` kernel shard: buffer ``(R + i, C + o)`` = HF ``(o0 + o, i0 + i)``.

    Args:
        spec: the checkpoint.
        name: a PyTorch-layout ``[out, in]`` weight of ``spec``.
        out: ``(o0, o1)`` rows of the weight (columns of the kernel; default: all).
        inp: ``(i0, i1)`` columns of the weight (rows of the kernel; default: all).
        at: ``(R, C)`` of the buffer where the shard starts.

    Returns:
        One block (or none, for an empty range).
    """
    rect = _rectangle(spec, name, out, inp)
    if rect is None:
        return Blocks.empty()
    id0, n_out, n_in, B = rect
    return broadcast_blocks(at[0], n_in, at[1], n_out, id0, 1, B)


def _rectangle(spec: CheckpointSpec, name: str, rows: tuple[int, int] | None,
               cols: tuple[int, int] | None) -> tuple[int, int, int, int] | None:
    """``(first id, rows, columns, B)`` of a rectangle of tensor ``name``'s ``[A, B]`` view,
    clipped to the view; None when empty."""
    A, B = tensor_view(spec.shape(name))
    a0, a1 = rows or (0, A)
    b0, b1 = cols or (0, B)
    na, nb = min(a1, A) - a0, min(b1, B) - b0
    if na <= 0 or nb <= 0:
        return None
    return spec.offset(name) + a0 * B + b0, na, nb, B


def buffer_spec(shape: Sequence[int], parts: Sequence[Blocks] | Blocks, dtype: str) -> BufferSpec:
    """A buffer of ``shape`` holding the given blocks (``-1`` elsewhere).

    ``check=False``: the generators place shards side by side by construction, and the overlap
    sweep would cost more than building the map; the tests compare every map with an oracle.

    Args:
        shape: the buffer's shape.
        parts: its blocks, as one :class:`~wb.data.sourcemap.Blocks` or several (concatenated).
        dtype: the buffer's dtype name.

    Returns:
        The :class:`~wb.data.layout.BufferSpec`.

    Examples:
        >>> spec = CheckpointSpec({"w": ((4, 3), "float32")})
        >>> buffer_spec((4, 3), slice_block(spec, "w"), "float32").sourcemap.n_ids
        12
    """
    if isinstance(parts, Blocks):
        b = parts
    else:
        parts = [p for p in parts if p.count]
        b = (Blocks(*(np.concatenate(f) for f in zip(*parts))) if len(parts) > 1
             else parts[0] if parts else Blocks.empty())
    return BufferSpec(SourceMap.from_blocks(tuple(int(s) for s in shape), b, check=False), dtype)


def whole_tensor(spec: CheckpointSpec, name: str) -> BufferSpec:
    """A buffer holding all of tensor ``name``, in the tensor's own shape and dtype (a replicated
    parameter: norms, routers, latent down-projections).

    Examples:
        >>> spec = CheckpointSpec({"w": ((4, 3), "float32")})
        >>> whole_tensor(spec, "w").shape, whole_tensor(spec, "w").dtype
        ((4, 3), 'float32')
    """
    return buffer_spec(spec.shape(name), slice_block(spec, name), spec.dtype(name))


def expert_offsets(spec: CheckpointSpec, layer: int, experts: int) -> tuple[np.ndarray, ...]:
    """The first ids of every routed expert's weights of ``layer``.

    Args:
        spec: the checkpoint (HF names ``model.layers.{layer}.mlp.experts.{e}.{w}_proj.weight``).
        layer: the decoder layer.
        experts: the number of routed experts.

    Returns:
        ``(gate, up, down)``, each ``(experts,) int64``.
    """
    p = f"model.layers.{layer}.mlp.experts."
    return tuple(np.fromiter((spec.offset(f"{p}{e}.{w}_proj.weight") for e in range(experts)),
                             dtype=np.int64, count=experts) for w in ("gate", "up", "down"))


def stacked_fc1(gate: np.ndarray, up: np.ndarray, m: tuple[int, int], h: int) -> Blocks:
    """A ``[n, 2 * w, h]`` PyTorch-layout expert stack: expert ``j`` = gate rows ``m`` then up
    rows ``m`` (``w = m1 - m0``).

    Args:
        gate: first ids of the stacked experts' gate_proj weights, ``(n,) int64``.
        up: first ids of their up_proj weights, ``(n,) int64``.
        m: ``(m0, m1)`` rows of each weight in the stack (an expert-TP shard).
        h: hidden size (columns of each weight).

    Returns:
        ``2 * n`` blocks.
    """
    m0, m1 = m
    w = m1 - m0
    j = np.arange(gate.size, dtype=np.int64)
    r0 = np.stack([j * 2 * w, j * 2 * w + w], axis=1)  # (n, 2): gate rows, then up rows
    id0 = np.stack([gate, up], axis=1) + m0 * h
    return broadcast_blocks(r0, w, 0, h, id0, h, 1)


def stacked_fc2(down: np.ndarray, m: tuple[int, int], h: int, mi: int) -> Blocks:
    """A ``[n, h, m1 - m0]`` PyTorch-layout stack of down_proj column shards ``[m0, m1)``.

    Args:
        down: first ids of the stacked experts' down_proj weights (``[h, mi]``), ``(n,) int64``.
        m: ``(m0, m1)`` columns of each weight in the stack.
        h: hidden size (rows of each weight).
        mi: the expert's intermediate size (columns of each weight).

    Returns:
        ``n`` blocks.
    """
    j = np.arange(down.size, dtype=np.int64)
    return broadcast_blocks(j * h, h, 0, m[1] - m[0], down + m[0], mi, 1)
