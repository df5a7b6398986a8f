"""The demo's checkpoint: random weights of the tiny model, and what they are after ``step`` updates."""

from __future__ import annotations

import numpy as np

from wb.data.dtypes import dtype_info
from wb.layouts.presets import TINY, spec_from_config
from wb.testing.versions import sparse_step

__all__ = ["DEMO_FP8", "random_checkpoint", "expected_checkpoint", "fp8_checkpoint"]

#: The demo's FP8 rollouts: every projection weight block-scaled, in blocks the tiny model's TP
#: shards split into (real checkpoints use 128 x 128).
DEMO_FP8 = {"tensors": ["*_proj.weight"], "format": "float8_e4m3fn", "block": [4, 4]}


def random_checkpoint(seed: int = 0, cfg: dict = TINY) -> dict[str, np.ndarray]:
    """Random checkpoint tensors of a model (default: the tiny one; numpy, in the spec's
    dtypes)."""
    spec = spec_from_config(cfg)
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(spec.shape(n), dtype=np.float32).astype(
        dtype_info(spec.dtype(n)).numpy) for n in spec.names}


def expected_checkpoint(ckpt: dict, step: int, *, sparse: bool = False) -> dict:
    """The trainer's weights after ``step`` updates (``w <- -2 w`` each, exact in any float dtype;
    ``sparse``: :func:`wb.testing.versions.sparse_step` each), as checkpoint tensors (numpy)."""
    if sparse:
        out = dict(ckpt)
        for k in range(1, step + 1):
            out = {n: sparse_step(a, k) for n, a in out.items()}
        return out
    f = (-2.0) ** step
    return {n: (a * np.asarray(f, dtype=a.dtype)).astype(a.dtype) for n, a in ckpt.items()}


def fp8_checkpoint(ckpt: dict, decl, cfg: dict = TINY) -> dict:
    """The FP8 checkpoint of ``ckpt`` under the declaration ``decl`` (a :class:`wb.FP8Blocks`),
    quantised by the plain reference (:func:`wb.testing.oracle.quantize_reference`): what the
    FP8 rollouts' own loaders are checked against."""
    from wb.testing.oracle import quantize_reference

    scaled = decl.bind(spec_from_config(cfg))
    out = dict(ckpt)
    for t, n in enumerate(scaled.names):
        out[n], out[scaled.scale_name(t)] = quantize_reference(ckpt[n], decl.block)
    return out
