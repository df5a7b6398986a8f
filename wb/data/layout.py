"""Who holds or needs which ids, where: Worker, BufferSpec, Layout (pure data)."""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType

import numpy as np

from wb.data.dtypes import canonical_dtype, dtype_info
from wb.errors import SpecError
from wb.data.sourcemap import MAX_ID, SourceMap

__all__ = [
    "BufferSpec",
    "Cluster",
    "Layout",
    "Role",
    "Worker",
    "layouts_from_arrays",
    "layouts_from_bytes",
    "layouts_to_arrays",
    "layouts_to_bytes",
]


class Role(str, Enum):
    """A worker's side of the update: a trainer's buffers hold ids, a rollout's need them.

    A ``str`` (``Role.TRAINER == "trainer"``, JSON-dumps as ``"trainer"``) that prints and formats
    as its value, like Python 3.11's ``StrEnum``, written out so ``wb`` imports on Python 3.10.

    Examples:
        >>> Role("rollout"), f"{Role.TRAINER}", Role.TRAINER == "trainer"
        (<Role.ROLLOUT: 'rollout'>, 'trainer', True)
    """

    TRAINER = "trainer"  # buffers *hold* ids
    ROLLOUT = "rollout"  # buffers *need* ids

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@dataclass(frozen=True, slots=True)
class Worker:
    """One process with one GPU (or CPU device): global rank, node name, role, index on the node.

    Examples:
        >>> Worker(rank=0, node="n0", role="trainer", local_rank=0).role
        <Role.TRAINER: 'trainer'>
    """

    rank: int  # global rank, unique over trainers and rollouts of one plan
    node: str  # machine name: GPUs of one node share NVLink, nodes talk over NICs
    role: Role  # "trainer" (holds ids) or "rollout" (needs them); a str is converted
    local_rank: int = 0  # GPU index on the node

    def __post_init__(self):
        try:
            object.__setattr__(self, "role", Role(self.role))
        except ValueError:
            raise SpecError(f"Worker.role must be 'trainer' or 'rollout', got {self.role!r}") from None
        if self.rank < 0 or self.local_rank < 0:
            raise SpecError(f"Worker rank and local_rank must be >= 0, got {self.rank}, "
                            f"{self.local_rank}")


@dataclass(frozen=True, slots=True)
class BufferSpec:
    """A buffer's source map and element dtype."""

    sourcemap: SourceMap  # the checkpoint id of each element of the buffer (its shape)
    dtype: str  # element dtype, canonical name ("bfloat16"); numpy/torch/jax dtypes converted

    def __post_init__(self):
        if not isinstance(self.sourcemap, SourceMap):
            raise SpecError(f"BufferSpec.sourcemap must be a SourceMap, got "
                            f"{type(self.sourcemap).__name__}")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        lo, hi = self.sourcemap.blocks.id_range()
        if lo < 0 or hi > MAX_ID:
            raise SpecError(f"BufferSpec source map holds ids in [{lo:.0f}, {hi:.0f}]; ids must be "
                            f"-1 (not from the checkpoint) or in [0, {MAX_ID}]")

    @property
    def itemsize(self) -> int:
        return dtype_info(self.dtype).itemsize

    @property
    def shape(self) -> tuple[int, ...]:
        return self.sourcemap.shape


@dataclass(frozen=True, slots=True)
class Layout:
    """One worker's buffers by name: held ids for a trainer, needed ids for a rollout."""

    worker: Worker  # whose buffers
    buffers: Mapping[str, BufferSpec] = field(default_factory=dict)  # name -> spec, read-only

    def __post_init__(self):
        for name, b in self.buffers.items():
            if not isinstance(b, BufferSpec):
                raise SpecError(f"Layout buffer `{name}` of rank {self.worker.rank} must be a "
                                f"BufferSpec, got {type(b).__name__}")
        object.__setattr__(self, "buffers", MappingProxyType(dict(self.buffers)))

    def __reduce__(self):
        return (Layout, (self.worker, dict(self.buffers)))


