"""One process of ``python -m wb bench`` (spawned; importable by ``multiprocessing``).

Every worker of every method is its own process: trainers ``0 .. T-1``, the broadcast's gather rank
``T`` (on trainer 0's GPU), rollouts after it. All run the same schedule, separated by barriers in
the rendezvous store: a probe of the emulated links, then ``repeats`` rounds of wb, naive P2P and
broadcast (in a rotating order), then wb's four sync modes through Sender/Receiver. Transports are
connected before each barrier, so a measurement starts with every endpoint ready; each method
keeps its transports over its repeats, as a Sender/Receiver keeps them over updates.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

import numpy as np

__all__ = ["bench_main"]


# A timed step starts this long after the last rank reached its barrier: longer than it takes
# every rank to see the barrier complete (the store is polled every few ms)
START_AFTER_S = 0.025


def barrier(store, key: str, ranks, rank: int, timeout: float, *,
             start: bool = False) -> float:
    """Waits until every rank of ``ranks`` reached ``key``; returns the time. With ``start``,
    every rank then waits for one common instant, ``START_AFTER_S`` after the last arrival (the
    ranks share the host's clock), and returns that instant: a timed step then starts on every
    rank at once instead of as each one happens to notice the barrier (up to the store's polling
    interval apart), and its duration, counted from that instant, includes any rank that
    noticed late."""
    store.set(f"{key}/{rank}", repr(time.time()).encode())
    arrived = [float(store.get(f"{key}/{r}", timeout)) for r in ranks]
    if not start:
        return time.time()
    at = max(arrived) + START_AFTER_S
    while (left := at - time.time()) > 0:
        time.sleep(left - 2e-3 if left > 3e-3 else 0)
    return at


class _Ctx:
    def __init__(self, job):
        from wb.data.plan import RankPlan
        from wb.runtime.transport.stores import DirectoryStore

        self.job, self.rank = job, job["rank"]
        self.store = DirectoryStore(job["store_dir"])
        # this rank's part of each plan (None: the rank has no part in it, as the gather rank in
        # wb's plan)
        self.plans = {}
        for k, v in job["plans"].items():
            f = Path(v.format(rank=self.rank))
            self.plans[k] = RankPlan.from_bytes(f.read_bytes()) if f.exists() else None
        self.all_ranks = job["all_ranks"]
        self.gpu_of = {int(r): tuple(g) for r, g in job["gpu_of"].items()}
        self.timeout = job["timeout"]
        self.xp = np
        if job.get("cuda") is not None:
            import cupy

            cupy.cuda.Device(job["cuda"]).use()
            self.xp = cupy

    def barrier(self, key: str, *, start: bool = False) -> float:
        return barrier(self.store, f"b/{key}", self.all_ranks, self.rank, self.timeout,
                        start=start)

    def transport(self, session: str, plan, *, checksums: bool = True):
        """A connected, shaped transport for this rank's peers in ``plan`` (or None), its
        messages checked against their senders' CRC32C or not."""
        from wb.cli.bench.shaped import ShapedTransport
        from wb.runtime.engine.executor import connect
        from wb.runtime.transport.ucx import UcxTransport

        if plan is None or not plan.peers:
            return None
        t = UcxTransport(self.rank, self.store, session=session, timeout=self.timeout,
                         cuda_device=self.job.get("cuda"), polling=self.job.get("polling"),
                         checksums=checksums)
        # as a Sender/Receiver does at set-up; the measured runs (Program.run) then skip this round
        connect(plan, t)
        job = self.job
        if job["links"] == "real":
            return t
        return ShapedTransport(t, gpu_of=self.gpu_of, nic_Bps=job["nic_Bps"],
                               nvlink_Bps=job["nvlink_Bps"])


def bench_main(job: dict) -> None:
    os.environ.setdefault("WB_JOB_KEY", job["job_key"])  # the bench's job signs its records
    out = Path(job["result_dir"]) / f"{job['rank']}.json"
    result: dict = {"rank": job["rank"], "runs": [], "probe": {}, "modes": {}}
    try:
        _run(_Ctx(job), result)
        result["ok"] = True
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the run
        result.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
    finally:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, out)


def _role(part, rank):
    if part is None:
        return None, None
    return part.layout.worker.role.value, part.layout


def _same(xp, bufs, want) -> bool:
    return all(bool(xp.array_equal(bufs[k].view(xp.uint8), want[k].view(xp.uint8))) for k in want)


