"""Probing: run a framework's own load function on tensors whose values encode element ids.

:func:`probe` runs the passes of :mod:`wb.algorithms.probing.idcode`: each feeds every checkpoint
tensor (a :class:`ProbeCheckpoint`) with one base-``B`` digit of each element's id, then reads every
buffer the load function produced. ``B`` is the largest integer count every dtype on the path holds
exactly (bf16: 256, fp16: 2048, fp32: 2**24, fp8 e4m3: 16), so ``passes = ceil(log_B(numel))``
plus one *check pass* whose value is a hash digit of the id. A load function that is pure data
movement reproduces the digits; one that scales, adds or quantises produces non-integers,
out-of-range values, elements written in some passes but not others, or ids whose hash disagrees
with the check pass: all raise :class:`wb.ProbeError`, never a wrong map. Where the per-element
work runs is a :class:`~wb.algorithms.probing.ProbeArrays`; this module holds the pass loop, the
map cache's reading and the progress bar.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from wb.algorithms.probing.host import HostArrays
from wb.algorithms.probing.idcode import digit_base, n_passes
from wb.algorithms.probing.seam import ProbeArrays
from wb.data.dtypes import dtype_info
from wb.data.mapcache import BufferInfo, MapCache, cache_file, fingerprint
from wb.data.sourcemap import SourceMap
from wb.data.spec import CheckpointSpec
from wb.errors import ProbeError, SpecError

__all__ = ["probe", "ProbeCheckpoint"]

log = logging.getLogger(__name__)


class ProbeCheckpoint(Mapping):
    """The checkpoint of one probing pass: ``{name: array of digit values}``, built on access.

    Arrays are what ``arrays.feed`` makes: by default numpy arrays in each tensor's spec dtype
    (``ml_dtypes`` for bf16/fp8), filled without a per-element id array (see
    :class:`~wb.algorithms.probing.HostArrays`). The name of the tensor accessed last is kept in
    :attr:`last`, so an error inside the load function can say which tensor it was being fed.
    """

    def __init__(self, spec: CheckpointSpec, base: int, pass_index: int | None, *,
                 arrays: ProbeArrays | None = None):
        self.spec, self.base, self.pass_index = spec, base, pass_index  # None: the check pass
        self.last: str | None = None
        self._arrays = arrays or HostArrays()

    def __getitem__(self, name: str) -> Any:
        self.last = name
        return self._arrays.feed(self.spec, name, self.base, self.pass_index)

    def __iter__(self) -> Iterator[str]:
        return iter(self.spec.names)

    def __contains__(self, name: object) -> bool:  # Mapping's default would build the tensor
        return name in self.spec

    def __len__(self) -> int:
        return len(self.spec)


def probe(spec: CheckpointSpec, load: Callable[[Mapping[str, np.ndarray]], Mapping[str, Any]], *,
          base: int | None = None, progress: bool = False,
          cache: str | os.PathLike | None = None, key: Any = None,
          buffers: Mapping[str, BufferInfo] | None = None,
          arrays: ProbeArrays | None = None) -> dict[str, SourceMap]:
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
        cache: a file (``.npz``) or a directory (one file per ``key``) to keep the maps in. When it
            holds maps with the fingerprint of ``spec``, ``buffers`` and ``key``, they are returned
            and ``load`` is never called; otherwise (missing, stale, unreadable: logged) the probe
            runs and overwrites it. See :mod:`wb.data.mapcache`.
        key: what tells this rank's maps from another's (JSON-able: ``{"rank": 3, "tp": 8}``);
            part of the fingerprint.
        buffers: ``{name: (shape, dtype, device kind)}`` of the buffers ``load`` writes, when the
            caller knows them without running it (the shims do); part of the fingerprint, so a
            changed model re-probes.
        arrays: where the per-element work runs (:class:`ProbeArrays`); default numpy on the
            host (:class:`HostArrays`). ``wb_torch.probe`` passes one that works on the
            parameters' device.

    Returns:
        ``{buffer name: SourceMap}``; elements never written map to ``-1``.

    Raises:
        ProbeError: ``load`` raised (the message names the checkpoint tensor it was being fed),
            returned something unusable, wrote no checkpoint id into any buffer, or is not pure
            data movement (names the buffer and the first bad element).
        SpecError: ``spec`` is not a :class:`wb.CheckpointSpec`, or ``key`` is not JSON-able.

    Examples:
        >>> spec = CheckpointSpec({"w": ((4, 6), "bfloat16")})
        >>> maps = probe(spec, lambda ck: {"shard": np.asarray(ck["w"])[:, 3:].T})
        >>> maps["shard"].to_indices()[:, :2]
        array([[ 3,  9],
               [ 4, 10],
               [ 5, 11]])
    """
    if not isinstance(spec, CheckpointSpec):
        raise SpecError(f"probe takes a wb.CheckpointSpec, got {type(spec).__name__}")
    if not callable(load):
        raise ProbeError(f"probe: load must be a function (checkpoint -> buffers), got "
                         f"{type(load).__name__}")
    if len(spec) == 0 or spec.numel == 0:
        raise ProbeError("the checkpoint spec is empty: nothing to probe")
    if cache is None:
        return _probe(spec, load, base, progress, arrays)
    fp = fingerprint(spec, buffers=buffers, key=key)
    path = cache_file(cache, key)
    cached = _read_cache(path, fp)
    if cached is not None:
        return cached
    maps = _probe(spec, load, base, progress, arrays)
    MapCache(fp, maps).save(path)
    log.info("probe: saved %d maps to %s", len(maps), path)
    return maps


