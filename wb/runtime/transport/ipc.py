"""One-sided moves between the processes of one host: a sender says where its bytes are, the
receiver copies them itself, and both sides trade those notes in batches.

A tagged message through UCX's rendezvous costs two control messages of its own (the sender's
"ready to send" and the receiver's "done"), over TCP between the processes of a host (UCX's
shared-memory rings are left out: :mod:`~wb.runtime.transport.ucx`), and a CUDA one some 20 us
of the caller's time: a rollout rank posting hundreds per update spends longer posting than the
bytes take to move. :class:`Channel` carries the same messages with the same tags and the same
:class:`~wb.runtime.transport.Request` semantics, but

- a send only notes ``(tag, bytes, where they are)``: an exported handle of the memory that holds
  them (CUDA IPC; a process id and address on hosts, read with ``process_vm_readv``);
- every turn of the caller's loop, the notes gathered for a peer go as one small control message
  (a *batch*), over UCX tags;
- the receiver matches each note with its posted receive (whichever came first), opens the handle
  once (cached by its bytes: a new allocation at an old address has another handle), and copies
  the bytes on a stream of its own per sender: the copies matched in one turn of the caller's loop
  go together, a group of up to :data:`GROUP_BYTES` as one call and one event (CUDA: one launch
  of a copy kernel over the group's rows; hosts: one ``process_vm_readv``), one by one where the
  memory cannot batch them; a receive completes when its group has;
- a receive its caller can unpack (``unpack``) is unpacked by its kernel from the sender's memory
  on that stream, not copied into its buffer to be unpacked after: one pass, no wait between;
  one its caller hashes (``hashed``: checksums) is copied by the caller's kernel that takes its
  checksum as it copies;
- the receiver's acknowledgements go back in batches too; a send completes with its ack, so the
  sender never reuses memory a peer may still read.

Whatever cannot go one-sided still moves, over plain UCX tag messages, and says so in its note:
memory that cannot be exported (host memory under CUDA, memory the driver will not export such
as virtual-memory allocations) goes as a UCX send at once; a handle the receiver cannot open (no
peer access between the devices, another IPC namespace, a peer in the same process) is answered
with a *nack*, after which the sender sends that message, and every later one from the same
allocation, over UCX, and logs it once.

Nothing here is sent unsigned or unkeyed: control messages are UCX tag messages of the owning
transport (tags XORed with the job key's secret), and the handles travel only inside them.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque

import numpy as np

from wb.errors import TransferError
from wb.runtime.transport import ucx_env
from wb.runtime.transport.notes import (ACK_NACK, ACK_OK, ACK_SIZE, NOTE_IPC, NOTE_UCX, decode,
                                        encode, size)

__all__ = ["Channel", "CTRL_TAG"]

log = logging.getLogger(__name__)

#: Tags of control messages: bit 62 (updates use bits 0-61 for versions below 2**30; the key's
#: challenge bit 63), the sending rank in bits 32-61, a sequence number below.
CTRL_TAG = 1 << 62
CTRL_BYTES = 64 << 10  # a control receive (kept posted); what is sent stays below EAGER_BYTES
#: Control messages stay below UCX's rendezvous threshold (ucxx sets 8 KiB), so each goes out
#: eagerly when posted: a rendezvous one would need this side to progress UCX again, and a
#: side whose update is over may not until its next one, while its peer waits for the acks.
EAGER_BYTES = 8000
WINDOW = 8  # control receives kept posted per peer
FLUSH_ROWS = 64  # notes gathered for one peer before they go whatever the caller does
FULL_EVERY = 16  # pumps between looks at every posted control receive
#: A request's done() runs the channel only this long after its last run ended: a loop that polls
#: hundreds of requests in a row runs it a few times, not once per request (each run costs more
#: than polling one request does).
_PUMP_S = 20e-6
GROUP_BYTES = 64 << 20  # copies from one peer started (and completed) together, at most



class _Req:
    """A send or receive through a :class:`Channel`: pending, done, failed, or handed to UCX."""

    __slots__ = ("chan", "peer", "tag", "what", "buf", "ok", "error", "ucx", "upto", "unpack",
                 "unpacked", "hasher", "hashed", "__weakref__")

    def __init__(self, chan, peer: int, tag: int, what: str, buf, upto: bool = False,
                 unpack=None, hasher=None):
        self.chan, self.peer, self.tag, self.what, self.buf = chan, peer, tag, what, buf
        self.ok, self.error, self.ucx, self.upto = False, None, None, upto
        self.unpack, self.unpacked = unpack, False
        self.hasher, self.hashed = hasher, False

    def done(self) -> bool:
        if self.ucx is not None:
            if self.ucx.done():
                return True
            self.chan.pump(soon=True)  # what this one waits for may be a note or nack unsent
            return False
        if not self.ok and self.error is None:
            self.chan.pump(soon=True)
            if self.ucx is not None:
                return self.ucx.done()
        if self.error is not None:
            err = TransferError(self.error)
            err.peer = self.peer
            raise err
        return self.ok


class Channel:
    """Sends and receives of one :class:`~wb.runtime.transport.ucx.UcxTransport` with the peers
    of its host, one-sided (the module doc). ``memory`` is a
    :class:`~wb.runtime.transport.memory.CudaMemory` or
    :class:`~wb.runtime.transport.memory.HostMemory`; control messages and fallbacks go
    through ``transport``'s ``_post``."""

    def __init__(self, transport, memory):
        self.t, self.mem, self.rank = transport, memory, transport.rank
        self._lock = threading.RLock()
        self._last = 0.0
        self._pumps = 0
        self._sends: dict[tuple[int, int], _Req] = {}  # noted, waiting for their ack
        self._recvs: dict[tuple[int, int], _Req] = {}  # posted, no note yet
        self._notes: dict[tuple[int, int], tuple] = {}  # (kind, nbytes, handle, offset)
        self._starting: dict[int, list] = {}  # peer -> (request, opened, offset, nbytes) to copy
        self._copies: dict[int, deque] = {}  # peer -> (requests, token), in copy order
        self._out: dict[int, list] = {}  # peer -> rows (kind, tag, nbytes, handle, offset)
        self._ctrl: dict[int, dict[int, tuple]] = {}  # peer -> seq -> (request, buffer)
        self._next_in: dict[int, int] = {}  # peer -> next sequence number to post a receive for
        self._seq: dict[int, int] = {}  # peer -> next sequence number to send
        self._sent: list = []  # control sends in flight (request, buffer)
        self._refused: set[tuple[int, bytes]] = set()  # (peer, handle) that peer cannot open
        self._kept: list = []  # buffers of sends a cancel left behind (peers may still read)
        # This process's control messages to each peer are numbered from here: a process that
        # takes a dead one's rank starts elsewhere, so the receives its peers still have posted
        # for the dead one (UCX cannot withdraw them) never take its messages.
        self.seq0 = secrets.randbits(32)
        self.eager = min(EAGER_BYTES, ucx_env.rndv_thresh(EAGER_BYTES + 64) - 64)
        self._met: dict[int, int] = {}  # peer -> the seq0 it was met with
        # messages this side sent or received one-sided, over UCX (not exportable, or as a nack
        # asked) and refused by a nack (this side could not open the sender's memory); of the
        # one-sided receives, those unpacked from the sender's memory and those copied hashed
        self.counts = {"one_sided": 0, "over_ucx": 0, "nacked": 0, "batched": 0, "unpacked": 0,
                       "hashed": 0}

    # --- the caller's side ---------------------------------------------------------------------
    def meet(self, peer: int, seq0: int) -> None:
        """Starts the control channel with ``peer`` (numbering its messages from ``seq0``, as its
        record says): keeps :data:`WINDOW` control receives posted for it from now on."""
        with self._lock:
            same = self._met.get(peer) == seq0
            if same and self._ctrl.get(peer):
                return  # the same process again (forgotten, then back): numbering goes on
            if not same:  # a new process in that rank: numbered from its start, and from ours
                self._met[peer], self._next_in[peer], self._seq[peer] = seq0, int(seq0), self.seq0
            self._drop_window(peer)
            self._ctrl[peer] = {}
            for _ in range(WINDOW):
                self._post_ctrl(peer)

    def send(self, peer: int, buf, tag: int) -> _Req:
        with self._lock:
            req = _Req(self, peer, tag, "send", buf)
            exp = self.mem.export(buf)
            if exp is not None and (peer, exp[0]) in self._refused:
                exp = None
            out = self._out.setdefault(peer, [])
            if exp is None:
                self.counts["over_ucx"] += 1
                req.ucx = self.t._post("send", peer, buf, tag)
                out.append((NOTE_UCX, tag, buf.nbytes, b"", 0))
            else:
                self._sends[peer, tag] = req
                out.append((NOTE_IPC, tag, buf.nbytes, *exp))
            # a long run of posts: the peer starts on the first ones. A send over UCX may be
            # done at once, before any pump: its note (the peer's cue to post the receive) goes now
            if exp is None or len(out) >= FLUSH_ROWS:
                self.pump()
            return req

    def unexportable(self, buf) -> bool:
        """Whether ``buf`` is memory this channel moves but cannot export (see the memory's
        ``unexportable``): its messages would go over UCX tags."""
        with self._lock:
            return self.mem.unexportable(buf)

    def recv(self, peer: int, buf, tag: int, *, upto: bool = False, unpack=None,
             hashed=None) -> _Req:
        """``upto``: the message may be shorter than ``buf`` (see :class:`~wb.runtime.transport.
        Transport`). ``unpack``: ``(unpacker, key)``, where the memory can run it
        (``unpack_many``) the message is unpacked from the sender's memory instead of copied.
        ``hashed``: ``(hasher, key)``, where the memory can run it (``copy_hashed``) the
        hasher copies the message and takes its checksum in one pass (the request's
        ``hashed`` then true)."""
        with self._lock:
            req = _Req(self, peer, tag, "recv", buf, upto, unpack, hashed)
            note = self._notes.pop((peer, tag), None)
            if note is None:
                self._recvs[peer, tag] = req
            else:
                self._start(req, *note)
                if self._out.get(peer):  # a nack or refusal: the sender waits for it
                    self._flush()
            return req

    def pump(self, *, soon: bool = False) -> None:
        """Progresses UCX, takes control messages, starts matched copies, completes finished
        ones, and sends what is noted for each peer as one batch. ``soon``: unless it ran in the
        last few microseconds."""
        if soon and time.perf_counter() - self._last < _PUMP_S:
            return
        with self._lock:
            self.t.progress()
            self._take_control()
            self._launch()
            self._finish_copies()
            self._flush()
            self._last = time.perf_counter()

    # --- rounds, faults, the end ---------------------------------------------------------------
    def new_round(self) -> None:
        with self._lock:
            self.mem.new_round()

    def cancel(self) -> None:
        """After the transport cancelled what UCX had in flight: sends the notes gathered so far,
        waits for this side's copies, drops every request of the attempt (what was sent stays
        alive: a peer may still read it). Notes not matched yet stay, as UCX keeps unexpected
        messages through a cancel: a peer already in the next attempt may have sent them (its tags
        are new). Control receives cancelled with the rest are posted again as they report it."""
        with self._lock:
            # what was posted goes out, as a UCX post does at once: peers still in the attempt
            # (not every rank gives it up) may be waiting for those notes
            self._flush()
            self._launch()
            self.mem.wait_all()
            self._finish_copies()  # delivered: their senders, maybe still in it, get the acks
            self._flush()
            self._kept += [r.buf for r in self._sends.values()]
            self._sends.clear()
            self._recvs.clear()
            self._copies.clear()
            self._out.clear()

    def forget(self, peers) -> None:
        with self._lock:
            gone = set(peers)
            for d in (self._sends, self._recvs, self._notes):
                for k in [k for k in d if k[0] in gone]:
                    d.pop(k)
            for p in gone:  # its control window stays, should the same process come back
                for q in (self._starting, self._copies, self._out):
                    q.pop(p, None)
            self._refused = {(p, h) for p, h in self._refused if p not in gone}

    def close(self) -> None:
        with self._lock:
            self._launch()  # matched copies a caller stopped waiting for
            self.mem.wait_all()
            self._finish_copies()
            self._flush()  # notes and acks still gathered: peers may wait for them
            self.mem.close()
            self._kept.clear()

    def describe(self) -> dict:
        return {"memory": self.mem.name, "peers": sorted(self._ctrl), **self.counts}

    # --- inside --------------------------------------------------------------------------------
    def _post_ctrl(self, peer: int, seq: int | None = None) -> None:
        if seq is None:
            seq = self._next_in[peer]
            self._next_in[peer] = (seq + 1) & 0xFFFFFFFF
        buf = np.empty(CTRL_BYTES, np.uint8)
        req = self.t._post("recv", peer, buf, CTRL_TAG | peer << 32 | seq)
        self._ctrl[peer][seq] = (req, buf)

    def _repost(self, peer: int, seq: int | None = None) -> bool:
        """Posts a control receive again; a peer no longer connected (forgotten) loses its
        window instead (made again if it is met again)."""
        try:
            self._post_ctrl(peer, seq)
            return True
        except TransferError:
            self._drop_window(peer)
            return False

    def _drop_window(self, peer: int) -> None:
        """Stops taking ``peer``'s control receives; UCX cannot withdraw them, so their buffers
        stay alive until the transport closes."""
        self._kept += list(self._ctrl.pop(peer, {}).values())

    def _take_control(self) -> None:
        # A peer's control messages complete in the order it sent them (eager, one endpoint):
        # each pump looks at each peer's receives up to the first not yet complete, and at all
        # of them every FULL_EVERY pumps (one left behind by a cancelled send of the peer's).
        self._pumps += 1
        full = self._pumps % FULL_EVERY == 0
        for peer in list(self._ctrl):
            posted = self._ctrl.get(peer)
            while posted:
                seq = None
                for k, item in posted.items():
                    if item[0].req.completed:
                        seq = k
                        break
                    if not full:
                        break
                if seq is None:
                    break
                req, buf = posted.pop(seq)
                try:
                    req.done()
                except TransferError as e:
                    if "cancel" in str(e).lower():  # a cancel() took it: post it again
                        if not self._repost(peer, seq):
                            break
                        continue
                    self._fail_peer(peer, str(e))
                    break
                self._read(peer, buf)
                if not self._repost(peer):
                    break

    def _read(self, peer: int, buf: np.ndarray) -> None:
        rows, handles = decode(buf)
        for tag, nbytes, offset, h, kind in rows:
            if kind in (NOTE_IPC, NOTE_UCX):
                note = (kind, nbytes, handles[h] if kind == NOTE_IPC else b"", offset)
                req = self._recvs.pop((peer, tag), None)
                if req is None:
                    self._notes[peer, tag] = note
                else:
                    self._start(req, *note)
                continue
            req = self._sends.pop((peer, tag), None)
            if req is None:  # an ack of an attempt this side cancelled
                continue
            if kind == ACK_OK:
                self.counts["one_sided"] += 1
                req.ok = True
            elif kind == ACK_NACK:
                handle = self.mem.export(req.buf)
                if handle is not None and (peer, handle[0]) not in self._refused:
                    self._refused.add((peer, handle[0]))
                    log.warning("rank %d: peer %d cannot open this rank's memory for one-sided "
                                "reads: its messages from that allocation go over UCX tags",
                                self.rank, peer)
                self.counts["over_ucx"] += 1
                self._to_ucx(req)
            else:
                req.error = (f"rank {self.rank}: send of tag {tag:#x} to peer {peer}: the peer's "
                             f"receive is not {req.buf.nbytes:,} bytes (refused)")

    def _start(self, req: _Req, kind: int, nbytes: int, handle: bytes, offset: int) -> None:
        """Moves a matched note's bytes into ``req``'s buffer (or hands it to UCX)."""
        peer, tag = req.peer, req.tag
        if kind == NOTE_UCX:  # sizes are UCX's to check, as for any tag message
            self.counts["over_ucx"] += 1
            self._to_ucx(req)
            return
        if nbytes > req.buf.nbytes or (nbytes != req.buf.nbytes and not req.upto):
            req.error = (f"rank {self.rank}: receive of tag {tag:#x} from peer {peer} is "
                         f"{req.buf.nbytes:,} bytes, the peer sent {nbytes:,} (refused)")
            self._out.setdefault(peer, []).append((ACK_SIZE, tag, 0, b"", 0))
            return
        opened = self.mem.open(handle)
        if opened is None:
            self._nack(req)
            return
        self._starting.setdefault(peer, []).append((req, opened, offset, nbytes))

    def _nack(self, req: _Req) -> None:
        """The sender sends ``req``'s message over UCX once it reads the nack."""
        self.counts["nacked"] += 1
        self._to_ucx(req)
        self._out.setdefault(req.peer, []).append((ACK_NACK, req.tag, 0, b"", 0))

    def _launch(self) -> None:
        """Starts the copies matched since the last call: each peer's in groups of up to
        :data:`GROUP_BYTES`, a group one batched call and one token where the memory can (a
        group completes as one), else one by one."""
        if not self._starting:
            return
        mem, can = self.mem, hasattr(self.mem, "unpack_many")
        hashes = hasattr(mem, "copy_hashed")

        def kind(item) -> int:  # unpacks in place first, then copies hashed, then copies
            r = item[0]
            return 0 if can and r.unpack else 1 if hashes and r.hasher else 2
        for peer, items in self._starting.items():
            q = self._copies.setdefault(peer, deque())
            items.sort(key=kind)
            at = 0
            while at < len(items):
                end, size = at, 0
                k = kind(items[at])  # each kind goes in groups of its own
                while end < len(items) and (end == at or size + items[end][3] <= GROUP_BYTES
                                            and kind(items[end]) == k):
                    size += items[end][3]
                    end += 1
                group = items[at:end]
                token = self._one_pass(group, peer, k == 0) if k < 2 else None
                if token is not None:
                    q.append(([r for r, *_ in group], token))
                    at = end
                    continue
                token = mem.copy_many([(r.buf, o, off, n) for r, o, off, n in group], peer) \
                    if len(group) > 1 else None
                if token is not None:
                    self.counts["batched"] += len(group)
                    self.counts["one_sided"] += len(group)
                    q.append(([r for r, *_ in group], token))
                else:
                    for r, opened, offset, nbytes in group:
                        token = mem.copy(r.buf, opened, offset, nbytes, peer)
                        if token is None:
                            self._nack(r)
                        else:
                            self.counts["one_sided"] += 1
                            q.append(((r,), token))
                at = end
        self._starting.clear()

    def _one_pass(self, group: list, peer: int, unpack: bool):
        """A token for ``group``'s receives unpacked from ``peer``'s memory (``unpack``) or
        copied and hashed in one pass, or ``None`` (they are copied as any other)."""
        token = (self.mem.unpack_many([(r.unpack, o, off, n) for r, o, off, n in group], peer)
                 if unpack else self.mem.copy_hashed([(r.hasher, r.buf, o, off, n)
                                                       for r, o, off, n in group], peer))
        if token is not None:
            for r, *_ in group:
                r.unpacked, r.hashed = unpack, not unpack
            self.counts["one_sided"] += len(group)
            self.counts["unpacked" if unpack else "hashed"] += len(group)
        return token

    def _to_ucx(self, req: _Req) -> None:
        """``req`` as a UCX tag message (its error, naming the peer, if it cannot be posted)."""
        try:
            req.ucx = self.t._post(req.what, req.peer, req.buf, req.tag)
        except TransferError as e:
            req.error = str(e)

    def _finish_copies(self) -> None:
        for peer, q in self._copies.items():
            while q:
                reqs, token = q[0]
                try:
                    if not self.mem.passed(token):
                        break
                except Exception as e:  # noqa: BLE001 - a failed copy fails its receives
                    q.popleft()
                    for req in reqs:
                        req.error = (f"rank {self.rank}: the copy of tag {req.tag:#x} from "
                                     f"peer {peer} failed: {type(e).__name__}: {e}")
                    continue
                q.popleft()
                out = self._out.setdefault(peer, [])
                for req in reqs:
                    req.ok = True
                    out.append((ACK_OK, req.tag, 0, b"", 0))

    def _flush(self) -> None:
        if len(self._sent) > 8:  # eager sends complete as posted: their buffers go in bulk
            self._sent = [(r, b) for r, b in self._sent if not r.req.completed]
        for peer, rows in self._out.items():
            if not rows:
                continue
            handles: dict[bytes, int] = {}
            batch = []
            for row in rows:
                kind, tag, nbytes, handle, offset = row
                h = handles.setdefault(handle, len(handles)) if kind == NOTE_IPC else 0
                batch.append((tag, nbytes, offset, h, kind))
                if size(len(batch) + 1, len(handles) + 1) > self.eager:
                    self._send_ctrl(peer, batch, handles)
                    handles, batch = {}, []
            if batch:
                self._send_ctrl(peer, batch, handles)
            rows.clear()

    def _send_ctrl(self, peer: int, batch: list, handles: dict) -> None:
        msg = encode(batch, handles)
        seq = self._seq[peer]
        self._seq[peer] = (seq + 1) & 0xFFFFFFFF
        req = self.t._post("send", peer, msg, CTRL_TAG | self.rank << 32 | seq)
        self._sent.append((req, msg))

    def _fail_peer(self, peer: int, why: str) -> None:
        """A peer's control channel failed (it died): every request with it fails, naming it."""
        for d in (self._sends, self._recvs):
            for k in [k for k in d if k[0] == peer]:
                d.pop(k).error = f"rank {self.rank}: control channel to peer {peer} failed: {why}"
        for req, *_ in self._starting.pop(peer, ()):
            req.error = f"rank {self.rank}: control channel to peer {peer} failed: {why}"
        for req in [r for reqs, _ in self._copies.pop(peer, ()) for r in reqs]:
            req.error = f"rank {self.rank}: control channel to peer {peer} failed: {why}"
        self._drop_window(peer)
