"""A checksum on every message: each update's *digests*.

Every unit one rank sends another (a message, or a frame of small ones:
:mod:`wb.runtime.engine.frames`) is hashed (CRC32C, :mod:`wb.runtime.engine.crc`) by its sender
once posted and by its receiver once landed, before it is unpacked. Per update, per pair of
ranks that exchange units and per number of forwards those units are from their trainer
(:class:`Routes`), the sender then sends one *digest*: a small message (tag ``tag_base +``
:meth:`Routes.tag`) holding a status word, the number of units and each unit's CRC, in unit
order. The receiver compares. An update does not finish before every digest came and every unit
matched; a mismatch fails it (:class:`ChecksumError`) once all its bytes moved, so the transport
stays intact and no peer waits: with receiver staging nothing of the version is installed.

A forwarder's digest to a peer waits until every peer whose units fed what it forwarded there
passed its check, so corrupt bytes do not pass a forwarder unnoticed; a forwarder whose input
failed marks its digests :data:`CORRUPT`, and the ranks downstream fail the version too, naming
where it went wrong.

What it costs: one small message per pair of ranks (and hop) per update, and a pass over each message's
bytes at each end: on the host by the ``crc32c`` library as soon as the message is posted or
landed; on a GPU by one kernel launch per :data:`FLUSH_BYTES` of messages (or when the update
loop is idle), on a stream of its own (their stretches of 1 KiB hashed by threads of their own; the table of
them copied from pinned memory, asynchronously), the CRCs copied back behind an event
(:class:`_DeviceSums`: the loop never waits on the device for them; staging they read goes back
to the pool once they passed). With ``WB_COPY_HASHED=1``, a device's receive that the transport
copies out of its sender's memory (one-sided, within a host) is hashed by the same kernel as it
is copied (:class:`CopyHashed`): its bytes are read once. A forward of exactly its parent's
bytes takes its parent's CRC. Both ends must agree to take them: the transport says whether it
does (:func:`checksumming`), and :func:`~wb.runtime.engine.executor.connect` refuses peers that
differ.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from wb.errors import ChecksumError, TransferError
from wb.runtime.engine import crc
from wb.runtime.engine.frames import Frame
from wb.runtime.engine.inflight import recorded

__all__ = ["ChecksumError", "Routes", "Digests", "CopyHashed", "copies_hashed", "checksumming",
           "DIGEST_TAG", "OK", "CORRUPT", "FLUSH_BYTES"]

#: Digests' tags sit above every message's (a plan holds fewer than this many messages).
DIGEST_TAG = 1 << 26
#: Digest status words: its units' CRCs, as sent; or sent on from input that failed its check.
OK, CORRUPT = 0, 1
_MAX_RANK = 1 << 20  # digest tags: DIGEST_TAG + hops * _MAX_RANK + sender, below 2**27
_MAX_HOPS = 1 << 6
#: A device launches its hashing once this many bytes are queued (or when nothing else moves).
FLUSH_BYTES = 32 << 20
#: Bytes per thread and threads per block of the kernel that copies a receive and hashes it: an
#: 8 MiB message in 64 blocks of 256 threads, as the row copy kernel spreads it (1 KiB stretches
#: in blocks of 1024 would put it on 8 of the device's processors). Chosen from that geometry;
#: ``bench/bench_crc.py --fused`` times the shapes on a GPU.
COPY_SHAPE = (512, 256)


def checksumming(transport) -> bool:
    """Whether ``transport``'s messages carry checksums: unless it says ``checksums = False``."""
    return bool(getattr(transport, "checksums", True))


