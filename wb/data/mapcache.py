"""Probed source maps saved to disk with the fingerprint of what they were probed from.

A probe costs passes over the whole checkpoint; its result depends only on the checkpoint spec,
on the buffers the load function writes (their names, shapes, dtypes and device kind) and on what
the caller says distinguishes one rank from another (rank, TP degree, ...). :func:`fingerprint`
hashes exactly those; :class:`MapCache` is the maps with that hash, saved as one ``.npz`` of plain
integer arrays plus a JSON header (no pickle: ``np.load(allow_pickle=False)`` reads it back),
sealed with a digest of the whole file that is checked before anything is decoded
(:mod:`wb.data.sealed`). Which
file a cache argument names is :func:`cache_file`'s rule. Deciding whether to trust a file is the
prober's (:func:`wb.probe`); this module only writes and reads values.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from wb.data.sealed import seal_head, unseal_stream
from wb.data.sourcemap import SourceMap
from wb.data.spec import CheckpointSpec
from wb.errors import SpecError

__all__ = ["MapCache", "BufferInfo", "fingerprint", "cache_file", "FORMAT"]

#: Version of the file layout; a file of another version is stale (2: sealed).
FORMAT = 2

#: ``(shape, dtype name, device kind)`` of one probed buffer: ``((64, 32), "bfloat16", "cuda")``.
BufferInfo = tuple[tuple[int, ...], str, str]


def _json_key(key: Any) -> str:
    try:
        return json.dumps(key, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise SpecError(f"`key` must be JSON-able (ints, strs, lists, dicts), got "
                        f"{type(key).__name__} {key!r}: pass e.g. {{'rank': 3, 'tp': 8}}") from e


def describe(spec: CheckpointSpec, *, buffers: Mapping[str, BufferInfo] | None = None,
             key: Any = None) -> dict:
    """The JSON-able facts a probe's maps depend on (what :func:`fingerprint` hashes).

    Args:
        spec: the checkpoint spec (its order matters: ids follow it).
        buffers: ``{buffer name: (shape, dtype, device kind)}`` of what the load writes, or
            ``None`` where it cannot be known without running the load.
        key: the caller's JSON-able distinction between ranks (rank, TP degree, ...).

    Returns:
        A dict of lists, strs and ints.
    """
    bufs = None if buffers is None else sorted(
        [str(n), [int(d) for d in s], str(dt), str(dev)] for n, (s, dt, dev) in buffers.items())
    return {"format": FORMAT, "spec": [[n, list(s), d] for n, (s, d) in spec.items()],
            "buffers": bufs, "key": json.loads(_json_key(key))}


def fingerprint(spec: CheckpointSpec, *, buffers: Mapping[str, BufferInfo] | None = None,
                key: Any = None) -> str:
    """SHA-256 (hex) of :func:`describe`'s facts: equal iff spec, buffers and key are equal.

    Examples:
        >>> spec = CheckpointSpec({"w": ((4, 6), "bfloat16")})
        >>> fingerprint(spec, key={"rank": 0}) == fingerprint(spec, key={"rank": 1})
        False
    """
    text = json.dumps(describe(spec, buffers=buffers, key=key), sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def cache_file(cache: str | os.PathLike, key: Any = None) -> Path:
    """The file a ``cache=`` argument names: ``cache`` itself, or, when ``cache`` is an existing
    directory (or ends with a path separator), ``wb-maps-<hash of key>.npz`` in it, so that the
    ranks of a job can share one directory and a rank finds its own file again after a restart.

    Examples:
        >>> cache_file("maps.npz").name
        'maps.npz'
    """
    text = os.fspath(cache)
    path = Path(text)
    if path.is_dir() or text.endswith((os.sep, "/")):
        digest = hashlib.sha256(_json_key(key).encode()).hexdigest()[:16]
        return path / f"wb-maps-{digest}.npz"
    return path


@dataclass(frozen=True, slots=True)
class MapCache:
    """Probed maps and the fingerprint of what they were probed from.

    Args:
        fingerprint: :func:`fingerprint` of the spec, buffers and key.
        maps: ``{buffer name: SourceMap}`` as the probe returned them.
    """

    fingerprint: str
    maps: Mapping[str, SourceMap]

    def save(self, path: str | os.PathLike) -> None:
        """Writes the maps to ``path`` (``.npz``) atomically: a reader sees the old file or the
        new one, never half of one (ranks of a job may share a directory)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        names = list(self.maps)
        meta = {"format": FORMAT, "fingerprint": self.fingerprint, "names": names}
        arrays = {"meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
        for i, name in enumerate(names):
            arrays.update({f"m{i}.{k}": v for k, v in self.maps[name].to_arrays().items()})
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        payload = buf.getbuffer()
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(seal_head("map cache", payload))
                f.write(payload)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike) -> MapCache:
        """Reads a file :meth:`save` wrote.

        Raises:
            SpecError: the file is not a map cache of this format (its digest does not match:
                corrupt, truncated; another version); the message names the file.
            FileNotFoundError: there is no file.
        """
        fix = "delete it or let the probe overwrite it"
        data = Path(path).read_bytes()
        stream = unseal_stream("map cache", data, where=f"map cache `{path}`", error=SpecError,
                               remedy=fix)
        try:
            with np.load(stream, allow_pickle=False) as z:
                meta = json.loads(bytes(z["meta"]).decode())
                if meta.get("format") != FORMAT:
                    raise ValueError(f"format {meta.get('format')!r}, this version reads {FORMAT}")
                maps = {}
                for i, name in enumerate(meta["names"]):
                    pre = f"m{i}."
                    maps[name] = SourceMap.from_arrays(
                        {k[len(pre):]: z[k] for k in z.files if k.startswith(pre)})
                return cls(str(meta["fingerprint"]), maps)
        except FileNotFoundError:
            raise
        except Exception as e:  # noqa: BLE001 - any unreadable file is one kind of problem
            raise SpecError(f"map cache `{path}` cannot be read ({type(e).__name__}: {e}); "
                            f"{fix}") from e
