"""A delta applied where a unit received packed lies (``wb.runtime.engine.gather.Regions``
targets of ``deltas.tables.apply_many``), checked on whichever memory the kernels run on: the
host-compiled ones (``tests/test_delta_kernel_host.py``) or a GPU's
(``tests/test_delta_cuda.py``)."""

from __future__ import annotations

import numpy as np

from wb.algorithms import delta as codec
from wb.runtime.engine import gather
from wb.runtime.engine.deltas import tables as many

__all__ = ["check"]

# (slot, f0, na, nb, fa, fb): rows of a matrix, a transposed block, regions of three elements
# (a block of the delta crosses hundreds of them), one range longer than a table row, short rows
_SPANS = [(0, 10, 40, 100, 120, 1), (1, 5, 30, 20, 1, 40)]
_SPANS += [(i % 2, 20_000 + 7 * i, 1, 3, 3, 1) for i in range(300)]
_SPANS += [(0, 150_000, 1, 140_000, 140_000, 1), (1, 60_000, 50, 7, 300, 1)]


def _message(bufs, spans=_SPANS):
    """The message the regions hold: every region's elements, row by row."""
    out = []
    for b, (_, f0, na, nb, fa, fb) in ((bufs[s[0]], s) for s in spans):
        i, j = np.meshgrid(np.arange(na), np.arange(nb), indexing="ij")
        out.append(b[f0 + i * fa + j * fb].reshape(-1))
    return np.concatenate(out)


def check(xp, on, back, address, w: int) -> None:
    """Two buffers of ``w``-byte elements (``on``: numpy to the kernels' memory, ``back`` the
    reverse, ``address`` an array's address there), a message of their regions (:data:`_SPANS`)
    and a delta of it (5% of its elements changed, the last too): applied through the regions'
    table, every change lands where the message's element lies (as the host codec applied to
    the message gathered says); no other byte changes; a malformed copy of the delta (a place
    out of order) is flagged 1, a delta of the same bytes in another element width flagged 2
    (the host applies it: the regions are in their own width), and neither writes anything;
    then a delta of changes far apart (the last element among them) lands as the codec says."""
    rng = np.random.default_rng(w)
    dt = np.dtype(f"u{w}")
    host = [rng.integers(0, 1 << 8 * w - 1, size, dtype=np.uint64).astype(dt)
            for size in (300_000, 90_000)]
    old = _message(host)
    new = old.copy()
    new[rng.random(new.size) < 0.05] ^= 1
    new[-1] ^= 2
    d = codec.encode(old.view(np.uint8), new.view(np.uint8), itemsize=w)
    assert codec.kind_of(d) == "blocks"
    broken = d.copy()
    broken[-2:].view("<u2")[0] = 0  # the last block's last place before the one ahead of it
    # the same bytes in another width: for the first two regions alone (4,600 elements), so
    # that it has as many blocks as the regions' width gives (one)
    few = _message(host, _SPANS[:2])
    changed = few.copy()
    changed[::97] ^= 1
    other = codec.encode(few.view(np.uint8), changed.view(np.uint8), itemsize=1 if w > 1 else 2)
    assert codec.kind_of(other) == "blocks"
    bufs = [on(h) for h in host]
    ptrs = on(np.array([address(b) for b in bufs], np.uint64))
    target = gather.Regions(on(gather.table(_SPANS, piece=4096)), ptrs, old.nbytes, w)
    first = gather.Regions(on(gather.table(_SPANS[:2])), ptrs, few.nbytes, w)
    bad, sizes = on(np.zeros(3, np.uint32)), on(np.zeros(3, np.int64))
    many.apply_many([(target, on(d), w, 0), (target, on(broken), w, 1),
                     (first, on(other), w, 2)], bad, sizes, xp=xp)
    assert back(bad).tolist() == [0, 1, 2] and int(back(sizes)[0]) == d.nbytes
    got = [back(b) for b in bufs]
    assert np.array_equal(_message(got), new)
    # changes far apart (on a GPU a thread's next change lies a block's threads on: the table
    # is searched past a few rows, not walked): regions' first and last elements, and, in the
    # last block of the delta, one far before the message's last element (the table's last
    # row; rows of 512 elements here, so that the last block holds dozens)
    sparse = new.copy()
    sparse[[4600 + 3 * i for i in range(0, 300, 20)] + [4602 + 3 * i for i in range(10, 300, 20)]
           + [131_100, new.size - 1]] ^= 4
    far = codec.encode(new.view(np.uint8), sparse.view(np.uint8), itemsize=w)
    assert codec.kind_of(far) == "blocks"
    bad, sizes = on(np.zeros(1, np.uint32)), on(np.zeros(1, np.int64))
    rows512 = gather.Regions(on(gather.table(_SPANS, piece=512)), ptrs, old.nbytes, w)
    many.apply_many([(rows512, on(far), w, 0)], bad, sizes, xp=xp)
    assert back(bad).tolist() == [0]
    got = [back(b) for b in bufs]
    assert np.array_equal(_message(got), sparse)
    for h, (_, f0, na, nb, fa, fb), part in zip(  # the old message put back: the old buffers
            (got[s[0]] for s in _SPANS), _SPANS,
            np.split(old, np.cumsum([s[2] * s[3] for s in _SPANS])[:-1])):
        i, j = np.meshgrid(np.arange(na), np.arange(nb), indexing="ij")
        h[f0 + i * fa + j * fb] = part.reshape(na, nb)
    assert all(np.array_equal(a, b) for a, b in zip(got, host))
