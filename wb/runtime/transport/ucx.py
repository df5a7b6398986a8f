"""UCX transport over ``ucxx``: tag send/recv between worker-address endpoints.

Nothing happens at import or construction: the UCX context and worker are created by
:meth:`UcxTransport.connect`. Each rank publishes its worker address through a rendezvous
:class:`~wb.runtime.transport.stores.Store` and creates an endpoint from each peer's address. Endpoints are created
with UCX error handling off on both sides, because UCX's shared-memory transports (which a user
may allow) need it; a peer that dies is noticed through heartbeats (:mod:`wb.runtime.membership.liveness`).

UCX moves large tagged messages by zero-copy rendezvous: CUDA IPC between GPUs of one node,
RDMA over InfiniBand/RoCE when UCX has verbs, cross-memory attach (``cma``) between processes of
one host, TCP otherwise. Which transports are allowed is ``tls`` (UCX's ``UCX_TLS``):

- default on a machine without GPUs: ``tcp,cma,self``, or ``tcp,self`` where cross-memory attach
  is forbidden (:func:`cma_usable`: Yama's ``ptrace_scope`` above 0, or a seccomp filter that
  refuses ``process_vm_readv``, as container runtimes do by default).
- default on a machine with GPUs: ``cuda_ipc,cuda_copy,tcp`` and the same, plus ``rc`` (RDMA)
  when the system's UCX is used (``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true``: PyPI's has no verbs).
- ``UCX_TLS`` in the environment, or the ``tls`` argument, overrides both.

UCX's shared-memory transports (``posix``, ``sysv``) are left out on purpose: their receive queue
is a ring every local peer writes into, and a peer killed while it writes leaves a slot that is
never filled, behind which its receiver waits forever, for every other peer's messages too (a
kill -9 mid-message of a peer streaming small messages wedged its receiver in 5 of 20 tries;
with ``tcp,cma,self``, in none). wb finishes versions without dead rollouts
(:mod:`wb.runtime.membership.finish`), so a survivor's transport must outlive its peers. Where no process
can die mid-update, ``UCX_TLS=tcp,posix,sysv,self`` is faster for small messages.

Between the processes of one host, messages go one-sided where both ends chose it (``ipc``;
by default with CUDA buffers): the sender only notes where its bytes are, the receiver copies them
from its mapping of the sender's memory, and notes and acknowledgements travel in batches as
small tag messages (:mod:`~wb.runtime.transport.ipc`); UCX's rendezvous, two control messages
over TCP per message, is then left to what cannot go one-sided.

PyPI's ``libucx`` wheels are built without InfiniBand verbs. On an InfiniBand cluster, use the
system's UCX: ``RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true`` (with the system UCX on the library
path) makes ``ucxx`` load it; then ``rc`` (and ``dc``/``ud``) carry stage 1 and 2 by RDMA.
"""

from __future__ import annotations

import hashlib
import glob
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np

from wb.errors import AuthError, TransferError
from wb.runtime.transport.ipc import Channel
from wb.runtime.transport.memory import CudaMemory, HostMemory, cma_usable, host_id
from wb.runtime.transport.challenge import Gate, challenge
from wb.runtime.transport.keyed import KeyedStore, keyed, tag_secret
from wb.runtime.transport.stores import Store
from wb.runtime.transport import ucx_env

__all__ = ["UcxTransport", "default_tls", "cma_usable"]

log = logging.getLogger(__name__)

_GPU_TLS = "cuda_ipc,cuda_copy,"
_PROGRESS = ("polling", "blocking", "caller")  # who progresses the worker (UcxTransport)
_IPC = ("cuda", "host", "off")  # how messages move within a host (UcxTransport)
_TICK_S = 5e-6  # a request's done() progresses the worker at most this often (progress="caller")
_CLOSE_WAIT_S = 10.0  # for peers to close their endpoints, once all are done (they close at once)


def default_tls() -> str:
    """The UCX transports used when neither ``tls=`` nor ``UCX_TLS`` says otherwise (see the
    module doc)."""
    if os.environ.get("UCX_TLS"):
        return os.environ["UCX_TLS"]
    tls = "tcp,cma,self" if cma_usable() else "tcp,self"
    if glob.glob("/dev/nvidia[0-9]*"):
        tls = _GPU_TLS + tls
    if os.environ.get("RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY", "").lower() in ("1", "true", "yes"):
        tls = "rc," + tls  # the system's UCX: built with verbs on an InfiniBand cluster
    return tls


