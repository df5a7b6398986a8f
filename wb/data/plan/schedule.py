"""When each message of a plan should move: :func:`schedule`."""

from __future__ import annotations

import numpy as np

from wb.data.plan.arrays import Messages

__all__ = ["schedule", "hops"]


def schedule(M: Messages) -> np.ndarray:
    """When each message should move, as a fraction of its trainer's stream (0 first, 1 last).

    A trainer sends to many rollout GPUs; sending all of one destination's messages before the
    next (plan order) would feed one GPU at a time, and the GPUs fed last could only start their
    forwards at the very end. Instead a trainer interleaves its destinations: its k-th message
    to a GPU goes when that pair's stream is as far along as all its others, so every rollout
    GPU receives (and forwards) at a steady rate from the start. A forwarded message inherits
    the time of the stage-1 message it descends from (a hop later). Receivers post staged
    receives in the same order.

    Args:
        M: ``plan.messages``.

    Returns:
        ``(messages,) float64``: each message's time.
    """
    n = M.nbytes.size
    when = np.zeros(n, np.float64)
    root = M.parent < 0
    r = np.flatnonzero(root)
    if r.size:
        pair = M.src_rank[r].astype(np.int64) * (int(M.dst_rank.max()) + 1) + M.dst_rank[r]
        o = np.lexsort((r, pair))  # by pair, then plan order within the pair
        rs, ps, nb = r[o], pair[o], M.nbytes[r[o]].astype(np.float64)
        starts = np.r_[True, ps[1:] != ps[:-1]]
        grp = np.cumsum(starts) - 1
        tot = np.bincount(grp, weights=nb)
        before = np.cumsum(nb) - nb
        first = before[starts][grp]
        when[rs] = (before - first) / np.maximum(tot[grp], 1.0)
    # forwards: their root's time, plus a little per hop (parents have lower ids than children)
    child = np.flatnonzero(~root)
    for _ in range(64):
        if not child.size:
            break
        new = when[M.parent[child]] + 1e-6
        if np.array_equal(new, when[child]):
            break
        when[child] = new
    return when


def hops(M: Messages) -> np.ndarray:
    """``(messages,) int64``: how many forwards each message is from its trainer (0: sent by
    the trainer; a forward: its parent's hops plus one)."""
    out = np.zeros(M.nbytes.size, np.int64)
    child = np.flatnonzero(M.parent >= 0)
    for _ in range(1 << 16):
        if not child.size:
            break
        new = out[M.parent[child]] + 1
        if np.array_equal(new, out[child]):
            break
        out[child] = new
    return out