class Routes:
    """What a rank's program exchanges with each peer, for its digests (made once per program).

    A digest covers the units one rank sends another that are the same number of forwards from
    their trainer (*hops*, :attr:`wb.RankPlan.hops`): a forward's digest waits for the check of
    what fed it, one hop fewer, so the waits follow the hops down to the trainers and never
    close a ring (replicas that forward to each other in a circle).

    Attributes:
        out: ``{(peer, hops): [unit]}`` the units sent to each peer, in unit order.
        inn: ``{(peer, hops): [unit]}`` the units received from each peer, in unit order.
        slot: ``{unit: index}`` of each unit's CRC in an update's array of them.
        needs: ``{(peer, hops): {(sender, hops - 1)}}``: the digests whose check the digest to
            ``peer`` waits for (what fed its forwards).
        buffers: ``{unit: [buffer name]}`` the buffers each received unit writes (for errors).
        hop_of: ``{unit: hops}``.
        aliased: forwards whose bytes are their parent's (their ``slot`` is the parent's).
        own: ``{aliased forward: index}`` of a CRC of its own, for an update in which it travels
            otherwise than its parent came (one a delta, the other dense:
            :mod:`wb.runtime.engine.deltas.units`).
    """

    def __init__(self, prog):
        crc.load()
        units, part = prog.units, prog.part
        hop = dict(zip(part.index.tolist(), part.hops.tolist()))
        if units and max(units) >= DIGEST_TAG:
            raise TransferError(f"rank {prog.rank}: a plan of more than {DIGEST_TAG:,} messages "
                                f"cannot carry checksums; plan with larger pieces")
        if hop and (max(hop.values()) >= _MAX_HOPS or max(part.peers, default=0) >= _MAX_RANK):
            raise TransferError(f"rank {prog.rank}: checksums take plans of fewer than "
                                f"{_MAX_HOPS} forwards per message and {_MAX_RANK:,} ranks")
        self.out: dict[tuple[int, int], list[int]] = {}
        self.inn: dict[tuple[int, int], list[int]] = {}
        for m in sorted(units):
            g = units[m]
            if not g.local:
                (self.out if g.out else self.inn).setdefault((g.peer, hop[m]), []).append(m)
        self.hop_of = {m: hop[m] for m in units}
        self._device: _DeviceSums | None = None  # kept across updates (see sums)
        self.slot = {m: i for i, m in enumerate(m for ms in (*self.out.values(),
                                                             *self.inn.values()) for m in ms)}
        # a forward of exactly its parent's bytes (Program.relays) takes its parent's CRC
        # (checked against the parent's sender before this rank's digest goes), and is not
        # hashed again
        self.aliased: set[int] = set(prog.relays)
        self.own: dict[int, int] = {}
        for m in prog.relays:
            self.own[m] = self.slot[m]
            self.slot[m] = self.slot[units[m].parent]
        fed_by = {}  # a received message -> its digest's key
        for key, ms in self.inn.items():
            for m in ms:
                g = units[m]
                for member in (g.members if g.__class__ is Frame else (g,)):
                    fed_by[member.m] = key
        self.needs = {key: {fed_by[units[m].parent] for m in ms if units[m].parent in fed_by}
                      for key, ms in self.out.items()}
        self.buffers = {}
        T = prog.part.transfers
        for ms in self.inn.values():
            for m in ms:
                g = units[m]
                names = dict.fromkeys(prog.slot_buf[int(s)] for member in
                                      (g.members if g.__class__ is Frame else (g,))
                                      for s in T.dst_slot[member.ts])
                self.buffers[m] = list(names)

    def sums(self, xp):
        """Where an update's CRCs go: host ones anew; a device's array and pinned memory kept
        from update to update (pinned memory costs milliseconds to allocate), zeroed."""
        n = len(self.slot)
        if xp is np:
            return _HostSums(n)
        if self._device is None:
            self._device = _DeviceSums(xp, n)
        self._device.reset()
        return self._device

    @staticmethod
    def tag(sender: int, hops: int) -> int:
        """The tag (above ``tag_base``) of ``sender``'s digest of units ``hops`` forwards out."""
        return DIGEST_TAG + hops * _MAX_RANK + sender


class _HostSums:
    """CRCs of host buffers, taken at once."""

    def __init__(self, n: int):
        self.values = np.zeros(n, np.uint32)

    def take(self, buf, slot: int) -> None:
        self.values[slot] = crc.host(buf)

    def flush(self, *, idle: bool = True) -> None:
        pass

    def fetch(self) -> None:
        """Nothing to wait for: ``None`` is a fetch that is done."""
        return None

    def guard(self) -> None:
        """Nothing reads a buffer after it was taken."""
        return None

    def passed(self, token) -> bool:
        return True

    def read(self, slots: list[int]) -> list[int]:
        return self.values[slots].tolist()


