"""Multi-process transfers over UCX on loopback (spawned processes), and faults that must not hang.

The layouts are the reference backends': a JAX trainer on a 2x2 mesh (2 data-parallel replicas x 2
shards = 4 trainer processes) feeding vLLM-style PyTorch rollouts (2 nodes x TP 2 = 4 processes).
"""

import time

import numpy as np
import pytest

pytest.importorskip("ucxx")
pytest.importorskip("torch")
jax = pytest.importorskip("jax")

import wb  # noqa: E402
from wb.data.plan import RankPlan  # noqa: E402
from harness.multiproc import run_ranks  # noqa: E402


@pytest.fixture(scope="module")
def layouts():
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 emulated JAX devices")
    from wb.cli.demo.checkpoint import random_checkpoint
    from wb.cli.demo.runner import jax_layouts, torch_layouts
    from wb.layouts.presets import TINY

    ckpt = random_checkpoint()
    trainers, _, _ = jax_layouts(TINY, role="trainer", dp=2, tp=2, copies=1, first_rank=0,
                                 node_prefix="trainer", ckpt=ckpt)
    rollouts, _, _ = torch_layouts(TINY, role="rollout", tp=2, copies=2, first_rank=4,
                                   node_prefix="rollout", ckpt=ckpt)
    return trainers, rollouts


@pytest.fixture(scope="module")
def plan_file(layouts, tmp_path_factory):
    trainers, rollouts = layouts
    d = tmp_path_factory.mktemp("plan")
    p = wb.plan(trainers, rollouts, chunk_bytes=4096)  # several messages per pair, forwarding
    p.verify()
    p.save(d / "plan.npz")
    # the same layouts, cut differently: a different plan (different fingerprint)
    wb.plan(trainers, rollouts, chunk_bytes=1024).save(d / "other.npz")
    return d


RANKS = list(range(8))


def _check_all_reported(run, faulty=()):
    for r in RANKS:
        if r in faulty:
            continue
        res = run.results[r]
        assert res is not None, f"rank {r} wrote no result (exit code {run.exitcodes[r]})"
        assert res["ok"] or res["kind"] == "TransferError", res


@pytest.mark.timeout(180)
def test_end_to_end_bit_identical_over_ucx(plan_file, tmp_path):
    run = run_ranks(str(plan_file / "plan.npz"), RANKS, str(tmp_path), options={"timeout": 30})
    _check_all_reported(run)
    assert all(run.results[r]["ok"] for r in RANKS), run.results
    assert all(run.results[r]["bit_identical"] for r in range(4, 8))
    p = wb.Plan.load(plan_file / "plan.npz")
    t = p.traffic()
    sent = {r: run.results[r]["bytes_sent"] for r in range(4)}
    assert sent == t.trainer_out  # trainers sent exactly what the plan (= the bound) says
    received = sum(run.results[r]["bytes_received"] for r in range(4, 8))
    assert received == int(p.messages.nbytes[p.messages.src_rank != p.messages.dst_rank].sum())


@pytest.mark.timeout(180)
def test_end_to_end_from_per_rank_parts_over_ucx(plan_file, tmp_path):
    """Each process loads only its own part (RankPlan bytes): the same bytes arrive, bit for bit,
    and the trainers send exactly what the whole plan says."""
    from wb.data.plan import parts
    p = wb.Plan.load(plan_file / "plan.npz")
    parts_dir = tmp_path / "parts"
    parts_dir.mkdir()
    for part in parts(p):
        (parts_dir / f"{part.rank}.part").write_bytes(part.to_bytes())
    run = run_ranks(str(plan_file / "plan.npz"), RANKS, str(tmp_path / "run"),
                    options={"timeout": 30, "parts_dir": str(parts_dir)})
    _check_all_reported(run)
    assert all(run.results[r]["ok"] for r in RANKS), run.results
    assert all(run.results[r]["bit_identical"] for r in range(4, 8))
    assert {r: run.results[r]["bytes_sent"] for r in range(4)} == p.traffic().trainer_out


