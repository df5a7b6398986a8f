"""PyTorch FSDP1 trainer layouts: one flat parameter per wrapped unit, sharded equally over ranks.

:func:`fsdp_trainer` gives every rank its 1-D shard of each ``FlatParameter`` (``use_orig_params=
False``, FULL_SHARD), one block per piece of a checkpoint tensor the shard spans.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from wb.data.layout import BufferSpec, Layout, Role
from wb.errors import SpecError
from wb.layouts.blocks import broadcast_blocks, buffer_spec, slice_block
from wb.layouts.dims import ModelDims
from wb.layouts.presets import spec_from_config
from wb.layouts.shards import check_world, worker_layouts

__all__ = ["fsdp_trainer"]

# FSDP's names of the root unit's and of decoder layer i's flat parameter.
_FSDP_ROOT = "_fsdp_wrapped_module._flat_param"
_FSDP_LAYER = "_fsdp_wrapped_module.model.layers.{i}._fsdp_wrapped_module._flat_param"


def fsdp_trainer(cfg: Mapping, *, nodes: Sequence[str], gpus_per_node: int = 8,
                 first_rank: int = 0, unit: str = "layer") -> list[Layout]:
    """PyTorch FSDP1 (``use_orig_params=False``, FULL_SHARD) trainer layouts, one per GPU.

    Each wrapped unit flattens its tensors (in checkpoint order) into one ``FlatParameter``,
    pads it to a multiple of the world size and gives every rank one equal 1-D shard; padding
    elements hold ``-1``. A shard may span several tensors: one block per tensor piece.

    - ``unit="layer"`` (transformer auto-wrap policy): every decoder layer is a unit,
      ``_fsdp_wrapped_module.model.layers.{i}._fsdp_wrapped_module._flat_param``; the root unit
      ``_fsdp_wrapped_module._flat_param`` holds the rest (embeddings, final norm, lm_head).
    - ``unit="model"``: no auto-wrap, the root unit holds the whole model.
    - Checkpoint tensors in another dtype than the weights (DeepSeek-V3's float32
      ``e_score_correction_bias``) are module buffers, not parameters, in the trainers that keep
      them so: never flattened, every rank holds them whole under their checkpoint names.

    Args:
        cfg: model config (:func:`wb.layouts.presets.load_config`).
        nodes: trainer node names; the world is ``len(nodes) * gpus_per_node`` GPUs.
        gpus_per_node: GPUs per node.
        first_rank: global rank of the first GPU; ranks are consecutive.
        unit: ``"layer"`` or ``"model"``.

    Returns:
        One trainer :class:`~wb.data.layout.Layout` per GPU, in rank order.

    Raises:
        SpecError: ``unit`` is unknown, or the node arguments are malformed.

    Examples:
        >>> from wb.layouts.presets import TINY
        >>> lays = fsdp_trainer(TINY, nodes=["trainer0"], gpus_per_node=3)
        >>> lays[0].buffers["_fsdp_wrapped_module._flat_param"].shape  # (100*32*2 + 32) / 3
        (2144,)
    """
    fn = "fsdp_trainer"
    d = ModelDims.of(cfg)
    spec = spec_from_config(cfg)
    world = check_world(fn, nodes, gpus_per_node)
    if unit not in ("layer", "model"):
        raise SpecError(f"{fn}: `unit` must be 'layer' (one flat parameter per decoder layer) or "
                        f"'model' (one for the whole model), got {unit!r}")
    sizes = np.diff(spec.offsets)
    flat = [k for k, n in enumerate(spec.names) if spec.dtype(n) == d.dtype]
    kept = [n for n in spec.names if spec.dtype(n) != d.dtype]  # buffers, replicated
    if unit == "model":
        units = {_FSDP_ROOT: np.asarray(flat, dtype=np.int64)}
    else:
        root, layer_of = [], {}
        for k in flat:
            n = spec.names[k]
            if n.startswith("model.layers."):
                layer_of.setdefault(int(n.split(".", 3)[2]), []).append(k)
            else:
                root.append(k)
        units = {_FSDP_ROOT: np.asarray(root, dtype=np.int64)}
        units.update({_FSDP_LAYER.format(i=i): np.asarray(layer_of[i], dtype=np.int64)
                      for i in range(d.layers)})
    per_rank: list[dict[str, BufferSpec]] = [{} for _ in range(world)]
    for name, tensors in units.items():
        toff = spec.offsets[tensors]  # (n,) first id of each tensor of the unit
        tlen = sizes[tensors]
        end = np.cumsum(tlen)  # (n,) flat end of each tensor in the unit
        start = end - tlen
        shard = -(-int(end[-1]) // world) if end.size else 0
        for r in range(world):
            a, b = r * shard, (r + 1) * shard
            k0, k1 = np.searchsorted(end, a, side="right"), np.searchsorted(start, b, side="left")
            lo, hi = np.maximum(start[k0:k1], a), np.minimum(end[k0:k1], b)
            keep = hi > lo  # empty tensors take no block
            lo, hi = lo[keep], hi[keep]
            first_id = toff[k0:k1][keep] + lo - start[k0:k1][keep]
            blk = broadcast_blocks(0, 1, lo - a, hi - lo, first_id, 0, 1)
            per_rank[r][name] = buffer_spec((shard,), blk, d.dtype)
    for r in range(world):
        for n in kept:
            per_rank[r][n] = buffer_spec(spec.shape(n), slice_block(spec, n), spec.dtype(n))
    return worker_layouts(per_rank, Role.TRAINER, first_rank,
                          lambda g: (nodes[g // gpus_per_node], g % gpus_per_node))
