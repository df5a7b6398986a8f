"""CheckpointSpec: checkpoint tensor names, shapes and dtypes -> global element ids."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from wb.data.dtypes import canonical_dtype, dtype_info
from wb.errors import SpecError

__all__ = ["CheckpointSpec"]


class CheckpointSpec:
    """The checkpoint's tensors in a fixed order, each element with a global int64 id.

    Element ``k`` (flat, C order) of tensor ``name`` has id ``spec.offset(name) + k``. Tensors are
    ordered as given (insertion order). The spec holds names, shapes and dtypes only: never data.

    Args:
        tensors: ``{name: (shape, dtype)}``; shape a tuple of ints, dtype a name such as
            ``"bfloat16"`` (or anything :func:`wb.data.dtypes.canonical_dtype` accepts).

    Raises:
        SpecError: a shape has a negative dimension, or a dtype is unknown.

    Examples:
        >>> spec = CheckpointSpec({"a": ((2, 3), "bfloat16"), "b": ((4,), "float32")})
        >>> spec.offset("b"), spec.numel, spec.nbytes
        (6, 10, 28)
        >>> spec.tensor_of(np.array([0, 5, 6, 9]))
        array([0, 0, 1, 1])
    """

    __slots__ = ("_names", "_index", "_shapes", "_dtypes", "_offsets", "_itemsizes")

    def __init__(self, tensors: Mapping[str, tuple[Sequence[int], object]]):
        if not isinstance(tensors, Mapping):
            raise SpecError(f"CheckpointSpec takes {{name: (shape, dtype)}}, got "
                            f"{type(tensors).__name__}")
        names, shapes, dtypes, sizes = [], [], [], []
        for name, entry in tensors.items():
            try:
                shape, dtype = entry
                shape = tuple(int(d) for d in shape)
            except (TypeError, ValueError) as e:
                raise SpecError(
                    f"spec entry `{name}` must be (shape, dtype), got {entry!r}") from e
            if any(d < 0 for d in shape):
                raise SpecError(f"spec entry `{name}` has a negative dimension: {shape}")
            names.append(str(name))
            shapes.append(shape)
            dtypes.append(canonical_dtype(dtype))
            sizes.append(math.prod(shape))
        self._names = tuple(names)
        self._index = {n: i for i, n in enumerate(names)}
        self._shapes = tuple(shapes)
        self._dtypes = tuple(dtypes)
        self._offsets = np.zeros(len(names) + 1, dtype=np.int64)  # (T+1,) int64
        np.cumsum(np.asarray(sizes, dtype=np.int64), out=self._offsets[1:])
        self._itemsizes = np.array([dtype_info(d).itemsize for d in dtypes], dtype=np.int64)

    # --- lookups -------------------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    @property
    def dtypes(self) -> tuple[str, ...]:
        return self._dtypes

    @property
    def offsets(self) -> np.ndarray:
        """``(T+1,) int64``: first id of each tensor, then ``numel``."""
        return self._offsets

    def offset(self, name: str) -> int:
        """Global id of element 0 of tensor ``name``."""
        return int(self._offsets[self._position(name)])

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[self._position(name)]

    def dtype(self, name: str) -> str:
        return self._dtypes[self._position(name)]

    def size(self, name: str) -> int:
        """Number of elements of tensor ``name``."""
        i = self._position(name)
        return int(self._offsets[i + 1] - self._offsets[i])

    @property
    def numel(self) -> int:
        """Total number of elements (ids are ``0 .. numel-1``)."""
        return int(self._offsets[-1])

    @property
    def nbytes(self) -> int:
        """Total bytes of the checkpoint in its own dtypes."""
        return int(np.dot(np.diff(self._offsets), self._itemsizes))

    def tensor_of(self, ids: np.ndarray) -> np.ndarray:
        """Index (in :attr:`names`) of the tensor each id belongs to; ids must be in range."""
        return np.searchsorted(self._offsets, ids, side="right") - 1

    def locate(self, id_: int) -> tuple[str, tuple[int, ...]]:
        """``(tensor name, multi-index)`` of one global id.

        Examples:
            >>> CheckpointSpec({"a": ((2, 3), "float32"), "b": ((4,), "float32")}).locate(4)
            ('a', (1, 1))
        """
        if not 0 <= id_ < self.numel:
            raise SpecError(f"id {id_} is outside the checkpoint (ids 0..{self.numel - 1})")
        t = int(self.tensor_of(np.int64(id_)))
        k = int(id_ - self._offsets[t])
        idx = np.unravel_index(k, self._shapes[t]) if self._shapes[t] else ()
        return self._names[t], tuple(int(i) for i in idx)

    def ids(self, name: str) -> np.ndarray:
        """The ids of tensor ``name`` as an int64 array of its shape (O(elements): tests, probing)."""
        i = self._position(name)
        return np.arange(self._offsets[i], self._offsets[i + 1], dtype=np.int64).reshape(
            self._shapes[i])

    def block_ids(self, name: str, offset: Sequence[int], shape: Sequence[int]) -> np.ndarray:
        """The ids of the block of tensor ``name`` that starts at ``offset`` and has ``shape``, as
        an int64 array of that shape (O(block elements): what a shard of the tensor holds).

        Raises:
            SpecError: ``name`` is not in the spec, or the block does not fit the tensor.

        Examples:
            >>> CheckpointSpec({"a": ((3, 4), "float32")}).block_ids("a", (1, 2), (2, 2)).tolist()
            [[6, 7], [10, 11]]
        """
        i = self._position(name)
        full, off, shape = self._shapes[i], tuple(int(o) for o in offset), tuple(map(int, shape))
        if len(off) != len(full) or len(shape) != len(full) or any(
                o < 0 or o + n > f for o, n, f in zip(off, shape, full)):
            raise SpecError(f"tensor `{name}`: a block at offset {off} of shape {shape} does not "
                            f"fit the checkpoint's {full}")
        ids = np.full(shape, self._offsets[i], dtype=np.int64)
        stride = 1
        for d in range(len(full) - 1, -1, -1):  # C order: the last axis varies fastest
            ax = np.arange(off[d], off[d] + shape[d], dtype=np.int64) * stride
            ids += ax.reshape((-1,) + (1,) * (len(full) - 1 - d))
            stride *= full[d]
        return ids

    def _position(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            close = [n for n in self._names if name.split(".")[-1] in n][:3]
            hint = f"; similar names: {close}" if close else ""
            raise SpecError(f"`{name}` is not a tensor of this checkpoint spec{hint}") from None

    # --- value semantics -----------------------------------------------------------------------
    def items(self) -> Iterator[tuple[str, tuple[tuple[int, ...], str]]]:
        for n, s, d in zip(self._names, self._shapes, self._dtypes):
            yield n, (s, d)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CheckpointSpec):
            return NotImplemented
        return (self._names, self._shapes, self._dtypes) == (
            other._names, other._shapes, other._dtypes)

    def __hash__(self) -> int:
        return hash((self._names, self._shapes, self._dtypes))

    def __getstate__(self):
        return dict(self.items())

    def __setstate__(self, state):
        self.__init__(state)

    def to_json(self) -> dict:
        """A JSON-able dict ``{name: [shape, dtype]}`` that :meth:`from_json` reads back."""
        return {n: [list(s), d] for n, (s, d) in self.items()}

    @classmethod
    def from_json(cls, data: Mapping[str, Sequence]) -> CheckpointSpec:
        return cls({n: (tuple(v[0]), v[1]) for n, v in data.items()})

    def __repr__(self) -> str:
        return (f"CheckpointSpec({len(self)} tensors, {self.numel:,} elements, "
                f"{self.nbytes / 2**20:,.1f} MiB)")
