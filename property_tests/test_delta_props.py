"""Deltas of a message's bytes (wb.algorithms.delta), against a brute-force oracle: any base and
any new bytes of any element width give a delta that turns the base into the new bytes bit for
bit, in the smallest of the three encodings (sizes counted element by element); a delta applied
to a message of another size, or cut short, or with its positions corrupted, is refused with
nothing of the target written. Messages of several blocks of changes, with changes at the blocks'
edges, against numpy."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wb.algorithms import delta
from wb.errors import TransferError


_H = 32  # a delta's header: kind, element bytes, its bytes, elements, changed elements


def _oracle_sizes(base: np.ndarray, new: np.ndarray, w: int) -> dict[str, int]:
    n = base.size // w
    pos = [i for i in range(n) if bytes(base[i * w:(i + 1) * w]) != bytes(new[i * w:(i + 1) * w])]
    k = len(pos)
    return {"dense": _H + n * w, "mask": _H + k * w + (n + 7) // 8,
            "blocks": _H + k * w + (-(_H + k * w)) % 4 + 4 * -(-n // 65536) + 2 * k}


@st.composite
def _pairs(draw):
    w = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(0, 3000))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base = rng.integers(0, 256, n * w, dtype=np.uint8)
    new = base.copy()
    density = draw(st.sampled_from([0.0, 0.001, 0.02, 0.2, 0.6, 1.0]))
    hit = np.flatnonzero(rng.random(n) < density)
    for i in hit:  # another value of the element: at least one of its bytes differs
        new[i * w + int(rng.integers(0, w))] ^= np.uint8(rng.integers(1, 256))
    if n and draw(st.booleans()):  # a run at the end, far from the rest (long gaps)
        new[-w:] ^= 0xFF
    return base, new, w


@settings(max_examples=300, deadline=None)
@given(_pairs())
def test_a_delta_turns_its_base_into_the_new_bytes_in_its_smallest_encoding(pair):
    base, new, w = pair
    d = delta.encode(base, new, itemsize=w)
    want = _oracle_sizes(base, new, w)
    assert d.nbytes == min(want.values()) <= delta.max_bytes(base.nbytes)
    assert want[delta.kind_of(d)] == d.nbytes
    out = base.copy()
    delta.apply(out, d)
    assert out.tobytes() == new.tobytes()
    # what a forwarder sends on is the same bytes: applied again elsewhere, the same result
    again = base.copy()
    delta.apply(again, d.copy())
    assert again.tobytes() == new.tobytes()


def test_elements_are_compared_as_bits():
    base = np.array([0.0, np.nan, 1.0], np.float32)
    new = np.array([-0.0, 0.0, 1.0], np.float32)
    new.view(np.uint32)[1] = base.view(np.uint32)[1] ^ 0x80000000  # the NaN of the other sign
    pos = delta.changed(base.view(np.uint8), new.view(np.uint8), itemsize=4)
    assert pos.tolist() == [0, 1]
    out = base.view(np.uint8).copy()
    delta.apply(out, delta.encode(base.view(np.uint8), new.view(np.uint8), itemsize=4))
    assert out.tobytes() == new.tobytes()


@pytest.mark.parametrize("density", [0.01, 0.5])
def test_a_malformed_delta_is_refused_and_writes_nothing(density):
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, 2000, dtype=np.uint8)
    new = base.copy()
    new[rng.random(2000) < density] ^= 1
    d = delta.encode(base, new, itemsize=2)
    for bad, why in [(d[:-1], "cut short"), (d[:10], "no header")]:
        out = base.copy()
        with pytest.raises(TransferError):
            delta.apply(out, bad)
        assert out.tobytes() == base.tobytes(), why
    with pytest.raises(TransferError, match="for a message of"):
        delta.apply(np.zeros(1000, np.uint8), d)
    tail = d.copy()
    tail[-1] |= 0x80  # the last change's place made to lie past the end, or the mask's last bit set
    out = base.copy()
    if tail.tobytes() == d.tobytes():  # that bit was set already: the same delta
        delta.apply(out, tail)
        assert out.tobytes() == new.tobytes()
    else:
        with pytest.raises(TransferError):
            delta.apply(out, tail)
        assert out.tobytes() == base.tobytes()


def several_blocks(w: int):
    """``(base, new, hit)``: a message of three blocks and a part of elements of ``w`` bytes,
    changed at both edges of each block and at 1% of the others (``hit``: their positions)."""
    n = 3 * delta.BLOCK + 1234
    rng = np.random.default_rng(w)
    base = rng.integers(0, 256, n * w, dtype=np.uint8)
    new = base.copy()
    edges = [0, delta.BLOCK - 1, delta.BLOCK, 2 * delta.BLOCK - 1, 3 * delta.BLOCK, n - 1]
    hit = np.union1d(edges, np.flatnonzero(rng.random(n) < 0.01))
    new.reshape(n, w)[hit, 0] ^= 0x5A
    return base, new, hit


@pytest.mark.parametrize("w", [1, 2, 4])
def test_changes_of_several_blocks_keep_their_places(w):
    """Changes at both edges of each block and scattered, in a message of three blocks and a
    part: applied bit for bit; counts that say another block for a change are refused."""
    base, new, hit = several_blocks(w)
    d = delta.encode(base, new, itemsize=w)
    assert delta.kind_of(d) == "blocks"
    out = base.copy()
    pos, _ = delta.apply(out, d)
    assert out.tobytes() == new.tobytes()
    assert np.array_equal(pos, hit)
    bad = d.copy()  # the first block's last change counted in the second block
    counts = bad[d.nbytes - 2 * hit.size - 16:d.nbytes - 2 * hit.size].view("<u4")
    counts[0] -= 1
    counts[1] += 1
    out = base.copy()
    with pytest.raises(TransferError, match="not ascending"):
        delta.apply(out, bad)
    assert out.tobytes() == base.tobytes()


@settings(max_examples=40, deadline=None)
@given(density=st.sampled_from([0.0, 1e-4, 0.003, 0.03, 0.1, 0.3, 0.7, 1.0]),
       itemsize=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**32 - 1))
def test_expected_bytes_is_what_random_changes_encode_to(density, itemsize, seed):
    """The planning model of a delta's size against the codec's own sizes of changes drawn
    element by element with that probability (200,000 elements: within 3% or 64 bytes)."""
    from wb.algorithms.delta import expected_bytes, sizes

    n = 200_000
    pos = np.flatnonzero(np.random.default_rng(seed).random(n) < density)
    got = min(sizes(n, pos, itemsize=itemsize).values())
    want = float(expected_bytes(n * itemsize, itemsize, density))
    spread = 5 * (n * density * (1 - density)) ** 0.5 * (itemsize + 3) + 64
    assert abs(got - want) <= max(0.03 * want, spread), (got, want)
