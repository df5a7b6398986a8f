"""The delta codec on CUDA memory (wb.runtime.engine.deltas.device with CuPy): for messages of
several blocks, every element width and densities from none to all, the device makes the host
codec's bytes exactly and applies them bit for bit; corrupted deltas are refused with nothing
written. Skips cleanly without a GPU."""

import numpy as np
import pytest

from harness.cuda import cupy_or_skip

cupy = cupy_or_skip()

from wb.algorithms import delta as codec  # noqa: E402
from wb.errors import TransferError  # noqa: E402
from wb.runtime.engine.deltas import device as dev  # noqa: E402
from wb.runtime.engine.deltas import tables as many  # noqa: E402


@pytest.mark.parametrize("w", [1, 2, 4, 8])
@pytest.mark.parametrize("density", [0.0, 1e-4, 0.03, 0.3, 0.97, 1.0])
def test_the_device_makes_and_applies_the_host_codec_s_bytes(w, density):
    n = 3 * codec.BLOCK + 777
    rng = np.random.default_rng(int(density * 1000) + w)
    base = rng.integers(0, 256, n * w, dtype=np.uint8)
    new = base.copy()
    new.reshape(n, w)[rng.random(n) < density, -1] ^= 0x21
    new.reshape(n, w)[[0, codec.BLOCK - 1, codec.BLOCK, n - 1], 0] ^= 0x40  # the blocks' edges
    want = codec.encode(base, new, itemsize=w)
    d = dev.encode(cupy.asarray(base), cupy.asarray(new), itemsize=w, xp=cupy)
    assert isinstance(d, cupy.ndarray) and cupy.asnumpy(d).tobytes() == want.tobytes()
    out = cupy.asarray(base)
    pos, vals = dev.apply(out, d, xp=cupy)
    assert cupy.asnumpy(out).tobytes() == new.tobytes()
    want_pos, _ = codec.apply(base.copy(), want)
    assert (pos is None) == (want_pos is None)
    if pos is not None:
        assert np.array_equal(cupy.asnumpy(pos), want_pos)


def _three_blocks(seed: int):
    """Bytes of a bfloat16 message of three blocks (the last of five elements), and the same
    with a byte of every 97 flipped."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, 2 * (2 * codec.BLOCK + 5), dtype=np.uint8)
    new = base.copy()
    new[::97] ^= 1
    return base, new


def test_corrupted_deltas_are_refused_on_the_device():
    base, new = _three_blocks(0)
    new[-1] ^= 1  # a change in the last block, whose place the corruption below moves past the end
    d = codec.encode(base, new, itemsize=2)
    assert codec.kind_of(d) == "blocks"
    k = codec.header(d)[4]
    counts_at = d.nbytes - 2 * k - 12
    extra = d.copy()
    extra[counts_at:counts_at + 4].view("<u4")[0] += 1
    late = d.copy()
    late[-2:].view("<u2")[0] = 0xFFFF
    for bad, why in [(extra, "count"), (late, "not ascending"), (d[:-1], "bytes")]:
        out = cupy.asarray(base)
        with pytest.raises(TransferError, match=why):
            dev.apply(out, cupy.asarray(bad), xp=cupy)
        assert cupy.asnumpy(out).tobytes() == base.tobytes()
        with pytest.raises(TransferError, match=why):  # as the host codec refuses it
            codec.apply(base.copy(), bad)


def test_deltas_made_together_are_the_host_codec_s_and_advance_their_bases():
    rng = np.random.default_rng(7)
    jobs, want, news = [], [], []
    for w, n, density in [(2, 3 * codec.BLOCK + 11, 0.04), (1, 1000, 0.0), (4, codec.BLOCK, 0.3),
                          (8, 2 * codec.BLOCK, 1.0), (2, 5, 0.5)]:
        base = rng.integers(0, 256, n * w, dtype=np.uint8)
        new = base.copy()
        new.reshape(n, w)[rng.random(n) < density, 0] ^= 0x5
        want.append(codec.encode(base, new, itemsize=w))
        news.append(new)
        jobs.append((cupy.asarray(base), cupy.asarray(new), w))
    assert {codec.kind_of(d) for d in want} == {"blocks", "mask", "dense"}
    made = many.advance_many(jobs, xp=cupy)
    for d, want_d, (base, _, _), new in zip(made, want, jobs, news):
        assert cupy.asnumpy(d).tobytes() == want_d.tobytes()
        assert cupy.asnumpy(base).tobytes() == new.tobytes()  # the base holds the new bytes
    bufs = [cupy.concatenate([d, cupy.zeros(9, cupy.uint8)]) for d in made]  # receives larger
    for (got, head), d in zip(many.received_many(bufs, xp=cupy), made):
        assert got.nbytes == d.nbytes
        assert head.tobytes() == cupy.asnumpy(d[:codec.HEADER.size]).tobytes()


def test_a_flagged_delta_writes_nothing_and_the_flag_says_so():
    base, new = _three_blocks(1)
    d = codec.encode(base, new, itemsize=2)
    late = d.copy()
    late[-2:].view("<u2")[0] = 0  # a place before the one ahead of it
    for delta, flagged in [(d, 0), (late, 1)]:
        out, bad = cupy.asarray(base), cupy.zeros(1, cupy.uint32)
        dev.apply(out, cupy.asarray(delta), xp=cupy, bad=bad)  # raises nothing: the flag tells
        assert int(bad.get()[0]) == flagged
        assert cupy.asnumpy(out).tobytes() == (base if flagged else new).tobytes()


@pytest.mark.parametrize("w", [1, 2, 4, 8])
def test_a_delta_applies_where_a_packed_unit_s_regions_lie_on_the_device(w):
    """``harness.regions.check`` on the GPU (1,024 threads a block, each finding its changes'
    regions): every change where its element lies, nothing else written, a malformed delta
    writes nothing."""
    from harness.regions import check

    check(cupy, cupy.asarray, cupy.asnumpy, lambda a: a.data.ptr, w)