class _DeviceSums:
    """CRCs of CUDA buffers: queued per unit, launched in batches (:meth:`flush`: at least
    :data:`FLUSH_BYTES`, or when the loop has nothing else to do, or when CRCs are wanted) on a
    stream of their own (behind what the current stream queued so far: what wrote the buffers),
    so that hashing overlaps the packing, unpacking and sending and costs few launches; copied
    to pinned host memory behind an event (:meth:`fetch`): the update loop never waits on the
    device for them. Staging they read goes back to the pool once its batch passed
    (:meth:`guard`, :meth:`passed`)."""

    def __init__(self, xp, n: int):
        self.xp, self.values = xp, xp.zeros(max(n, 1), xp.uint32)
        self._pinned = xp.cuda.alloc_pinned_memory(4 * max(n, 1))
        self.host = np.frombuffer(self._pinned, np.uint32, max(n, 1))
        self.launcher = crc.Launcher(xp, n)  # a unit is hashed once per update: n rows
        # units copied out of their senders' memory and hashed in the same pass, on the
        # transport's streams (copy_hashed): rows of their own
        self.copier = crc.Launcher(xp, n, **_copier_shape())
        self.stream = xp.cuda.Stream(non_blocking=True)
        self.reset()

    def reset(self) -> None:
        """A new update (the last one's fetches are done)."""
        with self.stream:
            self.values.fill(0)
        self.cleared = recorded(self.xp, self.stream)  # what takes CRCs elsewhere waits for it
        self.pending, self.pending_bytes = [], 0
        self.batches: list = []  # an event after each launched batch
        self.launcher.reset()
        self.copier.reset()

    def take(self, buf, slot: int) -> None:
        """Queues ``buf`` (a CuPy array or a :class:`~wb.runtime.engine.inflight.DeviceBytes`)."""
        self.pending.append((buf.data.ptr, int(buf.nbytes), slot))
        self.pending_bytes += int(buf.nbytes)

    def take_now(self, rows: list) -> None:
        """Hashes ``(pointer, bytes, slot)`` rows now, on the current stream (behind the
        zeroing of the update's CRCs)."""
        self.xp.cuda.get_current_stream().wait_event(self.cleared)
        self.launcher.launch(rows, self.values)

    def copy_hashed(self, rows: list, stream) -> None:
        """Copies ``(source, bytes, slot, destination)`` rows on ``stream`` and takes their
        CRCs in the same pass (behind the zeroing of the update's CRCs)."""
        stream.wait_event(self.cleared)
        self.copier.launch(rows, self.values, stream)

    def flush(self, *, idle: bool = True) -> None:
        """Launches the batch taken so far (unless it is short of :data:`FLUSH_BYTES` and not
        ``idle``)."""
        if self.pending and (idle or self.pending_bytes >= FLUSH_BYTES):
            self.stream.wait_event(recorded(self.xp, self.xp.cuda.get_current_stream()))
            with self.stream:
                self.launcher.launch(self.pending, self.values)
            self.batches.append(recorded(self.xp, self.stream))
            self.pending, self.pending_bytes = [], 0

    def guard(self):
        """A token for the batch reading the buffers taken so far (:meth:`passed` says when it
        has), or ``None`` when it has."""
        token = len(self.batches) if self.pending else len(self.batches) - 1
        return None if token < 0 or self.passed(token) else token

    def passed(self, token: int) -> bool:
        return token < len(self.batches) and self.batches[token].done

    def fetch(self):
        """Copies every CRC taken so far to the host behind an event (``.done`` once there)."""
        self.flush()
        xp = self.xp
        xp.cuda.runtime.memcpyAsync(self.host.ctypes.data, self.values.data.ptr,
                                    self.host.nbytes, xp.cuda.runtime.memcpyDeviceToHost,
                                    self.stream.ptr)
        return recorded(self.xp, self.stream)

    def read(self, slots: list[int]) -> list[int]:
        """CRCs of a fetch that is done."""
        return self.host[slots].tolist()


def _copier_shape() -> dict:
    """Stretches and threads per block of the kernel that copies and hashes (a launch copies a
    group of a peer's messages, tens of MiB: smaller than what the hashing of a turn takes):
    :data:`COPY_SHAPE`, or ``WB_COPY_HASHED=stretch:threads`` from the environment."""
    v = os.environ.get("WB_COPY_HASHED", "")
    try:
        sub, threads = (int(x) for x in v.split(":")) if ":" in v else COPY_SHAPE
        if sub < 1 or not (0 < threads <= 1024 and threads % 32 == 0):
            raise ValueError
    except ValueError:
        raise TransferError(f"WB_COPY_HASHED={v!r}: 0, 1, or stretch:threads (bytes per "
                            f"thread, threads per block: a multiple of 32 up to 1024)") from None
    return {"sub": sub, "threads": threads}


