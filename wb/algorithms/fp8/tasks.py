"""Who quantises which block: trainer layouts turned into holders of a block-scaled FP8 checkpoint.

Rollouts that serve block-scaled FP8 (:mod:`wb.data.fp8`) need the FP8 checkpoint's ids:
each declared tensor's elements (the same ids as the trainers' copy, in the FP8 format) and its
scales. :func:`quantize_layouts` gives every block of every declared tensor to exactly one
trainer buffer that holds the whole block (where several do, replicas, each takes a range of
block rows of each tensor: a share of the work, in large rectangles) and returns:

- trainer layouts to plan with (:func:`wb.plan`): each declared tensor's ids taken out of the
  trainers' own buffers (they hold the unquantised values); beside each buffer a trainer
  quantises blocks of, a quantised copy ``wb:fp8:<buffer>`` of its shape in the format (holding
  the ids of the blocks it was given: pieces stay as large as the buffer's own; extra memory one
  byte per element of that buffer), and per declared tensor in it a buffer of the blocks'
  scales, ``wb:fp8:<buffer>:<scale tensor>`` (``(k,)`` float32);
- per trainer rank, the :class:`Task` that fills them from its own buffer before each update
  (:func:`quantize_buffers` with numpy; ``wb.runtime.engine.fp8`` on a GPU): per block the
  position of its first element and its row and column steps in the buffer (24 bytes per block
  of 16384 elements); only blocks a buffer holds in several pieces list their elements' positions.

Everything is computed from the source maps' affine rectangles (row or column shards,
transposes, stacks, flat FSDP-style runs across tensors), in O(rectangles + blocks); a buffer
with any other kind of rectangle is read element by element.

The plan then moves FP8 bytes and scales like any bytes, at the lower bound of what the rollouts
need in the FP8 checkpoint.

A block no trainer buffer holds whole (split between TP ranks at rows or columns that are not
block multiples, or between FSDP shards) is quantised by every buffer that holds a part of it,
each its own part, with the block's scale: before each update those trainers exchange each
part's ``amax`` (8 bytes per part, :func:`partial_amax`, :func:`combine_amax`), and each encodes
its part with ``amax`` over the whole block. That is bit-identical to quantising the block in one
place, and cheaper than gathering it there first (2 bytes per BF16 element): trainers still send
only FP8 bytes and scales, at the lower bound. Every holder of a part holds the block's scale
(the plan sends one copy where it is needed); ``Quantized.peers`` names who exchanges with whom.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from wb.data.fp8 import BlockScaled, block_amax, quantize_blocks
from wb.data.dtypes import dtype_info
from wb.data.layout import BufferSpec, Layout
from wb.data.sourcemap import SourceMap
from wb.algorithms.fp8.held import Geometry, Held, analyse, mirror_map
from wb.errors import PlanError

__all__ = ["PREFIX", "PART", "Quantized", "Task", "combine_amax", "partial_amax",
           "quantize_buffers", "quantize_all", "quantize_layouts", "tasks_for"]

#: Names of the buffers a trainer quantises into start with this.
PREFIX = "wb:fp8:"
#: The scales of blocks a buffer quantises a part of are in a buffer whose name ends with this.
PART = ":part"


class Task(NamedTuple):
    """The blocks of one declared tensor that one trainer buffer quantises (``part``: a part of
    each, with the scale of the whole block, :func:`partial_amax`)."""

    tensor: int  # index into BlockScaled.names
    source: str  # the trainer's buffer the blocks are read from
    weights: str  # the quantised copy of `source`: its shape, in the format
    scales: str  # the buffer of the blocks' scales: (k,) float32
    blocks: np.ndarray  # (k,) int64 block index, row-major over the tensor's grid of blocks
    at: np.ndarray  # (k, 3) int64 flat position in `source` (and `weights`) of each block's
    #                 (window's) first element, and the steps per row and per column; -1 first:
    #                 `gather`
    gather: np.ndarray  # (g * bh * bw,) int64 positions of every element of the g blocks whose
    #                     `at` is -1 (held, but not as one affine rectangle), block by block,
    #                     row-major; -1 outside the tensor (or, for parts, not held)
    window: np.ndarray | None = None  # (k, 4) int64 rows i0:i1, columns j0:j1 of each block
    #                                   held (None: whole blocks)
    part: bool = False  # blocks held in part: encoded with the whole block's amax

    def windows(self, bh: int, bw: int) -> np.ndarray:
        """``(k, 4)`` :attr:`window`, whole blocks where it is ``None``."""
        if self.window is not None:
            return self.window
        return np.tile(np.array([0, bh, 0, bw], np.int64), (self.blocks.size, 1))

    def positions(self, scaled: BlockScaled, lo: int = 0, hi: int | None = None, *, xp=np,
                  on: tuple | None = None):
        """``(n, bh, bw)`` int64 flat positions of blocks ``lo:hi`` in ``source``, -1 outside
        the tensor or the part held: computed, never stored (O(blocks) memory). ``xp``: the
        array module to compute with; ``on``: ``(blocks, at, gather, odd, window)`` already in
        its memory (CuPy), with ``odd`` each block's index among the gathered ones
        (:meth:`device_arrays`)."""
        bh, bw = scaled.decl.block
        rows, cols = int(scaled.rows[self.tensor]), int(scaled.cols[self.tensor])
        gc = int(scaled.grid_cols[self.tensor])
        blocks, at, gather, odd, win = on if on is not None else self.device_arrays(np, bh, bw)
        at, keys, odd, win = at[lo:hi], blocks[lo:hi], odd[lo:hi], win[lo:hi]
        i = xp.arange(bh).reshape(1, bh, 1)
        j = xp.arange(bw).reshape(1, 1, bw)
        i0, i1 = win[:, 0, None, None], win[:, 1, None, None]
        j0, j1 = win[:, 2, None, None], win[:, 3, None, None]
        pos = (at[:, 0, None, None] + (i - i0) * at[:, 1, None, None]
               + (j - j0) * at[:, 2, None, None])
        br, bc = keys // gc, keys % gc
        inside = ((br[:, None, None] * bh + i < rows) & (bc[:, None, None] * bw + j < cols)
                  & (i >= i0) & (i < i1) & (j >= j0) & (j < j1))
        pos = xp.where(inside, pos, -1)
        if gather.size:  # blocks listed in `gather`, in order
            g = gather.reshape(-1, bh, bw)[xp.maximum(odd, 0)]
            pos = xp.where((odd >= 0)[:, None, None], g, pos)
        return pos

    def device_arrays(self, xp, bh: int, bw: int) -> tuple:
        """``(blocks, at, gather, odd, window)`` in ``xp``'s memory, for :meth:`positions`."""
        odd = np.where(self.at[:, 0] < 0, np.cumsum(self.at[:, 0] < 0) - 1, -1)
        return tuple(xp.asarray(a) for a in (self.blocks, self.at, self.gather, odd,
                                             self.windows(bh, bw)))

    def keys(self) -> np.ndarray:
        """``(k,)`` int64 keys of the blocks, unique across tensors (:func:`partial_amax`)."""
        return self.tensor * _KEY_STRIDE + self.blocks


