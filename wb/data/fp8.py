"""Block-scaled FP8 checkpoints: the declaration, the spec it derives, and the quantisation rule.

A rollout may serve some weights as FP8 with one scale per block, the format of DeepSeek-V3,
Kimi-K2 and Qwen3-FP8 checkpoints: tensor ``X`` in ``float8_e4m3fn`` and ``X_scale_inv`` in
``float32``, one value per ``128 x 128`` block of ``X`` in checkpoint coordinates (edge blocks
smaller). The user states once which tensors (:class:`FP8Blocks`); :meth:`FP8Blocks.bind` derives
the FP8 checkpoint's spec from the trainer's (the rollout's load is probed against it) and where
each tensor and scale lies in it.

The rule, for one block of a tensor (this module's :func:`quantize_blocks` and the CUDA kernels
of ``wb.runtime.engine.fp8`` compute exactly this; ``wb.testing.oracle.quantize_reference`` is it
written plainly, one block at a time):

- ``x``: the block's values in float32 (float64 rounded to nearest even; narrower floats exact);
- ``amax = max |x|`` over the block;
- ``scale = amax / 448`` rounded to the nearest float32: the block's ``X_scale_inv`` value
  (a rollout dequantises ``q * scale``);
- ``q = float8_e4m3fn(x / scale)``: ``x / scale`` rounded to the nearest float32, then to the
  nearest ``float8_e4m3fn``, ties to even, clamped to +-448 (as :func:`wb.data.dtypes.convert`);
  ``q = 0`` where ``scale`` is 0 (a block of zeros, or one too small for a float32 scale);
- a block holding an infinity or a NaN (``amax`` not finite): ``scale = amax / 448`` (infinite
  or NaN) and every ``q`` is the format's NaN (``0x7f``).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

import numpy as np

from wb.data.dtypes import FLOATS, convert, dtype_info
from wb.data.spec import CheckpointSpec
from wb.errors import SpecError

__all__ = ["FORMATS", "BlockScaled", "FP8Blocks", "block_amax", "quantize_blocks", "quantize_tensor"]

#: Block-scaled formats wb quantises to: format -> the largest magnitude it holds (the divisor of
#: ``amax``).
FORMATS = MappingProxyType({"float8_e4m3fn": 448.0})
ROUNDINGS = ("nearest-even",)


@dataclass(frozen=True, slots=True)
class FP8Blocks:
    """Which checkpoint tensors a rollout serves block-scaled, and how (pure data; JSON-able).

    Args:
        tensors: names of the trainer's checkpoint tensors, or ``fnmatch`` patterns
            (``"*.mlp.experts.*.weight"``); each must match at least one 2-D float tensor.
        format: the element format (one of :data:`FORMATS`).
        block: ``(rows, cols)`` of a block, in checkpoint coordinates.
        scale_suffix: the scale tensor of ``X`` is named ``X + scale_suffix``.
        rounding: ``"nearest-even"`` (the only one).

    Raises:
        SpecError: an unknown format or rounding, a block that is not two positive ints, or no
            tensor patterns.

    Examples:
        >>> spec = CheckpointSpec({"w": ((256, 300), "bfloat16"), "norm": ((300,), "float32")})
        >>> fp8 = FP8Blocks(("w",)).bind(spec).spec
        >>> [(n, s, d) for n, (s, d) in fp8.items()]
        [('w', (256, 300), 'float8_e4m3fn'), ('norm', (300,), 'float32'), ('w_scale_inv', (2, 3), 'float32')]
    """

    tensors: tuple[str, ...]  # checkpoint names or fnmatch patterns of them
    format: str = "float8_e4m3fn"  # the element format, one of FORMATS
    block: tuple[int, int] = (128, 128)  # (rows, cols) of a block, checkpoint coordinates
    scale_suffix: str = "_scale_inv"  # X's scales are the tensor X + scale_suffix
    rounding: str = "nearest-even"  # the only rounding

    def __post_init__(self):
        try:
            tensors = (self.tensors,) if isinstance(self.tensors, str) else tuple(self.tensors)
        except TypeError:
            tensors = ()
        if not tensors or not all(isinstance(t, str) and t for t in tensors):
            raise SpecError(f"FP8Blocks.tensors must name at least one tensor (names or fnmatch "
                            f"patterns), got {self.tensors!r}")
        object.__setattr__(self, "tensors", tensors)
        if self.format not in FORMATS:
            raise SpecError(f"FP8Blocks.format {self.format!r} is not a block-scaled format wb "
                            f"knows; use one of {sorted(FORMATS)}")
        if self.rounding not in ROUNDINGS:
            raise SpecError(f"FP8Blocks.rounding {self.rounding!r} is not supported; use one of "
                            f"{list(ROUNDINGS)}")
        try:
            block = tuple(int(b) for b in self.block)
        except (TypeError, ValueError):
            block = ()
        if len(block) != 2 or min(block) < 1:
            raise SpecError(f"FP8Blocks.block must be two positive ints (rows, cols), got "
                            f"{self.block!r}")
        object.__setattr__(self, "block", block)
        if not self.scale_suffix:
            raise SpecError("FP8Blocks.scale_suffix must not be empty (X and its scales need "
                            "two names)")

    def to_json(self) -> dict:
        return {"tensors": list(self.tensors), "format": self.format, "block": list(self.block),
                "scale_suffix": self.scale_suffix, "rounding": self.rounding}

    @classmethod
    def from_json(cls, data: Mapping) -> FP8Blocks:
        unknown = set(data) - {"tensors", "format", "block", "scale_suffix", "rounding"}
        if unknown:
            raise SpecError(f"FP8Blocks JSON has unknown fields {sorted(unknown)}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})

    def bind(self, spec: CheckpointSpec) -> BlockScaled:
        """This declaration applied to the trainer's checkpoint ``spec``: which tensors, and the
        FP8 checkpoint's spec (the same tensors in the same order, the declared ones in
        :attr:`format`, then one float32 scale tensor per declared tensor, in that order).

        Raises:
            SpecError: a pattern matches no tensor, a matched tensor is not 2-D or not a float,
                or a scale name is already a tensor of ``spec``.
        """
        names: list[str] = []
        for pat in self.tensors:
            hits = [n for n in spec.names if fnmatch.fnmatchcase(n, pat)]
            if not hits:
                raise SpecError(f"FP8Blocks.tensors entry {pat!r} matches no tensor of the spec "
                                f"(its first names: {list(spec.names[:3])}); give checkpoint "
                                f"names or fnmatch patterns of them")
            names.extend(h for h in hits if h not in names)
        names.sort(key=spec.names.index)
        for n in names:
            if len(spec.shape(n)) != 2:
                raise SpecError(f"block scaling needs 2-D tensors: `{n}` has shape "
                                f"{spec.shape(n)}; leave it out of FP8Blocks.tensors")
            if spec.dtype(n) not in FLOATS:
                raise SpecError(f"block scaling quantises floats: `{n}` is {spec.dtype(n)}; leave "
                                f"it out of FP8Blocks.tensors")
            if n + self.scale_suffix in spec:
                raise SpecError(f"the scale tensor of `{n}` would be `{n + self.scale_suffix}`, "
                                f"which the spec already has; choose another scale_suffix")
        tensors = {n: (s, self.format if n in names else d) for n, (s, d) in spec.items()}
        bh, bw = self.block
        grids = [(-(-spec.shape(n)[0] // bh), -(-spec.shape(n)[1] // bw)) for n in names]
        for n, g in zip(names, grids):
            tensors[n + self.scale_suffix] = (g, "float32")
        fp8 = CheckpointSpec(tensors)
        return BlockScaled(
            decl=self, names=tuple(names),
            offset=np.array([spec.offset(n) for n in names], np.int64),
            rows=np.array([spec.shape(n)[0] for n in names], np.int64),
            cols=np.array([spec.shape(n)[1] for n in names], np.int64),
            grid_cols=np.array([g[1] for g in grids], np.int64),
            scale_offset=np.array([fp8.offset(n + self.scale_suffix) for n in names], np.int64),
            trainer_spec=spec, spec=fp8)


class BlockScaled(NamedTuple):
    """An :class:`FP8Blocks` bound to a trainer spec (:meth:`FP8Blocks.bind`); per declared
    tensor ``t`` (in spec order):"""

    decl: FP8Blocks  # the declaration
    names: tuple[str, ...]  # the declared tensors
    offset: np.ndarray  # (T,) int64 the first id of each (the same in both specs)
    rows: np.ndarray  # (T,) int64 its rows
    cols: np.ndarray  # (T,) int64 its columns
    grid_cols: np.ndarray  # (T,) int64 blocks per row of blocks
    scale_offset: np.ndarray  # (T,) int64 the first id of its scale tensor in the FP8 spec
    trainer_spec: CheckpointSpec  # the spec the trainers hold
    spec: CheckpointSpec  # the FP8 checkpoint's: what rollouts are probed against

    def scale_name(self, t: int) -> str:
        return self.names[t] + self.decl.scale_suffix

    def checkpoint(self, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The FP8 checkpoint of the trainer's ``{name: array}`` (numpy): declared tensors
        quantised (:func:`quantize_tensor`), their scales added, the rest as given."""
        out = dict(tensors)
        for t, n in enumerate(self.names):
            out[n], out[self.scale_name(t)] = quantize_tensor(np.asarray(tensors[n]),
                                                              self.decl.block, self.decl.format)
        return out