class CopyHashed:
    """What a transport calls to copy received units out of their senders' memory and take
    their CRCs in the same pass (``copy_many([(unit, destination, source, bytes), ...],
    stream)``, on the stream it copies them on; one launch): a device's receiver then reads
    each unit's bytes once, not a second time to hash them. The CRC is of the bytes as read,
    which are the bytes written."""

    __slots__ = ("sums", "slot")

    def __init__(self, digests: "Digests"):
        self.sums, self.slot = digests.sums, digests.r.slot

    def copy_many(self, items: list, stream) -> None:
        slot = self.slot
        self.sums.copy_hashed([(int(src), int(n), slot[g.m], int(dst))
                               for g, dst, src, n in items], stream)


def copies_hashed(transport, digests, delta) -> CopyHashed | None:
    """A :class:`CopyHashed` for ``transport``'s receives where it can run one (its
    ``copies_hashed``: device buffers through its one-sided channel) and the CRCs are a
    device's; not with deltas (a delta's CRC is of what came, its size known once it came).
    Opt-in until it has run on a GPU: ``WB_COPY_HASHED=1`` (or ``stretch:threads``, see
    :func:`_copier_shape`) in the environment; unset or ``0``, receives are copied, then
    hashed."""
    if digests is None or delta is not None or not isinstance(digests.sums, _DeviceSums) or \
            not getattr(transport, "copies_hashed", False) or \
            os.environ.get("WB_COPY_HASHED", "0") == "0":
        return None
    return CopyHashed(digests)


