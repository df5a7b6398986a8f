"""Survivors finish the version with every buffer on a GPU: real processes sharing one device, a
rollout killed (or stopped) mid-transfer, over one-sided CUDA messages and over UCX tags. The
same checks as tests/test_survive.py; skips cleanly without a GPU (CI has none)."""

import pytest

from harness.cuda import cupy_or_skip

cupy_or_skip()
pytest.importorskip("ucxx")

from harness.multiproc import coord_child_main, run_ranks  # noqa: E402
from test_survive import RANKS, _forwarder, _survivors_applied_everything, plan_file  # noqa: E402,F401


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["die", "stop"])
@pytest.mark.parametrize("ipc", ["cuda", "off"])
def test_survivors_finish_on_the_gpu(plan_file, tmp_path, monkeypatch, how, ipc):  # noqa: F811
    """The rollout that forwards most dies or is stopped after its first send of version 2:
    every other rollout gets versions 1-3 bit-identical, and the leader calls it dead once."""
    monkeypatch.setenv("WB_IPC", ipc)
    victim = _forwarder(plan_file)
    run = run_ranks(str(plan_file / "plan.npz"), RANKS, str(tmp_path / "run"),
                    target=coord_child_main,
                    options={"versions": 3, "timeout": 60, "cuda_device": 0},
                    faults={victim: {f"{how}_after": 1, "in_version": 2}}, join_timeout=200)
    repairs = _survivors_applied_everything(run, victim, 3)
    assert [r["dead"] for r in repairs] in ([[victim]], []), repairs  # []: nothing left to repair


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ipc", ["cuda", "off"])
def test_survivors_finish_on_the_gpu_with_parts_only(plan_file, tmp_path, monkeypatch,  # noqa: F811
                                                     ipc):
    """Set up with wb.agree_parts: each worker holds only its part; a rollout dies in
    version 2 and the others finish every version."""
    monkeypatch.setenv("WB_IPC", ipc)
    victim = _forwarder(plan_file)
    run = run_ranks(str(plan_file / "plan.npz"), RANKS, str(tmp_path / "run"),
                    target=coord_child_main,
                    options={"versions": 3, "timeout": 60, "agree": True, "agree_name": "wb",
                             "cuda_device": 0},
                    faults={victim: {"die_after": 1, "in_version": 2}}, join_timeout=200)
    repairs = _survivors_applied_everything(run, victim, 3)
    assert [r["dead"] for r in repairs] == [[victim]], repairs
