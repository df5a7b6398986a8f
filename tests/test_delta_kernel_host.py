"""The delta codec's kernels (``wb.runtime.engine.deltas.kernels``), their CUDA source compiled
for the host with one thread a block (``harness.host_device``), every block run in turn,
against the host codec: the changes counted per block of 65,536 elements, and their values and
places written in order, are the bytes of ``wb.algorithms.delta.encode``'s ``BLOCKS`` delta;
applying one (each place checked and its position written, then a scatter) gives what
``wb.algorithms.delta.apply`` gives, and a place out of order or past the end is flagged; the
steps over several messages (one launch each) and the codec's warm-up run on them too. On a
GPU, ``tests/test_delta_cuda.py`` runs the same source with 1,024 threads a block."""

import ctypes
import shutil

import numpy as np
import pytest

from harness.host_device import Dev as _Dev
from harness.host_device import Module as _Module
from harness.host_device import Xp as _Xp
from harness.host_device import compile_kernels
from wb.algorithms import delta as codec

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return compile_kernels(tmp_path_factory.mktemp("delta_kernel"))


def _ptr(a: np.ndarray):
    return ctypes.c_void_p(a.ctypes.data)


@pytest.mark.parametrize("w", [1, 2, 4, 8])
@pytest.mark.parametrize("density", [0.0, 0.001, 0.03, 0.6])
def test_the_kernels_write_the_host_codec_s_counts_values_and_places(lib, w, density):
    n = 2 * codec.BLOCK + 333
    rng = np.random.default_rng(int(density * 1e4) + w)
    base = rng.integers(0, 256, n * w, dtype=np.uint8)
    new = base.copy()
    new.reshape(n, w)[rng.random(n) < density, 0] ^= 0x11
    new.reshape(n, w)[[0, codec.BLOCK - 1, codec.BLOCK, n - 1], -1] ^= 0x80  # the edges
    nb = -(-n // codec.BLOCK)
    count, compact = getattr(lib, f"wb_delta_count_{w}"), getattr(lib, f"wb_delta_compact_{w}")
    counts = np.zeros(nb, np.uint32)
    for b in range(nb):
        lib.block(ctypes.c_longlong(b))
        count(_ptr(base), _ptr(new), ctypes.c_longlong(n), _ptr(counts))
    k = int(counts.sum())
    starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)[:-1]])
    pos = codec.changed(base, new, itemsize=w)
    for advance in (0, 1):  # advancing: the base takes the new values as they are read
        values = np.zeros(max(k, 1), f"u{w}")
        places = np.zeros(max(k, 1), np.uint16)
        a = base.copy()
        for b in range(nb):
            lib.block(ctypes.c_longlong(b))
            compact(_ptr(a), _ptr(new), ctypes.c_longlong(n), _ptr(starts), _ptr(values),
                    _ptr(places), ctypes.c_int(advance))
        assert k == pos.size
        assert np.array_equal(counts, np.bincount(pos >> 16, minlength=nb))
        assert np.array_equal(values[:k], new.view(f"u{w}")[pos])
        assert np.array_equal(places[:k], (pos & (codec.BLOCK - 1)).astype(np.uint16))
        assert (a == (new if advance else base)).all()


@pytest.mark.parametrize("w", [1, 2, 4, 8])
def test_the_apply_kernels_write_what_the_host_codec_applies_and_flag_bad_places(lib, w):
    n = 2 * codec.BLOCK + 333
    rng = np.random.default_rng(w)
    base = rng.integers(0, 256, n * w, dtype=np.uint8)
    new = base.copy()
    new.reshape(n, w)[rng.random(n) < 0.02, 0] ^= 0x11
    new.reshape(n, w)[n - 1, 0] ^= 0x11  # a change in the last block
    d = codec.encode(base, new, itemsize=w)
    _, _, _, _, k = codec.header(d)
    nb = -(-n // codec.BLOCK)
    at = codec.HEADER.size
    values = d[at:at + k * w].view(f"u{w}").copy()
    tail = d[at + k * w:]
    pad = codec.values_pad(k, w)
    counts = tail[pad:pad + 4 * nb].view("<u4")
    places = tail[pad + 4 * nb:].view("<u2").copy()
    starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])

    def run(places, k=k):
        pos, bad = np.zeros(max(k, int(starts[-1])), np.int64), np.zeros(1, np.uint32)
        for b in range(nb):
            lib.block(ctypes.c_longlong(b))
            lib.wb_delta_positions(_ptr(places), _ptr(starts), ctypes.c_longlong(n),
                                   ctypes.c_longlong(nb), ctypes.c_longlong(k), _ptr(pos),
                                   _ptr(bad))
        return pos, bad

    def scatter(pos, bad):
        out = base.copy()
        lib.block(ctypes.c_longlong(0))
        getattr(lib, f"wb_delta_scatter_{w}")(_ptr(out), _ptr(values), _ptr(pos),
                                              ctypes.c_longlong(k), _ptr(bad))
        return out
    pos, bad = run(places)
    assert bad[0] == 0 and np.array_equal(pos, codec.changed(base, new, itemsize=w))
    assert scatter(pos, bad).tobytes() == new.tobytes()
    for j, place in ((k - 1, 0xFFFF), (1, 0)):  # past the end; before the change ahead of it
        bad_places = places.copy()
        bad_places[j] = place
        pos, bad = run(bad_places)
        assert bad[0] == 1
        assert scatter(pos, bad).tobytes() == base.tobytes()  # a flagged delta writes nothing
    assert run(places, k=k - 1)[1][0] == 1  # counts that are not the header's k


