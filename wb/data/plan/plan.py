"""Plan: who sends which bytes to whom, in which order; pure data, independent of any process.

The arrays it is made of are in :mod:`wb.data.plan.arrays`, its check in
:mod:`wb.data.plan.verify`, its file format in :mod:`wb.data.plan.files`, its reference executor
in :mod:`wb.data.plan.reference` and each rank's part in :mod:`wb.data.plan.part`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from wb.data.correspondence import Correspondence, Slot, correspond
from wb.data.layout import Cluster, Layout
from wb.data.plan.arrays import (Messages, Pieces, SlotTable, Traffic, Transfers, slot_table,
                                 sum_by)
from wb.data.plan.files import plan_fingerprint, read_plan, save_plan
from wb.data.plan.schedule import hops, schedule
from wb.data.plan.verify import verify_plan
from wb.errors import PlanError

__all__ = ["Plan", "need_plan", "SMALL_RUN_BYTES"]

#: Contiguous ranges smaller than this travel packed with others of their pair of ranks, not each
#: in a message of its own (a plan's :attr:`Plan.pack_below` unless the planner was told
#: otherwise): a message costs tens of microseconds, more than such a range's bytes.
SMALL_RUN_BYTES = 1 << 20


def need_plan(plan, who: str) -> None:
    """Raises :class:`wb.PlanError` naming ``who`` unless ``plan`` is a :class:`Plan`."""
    if not isinstance(plan, Plan):
        raise PlanError(f"{who} takes a wb.Plan (from wb.plan or wb.Plan.load), got "
                        f"{type(plan).__name__}")


@dataclass(frozen=True, eq=False)
class Plan:
    """A complete transfer plan: pure data, independent of any process.

    Build one with :func:`wb.plan`. ``verify()`` checks it against the layouts it was made for;
    ``traffic()`` counts bytes per link; ``save``/``load`` write and read it without pickle. A
    rank runs its part of it (:class:`wb.RankPlan`, :func:`wb.data.plan.part.parts`), cut out
    once where the plan is made.
    """

    trainers: tuple[Layout, ...]  # the layouts it was made for
    rollouts: tuple[Layout, ...]  # and the rollouts'
    cluster: Cluster  # link rates it was balanced for
    chunk_bytes: int  # the largest piece, bytes
    corr: Correspondence  # the cells of ids every piece cuts
    pieces: Pieces  # sub-rectangles of cells, one per moved chunk
    transfers: Transfers  # each piece moved from one region to another, with its stage
    messages: Messages  # transfers grouped into sends between two ranks
    pack_below: int = SMALL_RUN_BYTES  # bytes: contiguous ranges below it travel packed

    # --- derived views -------------------------------------------------------------------------
    @property
    def slots(self) -> tuple[Slot, ...]:
        return self.corr.slots

    @functools.cached_property
    def table(self) -> tuple[SlotTable, list[str]]:
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
        for r, v in zip(*sum_by(ranks, b[from_trainer])):
            trainer_out[int(r)] = int(v)
        cross = sn != dn
        node_in = {nodes[i]: int(v) for i, v in zip(*sum_by(dn[cross], b[cross]))}
        node_out = {nodes[i]: int(v) for i, v in zip(*sum_by(sn[cross], b[cross]))}
        intra = moved & ~cross
        intra_node = {nodes[i]: int(v) for i, v in zip(*sum_by(dn[intra], b[intra]))}
        return Traffic(trainer_out, node_in, node_out, intra_node)

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash of everything that decides which bytes go where (hex sha256; peers compare it
        before any byte moves). Computed once: a plan never changes."""
        return plan_fingerprint(self)

    @functools.cached_property
    def schedule(self) -> np.ndarray:
        """``(messages,) float64``: when each message should move (:func:`schedule`), computed
        once for every rank that takes its part of this plan."""
        return schedule(self.messages)

    @functools.cached_property
    def hops(self) -> np.ndarray:
        """``(messages,) int64``: each message's forwards from its trainer (:func:`hops`)."""
        return hops(self.messages)

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
        verify_plan(self)

    # --- serialisation -------------------------------------------------------------------------
    def save(self, path) -> None:
        """Writes the plan as one file: an ``.npz`` (numpy arrays and a small JSON header; no
        pickle) sealed with a digest of the whole (:mod:`wb.data.sealed`).

        Its layouts and slots are columns of arrays too (:func:`wb.data.layout.layouts_to_arrays`),
        so saving and loading take time in proportion to the arrays, not to the buffers.

        Args:
            path: a file name (``.npz`` is added if it has none) or a writable binary file
                object.
        """
        save_plan(self, path)

    @classmethod
    def load(cls, path) -> Plan:
        """Reads a plan written by :meth:`save` (``allow_pickle=False``), once the file's digest
        matches.

        Args:
            path: a file name (as given to :meth:`save`) or a readable binary file object.

        Raises:
            PlanError: the file changed since it was saved (a flipped bit, cut short), or was
                saved by another ``wb``: make it again with :func:`wb.plan` and save it (plans
                are cheap to re-make). The message names the file.
            FileNotFoundError: there is no such file.
        """
        fields = read_plan(path)
        try:
            return cls(**fields)
        except (TypeError, ValueError, IndexError, KeyError) as e:
            raise PlanError(f"the plan file `{path}` holds no plan this wb can run "
                            f"({type(e).__name__}: {e}); make the plan again and save it") from e

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        same = (self.chunk_bytes == other.chunk_bytes and self.cluster == other.cluster
                and self.pack_below == other.pack_below
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
