"""JAX shim of WeightBridge: the same functions, names and signatures as :mod:`wb_torch`.

=========================  ==============================================================
``probe``                  source maps of the params a load function builds, by running it
                           on id-encoded checkpoint arrays
``layouts``                one :class:`wb.Layout` per rank (device) from probed maps
``checkpoint_layouts``     layouts of arrays named like the checkpoint (each device's shard
                           of a sharded ``jax.Array`` is a block of it)
``buffers``                ``{rank: {name: array}}``: each device's shard, no copy
``Sender`` / ``Receiver``  the trainer's and the rollout's end of every update
``to_numpy`` / ``from_numpy``  arrays <-> numpy
=========================  ==============================================================

``params`` is a pytree of ``jax.Array`` (keys: ``jax.tree_util.keystr`` of each leaf's path);
``ranks`` is an int (every leaf lives on one device, which is this rank) or ``{device: rank}``: a
JAX process drives several devices, each a wb worker with its own transport. JAX-only helpers:
:func:`shard_maps`, :func:`device_maps`, :func:`device_arrays`, :func:`use_cpu_devices`.

The reference JAX trainer layout used by tests and the demo is in :mod:`wb_jax.testing`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, Union

import jax
import numpy as np

import wb
from wb.algorithms.probing import HostArrays
from wb.runtime.engine import dlpack
from wb_jax.devices import use_cpu_devices
from wb_jax.probing import DeviceArrays
from wb_jax.views import array_of
from wb.data.dtypes import canonical_dtype, dtype_info

log = logging.getLogger(__name__)

__all__ = ["probe", "layouts", "checkpoint_layouts", "buffers", "Sender", "Receiver",
           "to_numpy", "from_numpy",
           # JAX only
           "leaves", "shard_maps", "device_maps", "device_arrays", "use_cpu_devices"]

Ranks = Union[int, Mapping[Any, int]]


def leaves(params: Any) -> dict[str, Any]:
    """``{jax.tree_util.keystr(path): leaf}`` of a pytree: the names this shim gives its leaves.

    Examples:
        >>> list(leaves({"a": {"b": 1}}))
        ["['a']['b']"]
    """
    flat, treedef = jax.tree_util.tree_flatten(params)
    keys = _KEYS.get(treedef)
    if keys is None:  # names once per structure: a trainer's pytree is new every step
        if len(_KEYS) >= 64:
            _KEYS.clear()
        keys = _KEYS[treedef] = [jax.tree_util.keystr(path) for path, _
                                 in jax.tree_util.tree_flatten_with_path(params)[0]]
    return dict(zip(keys, flat))


#: Leaf names by pytree structure (:func:`leaves`): ``keystr`` costs microseconds a leaf.
_KEYS: dict[Any, list[str]] = {}


def to_numpy(x: jax.Array) -> np.ndarray:
    """``np.asarray(x)``: ``x``'s values gathered from its devices, in the same dtype (bfloat16
    and float8 as ml_dtypes dtypes). Mirrors :func:`wb_torch.to_numpy`.

    >>> to_numpy(jax.numpy.ones(2, dtype=jax.numpy.bfloat16)).dtype
    dtype(bfloat16)
    """
    return np.asarray(x)


def from_numpy(a: np.ndarray, device: Any = None) -> jax.Array:
    """``jax.device_put(a, device)``: a ``jax.Array`` of ``a``'s values in the same dtype, on
    ``device`` (a device or sharding; default: JAX's default device). Mirrors
    :func:`wb_torch.from_numpy`.

    >>> from_numpy(np.arange(3, dtype=np.float32)).tolist()
    [0.0, 1.0, 2.0]
    """
    return jax.device_put(a, device)


def probe(load_fn: Callable[[Mapping[str, np.ndarray]], Any], spec: wb.CheckpointSpec, *,
          progress: bool = False, cache: str | os.PathLike | None = None,
          key: Any = None, arrays: Any = None) -> dict[str, wb.SourceMap]:
    """Source maps of the global arrays of the params pytree ``load_fn`` builds from a checkpoint.

    Args:
        load_fn: a function from ``{name: array}`` (full checkpoint tensors, numpy arrays in the
            spec's dtypes) to a params pytree of arrays. It must only move data; padding it creates
            from zeros maps to ``-1``.
        spec: the checkpoint's tensors.
        progress: show a progress bar over passes.
        cache: a file or directory where the maps are kept (see :func:`wb.probe`): a second start
            reads them back without calling ``load_fn``. The fingerprint covers the spec, ``key``
            and, when ``jax.eval_shape`` can trace ``load_fn``, every leaf's shape and dtype (a
            ``load_fn`` it cannot trace is described by spec and ``key`` only: put what tells
            models apart in ``key``).
        key: what distinguishes this process's maps (JSON-able, e.g. ``{"mesh": [2, 4]}``).
        arrays: where the per-element work runs (a :class:`wb.algorithms.probing.ProbeArrays`).
            Default: on JAX's default device when it is an accelerator (checkpoint arrays made
            there and passed to ``load_fn`` as ``jax.Array``; leaves checked and decoded there;
            only runs of ids come back: :class:`wb_jax.probing.DeviceArrays`), numpy on the
            host when JAX runs on CPU (faster there, as for :func:`wb_torch.probe`).

    Returns:
        ``{jax.tree_util.keystr(path): SourceMap}`` of each leaf's global array (:func:`layouts`
        cuts them into each device's shard).

    Raises:
        wb.ProbeError: ``load_fn`` raised (names the checkpoint tensor it was being fed), wrote no
            checkpoint id anywhere, or is not pure data movement (names the leaf and its first bad
            element).
    """
    if arrays is None:
        arrays = HostArrays() if jax.default_backend() == "cpu" else DeviceArrays()
    on_device = isinstance(arrays, DeviceArrays)
    info = _leaf_info(load_fn, spec) if cache is not None else None
    if on_device and info is None:
        try:
            info = _leaf_info(load_fn, spec)
        except wb.SpecError:  # a leaf dtype wb does not know: the probe itself names it
            info = None
    if on_device and info and not arrays.leaves:  # its reads compile while pass 1 runs
        arrays.leaves = {k: (s, dtype_info(d).numpy) for k, (s, d, _) in info.items()}
    return wb.probe(spec, lambda ckpt: leaves(load_fn(ckpt)), progress=progress, cache=cache,
                    key=key, buffers=info, arrays=arrays)


def _leaf_info(load_fn, spec: wb.CheckpointSpec) -> dict[str, tuple] | None:
    """``{leaf key: (shape, dtype, device kind)}`` of ``load_fn``'s output, traced, not run."""
    abstract = {n: jax.ShapeDtypeStruct(s, dtype_info(d).numpy)
                for n, (s, d) in spec.items()}
    try:
        out = jax.eval_shape(load_fn, abstract)
    except Exception as e:  # noqa: BLE001 - any untraceable load_fn falls back to spec + key
        log.info("probe cache: load_fn cannot be traced (%s: %s); its fingerprint is the spec and "
                 "key only", type(e).__name__, e)
        return None
    kind = jax.default_backend()
    return {jax.tree_util.keystr(p): (tuple(x.shape), canonical_dtype(x.dtype), kind)
            for p, x in jax.tree_util.tree_flatten_with_path(out)[0]}


