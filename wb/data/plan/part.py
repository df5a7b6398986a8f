"""One rank's part of a plan as a value of its own: :class:`RankPlan` (pure data).

A rank runs only the messages it sends, receives or copies; everything it needs of them (their
transfers and pieces, the buffers they touch, when each should go) is cut out of the whole plan
once, where the plan is made, and travels to the rank as a few kilobytes to megabytes instead of
the whole plan. Message indices stay those of the whole plan (they are the tags every rank uses),
and the part carries the whole plan's fingerprint, so peers running different plans are still
refused. Saved and loaded as bytes of its own: a JSON index and the arrays' raw bytes, deflated
together (no pickle), sealed with a digest of the whole (:mod:`wb.data.sealed`) that is checked
before anything of it is decoded.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from wb.data.layout import Layout, Role, layouts_from_arrays, layouts_to_arrays
from wb.data.plan.arrays import Messages, Pieces, Transfers
from wb.data.plan.plan import Plan, need_plan
from wb.data.sealed import DECODE_ERRORS, seal, unseal
from wb.errors import PlanError, WbError

__all__ = ["RankPlan", "parts", "part_of", "RANK_PLAN_FORMAT"]

#: Format of :meth:`RankPlan.to_bytes`: one deflated stream of a JSON index and the raw arrays
#: (pieces with the dtype they travel in), sealed.
RANK_PLAN_FORMAT = 6
_KIND = "rank part"
_AGAIN = "make the plan again with this wb (wb.agree_parts)"
_NUMERIC = "biuf"  # dtype kinds a part holds (bool, int, unsigned, float): nothing else is read


def _pack(header: dict, arrays: Mapping[str, np.ndarray]) -> bytes:
    """``header`` and ``arrays`` as one JSON index and the arrays' raw bytes after it, deflated
    together at level 1. An ``.npz`` costs a zip member per array, about 50 per part: most of a
    small part's time to write and read (a repair's parts are written while survivors wait).

    The index is inside the deflated stream: it holds the part's ``slot_buffer`` names and its
    layout's header, about a third of a Kimi-K2 part's bytes when left raw (52 of 152 MB for the
    512 parts) and a tenth of that deflated."""
    index, blobs, at = [], [], 0
    for k, v in arrays.items():
        v = np.ascontiguousarray(v)
        index.append([k, v.dtype.str, list(v.shape), at])
        blobs.append(v)
        at += v.nbytes
    head = json.dumps({"header": header, "arrays": index}).encode()
    head += b" " * (-(8 + len(head)) % 8)  # the arrays start 8-byte aligned (JSON ignores spaces)
    z = zlib.compressobj(1)
    out = [z.compress(len(head).to_bytes(8, "little")), z.compress(head)]
    out += [z.compress(memoryview(v).cast("B")) for v in blobs if v.nbytes]
    out.append(z.flush())
    return seal(_KIND, b"".join(out))


def _unpack(data, where: str) -> tuple[dict, dict[str, np.ndarray]]:
    """What :func:`_pack` wrote: ``(header, arrays)``, once the seal's digest matches."""
    payload = unseal(_KIND, data, where=where, error=PlanError, remedy=_AGAIN)
    raw = zlib.decompress(payload)
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8:8 + n].decode())
    start = 8 + n
    arrays = {}
    for k, dt, shape, at in head["arrays"]:
        dtype = np.dtype(dt)
        if dtype.kind not in _NUMERIC:
            raise PlanError(f"{where} has array `{k}` of dtype {dt}: not one wb writes; {_AGAIN}")
        count = int(np.prod(shape, dtype=np.int64))
        arrays[k] = np.frombuffer(raw, dtype, count, start + at).reshape(shape)
    return head["header"], arrays


