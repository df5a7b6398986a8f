"""Weight checks asked from outside a running job (``python -m wb check``,
``wb.runtime.endpoints.asks``): a Megatron -> vLLM job runs (threads sharing a DirectoryStore
signed with a job key), its workers serving checks; the command, a separate process with the
same key, asks while versions go by. Every rollout answers; the one whose maps say a loader now
lays a tensor out otherwise reports exactly the tensors that changed and the command fails; the
others match. The protocol itself: closed asks skipped, silent rollouts named."""

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import wb
from harness.threads import run_each
from wb.cli.bench.weights import buffers_for, mapped_of, version_bits
from wb.layouts import megatron_trainer, vllm_rollout
from wb.layouts.presets import TINY, spec_from_config
from wb.runtime.endpoints import asks
from wb.runtime.transport.local import LocalHub, LocalTransport


def _stale(plan, rank):
    """A transposed map of one square buffer of ``rank`` (a loader that changed), and the
    tensors it holds elements of."""
    spec = spec_from_config(TINY)
    lay = plan.layout_of(rank)
    name = next(n for n, b in lay.buffers.items()
                if len(b.sourcemap.shape) == 2 and b.sourcemap.shape[0] == b.sourcemap.shape[1]
                and b.sourcemap.shape[0] > 1)
    ids = lay.buffers[name].sourcemap.to_indices()
    offs = [spec.offset(n) for n in spec.names]
    tensors = {spec.names[int(np.searchsorted(offs, i, side="right")) - 1]
               for i in np.unique(ids[ids >= 0])}
    return {name: wb.SourceMap.from_indices(np.ascontiguousarray(ids.T))}, tensors


@pytest.mark.timeout(240)
def test_the_command_checks_a_running_job(tmp_path, monkeypatch):
    monkeypatch.setenv("WB_JOB_KEY", "a job key of this test")
    trainers = megatron_trainer(TINY, tp=2, pp=1, ep=2, nodes=["t0"], gpus_per_node=2)
    rollouts = vllm_rollout(TINY, tp=2, ep=2, replicas=2, gpus_per_node=2, first_rank=2)
    plan, spec = wb.plan(trainers, rollouts), spec_from_config(TINY)
    stale_rank = plan.rollouts[1].worker.rank
    stale_maps, stale_tensors = _stale(plan, stale_rank)
    hub, store = LocalHub(), wb.DirectoryStore(tmp_path / "store")
    nt, final, pushed = len(plan.trainers), {}, {}
    served = threading.Barrier(len(plan.ranks) + 1)

    def run(r):
        kw = dict(transport=LocalTransport(r, hub, timeout=30), store=store, timeout=30,
                  wait_timeout=30, name="job7")
        base = {k: np.asarray(a) for k, a in buffers_for(plan, r, fill=True).items()}
        if r < nt:
            bufs = {k: v.copy() for k, v in base.items()}
            mapped = mapped_of(plan.layout_of(r))
            with wb.Sender(plan, r, bufs, **kw) as tx:
                tx.serve_checks(spec, per_tensor=None)
                served.wait()
                v = 0
                while "v" not in final or v < final["v"]:
                    v += 1
                    for k, a in version_bits(base, v, mapped).items():
                        bufs[k][...] = a
                    pushed[r] = tx.push()
                    time.sleep(0.02)
        else:
            live = {k: np.zeros_like(a) for k, a in base.items()}
            with wb.Receiver(plan, r, live, **kw) as rx:
                rx.serve_checks(spec, per_tensor=None,
                                maps=stale_maps if r == stale_rank else None)
                served.wait()
                while "v" not in final or rx.version < final["v"]:
                    rx.apply()

    job: dict = {}
    runner = threading.Thread(target=lambda: job.setdefault("errors", run_each(
        run, plan.ranks, timeout=200)))
    runner.start()
    served.wait()
    try:
        cli = subprocess.run([sys.executable, "-m", "wb", "check", "--store",
                              str(tmp_path / "store"), "--name", "job7", "--timeout", "60",
                              "--json"], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONWARNINGS": "ignore"})
    finally:  # every trainer pushes up to a version just ahead of the first's, then all stop
        final["v"] = max(pushed.values(), default=0) + 2
    runner.join(200)
    assert not runner.is_alive()
    assert cli.returncode == 1, cli.stdout + cli.stderr
    out = json.loads(cli.stdout.strip().splitlines()[-1])
    answers = {int(r): a for r, a in out["answers"].items()}
    assert not out["ok"] and not out["silent"], (out, job.get("errors"))
    assert {r for r, a in answers.items() if a["role"] == "rollout"} == \
        {lay.worker.rank for lay in plan.rollouts}
    for r, a in answers.items():
        if a["role"] == "trainer":
            assert a["version"] >= 1 and a["claimed"] > 0
        elif r == stale_rank:
            assert not a["ok"] and set(a["mismatched"]) == stale_tensors, a
        else:
            assert a["ok"] and a["counts"].get("mismatch", 0) == 0, a
    assert "CHECK FAILED" not in cli.stdout  # --json: the report only
    assert not job["errors"], job["errors"]


def test_asks_protocol_closed_skipped_and_silent_named():
    """A worker skips asks closed before it looked; a rollout that never answers is named; a
    trainer answers every look while the ask is open and stops once it is closed."""
    store = wb.MemoryStore()
    calls = []
    trainer = asks.Desk(store, "j", 0, "trainer",
                        lambda n: calls.append(n) or {"version": n, "since": n})
    rollout = asks.Desk(store, "j", 1, "rollout", lambda n: None)  # never able to answer
    assert asks.serving(store, "j") == {0: "trainer", 1: "rollout"}
    n0 = asks.ask(store, "j")
    got = asks.gather(store, "j", n0, asks.serving(store, "j"), timeout=0.2)
    assert got == {}  # nobody looked in time: closed with no answers
    n1 = asks.ask(store, "j")
    assert n1 == n0 + 1
    trainer.poll()  # skips the closed ask 0, answers ask 1
    trainer.poll()  # still open: answers again (claims every push)
    rollout.poll()
    assert calls == [n1, n1] and trainer.open == n1 and rollout.open == n1
    got = asks.gather(store, "j", n1, asks.serving(store, "j"), timeout=0.3)
    assert set(got) == {0} and got[0]["role"] == "trainer"
    trainer.poll()  # closed now: nothing more
    assert calls == [n1, n1] and trainer.open is None and trainer.next == n1 + 1