class _UcxRequest:
    __slots__ = ("req", "peer", "tag", "what", "rank", "buf", "tick", "__weakref__")

    def __init__(self, req, peer: int, tag: int, what: str, rank: int, buf, tick=None):
        self.req, self.peer, self.tag, self.what, self.rank = req, peer, tag, what, rank
        self.buf = buf  # keep the memory alive while UCX may touch it
        self.tick = tick  # progress="caller": progresses the worker (rate-limited)

    def done(self) -> bool:
        if not self.req.completed:
            if self.tick is None:
                return False
            self.tick()
            if not self.req.completed:
                return False
        try:
            self.req.check_error()
        except Exception as e:  # noqa: BLE001 - every ucxx error becomes a TransferError
            err = TransferError(f"rank {self.rank}: UCX {self.what} of tag {self.tag:#x} with "
                                f"peer {self.peer} failed: {type(e).__name__}: {e}")
            err.peer = self.peer  # the update may go on without it (wb.runtime.membership.finish)
            raise err from e
        return True


class UcxTransport:
    """Tagged byte transport between ranks over UCX.

    Args:
        rank: this worker's global rank.
        store: the rendezvous store every rank of the plan shares.
        tls: UCX transports (``UCX_TLS``); default :func:`default_tls`.
        session: a name that keeps the keys of concurrent sessions in one store apart.
        timeout: seconds to wait for peers' addresses and for the closing barrier.
        cuda_device: the CUDA device whose buffers this worker sends (gives UCX's progress
            thread a context on it); ``None`` for host buffers.
        polling: ``True``: ``progress="polling"``; ``False``: ``"blocking"``.
        progress: who progresses the UCX worker: ``"polling"`` (a thread of UCX's that
            busy-polls), ``"blocking"`` (the same thread, waiting on events; posts are handed to
            it) or ``"caller"`` (no thread: the threads that post and complete requests progress
            it, :meth:`progress`, so a post never contends with a polling thread for the
            worker; a thread progresses it only while the transport closes). Default: the
            environment's ``WB_UCX_PROGRESS``, else ``polling`` as given, else ``"caller"``
            with ``cuda_device`` and ``"blocking"`` without.
        checksums: every message is checked against its sender's CRC32C
            (:mod:`wb.runtime.engine.digests`); every worker of a job must say the same. Default:
            on, unless the environment's ``WB_CHECKSUMS`` is ``0``.
        key: the job's key (default the environment's ``WB_JOB_KEY``): the addresses and hellos
            it puts in the store are signed, and peers' are refused without the same key
            (:mod:`wb.runtime.transport.keyed`); every tag is XORed with 64 bits drawn from the
            key (:func:`~wb.runtime.transport.keyed.tag_secret`), so a process without it can
            neither reach a worker (no signed address) nor address a message to one of its
            receives.
        ipc: how messages move between processes of this host: ``"cuda"`` (CUDA buffers
            one-sided, through CUDA IPC handles: :mod:`~wb.runtime.transport.ipc`), ``"host"``
            (host buffers one-sided, with ``process_vm_readv``) or ``"off"`` (every message a
            UCX tag message). Default: the environment's ``WB_IPC``, else ``"cuda"`` with
            ``cuda_device`` and ``"off"`` without (``"1"``: ``"cuda"`` with ``cuda_device``, else
            ``"host"``). A pair of ranks goes one-sided only where both chose the same and
            share the host; other messages, and whatever cannot go one-sided, are UCX tag
            messages.
    """

    def __init__(self, rank: int, store: Store, *, tls: str | None = None, session: str = "wb",
                 timeout: float = 60.0, cuda_device: int | None = None,
                 polling: bool | None = None, progress: str | None = None,
                 checksums: bool | None = None, key: bytes | str | None = None,
                 ipc: str | None = None):
        self.rank, self.session, self.timeout = int(rank), session, timeout
        self.store = keyed(store, key)
        self._secret = tag_secret(self.store, session)
        # with a key, messages with a peer not challenged yet wait for its challenge
        self._gate = (Gate(self._send, self._recv, self.rank, self.store.key, timeout=timeout,
                           where=self._address_of) if isinstance(self.store, KeyedStore) else None)
        self.checksums = (os.environ.get("WB_CHECKSUMS", "1") != "0" if checksums is None
                          else bool(checksums))
        self.cuda_device = cuda_device
        # Who progresses it, by default: the caller with a CUDA device (a polling thread makes
        # every post contend with it for the worker: 38 us per send of CUDA memory on an H200
        # host, 17 us progressed by the caller; bench/results/fp8/COMMAND.md), a thread waiting
        # on events on hosts
        progress = progress or os.environ.get("WB_UCX_PROGRESS") or (
            "caller" if polling is None and cuda_device is not None else
            "polling" if polling else "blocking")
        if progress not in _PROGRESS:
            raise TransferError(f"UcxTransport: progress={progress!r} (or WB_UCX_PROGRESS) must "
                                f"be one of {', '.join(_PROGRESS)}")
        self.progress_mode = progress
        ipc = ipc or os.environ.get("WB_IPC") or ("cuda" if cuda_device is not None else "off")
        ipc = {"0": "off", "1": "cuda" if cuda_device is not None else "host"}.get(ipc, ipc)
        if ipc not in _IPC or (ipc == "cuda" and cuda_device is None):
            raise TransferError(f"UcxTransport: ipc={ipc!r} (or WB_IPC) must be one of "
                                f"{', '.join(_IPC)}; 'cuda' needs cuda_device")
        if ipc == "host" and not cma_usable():
            log.info("rank %d: ipc='host' needs process_vm_readv, refused here: off", rank)
            ipc = "off"
        self.ipc_mode = ipc
        self._ipc: Channel | None = None
        self._ipc_peers: dict[int, bool] = {}
        self.polling = progress == "polling"
        self._last_tick = 0.0
        self.tls = tls or default_tls()
        self._ctx = self._worker = None
        self._eps: dict[int, Any] = {}
        self._stale: list[Any] = []  # endpoints to peers that died (forget), closed at close()
        # Requests the caller still holds (weakly: a completed one it drops goes, with its
        # buffer), and those a cancel() left behind, held until they complete or close(): ucxx
        # cannot withdraw a posted receive, so UCX may still write into its buffer (a peer's late
        # message of the abandoned attempt), which must never be freed and reused meanwhile.
        self._posted: weakref.WeakSet[_UcxRequest] = weakref.WeakSet()
        self._abandoned: list[_UcxRequest] = []
        self._peers: list[int] = []
        self._round = 0

    # --- lifetime ------------------------------------------------------------------------------
    def connect(self, peers: Iterable[int], *, hello: bytes = b"") -> dict[int, bytes]:
        """Connects to ``peers`` (creating the UCX context and worker the first time); publishes
        ``hello`` and returns each peer's. Every later call is a new *round* on the same worker and
        endpoints (one per update of a :class:`wb.Sender`): UCX state, CUDA IPC mappings included,
        is kept across updates. Every rank must call ``connect`` the same number of times."""
        if self._worker is None:
            self._start()
        else:
            self._round += 1
            if self._ipc is not None:
                self._ipc.new_round()
        self.store.set(f"{self.session}/hello/{self._round}/{self.rank}", hello)
        # endpoints come at first use: a caller may refuse a peer's hello (another plan) first
        self._peers = sorted(set(self._peers) | (set(int(p) for p in peers) - {self.rank}))
        return {p: self._get(f"hello/{self._round}/{p}", p)
                for p in sorted(set(int(p) for p in peers) - {self.rank})}

    def _start(self) -> None:
        ucx_env.prepare(self.tls)  # what UCX reads when ucxx first loads it
        try:
            import ucxx._lib.libucxx as ucx_api
        except ImportError as e:
            raise TransferError("the UCX transport needs ucxx: pip install 'weightbridge[ucx]' "
                                "(or [ucx-cu12])") from e
        self._api = ucx_api
        self._ctx = ucx_api.UCXContext(config_dict={"TLS": self.tls},
                                       feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        # With a blocking progress thread, a send posted from this thread while the progress
        # thread sleeps in epoll could wait forever (seen with rate-shaped sends of 1 MiB):
        # delayed submission hands every post to the progress thread and wakes it.
        caller = self.progress_mode == "caller"
        self._worker = ucx_api.UCXWorker(
            self._ctx, enable_delayed_submission=self.progress_mode == "blocking")
        if self.cuda_device is not None:
            # UCX's progress thread touches device memory (CUDA IPC, cuda_copy): it needs the
            # same CUDA context as this thread
            from ucxx._cuda_context import ensure_cuda_context

            ensure_cuda_context(self.cuda_device)
            self._worker.set_progress_thread_start_callback(ensure_cuda_context,
                                                            cb_args=(self.cuda_device,))
        if not caller:
            self._worker.start_progress_thread(polling_mode=self.polling)
        self._round = 0
        if self.ipc_mode != "off":
            self._ipc = Channel(self, CudaMemory(self.cuda_device) if self.ipc_mode == "cuda"
                                else HostMemory())
        self.store.set(f"{self.session}/ipc/{self.rank}", json.dumps(
            {"host": host_id(), "memory": self.ipc_mode,
             "seq0": self._ipc.seq0 if self._ipc is not None else 0}).encode())
        self.store.set(f"{self.session}/addr/{self.rank}", self._worker.address.tobytes())
        log.info("rank %d: UCX %s, TLS=%s, progress %s", self.rank, self._api.get_ucx_version(),
                 self.tls, self.progress_mode)

    def progress(self) -> None:
        """Progresses the UCX worker (``progress="caller"``; else its thread does, and this
        returns at once): completes what can complete, starts what was posted."""
        if self._worker is not None and self.progress_mode == "caller":
            self._last_tick = time.perf_counter()
            self._worker.progress()

    def _tick(self) -> None:
        """:meth:`progress`, unless it ran in the last few microseconds (a request's ``done``
        asks: a loop over many requests progresses the worker once per turn, not per request)."""
        if time.perf_counter() - self._last_tick > _TICK_S:
            self.progress()

    def _get(self, key: str, peer: int) -> bytes:
        try:
            return self.store.get(f"{self.session}/{key}", self.timeout)
        except AuthError as e:
            raise AuthError(f"rank {self.rank}: peer {peer}'s `{key}` in the rendezvous store is "
                            f"not signed with this job's key: refused (does that process run "
                            f"with another WB_JOB_KEY, or none?)") from e
        except TransferError as e:
            raise TransferError(f"rank {self.rank}: peer {peer} did not show up within "
                                f"{self.timeout:.1f} s (no `{key}` in the rendezvous store); is it "
                                f"running, with the same store and session?") from e

    def close(self, *, barrier: bool = True) -> None:
        if self._worker is None:
            return
        all_done = False
        if self._ipc is not None:  # its copies finish and its mappings close while peers live
            self._ipc.close()
        if self.progress_mode == "caller":  # the barrier, then closing, need the worker progressed
            # (a peer's last message may wait for an acknowledgement this worker still sends)
            self._worker.start_progress_thread(polling_mode=False)
        try:
            if barrier:  # peers may still be receiving what UCX already counts as sent
                self.store.set(f"{self.session}/done/{self.rank}", b"1")
                for p in self._peers:
                    try:
                        self.store.get(f"{self.session}/done/{p}", self.timeout)
                    except TransferError as e:
                        raise TransferError(f"rank {self.rank}: peer {p} did not finish its part "
                                            f"of the plan within {self.timeout:.1f} s") from e
                all_done = True
        finally:
            # endpoints close through the progress thread while it runs (else they can spin forever)
            closed = threading.Semaphore(0)
            eps = [*self._eps.values(), *self._stale]
            for ep in eps:
                try:
                    ep.set_close_callback(closed.release)
                    ep.close()
                except Exception:  # noqa: BLE001 - closing anyway; the peer may be gone
                    closed.release()
                    log.debug("rank %d: closing an endpoint failed", self.rank, exc_info=True)
            deadline = time.monotonic() + 2.0
            for _ in eps:
                if not closed.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    log.warning("rank %d: UCX endpoints still closing after 2 s", self.rank)
                    break
            for ep in eps:  # an endpoint failing later would call back into freed memory
                ep.remove_close_callback()  # (the callback's data goes with the Python object)
            self._eps, self._stale = {}, []
            if all_done:
                self._closed_barrier()
            self._worker.stop_progress_thread()
            self._worker = self._ctx = None
            self._posted, self._abandoned = weakref.WeakSet(), []  # no worker writes any more
            self._ipc, self._ipc_peers = None, {}

    def _closed_barrier(self) -> None:
        # A peer that stops its worker while an endpoint of this rank to it still flushes on
        # close resets the connection, and UCX prints "error during flush" on stderr (harmless,
        # but noise in every benchmark run): every rank keeps its worker until all have closed.
        self.store.set(f"{self.session}/closed/{self.rank}", b"1")
        for p in self._peers:
            try:
                self.store.get(f"{self.session}/closed/{p}", min(self.timeout, _CLOSE_WAIT_S))
            except TransferError:
                log.warning("rank %d: peer %d had not closed its UCX endpoints after %.0f s",
                            self.rank, p, min(self.timeout, _CLOSE_WAIT_S))
                return

    def abort(self) -> None:
        """Drops everything in flight (after a failure); no barrier."""
        if self._worker is not None:
            self._worker.cancel_inflight_requests()
            self.close(barrier=False)

    def cancel(self) -> None:
        """Cancels every request in flight and keeps the connections (a version goes on without
        its stalled attempt: :mod:`wb.runtime.membership.finish`). What UCX cannot withdraw (a posted
        receive may still be matched by a late message) keeps its buffer alive, never reused,
        until it completes or the transport closes."""
        if self._worker is not None:
            self._worker.cancel_inflight_requests()
        self._abandoned = [r for r in (*self._abandoned, *self._posted) if not r.req.completed]
        self._posted = weakref.WeakSet()
        if self._ipc is not None:
            self._ipc.cancel()
        if self._gate is not None:
            self._gate.cancel()

    def add_peers(self, peers: Iterable[int]) -> None:
        """Allows sends and receives with ``peers`` too (ranks of the same session, whose
        addresses are in the store), without a new :meth:`connect` round."""
        self._peers = sorted(set(self._peers) | (set(int(p) for p in peers) - {self.rank}))

    def forget(self, peers: Iterable[int]) -> None:
        """Drops ``peers`` (dead): their endpoints are closed and :meth:`close` waits for them no
        more."""
        gone = set(int(p) for p in peers)
        self._peers = [p for p in self._peers if p not in gone]
        for p in gone:
            ep = self._eps.pop(p, None)
            if ep is not None:  # closed with the others, while the progress thread runs
                self._stale.append(ep)
        if self._ipc is not None:
            self._ipc.forget(gone)
        for p in gone:  # a process that takes the rank later is met anew (its own record)
            self._ipc_peers.pop(p, None)
        if self._gate is not None:  # and challenged anew
            self._gate.forget(gone)

    # --- transfers -----------------------------------------------------------------------------
    def _ep(self, peer: int):
        ep = self._eps.get(peer)
        if ep is None:
            if peer not in self._peers:
                raise TransferError(f"rank {self.rank} is not connected to peer {peer}; pass it "
                                    f"to connect()")
            raw = self._get(f"addr/{peer}", peer)
            try:
                address = self._api.UCXAddress.create_from_buffer(np.frombuffer(raw, np.uint8))
                ep = self._worker.create_endpoint_from_worker_address(address, False)
            except Exception as e:  # noqa: BLE001 - every ucxx error becomes a TransferError
                err = TransferError(f"rank {self.rank}: cannot reach peer {peer} over UCX "
                                    f"(TLS={self.tls}): {type(e).__name__}: {e}")
                err.peer = peer  # dead since it published its address (wb.runtime.membership.finish)
                raise err from e
            self._eps[peer] = ep
        return ep

    def prepare(self, peers: Iterable[int]) -> None:
        """Creates the endpoints to ``peers`` now (connected peers only) rather than at first use;
        with a job key, each peer then answers its challenge (:mod:`~wb.runtime.transport.
        challenge`: every peer of a plan prepares at its set-up) before any update. A peer met
        later (:meth:`add_peers`) is challenged where the first message with it is posted.

        Raises:
            AuthError: a peer answered with another key, or not in time (named, with its
                address)."""
        peers = [int(p) for p in peers]
        for p in peers:
            self._ep(p)
        if self._gate is not None and peers:
            challenge(self._send, self._recv, self.rank, peers, self.store.key,
                      round_=self._round, timeout=self.timeout, where=self._address_of,
                      progress=self.progress)
            self._gate.trusted.update(peers)

    def _address_of(self, peer: int) -> str:
        """`` (address <digest>)``: a peer's UCX worker address, as an error names it."""
        try:
            raw = self.store.get(f"{self.session}/addr/{peer}", 0.01)
        except TransferError:
            return ""
        return f" (UCX address sha256 {hashlib.sha256(raw).hexdigest()[:16]})"

    def send(self, peer: int, buf, tag: int):
        if self._gate is not None and peer not in self._gate.trusted:
            return self._gate.hold(peer, tag, lambda: self._send(peer, buf, tag))
        return self._send(peer, buf, tag)

    def recv(self, peer: int, buf, tag: int, *, upto: bool = False, unpack=None, hashed=None):
        if self._gate is not None and peer not in self._gate.trusted:
            return self._gate.hold(peer, tag, lambda: self._recv(peer, buf, tag, upto=upto))
        return self._recv(peer, buf, tag, upto=upto, unpack=unpack, hashed=hashed)

    # receives take hashed=(hasher, key): copied and hashed in one pass (ipc.Channel.recv)
    copies_hashed = property(lambda self: self.ipc_mode == "cuda" and self._ipc is not None)

    def unpacks_from(self, peer: int) -> bool:
        """Whether a receive from ``peer`` may take ``unpack=(unpacker, key)``: unpacked from
        the sender's memory (``buf`` untouched, the request's ``unpacked`` true; ipc)."""
        return self.ipc_mode == "cuda" and self._ipc is not None and (
            self._gate is None or peer in self._gate.trusted) and self._one_sided(peer)

    def stage_send(self, peer: int, buf) -> bool | None:
        """Whether a message to ``peer`` should leave from staging, not ``buf``: CUDA memory the
        one-sided channel cannot export (JAX's) would take UCX's far slower path. ``None`` while
        ``peer`` is not trusted yet (the job key's challenge running): that is not settled."""
        if self._ipc is None:
            return False
        if self._gate is not None and peer not in self._gate.trusted:
            return None
        return self._one_sided(peer) and self._ipc.unexportable(buf)

    def _send(self, peer: int, buf, tag: int):
        if self._ipc is not None and self._one_sided(peer):
            return self._ipc.send(peer, buf, tag)
        return self._post("send", peer, buf, tag)

    def _recv(self, peer: int, buf, tag: int, *, upto: bool = False, unpack=None, hashed=None):
        if self._ipc is not None and self._one_sided(peer):
            return self._ipc.recv(peer, buf, tag, upto=upto, unpack=unpack, hashed=hashed)
        return self._post("recv", peer, buf, tag)  # UCX takes a shorter message as it is

    def _one_sided(self, peer: int) -> bool:
        """Whether messages with ``peer`` go through the one-sided channel: both chose the same
        kind and share this host (both ranks decide alike from both records)."""
        ok = self._ipc_peers.get(peer)
        if ok is None:
            if peer not in self._peers:
                raise TransferError(f"rank {self.rank} is not connected to peer {peer}; pass it "
                                    f"to connect()")
            theirs = json.loads(self._get(f"ipc/{peer}", peer))
            ok = self._ipc_peers[peer] = (theirs.get("memory") == self.ipc_mode
                                          and theirs.get("host") == host_id())
            if ok:
                self._ipc.meet(peer, int(theirs["seq0"]))
                log.info("rank %d: messages with peer %d go one-sided (%s)", self.rank, peer,
                         self.ipc_mode)
        return ok

    def _post(self, what: str, peer: int, buf, tag: int) -> _UcxRequest:
        from ucxx._lib.arr import Array

        ep = self._ep(peer)
        post = ep.tag_send if what == "send" else ep.tag_recv
        try:
            req = post(Array(buf), self._api.UCXXTag(int(tag) ^ self._secret))
        except Exception as e:  # noqa: BLE001 - every ucxx error becomes a TransferError
            raise TransferError(f"rank {self.rank}: UCX {what} of tag {tag:#x} with peer {peer} "
                                f"failed: {type(e).__name__}: {e}") from e
        out = _UcxRequest(req, peer, tag, what, self.rank, buf,
                          self._tick if self.progress_mode == "caller" else None)
        self._posted.add(out)
        return out

    def describe(self) -> str:
        cuda = bool(self._ctx.cuda_support) if self._ctx is not None else None
        return json.dumps({"transport": "ucx", "rank": self.rank, "tls": self.tls,
                           "progress": self.progress_mode, "ipc": self.ipc_mode,
                           "one_sided": self._ipc.describe() if self._ipc is not None else None,
                           "cuda_support": cuda, "peers": self._peers})
