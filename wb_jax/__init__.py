"""JAX shim of WeightBridge: probe a JAX trainer's load function; maps of each addressable shard.

The reference JAX trainer layout used by tests and the demo is in :mod:`wb_jax.testing`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

import wb

__all__ = ["probe", "shard_maps", "device_maps", "device_arrays", "use_cpu_devices"]


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
        dtype = wb.dtypes.canonical_dtype(leaf.dtype)
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
