"""Rollout layouts of a block-scaled FP8 checkpoint, made from the same rollouts' layouts of the
trainers' checkpoint (for benchmarks and planning studies; a real engine is probed against
:attr:`wb.data.blockscale.BlockScaled.spec` instead).

Each buffer that holds ids of declared tensors only (:meth:`wb.data.blockscale.FP8Blocks.bind`)
is needed in the format, and gets a ``float32`` buffer of the scales of every block it touches,
named ``<buffer>_scale_inv``, one scale per block in id order: what an engine that loads the
FP8 checkpoint keeps (its layout of scales is its own; the bytes it needs are these).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from wb.data.blockscale import BlockScaled
from wb.data.layout import BufferSpec, Layout
from wb.data.sourcemap import SourceMap
from wb.errors import SpecError

__all__ = ["fp8_rollouts"]


def fp8_rollouts(layouts: Sequence[Layout], scaled: BlockScaled) -> list[Layout]:
    """``layouts`` (rollouts, ids of ``scaled.trainer_spec``) as rollouts of the FP8 checkpoint.

    Raises:
        SpecError: a buffer mixes declared and other tensors' ids, or a name ``<buffer>_scale_inv``
            is taken.
    """
    bh, bw = scaled.decl.block
    lo = scaled.offset
    hi = lo + scaled.rows * scaled.cols
    out = []
    for lay in layouts:
        bufs = dict(lay.buffers)
        for name, b in lay.buffers.items():
            idlo, idhi = b.sourcemap.blocks.id_range()
            if b.sourcemap.n_ids == 0 or not ((lo <= idhi) & (hi > idlo)).any():
                continue
            ids = b.sourcemap.to_indices().reshape(-1)
            ids = ids[ids >= 0]
            t = np.searchsorted(lo, ids, side="right") - 1
            inside = (t >= 0) & (ids < hi[np.maximum(t, 0)])
            if not inside.any():
                continue
            if not inside.all():
                raise SpecError(f"rollout rank {lay.worker.rank} buffer `{name}` holds ids of "
                                f"declared and undeclared tensors: one dtype cannot serve both")
            r, c = np.divmod(ids - lo[t], scaled.cols[t])
            scale_ids = np.unique(scaled.scale_offset[t] + (r // bh) * scaled.grid_cols[t] + c // bw)
            sname = name + scaled.decl.scale_suffix
            if sname in bufs:
                raise SpecError(f"rollout rank {lay.worker.rank} already has a buffer `{sname}`")
            bufs[name] = BufferSpec(b.sourcemap, scaled.decl.format)
            bufs[sname] = BufferSpec(SourceMap.from_indices(scale_ids), "float32")
        out.append(Layout(lay.worker, bufs))
    return out