def _run(c: _Ctx, result: dict) -> None:
    from wb.cli.bench.baselines import FullArena
    from wb.runtime.engine.program import Program
    from wb.layouts.presets import spec_from_config
    from wb.cli.bench.weights import buffers_of

    job, rank, xp = c.job, c.rank, c.xp
    P = c.plans
    role, lay = _role(P["wb"], rank)
    spec = spec_from_config(job["cfg"])
    weights = buffers_of(P["wb"].layout, fill=True, xp=xp) if role else {}
    targets = ({k: xp.zeros_like(v) for k, v in weights.items()} if role == "rollout" else {})
    is_gather = rank == job["gather_rank"]
    arena = None
    if "broadcast" in job["methods"] and (is_gather or role == "rollout"):
        arena = FullArena(spec, job["bcast_names"], xp=xp)
    kw = dict(timeout=c.timeout, staging_bytes=job["staging_bytes"])

    # --- the emulated links, measured: NIC (across nodes) and NVLink (within a node) ----------
    c.barrier("probe-setup")
    phases: dict[str, dict] = {}  # the pairs of a kind run at once; "x:..." kinds with phase x
    for kind, pairs in job["probe_pairs"].items():
        phases.setdefault(kind.split(":")[0], {})[kind] = pairs
    for phase, kinds in phases.items():
        everyone = [x for pairs in kinds.values() for p in pairs for x in p]
        for kind, pairs in kinds.items():
            for a, b in pairs:
                if rank in (a, b):
                    result["probe"][kind] = _probe(c, kind, a, b, everyone, phase)
        c.barrier(f"probe-{phase}")

    # --- EWTT: wb, naive P2P, broadcast (gather, broadcast, load), rotating order ---------------
    # Each method keeps its transports and programs over the repeats, as a Sender/Receiver does
    # over updates: set up (connected, programs worked out) once before its first run, then one
    # tag range per run. The first run also pays for first-use costs (CUDA IPC mappings); the
    # summary reports it apart.
    methods = list(job["methods"])
    kept: dict[str, list] = {}  # method -> [(transport, program) or None per plan it runs]

    def keep(session: str, key: str, *, checksums: bool = False):
        t = c.transport(session, P[key], checksums=checksums)
        return None if t is None else (t, Program(P[key], checksums=checksums))
    for rep in range(job["repeats"]):
        for method in methods[rep % len(methods):] + methods[:rep % len(methods)]:
            key = f"{rep}/{method}"
            for v in targets.values():
                v[...] = 0
            _sync(xp)
            if method not in kept:
                # wb checks every message (its default), "wb-unchecked" is the same plan
                # without; the baselines are plain transfers
                kept[method] = ([keep(f"{method}/g", "gather"), keep(f"{method}/b", "bcast")]
                                if method == "broadcast" else
                                [keep(method, "wb", checksums=method == "wb")]
                                if method in ("wb", "wb-unchecked") else [keep(method, method)])
            used = [k[0] for k in kept[method] if k is not None]
            for t in used:
                if hasattr(t, "link_stats"):
                    t.link_stats(reset=True)
            trace = [] if job.get("trace") and method == "wb" else None
            runkw = dict(kw, tag_base=rep << 32)
            t0 = c.barrier(key, start=True)
            if method == "broadcast":
                gather, bcast = kept[method]
                if gather is not None:
                    t, program = gather
                    program.run(weights if role == "trainer" else arena.views, t, **runkw)
                if bcast is not None:
                    t, program = bcast
                    program.run(arena.views, t, **runkw)
                if role == "rollout":
                    arena.load(lay, targets)
                    _sync(xp)
            else:
                if kept[method][0] is not None:
                    t, program = kept[method][0]
                    program.run(weights if role == "trainer" else targets, t, trace=trace,
                                **runkw)
            end = time.time()
            ok = _same(xp, targets, weights) if role == "rollout" else None
            links = _merge_links([t.link_stats() for t in used if hasattr(t, "link_stats")])
            result["runs"].append({"rep": rep, "method": method, "t0": t0, "end": end, "ok": ok,
                                   "links": links})
            if trace is not None:
                result["msg_trace"] = {"rep": rep, "t0": t0, "messages": trace}
            c.barrier(f"{key}/done")
    for ks in kept.values():
        for k in ks:
            if k is not None:
                k[0].close()
                k[1].release()  # its staging: the processes share the host's memory
    kept.clear()
    c.barrier("ewtt/closed")

    # --- AGST: wb's four sync modes through Sender / Receiver ----------------------------------
    import wb
    from wb.cli.bench.weights import mapped_of, version_bits

    mapped = mapped_of(P["wb"].layout, xp) if role else {}
    for mode in job["modes"]:
        send, recv = wb.MODES[mode]
        t = c.transport(f"mode/{mode}", P["wb"])
        c.barrier(f"mode/{mode}")
        if role == "trainer":
            bufs = {k: v.copy() for k, v in weights.items()}
            tx = wb.Sender(P["wb"], rank, bufs, transport=t, store=c.store, staging=send,
                           name=f"agst/{mode}", timeout=c.timeout, wait_timeout=c.timeout)
            for v in range(1, job["steps"] + 1):
                time.sleep(job["train_s"])  # the rest of a training step (emulated compute)
                for k, a in version_bits(weights, v, mapped, xp).items():
                    bufs[k][...] = a
                _sync(xp)
                tx.push()
            tx.wait()
            result["modes"][mode] = {"stats": [s.to_json() for s in tx.stats], "ok": True}
            tx.close()
        elif role == "rollout":
            live = {k: xp.zeros_like(v) for k, v in weights.items()}
            rx = wb.Receiver(P["wb"], rank, live, transport=t, store=c.store, staging=recv,
                             name=f"agst/{mode}", timeout=c.timeout, wait_timeout=c.timeout)
            good = True
            while rx.version < job["steps"]:
                time.sleep(job["gen_s"])  # a decode step (emulated)
                if rx.ready():
                    v = rx.apply()
                    want = version_bits(weights, v, mapped, xp)
                    good &= _same(xp, live, want)
            result["modes"][mode] = {"stats": [s.to_json() for s in rx.stats], "ok": good}
            rx.close()
        c.barrier(f"mode/{mode}/done")

    # --- versions as a trainer makes them, dense and as deltas (--delta LR) -----------------------
    if job.get("delta_lr"):
        from wb.cli.bench.deltas import run_deltas

        del arena, weights, targets  # the broadcast's copy of the model first: 41 processes
        run_deltas(c, lambda key: c.barrier(key, start=True), result)
        c.barrier("delta/closed")