@pytest.mark.timeout(120)
def test_a_peer_that_dies_mid_transfer_makes_the_others_fail_in_time(plan_file, tmp_path):
    t0 = time.time()
    run = run_ranks(str(plan_file / "plan.npz"), RANKS, str(tmp_path), options={"timeout": 4},
                    faults={0: {"die_after": 1}}, join_timeout=60)
    assert run.exitcodes[0] == 17
    _check_all_reported(run, faulty=(0,))
    failed = [r for r in RANKS[1:] if not run.results[r]["ok"]]
    assert failed, "nobody noticed the dead trainer"
    import re
    assert any(re.search(r"peers? \[?0\b", run.results[r]["error"]) for r in failed)
    assert time.time() - t0 < 50  # each worker gives up within its 4 s timeout (x a few hops)


@pytest.mark.timeout(120)
def test_a_peer_that_hangs_makes_the_others_fail_in_time(plan_file, tmp_path):
    run = run_ranks(str(plan_file / "plan.npz"), RANKS, str(tmp_path), options={"timeout": 4},
                    faults={5: {"hang_after": 1}}, join_timeout=25)
    assert run.results[5] is None and run.exitcodes[5] == -9  # killed by the harness
    _check_all_reported(run, faulty=(5,))
    stuck = [r for r in RANKS if r != 5 and not run.results[r]["ok"]]
    assert any("peer 5" in run.results[r]["error"] or "peers [5]" in run.results[r]["error"]
               for r in stuck)


@pytest.mark.timeout(120)
def test_a_worker_with_another_plan_refuses_before_sending(plan_file, tmp_path):
    run = run_ranks(str(plan_file / "plan.npz"), RANKS, str(tmp_path), options={"timeout": 4},
                    faults={2: {"other_plan": str(plan_file / "other.npz")}}, join_timeout=60)
    _check_all_reported(run)
    res = run.results[2]
    assert not res["ok"] and "different plan" in res["error"] and "bytes_sent" not in res
    # no rollout ends up with a mix: whoever finished has exactly the right bytes
    for r in range(4, 8):
        if run.results[r]["ok"]:
            assert run.results[r]["bit_identical"]


@pytest.mark.timeout(120)
def test_a_wrong_buffer_is_refused_before_any_byte_moves(plan_file, tmp_path):
    p = wb.Plan.load(plan_file / "plan.npz")
    name = next(iter(p.rollouts[1].buffers))
    run = run_ranks(str(plan_file / "plan.npz"), RANKS, str(tmp_path), options={"timeout": 4},
                    faults={5: {"bad_buffer": name}}, join_timeout=60)
    _check_all_reported(run)
    res = run.results[5]
    assert not res["ok"] and "refusing before any byte moves" in res["error"]
    others = [run.results[r] for r in RANKS if r != 5 and not run.results[r]["ok"]]
    assert any("peer 5" in o["error"] for o in others)


def test_wrong_dtype_refused_in_process():
    from wb.runtime.engine.executor import execute
    from wb.runtime.transport.local import LocalHub, LocalTransport

    w = np.arange(64).reshape(8, 8)
    t = wb.Layout(wb.Worker(0, "t", "trainer"), {"w": wb.BufferSpec(wb.SourceMap.from_indices(w), "float32")})
    r = wb.Layout(wb.Worker(1, "r", "rollout"), {"w": wb.BufferSpec(wb.SourceMap.from_indices(w), "float32")})
    p = wb.plan([t], [r])
    with pytest.raises(wb.TransferError, match="is float64, the plan needs float32"):
        execute(RankPlan.of(p, 0), {"w": np.zeros((8, 8))}, LocalTransport(0, LocalHub()))
    with pytest.raises(wb.TransferError, match="different layouts"):
        execute(RankPlan.of(p, 1), {"w": np.zeros((8, 8), np.float32)},
                LocalTransport(1, LocalHub()),
                layout=wb.Layout(r.worker, {"w": wb.BufferSpec(wb.SourceMap.from_indices(w.T), "float32")}))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["both", "sync"])