def test_the_batched_device_steps_run_on_the_host_kernels(lib, monkeypatch):
    """advance_many's and apply's device branches (one read of all the counts, the bases advanced
    by the compaction, the flag of a bad delta), with the kernels compiled for the host."""
    from wb.runtime.engine.deltas import device as dev
    from wb.runtime.engine.deltas import tables as many

    monkeypatch.setattr(dev, "kernel_module", lambda: _Module(lib))
    xp = _Xp()
    rng = np.random.default_rng(3)
    jobs, want, olds = [], [], []
    for w, n, density in [(2, 2 * codec.BLOCK + 9, 0.03), (1, 700, 0.0), (4, 5000, 0.3),
                          (8, 300, 1.0)]:
        base = rng.integers(0, 256, n * w, dtype=np.uint8)
        new = base.copy()
        new.reshape(n, w)[rng.random(n) < density, 0] ^= 0x5
        want.append(codec.encode(base, new, itemsize=w))
        olds.append(base)
        jobs.append((base.copy().view(_Dev), new.view(_Dev), w))
    assert {codec.kind_of(d) for d in want} == {"blocks", "mask", "dense"}
    made = many.advance_many(jobs, xp=xp)
    for d, want_d, (base, new, _) in zip(made, want, jobs):
        assert d.tobytes() == want_d.tobytes()
        assert base.tobytes() == new.tobytes()  # advanced: the base holds the new bytes
    received = many.received_many([np.concatenate([d, np.zeros(5, np.uint8)]).view(_Dev)
                                  for d in made], xp=xp)
    assert [got.nbytes for got, _ in received] == [d.nbytes for d in made]
    got, head = received[0]
    late = got.copy()
    late[-2:].view("<u2")[0] = 0  # a place before the one ahead of it
    for delta, flagged in [(got, 0), (late, 1)]:
        target, bad = olds[0].copy().view(_Dev), np.zeros(1, np.uint32).view(_Dev)
        dev.apply(target, delta, xp=xp, head=head, bad=bad)
        assert bad[0] == flagged
        assert target.tobytes() == (olds[0] if flagged else jobs[0][1]).tobytes()


def test_several_deltas_are_applied_by_two_launches_and_a_bad_one_writes_nothing(lib, monkeypatch):
    """apply_many (the table of receives, each kernel reading its delta's header where it lies,
    each block's first change summed by the block, a flag and a size per delta) on the host
    kernels: every good delta applied as the host codec applies it and its size written; the bad
    ones (a place out of order, counts over the header's k, sizes that disagree with the header
    or the target) flagged 1, the ones the host must apply (a mask, dense bytes, another element
    width) flagged 2; nothing of a flagged one's target written."""
    from wb.runtime.engine.deltas import device as dev
    from wb.runtime.engine.deltas import tables as many

    monkeypatch.setattr(dev, "kernel_module", lambda: _Module(lib))
    xp, rng = _Xp(), np.random.default_rng(11)
    items, olds, news, want = [], [], [], []

    def add(base, new, delta, w, flag, room=0):
        buf = np.zeros(delta.nbytes + room, np.uint8)  # a receive may hold more than came
        buf[:delta.nbytes] = delta
        olds.append(base)
        news.append(new)
        want.append(flag)
        items.append((base.copy().view(_Dev), buf.view(_Dev), w, len(items)))

    for j, (w, n) in enumerate([(2, 3 * codec.BLOCK + 17), (1, 999), (4, codec.BLOCK),
                                (8, 2 * codec.BLOCK + 1), (2, 3 * codec.BLOCK + 17)]):
        base = rng.integers(0, 256, n * w, dtype=np.uint8)
        new = base.copy()
        new.reshape(n, w)[rng.random(n) < 0.02, 0] ^= 0x3
        new.reshape(n, w)[n - 1, 0] ^= 0x3
        d = codec.encode(base, new, itemsize=w)
        assert codec.kind_of(d) == "blocks"
        if j == 4:  # the first block's second place the same as its first
            k = codec.header(d)[4]
            d[d.nbytes - 2 * k:].view("<u2")[1] = d[d.nbytes - 2 * k:].view("<u2")[0]
        add(base, new, d, w, int(j == 4), room=100 * j)
    base, new = olds[1], news[1]
    d = codec.encode(base, new, itemsize=1)
    over = d.copy()
    over[-2 * codec.header(d)[4] - 4:][:4].view("<u4")[0] += 1  # counts over its k
    add(base, new, over, 1, 1)
    short = d.copy()
    add(base, new, short[:-1], 1, 1)  # its header says one byte more than came
    wrong_n = d.copy()
    wrong_n[16:24].view("<u8")[0] += 1  # elements that are not the target's
    add(base, new, wrong_n, 1, 1)
    k_over_n = d.copy()
    k_over_n[24:32].view("<u8")[0] = base.nbytes + 1
    add(base, new, k_over_n, 1, 1)
    add(base, new, d[:16], 1, 1)  # shorter than a header
    odd = d.copy()
    odd[0] = 7  # a kind no codec makes: the host's checks refuse it
    add(base, new, odd, 1, 2)
    dense = codec.dense(new, itemsize=1)
    add(base, new, dense, 1, 2)
    third = new.copy()
    third[::3] ^= 1
    mask = codec.encode(base, third, itemsize=1)
    assert codec.kind_of(mask) == "mask"
    add(base, third, mask, 1, 2)
    narrow = codec.encode(olds[3], news[3], itemsize=4)  # 4-byte elements where 8 are expected
    assert codec.kind_of(narrow) == "blocks"
    add(olds[3], news[3], narrow, 8, 2)
    bad = np.zeros(len(items), np.uint32).view(_Dev)
    sizes = np.zeros(len(items), np.int64).view(_Dev)
    many.apply_many(items, bad, sizes, xp=xp)
    assert bad.tolist() == want
    for (target, buf, _, j), old, new, flag in zip(items, olds, news, want):
        assert target.tobytes() == (old if flag else new).tobytes(), j
        if not flag:  # (a flagged delta's size says nothing)
            assert sizes[j] == codec.size_of(buf), j
    with pytest.raises(ValueError, match="contiguous"):
        many.apply_many([(items[0][0][::2], items[0][1], 2, 0)], bad, sizes, xp=xp)


