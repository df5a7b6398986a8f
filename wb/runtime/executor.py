"""Runs one worker's part of a plan: pack, send, receive, unpack, forward.

Each message of the plan is one tagged send from its source rank to its destination rank (tag =
``tag_base + message index``, the same on every rank). A message whose single region is contiguous
in both buffers moves zero-copy (sent from and received into the buffers themselves); others are
packed into contiguous staging on the sender (strided views, no index arrays) and unpacked at the
receiver. A message whose source and destination are the same rank is a local copy. A forwarded
message (stage 2 or 3) leaves as soon as the message that brought its data has landed.

Staging is bounded (``staging_bytes``, split between receives and sends). Receives and packed
sends are issued in plan order, which is topological: the lowest unfinished message of the whole
plan always has its parent done, its receive posted and staging free at its sender, so every plan
makes progress whatever the budget. Zero-copy messages and local copies use no staging and go as
soon as they are ready.

A peer that dies or hangs stops completions: after ``timeout`` seconds without any progress the
worker raises :class:`wb.TransferError` naming the peers and plan steps it is still waiting for.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from wb.data.dtypes import canonical_dtype
from wb.errors import TransferError
from wb.data.layout import Layout
from wb.data.plan import Plan

__all__ = ["DEFAULT_STAGING_BYTES", "ExecStats", "connect", "execute", "plan_fingerprint",
           "plan_peers"]

log = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 256 << 20


@dataclass(frozen=True)
class ExecStats:
    """What one worker did: bytes and messages each way, seconds, staging high-water mark."""

    rank: int
    bytes_sent: int
    bytes_received: int
    bytes_local: int
    messages_sent: int
    messages_received: int
    start_s: float  # time.time() when the first byte could move (after connecting)
    end_s: float  # time.time() when the worker's last message completed
    staging_peak: int

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


def plan_fingerprint(plan: Plan) -> str:
    """A hash of everything that decides which bytes go where (hex sha256)."""
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


def _layout_of(plan: Plan, rank: int) -> Layout:
    for lay in (*plan.trainers, *plan.rollouts):
        if lay.worker.rank == rank:
            return lay
    raise TransferError(f"rank {rank} has no layout in this plan (ranks "
                        f"{sorted(lay.worker.rank for lay in (*plan.trainers, *plan.rollouts))})")


def _as_array(name: str, buf: Any, rank: int):
    """(array module, array) of a numpy / DLPack / CUDA array, without copying."""
    if hasattr(buf, "__cuda_array_interface__"):
        try:
            import cupy
        except ImportError as e:
            raise TransferError(f"rank {rank}: buffer `{name}` is a CUDA array; packing on the "
                                f"device needs CuPy (pip install cupy-cuda12x / cupy-cuda13x)") from e
        if isinstance(buf, cupy.ndarray):
            return cupy, buf  # never cupy.asarray: it copies to the thread's current device
        # another framework's CUDA array: view it from its own device (same reason)
        ptr = int(buf.__cuda_array_interface__["data"][0])
        dev = cupy.cuda.runtime.pointerGetAttributes(ptr).device if ptr else None
        if dev is None or dev < 0:
            return cupy, cupy.asarray(buf)
        with cupy.cuda.Device(dev):
            return cupy, cupy.asarray(buf)
    if isinstance(buf, np.ndarray):
        return np, buf
    try:
        return np, np.from_dlpack(buf) if hasattr(buf, "__dlpack__") else np.asarray(buf)
    except (TypeError, BufferError, RuntimeError):
        return np, np.asarray(buf)


def _check_buffers(plan: Plan, rank: int, buffers: Mapping[str, Any], layout: Layout | None):
    mine = _layout_of(plan, rank)
    if layout is not None:
        if set(layout.buffers) != set(mine.buffers) or any(
                layout.buffers[n].sourcemap != b.sourcemap or layout.buffers[n].dtype != b.dtype
                for n, b in mine.buffers.items()):
            raise TransferError(
                f"rank {rank}: the plan was made for different layouts than this worker's "
                f"(buffers or source maps differ); plan again with every worker's current layout")
    flat: dict[str, Any] = {}
    xps = set()
    for name, spec in mine.buffers.items():
        if name not in buffers:
            raise TransferError(f"rank {rank}: buffer `{name}` of the plan was not given "
                                f"(given: {sorted(buffers)[:5]}...)")
        xp, a = _as_array(name, buffers[name], rank)
        if tuple(a.shape) != spec.shape:
            raise TransferError(f"rank {rank}: buffer `{name}` has shape {tuple(a.shape)}, the "
                                f"plan needs {spec.shape}; refusing before any byte moves")
        try:
            dt = canonical_dtype(a.dtype)
        except Exception:  # noqa: BLE001 - an unknown dtype is simply a mismatch
            dt = str(a.dtype)
        if dt != spec.dtype and not _raw_bits_ok(xp, a.dtype, spec.dtype):
            raise TransferError(f"rank {rank}: buffer `{name}` is {dt}, the plan needs "
                                f"{spec.dtype}; refusing before any byte moves")
        if not a.flags.c_contiguous:
            raise TransferError(f"rank {rank}: buffer `{name}` must be C-contiguous")
        flat[name] = a.reshape(-1)
        xps.add(xp)
    return flat, (xps.pop() if len(xps) == 1 else np)


_NO_NATIVE = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def _raw_bits_ok(xp, dtype, want: str) -> bool:
    """CUDA arrays of bf16/fp8 travel as same-width integers (CuPy has no such dtypes, and torch's
    ``__cuda_array_interface__`` refuses them): accept exactly that case, nothing else."""
    from wb.data.dtypes import dtype_info

    return (xp is not np and want in _NO_NATIVE and np.dtype(dtype).kind in "ui"
            and np.dtype(dtype).itemsize == dtype_info(want).itemsize)


def _region(xp, flat, f0, na, nb, fa, fb):
    """A strided (na, nb) view of the flat buffer, element (i, j) at flat[f0 + i*fa + j*fb]."""
    item = flat.itemsize
    # a length-1 axis has no step (the line zone's row step is 2**62: meaningless, and too big)
    strides = (int(fa) * item if na > 1 else 0, int(fb) * item if nb > 1 else 0)
    return xp.lib.stride_tricks.as_strided(flat[f0:], shape=(int(na), int(nb)), strides=strides)


class _Msg:
    __slots__ = ("m", "stage", "peer", "nbytes", "ts", "parent", "zc_src", "zc_dst", "out",
                 "local")

    def __init__(self, m, stage, peer, nbytes, ts, parent, zc_src, zc_dst, out, local):
        self.m, self.stage, self.peer, self.nbytes, self.ts = m, stage, peer, nbytes, ts
        self.parent, self.zc_src, self.zc_dst, self.out, self.local = (parent, zc_src, zc_dst,
                                                                      out, local)

    def label(self) -> str:
        return f"message {self.m} (stage {self.stage}, {self.nbytes:,} bytes, peer {self.peer})"


def _schedule(M) -> np.ndarray:
    """When each message should move, as a fraction of its trainer's stream (0 first, 1 last).

    A trainer sends to many rollout GPUs; sending all of one destination's messages before the
    next (plan order) would feed one GPU at a time, and the GPUs fed last could only start their
    forwards at the very end. Instead a trainer interleaves its destinations: its k-th message
    to a GPU goes when that pair's stream is as far along as all its others, so every rollout
    GPU receives (and forwards) at a steady rate from the start. A forwarded message inherits
    the time of the stage-1 message it descends from (a hop later). Receivers post staged
    receives in the same order."""
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


def _fencer(xp):
    """``fence()`` for the device work queued so far: an object whose ``done`` says it finished,
    or ``None`` when there is nothing to wait for (host buffers: numpy copies are synchronous).

    On CUDA buffers each pack, unpack or local copy records an event, and the executor's loop acts
    on it once ``done`` (a non-blocking query) rather than blocking on a stream synchronisation:
    a GPU time-shared by many processes can keep a kernel waiting, and meanwhile the worker keeps
    posting and completing its other messages."""
    if xp is np:
        return lambda: None

    def fence():
        ev = xp.cuda.Event(block=False, disable_timing=True)
        ev.record()
        return ev
    return fence


class _Inflight:
    """Requests in flight, one FIFO per (peer, direction) in posting order.

    Transfers with one peer mostly complete in the order they were posted, so a poll looks at the
    first few of each FIFO (``full=False``: O(peers), not O(requests), per poll: a rollout can
    have thousands of receives posted) and at all of them when asked (the loop does now and then,
    and when it finds nothing): every completion is seen, a rare late one a few polls later."""

    WINDOW = 8

    def __init__(self):
        self.queues: dict[tuple[int, bool], deque] = {}
        self.n = 0

    def add(self, req, g: _Msg, buf) -> None:
        self.queues.setdefault((g.peer, g.out), deque()).append((req, g, buf))
        self.n += 1

    def __len__(self) -> int:
        return self.n

    def completed(self, *, full: bool) -> list[tuple[Any, _Msg, Any]]:
        out = []
        for q in self.queues.values():
            limit = len(q) if full else min(len(q), self.WINDOW)
            i = 0
            while i < limit:
                if q[i][0].done():
                    out.append(q[i])
                    del q[i]
                    limit -= 1
                else:
                    i += 1
        self.n -= len(out)
        return out

    def first(self, k: int) -> list[tuple[Any, _Msg, Any]]:
        return [x for q in self.queues.values() for x in list(q)[:k]][:k]


def _run_contiguous(ts, slot, f0, fa, fb, na, nb) -> bool:
    """Whether the regions of transfers ``ts`` (in message order) are one contiguous range of one
    buffer: then the message is that range of the buffer itself, no packing."""
    t0 = ts[0]
    if (slot[ts] != slot[t0]).any():
        return False
    n = na * nb
    each = ((nb == 1) | (fb == 1)) & ((na == 1) | (fa == nb))
    if not each.all():
        return False
    return bool((f0[1:] == f0[:-1] + n[:-1]).all()) if ts.size > 1 else True


class _Program:
    """One rank's part of a plan, worked out once and reused by every update (a Sender/Receiver
    runs the same plan many times): its messages, which are zero-copy, the schedule, the forwards
    each message releases. The loop of an update then only posts and completes. Also remembers the
    last buffers it checked: an update with the same array objects skips the check."""

    def __init__(self, plan: Plan, rank: int, when: np.ndarray):
        M, T, P = plan.messages, plan.transfers, plan.pieces
        self.slot_buf = [s.buffer for s in plan.slots]
        self.msgs: dict[int, _Msg] = {}
        self.children: dict[int, list[int]] = {}
        for m in np.flatnonzero((M.src_rank == rank) | (M.dst_rank == rank)).tolist():
            f, c = int(M.first[m]), int(M.count[m])
            ts = np.arange(f, f + c)
            out = int(M.src_rank[m]) == rank
            local = out and int(M.dst_rank[m]) == rank
            na, nb = P.na[T.piece[ts]], P.nb[T.piece[ts]]
            zc_src = _run_contiguous(ts, T.src_slot, T.src_f0[ts], T.src_fa[ts], T.src_fb[ts],
                                     na, nb)
            zc_dst = _run_contiguous(ts, T.dst_slot, T.dst_f0[ts], T.dst_fa[ts], T.dst_fb[ts],
                                     na, nb)
            peer = int(M.dst_rank[m]) if out else int(M.src_rank[m])
            self.msgs[m] = _Msg(m, int(M.stage[m]), peer, int(M.nbytes[m]), ts, int(M.parent[m]),
                                zc_src, zc_dst, out, local)
            if out and M.parent[m] >= 0:
                self.children.setdefault(int(M.parent[m]), []).append(m)
        self.when = when
        order_in = sorted((m for m, g in self.msgs.items() if not g.out),
                          key=lambda m: (when[m], m))  # receives, in schedule order
        self.zc_in = [m for m in order_in if self.msgs[m].zc_dst]
        self.staged_in = [m for m in order_in if not self.msgs[m].zc_dst]
        self.roots = sorted((float(when[m]), m) for m, g in self.msgs.items()
                            if g.out and g.parent < 0)
        self.n_out = sum(g.out for g in self.msgs.values())
        self.checked: tuple | None = None  # (layout, {name: (weakref, (shape, dtype))}, xp)

    def buffers(self, plan: Plan, rank: int, buffers: Mapping[str, Any],
                layout: Layout | None):
        """``_check_buffers``; skipped when given the very same numpy/CuPy arrays as last time,
        with the same shapes and dtypes (their memory cannot have moved; framework tensors, whose
        storage can be swapped, are checked every time). Holds the arrays only weakly."""
        last = self.checked
        if last is not None and last[0] is layout:
            flat = {}
            for n, (ref, shape) in last[1].items():
                a = buffers.get(n)
                if a is None or ref() is not a or (tuple(a.shape), a.dtype) != shape:
                    break
                flat[n] = a.reshape(-1)
            else:
                return flat, last[2]
        flat, xp = _check_buffers(plan, rank, buffers, layout)
        given = {n: buffers[n] for n in flat}
        try:
            refs = {n: (weakref.ref(a), (tuple(a.shape), a.dtype)) for n, a in given.items()
                    if _fixed_memory(a)}
        except TypeError:  # an array type without weak references: check every time
            refs = {}
        self.checked = (layout, refs, xp) if len(refs) == len(given) else None
        return flat, xp


def _fixed_memory(a) -> bool:
    """A numpy or CuPy array: its data cannot move to other memory while the object lives."""
    t = type(a)
    return t is np.ndarray or (t.__name__ == "ndarray" and t.__module__.startswith("cupy"))


# id(plan) -> (weak reference to the plan, {rank: _Program, "when": schedule}); a Plan compares
# by value and is not hashable, so the cache goes by identity and drops a plan's entry with it
_PROGRAMS: dict[int, tuple[weakref.ref, dict]] = {}
_PROGRAMS_LOCK = threading.Lock()


def _program(plan: Plan, rank: int) -> _Program:
    """The cached :class:`_Program` of ``rank`` in ``plan`` (made on first use)."""
    with _PROGRAMS_LOCK:
        key = id(plan)
        entry = _PROGRAMS.get(key)
        if entry is None or entry[0]() is not plan:
            entry = _PROGRAMS[key] = (
                weakref.ref(plan, lambda _, key=key: _PROGRAMS.pop(key, None)), {})
        per_plan = entry[1]
        prog = per_plan.get(rank)
        if prog is None:
            when = per_plan.get("when")
            if when is None:
                when = per_plan["when"] = _schedule(plan.messages)
            prog = per_plan[rank] = _Program(plan, rank, when)
        return prog


class _DeviceBytes:
    """A byte range of a CUDA buffer, as the CUDA array interface: what a transport needs to move
    it, without slicing a CuPy array per message (tens of microseconds each; an update posts
    hundreds per rank). Keeps its buffer alive."""

    __slots__ = ("__cuda_array_interface__", "nbytes", "owner")

    def __init__(self, owner, offset: int, nbytes: int):
        self.owner, self.nbytes = owner, nbytes
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "strides": None,
                                         "data": (owner.data.ptr + offset, False), "version": 3}


def plan_peers(plan: Plan, rank: int) -> list[int]:
    """The ranks ``rank`` exchanges messages with in ``plan``."""
    M = plan.messages
    mine = (M.src_rank == rank) | (M.dst_rank == rank)
    return sorted((set(M.src_rank[mine].tolist()) | set(M.dst_rank[mine].tolist())) - {rank})


def connect(plan: Plan, rank: int, transport) -> list[int]:
    """Connects ``transport`` to ``rank``'s peers in ``plan``: a hello round through the store in
    which every peer must show the same plan (fingerprint), then every endpoint, created while
    each peer is known to be alive (UCX cannot create one to a peer that has died since: with
    error handling off it aborts). Returns the peers. A :class:`wb.Sender`/:class:`wb.Receiver`
    does this once at set-up, then runs updates with ``execute(..., connected=True)``.

    Raises:
        TransferError: a peer runs another plan (refused before any byte moves; the transport is
            aborted).
    """
    peers = plan_peers(plan, rank)
    fp = plan_fingerprint(plan).encode()
    wrong = sorted(p for p, h in transport.connect(peers, hello=fp).items() if h != fp)
    if wrong:
        _abort(transport)
        raise TransferError(f"rank {rank}: peers {wrong} run a different plan (fingerprint "
                            f"mismatch); refusing before sending anything; give every worker the "
                            f"same plan")
    prepare = getattr(transport, "prepare", None)
    if prepare is not None:
        prepare(peers)
    return peers


def execute(plan: Plan, rank: int, buffers: Mapping[str, Any], transport, *,
            layout: Layout | None = None, staging_bytes: int = DEFAULT_STAGING_BYTES,
            timeout: float = 60.0, tag_base: int = 0, close: bool = True,
            connected: bool = False, trace: list | None = None) -> ExecStats:
    """Runs ``rank``'s part of ``plan``: its sends, receives, local copies and forwards.

    Args:
        plan: the plan every worker runs (checked by fingerprint with every peer).
        rank: this worker's rank.
        buffers: ``{buffer name: array}`` of this worker's layout: numpy or DLPack host arrays, or
            CUDA arrays (packing then runs on the device, with CuPy). Filled in place on rollouts.
        transport: a connected-on-demand :class:`wb.runtime.transport.Transport` for this rank.
        layout: this worker's own layout (as it probed it); refused if the plan's differs.
        staging_bytes: bound on packing/unpacking memory in flight (split receive/send).
        timeout: seconds without any progress before raising :class:`wb.TransferError`.
        tag_base: added to every tag (keeps updates of different versions apart).
        close: close the transport (with a barrier) when done.
        connected: ``transport`` is already connected to this rank's peers in ``plan`` and they
            were checked to run this same plan (a :class:`wb.Sender` / :class:`wb.Receiver` does
            that once, at set-up): skip the hello round through the store (one round trip per
            call).
        trace: a list to append one ``(message, stage, peer, outgoing, nbytes, ready, posted,
            done)`` tuple per message of this rank to, times as ``time.time()`` (comparable across
            the processes of one host): ``ready`` when its data was here (a forward: its parent
            landed), ``posted`` when handed to the transport (after packing), ``done`` when it
            completed (a receive: after unpacking). For finding where an update's time goes.

    Returns:
        :class:`ExecStats`.

    Raises:
        TransferError: bad buffers or a plan for other layouts (before any byte moves), a peer
            running another plan (before sending), a failed or stalled transfer (naming the peer
            and plan step).
    """
    prog = _program(plan, rank)
    flat, xp = prog.buffers(plan, rank, buffers, layout)
    if xp is not np and flat:
        # CuPy's current device is per thread: staging and kernels must go to the buffers' own
        # device, whichever thread runs this (a Sender's or Receiver's background thread starts
        # on device 0)
        with next(iter(flat.values())).device:
            return _execute(plan, rank, prog, flat, xp, transport,
                            staging_bytes=staging_bytes, timeout=timeout, tag_base=tag_base,
                            close=close, connected=connected, trace=trace)
    return _execute(plan, rank, prog, flat, xp, transport, staging_bytes=staging_bytes,
                    timeout=timeout, tag_base=tag_base, close=close, connected=connected,
                    trace=trace)


def _execute(plan: Plan, rank: int, prog: _Program, flat: dict, xp, transport, *,
             staging_bytes: int, timeout: float, tag_base: int, close: bool, connected: bool,
             trace: list | None) -> ExecStats:
    T, P = plan.transfers, plan.pieces
    slot_buf, msgs, children, when = prog.slot_buf, prog.msgs, prog.children, prog.when
    if not connected:
        connect(plan, rank, transport)

    def src_view(t):
        p = T.piece[t]
        return _region(xp, flat[slot_buf[T.src_slot[t]]], T.src_f0[t], P.na[p], P.nb[p],
                       T.src_fa[t], T.src_fb[t])

    def dst_view(t):
        p = T.piece[t]
        return _region(xp, flat[slot_buf[T.dst_slot[t]]], T.dst_f0[t], P.na[p], P.nb[p],
                       T.dst_fa[t], T.dst_fb[t])

    def contiguous_bytes(g: _Msg, side):
        """The message as one range of a buffer (zero-copy), as bytes."""
        t = g.ts[0]
        if side == "src":
            a, f0 = flat[slot_buf[T.src_slot[t]]], int(T.src_f0[t])
        else:
            a, f0 = flat[slot_buf[T.dst_slot[t]]], int(T.dst_f0[t])
        if xp is np:
            return a[f0:f0 + g.nbytes // a.itemsize].view(np.uint8)
        return _DeviceBytes(a, f0 * a.itemsize, g.nbytes)

    # UCX reads and writes device memory outside our CUDA stream, so device work must finish
    # before a send is posted or a message counts as landed: see `_fencer`.
    fence = _fencer(xp)

    def pack(msg: _Msg):
        buf = xp.empty(msg.nbytes, dtype=xp.uint8)
        o = 0
        for t in msg.ts:
            v = src_view(t)
            n = v.size * v.itemsize
            buf[o:o + n].view(v.dtype).reshape(v.shape)[...] = v
            o += n
        return buf

    def unpack(msg: _Msg, buf):
        o = 0
        for t in msg.ts:
            v = dst_view(t)
            n = v.size * v.itemsize
            v[...] = buf[o:o + n].view(v.dtype).reshape(v.shape)
            o += n

    marks: dict[int, list] = {}  # trace: message -> [ready, posted, done]

    def mark(m: int, i: int) -> None:
        if trace is not None:
            marks.setdefault(m, [None, None, None])[i] = time.time()

    recv_budget = send_budget = max(staging_bytes // 2, 1)
    staged = {"recv": 0, "send": 0}
    peak = 0
    inflight = _Inflight()
    # zero-copy receives cost no staging: post them all now
    for m in prog.zc_in:
        g = msgs[m]
        inflight.add(transport.recv(g.peer, contiguous_bytes(g, "dst"), tag_base + m), g, None)
        mark(m, 1)
    staged_in = prog.staged_in
    # Sends go out as their data is here (a forward once its parent arrived), in the order of
    # `_schedule`; packed ones within the staging budget.
    ready: list[tuple[float, int]] = list(prog.roots)  # sorted: a heap already
    n_out = prog.n_out
    for _, m in ready:
        mark(m, 0)
    sent_out = 0
    next_in = 0
    stats = dict(sent=0, received=0, local=0, msent=0, mrecv=0)
    start = time.time()
    last = time.monotonic()
    idle = 0  # polls without progress: yield at first, then back off (2-core hosts, many ranks)
    polls = 0

    done: set[int] = set()
    fenced: list[tuple[Any, str, _Msg, Any]] = []  # device work in flight: (event, what, ...)

    def landed(g: _Msg, buf):
        if buf is not None:
            staged["recv"] -= g.nbytes
        stats["received"] += g.nbytes
        stats["mrecv"] += 1
        mark(g.m, 2)
        complete(g.m)

    def after(ev, what: str, g: _Msg, buf):
        """Does what follows device work (``ev``), or queues it until ``ev`` has passed."""
        if ev is not None:
            fenced.append((ev, what, g, buf))
        elif what == "send":
            inflight.add(transport.send(g.peer, buf, tag_base + g.m), g, buf)
            mark(g.m, 1)
        elif what == "local":
            stats["local"] += g.nbytes
            mark(g.m, 2)
            complete(g.m)
        else:
            landed(g, buf)

    def complete(m: int):
        done.add(m)
        for c in children.get(m, ()):
            heapq.heappush(ready, (when[c], c))
            mark(c, 0)

    try:
        while True:
            progressed = False
            # receives into staging, in schedule order, within budget
            while next_in < len(staged_in):
                g = msgs[staged_in[next_in]]
                if staged["recv"] and staged["recv"] + g.nbytes > recv_budget:
                    break
                buf = xp.empty(g.nbytes, dtype=xp.uint8)
                inflight.add(transport.recv(g.peer, buf, tag_base + g.m), g, buf)
                mark(g.m, 1)
                staged["recv"] += g.nbytes
                next_in += 1
                progressed = True
            # sends and local copies whose data is here, in schedule order
            while ready:
                g = msgs[ready[0][1]]
                packed = not (g.zc_src or g.local)
                if packed and staged["send"] and staged["send"] + g.nbytes > send_budget:
                    break
                heapq.heappop(ready)
                sent_out += 1
                progressed = True
                if g.local:
                    mark(g.m, 1)
                    for t in g.ts:
                        dst_view(t)[...] = src_view(t)
                    after(fence(), "local", g, None)
                elif packed:
                    buf = pack(g)
                    staged["send"] += g.nbytes
                    after(fence(), "send", g, buf)
                else:
                    inflight.add(transport.send(g.peer, contiguous_bytes(g, "src"),
                                                tag_base + g.m), g, None)
                    mark(g.m, 1)
            peak = max(peak, staged["recv"] + staged["send"])
            # completions: the head of each peer's FIFO; everything now and then, and when idle
            polls += 1
            for req, g, buf in inflight.completed(full=polls % 16 == 0 or idle % 8 == 1):
                progressed = True
                if g.out:
                    stats["sent"] += g.nbytes
                    stats["msent"] += 1
                    mark(g.m, 2)
                    if buf is not None:
                        staged["send"] -= g.nbytes
                elif buf is not None:
                    unpack(g, buf)
                    after(fence(), "landed", g, buf)
                else:
                    landed(g, None)
            # device work whose event has passed
            if fenced:
                waiting_dev = []
                for ev, what, g, buf in fenced:
                    if ev.done:
                        progressed = True
                        after(None, what, g, buf)
                    else:
                        waiting_dev.append((ev, what, g, buf))
                fenced = waiting_dev
            if (not len(inflight) and not fenced and next_in == len(staged_in)
                    and sent_out == n_out):
                break
            now = time.monotonic()
            if progressed:
                last, idle = now, 0
            elif now - last > timeout:
                raise TransferError(_stalled(rank, timeout, inflight, msgs, ready, done))
            else:
                idle += 1
                time.sleep(0 if idle < 20 else min(1e-3, 2e-5 * (idle - 19)))
    except BaseException:
        _abort(transport)
        raise
    end = time.time()
    if trace is not None:
        for m, (r, p, d) in sorted(marks.items()):
            g = msgs[m]
            trace.append((m, g.stage, g.peer, g.out, g.nbytes, r if r is not None else p, p, d))
    if close:
        transport.close()
    return ExecStats(rank, stats["sent"], stats["received"], stats["local"], stats["msent"],
                     stats["mrecv"], start, end, peak)


def _abort(transport) -> None:
    try:
        getattr(transport, "abort", transport.close)()
    except Exception:
        log.exception("closing the transport after a failure")


def _stalled(rank, timeout, inflight, msgs, ready, done) -> str:
    stuck = inflight.first(4)
    waiting = [f"{'sending' if g.out else 'receiving'} {g.label()}" for _, g, _ in stuck]
    if ready:
        waiting.append(f"staging budget for {msgs[ready[0][1]].label()}")
    forwards = [g for g in msgs.values() if g.out and g.parent >= 0 and g.parent not in done]
    for g in forwards[:2]:
        waiting.append(f"forwarding {g.label()} once message {g.parent} arrives")
    peers = sorted({peer for (peer, _), q in inflight.queues.items() if q})
    return (f"rank {rank}: no progress for {timeout:.1f} s; peers {peers} are dead or hung? "
            f"Waiting for: " + "; ".join(waiting))
