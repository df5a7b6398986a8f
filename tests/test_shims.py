"""wb_torch and wb_jax mirror each other: the same functions with the same signatures, the same
layouts for the same blocks, and a PyTorch trainer feeding a JAX rollout (and the reverse) through
the two shims' Sender and Receiver, bit for bit."""

import inspect

import numpy as np
import pytest
from wb.data.dtypes import dtype_info
from wb.runtime.transport.local import LocalHub, LocalTransport

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

import wb  # noqa: E402
from harness.threads import together  # noqa: E402
import wb_jax  # noqa: E402
import wb_torch  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

MIRRORED = ["probe", "layouts", "checkpoint_layouts", "buffers", "Sender", "Receiver", "to_numpy",
            "from_numpy"]
SPEC = wb.CheckpointSpec({"w": ((4, 6), "float32"), "b": ((6,), "bfloat16")})


def test_both_shims_export_the_same_functions():
    assert wb_torch.__all__ == MIRRORED
    assert wb_jax.__all__[:len(MIRRORED)] == MIRRORED  # then JAX-only helpers (shard maps, ...)


@pytest.mark.parametrize("name", MIRRORED)
def test_mirrored_functions_take_the_same_arguments(name):
    def params(mod):
        sig = inspect.signature(getattr(mod, name))
        # PyTorch's probe also takes the model's loader (JAX's load function is its first arg)
        return [(p.name if i else "first", p.kind) for i, p in enumerate(sig.parameters.values())
                if not (name == "probe" and p.name == "load_weights")]
    assert params(wb_torch) == params(wb_jax)


def test_checkpoint_layouts_agree_on_the_same_blocks():
    devs = jax.devices()[:2]
    mesh = Mesh(np.array(devs), ("x",))
    w = jax.device_put(np.zeros((4, 6), np.float32), NamedSharding(mesh, PartitionSpec(None, "x")))
    jl = wb_jax.checkpoint_layouts({"w": w}, SPEC, {devs[0]: 0, devs[1]: 1}, node="n",
                                   role="trainer")
    tl = [wb_torch.checkpoint_layouts({"w": torch.zeros(4, 3)}, SPEC, r, node="n", role="trainer",
                                      local_rank=r, offsets={"w": (0, 3 * r)})[0]
          for r in (0, 1)]
    # the same maps and dtypes; JAX names a leaf by its path in the pytree
    for j, t in zip(jl, tl):
        assert j.worker == t.worker
        assert {n.strip("[']"): b for n, b in j.buffers.items()} == t.buffers
    ids = SPEC.ids("w")
    assert np.array_equal(jl[1].buffers["['w']"].sourcemap.to_indices(), ids[:, 3:])


def test_one_rank_for_params_on_several_devices_is_refused():
    devs = jax.devices()[:2]
    x = jax.device_put(np.zeros(4, np.float32),
                       NamedSharding(Mesh(np.array(devs), ("x",)), PartitionSpec("x")))
    with pytest.raises(wb.SpecError, match="live on 2 devices"):
        wb_jax.buffers({"x": x}, 0)
    with pytest.raises(TypeError, match="ranks must be"):
        wb_torch.buffers({"x": torch.zeros(2)}, "0")


def _ckpt(seed):
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((4, 6), dtype=np.float32),
            "b": rng.standard_normal(6, dtype=np.float32).astype(dtype_info("bfloat16").numpy)}


