"""PyTorch shim of WeightBridge: probe a model's own ``load_weights``; tensors <-> numpy views.

The reference vLLM-style rollout model used by tests and the demo is in :mod:`wb_torch.testing`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import ml_dtypes
import numpy as np
import torch

import wb
from wb.dtypes import canonical_dtype

__all__ = ["probe", "to_numpy", "from_numpy"]

# Same-size integer views: numpy has no bfloat16/float8, ml_dtypes does; torch <-> ml_dtypes goes
# through the raw bits.
_BITS = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
         torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
         torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2)}
_TORCH = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn,
          "float8_e5m2": torch.float8_e5m2}


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy array of ``t``'s values in the same dtype (zero-copy on CPU; a copy from GPU).

    Examples:
        >>> to_numpy(torch.ones(2, dtype=torch.bfloat16)).dtype
        dtype(bfloat16)
    """
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype in _BITS:
        raw, npdt = _BITS[t.dtype]
        return t.view(raw).numpy().view(npdt)
    return t.numpy()


def from_numpy(a: np.ndarray, device: torch.device | str = "cpu") -> torch.Tensor:
    """A torch tensor of ``a``'s values in the same dtype (bfloat16 and float8 included)."""
    name = canonical_dtype(a.dtype)
    if name in _TORCH:
        raw = _BITS[_TORCH[name]][0]
        t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16 if raw == torch.int16
                                                           else np.uint8)).view(_TORCH[name])
    else:
        t = torch.from_numpy(np.ascontiguousarray(a))
    return t.to(device)


class _ParamViews(Mapping):
    """``{name: numpy view of the parameter}``, converted when read (one buffer at a time)."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self._params = params

    def __getitem__(self, name: str) -> np.ndarray:
        return to_numpy(self._params[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def probe(model: torch.nn.Module, spec: wb.CheckpointSpec,
          load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object] | None = None, *,
          progress: bool = False) -> dict[str, wb.SourceMap]:
    """Source maps of every parameter of ``model``, found by running its own ``load_weights``.

    ``load_weights`` follows vLLM's contract: it takes an iterable of ``(hf_name, full tensor)`` and
    copies into the parameters in place. Before each pass every parameter is zeroed (0 is the probe's
    "never written" value), so **probing overwrites the model's weights**: probe first, then load or
    receive real weights.

    Args:
        model: the module; its ``named_parameters()`` names key the result.
        spec: the checkpoint's tensors (names, shapes, dtypes) as ``load_weights`` expects them.
        load_weights: defaults to ``model.load_weights``.
        progress: show a progress bar over passes.

    Returns:
        ``{parameter name: SourceMap}``; elements ``load_weights`` never writes map to ``-1``.

    Raises:
        wb.ProbeError: ``load_weights`` raised (names the checkpoint tensor it was being fed) or is
            not pure data movement (names the parameter and its first bad element).
    """
    if load_weights is None:
        if not hasattr(model, "load_weights"):
            raise wb.ProbeError(f"{type(model).__name__} has no load_weights method; pass "
                                f"load_weights= (an iterable of (name, tensor) -> in-place copy)")
        load_weights = model.load_weights
    params = dict(model.named_parameters())
    if not params:
        raise wb.ProbeError(f"{type(model).__name__} has no parameters to probe")
    device = next(iter(params.values())).device

    def load(ckpt: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        with torch.no_grad():
            for p in params.values():
                p.view(torch.uint8).zero_() if p.dtype in _BITS else p.zero_()
            load_weights((name, from_numpy(ckpt[name], device)) for name in ckpt)
        return _ParamViews(params)

    return wb.probe(spec, load, progress=progress)
