"""The README's main job: `python -m wb demo` runs in both directions and verifies exactly."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")


# both directions of the README's demo (PyTorch -> PyTorch is the wb_torch tests' own pairing),
# the second with every rollout's weight check after every update
@pytest.mark.parametrize("args", [[], ["--trainer", "torch", "--rollout", "jax", "--check"]])
def test_demo_json_last_line(args):
    out = subprocess.run([sys.executable, "-m", "wb", "demo", "--json", *args],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    # quiet: no process prints UCX's warning about unused UCX_* variables (ucxx sets some)
    assert "UCX_WARN_UNUSED_ENV_VARS" not in out.stdout + out.stderr, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["verified"] is True
    # TINY in bf16: every rollout node needs the whole model once; M is its size in bytes.
    from wb.layouts.presets import TINY, spec_from_config
    nbytes = spec_from_config(TINY).nbytes
    assert report["needed_bytes"] == nbytes
    assert set(report["node_needed_bytes"].values()) == {nbytes}
    assert report["map_entries"] * 20 < report["elements"]
    assert report["weights_bit_identical"] is True and report["traffic_ratio"] == 1.0
    # between processes over UCX, in all four sync modes, every buffer checked after every update
    assert report["transfers_verified"] is True and report["traffic_ratio_processes"] == 1.0
    assert set(report["modes"]) == {"sync", "sender", "receiver", "both"}
    for m in report["modes"].values():
        assert m["verified"] and m["mismatches"] == 0 and m["updates"] == 3
        assert m["rollout_records"] == 3 * report["process_rollout_workers"] and m["checks"] > 0
    # the library's own stall records: staging on both sides stalls less than fully synchronous
    assert report["modes"]["both"]["agst_s"] < report["modes"]["sync"]["agst_s"]
    assert report["agst_sync_over_both"] > 1
    if "--check" in args:  # 4 modes x 3 updates x every rollout rank, each one ok
        wc = report["weight_checks"]
        assert wc["reports"] == 12 * report["process_rollout_workers"] == wc["ok"], wc
        assert wc["mismatched"] == []


def test_demo_check_fails_when_no_bytes_move(monkeypatch):
    import wb
    import wb.cli.demo.runner
    monkeypatch.setattr(wb, "run_local", lambda plan, t, r: r)  # a transfer that moves nothing
    report = wb.cli.demo.runner.run_demo(quiet=True, processes=False)
    assert report["correspondence_exact"] is True
    assert report["weights_bit_identical"] is False and report["verified"] is False


def test_demo_refuses_bad_arguments():
    out = subprocess.run([sys.executable, "-m", "wb", "demo", "--replicas", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--replicas" in out.stderr


def test_demo_cuda_needs_gpus():
    import glob
    if glob.glob("/dev/nvidia[0-9]*"):
        pytest.skip("this machine has GPUs: the GPU run is bench/gpu_x2_bench.sh's")
    out = subprocess.run([sys.executable, "-m", "wb", "demo", "--cuda"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "CUDA devices" in out.stderr and "Traceback" not in out.stderr


def test_demo_process_check_fails_on_wrong_weights():
    """The rollouts' check is real: expecting the weights of another step fails it."""
    from rich.console import Console

    import wb.cli.demo.runner
    out = wb.cli.demo.runner.run_processes("jax", "torch", replicas=1, tp=2, modes=["both"],
                                           steps=1, train_s=0.0, gen_s=0.01,
                                           console=Console(quiet=True), expect_offset=1)
    assert out["transfers_verified"] is False
    assert out["modes"]["both"]["mismatches"] > 0


@pytest.mark.parametrize("dtype", ["float16"])  # narrowed; widening: tests/test_casts.py
def test_demo_with_rollouts_in_another_dtype_converts_in_flight(dtype):
    """bf16 trainers, rollouts keeping their parameters in another dtype: still bit-identical to
    each rollout's own load of the checkpoint, in process and between processes."""
    import wb.cli.demo.runner
    report = wb.cli.demo.runner.run_demo(quiet=True, rollout_dtype=dtype, modes=["both"],
                                         steps=2, train_s=0.05)
    assert report["verified"] and report["weights_bit_identical"] and report["transfers_verified"]
    assert report["rollout_dtype"] == dtype and report["modes"]["both"]["mismatches"] == 0
    # the bf16 checkpoint travels as bf16 either way (narrowed or widened on arrival)
    from wb.layouts.presets import TINY, spec_from_config
    assert report["bytes_on_wire"] == spec_from_config(TINY).nbytes


def test_demo_refuses_a_rollout_dtype_it_cannot_build():
    out = subprocess.run([sys.executable, "-m", "wb", "demo", "--rollout", "jax",
                          "--rollout-dtype", "float32"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "needs PyTorch rollouts" in out.stderr


@pytest.mark.parametrize("trainer, rollout", [("jax", "torch"), ("torch", "jax")])
def test_demo_with_fp8_rollouts_quantises_on_the_trainers(trainer, rollout):
    """Block-scaled FP8 rollouts fed by bf16 trainers: every rollout buffer equals the rollout's
    own load of the reference-quantised checkpoint, in process and between processes, and the
    trainers send the FP8 checkpoint's bytes, not the bf16 one's."""
    import wb.cli.demo.runner
    from wb.cli.demo.checkpoint import DEMO_FP8
    from wb.layouts.presets import TINY, spec_from_config

    report = wb.cli.demo.runner.run_demo(trainer=trainer, rollout=rollout, quiet=True,
                                         rollout_dtype="float8_e4m3fn", modes=["both"],
                                         steps=2, train_s=0.05)
    assert report["verified"] and report["weights_bit_identical"] and report["transfers_verified"]
    assert report["modes"]["both"]["checks"] > 0 and report["modes"]["both"]["mismatches"] == 0
    assert report["bytes_on_wire_bf16"] == spec_from_config(TINY).nbytes
    fp8 = wb.FP8Blocks.from_json(DEMO_FP8).bind(spec_from_config(TINY)).spec
    assert report["bytes_on_wire"] == fp8.nbytes < report["bytes_on_wire_bf16"]


def test_demo_fp8_check_fails_on_wrong_weights():
    from rich.console import Console

    import wb.cli.demo.runner
    out = wb.cli.demo.runner.run_processes("jax", "torch", replicas=1, tp=2, modes=["both"],
                                           steps=1, train_s=0.0, gen_s=0.01,
                                           console=Console(quiet=True), expect_offset=1,
                                           rollout_dtype="float8_e4m3fn")
    assert out["transfers_verified"] is False and out["modes"]["both"]["mismatches"] > 0


def test_the_demos_zero_copy_check_sees_a_copy():
    """The address check the demo's processes run can fail: a worker holding a copy of the
    framework's array is counted, one holding the array itself (or a view of it) is not."""
    import types

    import numpy as np
    import torch

    from wb.cli.demo.workers import _zero_copy

    t = torch.arange(6.0, requires_grad=True)
    a = np.arange(4, dtype=np.float32)
    same = types.SimpleNamespace(buffers={"t": t.detach().numpy(), "a": a})
    copied = types.SimpleNamespace(buffers={"t": t.detach().numpy().copy(), "a": a.copy()})
    assert _zero_copy({0: same}, {0: {"t": t, "a": a}}) == (2, 0)
    assert _zero_copy({0: copied}, {0: {"t": t, "a": a}}) == (2, 2)
