"""Chaos run: rollouts killed (kill -9) and restarted at random while training pushes versions.

Spawned processes over UCX (``wb.Sender`` / ``wb.Receiver`` with staging on both sides): 2
trainer processes (TP 2) feed ``--replicas`` rollout replicas of 2 processes each (one node per
replica: stage 2 between replicas, stage 3 inside one). Once version 2 is out, a supervisor kills
``--faults`` times a random rollout process, or a whole replica (``--replica-p``), at random
moments (each kill is classed by what the victim was doing: mid-transfer or between versions), and
restarts each killed process after a random delay: it joins the running job
(``wb.Receiver.join``) with its own rank and layout. Every rollout checks every version it applies
against the weights of that version, bit for bit, and logs it at once (a line per version: kept
when the process is killed). The trainers push until every fault is injected and every restarted
process is back, then 3 more versions.

Reported (``--json``): versions sent; per replica, versions applied and verified; torn reads (a
version applied whose bytes are not all that version's: must be 0); the longest stall a surviving
rollout saw (``apply`` blocked); each death's detection time (the trainers' leader called it dead)
and each restart's rejoin time and how many versions behind the current one it came back; EWTT of
the versions during which a process died against the clean ones (no death, and no joiner's first
version). Exits non-zero when a check fails or the run hangs.

``--delta LR``: the weights are bfloat16 and each version is an Adam step at that learning rate
(:class:`wb.testing.versions.AdamById`); the trainers send deltas (``wb.Sender(delta=True)``), so
restarted rollouts, survivors of a repair and every rollout after a membership change must come
back on dense bytes, never on a wrong base. Also reported then: the bytes the rollouts received
per version (``received_by_version``).

A training step is 1 s by default (RL steps take seconds to minutes): "back within two versions
of its restart" counts versions, so a step shorter than a restarted process's own start-up
(interpreter, imports, UCX: ~0.7 s on a 2-core machine) counts that start-up, not wb.

    python bench/chaos.py [--replicas 4] [--faults 20] [--seed 0] [--step 1.0] [--rows 256 --cols 192]
        [--delta 1e-6] [--json] [--out FILE]
"""

from __future__ import annotations

import argparse
import compileall
import json
import multiprocessing as mp
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

TRAINERS = 2


def _layouts(replicas: int, rows: int = 256, cols: int = 192, dtype: str = "float32"):
    import wb

    w = np.arange(rows * cols, dtype=np.int64).reshape(rows, cols)
    norm = w.size + np.arange(cols)
    f32 = lambda ids: wb.BufferSpec(wb.SourceMap.from_indices(ids), dtype)  # noqa: E731
    c, r = cols // TRAINERS, rows // 2
    trainers = [wb.Layout(wb.Worker(t, "t0", "trainer", t),
                          {"w": f32(w[:, c * t:c * (t + 1)].T), "n": f32(norm)})
                for t in range(TRAINERS)]
    rollouts = [wb.Layout(wb.Worker(TRAINERS + 2 * n + g, f"r{n}", "rollout", g),
                          {"w": f32(w[r * g:r * (g + 1)]), "n": f32(norm)})
                for n in range(replicas) for g in range(2)]
    return trainers, rollouts


def _log(path: Path, **row) -> None:
    with open(path, "a") as f:  # one line per event, flushed: kept when the process is killed
        f.write(json.dumps(row) + "\n")


class _Versions:
    """A worker's weights of each version: ``version_bits`` of its version-0 weights, or (with a
    learning rate) Adam's steps of every element it holds (each id alike everywhere)."""

    def __init__(self, lay, base: dict, mapped: dict, lr: float | None):
        from wb.testing.versions import AdamById

        self.base, self.mapped = base, mapped
        self.gens = ({k: AdamById(b.sourcemap.to_indices(), lr=lr, dtype=b.dtype)
                      for k, b in lay.buffers.items()} if lr else None)

    def at(self, v: int) -> dict:
        from harness.multiproc import version_bits

        if self.gens is None:
            return version_bits(self.base, v, self.mapped)
        for g in self.gens.values():
            if g.version > v:
                raise ValueError(f"version {v} after {g.version}")
            while g.version < v:
                g.step()
        return {k: g.weights() for k, g in self.gens.items()}