@dataclass(frozen=True, eq=False)
class RankPlan:
    """The part of a plan one rank runs: its messages with their transfers and pieces.

    Make one with :meth:`of` (or every rank's with :func:`parts`); save it with :meth:`to_bytes`.
    Transfers and pieces are renumbered within the part (``messages.first`` and
    ``transfers.piece`` index the part's own arrays, ``transfers.src_slot``/``dst_slot`` index
    :attr:`slot_rank`/:attr:`slot_buffer`); ``transfers.after``, ``src_inc`` and ``dst_inc`` keep
    the whole plan's numbers. :attr:`index` keeps each message's index in the whole plan (its
    tag).

    Examples:
        >>> import numpy as np, wb
        >>> sm = wb.SourceMap.from_indices(np.arange(8))
        >>> t = wb.Layout(wb.Worker(0, "n", "trainer"), {"w": wb.BufferSpec(sm, "float32")})
        >>> r = wb.Layout(wb.Worker(1, "n", "rollout"), {"w": wb.BufferSpec(sm, "float32")})
        >>> part = RankPlan.of(wb.plan([t], [r]), 1)
        >>> part.peers, RankPlan.from_bytes(part.to_bytes()) == part
        ((0,), True)
    """

    rank: int  # whose part
    fingerprint: str  # of the whole plan (hex sha256): peers must show the same
    layout: Layout  # this rank's layout in the plan
    trainers: tuple[int, ...]  # every trainer rank of the plan (announcements)
    index: np.ndarray  # (k,) int64 each message's index in the whole plan (its tag)
    when: np.ndarray  # (k,) float64 schedule (:func:`wb.data.plan.schedule`) of each message
    hops: np.ndarray  # (k,) int64 forwards between each message and its trainer (plan.hops)
    messages: Messages  # (k,) this rank's messages; first/count into `transfers`
    transfers: Transfers  # (t,) their transfers, in message order
    pieces: Pieces  # (p,) the pieces they move
    slot_rank: np.ndarray  # (s,) int64 rank of each slot the transfers touch
    slot_buffer: tuple[str, ...]  # (s,) buffer name of each slot

    @property
    def peers(self) -> tuple[int, ...]:
        """The ranks this rank exchanges messages with (sorted; not itself)."""
        M = self.messages
        both = np.union1d(M.src_rank, M.dst_rank)
        return tuple(int(r) for r in both if r != self.rank)

    @property
    def role(self) -> Role:
        return self.layout.worker.role

    @classmethod
    def of(cls, plan: Plan, rank: int, *, when: np.ndarray | None = None,
           hops: np.ndarray | None = None, fingerprint_: str | None = None,
           messages: np.ndarray | None = None) -> RankPlan:
        """Rank ``rank``'s part of ``plan``.

        Args:
            plan: the whole plan.
            rank: a worker of ``plan``.
            when: the plan's schedule, when already at hand (default :attr:`Plan.schedule`).
            hops: the plan's :attr:`Plan.hops`, likewise.
            fingerprint_: the plan's fingerprint, likewise (:attr:`Plan.fingerprint`).
            messages: ``(k,) int64`` the sorted indices of ``rank``'s messages, when known.

        Raises:
            PlanError: ``plan`` is not a plan, or ``rank`` is not a worker of it.
        """
        need_plan(plan, "RankPlan.of")
        layout = plan.layout_of(rank)
        M, T, P = plan.messages, plan.transfers, plan.pieces
        if messages is None:
            messages = np.flatnonzero((M.src_rank == rank) | (M.dst_rank == rank))
        mi = np.asarray(messages, np.int64)
        when = plan.schedule if when is None else when
        hops = plan.hops if hops is None else hops
        count = M.count[mi]
        starts = np.zeros(mi.size + 1, np.int64)
        np.cumsum(count, out=starts[1:])
        ts = (np.repeat(M.first[mi] - starts[:-1], count) + np.arange(int(starts[-1]))
              if mi.size else np.zeros(0, np.int64))
        sub = Transfers(*(f[ts] for f in T))
        pcs, piece = np.unique(sub.piece, return_inverse=True)
        slots, flat = np.unique(np.r_[sub.src_slot, sub.dst_slot], return_inverse=True)
        flat = flat.reshape(-1)
        tab = plan.table[0]
        sub = sub._replace(piece=piece.reshape(-1).astype(np.int64),
                           src_slot=flat[:ts.size].astype(np.int64),
                           dst_slot=flat[ts.size:].astype(np.int64),
                           message=np.repeat(np.arange(mi.size, dtype=np.int64), count))
        msgs = Messages(M.stage[mi], M.src_rank[mi], M.dst_rank[mi], M.nbytes[mi], M.parent[mi],
                        starts[:-1], count)
        return cls(int(rank), plan.fingerprint if fingerprint_ is None else fingerprint_,
                   layout, tuple(lay.worker.rank for lay in plan.trainers), mi, when[mi],
                   hops[mi], msgs,
                   sub, Pieces(*(f[pcs] for f in P)), tab.rank[slots],
                   tuple(plan.slots[s].buffer for s in slots.tolist()))

    # --- serialisation -------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The part as bytes: a JSON index and its arrays' raw bytes, deflated at level 1 (no
        pickle).

        Deflated: a part's index arrays are regular (one stage, one peer, unit steps per
        message), so this cuts a Kimi-K2 rank's part about 11x, and the bytes through the store
        to about those of the layouts."""
        arrays: dict[str, np.ndarray] = {"index": self.index, "when": self.when,
                                         "hops": self.hops, "slot_rank": self.slot_rank}
        for group, nt in (("messages", self.messages), ("transfers", self.transfers),
                          ("pieces", self.pieces)):
            arrays.update({f"{group}.{k}": v for k, v in nt._asdict().items()})
        lay_header, lay_arrays = layouts_to_arrays([self.layout])
        arrays.update({f"layout.{k}": v for k, v in lay_arrays.items()})
        header = {"format": RANK_PLAN_FORMAT, "rank": self.rank, "fingerprint": self.fingerprint,
                  "trainers": list(self.trainers), "slot_buffer": list(self.slot_buffer),
                  "layout": lay_header}
        return _pack(header, arrays)

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = "a rank's plan") -> RankPlan:
        """The part :meth:`to_bytes` wrote, once its digest matches.

        Args:
            data: the bytes.
            where: where they came from, for errors (e.g. the store key).

        Raises:
            PlanError: bytes changed since they were written (a flipped bit, cut short, longer),
                or of another format (made by another ``wb``): make the plan again.
        """
        try:
            header, a = _unpack(data, where)
            if header.get("format") != RANK_PLAN_FORMAT:
                raise PlanError(f"{where} is of format {header.get('format')}; this wb reads "
                                f"format {RANK_PLAN_FORMAT}: {_AGAIN}")
            layout = layouts_from_arrays(header["layout"], {
                k.split(".", 1)[1]: v for k, v in a.items() if k.startswith("layout.")})[0]

            def group(nt, name):
                return nt(**{f: a[f"{name}.{f}"] for f in nt._fields})
            return cls(int(header["rank"]), str(header["fingerprint"]), layout,
                       tuple(int(t) for t in header["trainers"]), a["index"], a["when"],
                       a["hops"], group(Messages, "messages"), group(Transfers, "transfers"),
                       group(Pieces, "pieces"), a["slot_rank"],
                       tuple(str(b) for b in header["slot_buffer"]))
        except PlanError:
            raise
        except (*DECODE_ERRORS, WbError) as e:  # the right digest on bytes of another layout
            raise PlanError(f"{where} cannot be read ({type(e).__name__}: {e}); {_AGAIN}") from e

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RankPlan):
            return NotImplemented
        if (self.rank, self.fingerprint, self.trainers, self.slot_buffer) != (
                other.rank, other.fingerprint, other.trainers, other.slot_buffer):
            return False
        if self.layout.worker != other.layout.worker or dict(self.layout.buffers) != dict(
                other.layout.buffers):
            return False
        pairs = [(self.index, other.index), (self.when, other.when), (self.hops, other.hops),
                 (self.slot_rank, other.slot_rank)]
        for a, b in ((self.messages, other.messages), (self.transfers, other.transfers),
                     (self.pieces, other.pieces)):
            pairs += list(zip(a, b))
        return all(np.array_equal(x, y) for x, y in pairs)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"RankPlan(rank {self.rank}, {self.index.size:,} messages, "
                f"{self.transfers.piece.size:,} transfers, peers {len(self.peers)}, "
                f"plan {self.fingerprint[:12]})")


def parts(plan: Plan, ranks=None) -> Iterator[RankPlan]:
    """Every rank's part of ``plan`` (or those of ``ranks``), sharing the work they have in common
    (the schedule, the fingerprint, which messages each rank has).

    Args:
        plan: the whole plan.
        ranks: the ranks to cut parts for (default: every worker of ``plan``).

    Yields:
        :class:`RankPlan`, in the order of ``ranks``.
    """
    M = plan.messages
    when, hops, fp = plan.schedule, plan.hops, plan.fingerprint
    ranks = plan.ranks if ranks is None else [int(r) for r in ranks]
    # messages by rank, once: each message belongs to its source and (if other) its destination
    idx = np.arange(M.stage.size, dtype=np.int64)
    other = M.dst_rank != M.src_rank
    owner = np.r_[M.src_rank, M.dst_rank[other]]
    msg = np.r_[idx, idx[other]]
    o = np.lexsort((msg, owner))
    owner, msg = owner[o], msg[o]
    for r in ranks:
        lo, hi = np.searchsorted(owner, [r, r + 1])
        yield RankPlan.of(plan, r, when=when, hops=hops, fingerprint_=fp, messages=msg[lo:hi])


def part_of(plan: Plan | RankPlan | Mapping[int, RankPlan], rank: int) -> RankPlan:
    """Rank ``rank``'s part, from a whole plan (cut out), a part (checked) or ``{rank: part}``
    (looked up): where a whole plan or a process's parts become the one part a worker runs.

    Args:
        plan: the whole plan, ``rank``'s part, or a process's parts (:func:`wb.agree_parts`).
        rank: a worker of the plan.

    Returns:
        The :class:`RankPlan` of ``rank``.

    Raises:
        PlanError: ``rank`` is not a worker of ``plan``, not the part's rank, or has no part
            among those given.
    """
    if isinstance(plan, RankPlan):
        if int(rank) != plan.rank:
            raise PlanError(f"got rank {plan.rank}'s part of the plan for rank {rank}; give rank "
                            f"{rank} its own part (or the whole plan)")
        return plan
    if isinstance(plan, Plan):
        return RankPlan.of(plan, rank)
    if not isinstance(plan, Mapping):
        raise TypeError(f"a plan must be a wb.Plan, a wb.RankPlan or {{rank: RankPlan}}, got a "
                        f"{type(plan).__name__}")
    part = plan.get(int(rank))
    if part is None:
        have = sorted(plan)
        raise PlanError(f"rank {rank} has no part here (the parts given are ranks {have}); "
                        f"give each worker its own rank's part")
    return part