def shard_maps(sourcemap: wb.SourceMap, sharding: jax.sharding.Sharding) -> dict[Any, wb.SourceMap]:
    """The source map of each addressable shard of an array with ``sharding`` (JAX only).

    Args:
        sourcemap: the map of the global array (from :func:`probe`).
        sharding: the array's sharding (``array.sharding``).

    Returns:
        ``{device: SourceMap}`` for every addressable device, from
        ``sharding.addressable_devices_indices_map(shape)`` (replicas included).
    """
    index = sharding.addressable_devices_indices_map(sourcemap.shape)
    full = sourcemap.to_indices()
    return {dev: wb.SourceMap.from_indices(full[idx]) for dev, idx in index.items()}


def device_maps(params: Any, maps: Mapping[str, wb.SourceMap]
                ) -> dict[Any, dict[str, tuple[wb.SourceMap, str]]]:
    """Per addressable device, ``{leaf key: (shard map, dtype)}`` of every leaf (JAX only).

    Args:
        params: the params pytree.
        maps: the global arrays' maps (:func:`probe`).

    Returns:
        ``{device: {leaf key: (SourceMap, dtype name)}}``.

    Raises:
        wb.SpecError: a leaf has no map.
    """
    out: dict[Any, dict[str, tuple[wb.SourceMap, str]]] = {}
    for key, leaf in leaves(params).items():
        if key not in maps:
            raise wb.SpecError(f"params leaf `{key}` has no source map; probe the same load_fn")
        dtype = canonical_dtype(leaf.dtype)
        for dev, sm in shard_maps(maps[key], leaf.sharding).items():
            out.setdefault(dev, {})[key] = (sm, dtype)
    return out