def _merge_links(stats: list[dict]) -> dict:
    """One worker's emulated-link usage over the transports of one run (the broadcast has two,
    one after the other): bytes and busy time add up, the span runs from the first to the last."""
    out: dict[str, dict] = {}
    for st in stats:
        for k, v in st.items():
            cur = out.setdefault(k, {"bytes": 0, "busy_s": 0.0, "first": v["first"],
                                     "last": v["last"]})
            cur["bytes"] += v["bytes"]
            cur["busy_s"] += v["busy_s"]
            cur["first"], cur["last"] = min(cur["first"], v["first"]), max(cur["last"], v["last"])
    for v in out.values():
        v["span_s"] = v["last"] - v["first"]
    return out


def _sync(xp):
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def _probe(c: _Ctx, kind: str, a: int, b: int, everyone: list[int], phase: str) -> dict:
    """Plain sends of ``probe_bytes`` from ``a`` to ``b`` through the benchmark's transport (shaped
    or not), 4 in flight, all pairs of the probe's ``phase`` at once: a link's rate as the
    executor sees it."""
    from wb.cli.bench.shaped import ShapedTransport
    from wb.runtime.transport.ucx import UcxTransport

    job, xp = c.job, c.xp
    peer = b if c.rank == a else a
    t = UcxTransport(c.rank, c.store, session=f"probe/{kind}", timeout=c.timeout,
                     cuda_device=job.get("cuda"), polling=job.get("polling"))
    t.connect([peer])
    t.prepare([peer])
    st = t if job["links"] == "real" else ShapedTransport(
        t, gpu_of=c.gpu_of, nic_Bps=job["nic_Bps"], nvlink_Bps=job["nvlink_Bps"])
    n, reps = job["probe_bytes"], job["probe_reps"]
    bufs = [xp.ones(n, xp.uint8) for _ in range(4)]
    post = st.send if c.rank == a else st.recv
    for r in [post(peer, buf, 900 + i) for i, buf in enumerate(bufs)]:
        while not r.done():  # warm-up, untimed: first use of each buffer (CUDA IPC handles)
            time.sleep(1e-5)
    _sync(xp)
    t0 = barrier(c.store, f"probe/{phase}/go", everyone, c.rank, c.timeout, start=True)
    pending = []
    for i in range(reps):
        if len(pending) == 4:
            while not pending[0].done():
                time.sleep(1e-5)
            pending.pop(0)
        pending.append(post(peer, bufs[i % 4], 1000 + i))
    for r in pending:
        while not r.done():
            time.sleep(1e-5)
    t1 = time.time()
    t.close()
    return {"bytes": n * reps, "t0": t0, "t1": t1, "Bps": n * reps / (t1 - t0),
            "sender": c.rank == a}