def _read_cache(path, fp: str) -> dict[str, SourceMap] | None:
    """The maps saved at ``path`` if their fingerprint is ``fp``; ``None`` (logged) otherwise."""
    try:
        saved = MapCache.load(path)
    except FileNotFoundError:
        log.info("probe: no map cache at %s; probing", path)
        return None
    except SpecError as e:
        log.warning("probe: %s; probing again", e)
        return None
    if saved.fingerprint != fp:
        log.warning("probe: the map cache %s was probed from another spec, model or key "
                    "(fingerprint %s..., now %s...); probing again and overwriting it", path,
                    saved.fingerprint[:12], fp[:12])
        return None
    log.info("probe: %d maps from the cache %s", len(saved.maps), path)
    return dict(saved.maps)


def _probe(spec, load, base, progress, arrays) -> dict[str, SourceMap]:
    chosen = base or digit_base(set(spec.dtypes))
    for attempt in range(2):
        result = _probe_with_base(spec, load, chosen, progress, base is None and attempt == 0,
                                  arrays or HostArrays())
        if isinstance(result, dict):
            _check_found_ids(result)
            return result
        log.info("restarting probe with digit base %d: %s", result[0], result[1])
        chosen = result[0]
    raise AssertionError("unreachable: the second attempt never narrows")


def _check_found_ids(maps: Mapping[str, SourceMap]) -> None:
    # Maps that are all -1 are what a load writing somewhere else produces (a loader that
    # replaces the Parameter objects read back here): never a useful result, so never silent.
    if not any(m.n_ids for m in maps.values()):
        names = sorted(maps)
        raise ProbeError(
            f"the load function wrote no checkpoint id into any of the {len(names)} buffers it "
            f"returned ({names[:5]}{'...' if len(names) > 5 else ''}): return the arrays the load "
            f"writes (a loader that replaces tensors must be read after it ran), and check that "
            f"the spec's names are the ones the load function expects")


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


def _probe_with_base(spec, load, base, progress, allow_narrowing, arrays):
    passes = n_passes(spec.numel, base)
    labels = [f"pass {k + 1}/{passes + 1}" for k in range(passes + 1)]
    written: dict[str, Any] = {}  # (buffer numel,) mask, for each buffer
    digits: dict[str, list] = {}  # (buffer numel,) digits, one per pass
    shapes: dict[str, tuple] = {}
    bar = _progress(progress, passes + 1)
    if hasattr(arrays, "begin"):
        arrays.begin(spec, base, passes)
    for k in range(passes + 1):
        ck = ProbeCheckpoint(spec, base, k if k < passes else None, arrays=arrays)
        out = _call(load, ck, labels[k])
        if k == 0:
            dts = {n: arrays.dtype_name(arrays.buffer(n, a)) for n, a in out.items()}
            # bool and other 1-value dtypes cannot carry a digit: they never narrow the base
            narrow = [(n, dtype_info(dt)) for n, dt in dts.items()
                      if dt is not None and dtype_info(dt).exact_int_max > 1]
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
        checks = []  # (name, buffer, ok of its digits, ok of its written mask): checked at once
        if k == 0 and hasattr(arrays, "prepare"):
            arrays.prepare({n: arrays.buffer(n, a) for n, a in out.items()}, base, passes)
        for name, arr in out.items():
            a = arrays.buffer(name, arr)
            shape = tuple(a.shape)
            if k == 0:
                shapes[name] = shape
            elif shape != shapes[name]:
                raise ProbeError(f"buffer `{name}` changed shape from {shapes[name]} to {shape} "
                                 f"in {labels[k]}")
            w, d, ok = arrays.read(a, base)
            if k == 0:
                written[name], same = w, True
            else:
                same = arrays.same(w, written[name])
            checks.append((name, a, ok, same))
            digits.setdefault(name, []).append(d)
            del w, d, a, arr
        if not arrays.all_true([c for _, _, ok, same in checks for c in (ok, same)]):
            _raise_first_bad(arrays, checks, shapes, written, base, labels[k])
        # the buffers may be views of this pass's checkpoint tensors: dropped, their memory is
        # the next pass's (HostArrays reuses it)
        del out, ck, checks
        bar.advance()
    bar.close()
    maps: dict[str, SourceMap] = {}
    for name, shape in shapes.items():
        cols = shape[-1] if shape else 1
        runs, bad, in_check = arrays.runs(written.pop(name), digits.pop(name), base, spec.numel,
                                          cols)
        if bad is not None:
            raise _bad(name, shape, bad.index, bad.what,
                       labels[passes] if in_check else "the decoded ids")
        maps[name] = SourceMap.from_runs(shape, runs)
    return maps


def _raise_first_bad(arrays, checks, shapes, written, base, label) -> None:
    """Raises the error of the first buffer whose digits or written mask failed in a pass."""
    for name, a, ok, same in checks:
        if not arrays.all_true([ok]):
            bad = arrays.first_bad(a, base)
            raise _bad(name, shapes[name], bad.index, bad.what, label)
        if not arrays.all_true([same]):
            w = arrays.read(a, base)[0]
            raise _bad(name, shapes[name], arrays.first_difference(w, written[name]),
                       "was written in some passes and not in others", label)
    raise AssertionError("a pass failed its check but no buffer did")


def _bad(name: str, shape, flat: int, what: str, pass_label: str) -> ProbeError:
    where = tuple(int(i) for i in np.unravel_index(flat, shape)) if shape else ()
    return ProbeError(
        f"buffer `{name}` element {where} {what} in {pass_label}: the load function is not pure data "
        f"movement (it scales, adds, casts lossily or quantises); probe a load path that only "
        f"copies, slices, concatenates, transposes or reshapes")


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