def device_arrays(params: Any) -> dict[Any, dict[str, np.ndarray]]:
    """Per addressable device, ``{leaf key: numpy copy of that device's shard}`` (JAX only; the
    same devices and keys, in the same order, as :func:`device_maps`).

    Args:
        params: the params pytree.

    Returns:
        ``{device: {leaf key: numpy array}}``.
    """
    out: dict[Any, dict[str, np.ndarray]] = {}
    for key, leaf in leaves(params).items():
        for shard in leaf.addressable_shards:
            out.setdefault(shard.device, {})[key] = np.asarray(shard.data)
    return out


# --- params -> ranks ---------------------------------------------------------------------------
def _devices(params: Any, ranks: Ranks) -> dict[Any, int]:
    """``{device: rank}``; an int ``ranks`` is the rank of the one device every leaf lives on."""
    if isinstance(ranks, Mapping):
        return {d: int(r) for d, r in ranks.items()}
    if not isinstance(ranks, (int, np.integer)) or isinstance(ranks, bool):
        raise TypeError(f"ranks must be an int (the rank of the one device of params) or "
                        f"{{device: rank}}, got {type(ranks).__name__}")
    devs = {d for leaf in leaves(params).values() for d in leaf.sharding.device_set}
    if len(devs) != 1:
        raise wb.SpecError(f"ranks={ranks} names one rank, but params live on {len(devs)} "
                           f"devices; give ranks={{device: rank}} for every device of this "
                           f"process")
    return {devs.pop(): int(ranks)}


def _host_or_device(a):
    """A shard's buffer as wb takes it: a numpy view on the CPU backend (no copy), the device
    array itself on GPUs (the core reads it through DLPack)."""
    if a.device.platform == "cpu":
        return np.asarray(a)
    return a


def _described(a):
    """A device shard as wb reads it every update: its address, shape, dtype and device
    (:class:`wb.runtime.engine.dlpack.Export`, the array kept alive), without ``__dlpack__`` (~0.3 ms
    per array on a GPU, and a trainer's arrays are new every step). wb reads them only while a
    push runs, after :meth:`_Arrays.settle`; host arrays (numpy views) are as they are."""
    if not isinstance(a, jax.Array):
        return a
    return dlpack.Export(a.unsafe_buffer_pointer(), a.shape, canonical_dtype(a.dtype),
                         a.__dlpack_device__(), a)


