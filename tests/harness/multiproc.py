"""Run a plan across spawned processes over UCX: the harness of multi-process tests and benchmarks.

The parent saves the plan (``Plan.save``); every child loads it, builds its buffers, runs the
steps of :func:`wb.runtime.engine.executor.execute` over :class:`wb.runtime.transport.ucx.UcxTransport`
with a :class:`wb.runtime.transport.stores.DirectoryStore`, checks its rollout buffers bit for bit, and
writes a JSON result. Trainer weights are a fixed function of each element's id (:func:`weight_bits`), so every
process can make and check them without shipping arrays. Faults can be injected per rank.
"""

from __future__ import annotations

import faulthandler
import json
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from wb.cli.bench.workers import barrier
from wb.cli.bench.weights import (buffers_for, buffers_of, fp8_expected, mapped_of, version_bits,
                                  weight_bits)

__all__ = ["weight_bits", "buffers_for", "mapped_of", "version_bits", "Fault", "run_ranks",
           "child_main", "raw_throughput", "coord_child_main"]


@dataclass
class Fault:
    """What to break on one rank: die or hang after ``after`` sends, give it a different plan, or
    a buffer of the wrong shape."""

    die_after: int | None = None
    hang_after: int | None = None
    stop_after: int | None = None  # SIGSTOP the whole process (every thread stops: a hung host)
    stamp: str | None = None  # a file the time of the death or stop is written to
    exit_before: int | None = None  # a rollout exits before applying this version
    other_plan: str | None = None  # path of another plan file
    bad_buffer: str | None = None  # name of a buffer to give the wrong shape
    in_version: int | None = None  # count sends only from this update on (coordinator runs)
    rejoin_after_s: float | None = None  # run_ranks restarts the dead rank, joining, this later
    pause_before: int | None = None  # a rollout sleeps pause_s before applying this version
    pause_s: float = 0.0
    flip_in: int | None = None  # in this version, one bit of one message goes wrong on the wire
    flip_send: int = 0  # ... of this rank's flip_send-th data message of that version


_STAMP_LOCK = threading.Lock()


