"""`python -m wb bench --quick --json`: all three methods run between processes over UCX, come out
bit-identical, and the report is consistent with itself and with the plans it ran. No speed
asserts: ratios are the benchmark's to report, not a test's (shared, noisy machines)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


@pytest.mark.timeout(400)
def test_bench_quick_json_is_consistent_with_itself_and_the_plans():
    import wb
    from wb.algorithms.planner import traffic_ratio
    from wb.algorithms.simulate import ideal_s, simulate
    from wb.cli.bench.runner import PROFILES, _config, _deployment
    from wb.data.layout import Cluster
    from wb.layouts.presets import spec_from_config

    out = subprocess.run([sys.executable, "-m", "wb", "bench", "--quick", "--json",
                          "--replicas", "1", "4"], capture_output=True, text=True, timeout=380)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # quiet: no UCX warning about unused variables, no flush error from a peer closing first
    assert "UCX  WARN" not in out.stderr and "UCX  ERROR" not in out.stderr, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    prof = PROFILES["quick"]
    cfg, G = _config(prof["preset"], prof["scale"]), prof["gpus_per_node"]
    assert r["model_bytes"] == spec_from_config(cfg).nbytes
    assert set(r["by_replicas"]) == {"1", "4"} and r["verified"] is True
    methods, modes = {"wb", "p2p", "broadcast"}, set(wb.MODES)
    for R, one in r["by_replicas"].items():
        assert one["errors"] == {} and one["verified"] is True and one["failed_checks"] == []
        assert one["processes"] == G + 1 + int(R) * G  # trainers, the gatherer, rollouts
        e, runs = one["ewtt_s"], one["ewtt_runs_s"]
        assert set(e) == set(runs) == set(one["ewtt_first_s"]) == methods
        for m in methods:  # the EWTT is the median of the runs after the first
            assert len(runs[m]) == prof["repeats"] and one["ewtt_first_s"][m] == runs[m][0]
            assert e[m] == pytest.approx(np.median(runs[m][1:] or runs[m]), rel=1e-12)
        # every ratio is the reported times' ratio
        assert one["speedup_vs_broadcast"] == pytest.approx(e["broadcast"] / e["wb"], rel=1e-12)
        assert one["speedup_vs_p2p"] == pytest.approx(e["p2p"] / e["wb"], rel=1e-12)
        assert one["ewtt_over_ideal"] == pytest.approx(e["wb"] / one["ideal_s"], rel=1e-12)
        # the ideal and the simulation are the wb plan's bytes over the measured link rates
        trainers, rollouts = _deployment(cfg, gpus=G, replicas=int(R))
        plan = wb.plan(trainers, rollouts, chunk_bytes=prof["chunk_kib"] << 10)
        measured = Cluster(nic_gbps=one["measured_nic_MBps"] * 8e6 / 1e9,
                           nvlink_GBps=one["measured_nvlink_MBps"] / 1e3)
        assert one["ideal_s"] == pytest.approx(ideal_s(plan, measured), rel=1e-9)
        assert one["simulated"]["wb"] == pytest.approx(simulate(plan, measured, message_s=0).ewtt_s,
                                                           rel=1e-9)
        assert one["traffic_ratio"] == traffic_ratio(plan) == 1.0
        # every sync mode measured; the baselines block every worker, so their AGST is their EWTT
        assert set(one["stalls"]) == modes
        assert set(one["agst_s"]) == modes | {"broadcast (synchronous)", "p2p (synchronous)"}
        assert one["agst_s"]["broadcast (synchronous)"] == e["broadcast"]
        assert one["agst_s"]["p2p (synchronous)"] == e["p2p"]
        assert one["agst_broadcast_over_both"] == pytest.approx(
            e["broadcast"] / one["agst_s"]["both"], rel=1e-12)
        # every method's emulated links: the busiest trainer NIC carried its share, busy <= span
        assert set(one["link_usage"]) == methods
        for method in methods:
            out_nic = one["link_usage"][method]["out/nic"]
            assert 0 < out_nic["busiest_busy_s"] <= out_nic["busiest_span_s"] + 1e-6
    # the headline fields are those of the largest replica count
    four = r["by_replicas"]["4"]
    for key in ("speedup_vs_broadcast", "speedup_vs_p2p", "ewtt_over_ideal", "agst_s",
                "agst_broadcast_over_both"):
        assert r[key] == four[key], key


@pytest.mark.timeout(300)
def test_real_links_ideal_is_the_bytes_over_the_measured_rates(tmp_path):
    """`--links real` between host processes, no AGST (`--modes` with none): the ideal is
    max(stage-1 bytes / measured trainer->rollout rate, forwarded bytes / measured rollout rate),
    recomputed here from the plan; the partial bench.json is written."""
    import wb
    from wb.cli.bench.runner import PROFILES, _config, _deployment

    out = subprocess.run([sys.executable, "-m", "wb", "bench", "--quick", "--json", "--replicas",
                          "2", "--links", "real", "--modes", "--out", str(tmp_path), "--trace"],
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    two = r["by_replicas"]["2"]
    assert r["verified"] is True and "sync" not in r["agst_s"]
    prof = PROFILES["quick"]
    trainers, rollouts = _deployment(_config(prof["preset"], prof["scale"]),
                                     gpus=prof["gpus_per_node"], replicas=2)
    M = wb.plan(trainers, rollouts, chunk_bytes=prof["chunk_kib"] << 10).messages
    want = max(M.nbytes[M.stage == 1].sum() / (two["measured_nic_MBps"] * 1e6),
               M.nbytes[M.stage != 1].sum() / (two["measured_nvlink_MBps"] * 1e6))
    assert two["ideal_s"] == pytest.approx(want, rel=1e-9)
    # trainer pairs and the free rollouts' pairs measured at once as well
    assert set(two["measured_together_MBps"]) == {"nic", "nvlink"}
    assert min(two["measured_together_MBps"].values()) > 0
    assert json.loads((tmp_path / "bench.json").read_text())["by_replicas"]["2"]["verified"]
    # --trace: every rank's messages of its last wb run, each once, and the summary script reads it
    traces = json.loads((tmp_path / "trace_r2.json").read_text())
    for lay in (*trainers, *rollouts):
        r = lay.worker.rank
        mine = ((M.src_rank == r) | (M.dst_rank == r)).nonzero()[0].tolist()
        assert sorted(m[0] for m in traces[str(r)]["messages"]) == mine
        assert traces[str(r)]["rep"] == prof["repeats"] - 1
    summary = subprocess.run([sys.executable, "bench/trace_summary.py",
                              str(tmp_path / "trace_r2.json")], capture_output=True, text=True,
                             timeout=60, cwd=Path(__file__).parents[1])
    assert summary.returncode == 0, summary.stderr
    assert summary.stdout.count("rank ") == len(trainers) + len(rollouts)
    assert "stage 1:" in summary.stdout


def test_a_timed_out_rank_names_the_last_barrier_it_passed(tmp_path):
    import os

    from wb.cli.bench.runner import _last_barrier
    from wb.runtime.transport.stores import DirectoryStore

    store = DirectoryStore(str(tmp_path))
    for t, key in enumerate(["b/probe-setup/3", "b/0/wb/3", "b/0/wb/13", "b/1/p2p/13"]):
        store.set(key, b"1")
        f = tmp_path / key.replace("/", "%")
        os.utime(f, (1000 + t, 1000 + t))
    assert _last_barrier(tmp_path, 3) == "0/wb"
    assert _last_barrier(tmp_path, 13) == "1/p2p"
    assert _last_barrier(tmp_path, 4) == "none"


@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_probe_pairs_keep_each_rank_in_one_pair_per_phase(replicas):
    from wb.cli.bench.runner import PROFILES, _config, _deployment, _probe_pairs

    prof = PROFILES["gpu-nvlink"]
    trainers, rollouts = _deployment(_config(prof["preset"], prof["scale"]),
                                     gpus=prof["gpus_per_node"], replicas=replicas)
    pairs = _probe_pairs(trainers, rollouts, "real")
    phases: dict[str, list] = {}
    for kind, ps in pairs.items():
        phases.setdefault(kind.split(":")[0], []).extend(x for p in ps for x in p)
    for ranks in phases.values():
        assert len(ranks) == len(set(ranks))  # one probe per rank at a time
    t = {lay.worker.rank for lay in trainers}
    assert all(a in t and b not in t for a, b in pairs["nic"])
    assert ("together:nvlink" in pairs) == (replicas > 1)
    assert not {x for p in pairs.get("together:nvlink", []) for x in p} & t


def test_a_timed_step_starts_at_one_instant_on_every_rank(tmp_path):
    """Ranks reach the barrier at different times and notice its completion up to the store's
    polling interval apart; with start=True they all leave at the same instant, after the last
    arrival, so a measured step has no skew between ranks."""
    import threading
    import time

    from wb.cli.bench.workers import START_AFTER_S, barrier
    from wb.runtime.transport.stores import DirectoryStore

    store = DirectoryStore(tmp_path)
    got, left, arrived = {}, {}, {}

    def rank(r):
        time.sleep(0.01 * r)  # arrive 10 ms apart
        arrived[r] = time.time()
        got[r] = barrier(store, "k", range(4), r, 10.0, start=True)
        left[r] = time.time()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(set(got.values())) == 1  # one instant for all
    at = got[0]
    assert at >= max(arrived.values()) + START_AFTER_S - 1e-3
    assert all(left[r] >= at for r in range(4))
    assert max(left.values()) - at < 0.5  # and left then (a loaded machine may lag a little)


class _Proc:
    def __init__(self, exitcode):
        self.exitcode = exitcode

    def is_alive(self):
        return self.exitcode is None


def test_a_worker_that_ended_in_failure_is_found_at_once(tmp_path):
    """The bench's parent stops the others as soon as one worker ended failing: its result says
    so, or it left none (killed); a worker still running or done well is no failure."""
    from wb.cli.bench.runner import _failed

    (tmp_path / "0.json").write_text(json.dumps({"ok": True}))
    (tmp_path / "2.json").write_text(json.dumps({"ok": False, "error": "OutOfMemoryError: x\ny"}))
    assert _failed({0: _Proc(0), 1: _Proc(None)}, tmp_path) is None
    assert _failed({0: _Proc(0), 1: _Proc(None), 2: _Proc(0)}, tmp_path) == (
        2, "OutOfMemoryError: x")
    assert _failed({0: _Proc(0), 3: _Proc(-9)}, tmp_path) == (3, "exit code -9, no result")


@pytest.mark.timeout(300)
def test_the_others_stop_when_one_worker_fails():
    """Every rollout fails in the sync mode's run (a decode step of negative length); the
    trainers, waiting for them there, are stopped at once instead of waiting out their timeout,
    and the report names each rank's error."""
    from wb.cli.bench.runner import run_bench

    report = run_bench(profile="quick", replicas=(1,), modes=["sync"], gen_s=-1.0, quiet=True,
                       timeout=600.0)
    errors = report["by_replicas"]["1"]["errors"]
    assert any("sleep length must be non-negative" in e for e in errors.values()), errors
    stopped = [r for r, e in errors.items() if "stopped after rank" in e]
    assert stopped and all("last barrier passed: mode/sync" in errors[r] for r in stopped), errors