_KEY_STRIDE = 1 << 40  # a block's key across tensors: tensor * stride + its block index


class Quantized(NamedTuple):
    """Trainer layouts holding a block-scaled FP8 checkpoint (:func:`quantize_layouts`)."""

    scaled: BlockScaled  # the declaration, bound to the trainers' spec
    trainers: tuple[Layout, ...]  # to plan with
    tasks: dict[int, tuple[Task, ...]]  # trainer rank -> what it quantises (never changed)
    peers: dict[int, tuple[int, ...]] | None = None  # rank -> the trainers it exchanges the
    #   amax of blocks held in parts with (None: not known here, see wb.Sender)

    def shapes(self, rank: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{buffer: (shape, dtype)}`` of the buffers trainer ``rank`` quantises into."""
        lay = next(t for t in self.trainers if t.worker.rank == rank)
        return {n: (b.shape, b.dtype) for n, b in lay.buffers.items() if n.startswith(PREFIX)}


def quantize_layouts(trainers: Sequence[Layout], scaled: BlockScaled) -> Quantized:
    """Gives every block of every declared tensor to one trainer buffer that holds it whole.

    Works on the source maps' affine rectangles (O(rectangles + blocks), never per element, for
    the usual layouts: row or column shards, transposes, stacks, flat shards); a buffer whose
    rectangles are none of those is read element by element.

    Args:
        trainers: the trainers' layouts (ids of ``scaled.trainer_spec``).
        scaled: the declaration bound to that spec (:meth:`wb.data.fp8.FP8Blocks.bind`).

    Returns:
        :class:`Quantized`: layouts to pass to :func:`wb.plan` with rollouts probed against
        ``scaled.spec``, and each trainer's tasks.

    Raises:
        PlanError: a block the trainers' buffers do not cover, not even in parts (which tensor,
            block, and by whom), or a trainer already has a buffer named like one wb adds.
    """
    g = Geometry.of(scaled)
    masked: list[dict[str, BufferSpec]] = []
    held: dict[int, Held] = {}  # candidate index -> what that buffer holds
    cand_names: list[tuple[int, str]] = []
    cand_key, cand_buf, part_key, part_buf = [], [], [], []
    for li, lay in enumerate(trainers):
        bufs = dict(lay.buffers)
        for name, b in lay.buffers.items():
            if name.startswith(PREFIX):
                raise PlanError(f"trainer rank {lay.worker.rank} has a buffer `{name}`: names "
                                f"starting with {PREFIX!r} are wb's (quantised blocks); rename it")
            h = analyse(b.sourcemap, g)
            if h is None:
                continue
            bufs[name] = BufferSpec(h.masked, b.dtype)
            held[len(cand_names)] = h
            cand_key.append(h.keys)
            cand_buf.append(np.full(h.keys.size, len(cand_names)))
            part_key.append(h.partial)
            part_buf.append(np.full(h.partial.size, len(cand_names)))
            cand_names.append((li, name))
        masked.append(bufs)
    ck = np.concatenate(cand_key) if cand_key else np.zeros(0, np.int64)
    cb = np.concatenate(cand_buf) if cand_buf else np.zeros(0, np.int64)
    order = np.lexsort((cb, ck))
    ck, cb = ck[order], cb[order]
    keys, start, count = np.unique(ck, return_index=True, return_counts=True)
    pk = np.concatenate(part_key) if part_key else np.zeros(0, np.int64)
    pb = np.concatenate(part_buf) if part_buf else np.zeros(0, np.int64)
    split = ~np.isin(pk, keys)  # blocks no buffer holds whole: each holder quantises its part
    pk, pb = pk[split], pb[split]
    _check_covered(pk, pb, held, cand_names, trainers, g)
    # replicas share the work in ranges of block rows, not block by block: a holder's blocks then
    # form large rectangles, and so do the pieces cut from them. Blocks with the same first and
    # last holding trainer and number of holders form a group (replicas: their holders); its
    # block rows, tensor after tensor, are cut into `count` ranges in order, so each replica
    # quantises whole tensors but at most one, and a rollout's range of one tensor comes from one
    # trainer (any candidate of a block holds it: the grouping weighs balance, not correctness).
    cand_li = np.array([li for li, _ in cand_names] or [0], np.int64)
    n_li, n_c = len(trainers) + 1, int(count.max(initial=0)) + 1
    group = (cand_li[cb[start]] * n_li + cand_li[cb[start + count - 1]]) * n_c + count
    row = g.t_of[keys] * (int(g.br.max(initial=0)) + 1) + g.br[keys]
    pairs, inv = np.unique(np.stack([group, row], 1), axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    g_first = np.searchsorted(pairs[:, 0], pairs[:, 0], side="left")
    g_size = np.searchsorted(pairs[:, 0], pairs[:, 0], side="right") - g_first
    at = (np.arange(len(pairs)) - g_first)[inv]
    chosen = cb[start + np.minimum(count - 1, at * count // g_size[inv])]
    tasks: dict[int, list[Task]] = {lay.worker.rank: [] for lay in trainers}
    for bi in np.union1d(chosen, pb).tolist():
        li, name = cand_names[bi]
        h = held[bi]
        mine, parts = keys[chosen == bi], np.sort(pk[pb == bi])
        shape = trainers[li].buffers[name].shape
        masked[li][PREFIX + name] = BufferSpec(
            mirror_map(h, np.union1d(mine, parts), g, shape), scaled.decl.format)
        for task in _tasks(h, mine, g, name) + _part_tasks(h, parts, g, name):
            masked[li][task.scales] = BufferSpec(SourceMap.from_indices(
                scaled.scale_offset[task.tensor] + task.blocks), "float32")
            tasks[trainers[li].worker.rank].append(task)
    layouts = tuple(Layout(lay.worker, masked[li]) for li, lay in enumerate(trainers))
    return Quantized(scaled, layouts, {r: tuple(ts) for r, ts in tasks.items()},
                     _peers(pk, np.array([trainers[li].worker.rank for li, _ in cand_names]
                                         or [0], np.int64)[pb], tasks))


def _check_covered(pk, pb, held, cand_names, trainers, g: Geometry) -> None:
    """Raises unless the parts the buffers hold of every block no buffer holds whole cover it."""
    if not pk.size:
        return
    bh, bw = g.block
    order = np.lexsort((pb, pk))
    pk, pb = pk[order], pb[order]
    keys, start = np.unique(pk, return_index=True)
    seen: dict[tuple, bool] = {}  # the same windows make the same answer
    for k, a, b in zip(keys.tolist(), start.tolist(), [*start[1:].tolist(), pk.size]):
        hb = min(bh, int(g.scaled.rows[g.t_of[k]]) - int(g.br[k]) * bh)
        wb = min(bw, int(g.scaled.cols[g.t_of[k]]) - int(g.bc[k]) * bw)
        wins, listed = set(), []
        for c in pb[a:b].tolist():
            h = held[c]
            i = int(np.searchsorted(h.partial, k))
            if h.part_at[i, 0] < 0:
                listed.append(h.odd[k])
            else:
                i0, i1, j0, j1 = h.part_win[i].tolist()
                wins.add((i0, min(i1, hb), j0, min(j1, wb)))
        sig = (hb, wb, tuple(sorted(wins)))
        if not listed and sig in seen:
            ok = seen[sig]
        else:
            mask = np.zeros((bh, bw), bool)
            for i0, i1, j0, j1 in wins:
                mask[i0:i1, j0:j1] = True
            for p in listed:
                mask |= p >= 0
            ok = bool(mask[:hb, :wb].all())
            if not listed:
                seen[sig] = ok
        if not ok:
            t = int(g.t_of[k])
            who = ", ".join(f"rank {trainers[cand_names[c][0]].worker.rank} "
                            f"`{cand_names[c][1]}`" for c in pb[a:b][:4].tolist())
            raise PlanError(
                f"block ({int(g.br[k])}, {int(g.bc[k])}) of `{g.scaled.names[t]}` (rows "
                f"{int(g.br[k]) * bh}.., cols {int(g.bc[k]) * bw}..) is held only in parts "
                f"({who}) that do not cover it, so its scale cannot be computed; give the "
                f"trainers every element of `{g.scaled.names[t]}` or leave it out of "
                f"FP8Blocks.tensors")


def _peers(pk, ranks, tasks) -> dict[int, tuple[int, ...]]:
    """``{rank: other ranks holding parts of the same blocks}`` (``pk``: split block keys,
    ``ranks``: the rank holding each part)."""
    out: dict[int, set] = {r: set() for r in tasks}
    if pk.size:
        order = np.argsort(pk, kind="stable")
        pk, ranks = pk[order], ranks[order]
        cut = np.flatnonzero(np.diff(pk)) + 1
        for group in {tuple(sorted(set(x.tolist()))) for x in np.split(ranks, cut)}:
            for r in group:
                out[r].update(group)
    return {r: tuple(sorted(s - {r})) for r, s in out.items()}


def tasks_for(scaled: BlockScaled, own: Layout, planned: Layout) -> Quantized:
    """One trainer's part of :func:`quantize_layouts`, rebuilt from its own layout and its layout
    in the plan (what :func:`wb.agree_parts` gives it): the tasks need not travel.

    Args:
        scaled: the declaration, bound to the trainers' spec.
        own: the trainer's layout as it holds its weights.
        planned: its layout in the plan (``plan.layout_of(rank)``).

    Returns:
        :class:`Quantized` of this one trainer (``trainers == (planned,)``).

    Raises:
        PlanError: ``planned`` has a quantised buffer that ``own`` does not explain, or blocks
            ``own`` does not hold whole.
    """
    g = Geometry.of(scaled)
    scale_of = {scaled.scale_name(t): t for t in range(len(scaled.names))}
    rank = planned.worker.rank
    mine: dict[tuple[str, bool], list] = {}
    for sname, b in planned.buffers.items():
        if not sname.startswith(PREFIX) or sname[len(PREFIX):] in own.buffers:
            continue  # not wb's, or a quantised copy (its tasks come with its scales)
        body = sname[len(PREFIX):]
        part = body.endswith(PART)
        body = body[:-len(PART)] if part else body
        hit = [(body[:-len(k) - 1], t) for k, t in scale_of.items() if body.endswith(":" + k)]
        hit = [(src, t) for src, t in hit if src in own.buffers]
        if not hit:
            raise PlanError(f"trainer rank {rank}: the plan has a buffer `{sname}` that no "
                            f"buffer of its own layout and no declared tensor explain; the plan "
                            f"was made from other layouts or another declaration")
        src, t = hit[0]
        local = b.sourcemap.to_indices().reshape(-1)
        mine.setdefault((src, part), []).append(g.key0[t] + local - scaled.scale_offset[t])
    tasks = []
    for (src, part), parts in mine.items():
        h = analyse(own.buffers[src].sourcemap, g)
        want = np.sort(np.concatenate(parts))
        if h is None or not np.isin(want, h.partial if part else h.keys).all():
            raise PlanError(f"trainer rank {rank}: the plan quantises blocks that `{src}` does "
                            f"not hold {'in part' if part else 'whole'}; the plan was made from "
                            f"other layouts")
        tasks += (_part_tasks if part else _tasks)(h, want, g, src)
    return Quantized(scaled, (planned,), {rank: tuple(tasks)})


def _tasks(h: Held, mine: np.ndarray, g: Geometry, source: str) -> list[Task]:
    """The tasks of blocks ``mine`` (sorted keys) that buffer ``source`` holds whole (``h``)."""
    out = []
    for t in np.unique(g.t_of[mine]).tolist():
        tk = mine[g.t_of[mine] == t]
        at = h.at[np.searchsorted(h.keys, tk)]
        odd = [h.odd[k].reshape(-1) for k, a in zip(tk.tolist(), at[:, 0].tolist()) if a < 0]
        gather = np.concatenate(odd) if odd else np.zeros(0, np.int64)
        sname = f"{PREFIX}{source}:{g.scaled.scale_name(t)}"
        out.append(Task(t, source, PREFIX + source, sname, tk - g.key0[t], at, gather))
    return out


def _part_tasks(h: Held, mine: np.ndarray, g: Geometry, source: str) -> list[Task]:
    """The tasks of blocks ``mine`` (sorted keys) that buffer ``source`` holds in part."""
    out = []
    for t in np.unique(g.t_of[mine]).tolist():
        tk = mine[g.t_of[mine] == t]
        i = np.searchsorted(h.partial, tk)
        at, win = h.part_at[i], h.part_win[i]
        odd = [h.odd[k].reshape(-1) for k, a in zip(tk.tolist(), at[:, 0].tolist()) if a < 0]
        gather = np.concatenate(odd) if odd else np.zeros(0, np.int64)
        sname = f"{PREFIX}{source}:{g.scaled.scale_name(t)}{PART}"
        out.append(Task(t, source, PREFIX + source, sname, tk - g.key0[t], at, gather, win,
                        True))
    return out


def partial_amax(q: Quantized, rank: int, buffers: Mapping[str, np.ndarray], *,
                 chunk: int = 1 << 22) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, amax)``: ``max |x|`` (float32 values as float64; NaN where a part holds a NaN)
    of the part of every block trainer ``rank`` holds in part (:meth:`Task.keys`, sorted), from
    its ``buffers`` (numpy), ``chunk`` elements of blocks at a time. A block's ``amax`` is the
    largest over its parts (:func:`combine_amax`)."""
    bh, bw = q.scaled.decl.block
    step = max(1, chunk // (bh * bw))
    keys, amax = [], []
    for task in q.tasks.get(rank, ()):
        if not task.part:
            continue
        src = np.asarray(buffers[task.source]).reshape(-1)
        on = task.device_arrays(np, bh, bw)
        keys.append(task.keys())
        for lo in range(0, task.blocks.size, step):
            pos = task.positions(q.scaled, lo, lo + step, on=on)
            x = np.where(pos >= 0, src[np.maximum(pos, 0)], np.zeros((), src.dtype))
            with np.errstate(all="ignore"):
                amax.append(block_amax(x).astype(np.float64))
    if not keys:
        return np.zeros(0, np.int64), np.zeros(0)
    return combine_amax([(np.concatenate(keys), np.concatenate(amax))])


def combine_amax(parts) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, amax)`` over ``parts`` (pairs of keys and amax): each key once, sorted, with its
    largest amax (NaN if any is NaN, as the rule has it)."""
    parts = list(parts)
    k = np.concatenate([np.asarray(a, np.int64) for a, _ in parts] or [np.zeros(0, np.int64)])
    v = np.concatenate([np.asarray(b, np.float64) for _, b in parts] or [np.zeros(0)])
    keys, inv = np.unique(k, return_inverse=True)
    out = np.full(keys.size, -np.inf)
    np.maximum.at(out, inv.reshape(-1), v)  # NaN propagates
    return keys, out


def quantize_buffers(q: Quantized, rank: int, buffers: Mapping[str, np.ndarray], *,
                     out: Mapping[str, np.ndarray] | None = None,
                     chunk: int = 1 << 22, amax: tuple | None = None) -> dict[str, np.ndarray]:
    """Trainer ``rank``'s quantised blocks and scales, from its own ``buffers`` (numpy), a chunk
    of about ``chunk`` elements of blocks at a time.

    Args:
        q: from :func:`quantize_layouts`.
        rank: the trainer's rank.
        buffers: its buffers (``{name: array}``, the layout's shapes).
        out: the arrays to write into (as returned before); new ones when ``None``.
        chunk: elements quantised at once (bounds the temporaries).
        amax: ``(keys, amax)`` of the blocks it holds in part, over the whole block
            (:func:`combine_amax` of every holder's :func:`partial_amax`); needed when it
            holds any.

    Returns:
        ``{buffer name: array}`` of the buffers it quantises into (:meth:`Quantized.shapes`).

    Raises:
        ValueError: blocks held in part, and no ``amax`` for them.
    """
    bh, bw = q.scaled.decl.block
    fmt = q.scaled.decl.format
    res = dict(out) if out is not None else {
        n: np.zeros(s, dtype_info(d).numpy) for n, (s, d) in q.shapes(rank).items()}
    step = max(1, chunk // (bh * bw))
    for task in q.tasks.get(rank, ()):
        src = np.asarray(buffers[task.source]).reshape(-1)
        dst = res[task.weights].reshape(-1)
        on = task.device_arrays(np, bh, bw)  # once per task, not per chunk
        whole = None
        if task.part:
            keys = task.keys()
            i = np.searchsorted(amax[0], keys) if amax is not None else None
            if i is None or (i >= amax[0].size).any() or (amax[0][np.minimum(
                    i, amax[0].size - 1)] != keys).any():
                raise ValueError(f"rank {rank}: `{task.source}` holds blocks of "
                                 f"`{q.scaled.names[task.tensor]}` in part: their amax over the "
                                 f"whole block is needed (amax=)")
            whole = amax[1][i]
        for lo in range(0, task.blocks.size, step):
            pos = task.positions(q.scaled, lo, lo + step, on=on)
            ok = pos >= 0
            v = np.zeros(pos.shape, src.dtype)
            v[ok] = src[pos[ok]]
            qv, s = quantize_blocks(v, fmt, amax=None if whole is None else whole[lo:lo + step])
            dst[pos[ok]] = qv[ok]
            res[task.scales][lo:lo + step] = s
    return res


def quantize_all(q: Quantized, buffers: Mapping[int, Mapping[str, np.ndarray]]
                 ) -> dict[int, dict[str, np.ndarray]]:
    """Every trainer's :func:`quantize_buffers` in one process (tests, simulations): the
    ``amax`` of blocks held in parts is exchanged here.

    Args:
        q: from :func:`quantize_layouts`.
        buffers: ``{rank: {name: array}}`` of every trainer of ``q``.

    Returns:
        ``{rank: {buffer name: array}}`` of the buffers each quantises into.
    """
    amax = combine_amax(partial_amax(q, r, b) for r, b in buffers.items())
    return {r: quantize_buffers(q, r, b, amax=amax) for r, b in buffers.items()}
