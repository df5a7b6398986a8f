"""Plan: who sends which bytes to whom, in which order (pure data), and checks of a plan.

Long because the plan's data, its element-exact check and its array-only save/load are one value.

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

import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from wb.data.conversions import ITEMSIZE
from wb.data.correspondence import Correspondence, Slot, correspond
from wb.data.dtypes import CODE, CODES, castable, convert, dtype_info
from wb.errors import PlanError
from wb.data.layout import (
    Cluster,
    Layout,
    Role,
    layouts_from_arrays,
    layouts_to_arrays,
)

__all__ = ["Messages", "Pieces", "Plan", "Traffic", "Transfers", "run_local", "schedule"]

#: Format of :meth:`Plan.save` files: 3 adds the dtypes cells travel in; 2 stores layouts and
#: slots as arrays (1 as JSON per buffer).
PLAN_FORMAT = 3


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


class _SlotTable(NamedTuple):
    role: np.ndarray  # (s,) int8 0 trainer, 1 rollout
    rank: np.ndarray  # (s,) int64
    node: np.ndarray  # (s,) int64 index into node names
    gpu: np.ndarray  # (s,) int64 global GPU index (node, local_rank)
    itemsize: np.ndarray  # (s,) int64
    dtype: np.ndarray  # (s,) int64 code (wb.data.dtypes.CODES)


def slot_table(slots: Sequence[Slot], trainers: Sequence[Layout], rollouts: Sequence[Layout]
               ) -> tuple[_SlotTable, list[str]]:
    """Per-slot arrays: role, rank, node index, GPU index, itemsize, dtype code; and the node
    names."""
    lays = {Role.TRAINER: trainers, Role.ROLLOUT: rollouts}
    workers = [lays[s.role][s.layout].worker for s in slots]
    nodes = sorted({w.node for lay in (*trainers, *rollouts) for w in [lay.worker]})
    node_ix = {n: i for i, n in enumerate(nodes)}
    gpus = sorted({(node_ix[lay.worker.node], lay.worker.local_rank)
                   for lay in (*trainers, *rollouts)})
    gpu_ix = {g: i for i, g in enumerate(gpus)}
    table = _SlotTable(
        np.array([0 if s.role == Role.TRAINER else 1 for s in slots], np.int8),
        np.array([w.rank for w in workers], np.int64),
        np.array([node_ix[w.node] for w in workers], np.int64),
        np.array([gpu_ix[(node_ix[w.node], w.local_rank)] for w in workers], np.int64),
        np.array([lays[s.role][s.layout].buffers[s.buffer].itemsize for s in slots], np.int64),
        np.array([CODE[lays[s.role][s.layout].buffers[s.buffer].dtype] for s in slots], np.int64))
    return table, nodes


@dataclass(frozen=True, eq=False)
class Plan:
    """A complete transfer plan: pure data, independent of any process.

    Build one with :func:`wb.plan`. ``verify()`` checks it against the layouts it was made for;
    ``traffic()`` counts bytes per link; ``for_rank(r)`` is one worker's message indices (a
    rank's part as a value of its own, small enough to send to it, is
    :class:`wb.data.rankplan.RankPlan`); ``save``/``load`` write and read it without pickle.
    """

    trainers: tuple[Layout, ...]  # the layouts it was made for
    rollouts: tuple[Layout, ...]  # and the rollouts'
    cluster: Cluster  # link rates it was balanced for
    chunk_bytes: int  # the largest piece, bytes
    corr: Correspondence  # the cells of ids every piece cuts
    pieces: Pieces  # sub-rectangles of cells, one per moved chunk
    transfers: Transfers  # each piece moved from one region to another, with its stage
    messages: Messages  # transfers grouped into sends between two ranks

    # --- derived views -------------------------------------------------------------------------
    @property
    def slots(self) -> tuple[Slot, ...]:
        return self.corr.slots

    @functools.cached_property
    def table(self) -> tuple[_SlotTable, list[str]]:
        """Per-slot arrays and node names (computed once: a plan never changes)."""
        return slot_table(self.corr.slots, self.trainers, self.rollouts)

    def traffic(self) -> Traffic:
        """Bytes moved over each kind of link (local copies on one GPU count nowhere)."""
        tab, nodes = self.table
        t = self.transfers
        b = self.pieces.nbytes[t.piece]
        sg, dg = tab.gpu[t.src_slot], tab.gpu[t.dst_slot]
        sn, dn = tab.node[t.src_slot], tab.node[t.dst_slot]
        moved = sg != dg
        from_trainer = (tab.role[t.src_slot] == 0) & moved
        trainer_out: dict[int, int] = {int(lay.worker.rank): 0 for lay in self.trainers}
        ranks = tab.rank[t.src_slot][from_trainer]
        for r, v in zip(*_sum_by(ranks, b[from_trainer])):
            trainer_out[int(r)] = int(v)
        cross = sn != dn
        node_in = {nodes[i]: int(v) for i, v in zip(*_sum_by(dn[cross], b[cross]))}
        node_out = {nodes[i]: int(v) for i, v in zip(*_sum_by(sn[cross], b[cross]))}
        intra = moved & ~cross
        intra_node = {nodes[i]: int(v) for i, v in zip(*_sum_by(dn[intra], b[intra]))}
        return Traffic(trainer_out, node_in, node_out, intra_node)

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash of everything that decides which bytes go where (hex sha256; peers compare it
        before any byte moves). Computed once: a plan never changes."""
        return _fingerprint(self)

    @functools.cached_property
    def schedule(self) -> np.ndarray:
        """``(messages,) float64``: when each message should move (:func:`schedule`), computed
        once for every rank that takes its part of this plan."""
        return schedule(self.messages)

    @functools.cached_property
    def _by_rank(self) -> dict[int, Layout]:
        return {lay.worker.rank: lay for lay in (*self.trainers, *self.rollouts)}

    @property
    def ranks(self) -> list[int]:
        """Every worker's rank, sorted."""
        return sorted(self._by_rank)

    def layout_of(self, rank: int) -> Layout:
        """The layout of worker ``rank``.

        Raises:
            PlanError: ``rank`` is not a worker of this plan (names the plan's ranks).

        Examples:
            >>> import numpy as np, wb
            >>> sm = wb.SourceMap.from_indices(np.arange(4))
            >>> lay = lambda r, role: wb.Layout(wb.Worker(r, "n", role), {"w": wb.BufferSpec(sm, "float32")})
            >>> wb.plan([lay(0, "trainer")], [lay(1, "rollout")]).layout_of(1).worker.role
            <Role.ROLLOUT: 'rollout'>
        """
        lay = self._by_rank.get(int(rank))
        if lay is None:
            raise PlanError(f"rank {rank} has no layout in this plan (ranks {self.ranks})")
        return lay

    def for_rank(self, rank: int) -> WorkerPlan:
        """The messages ``rank`` sends and receives, in plan order, with their transfers."""
        m = self.messages
        sends = np.flatnonzero(m.src_rank == rank)
        recvs = np.flatnonzero(m.dst_rank == rank)
        return WorkerPlan(rank, sends, recvs, self)

    def summary(self) -> dict:
        """Counts and bytes: for printing."""
        st = self.transfers.stage
        b = self.pieces.nbytes[self.transfers.piece]
        return {"cells": int(self.corr.cell_id0.size), "pieces": int(self.pieces.cell.size),
                "transfers": int(st.size), "messages": int(self.messages.stage.size),
                "bytes_by_stage": {int(s): int(b[st == s].sum()) for s in (1, 2, 3)}}

    # --- checks --------------------------------------------------------------------------------
    def verify(self) -> None:
        """Checks the plan element-exactly against the layouts, on blocks.

        Every needed element must be delivered exactly once, from a buffer that holds that very
        id (a trainer's, or a rollout's that received it earlier in the plan), into the region
        that needs it; stages must match where source and destination are; no piece may enter a
        node from outside twice; messages must agree with their transfers.

        Raises:
            PlanError: saying what is wrong and where (first offending transfer).
        """
        fresh = correspond(self.trainers, self.rollouts)
        if not all(np.array_equal(a, b) for a, b in zip(fresh[2:], self.corr[2:])):
            raise PlanError("the plan was made for other layouts: its cells differ from the "
                            "layouts' correspondence; plan again for these layouts")
        _verify(self)

    # --- serialisation -------------------------------------------------------------------------
    def save(self, path) -> None:
        """Writes the plan as one ``.npz`` (numpy arrays and a small JSON header; no pickle).

        Its layouts and slots are columns of arrays too (:func:`wb.data.layout.layouts_to_arrays`),
        so saving and loading take time in proportion to the arrays, not to the buffers.

        Args:
            path: a file name or a writable binary file object.
        """
        arrays: dict[str, np.ndarray] = {}
        for group, nt in (("corr", self.corr), ("pieces", self.pieces),
                          ("transfers", self.transfers), ("messages", self.messages)):
            for k, v in nt._asdict().items():
                if isinstance(v, np.ndarray):
                    arrays[f"{group}.{k}"] = v
        lay_header, lay_arrays = layouts_to_arrays((*self.trainers, *self.rollouts))
        arrays.update({f"layouts.{k}": v for k, v in lay_arrays.items()})
        slots = self.corr.slots
        names: dict[str, int] = {}
        arrays["slots.role"] = np.array([s.role == Role.ROLLOUT for s in slots], np.int8)
        arrays["slots.layout"] = np.array([s.layout for s in slots], np.int64)
        arrays["slots.rank"] = np.array([s.rank for s in slots], np.int64)
        arrays["slots.buffer"] = np.array([names.setdefault(s.buffer, len(names)) for s in slots],
                                          np.int64)
        header = {"version": PLAN_FORMAT, "chunk_bytes": self.chunk_bytes,
                  "cluster": {"nic_gbps": self.cluster.nic_gbps,
                              "nvlink_GBps": self.cluster.nvlink_GBps,
                              "nodes": dict(self.cluster.nodes)},
                  "layouts": lay_header, "slot_buffers": list(names)}
        arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
        np.savez(path, **arrays)

    @classmethod
    def load(cls, path) -> Plan:
        """Reads a plan written by :meth:`save` (``allow_pickle=False``).

        Args:
            path: a file name or a readable binary file object.

        Raises:
            PlanError: a plan saved by an older ``wb`` (format 1 or 2): make it again with
                :func:`wb.plan` and save it (plans are cheap to re-make).
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
        return cls(trainers, rollouts,
                   Cluster(c["nic_gbps"], c["nvlink_GBps"], c["nodes"]), header["chunk_bytes"],
                   corr, group(Pieces, "pieces"), group(Transfers, "transfers"),
                   group(Messages, "messages"))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        same = (self.chunk_bytes == other.chunk_bytes and self.cluster == other.cluster
                and self.corr.slots == other.corr.slots
                and [lay.worker for lay in self.trainers + self.rollouts]
                == [lay.worker for lay in other.trainers + other.rollouts])
        if not same:
            return False
        for a, b in ((self.corr, other.corr), (self.pieces, other.pieces),
                     (self.transfers, other.transfers), (self.messages, other.messages)):
            for x, y in zip(a, b):
                if isinstance(x, np.ndarray) and not np.array_equal(x, y):
                    return False
        return True

    __hash__ = None  # type: ignore[assignment]

    def replace(self, **changes) -> Plan:
        """A copy with fields replaced (for tests that corrupt plans on purpose)."""
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:
        s = self.summary()
        return (f"Plan({len(self.trainers)} trainers -> {len(self.rollouts)} rollouts, "
                f"{s['pieces']:,} pieces, {s['transfers']:,} transfers, {s['messages']:,} messages, "
                f"bytes by stage {s['bytes_by_stage']})")


@dataclass(frozen=True, eq=False)
class WorkerPlan:
    """One rank's view: the indices of the messages it sends and receives, in plan order."""

    rank: int
    sends: np.ndarray  # (k,) int64 message indices
    recvs: np.ndarray  # (k,) int64 message indices
    plan: Plan

    def transfers_of(self, message: int) -> np.ndarray:
        m = self.plan.messages
        return np.arange(m.first[message], m.first[message] + m.count[message])