class Digests:
    """One update's checksums at one rank (see the module doc): the loop tells it what was sent
    (:meth:`sent`) and what landed (:meth:`landed`), and gives it a turn (:meth:`turn`)."""

    def __init__(self, routes: Routes, prog, mover, transport, tag_base: int):
        self.r, self.prog, self.transport, self.base = routes, prog, transport, tag_base
        self.sums = routes.sums(mover.xp)
        # digests by (peer, hops): see Routes
        self.to_hash_out = {k: len(ms) for k, ms in routes.out.items()}  # units not yet hashed
        self.to_land = {k: len(ms) for k, ms in routes.inn.items()}  # units not yet landed
        self.inbox: dict[tuple[int, int], tuple[Any, np.ndarray]] = {}  # (request, digest)
        self.unchecked = set(routes.inn)  # received digests not checked yet
        self.failed: set[tuple[int, int]] = set()  # those whose units failed (or came corrupt)
        self.unsent = set(routes.out)  # digests not posted yet
        self.outbox: list[tuple[Any, np.ndarray, int]] = []  # digests posted, not complete
        self.apart: set[int] = set()  # aliased forwards hashed on their own this update
        self.bad: list[tuple[int, int, list[str], str]] = []
        # the CRCs on their way to the host (a device's), and what waits for them
        self.fetching: tuple[Any, list, list] | None = None  # (event, checks, sends)

    def post(self) -> None:
        """Posts the receive of every peer's digest (before the update's first message)."""
        for (s, h), ms in self.r.inn.items():
            buf = np.zeros(len(ms) + 2, np.uint32)
            req = self.transport.recv(s, buf, self.base + Routes.tag(s, h))
            self.inbox[(s, h)] = (req, buf)

    def sent(self, g, buf, *, parent_alike: bool = True) -> None:
        """Unit ``g`` was posted from ``buf`` (``parent_alike``: a forward travels as its parent
        came, so an aliased one's bytes are its parent's)."""
        if g.m not in self.r.aliased:
            self.sums.take(buf, self.r.slot[g.m])
        elif not parent_alike:
            self.sums.take(buf, self.r.own[g.m])
            self.apart.add(g.m)
        self.to_hash_out[(g.peer, self.r.hop_of[g.m])] -= 1

    def landed(self, g, buf) -> None:
        """Unit ``g`` landed in ``buf`` (before it is unpacked; ``None``: hashed where it was
        read, :meth:`hash_at` or :class:`CopyHashed`)."""
        if buf is not None:
            self.sums.take(buf, self.r.slot[g.m])
        self.to_land[(g.peer, self.r.hop_of[g.m])] -= 1

    def hash_at(self, items: list) -> None:
        """Units ``(g, address)`` unpacked straight from their senders' memory, hashed there
        now, on the current stream (the sender may reuse that memory once it has passed)."""
        self.sums.take_now([(int(at), g.nbytes, self.r.slot[g.m]) for g, at in items])

    def guard(self):
        """A token to pass (:meth:`passed`) before staging taken so far may be written again
        (``None``: now)."""
        return self.sums.guard()

    def passed(self, token) -> bool:
        return self.sums.passed(token)

    def turn(self, idle: bool) -> bool:
        """Checks the peers whose digest and units are all here, posts the digests that may go,
        takes completed ones; whether anything moved. The CRCs they need are fetched from the
        device first (behind an event, never waited for here). Hashing queued on a device is
        launched once enough is (or the loop is ``idle``)."""
        self.sums.flush(idle=idle)
        moved = False
        if self.fetching is not None:
            ev, checks, sends = self.fetching
            if ev is not None and not ev.done:
                return self._sent_out()
            self.fetching = None
            for k in checks:  # checks first: a digest's status says whether they passed
                self._check(k, self.inbox[k][1])
            for k in sends:
                self._send(k)
            moved = True
        checks = [k for k in self.unchecked if not self.to_land[k] and self.inbox[k][0].done()]
        sends = [k for k in self.unsent
                 if not self.to_hash_out[k] and not (self.r.needs[k] & self.unchecked)]
        if checks or sends:
            self.fetching = (self.sums.fetch(), checks, sends)
            self.unchecked.difference_update(checks)  # taken: checked once fetched
            self.unsent.difference_update(sends)
            moved = True
        return self._sent_out() or moved

    def _sent_out(self) -> bool:
        """Takes the completed digest sends; whether any."""
        if not self.outbox:
            return False
        left = [x for x in self.outbox if not x[0].done()]  # (request, digest, peer)
        moved = len(left) < len(self.outbox)
        self.outbox = left
        return moved

    def finished(self) -> bool:
        return (not self.unchecked and not self.unsent and not self.outbox
                and self.fetching is None)

    def waiting(self) -> list[str]:
        """What it still waits for (for the stall message)."""
        out = [f"the digest of rank {s} ({h} hops)" for s, h in sorted(self.unchecked)
               if not self.to_land[(s, h)]]
        out += [f"checks of {sorted(self.r.needs[k] & self.unchecked)} (rank, hops) before the "
                f"digest to rank {k[0]}" for k in sorted(self.unsent) if not self.to_hash_out[k]]
        out += [f"sending its digest to rank {peer}" for _, _, peer in self.outbox]
        return out

    def peers(self) -> set[int]:
        """The peers whose digests it still waits for, or that its digests still go to."""
        return ({k[0] for k in self.unchecked if not self.to_land[k]}
                | {peer for _, _, peer in self.outbox})

    def error(self, stats) -> ChecksumError | None:
        return ChecksumError(self.prog.rank, self.bad, stats) if self.bad else None

    # --- one peer's digest ---------------------------------------------------------------------
    def _check(self, k: tuple[int, int], buf: np.ndarray) -> None:
        self.unchecked.discard(k)
        s, ms = k[0], self.r.inn[k]
        status, count = int(buf[0]), int(buf[1])
        if status == CORRUPT:
            what = (f"forwarded by rank {s} from input that failed its checksum there")
            self.bad += [(s, m, self.r.buffers[m], what) for m in ms]
            self.failed.add(k)
            return
        if status != OK or count != len(ms):
            self.bad.append((s, ms[0], self.r.buffers[ms[0]],
                             f"its digest is malformed (status {status}, {count} units for "
                             f"{len(ms)})"))
            self.failed.add(k)
            return
        got = self.sums.read([self.r.slot[m] for m in ms])
        for m, mine, theirs in zip(ms, got, buf[2:].tolist()):
            if mine != theirs:
                self.bad.append((s, m, self.r.buffers[m],
                                 f"CRC32C {mine:#010x} here, {theirs:#010x} at its sender"))
                self.failed.add(k)

    def _send(self, k: tuple[int, int]) -> None:
        self.unsent.discard(k)
        ms = self.r.out[k]
        buf = np.empty(len(ms) + 2, np.uint32)
        buf[0] = CORRUPT if self.r.needs[k] & self.failed else OK
        buf[1] = len(ms)
        own, apart = self.r.own, self.apart
        buf[2:] = self.sums.read([own[m] if m in apart else self.r.slot[m] for m in ms])
        req = self.transport.send(k[0], buf, self.base + Routes.tag(self.prog.rank, k[1]))
        self.outbox.append((req, buf, k[0]))
