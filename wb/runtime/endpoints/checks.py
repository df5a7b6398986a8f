"""A weight check through the source maps: does a rollout serve the trainers' weights?

The trainers *claim* a version (:meth:`wb.Sender.claim`): each publishes the values of a seeded
sample of checkpoint elements it holds (:func:`sample`; every element, when asked), read from the
weights it says it trains (by default the buffers it pushes: pass others, such as the
framework's parameters, to catch a push of the wrong buffers). A rollout *checks* it
(:meth:`wb.Receiver.check`): it takes the same sample, finds where its buffers hold each element
through its source maps (:func:`wb.algorithms.locate.locate`; the maps it was planned with, or
maps just probed from its loader: a stale map cache or a loader that changed then shows), reads
those elements of its live buffers, converts the trainers' values to its dtypes as a transfer
does, and compares. Nothing of the model moves: the sample's values go through the store.

The answer is a :class:`CheckReport`, one :class:`TensorCheck` per checkpoint tensor: ``ok``,
``mismatch`` (with the first element that differs), ``not held`` (no sampled element is in this
rollout), ``unclaimed`` (no trainer published it) or ``not checked`` (FP8 blocks: their values
are the trainers' quantised, not checked here).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from wb.algorithms.locate import locate
from wb.data.dtypes import dtype_info
from wb.data.sealed import seal, unseal
from wb.data.sourcemap import SourceMap
from wb.data.spec import CheckpointSpec
from wb.runtime.engine.casts import assign
from wb.runtime.transport.stores import get_large, set_large

__all__ = ["sample", "claim", "check", "CheckReport", "TensorCheck", "DEFAULT_PER_TENSOR"]

#: Elements sampled per checkpoint tensor by default.
DEFAULT_PER_TENSOR = 64
_KIND = "weight claim"


def sample(spec: CheckpointSpec, seed: str, per_tensor: int | None = DEFAULT_PER_TENSOR
           ) -> np.ndarray:
    """The checkpoint ids a check of ``seed`` looks at: ``per_tensor`` elements of every tensor
    drawn at random (all of a smaller one; ``None``: every element; two draws of one element
    count once), sorted. The same on every worker for the same spec and seed."""
    bounds = np.asarray(spec.offsets, np.int64)  # each tensor's first id, then numel
    off, n = bounds[:-1], np.diff(bounds)
    if per_tensor is None:
        return np.arange(spec.numel, dtype=np.int64)
    small = n <= per_tensor
    big = np.flatnonzero(~small)
    digest = hashlib.sha256(seed.encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    draw = np.floor(rng.random((big.size, per_tensor)) * n[big, None]).astype(np.int64)
    draw = np.sort(off[big, None] + np.minimum(draw, n[big, None] - 1), axis=1)
    parts: list = [None] * n.size  # in tensor order: the whole is sorted
    for t in np.flatnonzero(small).tolist():
        parts[t] = off[t] + np.arange(n[t], dtype=np.int64)
    for k, t in enumerate(big.tolist()):
        parts[t] = draw[k]
    if not parts:
        return np.zeros(0, np.int64)
    out = np.concatenate(parts)
    return out[np.r_[True, out[1:] != out[:-1]]]  # a twice-drawn element once


def _read(flat, xp, pos: np.ndarray) -> np.ndarray:
    """Elements ``pos`` of a buffer (numpy or CuPy 1-D), as raw bits on the host."""
    raw = flat.view(f"u{flat.dtype.itemsize}")
    got = raw[xp.asarray(pos)] if xp is not np else raw[pos]
    return np.asarray(got.get() if hasattr(got, "get") else got)


def claim(store, key: str, layout, flat: Mapping[str, Any], xp, ids: np.ndarray) -> int:
    """Publishes under ``key`` the values of the ``ids`` this trainer's ``layout`` holds, read
    from ``flat`` (``{buffer: 1-D view}``, array module ``xp``). Returns how many."""
    header, blobs = [], []
    for name, b in layout.buffers.items():
        which, pos = locate(b.sourcemap, ids)
        if not which.size:
            continue
        first = np.unique(which, return_index=True)[1]  # an id held twice: once
        bits = _read(flat[name], xp, pos[first])
        header.append({"dtype": b.dtype, "n": int(first.size)})
        blobs += [ids[which[first]].astype(np.int64).tobytes(), bits.tobytes()]
    body = json.dumps(header).encode()
    set_large(store, key, seal(_KIND, len(body).to_bytes(8, "little") + body + b"".join(blobs)))
    return sum(h["n"] for h in header)


def _claims(store, keys: list[str], timeout: float) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The trainers' claims: ``{dtype: (ids, bits)}``, sorted by id, the first trainer's value of
    an id several hold."""
    ids: dict[str, list] = {}
    bits: dict[str, list] = {}
    for key in keys:
        raw = bytes(unseal(_KIND, get_large(store, key, timeout),
                           where=f"rendezvous: key `{key}`", remedy="claim the version again"))
        n = int.from_bytes(raw[:8], "little")
        at = 8 + n
        for h in json.loads(raw[8:at]):
            k, size = h["n"], dtype_info(h["dtype"]).itemsize
            ids.setdefault(h["dtype"], []).append(np.frombuffer(raw, np.int64, k, at))
            at += 8 * k
            bits.setdefault(h["dtype"], []).append(
                np.frombuffer(raw, np.dtype(f"u{size}"), k, at))
            at += size * k
    out = {}
    for dt in ids:
        i, b = np.concatenate(ids[dt]), np.concatenate(bits[dt])
        o = np.argsort(i, kind="stable")  # the first trainer's value of an id several hold
        i, b = i[o], b[o]
        keep = np.r_[True, i[1:] != i[:-1]]
        out[dt] = (i[keep], b[keep])
    return out


