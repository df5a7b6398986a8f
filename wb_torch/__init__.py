"""PyTorch shim of WeightBridge: probe a model's own ``load_weights``; tensors <-> numpy views;
:class:`Sender` over a module or named tensors (DTensor / FSDP2 local shards included) and
:class:`Receiver` into a model's own parameter storage.

The reference vLLM-style rollout model used by tests and the demo is in :mod:`wb_torch.testing`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import ml_dtypes
import numpy as np
import torch

import wb
from wb.data.dtypes import canonical_dtype

__all__ = ["probe", "to_numpy", "from_numpy", "buffers", "layout", "shard_layout", "Sender",
           "Receiver"]

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


def _named(tensors) -> dict[str, torch.Tensor]:
    if isinstance(tensors, torch.nn.Module):
        return dict(tensors.named_parameters())
    if isinstance(tensors, Mapping):
        return dict(tensors)
    raise TypeError(f"expected an nn.Module or a mapping of name -> tensor, got "
                    f"{type(tensors).__name__}")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor's own storage: a DTensor's local shard, a parameter's data."""
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t


def buffers(tensors, names: Iterable[str] | None = None) -> dict[str, object]:
    """Arrays that share memory with ``tensors`` (no copy), as ``wb.Sender`` / ``wb.Receiver`` take.

    CPU tensors become numpy views (bfloat16 / float8 through ml_dtypes); CUDA tensors stay
    tensors (``__cuda_array_interface__``), bfloat16 / float8 viewed as same-width integers, which
    the executor moves as raw bits. DTensors give their local shard.

    Args:
        tensors: an ``nn.Module`` (its ``named_parameters()``) or ``{name: tensor}``.
        names: which ones (default: all).

    Raises:
        wb.TransferError: a tensor is not contiguous (its storage cannot be written in place).
    """
    named = _named(tensors)
    out = {}
    for name in (named if names is None else names):
        t = _local(named[name])
        if not t.is_contiguous():
            raise wb.TransferError(f"tensor `{name}` is not contiguous; wb reads and writes a "
                                   f"tensor's own storage, which must be one dense block")
        if t.device.type == "cpu":
            out[name] = to_numpy(t)
        else:
            out[name] = t.view(_BITS[t.dtype][0]) if t.dtype in _BITS else t
    return out


def layout(model: torch.nn.Module, spec: wb.CheckpointSpec, worker: wb.Worker, *,
           load_weights=None) -> wb.Layout:
    """This worker's :class:`wb.Layout`: its parameters' source maps, probed through its own
    ``load_weights`` (**overwrites the weights**: probe, then load or receive). Parameters the
    loader never writes are left out."""
    maps = probe(model, spec, load_weights)
    params = dict(model.named_parameters())
    return wb.Layout(worker, {n: wb.BufferSpec(sm, canonical_dtype(params[n].dtype))
                              for n, sm in maps.items() if sm.n_ids})


def shard_layout(tensors, spec: wb.CheckpointSpec, worker: wb.Worker, *,
                 offsets: Mapping[str, tuple[int, ...]] | None = None) -> wb.Layout:
    """The layout of a trainer whose tensors are named like the checkpoint and each hold one
    rectangular block of it: DTensor / FSDP2 local shards (offsets from their mesh and placements)
    or plain tensors with ``offsets[name]`` (default: the whole tensor, offset 0).

    Raises:
        wb.SpecError: a name not in ``spec``, or a block that does not fit its tensor.
    """
    named = _named(tensors)
    out = {}
    for name, t in named.items():
        if name not in spec.names:
            raise wb.SpecError(f"tensor `{name}` is not in the checkpoint spec; shard_layout needs "
                               f"checkpoint names (use wb_torch.layout to probe a loader instead)")
        local = _local(t)
        if hasattr(t, "placements") and hasattr(t, "device_mesh"):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            _, off = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        else:
            off = tuple((offsets or {}).get(name, (0,) * local.dim()))
        full = spec.shape(name)
        if len(off) != len(full) or any(o + n > f for o, n, f in zip(off, local.shape, full)):
            raise wb.SpecError(f"tensor `{name}`: block at offset {tuple(off)} of shape "
                               f"{tuple(local.shape)} does not fit the checkpoint's {full}")
        ids = spec.offset(name) + np.arange(int(np.prod(full)), dtype=np.int64).reshape(full)
        block = ids[tuple(slice(o, o + n) for o, n in zip(off, local.shape))]
        out[name] = wb.BufferSpec(wb.SourceMap.from_indices(block),
                                  canonical_dtype(local.dtype))
    return wb.Layout(worker, out)


class Sender(wb.Sender):
    """:class:`wb.Sender` over a module's parameters or named tensors (read in place at each
    ``push``; optimizers update them in place). Same arguments as :class:`wb.Sender` after
    ``tensors``."""

    def __init__(self, tensors, plan: wb.Plan, rank: int, **kwargs):
        lay = next((x for x in plan.trainers if x.worker.rank == rank), None)
        names = list(lay.buffers) if lay is not None else None
        named = _named(tensors)
        self._cuda = sorted({t.device for n, t in named.items()
                             if t.device.type == "cuda" and (names is None or n in names)},
                            key=str)
        super().__init__(plan, rank, buffers(tensors, names), **kwargs)

    def push(self, *args, **kwargs) -> int:
        """As :meth:`wb.Sender.push`, after the kernels queued on the parameters' devices (the
        optimizer step) have finished: wb reads the weights on other streams."""
        for d in self._cuda:
            torch.cuda.synchronize(d)
        return super().push(*args, **kwargs)


class Receiver(wb.Receiver):
    """:class:`wb.Receiver` writing into ``model``'s own parameter storage (addresses unchanged,
    as CUDA graphs need); with ``staging=True``, ``apply()`` is one device copy per parameter.
    Same arguments as :class:`wb.Receiver` after ``model``."""

    def __init__(self, model, plan: wb.Plan, rank: int, **kwargs):
        lay = next((x for x in plan.rollouts if x.worker.rank == rank), None)
        names = list(lay.buffers) if lay is not None else None
        super().__init__(plan, rank, buffers(model, names), **kwargs)
