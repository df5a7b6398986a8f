"""Brute-force, per-element oracles (O(elements)): the reference the block algorithms must equal."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from wb.data.correspondence import Correspondence
from wb.data.layout import Layout

__all__ = ["correspondence_pairs", "overlap_pairs", "quantize_reference"]

Element = tuple[int, str, int]  # (layout index, buffer name, flat index)


def correspondence_pairs(trainers: Sequence[Layout], rollouts: Sequence[Layout]
                         ) -> set[tuple[Element, Element]]:
    """Every (trainer element, rollout element) pair holding the same id, element by element."""
    holders: dict[int, list[Element]] = {}
    for li, lay in enumerate(trainers):
        for name, buf in lay.buffers.items():
            for f, i in enumerate(buf.sourcemap.to_indices().reshape(-1).tolist()):
                if i >= 0:
                    holders.setdefault(i, []).append((li, name, f))
    pairs = set()
    for li, lay in enumerate(rollouts):
        for name, buf in lay.buffers.items():
            for f, i in enumerate(buf.sourcemap.to_indices().reshape(-1).tolist()):
                for h in holders.get(i, ()):
                    pairs.add((h, (li, name, f)))
    return pairs


def overlap_pairs(corr: Correspondence) -> set[tuple[Element, Element]]:
    """The element pairs a :class:`~wb.data.correspondence.Correspondence` claims, expanded per element."""
    ov = corr.overlaps()
    pairs = set()
    for k in range(ov.src_slot.size):
        s, d = corr.slots[ov.src_slot[k]], corr.slots[ov.dst_slot[k]]
        i, j = np.meshgrid(np.arange(ov.na[k]), np.arange(ov.nb[k]), indexing="ij")
        fs = (ov.src_f0[k] + i * ov.src_fa[k] + j * ov.src_fb[k]).reshape(-1).tolist()
        fd = (ov.dst_f0[k] + i * ov.dst_fa[k] + j * ov.dst_fb[k]).reshape(-1).tolist()
        pairs.update(((s.layout, s.buffer, a), (d.layout, d.buffer, b)) for a, b in zip(fs, fd))
    return pairs


def quantize_reference(x: np.ndarray, block: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Block-scaled ``float8_e4m3fn`` of a 2-D tensor, written plainly, one block at a time, with
    ``ml_dtypes``' conversion (not wb's): the oracle of :mod:`wb.data.fp8`'s rule.

    Returns:
        ``(q, scale)``: ``q`` of ``x``'s shape (float8_e4m3fn), ``scale`` float32 per block.
    """
    import ml_dtypes

    bh, bw = block
    rows, cols = x.shape
    q = np.zeros(x.shape, ml_dtypes.float8_e4m3fn)
    scale = np.zeros((-(-rows // bh), -(-cols // bw)), np.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            xb = x[i * bh:(i + 1) * bh, j * bw:(j + 1) * bw].astype(np.float32)
            amax = np.float32(np.max(np.abs(xb)))
            s = np.float32(amax / np.float32(448.0))
            scale[i, j] = s
            if not np.isfinite(amax):  # an infinity or a NaN in the block: every q is NaN
                q[i * bh:(i + 1) * bh, j * bw:(j + 1) * bw] = np.float32(np.nan)
                continue
            if s == 0:
                continue  # an all-zero block (or one too small for a float32 scale): q stays 0
            y = np.clip(xb / s, -448, 448)  # float32; the format's largest finite value
            q[i * bh:(i + 1) * bh, j * bw:(j + 1) * bw] = y.astype(ml_dtypes.float8_e4m3fn)
    return q, scale