def _sum_by(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if keys.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    u, inv = np.unique(keys, return_inverse=True)
    return u, np.bincount(inv, weights=values, minlength=u.size).astype(np.int64)


def _fail(what: str, t: int | None = None, plan: Plan | None = None) -> PlanError:
    if t is None or plan is None:
        return PlanError(what)
    tr = plan.transfers
    s, d = plan.slots[tr.src_slot[t]], plan.slots[tr.dst_slot[t]]
    return PlanError(f"{what}: transfer {t} (stage {int(tr.stage[t])}, piece {int(tr.piece[t])}, "
                     f"rank {s.rank} `{s.buffer}` -> rank {d.rank} `{d.buffer}`)")


def _verify(plan: Plan) -> None:
    corr, P, T, M = plan.corr, plan.pieces, plan.transfers, plan.messages
    tab, _ = plan.table
    n_t = T.piece.size
    # Pieces tile their cells exactly: in bounds, and areas add up to each needed cell's area.
    ca, cb = corr.cell_na[P.cell], corr.cell_nb[P.cell]
    if ((P.i0 < 0) | (P.j0 < 0) | (P.na < 1) | (P.nb < 1) | (P.i0 + P.na > ca)
            | (P.j0 + P.nb > cb)).any():
        raise _fail("a piece lies outside its cell")
    if (P.dtype != corr.cell_dtype[P.cell]).any() or (P.nbytes != P.na * P.nb * ITEMSIZE[P.dtype]).any():
        raise _fail("a piece does not travel in its cell's dtype, or its size is not its area "
                    "times that dtype's")
    area = np.bincount(P.cell, weights=P.na * P.nb, minlength=corr.cell_id0.size)
    needed_cells = np.unique(corr.inc_cell[tab.role[corr.inc_slot] == 1])
    if not np.array_equal(area[needed_cells], corr.cell_numel[needed_cells]):
        raise _fail("pieces do not tile the cells they cut")
    order = np.lexsort((P.j0, P.i0, P.cell))
    c, i0, j0, na, nb = P.cell[order], P.i0[order], P.j0[order], P.na[order], P.nb[order]
    same = c[1:] == c[:-1]
    nxt_row = same & (i0[1:] != i0[:-1])
    same_row = same & ~nxt_row
    if ((same_row & ((j0[1:] != j0[:-1] + nb[:-1]) | (na[1:] != na[:-1])))
            | (nxt_row & ((i0[1:] != i0[:-1] + na[:-1]) | (j0[1:] != 0)))).any():
        raise _fail("pieces of a cell overlap or leave gaps")
    # Every transfer's regions are incidences of its piece's cell, offset to the piece.
    n_inc = corr.inc_cell.size
    cell_t = P.cell[T.piece]
    for side, inc, slot, f0, fa, fb in (
            ("source", T.src_inc, T.src_slot, T.src_f0, T.src_fa, T.src_fb),
            ("destination", T.dst_inc, T.dst_slot, T.dst_f0, T.dst_fa, T.dst_fb)):
        k = np.clip(inc, 0, max(n_inc - 1, 0))
        ok = (inc >= 0) & (inc < n_inc)
        if n_inc:
            ok &= (corr.inc_cell[k] == cell_t) & (corr.inc_slot[k] == slot)
        if not ok.all():
            t = int(np.flatnonzero(~ok)[0])
            raise _fail(f"the {side} buffer does not hold/need these ids", t, plan)
        want = corr.inc_f0[k] + P.i0[T.piece] * corr.inc_fa[k] + P.j0[T.piece] * corr.inc_fb[k]
        bad = (f0 != want) | (fa != corr.inc_fa[k]) | (fb != corr.inc_fb[k])
        if bad.any():
            raise _fail(f"the {side} region is not where the buffer keeps these ids",
                        int(np.flatnonzero(bad)[0]), plan)
    src_role, dst_role = tab.role[T.src_slot], tab.role[T.dst_slot]
    wire = P.dtype[T.piece].astype(np.int64)
    for side, slot in (("source", T.src_slot), ("destination", T.dst_slot)):
        dt = tab.dtype[slot]
        for k in np.unique(dt * len(CODES) + wire, return_index=True)[1]:  # each pair once
            if not castable(CODES[dt[k]], CODES[wire[k]]):
                raise _fail(f"the {side} is {CODES[dt[k]]}, which wb does not convert to "
                            f"{CODES[wire[k]]}", int(k), plan)
    if (dst_role != 1).any():
        raise _fail("a transfer writes into a trainer buffer", int(np.argmax(dst_role != 1)), plan)
    # Sources: a trainer directly, or a rollout buffer an earlier transfer filled with this piece.
    from_trainer = src_role == 0
    bad = from_trainer & ((T.after != -1) | (T.stage != 1))
    if bad.any():
        raise _fail("a send from a trainer must be stage 1 and wait for nothing",
                    int(np.argmax(bad)), plan)
    fwd = np.flatnonzero(~from_trainer)
    a = T.after[fwd]
    if ((a < 0) | (a >= np.arange(n_t)[fwd])).any():
        t = int(fwd[np.argmax((a < 0) | (a >= fwd))])
        raise _fail("a forward comes before the transfer that brings it its piece "
                    "(stage order violated)", t, plan)
    bad = (T.piece[a] != T.piece[fwd]) | (T.dst_inc[a] != T.src_inc[fwd])
    if bad.any():
        raise _fail("a forward's source never received its piece", int(fwd[np.argmax(bad)]), plan)
    # Stages match where the bytes go.
    sn, dn = tab.node[T.src_slot], tab.node[T.dst_slot]
    bad = ((T.stage == 2) & (from_trainer | (sn == dn))) | ((T.stage == 3) & (from_trainer | (sn != dn)))
    if bad.any():
        raise _fail("stage 2 must cross rollout nodes and stage 3 stay inside one",
                    int(np.argmax(bad)), plan)
    # Every needed (piece, buffer) is delivered exactly once, and nothing else is.
    need = tab.role[corr.inc_slot] == 1
    n_pieces_of_cell = np.bincount(P.cell, minlength=corr.cell_id0.size)
    first_piece = np.r_[0, np.cumsum(n_pieces_of_cell)[:-1]]
    piece_order = np.argsort(P.cell, kind="stable")
    need_inc = np.flatnonzero(need)
    inc_c = corr.inc_cell[need_inc]
    cnt = n_pieces_of_cell[inc_c]
    rep = np.repeat(np.arange(inc_c.size), cnt)
    k = first_piece[inc_c][rep] + (np.arange(rep.size) - np.repeat(np.cumsum(cnt) - cnt, cnt))
    required = np.sort(piece_order[k] * n_inc + need_inc[rep])
    delivered = T.piece * n_inc + T.dst_inc
    d_sorted = np.sort(delivered)
    dup = d_sorted[1:] == d_sorted[:-1]
    if dup.any():
        key = d_sorted[1:][dup][0]
        t = int(np.flatnonzero(delivered == key)[1])
        raise _fail("a piece is delivered twice to the same buffer region (duplicated send)", t,
                    plan)
    if not np.array_equal(required, d_sorted):
        missing = np.setdiff1d(required, d_sorted)
        if missing.size:
            p, i = divmod(int(missing[0]), n_inc)
            sl = corr.slots[corr.inc_slot[i]]
            raise _fail(f"needed ids are never delivered: piece {p} (first id "
                        f"{int(corr.cell_id0[P.cell[p]] + P.i0[p] * corr.cell_S[P.cell[p]] + P.j0[p])}"
                        f") for rank {sl.rank} buffer `{sl.buffer}` (a dropped chunk?)")
        extra = np.setdiff1d(d_sorted, required)
        t = int(np.flatnonzero(delivered == extra[0])[0])
        raise _fail("a transfer delivers ids its destination does not need", t, plan)
    # No piece enters a node from outside twice.
    cross = np.flatnonzero(sn != dn)
    key = T.piece[cross] * (int(dn.max(initial=0)) + 1) + dn[cross]
    ks = np.sort(key)
    if (ks[1:] == ks[:-1]).any():
        dupk = ks[1:][ks[1:] == ks[:-1]][0]
        raise _fail("a piece enters a node from outside twice",
                    int(cross[np.flatnonzero(key == dupk)[1]]), plan)
    # Messages agree with their transfers.
    if M.stage.size:
        idx = np.repeat(np.arange(M.stage.size), M.count)
        if (idx.size != n_t or not np.array_equal(T.message, idx)
                or not np.array_equal(M.first, np.r_[0, np.cumsum(M.count)[:-1]])):
            raise _fail("messages do not partition the transfers in order")
        bad = ((M.stage[T.message] != T.stage) | (M.src_rank[T.message] != tab.rank[T.src_slot])
               | (M.dst_rank[T.message] != tab.rank[T.dst_slot]))
        if bad.any():
            raise _fail("a transfer travels in a message between other ranks",
                        int(np.argmax(bad)), plan)
        f = np.flatnonzero(~from_trainer)
        bad = M.parent[T.message[f]] != T.message[T.after[f]]
        if bad.any():
            raise _fail("a forwarded message does not wait for the message that brings its data",
                        int(f[np.argmax(bad)]), plan)
    elif n_t:
        raise _fail("transfers without messages")


def run_local(plan: Plan, trainer_buffers: Mapping[int, Mapping[str, np.ndarray]],
              rollout_buffers: Mapping[int, Mapping[str, np.ndarray]]
              ) -> dict[int, dict[str, np.ndarray]]:
    """Executes a plan in this process with numpy: fills the rollout buffers (in place).

    Args:
        plan: the plan.
        trainer_buffers: ``{trainer rank: {buffer name: array}}`` holding the weights.
        rollout_buffers: ``{rollout rank: {buffer name: array}}`` to fill (written in place; any
            contiguous arrays of the layouts' shapes and dtypes). Where the plan converts an
            element (a rollout needs it in another dtype than the trainers hold it), it is
            converted as the executor does (:func:`wb.data.dtypes.convert`).

    Returns:
        ``rollout_buffers`` (as dicts), filled.

    Raises:
        PlanError: a buffer is missing or has the wrong shape.
    """
    bufs: dict[int, np.ndarray] = {}
    for si, s in enumerate(plan.slots):
        lays = plan.trainers if s.role == Role.TRAINER else plan.rollouts
        src = trainer_buffers if s.role == Role.TRAINER else rollout_buffers
        spec = lays[s.layout].buffers[s.buffer]
        try:
            arr = src[s.rank][s.buffer]
        except KeyError:
            raise PlanError(f"run_local needs buffer `{s.buffer}` of {s.role.value} rank "
                            f"{s.rank}") from None
        arr = np.asarray(arr)
        if arr.shape != spec.shape:
            raise PlanError(f"{s.role.value} rank {s.rank} buffer `{s.buffer}` has shape "
                            f"{arr.shape}, the layout says {spec.shape}")
        if s.role == Role.ROLLOUT and not arr.flags.c_contiguous:
            raise PlanError(f"rollout rank {s.rank} buffer `{s.buffer}` must be C-contiguous")
        bufs[si] = arr.reshape(-1)
    P, T = plan.pieces, plan.transfers
    tab, _ = plan.table
    for t in range(T.piece.size):
        p = T.piece[t]
        i = np.arange(P.na[p])[:, None]
        j = np.arange(P.nb[p])[None, :]
        src = bufs[T.src_slot[t]][T.src_f0[t] + i * T.src_fa[t] + j * T.src_fb[t]]
        dst = bufs[T.dst_slot[t]]
        # as the executor does: converted to the dtype the piece travels in, then to the need's
        # (where the layouts' dtypes differ from it)
        if tab.dtype[T.src_slot[t]] != P.dtype[p]:
            wire = np.empty(src.shape, dtype_info(CODES[P.dtype[p]]).numpy)
            convert(wire, src)
            src = wire
        if tab.dtype[T.dst_slot[t]] != P.dtype[p]:
            out = np.empty(src.shape, dst.dtype)
            convert(out, src)
            src = out
        dst[T.dst_f0[t] + i * T.dst_fa[t] + j * T.dst_fb[t]] = src
    return {int(r): dict(b) for r, b in rollout_buffers.items()}


def _fingerprint(plan: Plan) -> str:
    """A hash of everything in ``plan`` that decides which bytes go where (hex sha256)."""
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


def schedule(M: Messages) -> np.ndarray:
    """When each message should move, as a fraction of its trainer's stream (0 first, 1 last).

    A trainer sends to many rollout GPUs; sending all of one destination's messages before the
    next (plan order) would feed one GPU at a time, and the GPUs fed last could only start their
    forwards at the very end. Instead a trainer interleaves its destinations: its k-th message
    to a GPU goes when that pair's stream is as far along as all its others, so every rollout
    GPU receives (and forwards) at a steady rate from the start. A forwarded message inherits
    the time of the stage-1 message it descends from (a hop later). Receivers post staged
    receives in the same order.

    Args:
        M: ``plan.messages``.

    Returns:
        ``(messages,) float64``: each message's time.
    """
    n = M.nbytes.size
    when = np.zeros(n, np.float64)
    root = M.parent < 0
    r = np.flatnonzero(root)
    if r.size:
        pair = M.src_rank[r].astype(np.int64) * (int(M.dst_rank.max()) + 1) + M.dst_rank[r]
        o = np.lexsort((r, pair))  # by pair, then plan order within the pair
        rs, ps, nb = r[o], pair[o], M.nbytes[r[o]].astype(np.float64)
        starts = np.r_[True, ps[1:] != ps[:-1]]
        grp = np.cumsum(starts) - 1
        tot = np.bincount(grp, weights=nb)
        before = np.cumsum(nb) - nb
        first = before[starts][grp]
        when[rs] = (before - first) / np.maximum(tot[grp], 1.0)
    # forwards: their root's time, plus a little per hop (parents have lower ids than children)
    child = np.flatnonzero(~root)
    for _ in range(64):
        if not child.size:
            break
        new = when[M.parent[child]] + 1e-6
        if np.array_equal(new, when[child]):
            break
        when[child] = new
    return when
