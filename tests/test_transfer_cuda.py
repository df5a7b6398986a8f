"""The GPU path: buffers in device memory, packing on the device, UCX CUDA IPC between processes
sharing one GPU. Skips cleanly without a GPU (CI has none); run on the H200 device machine."""

import pytest

cupy = pytest.importorskip("cupy")
pytest.importorskip("ucxx")
try:
    if cupy.cuda.runtime.getDeviceCount() < 1:
        raise RuntimeError
except Exception:  # noqa: BLE001 - no driver, no device: the same answer
    pytest.skip("no CUDA device", allow_module_level=True)

import wb  # noqa: E402
from harness.multiproc import run_ranks  # noqa: E402


@pytest.mark.timeout(300)
@pytest.mark.parametrize("staging_bytes", [256 << 20, 2048])
@pytest.mark.parametrize("ipc", ["cuda", "off"])
def test_cuda_buffers_end_to_end_bit_identical(tmp_path, monkeypatch, staging_bytes, ipc):
    """Also with staging for a few messages at a time: each buffer goes back to the pool and
    is received into again while the checksums' stream may still be hashing it (they hold it
    until their event passes). One-sided between the processes (the default) and over UCX
    tags."""
    monkeypatch.setenv("WB_IPC", ipc)
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_plan import deployment

    trainers, rollouts = deployment()
    p = wb.plan(trainers, rollouts, chunk_bytes=256)
    p.save(tmp_path / "plan.npz")
    ranks = [lay.worker.rank for lay in (*trainers, *rollouts)]
    run = run_ranks(str(tmp_path / "plan.npz"), ranks, str(tmp_path),
                    options={"timeout": 60, "cuda_device": 0, "staging_bytes": staging_bytes})
    assert all(run.results[r] and run.results[r]["ok"] for r in ranks), run.results
    assert all(run.results[lay.worker.rank]["bit_identical"] for lay in rollouts)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("staging", [True, False])
def test_torch_sender_receiver_on_cuda_tensors(tmp_path, staging):
    pytest.importorskip("torch")
    from harness.cuda import cuda_sender_receiver_child, run_pair

    res = run_pair(cuda_sender_receiver_child, tmp_path, {"staging": staging, "versions": 3})
    assert all(r["ok"] for r in res), [(r.get("error"), r.get("trace", "")[-2000:]) for r in res]
    assert res[1]["checks"] == [True] * 3 and res[1]["same_ptr"] == [True] * 3


@pytest.mark.timeout(300)
@pytest.mark.parametrize("checksums", [True, False])
def test_receives_are_unpacked_from_the_senders_memory(tmp_path, monkeypatch, checksums):
    """One-sided CUDA messages whose regions lie apart in the receiver's buffers are unpacked by
    its kernel straight from the sender's memory (no copy into staging first), with their CRCs
    taken there when checksums are on: every rollout buffer bit-identical."""
    monkeypatch.setenv("WB_IPC", "cuda")
    monkeypatch.setenv("WB_UNPACK_IN_PLACE", "1")
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_plan import deployment

    trainers, rollouts = deployment()
    p = wb.plan(trainers, rollouts, chunk_bytes=256)
    p.save(tmp_path / "plan.npz")
    ranks = [lay.worker.rank for lay in (*trainers, *rollouts)]
    run = run_ranks(str(tmp_path / "plan.npz"), ranks, str(tmp_path),
                    options={"timeout": 60, "cuda_device": 0, "checksums": checksums})
    assert all(run.results[r] and run.results[r]["ok"] for r in ranks), run.results
    assert all(run.results[lay.worker.rank]["bit_identical"] for lay in rollouts)
    assert sum(run.results[r]["unpacked"] for r in ranks) > 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,ipc", [("both", "cuda"), ("sync", "off")])
def test_versions_as_deltas_on_cuda_buffers(tmp_path, monkeypatch, mode, ipc):
    """Trainers with ``delta=True`` on CUDA buffers: every version after the first comes as what
    changed (about 2% of the elements a version), encoded and applied on the GPU
    (:mod:`wb.runtime.engine.deltas.device`); every rollout bit-identical to the trainers'
    weights, every version. One-sided between the processes and over UCX tags."""
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from harness.multiproc import coord_child_main
    from test_plan import deployment

    monkeypatch.setenv("WB_IPC", ipc)
    trainers, rollouts = deployment()
    p = wb.plan(trainers, rollouts, chunk_bytes=4096)
    p.save(tmp_path / "plan.npz")
    ranks = [lay.worker.rank for lay in (*trainers, *rollouts)]
    send, recv = wb.MODES[mode]
    run = run_ranks(str(tmp_path / "plan.npz"), ranks, str(tmp_path), target=coord_child_main,
                    options={"versions": 4, "sender_staging": send, "receiver_staging": recv,
                             "timeout": 60, "delta": True, "density": 0.02, "cuda_device": 0},
                    join_timeout=240)
    for lay in rollouts:
        res = run.results[lay.worker.rank]
        assert res is not None and res["ok"], res
        assert res["applied"] == [1, 2, 3, 4] and res["checks"] == [True] * 4, res
        first, *later = res["received"]
        assert max(later) < 0.25 * first, res["received"]
    assert all(run.results[lay.worker.rank]["ok"] for lay in trainers), run.results
