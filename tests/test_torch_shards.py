"""wb_torch.checkpoint_layouts: the maps of DTensor / FSDP2 local shards and of plain blocks."""

import multiprocessing as mp

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import wb  # noqa: E402
import wb_torch  # noqa: E402

SPEC = wb.CheckpointSpec({"w": ((6, 4), "float32"), "b": ((5,), "bfloat16")})


def _ids(name):
    return SPEC.offset(name) + np.arange(int(np.prod(SPEC.shape(name)))).reshape(SPEC.shape(name))


def test_plain_blocks_with_offsets():
    t = {"w": torch.zeros(3, 2), "b": torch.zeros(5, dtype=torch.bfloat16)}
    (lay,) = wb_torch.checkpoint_layouts(t, SPEC, 0, node="n", role="trainer",
                                         offsets={"w": (3, 2)})
    assert np.array_equal(lay.buffers["w"].sourcemap.to_indices(), _ids("w")[3:6, 2:4])
    assert np.array_equal(lay.buffers["b"].sourcemap.to_indices(), _ids("b"))
    assert lay.buffers["b"].dtype == "bfloat16"
    with pytest.raises(wb.SpecError, match="does not fit"):
        wb_torch.checkpoint_layouts(t, SPEC, 0, node="n", role="trainer", offsets={"w": (4, 0)})
    with pytest.raises(wb.SpecError, match="not in the checkpoint spec"):
        wb_torch.checkpoint_layouts({"x": torch.zeros(1)}, SPEC, 0, node="n", role="trainer")


def test_buffers_share_memory_and_refuse_non_contiguous():
    m = torch.nn.Linear(4, 3).to(torch.bfloat16)
    bufs = wb_torch.buffers(m, 7)
    assert list(bufs) == [7] and set(bufs[7]) == {"weight", "bias"}
    bufs[7]["weight"][...] = 0
    assert float(m.weight.detach().abs().sum()) == 0  # written in place: the parameter's own storage
    with pytest.raises(wb.TransferError, match="not contiguous"):
        wb_torch.buffers({"t": torch.zeros(4, 4).t()}, 0)


def _dtensor_child(rank, port, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        full = {"w": torch.zeros(6, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}
        dts = {"w": distribute_tensor(full["w"], mesh, [Shard(1)]),
               "b": distribute_tensor(full["b"], mesh, [Shard(0)])}  # uneven: 3 + 2
        (lay,) = wb_torch.checkpoint_layouts(dts, SPEC, rank, node="n", role="trainer",
                                             local_rank=rank)
        out[rank] = {n: b.sourcemap.to_indices().tolist() for n, b in lay.buffers.items()}
        bufs = wb_torch.buffers(dts, rank)[rank]
        out[f"shape{rank}"] = {n: list(a.shape) for n, a in bufs.items()}
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_dtensor_local_shards_map_to_their_global_offsets():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    with ctx.Manager() as mgr:
        out = mgr.dict()
        procs = [ctx.Process(target=_dtensor_child, args=(r, port, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(100)
        assert all(p.exitcode == 0 for p in procs)
        out = dict(out)
    w, b = _ids("w"), _ids("b")
    assert np.array_equal(out[0]["w"], w[:, :2]) and np.array_equal(out[1]["w"], w[:, 2:])
    assert np.array_equal(out[0]["b"], b[:3]) and np.array_equal(out[1]["b"], b[3:])
    assert out["shape1"] == {"w": [6, 2], "b": [2]}
