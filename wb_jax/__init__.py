"""JAX shim of WeightBridge: probe a JAX trainer's load function; maps of each addressable shard;
:class:`Sender` over a params pytree of sharded arrays and :class:`Receiver` whose ``apply()``
returns a new pytree built zero-copy from the received buffers.

A JAX process drives several devices, each a wb worker (rank) with its own transport: the shim
runs one :class:`wb.Sender` / :class:`wb.Receiver` per device, in threads.

The reference JAX trainer layout used by tests and the demo is in :mod:`wb_jax.testing`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

import wb

__all__ = ["probe", "shard_maps", "device_maps", "device_arrays", "use_cpu_devices", "layouts",
           "shard_buffers", "Sender", "Receiver"]


def use_cpu_devices(n: int) -> int:
    """Asks JAX for ``n`` emulated CPU devices (for meshes on one machine); returns how many exist.

    Only works before JAX starts its backend (the first computation); afterwards the devices that
    exist are kept, and the caller gets their count to check.
    """
    try:
        jax.config.update("jax_num_cpu_devices", max(int(n), 1))
    except RuntimeError:
        pass  # backend already started (a notebook, a test session): keep what exists
    return len(jax.devices())


def _leaves(tree: Any) -> dict[str, Any]:
    return {jax.tree_util.keystr(path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def probe(load_fn: Callable[[Mapping[str, np.ndarray]], Any], spec: wb.CheckpointSpec, *,
          progress: bool = False) -> dict[str, wb.SourceMap]:
    """Source maps of the global arrays of the params pytree ``load_fn`` builds from a checkpoint.

    Args:
        load_fn: a function from ``{name: array}`` (full checkpoint tensors, numpy arrays in the
            spec's dtypes) to a params pytree of arrays. It must only move data; padding it creates
            from zeros maps to ``-1``.
        spec: the checkpoint's tensors.
        progress: show a progress bar over passes.

    Returns:
        ``{jax.tree_util.keystr(path): SourceMap}`` of each leaf's global array. Use
        :func:`shard_maps` for the map of each addressable shard.

    Raises:
        wb.ProbeError: ``load_fn`` raised (names the checkpoint tensor it was being fed) or is not
            pure data movement (names the leaf and its first bad element).
    """
    return wb.probe(spec, lambda ckpt: _leaves(load_fn(ckpt)), progress=progress)


def shard_maps(sourcemap: wb.SourceMap, sharding: jax.sharding.Sharding) -> dict[Any, wb.SourceMap]:
    """The source map of each addressable shard of an array with ``sharding``.

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


def device_maps(params: Any, maps: Mapping[str, wb.SourceMap]) -> dict[Any, dict[str, tuple[wb.SourceMap, str]]]:
    """Per addressable device, ``{leaf key: (shard map, dtype)}`` of every leaf of ``params``.

    These are a trainer's holders: one dict per device, ready for ``wb.Layout`` buffers.
    """
    out: dict[Any, dict[str, tuple[wb.SourceMap, str]]] = {}
    for key, leaf in _leaves(params).items():
        if key not in maps:
            raise wb.SpecError(f"params leaf `{key}` has no source map; probe the same load_fn")
        dtype = wb.data.dtypes.canonical_dtype(leaf.dtype)
        for dev, sm in shard_maps(maps[key], leaf.sharding).items():
            out.setdefault(dev, {})[key] = (sm, dtype)
    return out


def device_arrays(params: Any) -> dict[Any, dict[str, np.ndarray]]:
    """Per addressable device, ``{leaf key: numpy copy of that device's shard}`` of ``params``
    (the same devices and keys, in the same order, as :func:`device_maps`)."""
    out: dict[Any, dict[str, np.ndarray]] = {}
    for key, leaf in _leaves(params).items():
        for shard in leaf.addressable_shards:
            out.setdefault(shard.device, {})[key] = np.asarray(shard.data)
    return out


def layouts(params: Any, maps: Mapping[str, wb.SourceMap], *, ranks: Mapping[Any, int],
            node: str, role: str, holders: str = "replica0") -> list[wb.Layout]:
    """One :class:`wb.Layout` per device of ``ranks`` (``{device: rank}``).

    Args:
        params: the params pytree (its leaves' shardings give each device's shard).
        maps: the global arrays' maps (:func:`probe`).
        ranks: the rank of each addressable device that is a worker.
        node: the node (machine) of these devices.
        role: ``"trainer"`` or ``"rollout"``.
        holders: for a trainer, ``"replica0"`` (default) keeps only shards with replica id 0:
            the other replicas hold the same bytes, and leaving them out keeps data-parallel
            devices free to train on; ``"all"`` offers every replica to the planner. Rollouts
            need every shard.

    Returns:
        Layouts in the order of ``ranks``; leaves whose shard maps no id are left out.
    """
    if holders not in ("replica0", "all"):
        raise wb.SpecError(f"holders must be 'replica0' or 'all', got {holders!r}")
    per_dev: dict[Any, dict[str, wb.BufferSpec]] = {d: {} for d in ranks}
    for key, leaf in _leaves(params).items():
        if key not in maps:
            raise wb.SpecError(f"params leaf `{key}` has no source map; probe the same load_fn")
        dtype = wb.data.dtypes.canonical_dtype(leaf.dtype)
        sms = shard_maps(maps[key], leaf.sharding)
        for shard in leaf.addressable_shards:
            if shard.device not in per_dev:
                continue
            if role == "trainer" and holders == "replica0" and shard.replica_id != 0:
                continue
            sm = sms[shard.device]
            if sm.n_ids:
                per_dev[shard.device][key] = wb.BufferSpec(sm, dtype)
    return [wb.Layout(wb.Worker(rank=r, node=node, role=role, local_rank=i), per_dev[d])
            for i, (d, r) in enumerate(ranks.items())]


def _host_or_device(a):
    """A shard's buffer as wb takes it: a numpy view on the CPU backend (no copy), the device
    array itself (``__cuda_array_interface__``) on GPUs."""
    if a.device.platform == "cpu":
        return np.asarray(a)
    return a


def shard_buffers(params: Any, ranks: Mapping[Any, int]) -> dict[int, dict[str, Any]]:
    """``{rank: {leaf key: that device's shard}}`` (no copy where the backend allows)."""
    out: dict[int, dict[str, Any]] = {r: {} for r in ranks.values()}
    for key, leaf in _leaves(params).items():
        for shard in leaf.addressable_shards:
            if shard.device in ranks:
                out[ranks[shard.device]][key] = _host_or_device(shard.data)
    return out


class _PerDevice:
    def __init__(self, make: dict[int, Callable[[], Any]]):
        self._pool = ThreadPoolExecutor(max_workers=max(len(make), 1),
                                        thread_name_prefix="wb-jax")
        # each worker connects to its peers (possibly this process's other devices) when made
        futs = {r: self._pool.submit(f) for r, f in make.items()}
        self.workers = {r: f.result() for r, f in futs.items()}

    def _all(self, fn):
        return list(self._pool.map(fn, self.workers.values()))

    @property
    def version(self) -> int:
        return min(w.version for w in self.workers.values())

    @property
    def stats(self) -> list:
        return [x for w in self.workers.values() for x in w.stats]

    def close(self) -> None:
        self._all(lambda w: w.close())
        self._pool.shutdown()


class Sender(_PerDevice):
    """Sends a params pytree of sharded ``jax.Array``s: one :class:`wb.Sender` per device rank.

    Args:
        params: the current params (their shards are checked against the plan).
        plan: the plan.
        ranks: ``{device: rank}`` of this process's trainer workers.
        transports: ``{rank: Transport}``.
        kwargs: as :class:`wb.Sender` (``store=``, ``staging=``, ``timeout=``, ...).
    """

    def __init__(self, params: Any, plan: wb.Plan, ranks: Mapping[Any, int], *,
                 transports: Mapping[int, Any], **kwargs):
        self.ranks = dict(ranks)
        bufs = self._buffers(params, plan)
        super().__init__({r: functools.partial(wb.Sender, plan, r, bufs[r],
                                               transport=transports[r], **kwargs)
                          for r in self.ranks.values()})

    def _buffers(self, params, plan):
        bufs = shard_buffers(params, self.ranks)
        names = {lay.worker.rank: set(lay.buffers) for lay in plan.trainers}
        return {r: {k: v for k, v in b.items() if k in names.get(r, ())} for r, b in bufs.items()}

    def push(self, params: Any) -> int:
        """Pushes ``params`` (a new pytree each training step) from every device; returns the
        version. Blocks as :meth:`wb.Sender.push` does for the staging mode."""
        bufs = self._buffers(params, next(iter(self.workers.values())).plan)
        for leaf in _leaves(params).values():
            leaf.block_until_ready()
        return self._all(lambda w: w.push(buffers=bufs[w.rank]))[0]

    def wait(self) -> None:
        self._all(lambda w: w.wait())


class Receiver(_PerDevice):
    """Receives into new buffers every version; ``apply()`` returns a new params pytree made from
    them without copying (``jax.make_array_from_single_device_arrays`` over 64-byte aligned host
    buffers on the CPU backend; the received device buffers on GPUs).

    Args:
        params: a template pytree with the target shardings (its values are kept only for leaves
            no checkpoint id reaches, such as padding).
        plan, ranks, transports, kwargs: as :class:`Sender` (``staging=`` is receiver staging).
    """

    def __init__(self, params: Any, plan: wb.Plan, ranks: Mapping[Any, int], *,
                 transports: Mapping[int, Any], allocate=None, **kwargs):
        from wb.runtime.coordinator import aligned_empty

        self.ranks = dict(ranks)
        self._template = params
        alloc = allocate or aligned_empty
        names = {lay.worker.rank: set(lay.buffers) for lay in plan.rollouts}
        first = {}  # the template's values: what elements no id reaches keep
        for r, bufs in shard_buffers(params, self.ranks).items():
            first[r] = {}
            for k, v in bufs.items():
                if k in names.get(r, ()):
                    first[r][k] = alloc(v.shape, wb.data.dtypes.canonical_dtype(v.dtype))
                    first[r][k][...] = v
        super().__init__({r: functools.partial(wb.Receiver, plan, r, first[r],
                                               transport=transports[r], handoff=True,
                                               allocate=alloc, **kwargs)
                          for r in self.ranks.values()})

    def ready(self) -> bool:
        """Whether every device has the next version ready (see :meth:`wb.Receiver.ready`)."""
        return all(w.ready() for w in self.workers.values())

    def apply(self) -> Any:
        """Installs the next version on every device; returns the new params pytree."""
        self._all(lambda w: w.apply())
        by_rank = {r: w.buffers for r, w in self.workers.items()}
        leaves, treedef = jax.tree_util.tree_flatten_with_path(self._template)
        out = []
        for path, leaf in leaves:
            key = jax.tree_util.keystr(path)
            shards = []
            for shard in leaf.addressable_shards:
                r = self.ranks.get(shard.device)
                buf = by_rank.get(r, {}).get(key) if r is not None else None
                # jax.device_put aliases an aligned host buffer on the CPU backend (no copy)
                shards.append(shard.data if buf is None else jax.device_put(buf, shard.device))
            out.append(jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding,
                                                                shards))
        return jax.tree_util.tree_unflatten(treedef, out)
