"""The probe's id encoding (wb.algorithms.probing.idcode) against a per-element oracle in plain
Python ints, and the shims' use of its constants instead of copies."""

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from wb.algorithms.probing import idcode

ROOT = Path(__file__).resolve().parent.parent
SHIM_PROBING = [ROOT / "wb_torch" / "probing.py", ROOT / "wb_jax" / "probing.py"]

# --- the oracle: the module docstring's formulas, one Python int at a time -----------------------


def oracle_digits(i: int, base: int, passes: int) -> list[int]:
    """The base-``base`` digits of id ``i``, lowest first."""
    out = []
    for _ in range(passes):
        i, d = divmod(i, base)
        out.append(d)
    return out


def oracle_row_hash(row: int, base: int) -> int:
    return ((row * idcode.ROW_MUL) % 2**64 >> idcode.ROW_SHIFT) % base


def oracle_check_digit(i: int, base: int) -> int:
    return (i % base * idcode.COL_MUL + oracle_row_hash(i // base, base)) % base


def oracle_passes(numel: int, base: int) -> int:
    p = 1
    while base**p < numel:
        p += 1
    return p


POW2_BASES = st.integers(1, 24).map(lambda b: 2**b)
OTHER_BASES = st.integers(3, 2**24 + 5).filter(lambda b: b & (b - 1) != 0)
BASES = st.one_of(POW2_BASES, OTHER_BASES, st.sampled_from([16, 256, 2048, 2**24, 100, 1000]))
IDS = st.lists(st.one_of(st.integers(0, 2**63 - 1), st.integers(0, 2**20)), min_size=1,
               max_size=40)


def test_the_constants_are_the_contract():
    # golden: a device implementation built against these values must keep decoding
    assert (idcode.COL_MUL, idcode.ROW_MUL, idcode.ROW_SHIFT) == (
        2654435761, 0x9E3779B97F4A7C15, 24)
    np.testing.assert_array_equal(idcode.check_digit(np.array([0, 1, 256, 257, 2**40 + 3]), 256),
                                  [0, 177, 127, 48, 19])


@settings(max_examples=200, deadline=None)
@given(IDS, BASES)
def test_pass_and_check_digits_equal_the_oracle(ids, base):
    arr = np.array(ids, dtype=np.int64)
    passes = oracle_passes(max(ids) + 1, base)
    for k in range(passes):
        got = idcode.pass_digits(arr.copy(), k, base)
        assert got.dtype == np.int64
        assert got.tolist() == [oracle_digits(i, base, passes)[k] for i in ids]
    want = [oracle_check_digit(i, base) for i in ids]
    assert idcode.check_digit(arr.copy(), base).tolist() == want
    assert idcode.pass_digits(arr.copy(), None, base).tolist() == want


@settings(max_examples=200, deadline=None)
@given(IDS, BASES)
def test_decode_inverts_the_digits(ids, base):
    arr = np.array(ids, dtype=np.int64)
    passes = idcode.n_passes(max(ids) + 1, base)
    assert passes == oracle_passes(max(ids) + 1, base)
    dt = idcode.digit_dtype(base)
    assert np.iinfo(dt).max >= base - 1
    digits = [idcode.pass_digits(arr, k, base).astype(dt) for k in range(passes)]
    assert [d.tolist() for d in digits] == [
        [oracle_digits(i, base, passes)[k] for i in ids] for k in range(passes)]
    assert idcode.decode(digits, base).tolist() == ids


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**63 // 2**24 - 1), min_size=1, max_size=20), BASES)
def test_row_hash_and_row_index_equal_the_oracle(rows, base):
    arr = np.array(rows, dtype=np.int64)
    want = [oracle_row_hash(r, base) for r in rows]
    assert idcode.row_hash(arr, base).tolist() == want
    assert idcode.row_index(None, rows[0], 3, base).tolist() == [
        oracle_row_hash(r, base) for r in range(rows[0], rows[0] + 3)]
    assert idcode.row_index(0, rows[0], 3, base) is None


@settings(max_examples=40, deadline=None)  # a pure-Python oracle per element: ~0.14 s each
@given(st.integers(0, 2**40), st.integers(1, 9), st.sampled_from([2, 7, 16, 100, 256, 2048]))
def test_rows_and_tables_give_every_element_its_value(row0, m, base):
    """What a feed builds from (a row index and a table row, per pass) is each id's digit."""
    cols = np.arange(base)
    table = idcode.check_table(base)
    assert table.tolist() == [[(c * idcode.COL_MUL + g) % base for c in range(base)]
                              for g in range(base)]
    passes = oracle_passes((row0 + m) * base, base)
    for k in [None, *range(1, passes)]:
        idx = idcode.row_index(k, row0, m, base)
        for r in range(m):
            ids = (row0 + r) * base + cols
            got = table[idx[r]] if k is None else np.full(base, idx[r])
            want = [oracle_check_digit(int(i), base) if k is None
                    else oracle_digits(int(i), base, passes)[k] for i in ids]
            assert got.tolist() == want
    # pass 0: the digit is the column
    assert idcode.pass_digits((row0 * base + cols).astype(np.int64), 0, base).tolist() == list(cols)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**40), st.integers(0, 70_000), st.sampled_from([2, 3, 16, 100, 256]))
