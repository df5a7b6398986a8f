"""Rollout layouts of a block-scaled FP8 checkpoint, made from the same rollouts' layouts of the
trainers' checkpoint (for benchmarks and planning studies; a real engine is probed against
:attr:`wb.data.fp8.BlockScaled.spec` instead).

Each buffer that holds ids of declared tensors only (:meth:`wb.data.fp8.FP8Blocks.bind`)
is needed in the format, and gets a ``float32`` buffer of the scales of every block it touches,
named ``<buffer>_scale_inv``, one scale per block in id order: what an engine that loads the
FP8 checkpoint keeps (its layout of scales is its own; the bytes it needs are these).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from wb.algorithms.fp8.held import Geometry, analyse
from wb.data.fp8 import BlockScaled
from wb.data.layout import BufferSpec, Layout
from wb.data.sourcemap import SourceMap
from wb.errors import SpecError

__all__ = ["fp8_rollouts"]


def fp8_rollouts(layouts: Sequence[Layout], scaled: BlockScaled) -> list[Layout]:
    """``layouts`` (rollouts, ids of ``scaled.trainer_spec``) as rollouts of the FP8 checkpoint
    (from the source maps' rectangles: O(rectangles + blocks)).

    Raises:
        SpecError: a buffer mixes declared and other tensors' ids, or a name ``<buffer>_scale_inv``
            is taken.
    """
    g = Geometry.of(scaled)
    out = []
    for lay in layouts:
        bufs = dict(lay.buffers)
        for name, b in lay.buffers.items():
            h = analyse(b.sourcemap, g)
            if h is None:
                continue
            if h.masked.n_ids:
                raise SpecError(f"rollout rank {lay.worker.rank} buffer `{name}` holds ids of "
                                f"declared and undeclared tensors: one dtype cannot serve both")
            keys = np.union1d(h.keys, h.partial)  # every block it touches
            t = g.t_of[keys]
            scale_ids = scaled.scale_offset[t] + keys - g.key0[t]
            sname = name + scaled.decl.scale_suffix
            if sname in bufs:
                raise SpecError(f"rollout rank {lay.worker.rank} already has a buffer `{sname}`")
            bufs[name] = BufferSpec(b.sourcemap, scaled.decl.format)
            bufs[sname] = BufferSpec(SourceMap.from_indices(np.sort(scale_ids)), "float32")
        out.append(Layout(lay.worker, bufs))
    return out
