"""The delta codec where the buffers are (wb.runtime.engine.deltas.device), run here with numpy as
its array module: for any base and new bytes of any element width it makes the host codec's
bytes exactly (wb.algorithms.delta), applies any delta the host codec makes to the same bytes,
and refuses what the host codec refuses, nothing of the target written. The same functions on
CUDA memory: tests/test_delta_cuda.py."""

import numpy as np
import pytest
from hypothesis import given, settings

from test_delta_props import _pairs, several_blocks
from wb.algorithms import delta as codec
from wb.errors import TransferError
from wb.runtime.engine.deltas import device as dev


@settings(max_examples=300, deadline=None)
@given(_pairs())
def test_the_device_codec_makes_and_applies_the_host_codec_s_bytes(pair):
    base, new, w = pair
    d = dev.encode(base, new, itemsize=w, xp=np)
    assert d.tobytes() == codec.encode(base, new, itemsize=w).tobytes()
    out = base.copy()
    pos, vals = dev.apply(out, d, xp=np)
    assert out.tobytes() == new.tobytes()
    want_pos, want_vals = codec.apply(base.copy(), d)
    assert (pos is None) == (want_pos is None)
    if pos is not None:
        assert np.array_equal(pos, want_pos)
    assert vals.tobytes() == want_vals.tobytes()


@pytest.mark.parametrize("w", [1, 2, 4, 8])
def test_several_blocks_and_their_corruptions_as_the_host_codec(w):
    base, new, hit = several_blocks(w)
    n = base.size // w
    d = dev.encode(base, new, itemsize=w, xp=np)
    assert codec.kind_of(d) == "blocks" and d.tobytes() == codec.encode(base, new, itemsize=w).tobytes()
    out = base.copy()
    pos, _ = dev.apply(out, d, xp=np)
    assert out.tobytes() == new.tobytes() and np.array_equal(pos, hit)
    tail = d.nbytes - 2 * hit.size  # where the places start; the counts are before them
    shifted = d.copy()  # the first block's last change counted in the second block
    counts = shifted[tail - 16:tail].view("<u4")
    counts[0] -= 1
    counts[1] += 1
    extra = d.copy()  # one change more counted than the header says
    extra[tail - 16:tail].view("<u4")[3] += 1
    late = d.copy()  # the last change's place past the message's end
    late[-2:].view("<u2")[0] = 0xFFFF
    for bad, why in [(shifted, "not ascending"), (extra, "count"), (late, "not ascending"),
                     (d[:-1], "bytes"), (d[:10], "header")]:
        out = base.copy()
        with pytest.raises(TransferError, match=why):
            dev.apply(out, bad, xp=np)
        with pytest.raises(TransferError):
            codec.apply(base.copy(), bad)
        assert out.tobytes() == base.tobytes()
    with pytest.raises(TransferError, match="for a message of"):
        dev.apply(np.zeros(n * w + w, np.uint8), d, xp=np)


def test_a_mask_with_bits_past_its_end_is_refused():
    base = np.zeros(2 * 61, np.uint8)  # 61 elements of 2 bytes: the mask's last byte has 3 spare bits
    new = base.copy()
    new[::4] = 1  # every other element changed: a mask is the smallest
    d = dev.encode(base, new, itemsize=2, xp=np)
    assert codec.kind_of(d) == "mask"
    bad = d.copy()
    bad[-1] |= 0x80
    out = base.copy()
    with pytest.raises(TransferError, match="mask"):
        dev.apply(out, bad, xp=np)
    assert out.tobytes() == base.tobytes()
