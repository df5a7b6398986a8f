"""Probing: run a framework's own load function on tensors whose values encode element ids.

Each pass feeds every checkpoint tensor with one base-``B`` digit of each element's id (as the value
``digit + 1``; ``0`` is reserved for "never written"), then reads every buffer the load function
produced. ``B`` is the largest integer count every dtype on the path holds exactly (bf16: 256,
fp16: 2048, fp32: 2**24, fp8 e4m3: 16), so ``passes = ceil(log_B(numel))`` plus one *check pass*
whose value is a hash digit of the id. A load function that is pure data movement reproduces the
digits; one that scales, adds or quantises produces non-integers, out-of-range values, elements
written in some passes but not others, or ids whose hash disagrees with the check pass: all raise
:class:`wb.ProbeError`, never a wrong map.

Memory: per pass, one checkpoint tensor at a time is materialised (if the load function reads them
one at a time); digits of each buffer are kept in the narrowest unsigned type (1 byte per element
per pass for bf16) and 64-bit ids exist for one buffer at a time, when its map is encoded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from wb.data.dtypes import dtype_info
from wb.errors import ProbeError
from wb.data.sourcemap import SourceMap
from wb.data.spec import CheckpointSpec

__all__ = ["probe", "digit_base", "ProbeCheckpoint"]

log = logging.getLogger(__name__)

_HASH_MUL = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: spreads nearby ids apart


def digit_base(dtypes) -> int:
    """The digit base every dtype in ``dtypes`` carries exactly (values ``1 .. base``).

    Examples:
        >>> digit_base(["bfloat16", "float32"]), digit_base(["float8_e4m3fn"])
        (256, 16)
    """
    return int(min(min(dtype_info(d).exact_int_max for d in dtypes), 2**24))


def _n_passes(numel: int, base: int) -> int:
    passes, reach = 1, base
    while reach < numel:
        passes, reach = passes + 1, reach * base
    return passes


def _check_digit(ids: np.ndarray, base: int) -> np.ndarray:
    h = (ids.astype(np.uint64) * _HASH_MUL) >> np.uint64(24)
    return (h % np.uint64(base)).astype(np.int64)


class ProbeCheckpoint(Mapping):
    """The checkpoint of one probing pass: ``{name: array of digit values}``, built on access.

    Arrays are numpy arrays in each tensor's spec dtype (``ml_dtypes`` for bf16/fp8). The name of
    the tensor accessed last is kept in :attr:`last`, so an error inside the load function can say
    which tensor it was being fed.
    """

    def __init__(self, spec: CheckpointSpec, base: int, pass_index: int | None):
        self.spec, self.base, self.pass_index = spec, base, pass_index  # None: the check pass
        self.last: str | None = None

    def __getitem__(self, name: str) -> np.ndarray:
        ids = self.spec.ids(name)
        self.last = name
        if self.pass_index is None:
            digit = _check_digit(ids, self.base)
        else:
            digit = (ids // self.base**self.pass_index) % self.base
        values = (digit + 1).astype(np.float64 if self.base > 2**24 else np.float32)
        return values.astype(dtype_info(self.spec.dtype(name)).numpy)

    def __iter__(self) -> Iterator[str]:
        return iter(self.spec.names)

    def __len__(self) -> int:
        return len(self.spec)


def _as_numpy(name: str, arr: Any) -> np.ndarray:
    try:
        return np.asarray(arr)
    except Exception as e:  # noqa: BLE001 - any conversion failure is the caller's type problem
        raise ProbeError(
            f"buffer `{name}` returned by the load function is a {type(arr).__name__} that numpy "
            f"cannot read ({e}); return numpy-convertible arrays (the wb_torch / wb_jax shims do)"
        ) from e


def _bad(name: str, shape, flat: int, what: str, pass_label: str) -> ProbeError:
    where = tuple(int(i) for i in np.unravel_index(flat, shape)) if shape else ()
    return ProbeError(
        f"buffer `{name}` element {where} {what} in {pass_label}: the load function is not pure data "
        f"movement (it scales, adds, casts lossily or quantises); probe a load path that only "
        f"copies, slices, concatenates, transposes or reshapes")


def probe(spec: CheckpointSpec, load: Callable[[Mapping[str, np.ndarray]], Mapping[str, Any]], *,
          base: int | None = None, progress: bool = False) -> dict[str, SourceMap]:
    """Discovers the source map of every buffer ``load`` produces from a checkpoint.

    Args:
        spec: the checkpoint's tensors.
        load: the framework's own load function: takes ``{name: array}`` (a lazy mapping that
            builds each checkpoint tensor when accessed) and returns ``{buffer name: array}``
            (anything ``np.asarray`` reads). Elements a pass does not write must read ``0``: start
            from zeros (JAX padding) or pre-fill in-place buffers with zeros (the PyTorch shim does).
        base: digit base; default: the largest that every checkpoint and buffer dtype holds exactly
            (found from the first pass; probing restarts once if a buffer is narrower).
        progress: show a progress bar (rich) over passes.

    Returns:
        ``{buffer name: SourceMap}``; elements never written map to ``-1``.

    Raises:
        ProbeError: ``load`` raised (the message names the checkpoint tensor it was being fed),
            returned something unusable, or is not pure data movement (names the buffer and the
            first bad element).

    Examples:
        >>> spec = CheckpointSpec({"w": ((4, 6), "bfloat16")})
        >>> maps = probe(spec, lambda ck: {"shard": np.asarray(ck["w"])[:, 3:].T})
        >>> maps["shard"].to_indices()[:, :2]
        array([[ 3,  9],
               [ 4, 10],
               [ 5, 11]])
    """
    if len(spec) == 0 or spec.numel == 0:
        raise ProbeError("the checkpoint spec is empty: nothing to probe")
    chosen = base or digit_base(set(spec.dtypes))
    for attempt in range(2):
        result = _probe_with_base(spec, load, chosen, progress, allow_narrowing=base is None
                                  and attempt == 0)
        if isinstance(result, dict):
            return result
        log.info("restarting probe with digit base %d: %s", result[0], result[1])
        chosen = result[0]
    raise AssertionError("unreachable: the second attempt never narrows")


def _call(load, ck: ProbeCheckpoint, label: str) -> Mapping[str, Any]:
    try:
        out = load(ck)
    except ProbeError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with what it was fed
        fed = (f"while being fed checkpoint tensor `{ck.last}` (shape {ck.spec.shape(ck.last)}, "
               f"{ck.spec.dtype(ck.last)})" if ck.last else "before reading any checkpoint tensor")
        raise ProbeError(f"the load function raised {type(e).__name__}: {e} {fed}, in {label}") from e
    if not isinstance(out, Mapping):
        raise ProbeError(f"the load function must return a mapping of buffer name -> array, "
                         f"got {type(out).__name__}")
    return out


def _probe_with_base(spec, load, base, progress, allow_narrowing):
    passes = _n_passes(spec.numel, base)
    digit_dtype = np.uint8 if base <= 256 else np.uint16 if base <= 2**16 else np.uint32
    labels = [f"pass {k + 1}/{passes + 1}" for k in range(passes + 1)]
    written: dict[str, np.ndarray] = {}
    digits: dict[str, list[np.ndarray]] = {}
    shapes: dict[str, tuple] = {}
    bar = _progress(progress, passes + 1)
    for k in range(passes + 1):
        ck = ProbeCheckpoint(spec, base, k if k < passes else None)
        out = _call(load, ck, labels[k])
        if k == 0:
            dts = {n: _as_numpy(n, a).dtype for n, a in out.items()}
            narrow = [(n, dtype_info(dt)) for n, dt in dts.items() if _dtype_known(dt)]
            limit = min((d.exact_int_max for _, d in narrow), default=base)
            if limit < base:
                name, d = min(narrow, key=lambda x: x[1].exact_int_max)
                if allow_narrowing:
                    return (limit, f"buffer `{name}` is {d.name}")
                raise ProbeError(f"buffer `{name}` is {d.name}, which holds digits only up to "
                                 f"{limit}, below the requested base {base}")
        elif set(out) != set(shapes):
            raise ProbeError(f"the load function returned different buffers in {labels[k]} than in "
                             f"pass 1: {sorted(set(out) ^ set(shapes))[:5]}")
        for name, arr in out.items():
            a = _as_numpy(name, arr)
            if k == 0:
                shapes[name] = a.shape
            elif a.shape != shapes[name]:
                raise ProbeError(f"buffer `{name}` changed shape from {shapes[name]} to {a.shape} "
                                 f"in {labels[k]}")
            v = a.astype(np.float64, copy=False).reshape(-1)
            bad = ~np.isfinite(v) | (v != np.round(v)) | (v < 0) | (v > base)
            if bad.any():
                i = int(np.argmax(bad))
                raise _bad(name, a.shape, i, f"reads {float(v[i])}, not an integer digit 0..{base}",
                           labels[k])
            w = v != 0
            if k == 0:
                written[name] = w
            elif not np.array_equal(w, written[name]):
                i = int(np.argmax(w != written[name]))
                raise _bad(name, a.shape, i, "was written in some passes and not in others",
                           labels[k])
            digits.setdefault(name, []).append(np.where(w, v - 1, 0).astype(digit_dtype))
        bar.advance()
    bar.close()
    maps: dict[str, SourceMap] = {}
    for name in shapes:
        ids = np.zeros(written[name].shape, dtype=np.int64)
        scale = 1
        for d in digits[name][:passes]:
            ids += d.astype(np.int64) * scale
            scale *= base
        w = written[name]
        if (ids[w] >= spec.numel).any():
            i = int(np.flatnonzero(w & (ids >= spec.numel))[0])
            raise _bad(name, shapes[name], i, f"decodes to id {ids[i]} >= numel {spec.numel}",
                       "the decoded ids")
        check = digits[name][passes].astype(np.int64)
        wrong = w & (check != _check_digit(ids, base))
        if wrong.any():
            i = int(np.argmax(wrong))
            raise _bad(name, shapes[name], i, "disagrees between the id passes and the check pass",
                       labels[passes])
        ids[~w] = -1
        maps[name] = SourceMap.from_indices(ids.reshape(shapes[name]))
        del digits[name], written[name]
    return maps


def _dtype_known(dt: np.dtype) -> bool:
    try:
        dtype_info(dt)
    except Exception:  # noqa: BLE001 - unknown dtypes are simply not used to narrow the base
        return False
    return True


class _NoBar:
    def advance(self) -> None:
        pass

    def close(self) -> None:
        pass


class _RichBar:
    def __init__(self, total: int):
        from rich.progress import Progress

        self._p = Progress(transient=True)
        self._p.start()
        self._t = self._p.add_task("probing load function", total=total)

    def advance(self) -> None:
        self._p.advance(self._t)

    def close(self) -> None:
        self._p.stop()


def _progress(enabled: bool, total: int):
    return _RichBar(total) if enabled else _NoBar()
