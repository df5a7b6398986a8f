"""A plan as a file: one ``.npz`` of numpy arrays and a small JSON header, no pickle, sealed with
a digest of the whole that is checked before anything is decoded (:mod:`wb.data.sealed`;
:func:`save_plan`, :func:`read_plan`), and the hash peers compare (:func:`plan_fingerprint`).

Layouts and slots are columns of arrays too (:func:`wb.data.layout.layouts_to_arrays`), so
saving and loading take time in proportion to the arrays, not to the buffers.
"""

from __future__ import annotations

import hashlib
import io
import json
import os

import numpy as np

from wb.data.correspondence import Correspondence, Slot
from wb.data.layout import Cluster, Role, layouts_from_arrays, layouts_to_arrays
from wb.data.plan.arrays import Messages, Pieces, Transfers
from wb.data.sealed import DECODE_ERRORS, seal_head, unseal_stream
from wb.errors import PlanError, WbError

__all__ = ["PLAN_FORMAT", "save_plan", "read_plan", "plan_fingerprint"]

#: Format of saved plans: the version a file's header carries (3: pieces carry the dtype they
#: travel in; layouts and slots are arrays; 4: the file is sealed).
PLAN_FORMAT = 4
_AGAIN = "make the plan again with wb.plan(...) and save it (plans are cheap to re-make)"


def _file_name(path) -> str | None:
    """The file a path names (``.npz`` added, as numpy's ``savez`` always did), or None for a
    file object."""
    if isinstance(path, (str, os.PathLike)):
        name = os.fspath(path)
        return name if name.endswith(".npz") else name + ".npz"
    return None


def save_plan(plan, path) -> None:
    """Writes ``plan`` (a :class:`wb.Plan`) to ``path`` (a file name, ``.npz`` added if it has
    none, or a writable binary file object)."""
    arrays: dict[str, np.ndarray] = {}
    for group, nt in (("corr", plan.corr), ("pieces", plan.pieces),
                      ("transfers", plan.transfers), ("messages", plan.messages)):
        for k, v in nt._asdict().items():
            if isinstance(v, np.ndarray):
                arrays[f"{group}.{k}"] = v
    lay_header, lay_arrays = layouts_to_arrays((*plan.trainers, *plan.rollouts))
    arrays.update({f"layouts.{k}": v for k, v in lay_arrays.items()})
    slots = plan.corr.slots
    names: dict[str, int] = {}
    arrays["slots.role"] = np.array([s.role == Role.ROLLOUT for s in slots], np.int8)
    arrays["slots.layout"] = np.array([s.layout for s in slots], np.int64)
    arrays["slots.rank"] = np.array([s.rank for s in slots], np.int64)
    arrays["slots.buffer"] = np.array([names.setdefault(s.buffer, len(names)) for s in slots],
                                      np.int64)
    header = {"version": PLAN_FORMAT, "chunk_bytes": plan.chunk_bytes,
              "pack_below": plan.pack_below,
              "cluster": {"nic_gbps": plan.cluster.nic_gbps,
                          "nvlink_GBps": plan.cluster.nvlink_GBps,
                          "nodes": dict(plan.cluster.nodes)},
              "layouts": lay_header, "slot_buffers": list(names)}
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    name = _file_name(path)
    if name is None and not callable(getattr(path, "write", None)):
        raise PlanError(f"Plan.save takes a file name or a writable binary file object, got "
                        f"{type(path).__name__}")
    f = io.BytesIO()
    np.savez(f, **arrays)
    payload = f.getbuffer()
    with open(name, "wb") if name is not None else _kept(path) as out:
        out.write(seal_head("plan", payload))
        out.write(payload)


class _kept:
    """A file object the caller owns, as a context manager that leaves it open."""

    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self.f

    def __exit__(self, *exc):
        return False


def read_plan(path) -> dict:
    """The fields of the plan :func:`save_plan` wrote to ``path`` (a file name or a readable
    binary file object), as keyword arguments of :class:`wb.Plan`, once the file's digest
    matches.

    Raises:
        PlanError: the file changed since it was saved (a flipped bit, cut short, longer), or is
            of another format: make the plan again and save it. Names the file.
        FileNotFoundError: there is no such file.
    """
    name = _file_name(path)
    if name is None and not callable(getattr(path, "read", None)):
        raise PlanError(f"Plan.load takes a file name or a readable binary file object, got "
                        f"{type(path).__name__}")
    if name is not None and not os.path.exists(name) and os.path.exists(os.fspath(path)):
        name = os.fspath(path)  # a file named without .npz by other means
    where = f"plan file `{name}`" if name is not None else "the plan file given"
    if name is None:
        data = path.read()
    else:
        with open(name, "rb") as f:
            data = f.read()
    stream = unseal_stream("plan", data, where=where, error=PlanError, remedy=_AGAIN)
    try:
        return _fields(stream, where)
    except PlanError:
        raise
    except (*DECODE_ERRORS, WbError) as e:  # the right digest on bytes of another layout
        raise PlanError(f"{where} cannot be read ({type(e).__name__}: {e}); {_AGAIN}") from e


def _fields(stream, where: str) -> dict:
    with np.load(stream, allow_pickle=False) as z:
        data = {k: z[k] for k in z.files}
    header = json.loads(bytes(data.pop("header")).decode())
    if header.get("version") != PLAN_FORMAT:
        raise PlanError(f"{where} is of format {header.get('version')}, this wb reads "
                        f"format {PLAN_FORMAT}; {_AGAIN}")
    lays = layouts_from_arrays(header["layouts"], {
        k.split(".", 1)[1]: v for k, v in data.items() if k.startswith("layouts.")})
    trainers = tuple(lay for lay in lays if lay.worker.role == Role.TRAINER)
    rollouts = tuple(lay for lay in lays if lay.worker.role == Role.ROLLOUT)
    names = header["slot_buffers"]
    slots = tuple(Slot(Role.ROLLOUT if r else Role.TRAINER, li, rank, names[b])
                  for r, li, rank, b in zip(data["slots.role"].tolist(),
                                            data["slots.layout"].tolist(),
                                            data["slots.rank"].tolist(),
                                            data["slots.buffer"].tolist()))

    def group(nt, name, **extra):
        return nt(**extra, **{f: data[f"{name}.{f}"] for f in nt._fields if f not in extra})
    corr = group(Correspondence, "corr", slots=slots)
    c = header["cluster"]
    return dict(trainers=trainers, rollouts=rollouts,
                cluster=Cluster(c["nic_gbps"], c["nvlink_GBps"], c["nodes"]),
                chunk_bytes=header["chunk_bytes"],
                pack_below=int(header.get("pack_below", 1 << 20)),  # (a file without it: 1 MiB)
                corr=corr, pieces=group(Pieces, "pieces"),
                transfers=group(Transfers, "transfers"), messages=group(Messages, "messages"))


def plan_fingerprint(plan) -> str:
    """A hash of everything in ``plan`` (a :class:`wb.Plan`) that decides which bytes go where
    (hex sha256)."""
    h = hashlib.sha256()
    for lay in (*plan.trainers, *plan.rollouts):
        w = lay.worker
        h.update(json.dumps([w.rank, w.node, w.role.value, w.local_rank,
                             [[n, list(b.shape), b.dtype] for n, b in lay.buffers.items()]]).encode())
    for nt in (plan.corr, plan.pieces, plan.transfers, plan.messages):
        for v in nt:
            if isinstance(v, np.ndarray):
                h.update(np.ascontiguousarray(v).tobytes())
    return h.hexdigest()

