"""Checksums on the GPU: the CRC32C kernel (``wb.runtime.engine.crc``) on device buffers equals
the host library, many buffers of any length and alignment in one launch, and copies what it
hashes where a row says; and a real transfer of CUDA buffers over UCX (copied out of their
senders' memory and hashed in one pass with ``WB_COPY_HASHED=1``, and without) with one bit
flipped on the wire is refused where it lands, the others bit-identical. Skips cleanly without
a GPU (CI has none); run on the H200 device machine."""

import json

import numpy as np
import pytest

from harness.cuda import cupy_or_skip

cupy = cupy_or_skip()
pytest.importorskip("ucxx")

import wb  # noqa: E402
from harness.multiproc import run_ranks  # noqa: E402
from wb.runtime.engine import crc  # noqa: E402


@pytest.mark.parametrize("sub", [crc.SUB, 256, 7])
def test_device_kernel_equals_the_library(sub):
    rng = np.random.default_rng(sub)
    host = rng.integers(0, 256, 40 << 20, dtype=np.uint8)
    dev = cupy.asarray(host)
    cuts = [(0, 0), (3, 1), (8, 4096), (1, 4097), (5, 1 << 20), (2, (8 << 20) + 3),
            (16 << 20, 24 << 20)]
    out = cupy.zeros(len(cuts) + 3, cupy.uint32)
    bufs = [(dev.data.ptr + a, n, len(cuts) - i) for i, (a, n) in enumerate(cuts)]
    lz = crc.Launcher(cupy, len(bufs), sub=sub)  # rows in pinned memory, copied behind the
    lz.launch(bufs[:3], out)  # stream, in two launches
    lz.launch(bufs[3:], out)
    got = out.get()
    for i, (a, n) in enumerate(cuts):
        assert int(got[len(cuts) - i]) == crc.host(host[a:a + n]), (a, n)


@pytest.mark.parametrize("sub", [crc.SUB, 7])
def test_thousands_of_short_buffers_in_one_launch(sub):
    """Many buffers per block of the kernel (each thread finds its own among them, each warp
    XORs per buffer), of every length and alignment, slots in any order, over launches."""
    rng = np.random.default_rng(sub + 1)
    host = rng.integers(0, 256, 16 << 20, dtype=np.uint8)
    dev = cupy.asarray(host)
    n = 6000
    lens = np.where(rng.random(n) < 0.05, rng.integers(2500, 300_000, n), rng.integers(0, 2500, n))
    starts = rng.integers(0, host.size - 300_000, n)
    slots = rng.permutation(n)
    out = cupy.zeros(n, cupy.uint32)
    lz = crc.Launcher(cupy, n, sub=sub)
    bufs = [(dev.data.ptr + int(a), int(b), int(k)) for a, b, k in zip(starts, lens, slots)]
    for part in np.array_split(np.arange(n), 3):
        lz.launch([bufs[i] for i in part], out)
    got = out.get()
    for a, b, k in zip(starts, lens, slots):
        assert int(got[k]) == crc.host(host[a:a + b]), (a, b)


@pytest.mark.parametrize("sub", [crc.SUB, 7])
def test_rows_with_a_destination_are_copied_as_they_are_hashed(sub):
    """Rows ``(pointer, bytes, slot, destination)`` at every pair of alignments, on a stream of
    their own: each destination holds its source's bytes, nothing around it is written, and
    the CRCs are the library's."""
    rng = np.random.default_rng(sub + 2)
    host = rng.integers(0, 256, 24 << 20, dtype=np.uint8)
    src = cupy.asarray(host)
    dst = cupy.zeros(src.size + (1 << 20), cupy.uint8)
    lens = [0, 1, 15, 17, 1000, 4097, 1 << 20, (3 << 20) + 5]
    rows, at, to, want = [], 0, 0, np.zeros(dst.size, np.uint8)
    for i, n in enumerate(lens):
        a, b = at + i % 16, to + (3 * i) % 16
        rows.append((src.data.ptr + a, n, i, dst.data.ptr + b))
        want[b:b + n] = host[a:a + n]
        at, to = a + n + 64, b + n + 64
    out = cupy.zeros(len(lens), cupy.uint32)
    stream = cupy.cuda.Stream(non_blocking=True)
    crc.Launcher(cupy, len(rows), sub=sub).launch(rows, out, stream)
    stream.synchronize()
    np.testing.assert_array_equal(dst.get(), want)
    got = out.get()
    for i, (p0, n, _, _) in enumerate(rows):
        a = p0 - src.data.ptr
        assert int(got[i]) == crc.host(host[a:a + n]), n


@pytest.mark.timeout(300)
@pytest.mark.parametrize("copy_hashed", ["1", "0"])
def test_a_flipped_bit_in_a_cuda_message_is_refused_where_it_lands(tmp_path, monkeypatch,
                                                                   copy_hashed):
    monkeypatch.setenv("WB_COPY_HASHED", copy_hashed)  # (the spawned ranks inherit it)
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_plan import deployment

    trainers, rollouts = deployment()
    p = wb.plan(trainers, rollouts, chunk_bytes=256)
    p.save(tmp_path / "plan.npz")
    ranks = [lay.worker.rank for lay in (*trainers, *rollouts)]
    stamp = tmp_path / "flipped.json"
    run = run_ranks(str(tmp_path / "plan.npz"), ranks, str(tmp_path),
                    options={"timeout": 60, "cuda_device": 0},
                    faults={0: {"flip_in": 0, "flip_send": 0, "stamp": str(stamp)}})
    flipped = json.loads(stamp.read_text())
    M = p.messages
    reached, todo = set(), [flipped["message"]]
    while todo:
        k = todo.pop()
        reached.add(int(M.dst_rank[k]))
        todo += np.flatnonzero(M.parent == k).tolist()
    for r in ranks:
        res = run.results[r]
        if r in reached:
            assert not res["ok"] and "failed their checksums" in res["error"], res
        else:
            assert res["ok"], res
            assert r < len(trainers) or res["bit_identical"], res
    # with WB_COPY_HASHED=1 the rollouts that passed took their checks as they copied (one
    # pass over the bytes); without, none did
    hashed = sum(run.results[r]["hashed"] for r in ranks[len(trainers):] if r not in reached)
    assert (hashed > 0) == (copy_hashed == "1"), hashed