def buffers(params: Any, ranks: Ranks) -> dict[int, dict[str, Any]]:
    """Each device's shard of every leaf, per rank, as :mod:`wb` takes them (no copy where the
    backend allows: numpy views on the CPU backend, the device arrays on GPUs).

    Args:
        params: the params pytree.
        ranks: the rank of the one device of ``params``, or ``{device: rank}``.

    Returns:
        ``{rank: {leaf key: array}}``.

    Examples:
        >>> buffers({"w": jax.numpy.zeros((2, 3))}, 0)[0]["['w']"].shape
        (2, 3)
    """
    by_dev = _devices(params, ranks)
    out: dict[int, dict[str, Any]] = {r: {} for r in by_dev.values()}
    for key, leaf in leaves(params).items():
        devs = leaf.sharding.device_set
        if len(devs) == 1:  # the array is its one shard (no Shard objects made per step)
            (dev,) = devs
            if dev in by_dev:
                out[by_dev[dev]][key] = _host_or_device(leaf)
            continue
        for shard in leaf.addressable_shards:
            if shard.device in by_dev:
                out[by_dev[shard.device]][key] = _host_or_device(shard.data)
    return out


def layouts(params: Any, maps: Mapping[str, wb.SourceMap], ranks: Ranks, *, node: str,
            role: str, local_rank: int = 0, holders: str = "replica0") -> list[wb.Layout]:
    """One :class:`wb.Layout` per rank (device), from the maps :func:`probe` found.

    Args:
        params: the params pytree (its leaves' shardings give each device's shard).
        maps: the global arrays' maps (:func:`probe`).
        ranks: the rank of the one device of ``params``, or ``{device: rank}``.
        node: the node (machine) of these devices.
        role: ``"trainer"`` or ``"rollout"``.
        local_rank: the GPU (NIC) index on the node of the first rank; the others follow.
        holders: for a trainer, ``"replica0"`` (default) keeps only shards with replica id 0:
            the other replicas hold the same bytes, and leaving them out keeps data-parallel
            devices free to train on; ``"all"`` offers every replica to the planner. Rollouts
            need every shard.

    Returns:
        Layouts in the order of ``ranks``; leaves whose shard maps hold no id are left out.

    Raises:
        wb.SpecError: a leaf has no map, or ``holders`` is unknown.
    """
    if holders not in ("replica0", "all"):
        raise wb.SpecError(f"holders must be 'replica0' or 'all', got {holders!r}")
    by_dev = _devices(params, ranks)
    per_dev: dict[Any, dict[str, wb.BufferSpec]] = {d: {} for d in by_dev}
    for key, leaf in leaves(params).items():
        if key not in maps:
            raise wb.SpecError(f"params leaf `{key}` has no source map; probe the same load_fn "
                               f"(maps has {sorted(maps)[:5]}...)")
        dtype = canonical_dtype(leaf.dtype)
        sms = shard_maps(maps[key], leaf.sharding)
        for shard in leaf.addressable_shards:
            if shard.device not in per_dev:
                continue
            if role == "trainer" and holders == "replica0" and shard.replica_id != 0:
                continue
            sm = sms[shard.device]
            if sm.n_ids:
                per_dev[shard.device][key] = wb.BufferSpec(sm, dtype)
    return [wb.Layout(wb.Worker(rank=r, node=node, role=role, local_rank=local_rank + i),
                      per_dev[d]) for i, (d, r) in enumerate(by_dev.items())]


