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
from wb.data.sealed import DECODE_ERRORS, seal, unseal_stream
from wb.data.sourcemap import MAX_ID, Blocks, SourceMap
from wb.errors import SpecError, WbError

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
        for what in ("rank", "local_rank"):
            v = getattr(self, what)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise SpecError(f"Worker.{what} must be an int, got {v!r}")
            object.__setattr__(self, what, int(v))
        if not isinstance(self.node, str):
            raise SpecError(f"Worker.node must be a str (the machine's name), got {self.node!r}")
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
        if not isinstance(self.worker, Worker):
            raise SpecError(f"Layout.worker must be a wb.Worker, got {type(self.worker).__name__}")
        if not isinstance(self.buffers, Mapping):
            raise SpecError(f"Layout.buffers must map buffer names to BufferSpecs, got "
                            f"{type(self.buffers).__name__}")
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


#: Format of :func:`layouts_to_arrays` (and of saved plans' layouts): bumped when it changes.
LAYOUTS_FORMAT = 2


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int64, copy=False) if parts else np.zeros(0, np.int64)


def _starts(counts: np.ndarray) -> np.ndarray:
    """``(n+1,) int64`` offsets of consecutive runs of the given lengths."""
    out = np.zeros(counts.size + 1, np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def layouts_to_arrays(layouts) -> tuple[dict, dict[str, np.ndarray]]:
    """Layouts as (a small JSON-able header, ``{key: array}``); shared specs and maps once.

    Everything per buffer is a column of an array (its name's index, its spec's index; per spec
    its map's and dtype's index; per map its shape, diff2 entries and blocks concatenated with
    counts), so writing and reading take time in proportion to the arrays, not to Python objects
    per buffer. Equal specs (or maps) of several buffers (replicas of one shard), whether one
    shared object or equal ones, are stored once and shared by :func:`layouts_from_arrays`. The
    header holds only the distinct strings (node names, buffer names, dtypes). No pickle either
    way (plans and layouts travel between processes through rendezvous stores as these bytes).
    """
    layouts = list(layouts)
    nodes: dict[str, int] = {}
    names: dict[str, int] = {}
    dtypes: dict[str, int] = {}
    specs: dict[int, int] = {}  # id(BufferSpec) -> index
    maps: dict[int, int] = {}  # id(SourceMap) -> index
    by_value: dict[tuple, int] = {}  # (shape, diff2 bytes) -> index
    spec_of: dict[tuple[int, str], int] = {}  # (map index, dtype) -> spec index
    spec_objs: list[BufferSpec] = []
    map_objs: list[SourceMap] = []
    buf_name: list[int] = []
    buf_spec: list[int] = []
    spec_map: list[int] = []
    spec_dtype: list[int] = []
    for lay in layouts:
        for name, b in lay.buffers.items():
            buf_name.append(names.setdefault(name, len(names)))
            k = specs.get(id(b))
            if k is None:
                m = maps.get(id(b.sourcemap))
                if m is None:
                    # equal maps that are distinct objects (layouts read back one by one, as a
                    # planner gathers them) are stored once too: keyed by their entries
                    sm = b.sourcemap
                    pos, val = sm.diff2()
                    m = by_value.setdefault((sm.shape, pos.tobytes(), val.tobytes()),
                                            len(map_objs))
                    if m == len(map_objs):
                        map_objs.append(sm)
                    maps[id(sm)] = m
                key = (m, b.dtype)
                k = spec_of.get(key)
                if k is None:
                    k = spec_of[key] = len(spec_objs)
                    spec_objs.append(b)
                    spec_map.append(m)
                    spec_dtype.append(dtypes.setdefault(b.dtype, len(dtypes)))
                specs[id(b)] = k
            buf_spec.append(k)
    diff2 = [sm.diff2() for sm in map_objs]
    blocks = [sm.blocks for sm in map_objs]
    arrays = {
        "lay.rank": np.array([lay.worker.rank for lay in layouts], np.int64),
        "lay.local_rank": np.array([lay.worker.local_rank for lay in layouts], np.int64),
        "lay.role": np.array([lay.worker.role == Role.ROLLOUT for lay in layouts], np.int8),
        "lay.node": np.array([nodes.setdefault(lay.worker.node, len(nodes)) for lay in layouts],
                             np.int64),
        "lay.nbuf": np.array([len(lay.buffers) for lay in layouts], np.int64),
        "buf.name": np.array(buf_name, np.int64),
        "buf.spec": np.array(buf_spec, np.int64),
        "spec.map": np.array(spec_map, np.int64),
        "spec.dtype": np.array(spec_dtype, np.int64),
        "map.ndim": np.array([len(sm.shape) for sm in map_objs], np.int64),
        "map.shape": np.array([d for sm in map_objs for d in sm.shape], np.int64),
        "map.nnz": np.array([p.size for p, _ in diff2], np.int64),
        "map.pos": _cat([p for p, _ in diff2]),
        "map.val": _cat([v for _, v in diff2]),
        "map.nblocks": np.array([b.count for b in blocks], np.int64),
    }
    for f in Blocks._fields:
        arrays[f"map.block_{f}"] = _cat([getattr(b, f) for b in blocks])
    header = {"format": LAYOUTS_FORMAT, "nodes": list(nodes), "names": list(names),
              "dtypes": list(dtypes)}
    return header, arrays


def layouts_from_arrays(header: Mapping, arrays: Mapping[str, np.ndarray]) -> list[Layout]:
    """The layouts :func:`layouts_to_arrays` described (buffers that shared a spec share one).

    Raises:
        SpecError: the arrays are of another format (written by an older ``wb``: make the layouts
            or the plan again).
    """
    if not isinstance(header, Mapping) or header.get("format") != LAYOUTS_FORMAT:
        got = header.get("format") if isinstance(header, Mapping) else "1 (a list)"
        raise SpecError(f"layouts of format {got} cannot be read by this wb (format "
                        f"{LAYOUTS_FORMAT}); they were written by an older version: probe the "
                        f"layouts or make the plan again (plans are cheap to re-make)")
    a = {k: np.asarray(v) for k, v in arrays.items()}
    shp = _starts(a["map.ndim"])
    nz = _starts(a["map.nnz"])
    nbk = _starts(a["map.nblocks"])
    pos, val = a["map.pos"], a["map.val"]
    bf = [a[f"map.block_{f}"] for f in Blocks._fields]
    shape_list = a["map.shape"].tolist()
    maps = []
    for m in range(a["map.ndim"].size):
        z0, z1, b0, b1 = int(nz[m]), int(nz[m + 1]), int(nbk[m]), int(nbk[m + 1])
        maps.append(SourceMap(tuple(shape_list[shp[m]:shp[m + 1]]), pos[z0:z1], val[z0:z1],
                              Blocks(*(f[b0:b1] for f in bf))))
    dtypes = header["dtypes"]
    specs = [BufferSpec(maps[m], dtypes[d])
             for m, d in zip(a["spec.map"].tolist(), a["spec.dtype"].tolist())]
    names, nodes = header["names"], header["nodes"]
    buf_name, buf_spec = a["buf.name"].tolist(), a["buf.spec"].tolist()
    out, k = [], 0
    for rank, local, role, node, nbuf in zip(a["lay.rank"].tolist(), a["lay.local_rank"].tolist(),
                                            a["lay.role"].tolist(), a["lay.node"].tolist(),
                                            a["lay.nbuf"].tolist()):
        bufs = {names[buf_name[j]]: specs[buf_spec[j]] for j in range(k, k + nbuf)}
        k += nbuf
        out.append(Layout(Worker(rank, nodes[node], Role.ROLLOUT if role else Role.TRAINER,
                                 local), bufs))
    return out


def layouts_to_bytes(layouts) -> bytes:
    """Layouts as sealed ``.npz`` bytes (numpy arrays and a JSON header, no pickle, with a digest
    of the whole: :mod:`wb.data.sealed`).

    Examples:
        >>> sm = SourceMap.from_indices(np.arange(6).reshape(2, 3))
        >>> lay = Layout(Worker(0, "n0", "trainer"), {"w": BufferSpec(sm, "float32")})
        >>> layouts_from_bytes(layouts_to_bytes([lay]))[0].buffers["w"] == lay.buffers["w"]
        True
    """
    header, arrays = layouts_to_arrays(layouts)
    f = io.BytesIO()
    np.savez(f, header=np.frombuffer(json.dumps(header).encode(), np.uint8), **arrays)
    return seal("layout list", f.getvalue())


def layouts_from_bytes(data: bytes, *, where: str = "layouts' bytes") -> list[Layout]:
    """The layouts :func:`layouts_to_bytes` wrote (``allow_pickle=False``), once their digest
    matches.

    Args:
        data: the bytes.
        where: where they came from, for errors (e.g. the store key).

    Raises:
        SpecError: the bytes changed since they were written (a flipped bit, cut short), or
            are of an older format (see :func:`layouts_from_arrays`); names ``where``.
    """
    again = "publish the layouts again (the store is corrupt?)"
    stream = unseal_stream("layout list", data, where=where, error=SpecError, remedy=again)
    try:
        with np.load(stream, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        return layouts_from_arrays(json.loads(bytes(arrays.pop("header")).decode()), arrays)
    except SpecError:
        raise
    except (*DECODE_ERRORS, WbError) as e:
        raise SpecError(f"{where} cannot be read as layouts ({type(e).__name__}: {e}); "
                        f"{again}") from e
