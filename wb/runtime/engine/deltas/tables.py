"""The delta codec over many messages at once on a CUDA device (:mod:`wb.runtime.engine.deltas.
device` makes and applies one): each step one launch over every block of every message,
driven by a table of them that the host writes once.

- encode (:func:`advance_many`: the deltas of a turn's sends): ``wb_delta_count_many`` counts
  each block's changes, the host reads the counts (its one read: :func:`count_many`, then
  :func:`write_many`), chooses each message's encoding and writes one table, and
  ``wb_delta_compact_many`` writes every BLOCKS delta whole into one buffer, each base taking
  the changed elements as they are read;
- apply (:func:`apply_many`): the deltas that came, checked and scattered by two launches that
  read each delta's header where it lies (the host reads nothing before), a flag and a size
  per delta written for the host to read with whatever it reads next (:func:`flags_and_sizes`,
  :func:`read_flags`);
- :func:`prepare`: every step run once on tiny messages, so that a job's first delta compiles
  nothing.

The tests run the same steps over the kernels compiled for the host (``tests/harness/
host_device.py``).
"""

from __future__ import annotations

import functools

import numpy as np

from wb.algorithms import delta as codec
from wb.runtime.engine.deltas import device as one
from wb.runtime.engine.deltas.kernels import THREADS
from wb.runtime.engine.gather import Regions

__all__ = ["advance_many", "count_many", "write_many", "apply_many", "flags_and_sizes",
           "read_flags", "headers", "received_many", "prepare"]