def checkpoint_layouts(params: Mapping[str, jax.Array], spec: wb.CheckpointSpec, ranks: Ranks, *,
                       node: str, role: str, local_rank: int = 0,
                       offsets: Mapping[str, tuple[int, ...]] | None = None) -> list[wb.Layout]:
    """Layouts of arrays named like the checkpoint, each device's shard a block of the tensor (its
    index from the sharding; plus ``offsets[name]`` when the array itself is a block of the
    checkpoint tensor). Nothing is probed.

    Args:
        params: ``{checkpoint name: jax.Array}``.
        spec: the checkpoint's tensors.
        ranks: the rank of the one device of ``params``, or ``{device: rank}``.
        node, role, local_rank: as :func:`layouts`.
        offsets: where each array starts in its checkpoint tensor (default: offset 0).

    Returns:
        Layouts in the order of ``ranks``; buffers are named as :func:`leaves` names them
        (``"['name']"``), like every buffer of this shim.

    Raises:
        wb.SpecError: a name not in ``spec``, or a block that does not fit its tensor.
    """
    by_dev = _devices(params, ranks)
    per_dev: dict[Any, dict[str, wb.BufferSpec]] = {d: {} for d in by_dev}
    for name, arr in params.items():
        if name not in spec:
            raise wb.SpecError(f"array `{name}` is not in the checkpoint spec; "
                               f"checkpoint_layouts needs checkpoint names (use probe and "
                               f"layouts for a load function instead)")
        key = jax.tree_util.keystr((jax.tree_util.DictKey(name),))  # as leaves() names it
        base = tuple((offsets or {}).get(name, (0,) * arr.ndim))
        dtype = canonical_dtype(arr.dtype)
        for dev, idx in arr.sharding.addressable_devices_indices_map(arr.shape).items():
            if dev not in per_dev:
                continue
            start = [s.indices(n)[0] for s, n in zip(idx, arr.shape)]
            stop = [s.indices(n)[1] for s, n in zip(idx, arr.shape)]
            off = tuple(b + a for b, a in zip(base, start))
            shape = tuple(e - a for a, e in zip(start, stop))
            per_dev[dev][key] = wb.BufferSpec(
                wb.SourceMap.from_indices(spec.block_ids(name, off, shape)), dtype)
    return [wb.Layout(wb.Worker(rank=r, node=node, role=role, local_rank=local_rank + i),
                      per_dev[d]) for i, (d, r) in enumerate(by_dev.items())]