def test_versions_through_sender_and_receiver_over_ucx(plan_file, tmp_path, mode):
    from harness.multiproc import coord_child_main

    send, recv = wb.MODES[mode]
    run = run_ranks(str(plan_file / "plan.npz"), RANKS, str(tmp_path), target=coord_child_main,
                    options={"versions": 3, "sender_staging": send, "receiver_staging": recv,
                             "timeout": 60}, join_timeout=200)
    for r in RANKS:
        res = run.results[r]
        assert res is not None and res["ok"], (r, res)
        if r >= 4:
            assert res["applied"] == [1, 2, 3] and res["checks"] == [True] * 3, res


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode,ipc", [("both", "off"), ("sync", "host")])
def test_versions_as_deltas_over_ucx(plan_file, tmp_path, mode, ipc):
    """Trainers with ``delta=True``: every version after the first that a rollout holds comes
    as what changed (here about 2% of the elements a version); every rollout bit-identical to
    the trainers' weights, every version. Over UCX tags, and one-sided (``WB_IPC=host``: the
    receiver reads a delta shorter than its receive)."""
    from harness.multiproc import coord_child_main

    send, recv = wb.MODES[mode]
    run = run_ranks(str(plan_file / "plan.npz"), RANKS, str(tmp_path), target=coord_child_main,
                    options={"versions": 4, "sender_staging": send, "receiver_staging": recv,
                             "timeout": 60, "delta": True, "density": 0.02,
                             "env": {"WB_IPC": ipc}}, join_timeout=200)
    for r in RANKS:
        res = run.results[r]
        assert res is not None and res["ok"], (r, res)
        if r >= 4:
            assert res["applied"] == [1, 2, 3, 4] and res["checks"] == [True] * 4, (
                res.get("refused"), res)
            first, *later = res["received"]
            assert max(later) < 0.25 * first, res["received"]


@pytest.mark.timeout(240)
def test_versions_from_the_parts_agree_parts_gives_over_ucx(plan_file, tmp_path):
    """A real set-up: each process publishes its layout, rank 0's plans, every process fetches
    only its part from the store and runs Sender/Receiver from it."""
    from harness.multiproc import coord_child_main

    p = wb.Plan.load(plan_file / "plan.npz")
    run = run_ranks(str(plan_file / "plan.npz"), RANKS, str(tmp_path), target=coord_child_main,
                    options={"versions": 2, "timeout": 60, "agree": True}, join_timeout=200)
    for r in RANKS:
        res = run.results[r]
        assert res is not None and res["ok"], (r, res)
        mine = (p.messages.src_rank == r) | (p.messages.dst_rank == r)
        assert res["part_messages"] == int(mine.sum())  # its part only: the same plan's
        if r >= 4:
            assert res["applied"] == [1, 2] and res["checks"] == [True] * 2, res


@pytest.mark.timeout(240)
def test_a_killed_trainer_leaves_the_previous_version_and_apply_raises(plan_file, tmp_path):
    from harness.multiproc import coord_child_main

    t0 = time.time()
    run = run_ranks(str(plan_file / "plan.npz"), RANKS, str(tmp_path), target=coord_child_main,
                    options={"versions": 3, "timeout": 5},
                    faults={0: {"die_after": 1, "in_version": 2}}, join_timeout=200)
    assert run.exitcodes[0] == 17  # the trainer died mid-transfer of version 2
    failed_in_2 = 0
    for r in range(4, 8):
        res = run.results[r]
        assert res is not None and res["ok"], (r, res)
        assert res["applied"] in ([1], [1, 2]) and all(res["checks"]), res
        # a rollout whose bytes of version 2 had all landed has it whole; the others fail in 2,
        # and every one fails at the next version it cannot get, keeping the last one it had
        last = res["applied"][-1]
        assert (f"receiving version {last + 1} failed" in res["error"]
                and f"still hold version {last}" in res["error"]
                or f"version {last + 1} did not arrive" in res["error"]), res
        assert res["intact"] is True and res["version_after_error"] == last
        failed_in_2 += last == 1
    assert failed_in_2 >= 1
    assert time.time() - t0 < 150
