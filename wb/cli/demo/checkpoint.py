"""The demo's checkpoint: random weights of the tiny model, and what they are after ``step`` updates."""

from __future__ import annotations

import numpy as np

from wb.data.dtypes import dtype_info
from wb.layouts.presets import TINY, spec_from_config

__all__ = ["random_checkpoint", "expected_checkpoint"]


def random_checkpoint(seed: int = 0) -> dict[str, np.ndarray]:
    """Random checkpoint tensors of the tiny model (numpy, in the spec's dtypes)."""
    spec = spec_from_config(TINY)
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(spec.shape(n), dtype=np.float32).astype(
        dtype_info(spec.dtype(n)).numpy) for n in spec.names}


def expected_checkpoint(ckpt: dict, step: int) -> dict:
    """The trainer's weights after ``step`` updates (``w <- -2 w`` each, exact in any float dtype),
    as checkpoint tensors (numpy)."""
    f = (-2.0) ** step
    return {n: (a * np.asarray(f, dtype=a.dtype)).astype(a.dtype) for n, a in ckpt.items()}
