"""The arrays a plan is made of: its pieces, transfers and messages, per-slot facts, and the
bytes it moves per link (:class:`Traffic`).

A plan moves **pieces**: sub-rectangles (at most ``chunk_bytes``) of the correspondence's cells. A
**transfer** moves one piece from a region of one buffer to a region of another; a transfer whose
source is a rollout buffer names the transfer that brought the piece there (``after``), which is
earlier in the plan's order. Transfers are grouped into **messages** (one send between two ranks,
at most about ``chunk_bytes``); a forwarded message has one parent message, so a worker can
forward it as soon as the parent lands.

Stages: 1 from a trainer (to another node over its NIC, within a node over NVLink, or a local copy
on a shared GPU); 2 between rollout nodes (NIC); 3 inside a rollout node (NVLink or a local copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from wb.data.correspondence import Slot
from wb.data.dtypes import CODE
from wb.data.layout import Layout, Role

__all__ = ["Pieces", "Transfers", "Messages", "Traffic", "SlotTable", "slot_table", "sum_by"]


class Pieces(NamedTuple):
    """Sub-rectangles of cells: ids ``id0 + i * S + j`` for ``i < na``, ``j < nb``."""

    cell: np.ndarray  # (p,) int64 cell index
    i0: np.ndarray  # (p,) int64 first row within the cell
    j0: np.ndarray  # (p,) int64 first column within the cell
    na: np.ndarray  # (p,) int64 rows
    nb: np.ndarray  # (p,) int64 columns
    nbytes: np.ndarray  # (p,) int64 as it travels
    dtype: np.ndarray  # (p,) int8 code (wb.data.dtypes.CODES) of the dtype it travels in


class Transfers(NamedTuple):
    """One piece from one buffer region to another; in execution order (parents first)."""

    stage: np.ndarray  # (t,) int8: 1, 2 or 3
    piece: np.ndarray  # (t,) int64
    src_slot: np.ndarray  # (t,) int64 index into Plan.slots
    src_f0: np.ndarray  # (t,) int64 flat index of the piece's first element in the source
    src_fa: np.ndarray  # (t,) int64 flat step per piece row
    src_fb: np.ndarray  # (t,) int64 flat step per piece column
    dst_slot: np.ndarray  # (t,) int64
    dst_f0: np.ndarray  # (t,) int64
    dst_fa: np.ndarray  # (t,) int64
    dst_fb: np.ndarray  # (t,) int64
    after: np.ndarray  # (t,) int64 transfer that delivered the piece to src_slot; -1 from a trainer
    message: np.ndarray  # (t,) int64
    src_inc: np.ndarray  # (t,) int64 incidence (Plan.corr) of the source region
    dst_inc: np.ndarray  # (t,) int64 incidence of the destination region


class Messages(NamedTuple):
    """Sends between two ranks; transfers ``first .. first+count-1`` travel in message ``k``."""

    stage: np.ndarray  # (m,) int8
    src_rank: np.ndarray  # (m,) int64
    dst_rank: np.ndarray  # (m,) int64
    nbytes: np.ndarray  # (m,) int64
    parent: np.ndarray  # (m,) int64 message whose arrival this one waits for; -1 none
    first: np.ndarray  # (m,) int64
    count: np.ndarray  # (m,) int64


@dataclass(frozen=True)
class Traffic:
    """Bytes per trainer rank sent, per node received/sent over NICs, and per node over NVLink."""

    trainer_out: dict[int, int]  # {trainer rank: bytes it sends to other GPUs}
    node_in: dict[str, int]  # {node: bytes entering it over NICs}
    node_out: dict[str, int]  # {node: bytes leaving it over NICs}
    intra_node: dict[str, int]  # {node: bytes between its GPUs (NVLink)}

    @property
    def trainer_total(self) -> int:
        return int(sum(self.trainer_out.values()))

    def to_json(self) -> dict:
        return {"trainer_out": {str(k): v for k, v in self.trainer_out.items()},
                "node_in": self.node_in, "node_out": self.node_out, "intra_node": self.intra_node}


class SlotTable(NamedTuple):
    role: np.ndarray  # (s,) int8 0 trainer, 1 rollout
    rank: np.ndarray  # (s,) int64
    node: np.ndarray  # (s,) int64 index into node names
    gpu: np.ndarray  # (s,) int64 global GPU index (node, local_rank)
    itemsize: np.ndarray  # (s,) int64
    dtype: np.ndarray  # (s,) int64 code (wb.data.dtypes.CODES)


def slot_table(slots: Sequence[Slot], trainers: Sequence[Layout], rollouts: Sequence[Layout]
               ) -> tuple[SlotTable, list[str]]:
    """Per-slot arrays: role, rank, node index, GPU index, itemsize, dtype code; and the node
    names."""
    lays = {Role.TRAINER: trainers, Role.ROLLOUT: rollouts}
    workers = [lays[s.role][s.layout].worker for s in slots]
    nodes = sorted({w.node for lay in (*trainers, *rollouts) for w in [lay.worker]})
    node_ix = {n: i for i, n in enumerate(nodes)}
    gpus = sorted({(node_ix[lay.worker.node], lay.worker.local_rank)
                   for lay in (*trainers, *rollouts)})
    gpu_ix = {g: i for i, g in enumerate(gpus)}
    table = SlotTable(
        np.array([0 if s.role == Role.TRAINER else 1 for s in slots], np.int8),
        np.array([w.rank for w in workers], np.int64),
        np.array([node_ix[w.node] for w in workers], np.int64),
        np.array([gpu_ix[(node_ix[w.node], w.local_rank)] for w in workers], np.int64),
        np.array([lays[s.role][s.layout].buffers[s.buffer].itemsize for s in slots], np.int64),
        np.array([CODE[lays[s.role][s.layout].buffers[s.buffer].dtype] for s in slots], np.int64))
    return table, nodes


def sum_by(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(unique keys, sum of values per key)`` (int64 both)."""
    if keys.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    u, inv = np.unique(keys, return_inverse=True)
    return u, np.bincount(inv, weights=values, minlength=u.size).astype(np.int64)

