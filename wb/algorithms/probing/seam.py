"""The seam between the probe's pass loop and where its per-element work runs.

:class:`ProbeArrays` is what a device implementation fills in (``wb_torch.probing.DeviceArrays``,
``wb_jax.probing.DeviceArrays``; :class:`~wb.algorithms.probing.HostArrays` is numpy's): it feeds
checkpoint tensors with the values of :mod:`wb.algorithms.probing.idcode`, checks the buffers the
load function returns, and decodes them into runs of ids. :class:`Bad` is how it reports the first
element that breaks a rule; :func:`chunks` and the two constants bound its memory.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple, Protocol

from wb.data.sourcemap import Runs
from wb.data.spec import CheckpointSpec

__all__ = ["ProbeArrays", "Bad", "chunks", "DECODE_CHUNK", "TRANSIENT_BYTES_PER_ELEMENT"]

#: Bound on the transient bytes per element of the one buffer being read or encoded (int64 ids,
#: their byte image, the check digits and two masks); a test measures it with tracemalloc.
TRANSIENT_BYTES_PER_ELEMENT = 40
#: Elements of a buffer decoded at once (whole rows): bounds the transient memory of decoding.
DECODE_CHUNK = 1 << 22


class Bad(NamedTuple):
    """The first element of a buffer that breaks a rule: its flat index and what it did."""

    index: int
    what: str  # e.g. "reads 1.5, not an integer digit 0..256"


class ProbeArrays(Protocol):
    """Where a probe's per-element work runs: :class:`~wb.algorithms.probing.HostArrays` (numpy)
    by default; a shim passes its own to feed, check and decode on the device its tensors live on.
    Buffers and masks are the implementation's own arrays; only ids come back as numpy."""

    def feed(self, spec: CheckpointSpec, name: str, base: int, pass_index: int | None) -> Any:
        """Checkpoint tensor ``name`` of one pass (``None``: the check pass), spec shape and
        dtype, each element ``digit + 1`` (:mod:`wb.algorithms.probing.idcode`)."""

    def buffer(self, name: str, arr: Any) -> Any:
        """A buffer the load returned, as :meth:`read` takes it (``.shape``, ``.dtype``);
        raises ProbeError if it cannot be read."""

    def dtype_name(self, a: Any) -> str | None:
        """The canonical dtype name of a buffer, ``None`` when wb does not know it."""

    def begin(self, spec: CheckpointSpec, base: int, passes: int) -> None:
        """Optional: told the spec and base before pass 1 feeds anything (``passes`` id passes
        follow, then the check pass), e.g. to start compiling per-shape kernels in the
        background while the load function runs."""

    def prepare(self, buffers: Mapping[str, Any], base: int, passes: int) -> None:
        """Optional: told every buffer of pass 1 before any is read (``passes`` id passes
        follow, then the check pass), e.g. to compile per-shape kernels ahead, in parallel."""

    def read(self, a: Any, base: int) -> tuple[Any, Any, Any]:
        """``(written, digits, ok)``: flat mask of written elements, their digits (any integer
        type), and whether every element is an integer ``0 .. base``: anything :meth:`all_true`
        takes (a device scalar, so a pass needs no synchronisation per buffer)."""

    def first_bad(self, a: Any, base: int) -> Bad:
        """The first element of ``a`` that is not an integer ``0 .. base`` (after ``read``'s
        ``ok`` was false)."""

    def same(self, a: Any, b: Any) -> Any:
        """Whether two masks are equal, as :meth:`all_true` takes it."""

    def first_difference(self, a: Any, b: Any) -> int:
        """The first flat index where two masks differ (after :meth:`same` was false)."""

    def all_true(self, oks: list) -> bool:
        """Whether every ``ok`` of :meth:`read` and :meth:`same` is true: one wait per pass."""

    def runs(self, written: Any, digits: list, base: int, numel: int, cols: int
             ) -> tuple[Runs | None, Bad | None, bool]:
        """``(runs, bad, in_check_pass)``: the maximal affine runs (:class:`wb.data.sourcemap.Runs`,
        numpy, O(runs)) of the ids decoded from the per-pass digits (the last one the check
        pass's; unwritten elements are ``-1``) of a buffer viewed as rows of ``cols``; or the
        first element whose id is ``>= numel`` (``in_check_pass`` False) or disagrees with its
        check digit (True). Ids are decoded a chunk of rows at a time (see
        :data:`DECODE_CHUNK`); only the runs leave the device."""


def chunks(n: int, cols: int, chunk: int | None = None) -> Iterator[tuple[int, int]]:
    """``(lo, hi)`` flat ranges of whole rows of ``cols`` covering ``n`` elements, each about
    ``chunk`` (default :data:`DECODE_CHUNK`) elements or one row.

    Examples:
        >>> list(chunks(10, 3, 6))
        [(0, 6), (6, 10)]
    """
    step = max(1, (chunk or DECODE_CHUNK) // max(cols, 1)) * cols
    for lo in range(0, n, step):
        yield lo, min(n, lo + step)
