"""UcxTransport's one-sided channel between GPUs' processes (CUDA IPC handles, the receiver's
row copy kernel): exact bytes, device and host memory mixed, peers of one process falling back
over UCX. Skips cleanly without a GPU (CI has none); run on the H200 device machine."""

import pytest

from harness.cuda import cupy_or_skip

cupy_or_skip()
pytest.importorskip("ucxx")

from harness.ipc import run_pair  # noqa: E402


@pytest.mark.timeout(180)
@pytest.mark.parametrize("late", [False, True], ids=["receives-first", "notes-first"])
def test_device_messages_go_one_sided_between_processes(tmp_path, late):
    """300 messages of 1 byte to 4 MiB, a tenth of them from host memory (which cannot go
    one-sided: over UCX tags): every byte exact, the device ones copied by the receiver, most of
    them several to one launch of the row copy kernel."""
    from harness.ipc import messages

    host = sum(h for *_, h in messages(300))
    res = run_pair(str(tmp_path), ipc="cuda", count=300, cuda=0, late=late)
    assert all("error" not in r for r in res), res
    assert res[1]["exact"]
    assert res[1]["counts"].pop("batched") > (300 - host) // 2
    assert res[0]["counts"].pop("batched") == 0
    want = {"one_sided": 300 - host, "over_ucx": host, "nacked": 0}
    assert res[0]["counts"] == res[1]["counts"] == want


@pytest.mark.timeout(180)
def test_a_peer_in_the_same_process_cannot_open_the_handle_and_gets_it_over_ucx(tmp_path):
    """CUDA opens no IPC handle of its own process: two ranks in threads of one process nack
    the first note of each allocation, and everything arrives over UCX, exact."""
    res = run_pair(str(tmp_path), threads=True, ipc="cuda", count=60, cuda=0, late=False)
    assert all("error" not in r for r in res), res
    assert res[1]["exact"]
    assert res[1]["counts"]["one_sided"] == 0 and res[1]["counts"]["nacked"] >= 1
    assert res[0]["counts"]["over_ucx"] == 60
