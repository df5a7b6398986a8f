"""What every layout generator shares besides blocks: per-shard buffer entries, the TP-split MLP,
argument checks, and the assembly of one :class:`~wb.data.layout.Layout` per GPU.

A generator describes the buffers of a layer as :data:`Entry` values: a buffer name with either
one BufferSpec (replicated: every shard shares the object) or a function of the shard index.
:func:`shard_buffers` expands them; identical shards stay the same objects, so data-parallel
copies and rollout replicas cost nothing extra.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from wb.data.layout import BufferSpec, Layout, Role, Worker
from wb.data.spec import CheckpointSpec
from wb.errors import SpecError
from wb.layouts.blocks import buffer_spec, slice_block

__all__ = ["Entry", "shard_buffers", "tp_mlp", "worker_layouts", "check_divides", "check_world",
           "check_positive"]

#: One buffer of a layer: the same BufferSpec on every shard (replicated), or built per shard index.
Entry = tuple[str, "BufferSpec | Callable[[int], BufferSpec]"]


def shard_buffers(entries: Sequence[Entry], n: int) -> list[dict[str, BufferSpec]]:
    """The ``n`` shards' buffers, sharing the replicated BufferSpec objects.

    Args:
        entries: the buffers, in module order.
        n: the number of shards (e.g. the TP size).

    Returns:
        ``n`` dicts ``{buffer name: BufferSpec}``, in ``entries`` order.
    """
    out: list[dict[str, BufferSpec]] = [{} for _ in range(n)]
    for name, v in entries:
        for k in range(n):
            out[k][name] = v if isinstance(v, BufferSpec) else v(k)
    return out


def tp_mlp(spec: CheckpointSpec, hf: str, names: tuple[str, str], w: int, h: int, dt: str
           ) -> list[Entry]:
    """A TP-split dense MLP, as Megatron (``linear_fc1/2``) and vLLM (``gate_up_proj``/
    ``down_proj``) both lay it out: fc1 = [gate rows; up rows] of the shard, fc2 = down columns.

    Args:
        spec: the checkpoint.
        hf: HF prefix of the MLP (``model.layers.{i}.mlp.`` or its ``shared_experts.``).
        names: the framework's ``(fc1, fc2)`` buffer names.
        w: rows of gate (and of up) per TP shard.
        h: hidden size.
        dt: dtype of the buffers.

    Returns:
        The two entries, indexed by TP rank.
    """
    def fc1(t: int) -> BufferSpec:
        return buffer_spec((2 * w, h), [
            slice_block(spec, hf + "gate_proj.weight", rows=(t * w, (t + 1) * w)),
            slice_block(spec, hf + "up_proj.weight", rows=(t * w, (t + 1) * w), at=(w, 0))], dt)

    return [(names[0], fc1), (names[1], lambda t: buffer_spec(
        (h, w), slice_block(spec, hf + "down_proj.weight", cols=(t * w, (t + 1) * w)), dt))]


def worker_layouts(per_rank: Sequence[Mapping[str, BufferSpec]], role: Role, first_rank: int,
                   node_of: Callable[[int], tuple[str, int]]) -> list[Layout]:
    """One Layout per GPU, ranks ``first_rank`` onward.

    Args:
        per_rank: the buffers of GPU ``g``, for ``g`` from 0.
        role: trainer or rollout.
        first_rank: global rank of GPU 0.
        node_of: ``g -> (node name, local rank)``.

    Returns:
        The layouts, in rank order.
    """
    out = []
    for g, bufs in enumerate(per_rank):
        node, local = node_of(g)
        worker = Worker(rank=first_rank + g, node=node, role=role, local_rank=local)
        out.append(Layout(worker, bufs))
    return out


def check_divides(what: str, n: int, by: int, arg: str, fix: str) -> None:
    """Raises a SpecError unless ``by`` (the value of argument ``arg``) divides ``n`` (``what``).

    Raises:
        SpecError: ``by <= 0`` or ``n % by``; the message names ``arg``, both values and ``fix``.
    """
    if by <= 0 or n % by:
        raise SpecError(f"`{arg}`={by} must divide {what} ({n}); {fix}")


def check_world(fn: str, nodes: Sequence[str], gpus_per_node: int) -> int:
    """The number of GPUs of ``nodes``, after checking the node arguments of generator ``fn``.

    Raises:
        SpecError: ``nodes`` is a string, empty or repeats a name, or ``gpus_per_node < 1``.
    """
    if isinstance(nodes, str) or not nodes:
        raise SpecError(f"{fn}: `nodes` must be a non-empty list of node names, got {nodes!r}")
    if len(set(nodes)) != len(nodes):
        raise SpecError(f"{fn}: `nodes` has repeated names: {list(nodes)!r}")
    if gpus_per_node < 1:
        raise SpecError(f"{fn}: `gpus_per_node` must be >= 1, got {gpus_per_node}")
    return len(nodes) * gpus_per_node


def check_positive(fn: str, **sizes: int) -> None:
    """Raises a SpecError unless every keyword value is an integer >= 1 (generator ``fn``'s sizes).

    Raises:
        SpecError: naming the first size that is not.
    """
    for k, v in sizes.items():
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise SpecError(f"{fn}: `{k}` must be an integer >= 1, got {v!r}")