def apply_many(items, bad, sizes, *, xp) -> None:
    """Several :data:`~wb.algorithms.delta.BLOCKS` deltas applied on a CUDA device in two
    launches (:func:`kernel_source`'s ``wb_delta_check_many`` and ``wb_delta_scatter_many``),
    each reading its delta's header on the device: the host reads nothing.

    ``items``: ``(target, buf, w, j)``: a receive ``buf`` with a delta at its start (it may hold
    more), for ``target`` (contiguous, or :class:`Regions`: a delta of another element width
    than the regions' is left to the host, flag 2; of elements of ``w`` bytes as the host
    expects them);
    ``j`` its place in ``bad`` (a device ``uint32`` array of zeros) and in ``sizes`` (a device
    ``int64`` array). A delta is applied and its size written to ``sizes[j]``, or ``bad[j]`` is
    set and nothing of its target written (its size says nothing then): 1 where the delta is
    malformed (its sizes disagree with its header or the target, a place out of order or past
    the end, counts not its own), 2 where it is not a BLOCKS delta, or its element width gives
    the target another number of blocks than ``w`` does (the host applies it: :func:`~wb.
    runtime.engine.deltas.device.apply`; a delta of another width with as many blocks is applied
    here, as the host codec would).

    Raises:
        ValueError: a target or receive is not contiguous, a target is empty or not a whole
            number of elements, or regions have no rows or a table that is not contiguous (the
            host applies those).
    """
    rows, nbs, total = [], [], 0
    for target, buf, w, j in items:
        spread = target.__class__ is Regions
        if not ((spread or target.flags.c_contiguous) and buf.flags.c_contiguous):
            raise ValueError("delta: apply_many's targets and receives must be contiguous")
        if spread and (not target.table.flags.c_contiguous or target.table.ndim != 2
                       or not target.table.shape[1]):
            raise ValueError("delta: apply_many's regions need a contiguous table of rows")
        t = target.nbytes
        if w not in one.WIDTHS or not t or t % w:
            raise ValueError(f"delta: apply_many takes targets of whole {w}-byte elements, not "
                             f"{t:,} bytes")
        nb = -(-(t // w) // codec.BLOCK)
        rows.append((one.address(buf), target.itemsize, t, buf.nbytes, nb, j, total,
                     one.address(target.table), target.table.shape[1], one.address(target.ptrs))
                    if spread else
                    (one.address(buf), one.address(target), t, buf.nbytes, nb, j, total, 0, 0, 0))
        nbs.append(nb)
        total += nb
    if not total:
        return
    args = _table(xp, rows, nbs)  # the one write
    starts = xp.empty(total, xp.int64)
    m = one.kernel_module()
    m.get_function("wb_delta_check_many")((total,), (THREADS,), args + (starts, bad, sizes))
    m.get_function("wb_delta_scatter_many")((total,), (THREADS,), args + (starts, bad))


def flags_and_sizes(n: int, *, xp):
    """``(state, flags, sizes)`` for :func:`apply_many` over ``n`` deltas: one device array of
    zeros (``state``, what the host copies back: :func:`read_flags`) and its two views."""
    state = xp.zeros(3 * max(n, 1), xp.uint32)
    return state, state[2 * n:], state[:2 * n].view(xp.int64)


def read_flags(host, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``(flags, sizes)`` from the host bytes of :func:`flags_and_sizes`'s ``state``."""
    host = np.asarray(host).view(np.uint32)
    return host[2 * n:3 * n], host[:2 * n].view(np.int64)


def prepare(xp) -> None:
    """Compiles the kernels and runs every step of the codec once on tiny messages (CuPy compiles
    its own operations on first use too), so that a job's first delta costs no compilation: a
    few hundred milliseconds once per process and device, on the job's first update."""
    if xp is np:
        return
    _prepared(xp, xp.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _prepared(xp, device: int) -> None:
    rng = np.random.default_rng(0)
    jobs = []
    for w, density in [(1, 0.01), (2, 0.01), (4, 0.01), (8, 0.01), (2, 0.5), (2, 1.0)]:
        base = rng.integers(0, 256, 4096 * w, dtype=np.uint8)
        new = base.copy()
        new.reshape(-1, w)[rng.random(4096) < density, 0] ^= 1
        jobs.append((xp.asarray(base), xp.asarray(new), w, base))
    made = advance_many([(b, n, w) for b, n, w, _ in jobs], xp=xp)
    heads = received_many(made, xp=xp)
    state, bad, sizes = flags_and_sizes(len(made), xp=xp)
    together = []
    for j, ((got, head), (_, _, w, base)) in enumerate(zip(heads, jobs)):
        together.append((xp.asarray(base), got, w, j))
        if codec.header(head)[0] == codec.BLOCKS:
            one.apply(xp.asarray(base), got, xp=xp, head=head, bad=bad[j:j + 1])
        else:
            one.apply(xp.asarray(base), got, xp=xp, head=head)
    apply_many(together, bad, sizes, xp=xp)
    state.get()


def _heads(bufs, xp):
    """The headers at the start of ``bufs``, one after another in one device array."""
    return xp.concatenate([b.reshape(-1).view(xp.uint8)[:codec.HEADER.size] for b in bufs])


def headers(bufs, *, xp):
    """The headers of the deltas at the start of ``bufs`` (receives), gathered on the device and
    copied to the host without waiting (:func:`to_host`); :func:`sized` reads them."""
    return one.to_host(_heads(bufs, xp), xp=xp)


def received_many(bufs, *, xp):
    """:func:`received` for several receives, their headers read by the host in one go."""
    if xp is np or not bufs:
        return [one.received(b, xp=xp) for b in bufs]
    return one.sized(bufs, _heads(bufs, xp).get(), xp=xp)


def advance_many(jobs, *, xp):
    """The deltas of several messages at once, each base then holding its new bytes.

    ``jobs``: ``(base, new, itemsize)`` byte arrays of one size each. Returns each job's delta,
    the bytes :func:`~wb.runtime.engine.deltas.device.encode` makes. On a CUDA device: one
    launch counts the changes of every block of every message, the host reads the counts (its
    one read) and writes one table, and one launch writes every :data:`~wb.algorithms.delta.
    BLOCKS` delta whole, each base taking the changed elements as they are read (a message's
    base costs no copy); a mask or a dense delta (most elements changed) is written apart. The
    deltas are queued on the current stream: the caller waits for it before they leave.
    """
    if xp is np:
        out = []
        for base, new, w in jobs:
            out.append(one.encode(base, new, itemsize=w, xp=xp))
            base.reshape(-1).view(xp.uint8)[:] = new.reshape(-1).view(xp.uint8)
        return out
    counted = count_many(jobs, xp=xp)
    return write_many(counted, counted[0].get(), xp=xp)  # the one read


def _span(a, w: int, *, written: bool, xp):
    """``(array, address, elements)`` of byte array ``a`` read as elements of ``w`` bytes; one
    the kernels write (``written``) must be contiguous (a copy would take the writes)."""
    if w not in one.WIDTHS:
        raise ValueError(f"delta: itemsize={w} must be one of {one.WIDTHS}")
    if not a.flags.c_contiguous:
        if written:
            raise ValueError("delta: a base or target the kernels write must be contiguous")
        a = xp.ascontiguousarray(a)
    if a.nbytes % w:
        raise ValueError(f"delta: {a.nbytes:,} bytes are not a multiple of itemsize={w}")
    return a, one.address(a), a.nbytes // w


def count_many(jobs, *, xp):
    """:func:`advance_many`'s first launch: every block of every message's changes counted on
    the device. Returns what :func:`write_many` takes, the device counts first (the host reads
    them: ``.get()``, or without waiting: :func:`to_host`)."""
    rows, views = [], []
    for base, new, w in jobs:
        b, ab, nb_ = _span(base, w, written=True, xp=xp)
        v, av, n = _span(new, w, written=False, xp=xp)
        if n != nb_:
            raise ValueError(f"delta: base holds {b.nbytes:,} bytes, new {v.nbytes:,}: they "
                             f"must be one size")
        views.append((b, v, w, n))
        rows.append((ab, av, n, w, 0))
    ns = np.array([r[2] for r in rows], np.int64)
    nbs = -(-ns // codec.BLOCK)
    first = np.concatenate([[0], np.cumsum(nbs)]).astype(np.int64)
    total = int(first[-1])
    counts = xp.empty(max(total, 1), xp.uint32)
    if total:  # every message's changes counted by one launch
        tab = np.array(rows, np.int64).reshape(-1, 5)
        tab[:, 4] = first[:-1]
        dev, block_job = _table(xp, tab, nbs)
        one.kernel_module().get_function("wb_delta_count_many")(
            (total,), (THREADS,), (dev, block_job, counts))
    return counts, views, nbs, first


#: Where each of a batch's deltas starts in their one buffer: a multiple of this many bytes.
_ALIGN = 256


def write_many(counted, host, *, xp):
    """:func:`advance_many`'s second launch, once the host holds the counts (``host``, the bytes
    or the ``uint32`` array of ``counted[0]``): every delta written (into one buffer, each
    returned as its part), each base advanced. Returns the deltas, queued on the current
    stream."""
    counts, views, nbs, first = counted
    total = int(first[-1])
    host = np.asarray(host).view(np.uint32)[:total]
    ends = np.concatenate([[0], np.cumsum(host, dtype=np.int64)])
    ks = ends[first[1:]] - ends[first[:-1]]
    begin = ends[:-1] - np.repeat(ends[first[:-1]], nbs)  # each block's first change in its delta
    kinds, sizes, heads = [], [], np.zeros((len(views), 4), np.int64)
    for j, ((_, _, w, n), k) in enumerate(zip(views, ks.tolist())):
        kind, nbytes = codec.choose(n, k, w)
        kinds.append(kind)
        sizes.append(nbytes)
        codec.HEADER.pack_into(heads[j].view(np.uint8), 0, kind, w, nbytes, n,
                               n if kind == codec.DENSE else k)
    sizes = np.array(sizes, np.int64)
    offs = np.concatenate([[0], np.cumsum(-(-sizes // _ALIGN) * _ALIGN)])
    buf = xp.empty(max(int(offs[-1]), 1), xp.uint8)
    out = [buf[o:o + z] for o, z in zip(offs[:-1].tolist(), sizes.tolist())]
    blocks = np.array([kd == codec.BLOCKS for kd in kinds]) & (nbs > 0)
    if blocks.any():  # every BLOCKS delta written by one launch: header, values, counts, places
        ws = np.array([w for _, _, w, _ in views], np.int64)
        vals_end = codec.HEADER.size + ks * ws
        at = vals_end + np.array([codec.values_pad(k, w) for k, w in zip(ks.tolist(),
                                                                         ws.tolist())], np.int64)
        first_of = np.concatenate([[0], np.cumsum(nbs[blocks])])[:-1]
        tab = np.column_stack([
            [one.address(b) for b, _, _, _ in views], [one.address(v) for _, v, _, _ in views],
            [n for _, _, _, n in views], ws, one.address(buf) + offs[:-1],
            np.zeros(len(views), np.int64), at, at + 4 * nbs, heads, vals_end,
            first[:-1]])[blocks].astype(np.int64)
        tab[:, 5] = first_of
        mine = np.repeat(blocks, nbs)
        dev, block_job, at_dev = _table(xp, tab, nbs[blocks], begin[mine])
        one.kernel_module().get_function("wb_delta_compact_many")(
            (int(mine.sum()),), (THREADS,), (dev, block_job, at_dev, counts))
    for j in np.flatnonzero(~blocks).tolist():  # a mask, the dense bytes, or no elements
        (b, v, w, n), d, at, kind, k = views[j], out[j], codec.HEADER.size, kinds[j], int(ks[j])
        b, v = one.elements(b, w, xp), one.elements(v, w, xp)
        d[:at] = xp.asarray(heads[j].view(np.uint8))
        if kind == codec.DENSE:
            d[at:] = v.view(xp.uint8)
            b[:] = v
            continue
        values, tail = d[at:at + k * w].view(f"<u{w}"), at + k * w
        if kind == codec.MASK:
            places = xp.empty(max(k, 1), xp.uint16)  # not sent: the mask says where
            d[tail:] = xp.packbits(b != v, bitorder="little")  # before the base advances
        else:  # no elements
            places = d[tail:].view("<u2")
        if k:
            one.kernels_of(w)[1]((int(nbs[j]),), (THREADS,), (
                b, v, np.int64(n), xp.asarray(begin[first[j]:first[j + 1]]), values,
                places, np.int32(1)))
    return out


def _table(xp, rows, nbs, starts=None):
    """``rows`` (an ``int64`` array, a row per job), each global block's job (job ``j`` has
    ``nbs[j]`` blocks) and (optionally) each block's start, on the device by one write; returns
    their device arrays: ``(rows, block_job)`` or ``(rows, block_job, starts)``."""
    tab = np.ascontiguousarray(rows, np.int64).reshape(-1)
    jobs = np.repeat(np.arange(len(nbs), dtype=np.int32), nbs)
    parts = [tab.view(np.uint8)]
    if starts is not None:
        parts.append(np.ascontiguousarray(starts, np.int64).view(np.uint8))
    dev = xp.asarray(np.concatenate(parts + [jobs.view(np.uint8)]))
    a = tab.nbytes
    out = [dev[:a].view(xp.int64)]
    if starts is not None:
        b = a + 8 * jobs.size
        return out[0], dev[b:].view(xp.int32), dev[a:b].view(xp.int64)
    return out[0], dev[a:].view(xp.int32)
