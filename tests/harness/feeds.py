"""The cases both shims' device feeds are checked on against the host feed (mirrored tests)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import wb
from wb.algorithms.probing import HostArrays
from wb.algorithms.probing.idcode import digit_base

__all__ = ["FEED_CASES", "SKIPS", "feed_mismatches"]

#: (dtype, pass index) pairs: every pass ids below 2**63 can have (None: the check pass)
FEED_CASES = [(dt, k) for dt in ["bfloat16", "float16", "float32", "float8_e4m3fn"]
              for k in ([0, 1, 2, None] if dt == "float32" else [0, 1, 2, 3, 4, None])]
#: ids before the fed tensors (never fed): 2**33 + 77 puts them where the high digits change
SKIPS = [0, 2**33 + 77]


def feed_mismatches(dtype: str, pass_index: int | None, skip: int, feed: Callable,
                    to_numpy: Callable[[Any], np.ndarray]) -> Iterator[str]:
    """Names of the tensors whose device feed (``feed(spec, name, base, pass_index)``) differs,
    bit for bit, from the host feed."""
    pad = {"pad": ((skip,), dtype)} if skip else {}
    spec = wb.CheckpointSpec({**pad, "a": ((7,), dtype), "b": ((37, 300), dtype),
                              "c": ((5,), dtype), "d": ((70_000,), dtype)})
    base = digit_base([dtype])
    for name in set(spec) - {"pad"}:
        host = HostArrays().feed(spec, name, base, pass_index)
        dev = feed(spec, name, base, pass_index)
        if to_numpy(dev).tobytes() != np.ascontiguousarray(host).tobytes():
            yield name
