"""A plan as a file: one ``.npz`` of numpy arrays and a small JSON header, no pickle
(:func:`save_plan`, :func:`read_plan`), and the hash peers compare (:func:`plan_fingerprint`).

Layouts and slots are columns of arrays too (:func:`wb.data.layout.layouts_to_arrays`), so
saving and loading take time in proportion to the arrays, not to the buffers.
"""

from __future__ import annotations

import hashlib
import json
import numpy as np

from wb.data.correspondence import Correspondence, Slot
from wb.data.layout import Cluster, Role, layouts_from_arrays, layouts_to_arrays
from wb.data.plan.arrays import Messages, Pieces, Transfers
from wb.errors import PlanError

__all__ = ["PLAN_FORMAT", "save_plan", "read_plan", "plan_fingerprint"]

#: Format of saved plans: the version a file's header carries (3: pieces carry the dtype they
#: travel in; layouts and slots are arrays).
PLAN_FORMAT = 3


def save_plan(plan, path) -> None:
    """Writes ``plan`` (a :class:`wb.Plan`) to ``path`` (a file name or a writable binary file
    object)."""
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
              "cluster": {"nic_gbps": plan.cluster.nic_gbps,
                          "nvlink_GBps": plan.cluster.nvlink_GBps,
                          "nodes": dict(plan.cluster.nodes)},
              "layouts": lay_header, "slot_buffers": list(names)}
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    np.savez(path, **arrays)


def read_plan(path) -> dict:
    """The fields of the plan :func:`save_plan` wrote to ``path`` (a file name or a readable
    binary file object), as keyword arguments of :class:`wb.Plan`.

    Raises:
        PlanError: a file of another format: make the plan again and save it.
    """
    with np.load(path, allow_pickle=False) as z:
        data = {k: z[k] for k in z.files}
    header = json.loads(bytes(data.pop("header")).decode())
    if header.get("version") != PLAN_FORMAT:
        raise PlanError(f"this plan file is of format {header.get('version')}, this wb reads "
                        f"format {PLAN_FORMAT} (it was saved by an older wb); make the plan "
                        f"again with wb.plan(...) and save it")
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
                chunk_bytes=header["chunk_bytes"], corr=corr, pieces=group(Pieces, "pieces"),
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