def _worker(rank: int, plan_path: str, store_dir: str, out: str, role: str, lr=None):
    """A worker's plan, store, log file, version-0 weights and its weights by version."""
    import faulthandler

    import wb

    faulthandler.enable()  # a crash (not a kill) prints where it happened
    from harness.multiproc import buffers_for, mapped_of
    from wb.runtime.transport.stores import DirectoryStore

    plan = wb.Plan.load(plan_path)
    lay = plan.layout_of(rank)
    versions = _Versions(lay, buffers_for(plan, rank, fill=True), mapped_of(lay), lr)
    return (plan, DirectoryStore(store_dir), Path(out, f"{role}{rank}.log"), versions.at(0),
            versions)


def trainer_main(rank: int, plan_path: str, store_dir: str, out: str, step_s: float,
                 lr: float | None = None) -> None:
    import wb
    from wb.runtime.transport.ucx import UcxTransport

    plan, store, log, base, versions = _worker(rank, plan_path, store_dir, out, "trainer", lr)
    bufs = {k: a.copy() for k, a in base.items()}
    try:
        tx = wb.Sender(plan, rank, bufs, transport=UcxTransport(rank, store, timeout=60),
                       store=store, timeout=60, wait_timeout=60, delta=lr is not None)
        v, last = 0, None
        while last is None or v < last:
            v += 1
            for k, a in versions.at(v).items():
                bufs[k][...] = a  # the training step
            time.sleep(step_s)
            tx.push()
            _log(log, event="pushed", v=v, t=time.time())
            if last is None:  # the supervisor says when to stop; the leader picks the version
                if rank == 0 and Path(out, "stop").exists():
                    store.set("chaos/last", str(v + 3).encode())
                try:
                    last = int(store.get("chaos/last", 0.001))
                except wb.TransferError:
                    pass
        tx.close()
        fin = tx._end.finisher
        _log(log, event="closed", v=v, deaths=fin.deaths, repairs=fin.repairs, t=time.time())
    except Exception as e:  # noqa: BLE001 - into the log, which the supervisor reads
        _log(log, event="error", error=f"{type(e).__name__}: {e}", t=time.time())