class TensorCheck(NamedTuple):
    """One checkpoint tensor's part of a :class:`CheckReport`."""

    status: str  # "ok", "mismatch", "not held", "unclaimed" or "not checked"
    checked: int  # sampled elements compared
    first_bad: tuple | None = None  # (element index in the tensor, buffer, want, got) of a mismatch


class CheckReport(NamedTuple):
    """What :meth:`wb.Receiver.check` found: per checkpoint tensor a :class:`TensorCheck`."""

    rank: int
    version: int
    tensors: dict[str, TensorCheck]
    seconds: float

    @property
    def ok(self) -> bool:
        """No tensor differs (and at least one was compared)."""
        st = [t.status for t in self.tensors.values()]
        return "mismatch" not in st and "ok" in st

    @property
    def counts(self) -> dict[str, int]:
        """``{status: tensors}``."""
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.status] = out.get(t.status, 0) + 1
        return out

    @property
    def mismatched(self) -> list[str]:
        return [n for n, t in self.tensors.items() if t.status == "mismatch"]

    def __str__(self) -> str:
        lines = [f"rank {self.rank}, version {self.version}: "
                 + ", ".join(f"{n} {s}" for s, n in sorted(self.counts.items()))
                 + f" ({self.seconds:.2f} s)"]
        for name in self.mismatched[:8]:
            i, buf, want, got = self.tensors[name].first_bad
            lines.append(f"  {name}[{i}] in buffer {buf}: {got!r} here, the trainers' {want!r}")
        return "\n".join(lines)


def check(store, keys: list[str], layout, flat: Mapping[str, Any], xp, ids: np.ndarray,
          spec: CheckpointSpec, *, rank: int, version: int, timeout: float,
          maps: Mapping[str, SourceMap] | None = None) -> CheckReport:
    """Compares ``flat`` (this rollout's buffers, ``{name: 1-D view}`` of module ``xp``) at
    the sampled ``ids`` with the trainers' claims under ``keys`` (see the module doc);
    ``maps``: source maps to read through instead of ``layout``'s (e.g. probed just now)."""
    t0 = time.perf_counter()
    claims = _claims(store, keys, timeout)
    names = list(spec.names)
    offsets = np.asarray(spec.offsets, np.int64)[:-1]
    checked = np.zeros(len(names), np.int64)
    fp8 = np.zeros(len(names), bool)
    first: dict[int, tuple] = {}  # tensor index -> its first mismatch
    for name, b in layout.buffers.items():
        which, pos = locate((maps or {}).get(name, b.sourcemap), ids)
        if not which.size:
            continue
        got_bits, have = _read(flat[name], xp, pos), ids[which]
        for dt, (cid, cbits) in claims.items():
            at = np.minimum(np.searchsorted(cid, have), cid.size - 1)
            sel = np.flatnonzero(cid[at] == have)
            if not sel.size:
                continue
            tix = np.searchsorted(offsets, have[sel], side="right") - 1
            if b.dtype.startswith("float8"):  # quantised with a scale: not compared here
                fp8[tix] = True
                continue
            want = cbits[at[sel]]
            if dt != b.dtype:  # converted as a transfer converts
                w = np.empty(sel.size, dtype_info(b.dtype).numpy)
                assign(np, w, want.view(dtype_info(dt).numpy), b.dtype, dt)
                want = w.view(f"u{w.dtype.itemsize}")
            g = got_bits[sel]
            vw, vg = _floats(want, b.dtype), _floats(g, b.dtype)
            same = (want == g) | (np.isnan(vw) & np.isnan(vg))
            np.add.at(checked, tix, 1)
            bad = np.flatnonzero(~same)
            for k in bad[np.unique(tix[bad], return_index=True)[1]]:
                t = int(tix[k])
                if t not in first:
                    first[t] = (int(have[sel[k]] - offsets[t]), name, float(vw[k]), float(vg[k]))
    sampled = np.zeros(len(names), bool)
    sampled[np.searchsorted(offsets, ids, side="right") - 1] = True
    claimed = np.zeros(len(names), bool)
    for cid, _ in claims.values():
        claimed[np.searchsorted(offsets, cid, side="right") - 1] = True
    report = {}
    for t, n in enumerate(names):
        if t in first:
            report[n] = TensorCheck("mismatch", int(checked[t]), first[t])
        elif checked[t]:
            report[n] = TensorCheck("ok", int(checked[t]))
        elif fp8[t]:
            report[n] = TensorCheck("not checked", 0)
        elif sampled[t] and not claimed[t]:
            report[n] = TensorCheck("unclaimed", 0)
        else:
            report[n] = TensorCheck("not held", 0)
    return CheckReport(rank, version, report, time.perf_counter() - t0)


def _floats(bits: np.ndarray, dtype: str) -> np.ndarray:
    """Raw bits as float64 values (for NaN and for the report)."""
    return bits.view(dtype_info(dtype).numpy).astype(np.float64)
