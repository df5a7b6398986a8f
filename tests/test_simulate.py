"""The bandwidth model on cases small enough to work out by hand; baselines; the plan CLI."""

import json
import subprocess
import sys

import numpy as np
import pytest

import wb
from wb.algorithms.simulate import simulate, simulate_broadcast, simulate_p2p

GB = 1e9


def lay(rank, node, role, ids, local_rank=0):
    return wb.Layout(wb.Worker(rank, node, role, local_rank),
                     {"w": wb.BufferSpec(wb.SourceMap.from_indices(ids), "float32")})


def _one_trainer_two_rollout_nodes():
    """A 4 MB tensor held by one trainer, needed whole on two rollout nodes, in 8 pieces: the
    plan and the tensor's bytes."""
    w = np.arange(1000 * 1000).reshape(1000, 1000)
    B = w.size * 4
    t = [lay(0, "t0", "trainer", w)]
    r = [lay(1, "r0", "rollout", w), lay(2, "r1", "rollout", w)]
    return wb.plan(t, r, wb.Cluster(nic_gbps=400), chunk_bytes=B // 8), B


def test_one_trainer_two_rollout_nodes_by_hand():
    p, B = _one_trainer_two_rollout_nodes()
    s = simulate(p, message_s=0)
    nic = 50 * GB
    # trainer sends B once; r0 receives B and forwards B to r1: every link carries B
    assert s.ideal_s == pytest.approx(B / nic)
    assert s.ewtt_s - s.pipeline_s == pytest.approx(B / nic)
    assert s.pipeline_s == pytest.approx(2 * (B / 8) / nic)  # two hops of one piece
    # naive P2P: the trainer NIC sends B to each rollout: 2B
    assert simulate_p2p(p).ewtt_s == pytest.approx(2 * B / nic)
    # broadcast: every rollout GPU receives everything; nothing to gather
    assert simulate_broadcast(p).ewtt_s == pytest.approx(B / nic)


def test_broadcast_gathers_tp_shards_over_nvlink():
    w = np.arange(400 * 500).reshape(400, 500)
    t = [lay(0, "t0", "trainer", w[:200], 0), lay(1, "t0", "trainer", w[200:], 1)]
    r = [lay(2, "r0", "rollout", w[:, :250], 0), lay(3, "r0", "rollout", w[:, 250:], 1)]
    p = wb.plan(t, r)
    bc = simulate_broadcast(p)
    B = w.size * 4
    assert bc.ewtt_s == pytest.approx(B / 2 / (450 * GB) + B / (50 * GB))
    wbs = simulate(p, message_s=0)
    assert wbs.ewtt_s - wbs.pipeline_s == pytest.approx(B / 2 / (50 * GB))  # each NIC half


def test_messages_cost_their_worker_beside_the_bytes_by_hand():
    """Each worker spends ``message_s`` per message it sends or receives, while bytes move: a GPU
    takes the larger of its busiest link and its messages; free messages give the bandwidth
    bound."""
    p, B = _one_trainer_two_rollout_nodes()
    M = p.messages
    # the oracle: messages each rank sends or receives, counted one by one
    count = {r: sum(1 for s, d in zip(M.src_rank, M.dst_rank) if r in (s, d)) for r in (0, 1, 2)}
    assert count[1] == count[0] + count[2]  # r0 receives everything and forwards it all
    free = simulate(p, message_s=0)
    assert free.control_s == 0 and free.free_messages_s == free.ewtt_s
    cheap = simulate(p, message_s=1e-9)  # the bytes take longer: messages are hidden
    assert cheap.ewtt_s == pytest.approx(free.ewtt_s) and cheap.busiest != "messages"
    slow = simulate(p, message_s=1e-3)  # r0's messages take longer than any link
    assert slow.busiest == "messages" and slow.control_s == pytest.approx(count[1] * 1e-3)
    assert slow.ewtt_s == pytest.approx(count[1] * 1e-3 + free.pipeline_s)
    assert slow.free_messages_s == pytest.approx(free.ewtt_s)


@pytest.mark.parametrize("density", [0.0, 0.001, 0.03, 0.5, 1.0])
def test_deltas_carry_their_expected_encoding_by_hand(density):
    """With ``delta_density`` each message's bytes are its delta's expected size: the trainer's
    NIC carries what the deltas of its messages add up to, counted one message at a time, and
    the pipeline fills with one delta per hop."""
    from wb.algorithms.delta import expected_bytes

    p, B = _one_trainer_two_rollout_nodes()
    M = p.messages
    sent = sum(float(expected_bytes(int(n), 4, density)) for n, s in zip(M.nbytes, M.src_rank)
               if s == 0)
    d = simulate(p, message_s=0, delta_density=density)
    nic = 50 * GB
    assert d.link_s["trainer_nic_out"].max() == pytest.approx(sent / nic)
    assert d.ewtt_s - d.pipeline_s == pytest.approx(sent / nic)  # every link carries as much
    piece = float(expected_bytes(B // 8, 4, density))
    assert d.pipeline_s == pytest.approx(2 * piece / nic)
    assert d.ideal_s == simulate(p).ideal_s  # the dense ideal, to compare against
    with pytest.raises(ValueError, match="density"):
        simulate(p, delta_density=1.5)


def test_ewtt_is_never_below_ideal():
    from hypothesis import given, settings

    from wb.testing import strategies as wbst

    @settings(max_examples=40, deadline=None)
    @given(wbst.layouts(), wbst.clusters())
    def check(case, cluster):
        p = wb.plan(case.trainers, case.rollouts, cluster)
        s = simulate(p)
        assert s.ewtt_s >= s.ideal_s * (1 - 1e-9)
        assert simulate_p2p(p).ewtt_s >= s.ideal_s * (1 - 1e-9)
    check()


def test_plan_cli_json_and_plot(tmp_path):
    png = tmp_path / "links.png"
    out = subprocess.run([sys.executable, "-m", "wb", "plan", "--preset", "tiny", "--json",
                          "--plot", str(png)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("plan_s", "peak_rss_mb", "traffic_ratio", "ewtt_s", "ideal_s", "baselines"):
        assert key in rep
    assert rep["traffic_ratio"] == 1.0 and rep["verified"]
    assert set(rep["baselines"]) == {"broadcast", "p2p"}
    assert png.stat().st_size > 10_000


def test_plan_cli_simulates_deltas_on_the_plan_a_delta_job_makes():
    """``--delta-density``: the deltas are simulated on the plan ``agree_parts(delta=True)``
    makes (pieces of ``DELTA_CHUNK_BYTES``), beside that plan's dense versions and the deltas
    on the default plan, each equal to the simulation run here by hand."""
    from wb.algorithms.planner import DELTA_CHUNK_BYTES
    from wb.cli.plan import run_plan
    from wb.layouts.deployments import deployment

    rep = run_plan("tiny", quiet=True, verify=False, delta_density=0.03)
    dep = deployment("tiny")
    dense_plan = wb.plan(dep.trainers, dep.rollouts)
    delta_plan = wb.plan(dep.trainers, dep.rollouts, chunk_bytes=DELTA_CHUNK_BYTES)
    assert rep["delta_chunk_bytes"] == DELTA_CHUNK_BYTES
    assert rep["delta_messages"] == delta_plan.summary()["messages"] <= rep["messages"]
    assert rep["delta_ewtt_s"] == pytest.approx(simulate(delta_plan, delta_density=0.03).ewtt_s)
    assert rep["delta_plan_dense_ewtt_s"] == pytest.approx(simulate(delta_plan).ewtt_s)
    assert rep["delta_default_chunk_ewtt_s"] == pytest.approx(
        simulate(dense_plan, delta_density=0.03).ewtt_s)
    assert rep["delta_ewtt_over_dense"] == pytest.approx(rep["delta_ewtt_s"] / rep["ewtt_s"])