def rollout_main(rank: int, plan_path: str, store_dir: str, out: str, join: bool,
                 lr: float | None = None) -> None:
    import wb
    from wb.runtime.transport.ucx import UcxTransport

    plan, store, log, base, versions = _worker(rank, plan_path, store_dir, out, "rollout", lr)
    bufs = {k: np.zeros_like(a) for k, a in base.items()}
    pid = os.getpid()
    try:
        transport = UcxTransport(rank, store, timeout=60)
        if join:
            _log(log, event="asked", pid=pid, t=time.time())
            rx = wb.Receiver.join(store, plan.layout_of(rank), bufs, transport=transport,
                                  timeout=60, wait_timeout=60, join_timeout=120)
            _log(log, event="admitted", pid=pid, first=rx.version + 1, t=time.time())
        else:
            rx = wb.Receiver(plan, rank, bufs, transport=transport, store=store, timeout=60,
                             wait_timeout=60)
        while True:
            t0 = time.time()
            v = rx.apply()
            stall = time.time() - t0
            want = versions.at(v)
            ok = all(np.array_equal(bufs[k].view(np.uint8), want[k].view(np.uint8)) for k in bufs)
            st = rx.stats[-1]
            _log(log, event="applied", pid=pid, v=v, ok=bool(ok), stall=stall, start=st.start_s,
                 end=st.end_s, received=st.bytes_received, t=time.time())
            try:
                if v >= int(store.get("chaos/last", 0.001)):
                    break
            except wb.TransferError:
                pass
        rx.close()
        _log(log, event="closed", pid=pid, t=time.time())
    except Exception as e:  # noqa: BLE001 - into the log
        _log(log, event="error", pid=pid, error=f"{type(e).__name__}: {e}", t=time.time())


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def run(*, replicas: int = 4, faults: int = 20, seed: int = 0, step_s: float = 1.0,
        replica_p: float = 0.25, timeout_s: float = 900.0, rows: int = 256,
        cols: int = 192, delta: float | None = None) -> dict:
    import wb

    rng = random.Random(seed)
    if rows % 2 or cols % TRAINERS:
        raise SystemExit(f"--rows must be even and --cols a multiple of {TRAINERS}")
    trainers, rollouts = _layouts(replicas, rows, cols, "bfloat16" if delta else "float32")
    plan = wb.plan(trainers, rollouts, chunk_bytes=max(8192, rows * cols // 64))
    work = Path(tempfile.mkdtemp(prefix="wb-chaos-"))
    plan.save(work / "plan.npz")
    store_dir, out = work / "store", work / "out"
    store_dir.mkdir()
    out.mkdir()
    # Workers start as a deployed Python does, with wb's bytecode cached: where the caller runs
    # with PYTHONDONTWRITEBYTECODE (its workers then too), every restart would compile wb anew,
    # ~0.3 s of its start-up that no deployment pays. Compiled here once (`__pycache__`).
    root = Path(__file__).resolve().parents[1]
    for folder in (Path(wb.__file__).parent, root / "bench", root / "tests" / "harness"):
        compileall.compile_dir(str(folder), quiet=1, workers=1)
    ctx = mp.get_context("spawn")
    plan_path = str(work / "plan.npz")
    procs: dict[int, mp.Process] = {}
    died: list[dict] = []  # processes that ended without being killed (a crash: exit code)

    def start(rank: int, join: bool = False) -> None:
        if rank < TRAINERS:
            p = ctx.Process(target=trainer_main, args=(rank, plan_path, str(store_dir), str(out),
                                                       step_s, delta), daemon=True)
        else:
            p = ctx.Process(target=rollout_main, args=(rank, plan_path, str(store_dir), str(out),
                                                       join, delta), daemon=True)
        p.start()
        procs[rank] = p

    t_start = time.time()
    for r in range(TRAINERS + 2 * replicas):
        start(r)
    deadline = t_start + timeout_s

    def pushed() -> int:
        rows = [x for x in _rows(out / "trainer0.log") if x["event"] == "pushed"]
        return rows[-1]["v"] if rows else 0

    def active(rank: int) -> bool:  # alive and has applied a version in this incarnation
        p = procs[rank]
        rows = [x for x in _rows(out / f"rollout{rank}.log") if x.get("pid") == p.pid]
        return p.is_alive() and any(x["event"] == "applied" for x in rows)

    while pushed() < 2 and time.time() < deadline:
        time.sleep(0.1)
    kills, restarts, pending = [], [], []  # pending: (time to restart, rank)
    from wb.runtime.transport.stores import DirectoryStore

    store = DirectoryStore(store_dir)
    ranks = [lay.worker.rank for lay in rollouts]
    def training() -> bool:  # the trainers still push (a failed version ends the run)
        return all(procs[t].is_alive() for t in range(TRAINERS))

    while (len(kills) < faults or pending) and time.time() < deadline and training():
        now = time.time()
        for due, r in [x for x in pending if x[0] <= now]:
            pending.remove((due, r))
            restarts.append({"rank": r, "t": time.time(), "current_version": pushed()})
            start(r, join=True)
        if len(kills) < faults and (not kills or now >= kills[-1]["t"] + kills[-1]["gap"]):
            live = [r for r in ranks if active(r)]
            if rng.random() < replica_p:
                n = rng.randrange(replicas)
                victims = [r for r in (TRAINERS + 2 * n, TRAINERS + 2 * n + 1) if r in live]
            else:
                victims = [rng.choice(live)] if live else []
            if victims and len(live) - len(victims) >= 2:
                v = pushed()
                mid = any(_has(store, f"wb/join/{v}/{r}") and
                          not _has(store, f"wb/v/{v}/done/0/{r}") for r in victims)
                pids = [procs[r].pid for r in victims]
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                t = time.time()
                kills.append({"ranks": victims, "pids": pids, "t": t, "version": v,
                              "phase": "mid-transfer" if mid else "between versions",
                              "gap": rng.uniform(0.5, 6.0)})
                for r in victims:
                    pending.append((t + rng.uniform(0.5, 4.0), r))
        time.sleep(0.02)
    # every restarted process back (admitted), then stop; one that died on its own ends the wait
    def crashed() -> list[dict]:
        killed = {p for k in kills for p in k.get("pids", ())}
        return [{"rank": r, "pid": p.pid, "exitcode": p.exitcode} for r, p in procs.items()
                if not p.is_alive() and p.pid not in killed and p.exitcode not in (0, None)]
    while time.time() < deadline and training() and not crashed() and not all(
            any(x["event"] == "admitted" and x.get("pid") == procs[r["rank"]].pid
                for x in _rows(out / f"rollout{r['rank']}.log")) for r in restarts):
        time.sleep(0.1)
    died += crashed()
    (out / "stop").write_text("1")
    end = min(deadline, time.time() + 180)  # the last versions and the closing: well within
    for p in procs.values():
        p.join(max(0.0, end - time.time()))
    hung = [r for r, p in procs.items() if p.is_alive()]
    for r in hung:
        procs[r].kill()
    rep = _report(out, kills, restarts, replicas, hung, time.time() - t_start, seed, faults)
    rep["died"] = died  # ended on their own (not killed here): a crash
    rep["ok"] = rep["ok"] and not died
    if delta:
        got: dict[int, int] = {}
        for f in out.glob("rollout*.log"):
            for x in _rows(f):
                if x["event"] == "applied":
                    got[x["v"]] = got.get(x["v"], 0) + x.get("received", 0)
        rep.update(delta_lr=delta, received_by_version={str(v): got[v] for v in sorted(got)})
    return rep


def _has(store, key: str) -> bool:
    try:
        store.get(key, 0.001)
        return True
    except Exception:  # noqa: BLE001 - absent
        return False


def _report(out: Path, kills, restarts, replicas, hung, wall_s, seed, faults) -> dict:
    t0 = _rows(out / "trainer0.log")
    closed = [x for x in t0 if x["event"] == "closed"]
    errors = [(f.name, x["error"]) for f in sorted(out.glob("*.log")) for x in _rows(f)
              if x["event"] == "error"]
    deaths = closed[0]["deaths"] if closed else []
    sent = max([x["v"] for x in t0 if x["event"] == "pushed"], default=0)
    applied = {}  # rank -> rows
    for f in out.glob("rollout*.log"):
        applied[int(f.stem[7:])] = [x for x in _rows(f) if x["event"] == "applied"]
    torn = sum(not x["ok"] for rows in applied.values() for x in rows)
    per_replica = {}
    for n in range(replicas):
        ranks = (TRAINERS + 2 * n, TRAINERS + 2 * n + 1)
        got = [{x["v"] for x in applied.get(r, [])} for r in ranks]
        ok = [{x["v"] for x in applied.get(r, []) if x["ok"]} for r in ranks]
        per_replica[f"r{n}"] = {"versions_applied": len(got[0] & got[1]),
                                "versions_verified": len(ok[0] & ok[1])}
    detect = []
    for k in kills:
        after = [d["detected_s"] - k["t"] for d in deaths
                 if set(k["ranks"]) & set(d["ranks"]) and d["detected_s"] >= k["t"]]
        detect.append(min(after) if after else None)
    rejoin = []
    pushes = [(x["t"], x["v"]) for x in t0 if x["event"] == "pushed"]

    def current(t: float) -> int:  # the newest version pushed at time t
        return max((v for tp, v in pushes if tp <= t), default=0)
    for r in restarts:
        rows = _rows(out / f"rollout{r['rank']}.log")
        adm = [x for x in rows if x["event"] == "admitted" and x["t"] >= r["t"]]
        asked = [x for x in rows if x["event"] == "asked" and x["t"] >= r["t"]]
        rejoin.append({
            "rank": r["rank"], "rejoin_s": adm[0]["t"] - r["t"] if adm else None,
            "versions_behind": (adm[0]["first"] - r["current_version"]) if adm else None,
            # from the moment the restarted process calls wb.Receiver.join (its interpreter,
            # imports and set-up before that are the process's, not the join's)
            "start_s": asked[0]["t"] - r["t"] if asked else None,
            "versions_behind_from_join": (adm[0]["first"] - current(asked[0]["t"])
                                          if adm and asked else None)})
    # EWTT per version over the processes that applied it; versions with a death against the rest
    by_v: dict[int, list] = {}
    for rows in applied.values():
        for x in rows:
            by_v.setdefault(x["v"], []).append(x)
    ewtt = {v: max(x["end"] for x in xs) - min(x["start"] for x in xs) for v, xs in by_v.items()}
    faulty: dict[int, float] = {}  # version -> the detection times of its deaths, summed
    for k, d in zip(kills, detect):
        found = [x["version"] for x in deaths
                 if set(k["ranks"]) & set(x["ranks"]) and x["detected_s"] >= k["t"]]
        if found and d is not None:
            faulty[min(found)] = faulty.get(min(found), 0.0) + d
    # an update without faults: no death, and no joiner's first version (a joiner starts it
    # late, fed apart: the version's span is the joiner's, not an update's)
    firsts = {x["first"] for f in out.glob("rollout*.log") for x in _rows(f)
              if x["event"] == "admitted"}
    clean = [e for v, e in ewtt.items() if v not in faulty and v not in firsts]
    hit = [e for v, e in ewtt.items() if v in faulty]
    stall = max((x["stall"] for rows in applied.values() for x in rows), default=0.0)
    det = [d for d in detect if d is not None]
    clean_med = statistics.median(clean) if clean else None
    rep = {
        "seed": seed, "replicas": replicas, "faults_asked": faults, "faults": len(kills),
        "whole_replica_kills": sum(len(k["ranks"]) == 2 for k in kills),
        "mid_transfer_kills": sum(k["phase"] == "mid-transfer" for k in kills),
        "versions_sent": sent, "per_replica": per_replica, "torn_reads": torn,
        "longest_stall_s": stall, "detection_s": detect,
        "detection_max_s": max(det) if det else None, "rejoins": rejoin,
        "ewtt_clean_median_s": clean_med, "ewtt_with_death_max_s": max(hit) if hit else None,
        "ewtt_no_death_median_s": statistics.median(
            [e for v, e in ewtt.items() if v not in faulty] or [0.0]),
        "joiner_first_versions": sorted(firsts),
        # per version with a death: its EWTT against 2x the clean median plus its detections
        "with_death_over_bound": ({str(v): round(ewtt[v] / (2 * clean_med + t), 3)
                                   for v, t in sorted(faulty.items()) if v in ewtt}
                                  if clean_med else None),
        # the measure: each surviving rollout's own update (its end less its start) in
        # a version with a death, against the same; the worst per version
        "survivor_over_bound": ({str(v): round(max(x["end"] - x["start"] for x in by_v[v])
                                               / (2 * clean_med + t), 3)
                                 for v, t in sorted(faulty.items()) if v in by_v}
                                if clean_med else None),
        "hung": hung, "errors": errors[:10], "wall_s": wall_s, "kills": kills,
    }
    rep["with_death_within_2x_plus_detection"] = bool(
        rep["survivor_over_bound"] is not None
        and all(x <= 1.0 for x in rep["survivor_over_bound"].values()))
    rep["ok"] = bool(not hung and not errors and torn == 0 and len(kills) == faults
                     and rep["with_death_within_2x_plus_detection"]
                     and all(d is not None and d < 5 for d in detect)
                     and all(r["versions_behind"] is not None and r["versions_behind"] <= 2
                             for r in rejoin))
    return rep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--faults", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step", type=float, default=1.0,
                    help="seconds per training step (default 1.0; see the module's doc)")
    ap.add_argument("--rows", type=int, default=256,
                    help="rows of the weight (float32; bfloat16 with --delta)")
    ap.add_argument("--cols", type=int, default=192, help="its columns")
    ap.add_argument("--delta", type=float, metavar="LR", default=None,
                    help="bfloat16 weights stepped by Adam at LR, sent as deltas")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    rep = run(replicas=a.replicas, faults=a.faults, seed=a.seed, step_s=a.step, rows=a.rows,
              cols=a.cols, delta=a.delta)
    if a.out:
        Path(a.out).write_text(json.dumps(rep, indent=1))
    if a.json:
        print(json.dumps(rep))
    else:
        for k, v in rep.items():
            if k not in ("kills", "rejoins", "detection_s"):
                print(f"{k:>36}: {v}")
        print(f"{'detection_s':>36}: {[round(d, 2) if d else d for d in rep['detection_s']]}")
        print(f"{'rejoins (s, versions behind)':>36}: "
              f"{[(round(r['rejoin_s'] or -1, 1), r['versions_behind']) for r in rep['rejoins']]}")
    sys.exit(0 if rep["ok"] else 1)


if __name__ == "__main__":
    main()