# --- Sender / Receiver -------------------------------------------------------------------------
class _Arrays:
    """How ``jax.Array`` pytrees meet wb (a :class:`wb.ParamsAdapter`): each device's shard of the
    leaves the plan names, ready arrays, and a new pytree from the buffers a version landed in."""

    handoff = True  # jax.Arrays are immutable: every version lands in new buffers

    def __init__(self, layouts: Mapping[int, wb.Layout], params: Any, ranks: Ranks):
        self.layouts, self.ranks = layouts, _devices(params, ranks)
        self._treedef, self._keys = None, []  # the leaves' names by pytree structure

    def buffers(self, params: Any) -> dict[int, dict[str, Any]]:
        # a rank without a layout keeps all its arrays: the group refuses it, naming the plan's
        return {r: {k: _described(v) for k, v in b.items()
                    if r not in self.layouts or k in self.layouts[r].buffers}
                for r, b in buffers(params, self.ranks).items()}

    def settle(self, params: Any) -> None:
        jax.block_until_ready(jax.tree_util.tree_leaves(params))  # one batched wait

    def _device(self, rank: int):
        """The device of ``rank`` in this process (None: not one of its ranks)."""
        return next((d for d, r in self.ranks.items() if r == rank), None)

    def recycles(self, rank: int) -> bool:
        """On a GPU a rank's versions land in a few sets of memory wb owns, which
        :meth:`received` makes arrays of (``jax.dlpack.from_dlpack``, no copy), reused once JAX
        has freed every array made of a set (UCX maps each set once). On the CPU backend every
        version gets new host arrays, which ``jax.device_put`` aliases on any CPU device."""
        dev = self._device(rank)
        return dev is not None and dev.platform != "cpu"

    def allocator(self, rank: int) -> Callable | None:
        """How a rank's sets of receive buffers are made: CUDA memory of its own GPU (CuPy's,
        which UCX maps once per set), or ``None`` on the CPU backend (64-byte aligned host
        arrays). Either way :meth:`received` makes JAX arrays of that memory, without a copy."""
        dev = self._device(rank)
        if dev is None or dev.platform == "cpu":
            return None
        if dev.platform != "gpu":
            raise wb.TransferError(f"rank {rank}: JAX device {dev} is a {dev.platform}; wb "
                                   f"receives into host and CUDA memory")

        def allocate(shape: tuple[int, ...], dtype: str) -> Any:
            import cupy  # wb moves CUDA memory with CuPy (see wb.runtime.engine.buffers)

            with cupy.cuda.Device(dev.local_hardware_id):
                a = cupy.zeros(shape, dlpack.cuda_dtype(dtype))
                cupy.cuda.get_current_stream().synchronize()  # written by wb's streams next
            return a

        return allocate

    def received(self, params: Any, bufs: dict[int, dict[str, Any]]) -> Any:
        """A new pytree with ``params``' shardings over the received buffers, without a copy:
        each is a DLPack export of wb's memory (see :meth:`allocator`), made a ``jax.Array`` of
        the same memory by ``jax.dlpack.from_dlpack``; other arrays are placed with
        ``jax.device_put`` (which aliases 64-byte aligned host memory on the CPU backend)."""
        flat, treedef = jax.tree_util.tree_flatten(params)
        if self._treedef is None or treedef != self._treedef:  # leaves' names, once per structure
            self._treedef = treedef
            self._keys = [jax.tree_util.keystr(path)
                          for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        out = []
        for key, leaf in zip(self._keys, flat):
            sharding = leaf.sharding
            if isinstance(sharding, jax.sharding.SingleDeviceSharding):  # the array is its shard
                (dev,) = sharding.device_set
                r = self.ranks.get(dev)
                out.append(self._shard(leaf, dev, bufs.get(r, {}).get(key) if r is not None
                                       else None))
                continue
            shards = []
            for shard in leaf.addressable_shards:
                r = self.ranks.get(shard.device)
                buf = bufs.get(r, {}).get(key) if r is not None else None
                shards.append(self._shard(shard.data, shard.device, buf))
            out.append(jax.make_array_from_single_device_arrays(leaf.shape, sharding, shards))
        return jax.tree_util.tree_unflatten(treedef, out)

    @staticmethod
    def _shard(old: Any, device: Any, buf: Any) -> Any:
        """The array of one device's shard: ``old`` where nothing was received for it, else the
        received buffer as a ``jax.Array`` on ``device`` (no copy: see :meth:`received`)."""
        if buf is None:
            return old
        if isinstance(buf, jax.Array) and buf.devices() == {device}:
            return buf
        if isinstance(buf, dlpack.Export):
            return array_of(buf, device)
        return jax.device_put(buf, device)


class Sender(wb.SenderGroup):
    """The trainer's end: ``push(params)`` after each training step sends a params pytree of
    ``jax.Array`` as the next version, once its arrays are ready (JAX makes new ones every step).

    Made as ``Sender(params, plan, ranks, *, transports, store, staging=True, **options)``, like
    every :class:`wb.SenderGroup` (one :class:`wb.Sender` per device rank, which reads each
    device's shard without a copy on the CPU backend).

    Args:
        params: the params pytree; ``ranks``: the rank of its one device, or ``{device: rank}``;
            the rest as :class:`wb.SenderGroup`.
    """

    adapter_type = _Arrays


class Receiver(wb.ReceiverGroup):
    """The rollout's end: ``ready()`` between generation steps, then ``apply()`` returns the new
    params.

    A :class:`wb.ReceiverGroup` over a pytree of ``jax.Array``. JAX arrays are immutable, so every
    version lands in buffers no live array refers to (:class:`wb.Receiver`'s ``handoff``) and
    ``apply()`` returns a new pytree made of them without a copy. On a GPU they are a few sets
    of CUDA memory wb owns, which UCX maps once and each version is received straight into
    (``recycle``); JAX's arrays are that memory (``jax.dlpack.from_dlpack``), and a set is
    written again only once JAX has freed every array made of it and the GPU has finished the
    work queued on them: arrays you keep are never written, but each older version you keep
    costs a set of memory. On the CPU backend every version gets new 64-byte aligned host
    arrays, which ``jax.device_put`` aliases.

    Args:
        params: a template pytree with the target shardings (its values are kept only for
            elements no checkpoint id reaches, such as padding).
        plan, ranks, transports, store: as :class:`Sender`.
        options: keyword options of :class:`wb.Receiver`: ``staging=`` (receiver staging),
            ``timeout=``, ``wait_timeout=``, ``allocate=``, ...
    """

    adapter_type = _Arrays