def quantize_blocks(x: np.ndarray, fmt: str = "float8_e4m3fn", *,
                    amax: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Quantises ``(n, bh, bw)`` blocks (padding must be 0) by the module's rule.

    Args:
        x: the blocks.
        fmt: the format.
        amax: ``(n,)`` each block's ``amax`` when ``x`` holds only a part of it (the largest
            :func:`block_amax` of its parts); default: ``x``'s own.

    Returns:
        ``(q, scale)``: ``(n, bh, bw)`` in ``fmt`` and ``(n,) float32``.
    """
    x32 = np.empty(x.shape, np.float32)
    convert(x32, x)
    with np.errstate(all="ignore"):  # IEEE results (0 / 0, subnormals, inf) are the rule
        amax = block_amax(x32) if amax is None else np.asarray(amax).astype(np.float32)
        scale = (amax / np.float32(FORMATS[fmt])).astype(np.float32)
        s = scale[:, None, None]
        y = np.where(s == 0, np.float32(0), x32 / s).astype(np.float32)
        y = np.where(np.isfinite(amax)[:, None, None], y, np.float32(np.nan))
    q = np.empty(x.shape, dtype_info(fmt).numpy)
    convert(q, y)
    return q, scale


def block_amax(x: np.ndarray) -> np.ndarray:
    """``(n,) float32`` ``max |x|`` of ``(n, bh, bw)`` blocks, each value rounded to float32
    first, as the rule has it (NaN if a block holds one)."""
    x32 = np.empty(x.shape, np.float32)
    convert(x32, x)
    return np.abs(x32).max(axis=(1, 2)) if x32.size else np.zeros(x32.shape[0], np.float32)


def quantize_tensor(x: np.ndarray, block: Sequence[int], fmt: str = "float8_e4m3fn"
                    ) -> tuple[np.ndarray, np.ndarray]:
    """A whole 2-D tensor quantised block by block: ``(q, scale)``, ``q`` of ``x``'s shape in
    ``fmt``, ``scale`` of shape ``(ceil(rows / bh), ceil(cols / bw))`` float32."""
    bh, bw = block
    r, c = x.shape
    gr, gc = math.ceil(r / bh), math.ceil(c / bw)
    pad = np.zeros((gr * bh, gc * bw), x.dtype)
    pad[:r, :c] = x
    blocks = pad.reshape(gr, bh, gc, bw).transpose(0, 2, 1, 3).reshape(gr * gc, bh, bw)
    q, scale = quantize_blocks(blocks, fmt)
    q = q.reshape(gr, gc, bh, bw).transpose(0, 2, 1, 3).reshape(gr * bh, gc * bw)[:r, :c]
    return np.ascontiguousarray(q), scale.reshape(gr, gc)