@pytest.mark.parametrize("direction", ["torch->jax", "jax->torch"])
@pytest.mark.parametrize("staging", [False, True])
def test_a_trainer_of_one_framework_feeds_a_rollout_of_the_other(direction, staging):
    ck = _ckpt(0)
    dev = jax.devices()[0]
    torch_params = {n: wb_torch.from_numpy(a.copy()) for n, a in ck.items()}
    jax_params = {n: wb_jax.from_numpy(a.copy(), dev) for n, a in ck.items()}
    t_kind, r_kind = direction.split("->")
    shim = {"torch": wb_torch, "jax": wb_jax}
    params = {"torch": torch_params, "jax": jax_params}
    tl = shim[t_kind].checkpoint_layouts(params[t_kind], SPEC, 0, node="t", role="trainer")
    rl = shim[r_kind].checkpoint_layouts(params[r_kind], SPEC, 1, node="r", role="rollout")
    plan = wb.plan(tl, rl)
    hub, store = LocalHub(), wb.MemoryStore()
    # the rollout starts from zeros
    zeros = {"torch": {n: torch.zeros_like(t) for n, t in torch_params.items()},
             "jax": {n: wb_jax.from_numpy(np.zeros_like(a), dev) for n, a in ck.items()}}
    kw = dict(store=store, staging=staging, timeout=30, wait_timeout=30)
    tx, rx = together(
        lambda: shim[t_kind].Sender(params[t_kind], plan, 0,
                                    transports=LocalTransport(0, hub, timeout=30), **kw),
        lambda: shim[r_kind].Receiver(zeros[r_kind], plan, 1,
                                      transports=LocalTransport(1, hub, timeout=30), **kw))
    with tx, rx:
        got = together(tx.push, rx.apply)[1]
        assert tx.version == rx.version == 1
        if r_kind == "torch":
            assert got is zeros["torch"]  # written in place: the same tensors
        for n, a in ck.items():
            assert shim[r_kind].to_numpy(got[n]).tobytes() == a.tobytes(), n
        # the next version: PyTorch updates in place, JAX makes new arrays
        if t_kind == "torch":
            with torch.no_grad():
                for t in torch_params.values():
                    t.mul_(-2)
        else:
            params["jax"] = {n: a * -2 for n, a in jax_params.items()}
        got = together(lambda: tx.push(params[t_kind]), rx.apply)[1]
        assert rx.version == 2
        for n, a in ck.items():
            want = (a * np.asarray(-2, a.dtype)).astype(a.dtype)
            assert shim[r_kind].to_numpy(got[n]).tobytes() == want.tobytes(), n


@pytest.mark.parametrize("staging", [False, True])
def test_a_jax_receiver_over_recycled_memory_is_zero_copy_and_never_writes_kept_arrays(
        monkeypatch, staging):
    """The JAX adapter's GPU path (``recycles``), run on JAX's first CPU device: each version's
    arrays are made of wb's memory by ``jax.dlpack.from_dlpack`` (same address), a set JAX has
    freed is written again, and arrays the caller keeps are never written."""
    monkeypatch.setattr(wb_jax._Arrays, "recycles", lambda self, rank: True)
    ck = _ckpt(0)
    dev = jax.devices()[0]
    torch_params = {n: wb_torch.from_numpy(a.copy()) for n, a in ck.items()}
    tl = wb_torch.checkpoint_layouts(torch_params, SPEC, 0, node="t", role="trainer")
    zeros = {n: wb_jax.from_numpy(np.zeros_like(a), dev) for n, a in ck.items()}
    rl = wb_jax.checkpoint_layouts(zeros, SPEC, 1, node="r", role="rollout")
    plan = wb.plan(tl, rl)
    hub, store = LocalHub(), wb.MemoryStore()
    kw = dict(store=store, staging=staging, timeout=30, wait_timeout=30)
    tx, rx = together(
        lambda: wb_torch.Sender(torch_params, plan, 0,
                                transports=LocalTransport(0, hub, timeout=30), **kw),
        lambda: wb_jax.Receiver(zeros, plan, 1,
                                transports=LocalTransport(1, hub, timeout=30), **kw))
    (worker,) = rx.workers.values()
    assert type(worker._target).__name__ == "Recycled"

    def version(v):
        return {n: (a.astype(np.float32) * (-2.0) ** v).astype(a.dtype) for n, a in ck.items()}

    def update(v):
        with torch.no_grad():
            for n, t in torch_params.items():
                t.copy_(wb_torch.from_numpy(version(v)[n]))
        got = together(tx.push, rx.apply)[1]
        for n in ck:
            assert wb_jax.to_numpy(got[n]).tobytes() == version(v)[n].tobytes(), (v, n)
            # the array JAX hands back is wb's memory
            assert got[n].unsafe_buffer_pointer() == wb.runtime.engine.buffers.address(
                worker.buffers[f"['{n}']"])
        return got

    with tx, rx:
        p1 = update(1)
        p2 = update(2)
        first = p1["w"].unsafe_buffer_pointer()
        del p1
        p3 = update(3)
        assert p3["w"].unsafe_buffer_pointer() == first  # freed, so written again
        kept = p2
        del p2, p3
        update(4)
        update(5)
        for n in ck:  # kept arrays stay version 2's, whatever came after
            assert wb_jax.to_numpy(kept[n]).tobytes() == version(2)[n].tobytes(), n


