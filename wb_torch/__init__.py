"""PyTorch shim of WeightBridge: the same functions, names and signatures as :mod:`wb_jax`.

=========================  ==============================================================
``probe``                  source maps of a model's parameters, by running its own
                           ``load_weights`` on id-encoded tensors
``layouts``                one :class:`wb.Layout` per rank from probed maps
``checkpoint_layouts``     layouts of tensors named like the checkpoint, each a block of
                           it (DTensor / FSDP2 local shards, or plain tensors + offsets)
``buffers``                ``{rank: {name: array}}`` sharing memory with the tensors
``Sender`` / ``Receiver``  the trainer's and the rollout's end of every update
``to_numpy`` / ``from_numpy``  tensors <-> numpy, bfloat16 and float8 included
=========================  ==============================================================

``params`` is an ``nn.Module`` (its parameters and persistent buffers, named as ``state_dict()``
names them) or ``{name: tensor}``; ``ranks`` is an int (this process is one worker: every tensor
belongs to that rank) or ``{device: rank}`` (tensors grouped by their device). The shim converts
tensors to zero-copy arrays and calls :mod:`wb`.

The reference vLLM-style rollout model used by tests and the demo is in :mod:`wb_torch.testing`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Union

import ml_dtypes
import numpy as np
import torch

import wb
from wb.algorithms.probing import HostArrays
from wb_torch.probing import DeviceArrays
from wb.data.dtypes import canonical_dtype

__all__ = ["probe", "layouts", "checkpoint_layouts", "buffers", "Sender", "Receiver",
           "to_numpy", "from_numpy"]

log = logging.getLogger(__name__)

Params = Union[torch.nn.Module, Mapping[str, torch.Tensor]]
Ranks = Union[int, Mapping[Any, int]]

# Same-size integer views: numpy has no bfloat16/float8, ml_dtypes does; torch <-> ml_dtypes goes
# through the raw bits.
_BITS = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
         torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
         torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2)}
_TORCH = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn,
          "float8_e5m2": torch.float8_e5m2}


def to_numpy(x: torch.Tensor) -> np.ndarray:
    """A numpy array of ``x``'s values in the same dtype (zero-copy on CPU; a copy from a GPU).

    Args:
        x: a tensor (bfloat16 and float8 become ml_dtypes arrays).

    Returns:
        The numpy array.

    Examples:
        >>> to_numpy(torch.ones(2, dtype=torch.bfloat16)).dtype
        dtype(bfloat16)
    """
    t = x.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype in _BITS:
        raw, npdt = _BITS[t.dtype]
        return t.view(raw).numpy().view(npdt)
    return t.numpy()


def from_numpy(a: np.ndarray, device: torch.device | str | None = None) -> torch.Tensor:
    """A tensor of ``a``'s values in the same dtype (bfloat16 and float8 included).

    Args:
        a: a numpy array.
        device: where to put it (default: the CPU, sharing ``a``'s memory when contiguous).

    Returns:
        The tensor.

    Examples:
        >>> from_numpy(np.arange(3, dtype=np.float32)).tolist()
        [0.0, 1.0, 2.0]
    """
    name = canonical_dtype(a.dtype)
    if name in _TORCH:
        raw = _BITS[_TORCH[name]][0]
        t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16 if raw == torch.int16
                                                           else np.uint8)).view(_TORCH[name])
    else:
        t = torch.from_numpy(np.ascontiguousarray(a))
    return t if device is None else t.to(device)


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
          progress: bool = False, cache: str | os.PathLike | None = None,
          key: Any = None, arrays: Any = None) -> dict[str, wb.SourceMap]:
    """Source maps of every state entry of ``model``, found by running its own ``load_weights``.

    ``load_weights`` follows vLLM's contract: it takes an iterable of ``(hf_name, full tensor)`` and
    writes the parameters (in place, or by replacing them as transformers' loader does: the
    module's tensors are read again after every pass). What is probed is what ``state_dict()``
    holds: the parameters and the **persistent buffers** (a checkpoint tensor kept in a
    ``register_buffer(..., persistent=True)``, such as DeepSeek-V3's ``e_score_correction_bias``),
    named as :func:`layouts` and :func:`buffers` name them. Before each pass each of them is zeroed
    (0 is the probe's "never written" value), so **probing overwrites the model's parameters and
    persistent buffers**: probe first, then load or receive real weights. Non-persistent buffers
    (rotary ``inv_freq``) are neither zeroed nor probed.

    Args:
        model: the module; its parameter and persistent buffer names key the result.
        spec: the checkpoint's tensors (names, shapes, dtypes) as ``load_weights`` expects them.
        load_weights: defaults to ``model.load_weights``.
        progress: show a progress bar over passes.
        cache: a file or directory where the maps are kept (see :func:`wb.probe`): a second start
            of the same rank reads them back without calling ``load_weights``; a changed spec,
            model (any tensor's name, shape, dtype or device kind) or ``key`` probes again.
        key: what distinguishes this rank (JSON-able, e.g. ``{"tp": 8, "rank": 3}``).
        arrays: where the per-element work runs (a :class:`wb.algorithms.probing.ProbeArrays`).
            Default: on the parameters' device with torch when it is a GPU (checkpoint tensors
            made there, checked and decoded there; only runs of ids come back:
            :class:`wb_torch.probing.DeviceArrays`), numpy
            on the host for CPU parameters (its kernels beat torch's int64 and bfloat16 CPU
            kernels several times over: ``bench/bench_probe.py``).

    Returns:
        ``{state entry name: SourceMap}``; elements ``load_weights`` never writes map to ``-1``.

    Raises:
        wb.ProbeError: ``model`` has no parameters or no ``load_weights``, ``load_weights`` raised
            (names the checkpoint tensor it was being fed), wrote no checkpoint id anywhere, or is
            not pure data movement (names the tensor and its first bad element).
    """
    if load_weights is None:
        if not hasattr(model, "load_weights"):
            raise wb.ProbeError(f"{type(model).__name__} has no load_weights method; pass "
                                f"load_weights= (an iterable of (name, tensor) -> in-place copy)")
        load_weights = model.load_weights
    params = _named(model)
    if not params:
        raise wb.ProbeError(f"{type(model).__name__} has no parameters to probe")
    device = next(iter(params.values())).device
    replaced: set[str] = set()

    def load(ckpt: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        before = _named(model)
        with torch.no_grad():
            for p in before.values():
                p.view(torch.uint8).zero_() if p.dtype in _BITS else p.zero_()
            load_weights((name, from_numpy(ckpt[name], device) if on_host else ckpt[name])
                         for name in ckpt)
        # A loader may put new tensors in place of the old (transformers setattrs a new
        # Parameter): what it wrote is in the module's tensors as they are now.
        after = _named(model)
        new = {n for n, t in after.items() if before.get(n) is not t} - replaced
        if new:
            log.info("load_weights replaced %d tensors (e.g. %s); probing the new ones",
                     len(new), sorted(new)[:3])
            replaced.update(new)
        return _ParamViews(after) if on_host else {n: _local(t) for n, t in after.items()}

    if arrays is None:
        arrays = HostArrays() if device.type == "cpu" else DeviceArrays(device)
    on_host = isinstance(arrays, HostArrays)
    info = {n: (tuple(_local(t).shape), canonical_dtype(t.dtype), _local(t).device.type)
            for n, t in params.items()}
    return wb.probe(spec, load, progress=progress, cache=cache, key=key, buffers=info,
                    arrays=arrays)


# --- params -> ranks ---------------------------------------------------------------------------
def _named(params: Params) -> dict[str, torch.Tensor]:
    """``{name: tensor}``: a module's parameters, then its persistent buffers (what
    ``state_dict()`` holds, with its names), each tensor once; a mapping as it is."""
    if isinstance(params, torch.nn.Module):
        named = dict(params.named_parameters())
        for name, b in params.named_buffers():
            owner, _, leaf = name.rpartition(".")
            # state_dict() itself would tell, but runs its hooks (FSDP gathers whole tensors
            # there); the set of non-persistent names is what state_dict consults
            mod = params.get_submodule(owner) if owner else params
            if leaf not in getattr(mod, "_non_persistent_buffers_set", ()) and name not in named:
                named[name] = b
        return named
    if isinstance(params, Mapping):
        return dict(params)
    raise TypeError(f"params must be an nn.Module or a mapping of name -> tensor, got "
                    f"{type(params).__name__}")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor's own storage: a DTensor's local shard, a parameter's data."""
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t


def _by_rank(params: Params, ranks: Ranks) -> dict[int, dict[str, torch.Tensor]]:
    """``{rank: {name: tensor}}``: every tensor for an int ``ranks``, else grouped by device."""
    named = _named(params)
    if isinstance(ranks, Mapping):
        want = {torch.device(d): int(r) for d, r in ranks.items()}
        out: dict[int, dict[str, torch.Tensor]] = {r: {} for r in want.values()}
        for name, t in named.items():
            r = want.get(_local(t).device)
            if r is not None:
                out[r][name] = t
        return out
    if isinstance(ranks, (int, np.integer)) and not isinstance(ranks, bool):
        return {int(ranks): named}
    raise TypeError(f"ranks must be an int (this process's one rank) or {{device: rank}}, got "
                    f"{type(ranks).__name__}")


def _array(name: str, t: torch.Tensor):
    """A zero-copy array of ``t``'s storage as wb takes it."""
    t = _local(t)
    if not t.is_contiguous():
        raise wb.TransferError(f"tensor `{name}` is not contiguous; wb reads and writes a "
                               f"tensor's own storage, which must be one dense block")
    if t.device.type == "cpu":
        return to_numpy(t)
    return t.detach()  # CUDA: the tensor itself, read through DLPack (wb.runtime.engine.dlpack)


def buffers(params: Params, ranks: Ranks) -> dict[int, dict[str, Any]]:
    """Arrays that share memory with the tensors (no copy), per rank, as :mod:`wb` takes them.

    CPU tensors become numpy views (bfloat16 / float8 through ml_dtypes); CUDA tensors stay
    tensors (detached: the same storage), which the core reads through DLPack. DTensors give
    their local shard.

    Args:
        params: an ``nn.Module`` (its parameters and persistent buffers) or ``{name: tensor}``.
        ranks: this process's rank (every tensor), or ``{device: rank}``.

    Returns:
        ``{rank: {name: array}}``.

    Raises:
        wb.TransferError: a tensor is not contiguous (its storage cannot be written in place).

    Examples:
        >>> buffers({"w": torch.zeros(2, 3)}, 0)[0]["w"].shape
        (2, 3)
    """
    return {r: {n: _array(n, t) for n, t in ts.items()} for r, ts in _by_rank(params, ranks).items()}


def layouts(params: Params, maps: Mapping[str, wb.SourceMap], ranks: Ranks, *, node: str,
            role: str, local_rank: int = 0, holders: str = "replica0") -> list[wb.Layout]:
    """One :class:`wb.Layout` per rank, from the maps :func:`probe` found.

    Args:
        params: the probed model (or ``{name: tensor}``): gives each buffer's dtype and device.
        maps: ``{state entry name: SourceMap}`` from :func:`probe`.
        ranks: this process's rank, or ``{device: rank}``.
        node: the node (machine) of this process.
        role: ``"trainer"`` or ``"rollout"``.
        local_rank: the GPU (NIC) index on the node of the first rank; the others follow.
        holders: ``"replica0"`` or ``"all"``: which data-parallel copies a trainer offers (as in
            :func:`wb_jax.layouts`; in PyTorch each process is one copy, so both are the same).

    Returns:
        Layouts in the order of ``ranks``; parameters whose maps hold no id are left out.

    Raises:
        wb.SpecError: a parameter or persistent buffer has no map, or ``holders`` is unknown.
    """
    if holders not in ("replica0", "all"):
        raise wb.SpecError(f"holders must be 'replica0' or 'all', got {holders!r}")

    def probed(n: str, t: torch.Tensor) -> wb.SourceMap | None:
        if n not in maps:
            raise wb.SpecError(f"tensor `{n}` has no source map; probe the same model "
                               f"(maps has {sorted(maps)[:5]}...)")
        return maps[n] if maps[n].n_ids else None
    return _layouts(params, ranks, probed, node=node, role=role, local_rank=local_rank)


def _layouts(params: Params, ranks: Ranks, map_of: Callable[[str, torch.Tensor], Any], *,
             node: str, role: str, local_rank: int) -> list[wb.Layout]:
    """A layout per rank of ``params``: each tensor with the map ``map_of`` gives it (``None``:
    left out), in its own dtype."""
    out = []
    for i, (r, named) in enumerate(_by_rank(params, ranks).items()):
        maps = {n: (map_of(n, t), _local(t).dtype) for n, t in named.items()}
        out.append(wb.Layout(wb.Worker(r, node, role, local_rank + i),
                             {n: wb.BufferSpec(sm, canonical_dtype(dt))
                              for n, (sm, dt) in maps.items() if sm is not None}))
    return out


def checkpoint_layouts(params: Params, spec: wb.CheckpointSpec, ranks: Ranks, *, node: str,
                       role: str, local_rank: int = 0,
                       offsets: Mapping[str, tuple[int, ...]] | None = None) -> list[wb.Layout]:
    """Layouts of tensors named like the checkpoint, each holding one rectangular block of it:
    DTensor / FSDP2 local shards (offsets from their mesh and placements) or plain tensors with
    ``offsets[name]`` (default: the whole tensor, offset 0). Nothing is probed.

    Args:
        params: ``{checkpoint name: tensor}`` (or a module whose parameter names are checkpoint
            names).
        spec: the checkpoint's tensors.
        ranks: this process's rank, or ``{device: rank}``.
        node, role, local_rank: as :func:`layouts`.
        offsets: the block's offset in the checkpoint tensor, for plain tensors.

    Returns:
        Layouts in the order of ``ranks``.

    Raises:
        wb.SpecError: a name not in ``spec``, or a block that does not fit its tensor.
    """
    def block(name: str, t: torch.Tensor) -> wb.SourceMap | None:
        if (name not in spec and isinstance(params, torch.nn.Module)
                and not isinstance(t, torch.nn.Parameter)):
            return None  # a persistent buffer that is not a checkpoint tensor (a step counter)
        if name not in spec:
            raise wb.SpecError(f"tensor `{name}` is not in the checkpoint spec; "
                               f"checkpoint_layouts needs checkpoint names (use probe and "
                               f"layouts for a loader instead)")
        return wb.SourceMap.from_indices(
            spec.block_ids(name, _offset(name, t, offsets), tuple(_local(t).shape)))
    return _layouts(params, ranks, block, node=node, role=role, local_rank=local_rank)


def _offset(name: str, t: torch.Tensor, offsets) -> tuple[int, ...]:
    if hasattr(t, "placements") and hasattr(t, "device_mesh"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        return tuple(compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                           t.placements)[1])
    return tuple((offsets or {}).get(name, (0,) * _local(t).dim()))


# --- Sender / Receiver -------------------------------------------------------------------------
class _Tensors:
    """How PyTorch tensors meet wb (a :class:`wb.ParamsAdapter`): zero-copy views of the tensors
    the plan names, a CUDA synchronisation before wb reads them, written in place."""

    handoff = False  # written in place: the buffers are the tensors' own storage

    def __init__(self, layouts: Mapping[int, wb.Layout], params: Params, ranks: Ranks):
        self.layouts, self.ranks = layouts, ranks

    def buffers(self, params: Params) -> dict[int, dict[str, Any]]:
        # a rank without a layout keeps all its tensors: the group refuses it, naming the plan's
        return {r: {n: _array(n, t) for n, t in ts.items()
                    if r not in self.layouts or n in self.layouts[r].buffers}
                for r, ts in _by_rank(params, self.ranks).items()}

    def settle(self, params: Params) -> None:
        # optimizers queue their updates on CUDA streams; wb reads on others
        for d in sorted({_local(t).device for t in _named(params).values()
                         if _local(t).device.type == "cuda"}, key=str):
            torch.cuda.synchronize(d)

    def received(self, params: Params, buffers: dict[int, dict[str, Any]]) -> Params:
        return params  # the buffers are the tensors' own storage


class Sender(wb.SenderGroup):
    """The trainer's end: ``push()`` after each training step sends the weights as a new version.

    ``Sender(params, plan, ranks, *, transports, store, staging=True, **options)``: a
    :class:`wb.SenderGroup` over PyTorch tensors, one :class:`wb.Sender` per rank. Tensors are
    read in place at each ``push`` (optimizers update them in place), once the kernels queued on
    their CUDA devices have finished; ``push(params)`` switches to new tensors.

    Args:
        params: an ``nn.Module`` or ``{name: tensor}`` of this process's trainer ranks.
        plan: the parts :func:`wb.agree_parts` gave this process, or the whole :class:`wb.Plan`.
        ranks: this process's rank, or ``{device: rank}``.
        transports: one :class:`wb.Transport`, or ``{rank: Transport}``.
        store: the rendezvous store every worker shares.
        options: keyword options of :class:`wb.Sender`: ``staging=`` (sender staging: ``push``
            returns after a local copy; see :data:`wb.MODES`), ``timeout=``, ``name=``, ...

    Raises:
        wb.TransferError: tensors that do not fit the plan, a peer running another plan.
    """

    adapter_type = _Tensors


class Receiver(wb.ReceiverGroup):
    """The rollout's end: ``ready()`` between generation steps, then ``apply()``.

    A :class:`wb.ReceiverGroup` writing into the tensors' own storage (addresses unchanged, as
    CUDA graphs need): ``apply()`` returns ``params`` itself, now holding the new version. With
    ``staging=True`` the next version lands in the background and ``apply()`` is one device copy
    per tensor.

    Args:
        params: the rollout model (or ``{name: tensor}``) whose storage receives the weights.
        plan, ranks, transports, store: as :class:`Sender`.
        options: keyword options of :class:`wb.Receiver`: ``staging=`` (receiver staging),
            ``timeout=``, ``wait_timeout=``, ...
    """

    adapter_type = _Tensors