class _FaultyTransport:
    def __init__(self, inner, fault: Fault):
        self.inner, self.fault, self.sends = inner, fault, 0
        self.stamped = False
        self.rank = inner.rank
        self.checksums = getattr(inner, "checksums", True)  # what the peers must agree on
        self.armed = fault.in_version is None

    def connect(self, peers, *, hello=b""):
        return self.inner.connect(peers, hello=hello)

    def send(self, peer, buf, tag):
        f = self.fault
        if f.flip_in is not None:
            return self._flipping(peer, buf, tag)
        if not self.armed and f.in_version is not None and tag >> 32 >= f.in_version:
            self.armed = True  # the first send of that version (a tag holds its version)
        if not self.armed:
            return self.inner.send(peer, buf, tag)
        if f.die_after is not None and self.sends >= f.die_after:
            self._stamp()
            os._exit(17)  # a crash: no goodbye to anyone
        if f.stop_after is not None and self.sends >= f.stop_after:
            self._stamp()
            os.kill(os.getpid(), signal.SIGSTOP)
        if f.hang_after is not None and self.sends >= f.hang_after:
            time.sleep(3600)
        self.sends += 1
        return self.inner.send(peer, buf, tag)

    def _flipping(self, peer, buf, tag):
        """Sends a copy with one bit flipped instead of the ``flip_send``-th data message of
        version ``flip_in`` (the bytes the sender hashed stay as they were: the wire broke)."""
        from wb.runtime.engine.digests import DIGEST_TAG

        f = self.fault
        if tag >> 32 == f.flip_in and (tag & ((1 << 27) - 1)) < DIGEST_TAG:
            self.sends += 1
            if self.sends - 1 == f.flip_send:
                if hasattr(buf, "__cuda_array_interface__"):  # a CUDA message: a device copy
                    import cupy

                    bad = cupy.array(cupy.asarray(buf), copy=True).reshape(-1).view(cupy.uint8)
                else:
                    bad = np.array(buf, copy=True).reshape(-1).view(np.uint8)
                bad[bad.size // 2] ^= 0x10
                self.flipped = int(tag & ((1 << 27) - 1))
                if self.fault.stamp:
                    Path(self.fault.stamp).write_text(json.dumps({"message": self.flipped,
                                                                  "peer": peer}))
                return self.inner.send(peer, bad, tag)
        return self.inner.send(peer, buf, tag)

    def _stamp(self) -> None:
        with _STAMP_LOCK:  # several threads may send: the first to break writes, once
            if self.fault.stamp and not self.stamped:
                self.stamped = True
                tmp = Path(self.fault.stamp + ".tmp")
                tmp.write_text(repr(time.time()))
                os.replace(tmp, self.fault.stamp)

    def recv(self, peer, buf, tag):
        return self.inner.recv(peer, buf, tag)

    def prepare(self, peers):  # endpoints, and with a job key its challenge: not faulted
        return self.inner.prepare(peers)

    def describe(self):
        return self.inner.describe()

    def close(self, **kw):
        return self.inner.close(**kw)

    def abort(self):
        return self.inner.abort()

    def cancel(self):
        return self.inner.cancel()

    def add_peers(self, peers):
        return self.inner.add_peers(peers)

    def forget(self, peers):
        return self.inner.forget(peers)


def _barrier(store, plan, rank: int, name: str, options: dict) -> None:
    """Every rank of ``plan`` has reached ``name``; they leave it at one instant
    (:func:`wb.cli.bench.workers.barrier`: a plain store barrier would let them go as each
    notices the last key, up to the store's polling interval apart, and that skew would count
    in every time measured from the earliest start)."""
    barrier(store, name, plan.ranks, rank, options.get("timeout", 60.0), start=True)


def _amax_exchange(store, rank: int, peers):
    """``exchange(name)``: the amax exchange of a trainer holding FP8 blocks in part (as a
    Sender's, through the run's store, under ``name``)."""
    from wb.algorithms.fp8.tasks import combine_amax
    from wb.runtime.engine.fp8 import amax_bytes, amax_from_bytes

    def exchange(name):
        def run(keys, amax):
            store.set(f"amax/{name}/{rank}", amax_bytes(keys, amax))
            return combine_amax([(keys, amax)] + [amax_from_bytes(store.get(f"amax/{name}/{r}", 60))
                                                  for r in peers])
        return run
    return exchange


def _profiler(where: str | None):
    """A running :class:`cProfile.Profile` when ``where`` (a path prefix) is given."""
    if not where:
        return None
    import cProfile

    Path(where).parent.mkdir(parents=True, exist_ok=True)
    prof = cProfile.Profile()
    prof.enable()
    return prof


def child_main(rank: int, plan_path: str, store_dir: str, result_dir: str, options: dict) -> None:
    """One worker process (spawned)."""
    faulthandler.enable()  # a crash in UCX shows where, in the test's captured output
    from wb.data.layout import Role
    from wb.data.plan import Plan, RankPlan
    from wb.errors import ChecksumError, TransferError
    from wb.runtime.engine.executor import connect
    from wb.runtime.engine.program import Program
    from wb.runtime.transport.stores import DirectoryStore
    from wb.runtime.transport.ucx import UcxTransport

    fault = Fault(**options.get("fault", {}))
    result: dict = {"rank": rank}
    try:
        if options.get("parts_dir"):  # this rank's part only (RankPlan bytes), not the plan
            plan = None
            part = RankPlan.from_bytes(Path(options["parts_dir"], f"{rank}.part").read_bytes())
        else:
            plan = Plan.load(fault.other_plan or plan_path)
            part = RankPlan.of(plan, rank)
        lay = part.layout
        trainer = lay.worker.role == Role.TRAINER
        cuda = options.get("cuda_device")
        if isinstance(cuda, dict):  # per role: {"trainer": 0, "rollout": 1} puts them apart
            cuda = cuda["trainer" if trainer else "rollout"]
        xp = np
        if cuda is not None:
            import cupy as xp

            xp.cuda.Device(cuda).use()
        checksums = options.get("checksums", True)  # as wb.UcxTransport's default
        program = Program(part, checksums=checksums)
        fp8 = options.get("fp8")  # {"quantized": Quantized, "own": {rank: Layout}, "held"}
        if fp8 and trainer:  # its own weights, then quantised as a Sender does before a push
            from wb.runtime.engine.fp8 import Quantiser

            bufs = buffers_of(fp8["own"][rank], fill=True, xp=xp)
            live = {n: (xp, a) for n, a in bufs.items()}
            qz = Quantiser(fp8["quantized"], rank, live)
            exchange = _amax_exchange(DirectoryStore(store_dir), rank,
                                      fp8["quantized"].peers.get(rank, ()))
            # once to compile its kernels and make its tables in the order the update sends
            # (as a Sender does at set-up); the second is timed
            order = program.first_sent()
            qz.run(live, exchange("compile"), order=order)
            if xp is not np:
                xp.cuda.runtime.deviceSynchronize()
            tq = time.perf_counter()
            qz.run(live, exchange("timed"), order=order)
            if xp is not np:
                xp.cuda.runtime.deviceSynchronize()
            result["quantize_s"] = time.perf_counter() - tq
            bufs.update(qz.buffers)
        else:
            bufs = buffers_of(lay, fill=trainer, xp=xp)
        if fault.bad_buffer:
            bufs[fault.bad_buffer] = np.zeros(3, bufs[fault.bad_buffer].dtype)
        transport = UcxTransport(rank, DirectoryStore(store_dir), tls=options.get("tls"),
                                 timeout=options.get("timeout", 60.0), cuda_device=cuda,
                                 polling=options.get("polling"), checksums=checksums)
        if fault.die_after is not None or fault.hang_after is not None or \
                fault.flip_in is not None:
            transport = _FaultyTransport(transport, fault)
        # as wb.runtime.engine.executor.execute, with `warmup` updates first over the same
        # connections (a first update also loads kernels and maps peers' memory), each with its
        # own tags
        timeout, staging = options.get("timeout", 60.0), options.get("staging_bytes", 256 << 20)
        if options.get("versions"):  # successive versions, dense or as deltas (bench_fp8 --delta)
            from harness.versions_run import run_versions

            run_versions(program, part, bufs, transport, xp, options, result,
                         lambda name: _barrier(DirectoryStore(store_dir), plan, rank, name,
                                               options))
            Path(result_dir, f"{rank}.json").write_text(json.dumps(result))
            return
        if options.get("warmup"):
            program.check(bufs)  # bad buffers are refused before connecting to anyone
            connect(program.part, transport)
            for w in range(options["warmup"]):
                _barrier(DirectoryStore(store_dir), plan, rank, f"warm{w}", options)
                first = program.run(bufs, transport, tag_base=(w + 1) << 32, timeout=timeout,
                                    staging_bytes=staging)
                result.setdefault("warmup", []).append([first.start_s, first.end_s])
        if fp8 and trainer and fp8.get("before"):  # outside the measured update: its transfer
            qz.run(live, exchange("before"), order=program.first_sent())
            if xp is not np:
                xp.cuda.runtime.deviceSynchronize()
        if options.get("barrier"):  # start together: EWTT then measures the transfer alone
            _barrier(DirectoryStore(store_dir), plan, rank, "go", options)
        t0 = time.time()
        trace = [] if options.get("trace") else None
        if not options.get("warmup"):  # connecting is part of a single transfer's time
            program.check(bufs)
            connect(program.part, transport)
        ready, quantised_at = None, None
        if fp8 and trainer and not fp8.get("before"):  # inside the measured update, as Sender.push
            quantised_at = time.time()
            ready = qz.launch(live, exchange("inside"), order=program.first_sent())
        prof = _profiler(options.get("profile"))
        try:
            stats = program.run(bufs, transport, timeout=timeout, staging_bytes=staging,
                                trace=trace, ready=ready)
            if prof is not None:
                prof.disable()
                prof.dump_stats(f"{options['profile']}_r{rank}.prof")
        except ChecksumError:  # refused, every byte moved: close with the others (a barrier)
            transport.close()
            raise
        if quantised_at is not None:  # the update ran from the quantiser's launch on
            stats = replace(stats, start_s=min(stats.start_s, quantised_at))
            result["quantize_in_ewtt"] = True
        one_sided = json.loads(transport.describe()).get("one_sided") or {}
        result["unpacked"] = one_sided.get("unpacked", 0)  # unpacked from their senders' memory
        result["hashed"] = one_sided.get("hashed", 0)  # copied out of it and hashed in one pass
        transport.close()
        if trace is not None:  # (message, stage, peer, out, nbytes, ready, posted, done)
            result["trace"] = [list(e) for e in trace]
        result.update(asdict(stats), ok=True, connect_s=stats.start_s - t0)
        if not trainer:
            if fp8:
                want = fp8_expected(lay, fp8["quantized"].scaled, fp8["held"], xp=xp)
            else:
                want = buffers_of(lay, fill=True, xp=xp, held=options.get("held"))
            result["bit_identical"] = bool(all(
                xp.array_equal(bufs[k].view(xp.uint8), want[k].view(xp.uint8)) for k in bufs))
    except TransferError as e:
        result.update(ok=False, error=str(e), kind="TransferError")
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test
        result.update(ok=False, error=f"{type(e).__name__}: {e}", kind=type(e).__name__,
                      trace=traceback.format_exc())
    Path(result_dir, f"{rank}.json").write_text(json.dumps(result))


@dataclass
class Run:
    results: dict[int, dict]
    exitcodes: dict[int, int | None]
    wall_s: float


def run_ranks(plan_path: str, ranks: list[int], workdir: str, *, options: dict | None = None,
              faults: dict[int, dict] | None = None, join_timeout: float = 120.0,
              target=None) -> Run:
    """Spawns one process per rank, waits (killing any still alive after ``join_timeout``).
    ``target`` is the child's function (default :func:`child_main`; :func:`coord_child_main`)."""
    ctx = mp.get_context("spawn")
    store_dir, result_dir = Path(workdir, "store"), Path(workdir, "results")
    store_dir.mkdir(parents=True, exist_ok=True)
    result_dir.mkdir(parents=True, exist_ok=True)
    procs = {}
    t0 = time.time()
    for r in ranks:
        opts = dict(options or {})
        if faults and r in faults:
            opts["fault"] = faults[r]
        procs[r] = ctx.Process(target=target or child_main, args=(r, plan_path, str(store_dir),
                                                        str(result_dir), opts), daemon=True)
        procs[r].start()
    deadline = t0 + join_timeout
    rejoin = {r: f["rejoin_after_s"] for r, f in (faults or {}).items() if "rejoin_after_s" in f}
    while rejoin and time.time() < deadline:  # restart the dead that are to come back
        for r in [r for r in rejoin if not procs[r].is_alive()]:
            opts = dict(options or {})
            opts["join_as"] = {"rank": r, "like": r, "after_s": rejoin.pop(r)}  # its own layout
            procs[r] = ctx.Process(target=target or child_main, daemon=True,
                                   args=(r, plan_path, str(store_dir), str(result_dir), opts))
            procs[r].start()
        time.sleep(0.05)
    for r, p in procs.items():  # the healthy first; a faulty one (stopped?) gets 5 s more
        if not (faults and r in faults):
            p.join(max(0.0, deadline - time.time()))
    for r, p in procs.items():
        if faults and r in faults:
            p.join(max(0.0, min(deadline, time.time() + 5.0) - time.time()))
    for p in procs.values():
        if p.is_alive():
            p.kill()
            p.join(5)
    results = {}
    for r in ranks:
        f = result_dir / f"{r}.json"
        results[r] = json.loads(f.read_text()) if f.exists() else None
    return Run(results, {r: p.exitcode for r, p in procs.items()}, time.time() - t0)


def _pair_main(rank: int, pairs: int, nbytes: int, reps: int, store_dir: str, result_dir: str,
               tls: str | None, cuda_device: int | None = None) -> None:
    """Raw UCX: rank 2k sends ``reps`` messages of ``nbytes`` to rank 2k+1 (no packing)."""
    from wb.runtime.transport.stores import DirectoryStore
    from wb.runtime.transport.ucx import UcxTransport

    xp = np
    if isinstance(cuda_device, (tuple, list)):  # (sender's device, receiver's device)
        cuda_device = cuda_device[rank % 2]
    if cuda_device is not None:
        import cupy as xp

        xp.cuda.Device(cuda_device).use()
    store = DirectoryStore(store_dir)
    peer = rank ^ 1
    t = UcxTransport(rank, store, tls=tls, session="raw", cuda_device=cuda_device)
    t.connect([peer])
    window = 4  # messages in flight, like the executor: measures bandwidth, not latency
    # xp.full writes every page: untouched (lazy) pages would measure page faults, not UCX
    bufs = [xp.full(nbytes, 1 if rank % 2 == 0 else 0, xp.uint8) for _ in range(window)]
    buf = bufs[0]
    warm = (t.send if rank % 2 == 0 else t.recv)(peer, buf[:4096], 1 << 40)
    while not warm.done():
        time.sleep(1e-4)
    barrier(store, "go", range(2 * pairs), rank, 60.0, start=True)
    t0 = time.time()
    post = t.send if rank % 2 == 0 else t.recv
    pending = []
    for k in range(reps):
        pending.append(post(peer, bufs[k % window], k))
        while len(pending) >= window or (k == reps - 1 and pending):
            pending = [q for q in pending if not q.done()]
            if len(pending) >= window or (k == reps - 1 and pending):
                time.sleep(1e-5)
    t1 = time.time()
    t.close()
    Path(result_dir, f"raw{rank}.json").write_text(json.dumps({"start": t0, "end": t1}))


def raw_throughput(pairs: int, nbytes: int, reps: int, workdir: str, *, tls: str | None = None,
                   cuda_device: int | None = None) -> dict:
    """Bytes/s of ``pairs`` concurrent sender -> receiver process pairs over UCX (one direction
    each): per pair and in aggregate, measured from a common start."""
    ctx = mp.get_context("spawn")
    store_dir, result_dir = Path(workdir, "rawstore"), Path(workdir, "rawres")
    store_dir.mkdir(parents=True, exist_ok=True)
    result_dir.mkdir(parents=True, exist_ok=True)
    procs = [ctx.Process(target=_pair_main, args=(r, pairs, nbytes, reps, str(store_dir),
                                                  str(result_dir), tls, cuda_device), daemon=True)
             for r in range(2 * pairs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    res = [json.loads(Path(result_dir, f"raw{r}.json").read_text()) for r in range(1, 2 * pairs, 2)]
    start, end = min(r["start"] for r in res), max(r["end"] for r in res)
    per_pair = [nbytes * reps / (r["end"] - r["start"]) for r in res]
    return {"pairs": pairs, "per_pair_Bps": per_pair, "aggregate_Bps": pairs * nbytes * reps / (end - start)}


def _await_version(store_dir: str, v: int | None) -> int:
    """Waits until trainer 0 has announced version ``v`` (a job running); returns the newest
    version it has announced then (0: none, or ``v`` is None)."""
    from wb.runtime.transport.stores import DirectoryStore

    store = DirectoryStore(store_dir)

    def announced(k: int) -> bool:
        try:
            store.get(f"wb/version/{k}/0", 0.001)
            return True
        except Exception:  # noqa: BLE001 - not there yet
            return False
    if v is not None:
        while not announced(v):
            time.sleep(0.02)
    newest = 0
    while announced(newest + 1):
        newest += 1
    return newest


def _joiner_main(rank: int, plan_path: str, store_dir: str, result_dir: str, options: dict,
                 join: dict) -> None:
    """A rollout that joins a running job after ``after_s`` seconds, with the layout of rollout
    ``like`` on node ``node``, and applies every version from the first it is given."""

    import wb
    from wb.data.plan import Plan
    from wb.runtime.transport.stores import DirectoryStore
    from wb.runtime.transport.ucx import UcxTransport

    if "group" in join:
        _group_joiner_main(rank, plan_path, store_dir, result_dir, options, join)
        return
    result: dict = {"rank": rank, "applied": [], "checks": []}
    try:
        time.sleep(join.get("after_s", 0.0))
        result["asked_after_version"] = _await_version(store_dir, join.get("after_version"))
        like = Plan.load(plan_path).layout_of(join["like"])
        buffers = dict(like.buffers)
        if join.get("dtype"):  # another dtype than the trainers' (one wb cannot convert to)
            buffers = {k: wb.BufferSpec(b.sourcemap, join["dtype"]) for k, b in buffers.items()}
        lay = wb.Layout(wb.Worker(rank, join.get("node", like.worker.node), "rollout",
                                  like.worker.local_rank), buffers)
        base = buffers_of(lay, fill=True)
        mapped = mapped_of(lay)
        bufs = {k: np.zeros_like(v) for k, v in base.items()}
        store = DirectoryStore(store_dir)
        timeout = options.get("timeout", 60.0)
        result["asked_at"] = time.time()
        transport = UcxTransport(rank, store, timeout=timeout)
        rx = wb.Receiver.join(store, lay, bufs, transport=transport,
                              staging=options.get("receiver_staging", True), timeout=timeout,
                              wait_timeout=timeout, join_timeout=timeout)
        result["admitted_at"], result["first_version"] = time.time(), rx.version + 1
        for _ in range(rx.version + 1, options["versions"] + 1):
            v = rx.apply()
            want = version_bits(base, v, mapped)
            result["applied"].append(v)
            result["checks"].append(bool(all(np.array_equal(bufs[k].view(np.uint8),
                                                            want[k].view(np.uint8)) for k in bufs)))
        # with a job key: the peers whose challenge it passed (a joiner has no set-up round)
        gate = getattr(transport, "_gate", None)
        result["challenged"] = sorted(gate.trusted) if gate is not None else None
        result["peers"] = sorted(rx._end.peers)  # its last version's
        rx.close()
        result["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test
        result.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
    Path(result_dir, f"{rank}.json").write_text(json.dumps(result))


def _group_joiner_main(rank: int, plan_path: str, store_dir: str, result_dir: str,
                       options: dict, join: dict) -> None:
    """A new replica's process joining a running job with several ranks at once
    (``wb.ReceiverGroup.join``): ``group`` is ``[(rank, like), ...]``, each rank with the layout
    of rollout ``like`` on node ``node``; applies every version from the first and checks every
    rank's buffers."""

    import wb
    from wb.data.plan import Plan
    from wb.runtime.transport.stores import DirectoryStore
    from wb.runtime.transport.ucx import UcxTransport

    result: dict = {"rank": rank, "applied": [], "checks": []}
    try:
        time.sleep(join.get("after_s", 0.0))
        result["asked_after_version"] = _await_version(store_dir, join.get("after_version"))
        plan = Plan.load(plan_path)
        lays, base, mapped, bufs = [], {}, {}, {}
        for r, like_rank in join["group"]:
            like = plan.layout_of(like_rank)
            lay = wb.Layout(wb.Worker(r, join["node"], "rollout", like.worker.local_rank),
                            dict(like.buffers))
            lays.append(lay)
            base[r] = buffers_of(lay, fill=True)
            mapped[r] = mapped_of(lay)
            bufs[r] = {k: np.zeros_like(v) for k, v in base[r].items()}
        store = DirectoryStore(store_dir)
        timeout = options.get("timeout", 60.0)
        result["asked_at"] = time.time()
        rx = wb.ReceiverGroup.join(bufs, lays, transports={
            lay.worker.rank: UcxTransport(lay.worker.rank, store, timeout=timeout) for lay in lays},
            store=store, staging=options.get("receiver_staging", True), timeout=timeout,
            wait_timeout=timeout, join_timeout=timeout)
        result["admitted_at"], result["first_version"] = time.time(), rx.version + 1
        result["firsts"] = {str(r): w.version + 1 for r, w in rx.workers.items()}
        while rx.version < options["versions"]:
            rx.apply()
            v = rx.version
            result["applied"].append(v)
            result["checks"].append(bool(all(
                np.array_equal(bufs[r][k].view(np.uint8),
                               version_bits(base[r], v, mapped[r])[k].view(np.uint8))
                for r in bufs for k in bufs[r])))
        rx.close()
        result["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test
        result.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
    Path(result_dir, f"{rank}.json").write_text(json.dumps(result))


class _LossyStore:
    """A store that loses some keys: their ``set`` is dropped (a store restarted or evicting)."""

    def __init__(self, inner, lose: set[str]):
        self.inner, self.lose = inner, lose

    def set(self, key: str, value: bytes) -> None:
        if key not in self.lose:
            self.inner.set(key, value)

    def get(self, key: str, timeout: float) -> bytes:
        return self.inner.get(key, timeout)


def _repairs(worker) -> list[dict]:
    """The attempt records a Sender's or Receiver's versions ran or saw (wb.runtime.membership.finish)."""
    fin = worker._end.finisher
    return list(fin.repairs) if fin is not None else []


def coord_child_main(rank: int, plan_path: str, store_dir: str, result_dir: str,
                     options: dict) -> None:
    """One worker of a multi-version run through wb.Sender / wb.Receiver (spawned): trainers push
    ``versions`` updates; rollouts apply each and check it; a fault may kill a trainer in one."""
    import wb
    from wb.data.layout import Role
    from wb.data.plan import Plan
    from wb.errors import TransferError
    from wb.runtime.transport.stores import DirectoryStore
    from wb.runtime.transport.ucx import UcxTransport

    fault = Fault(**options.get("fault", {}))
    result: dict = {"rank": rank, "applied": [], "checks": []}
    os.environ.update(options.get("env", {}))  # e.g. the job's key, WB_JOB_KEY
    join = options.get("join_as") or {}
    if join.get("rank") == rank:  # not in the plan: a new rollout joining the running job
        _joiner_main(rank, plan_path, store_dir, result_dir, options, join)
        return
    try:
        plan = Plan.load(plan_path)
        lay = plan.layout_of(rank)
        trainer = lay.worker.role == Role.TRAINER
        store = DirectoryStore(store_dir)
        if options.get("lose_keys"):  # a store that loses these keys (never keeps them)
            store = _LossyStore(store, set(options["lose_keys"]))
        timeout = options.get("timeout", 60.0)
        if options.get("agree"):  # the set-up of a real job: publish the layout, get the part
            from wb.runtime.membership.agree import agree_parts

            plan = agree_parts(store, [lay], world=len(plan.ranks),
                               name=options.get("agree_name", "agree"), timeout=timeout,
                               chunk_bytes=plan.chunk_bytes)
            result["part_messages"] = int(plan[rank].index.size)
        cuda = options.get("cuda_device")  # buffers on that GPU (CuPy); checked on the host
        transport = UcxTransport(rank, store, timeout=timeout, cuda_device=cuda)
        if fault.die_after is not None or fault.stop_after is not None or \
                fault.flip_in is not None:
            transport = _FaultyTransport(transport, fault)
        base = buffers_of(lay, fill=True)
        mapped = mapped_of(lay)
        if cuda is None:
            dev, host = (lambda a: a), (lambda a: a)
        else:
            import cupy

            cupy.cuda.Device(cuda).use()
            dev, host = cupy.asarray, cupy.asnumpy
        kw = dict(transport=transport, store=store, timeout=timeout, wait_timeout=timeout)
        density = options.get("density", 1.0)  # of the elements each version changes
        if trainer:
            bufs = {k: dev(v.copy()) for k, v in base.items()}
            tx = wb.Sender(plan, rank, bufs, staging=options.get("sender_staging", True),
                           delta=options.get("delta", False), **kw)
            for v in range(1, options["versions"] + 1):
                for k, a in version_bits(base, v, mapped, density=density).items():
                    bufs[k][...] = dev(a)  # the training step
                time.sleep(options.get("step_s", 0.0))
                if fault.in_version == v:
                    tx.wait()  # the previous version is out; break this one
                    transport.armed = True
                tx.push()
            tx.close()
            result["repairs"] = _repairs(tx)
            result["deaths"] = list(tx._end.finisher.deaths)  # the leader's calls
        else:
            bufs = {k: dev(np.zeros_like(v)) for k, v in base.items()}
            rx = wb.Receiver(plan, rank, bufs, staging=options.get("receiver_staging", True), **kw)
            for k in range(options["versions"]):
                if fault.exit_before == k + 1:  # between versions: after applying the last
                    if fault.stamp:
                        Path(fault.stamp).write_text(repr(time.time()))
                    os._exit(17)
                if fault.pause_before == k + 1:  # a slow rollout: (sync mode) a long update
                    time.sleep(fault.pause_s)
                try:
                    v = rx.apply()
                except wb.ChecksumError as e:  # refused; the next version comes as usual
                    want = version_bits(base, max(rx.version, 0), mapped, density=density)
                    result.setdefault("refused", []).append({
                        "error": str(e), "bad": [list(b[:3]) for b in e.bad],
                        "version": rx.version, "intact": bool(all(
                            np.array_equal(host(bufs[k]).view(np.uint8),
                                           want[k].view(np.uint8)) for k in bufs))})
                    continue
                except TransferError as e:
                    result["error"], result["error_at"] = str(e), time.time()
                    want = version_bits(base, max(rx.version, 0), mapped, density=density)
                    result["intact"] = bool(all(np.array_equal(host(bufs[k]).view(np.uint8),
                                                               want[k].view(np.uint8))
                                                for k in bufs))
                    result["version_after_error"] = rx.version
                    break
                result.setdefault("applied_at", []).append(time.time())
                want = version_bits(base, v, mapped, density=density)
                result["applied"].append(v)
                result["checks"].append(bool(all(
                    np.array_equal(host(bufs[k]).view(np.uint8), want[k].view(np.uint8))
                    for k in bufs)))
            try:
                rx.close()
            except TransferError as e:  # a peer died: the closing barrier says so
                result["close_error"] = str(e)
            result["repairs"] = _repairs(rx)
            result["received"] = [s.bytes_received for s in rx.stats]
        result["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test
        result.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc(),
                      error_at=time.time())
    Path(result_dir, f"{rank}.json").write_text(json.dumps(result))



def stranger_main(rank: int, plan_path: str, store_dir: str, result_dir: str,
                  options: dict) -> None:
    """A process with another job key than the job's (spawned): it asks to join as rollout
    ``rank`` (with rollout ``like``'s layout), writes records the job reads (a join request of
    its own, a version's record), and sends messages under the tags of version ``version`` to
    rollout ``target``, at the address it reads from the store's raw bytes (the signature cut
    off, as an attacker who can read the store would)."""
    import wb
    from wb.data.plan import Plan, RankPlan
    from wb.runtime.engine.program import Program
    from wb.runtime.transport.keyed import MAGIC
    from wb.runtime.transport.stores import DirectoryStore, set_record
    from wb.runtime.transport.ucx import UcxTransport

    os.environ["WB_JOB_KEY"] = options["key"]
    result: dict = {"rank": rank}
    try:
        plan = Plan.load(plan_path)
        raw = DirectoryStore(store_dir)
        _await_version(store_dir, options["version"] - 1)
        set_record(raw, "wb/v/99/final", {"forged": True})  # unsigned: refused if ever read
        raw.set(f"wb/joinreq/{rank + 1}", b"forged")
        # its messages: every receive of the target in that version, under the plain tags
        t = UcxTransport(rank, raw, timeout=10)
        t.connect([])
        addr = raw.get(f"wb/addr/{options['target']}", 10)
        addr = addr[len(MAGIC) + 32:] if addr.startswith(MAGIC) else addr
        from ucxx._lib.arr import Array

        ep = t._worker.create_endpoint_from_worker_address(
            t._api.UCXAddress.create_from_buffer(np.frombuffer(addr, np.uint8)), False)
        prog = Program(RankPlan.of(plan, options["target"]))
        sent = []
        for m, g in prog.units.items():
            if not g.out:
                junk = np.full(g.nbytes, 0x5A, np.uint8)
                sent.append((ep.tag_send(Array(junk), t._api.UCXXTag(
                    (options["version"] << 32) + m)), junk))
        result["sent"] = len(sent)
        # and asks to join: the leader is never to take it in
        like = plan.layout_of(options["like"])
        lay = wb.Layout(wb.Worker(rank, like.worker.node, "rollout", like.worker.local_rank),
                        dict(like.buffers))
        bufs = {k: np.zeros(b.sourcemap.shape, b.dtype) for k, b in like.buffers.items()}
        try:
            wb.Receiver.join(raw, lay, bufs, transport=UcxTransport(rank, raw, timeout=10),
                             timeout=10, wait_timeout=10, join_timeout=options["join_s"])
            result["admitted"] = True
        except wb.TransferError as e:
            result.update(admitted=False, join_error=str(e))
        result["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test
        result.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
    Path(result_dir, f"{rank}.json").write_text(json.dumps(result))


def _messages_main(rank: int, nbytes: int, count: int, store_dir: str, result_dir: str,
                   tls: str | None, cuda_device: int | None) -> None:
    """Raw UCX, many small messages: rank 0 posts ``count`` sends of ``nbytes`` (each its own
    range of one buffer, its own tag) to rank 1, which posts as many receives; each then takes
    its completions. Times from the first post to the last completion."""
    from wb.runtime.transport.stores import DirectoryStore
    from wb.runtime.transport.ucx import UcxTransport

    xp = np
    if cuda_device is not None:
        import cupy as xp

        xp.cuda.Device(cuda_device).use()
    store = DirectoryStore(store_dir)
    peer = rank ^ 1
    t = UcxTransport(rank, store, tls=tls, session="msgs", cuda_device=cuda_device)
    t.connect([peer])
    buf = xp.full(nbytes * count, 1 if rank == 0 else 0, xp.uint8)
    post = t.send if rank == 0 else t.recv
    warm = post(peer, buf[:nbytes], 1 << 40)
    while not warm.done():
        time.sleep(1e-5)
    if cuda_device is not None:
        from wb.runtime.engine.inflight import DeviceBytes

        views = [DeviceBytes(buf, k * nbytes, nbytes) for k in range(count)]
    else:
        views = [buf[k * nbytes:(k + 1) * nbytes] for k in range(count)]
    barrier(store, "go", range(2), rank, 60.0, start=True)
    t0 = time.perf_counter()
    pending = [post(peer, v, k) for k, v in enumerate(views)]
    posted = time.perf_counter()
    while pending:
        pending = [q for q in pending if not q.done()]
    t1 = time.perf_counter()
    t.close()
    Path(result_dir, f"msgs{rank}.json").write_text(json.dumps(
        {"seconds": t1 - t0, "post_seconds": posted - t0}))


def raw_messages(nbytes: int, count: int, workdir: str, *, tls: str | None = None,
                 cuda_device: int | None = None) -> dict:
    """Seconds one process takes to send ``count`` messages of ``nbytes`` over UCX and another to
    receive them (each from its first post to its last completion): ``{"send", "recv"}``, and the
    posting alone (``send_post``, ``recv_post``)."""
    ctx = mp.get_context("spawn")
    store_dir, result_dir = Path(workdir, "store"), Path(workdir, "res")
    store_dir.mkdir(parents=True, exist_ok=True)
    result_dir.mkdir(parents=True, exist_ok=True)
    procs = [ctx.Process(target=_messages_main, args=(r, nbytes, count, str(store_dir),
                                                      str(result_dir), tls, cuda_device),
                         daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    res = [json.loads(Path(result_dir, f"msgs{r}.json").read_text()) for r in range(2)]
    return {"send": res[0]["seconds"], "recv": res[1]["seconds"],
            "send_post": res[0]["post_seconds"], "recv_post": res[1]["post_seconds"]}