@dataclass(frozen=True, slots=True)
class Cluster:
    """Bandwidths of the machines: a NIC per GPU and NVLink inside a node.

    Defaults are H100/H200-class: 400 Gb/s NIC per GPU (each direction) and ~450 GB/s NVLink per
    GPU (each direction). ``nodes`` overrides the NIC speed of named nodes (Gb/s).

    Examples:
        >>> Cluster().nic_bytes_per_s("n0") / 1e9, Cluster().nvlink_bytes_per_s("n0") / 1e9
        (50.0, 450.0)
    """

    nic_gbps: float = 400.0  # per GPU, each direction, gigabits per second
    nvlink_GBps: float = 450.0  # per GPU, each direction, gigabytes per second
    nodes: Mapping[str, float] = field(default_factory=dict)  # node -> NIC Gb/s per GPU

    def __post_init__(self):
        if self.nic_gbps <= 0 or self.nvlink_GBps <= 0:
            raise SpecError(f"Cluster bandwidths must be positive, got nic_gbps={self.nic_gbps}, "
                            f"nvlink_GBps={self.nvlink_GBps}")
        object.__setattr__(self, "nodes", MappingProxyType(dict(self.nodes)))

    def nic_bytes_per_s(self, node: str) -> float:
        return self.nodes.get(node, self.nic_gbps) * 1e9 / 8

    def nvlink_bytes_per_s(self, node: str) -> float:
        return self.nvlink_GBps * 1e9

    def __reduce__(self):
        return (Cluster, (self.nic_gbps, self.nvlink_GBps, dict(self.nodes)))


def layouts_to_arrays(layouts) -> tuple[list[dict], dict[str, np.ndarray]]:
    """Layouts as (JSON-able descriptions, ``{key: array}`` of their source maps; shared maps once).

    The inverse is :func:`layouts_from_arrays`; no pickle either way (plans and layouts travel
    between processes through rendezvous stores as these bytes).
    """
    maps: dict[int, SourceMap] = {}
    described = []
    for lay in layouts:
        bufs = {}
        for name, b in lay.buffers.items():
            maps.setdefault(id(b.sourcemap), b.sourcemap)
            bufs[name] = [list(maps).index(id(b.sourcemap)), b.dtype]
        w = lay.worker
        described.append({"rank": w.rank, "node": w.node, "role": w.role.value,
                          "local_rank": w.local_rank, "buffers": bufs})
    arrays = {f"map{i}.{k}": v for i, sm in enumerate(maps.values())
              for k, v in sm.to_arrays().items()}
    return described, arrays


def layouts_from_arrays(described: list[dict], arrays: Mapping[str, np.ndarray]) -> list[Layout]:
    """The layouts :func:`layouts_to_arrays` described."""
    n_maps = 1 + max((i for L in described for i, _ in L["buffers"].values()), default=-1)
    maps = [SourceMap.from_arrays({k.split(".", 1)[1]: v for k, v in arrays.items()
                                   if k.startswith(f"map{i}.")}) for i in range(n_maps)]
    return [Layout(Worker(L["rank"], L["node"], L["role"], L["local_rank"]),
                   {n: BufferSpec(maps[i], dt) for n, (i, dt) in L["buffers"].items()})
            for L in described]


def layouts_to_bytes(layouts) -> bytes:
    """Layouts as ``.npz`` bytes (numpy arrays and a JSON header; no pickle)."""
    described, arrays = layouts_to_arrays(layouts)
    f = io.BytesIO()
    np.savez(f, header=np.frombuffer(json.dumps(described).encode(), np.uint8), **arrays)
    return f.getvalue()


def layouts_from_bytes(data: bytes) -> list[Layout]:
    """The layouts :func:`layouts_to_bytes` wrote (``allow_pickle=False``)."""
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return layouts_from_arrays(json.loads(bytes(arrays.pop("header")).decode()), arrays)
