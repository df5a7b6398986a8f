"""Hypothesis strategies for checkpoint specs, slice-copy source maps and layouts.

Importable by users to property-check their own code against WeightBridge's invariants::

    from hypothesis import given
    from wb.testing import strategies as wbst

    @given(wbst.layouts())
    def test_mine(case):
        trainers, rollouts = case.trainers, case.rollouts
        ...

Every map drawn here is built from real index arrays (``spec.ids``) by the operations load
functions perform: slicing on any dimension (also strided), transposes, reshapes, concatenation of
pieces (fused tensors), stacking (stacked experts), padding with ``-1``, and flat FSDP-style spans
across tensors. Sizes stay tiny so brute-force oracles can check every element.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from hypothesis import strategies as st

from wb.data.layout import BufferSpec, Cluster, Layout, Worker
from wb.data.sourcemap import SourceMap
from wb.data.spec import CheckpointSpec

__all__ = ["specs", "slice_copy", "slice_copy_maps", "holder_sets", "layouts", "LayoutCase",
           "clusters"]

_DTYPES = ("bfloat16", "float32", "float16")


@st.composite
def specs(draw, *, max_tensors: int = 4, max_dim: int = 9, dtypes=("bfloat16",)) -> CheckpointSpec:
    """Small checkpoint specs of 1-``max_tensors`` tensors with 1-3 dimensions."""
    n = draw(st.integers(1, max_tensors))
    tensors = {}
    for i in range(n):
        ndim = draw(st.integers(1, 3))
        shape = tuple(draw(st.lists(st.integers(1, max_dim), min_size=ndim, max_size=ndim)))
        tensors[f"t{i}.weight"] = (shape, draw(st.sampled_from(dtypes)))
    return CheckpointSpec(tensors)


@st.composite
def slice_copy(draw, spec: CheckpointSpec, *, max_pieces: int = 3) -> np.ndarray:
    """An int64 index array a load function could produce: slice copies of ``spec`` tensors."""
    pieces = []
    for _ in range(draw(st.integers(1, max_pieces))):
        pieces.append(draw(_piece(spec)).reshape(-1) if len(pieces) else draw(_piece(spec)))
    first = pieces[0]
    if len(pieces) == 1:
        return first
    # Fused tensors: concatenate whole rows when the widths agree, else flatten.
    width = first.shape[-1] if first.ndim >= 1 else 1
    rest = np.concatenate(pieces[1:])
    if first.ndim == 2 and rest.size % width == 0:
        return np.concatenate([first, rest.reshape(-1, width)])
    return np.concatenate([first.reshape(-1), rest])


@st.composite
def _piece(draw, spec: CheckpointSpec) -> np.ndarray:
    name = draw(st.sampled_from(spec.names))
    ids = spec.ids(name)
    ids2 = ids.reshape(-1, ids.shape[-1]) if ids.ndim > 1 else ids.reshape(1, -1)
    A, B = ids2.shape
    a0 = draw(st.integers(0, A - 1))
    a1 = draw(st.integers(a0 + 1, A))
    b0 = draw(st.integers(0, B - 1))
    b1 = draw(st.integers(b0 + 1, B))
    step_a = draw(st.sampled_from([1, 1, 1, 2]))
    step_b = draw(st.sampled_from([1, 1, 1, 2, 3]))
    x = ids2[a0:a1:step_a, b0:b1:step_b]
    op = draw(st.sampled_from(["none", "T", "flat", "reshape", "pad", "reverse", "stack", "span"]))
    if op == "T":
        x = x.T
    elif op == "flat":
        x = x.reshape(-1)
    elif op == "reshape":  # a JAX-style [in, heads, head_dim] view of a transposed kernel
        t = x.T
        k = draw(st.sampled_from([d for d in range(1, t.shape[1] + 1) if t.shape[1] % d == 0]))
        x = t.reshape(t.shape[0], k, t.shape[1] // k)
    elif op == "pad":
        x = np.concatenate([x, np.full((draw(st.integers(1, 3)), x.shape[1]), -1, np.int64)])
    elif op == "reverse":
        x = x[::-1]
    elif op == "stack":
        x = np.stack([x, ids2[a0:a1:step_a, b0:b1:step_b]])
    elif op == "span":  # a flat FSDP shard: a contiguous run of ids across tensors
        lo = draw(st.integers(0, spec.numel - 1))
        x = np.arange(lo, draw(st.integers(lo + 1, min(spec.numel, lo + 64))), dtype=np.int64)
    return np.ascontiguousarray(x, dtype=np.int64)


@st.composite
def slice_copy_maps(draw, spec: CheckpointSpec | None = None) -> tuple[CheckpointSpec, np.ndarray]:
    """``(spec, ids)`` with ``ids`` a slice-copy index array of ``spec``."""
    spec = spec or draw(specs())
    return spec, draw(slice_copy(spec))


@st.composite
def holder_sets(draw, spec: CheckpointSpec) -> list[np.ndarray]:
    """Index arrays of trainer buffers that together hold every id: 1-2 replicas, each cut into
    flat shards (FSDP) or row/column shards of each tensor (TP)."""
    out: list[np.ndarray] = []
    for _ in range(draw(st.integers(1, 2))):
        if draw(st.booleans()):
            n_cuts = draw(st.integers(0, min(3, spec.numel - 1)))
            cuts = sorted(draw(st.lists(st.integers(1, spec.numel - 1), min_size=n_cuts,
                                        max_size=n_cuts, unique=True))) if n_cuts else []
            out += [p for p in np.split(np.arange(spec.numel, dtype=np.int64), cuts)]
        else:
            for name in spec.names:
                ids = spec.ids(name)
                ids2 = ids.reshape(-1, ids.shape[-1]) if ids.ndim > 1 else ids.reshape(1, -1)
                axis = draw(st.integers(0, 1))
                k = draw(st.integers(1, max(1, min(3, ids2.shape[axis]))))
                for part in np.array_split(ids2, k, axis=axis):
                    if part.size:
                        out.append(np.ascontiguousarray(part.T if draw(st.booleans()) else part))
    return out


class LayoutCase(NamedTuple):
    spec: CheckpointSpec
    trainers: list[Layout]
    rollouts: list[Layout]


@st.composite
def layouts(draw, *, max_rollouts: int = 4, max_nodes: int = 3, dtype: str = "bfloat16",
            colocated: bool | None = None, rollout_dtypes: tuple[str, ...] = ()) -> LayoutCase:
    """A spec, trainers that hold all of it, and rollout workers on nodes needing slice copies.

    With ``colocated`` (drawn when ``None``), rollout workers share nodes, and sometimes GPUs
    (same node and ``local_rank``), with trainers. Trainers hold ``dtype``; rollout buffers are
    ``dtype`` too, or each of a dtype drawn from ``rollout_dtypes`` (a plan that converts).
    """
    spec = draw(specs(dtypes=(dtype,)))
    holders = draw(holder_sets(spec))
    n_tnodes = draw(st.integers(1, 2))
    trainers = [Layout(Worker(rank=i, node=f"n{i % n_tnodes}", role="trainer",
                              local_rank=i // n_tnodes),
                       {"buf": BufferSpec(SourceMap.from_indices(h), dtype)})
                for i, h in enumerate(holders)]
    coloc = draw(st.booleans()) if colocated is None else colocated
    n_nodes = draw(st.integers(1, max_nodes))
    rollouts = []
    for k in range(draw(st.integers(1, max_rollouts))):
        bufs = {f"b{j}": BufferSpec(SourceMap.from_indices(draw(slice_copy(spec))),
                                    draw(st.sampled_from(rollout_dtypes)) if rollout_dtypes
                                    else dtype)
                for j in range(draw(st.integers(1, 3)))}
        # colocated: rollout nodes are the trainer nodes n0, n1, ..., GPUs overlap theirs
        node = f"n{k % n_nodes}" if coloc else f"r{k % n_nodes}"
        rollouts.append(Layout(Worker(rank=len(trainers) + k, node=node, role="rollout",
                                      local_rank=k // n_nodes), bufs))
    return LayoutCase(spec, trainers, rollouts)


@st.composite
def clusters(draw) -> Cluster:
    """Bandwidth models: NIC 100-800 Gb/s per GPU, NVLink 100-900 GB/s, some slower nodes."""
    slow = draw(st.dictionaries(st.sampled_from(["n0", "n1", "r0", "r1"]),
                                st.floats(25, 400), max_size=2))
    return Cluster(nic_gbps=draw(st.floats(100, 800)), nvlink_GBps=draw(st.floats(100, 900)),
                   nodes=slow)