def test_segments_cover_the_ids_row_by_row(first, n, base):
    ids = np.full(n, -1, dtype=np.int64)
    for start, rows, width, row0, col0 in idcode.segments(first, n, base):
        assert rows <= 1 << 14 and col0 + width <= base and (rows == 1 or col0 == 0)
        block = (row0 + np.arange(rows))[:, None] * base + col0 + np.arange(width)[None, :]
        assert (ids[start:start + rows * width] == -1).all()  # no element twice
        ids[start:start + rows * width] = block.reshape(-1)
    np.testing.assert_array_equal(ids, first + np.arange(n))


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**40), BASES.filter(lambda b: b <= 2**16))
def test_ids_of_a_row_get_distinct_check_digits(row, base):
    ids = row * base + np.arange(base, dtype=np.int64)
    assert sorted(idcode.check_digit(ids, base).tolist()) == list(range(base))


def test_digit_base_and_passes():
    assert idcode.digit_base(["bfloat16", "float32"]) == 256
    assert idcode.digit_base(["float32"]) == 2**24
    assert idcode.digit_base(["float16"]) == 2048
    assert [idcode.n_passes(n, 256) for n in (1, 256, 257, 2**16, 2**16 + 1)] == [1, 1, 2, 2, 3]


# --- the shims take the contract's names, never a copy of its values -----------------------------
COPIES = [
    (re.compile(r"0x9e3779b97f4a7c15", re.I), "the row multiplier"),
    (re.compile(rf"\b({idcode.ROW_MUL}|{2**64 - idcode.ROW_MUL})\b"), "the row multiplier"),
    (re.compile(rf"\b{idcode.COL_MUL}\b"), "the column multiplier"),
    (re.compile(r">>\s*(np\.uint64\(\s*)?24\b"), "the row shift"),
    (re.compile(r"np\.uint64\(\s*24\s*\)"), "the row shift"),
    (re.compile(r"shift\w*\(\s*([^()]*,\s*)?(np\.uint64\(\s*)?24\b"), "the row shift"),
]


@pytest.mark.parametrize("path", SHIM_PROBING, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shims_use_the_contract_not_copies(path):
    code = "\n".join(line.split("#", 1)[0] for line in path.read_text().splitlines())
    for pattern, what in COPIES:
        assert not pattern.search(code), f"{path.name} copies {what}: {pattern.search(code)[0]!r}"
    for name in ("idcode.ROW_MUL", "idcode.ROW_SHIFT", "idcode.COL_MUL"):
        assert name in code, f"{path.name} does not use {name}"
    # the seam's surface is wb.algorithms.probing: not the data layer behind it
    assert not re.search(r"^\s*(from|import)\s+wb\.data\.sourcemap\b", code, re.M)