@pytest.mark.parametrize("w", [1, 2, 4, 8])
def test_a_delta_applies_where_a_packed_unit_s_regions_lie(lib, monkeypatch, w):
    """apply_many with a target that is regions of buffers (``gather.Regions``: a unit received
    packed) on the host kernels: ``harness.regions.check`` (every change where its element lies,
    nothing else written, a malformed delta writes nothing)."""
    from harness.regions import check
    from wb.runtime.engine.deltas import device as dev

    monkeypatch.setattr(dev, "kernel_module", lambda: _Module(lib))
    check(_Xp(), lambda a: np.array(a).view(_Dev), np.asarray, lambda a: a.ctypes.data, w)


def test_regions_without_rows_or_with_a_strided_table_are_left_to_the_host():
    """apply_many refuses (ValueError: the host applies the delta) regions whose gather table
    has no rows or is not contiguous: its kernel reads the table's fields row after row."""
    from wb.runtime.engine import gather
    from wb.runtime.engine.deltas import tables as many

    table = gather.table([(0, 0, 1, 64, 64, 1)])
    ptrs = np.zeros(1, np.uint64)
    d = np.zeros(64, np.uint8)
    bad, sizes = np.zeros(1, np.uint32), np.zeros(1, np.int64)
    for t in (table[:, :0], np.repeat(table, 2, axis=1)[:, ::2]):
        with pytest.raises(ValueError, match="regions"):
            many.apply_many([(gather.Regions(t, ptrs, 64, 1), d, 1, 0)], bad, sizes, xp=np)


def test_prepare_runs_every_step_of_the_codec_on_the_host_kernels(lib, monkeypatch):
    """prepare (what a delta job's first update on a device runs once) makes and applies tiny
    deltas of every kind and width without error, with the kernels compiled for the host."""
    from wb.runtime.engine.deltas import device as dev
    from wb.runtime.engine.deltas import tables as many

    monkeypatch.setattr(dev, "kernel_module", lambda: _Module(lib))
    xp = _Xp()
    many._prepared.cache_clear()
    many.prepare(xp)
    assert many._prepared.cache_info().currsize == 1
    many._prepared.cache_clear()


def test_advance_many_with_numpy_makes_the_host_codec_s_deltas_and_advances_the_bases():
    """advance_many on host arrays (numpy as the array module): each delta the host codec's,
    each base then holding its new bytes."""
    from wb.runtime.engine.deltas import tables as many

    rng = np.random.default_rng(3)
    jobs, olds, news = [], [], []
    for w, n in [(2, 3000), (4, 777), (1, 5)]:
        base = rng.integers(0, 256, n * w, dtype=np.uint8)
        new = base.copy()
        new.reshape(n, w)[rng.random(n) < 0.1, 0] ^= 1
        olds.append(base.copy())
        news.append(new)
        jobs.append((base, new, w))
    made = many.advance_many(jobs, xp=np)
    for (base, new, w), old, d in zip(jobs, olds, made):
        assert d.tobytes() == codec.encode(old, new, itemsize=w).tobytes()
        assert base.tobytes() == new.tobytes()