@pytest.mark.parametrize("shim", ["torch", "jax"])
def test_a_rank_without_a_part_is_refused_naming_the_ranks_there_are(shim):
    """Parameters of a rank the plan (or the parts given) has no part for: the plan's own error,
    naming its ranks, before any transport is touched."""
    w = SPEC.ids("w")
    lay = lambda r, role: wb.Layout(wb.Worker(r, "n", role), {  # noqa: E731
        "w": wb.BufferSpec(wb.SourceMap.from_indices(w), "float32")})
    plan = wb.plan([lay(0, "trainer")], [lay(1, "rollout")])
    parts = {1: wb.RankPlan.of(plan, 1)}
    params = ({"w": torch.zeros(4, 6)} if shim == "torch"
              else {"w": jax.device_put(np.zeros((4, 6), np.float32), jax.devices()[0])})
    mod = wb_torch if shim == "torch" else wb_jax
    ranks = 5 if shim == "torch" else {jax.devices()[0]: 5}
    with pytest.raises(wb.PlanError, match=r"rank 5 has no layout in this plan \(ranks \[0, 1\]\)"):
        mod.Sender(params, plan, ranks, transports=object(), store=wb.MemoryStore())
    ranks = 0 if shim == "torch" else {jax.devices()[0]: 0}
    with pytest.raises(wb.PlanError, match=r"rank 0 has no part here .*ranks \[1\]"):
        mod.Receiver(params, parts, ranks, transports=object(), store=wb.MemoryStore())


def test_jax_arrays_of_wb_memory_are_that_memory_and_fall_back_when_jax_differs(monkeypatch):
    """``wb_jax.views.array_of``: the array JAX makes of wb's memory is that memory (same
    address, values, shape), held until JAX lets it go; a conversion that gives anything else
    (another JAX's internals) is dropped for ``jax.dlpack.from_dlpack``, with the same result."""
    import jax

    from wb.runtime.engine import dlpack
    from wb.runtime.engine.buffers import aligned_empty
    from wb_jax import views

    dev = jax.devices("cpu")[0]
    a = aligned_empty((3, 5), "float32")
    a[...] = np.arange(15).reshape(3, 5)
    holds = dlpack.Holds()
    x = views.array_of(dlpack.export(a, "float32", holds), dev)
    assert views._direct  # this JAX's conversion is taken directly
    assert x.unsafe_buffer_pointer() == a.ctypes.data and x.shape == (3, 5)
    np.testing.assert_array_equal(np.asarray(x), a)
    assert holds.count == 1
    del x
    assert holds.count == 0

    def elsewhere(capsule, device, stream, copy, kind):  # an array of other memory
        return jax.device_put(np.zeros((3, 5), np.float32), device)

    monkeypatch.setattr(views, "_direct", elsewhere)
    y = views.array_of(dlpack.export(a, "float32", holds), dev)
    assert views._direct is False  # given up for good
    assert y.unsafe_buffer_pointer() == a.ctypes.data
    np.testing.assert_array_equal(np.asarray(y), a)
