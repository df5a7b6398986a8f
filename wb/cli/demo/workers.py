"""The processes of ``python -m wb demo`` (spawned; importable so ``multiprocessing`` can start them).

Each process probes its own load path, publishes its layouts, gets its workers' parts of the plan
(:func:`wb.agree_parts`) and then, for each sync mode, runs a small RL loop over
UCX: the trainer "trains" (an emulated compute step, then a real update of every weight:
``w <- -2 w``, exact in any float dtype) and pushes; the rollouts "generate" (emulated decode
steps), apply each new version between steps, and check every buffer bit for bit against what
their *own* loader makes of the trainer's checkpoint at that step (``(-2)**step * checkpoint``).
Every call's stall is recorded by wb itself.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

import numpy as np

from wb.cli.demo.checkpoint import DEMO_FP8, expected_checkpoint, fp8_checkpoint, random_checkpoint
from wb.runtime.membership.agree import agree_parts

__all__ = ["worker_main"]


def _ucx(rank, store, mode, cuda=None):
    from wb.runtime.transport.ucx import UcxTransport

    return UcxTransport(rank, store, session=f"demo/{mode}/ucx", timeout=120, cuda_device=cuda)


def _cuda_device(job):
    """With ``--cuda``: the CUDA device of a PyTorch process (a node's workers spread over the
    GPUs); else None."""
    if not job.get("cuda"):
        return None
    from wb_torch.testing import spread_device

    return spread_device(job["local_rank"])


def _fp8(job):
    """With ``--rollout-dtype float8_e4m3fn``: the declaration (wb.FP8Blocks); else None."""
    if job.get("rollout_dtype") != "float8_e4m3fn":
        return None
    import wb

    return wb.FP8Blocks.from_json(DEMO_FP8)


def _quantize(job, spec) -> dict:
    """``agree_parts``'s and the Senders' ``quantize=`` (empty without FP8 rollouts)."""
    fp8 = _fp8(job)
    return {} if fp8 is None else {"quantize": fp8.bind(spec)}


def _trainers_key(store, k=None):
    if k is not None:
        store.set("demo/trainers", str(k).encode())
        return k
    return int(store.get("demo/trainers", 300))


def worker_main(job: dict) -> None:
    """One demo process: ``job`` says its side, framework, ranks and the loop's parameters."""
    out = Path(job["result_dir"]) / f"{job['name']}.json"
    result = {"name": job["name"], "ok": False, "modes": {}}
    os.environ.setdefault("WB_JOB_KEY", job["job_key"])  # the demo's job signs its records
    if job["kind"] == "jax":  # emulated CPU devices, or the GPUs with --cuda
        if job.get("cuda"):  # sharing them with the other processes: no preallocation
            os.environ["JAX_PLATFORMS"] = "cuda"
            os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        else:
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        from wb.layouts.presets import spec_from_config
        from wb.runtime.transport.stores import DirectoryStore

        store = DirectoryStore(job["store_dir"])
        spec = spec_from_config(job["cfg"])

        ckpt = random_checkpoint(0, job["cfg"])
        fn = {("trainer", "jax"): _jax_trainer, ("trainer", "torch"): _torch_trainer,
              ("rollout", "jax"): _jax_rollout, ("rollout", "torch"): _torch_rollout}
        fn[(job["role"], job["kind"])](job, store, spec, ckpt, result)
        result["ok"] = True
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the demo
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    finally:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, out)


def _weight_check(job, rx, spec, mode, result) -> None:
    """With ``--check``: this process's rollout ranks check the version just applied against
    the trainers' claim of it (every element); their reports go into the result."""
    if not job.get("check"):
        return
    for rank, rep in rx.check(spec, per_tensor=None).items():
        result["modes"].setdefault(mode, {}).setdefault("weight_checks", []).append(
            {"rank": rank, "version": rep.version, "ok": rep.ok, "mismatched": rep.mismatched,
             "seconds": rep.seconds})


def _progress(store, mode, v, rank):
    store.set(f"demo/progress/{mode}/{v}/{rank}", b"1")


# --- trainers ------------------------------------------------------------------------------------
def _jax_devices(job, n):
    """``n`` emulated CPU devices, or (with ``--cuda``) the GPUs, already enough of them."""
    import wb_jax

    if not job.get("cuda"):
        wb_jax.use_cpu_devices(n)


def _jax_ucx(rank, store, mode, dev):
    """The transport of a JAX device's rank (on a GPU: UCX's CUDA transports on its memory)."""
    return _ucx(rank, store, mode, dev.id if dev.platform == "gpu" else None)


def _zero_copy(workers, arrays) -> tuple[int, int]:
    """``(checked, bad)`` over ``{rank: {name: framework array}}``: each array a worker moves
    must be its buffer itself (the same address: no copy on either side)."""
    from wb.runtime.engine.buffers import address

    pairs = [(workers[r].buffers[n], a) for r, bufs in arrays.items() for n, a in bufs.items()
             if n in workers[r].buffers]
    return len(pairs), sum(address(b) != address(getattr(a, "detach", lambda: a)())
                           for b, a in pairs)


def _jax_trainer(job, store, spec, ckpt, result):
    import wb_jax

    _jax_devices(job, job["dp"] * job["tp"])
    import wb
    from wb_jax.testing import make_load_fn, make_mesh, sparse_train_step, train_step

    mesh = make_mesh(job["dp"], job["tp"])
    load = make_load_fn(job["cfg"], mesh)
    maps = wb_jax.probe(load, spec)
    params = load(ckpt)
    devices = list(mesh.devices.flat)
    trial = wb_jax.layouts(params, maps, ranks={d: i for i, d in enumerate(devices)},
                           node="trainer0", role="trainer")
    holders = [d for d, lay in zip(devices, trial) if lay.buffers]  # replica 0's devices
    ranks = {d: i for i, d in enumerate(holders)}
    layouts = wb_jax.layouts(params, maps, ranks=ranks, node="trainer0", role="trainer")
    world = _trainers_key(store, len(layouts)) + job["rollout_workers"]
    planned = []  # the whole plan, in the process that makes it (this one: it holds rank 0)
    q = _quantize(job, spec)
    plan = agree_parts(store, layouts, world=world, name="demo/plan", planned=planned,
                       delta=bool(job.get("delta")), **q)
    if job.get("plan_path") and planned:
        planned[0].save(job["plan_path"])
    if q:  # each rank rebuilds what it quantises from its own layout
        q["layout"] = {lay.worker.rank: lay for lay in layouts}
    state = {"params": params, "steps": 0}

    def step(sender):  # JAX makes a new pytree every step
        state["steps"] += 1
        state["params"] = (sparse_train_step(state["params"], state["steps"]) if job.get("delta")
                           else train_step(state["params"]))
        sender.push(state["params"])
        if job.get("check"):
            sender.claim(spec, per_tensor=None)
        if q:  # what it sends are its quantised copies
            return 0, 0
        return _zero_copy(sender.workers, wb_jax.buffers(state["params"], ranks))

    for mode in job["modes"]:
        sender = wb_jax.Sender(state["params"], plan, ranks, store=store,
                               staging=wb.MODES[mode][0], name=f"demo/{mode}", timeout=60,
                               wait_timeout=300,
                               transports={r: _jax_ucx(r, store, mode, d)
                                           for d, r in ranks.items()},
                               delta=bool(job.get("delta")), **q)
        _train(job, mode, sender, step, result)


def _train(job, mode, sender, step, result):
    """``steps`` training steps of emulated compute, each ending in ``step(sender)`` (the update
    and the push; it returns how many buffers wb did not read in place); records the sender's
    stalls."""
    checks = bad = 0
    for _ in range(job["steps"]):
        time.sleep(job["train_s"])  # the rest of a training step (emulated compute)
        n, b = step(sender)
        checks, bad = checks + n, bad + b
    sender.wait()
    result["modes"][mode] = {"stats": [s.to_json() for s in sender.stats], "checks": checks,
                             "bad": int(bad)}
    sender.close()


def _torch_trainer(job, store, spec, ckpt, result):
    import wb
    import wb_torch
    from wb_torch.testing import TinyRollout, sparse_train_step_, train_step_

    tp, r = job["tp"], job["local_rank"]
    model = TinyRollout(job["cfg"], tp_rank=r, tp_size=tp)
    (lay,) = wb_torch.layouts(model, wb_torch.probe(model, spec), r, node="trainer0",
                              role="trainer", local_rank=r)
    dev = _cuda_device(job)
    if dev is not None:  # probed on the CPU (same module, same maps); trains on the GPU
        model.to(f"cuda:{dev}")
    model.load_weights((n, wb_torch.from_numpy(a)) for n, a in ckpt.items())
    if r == 0:
        _trainers_key(store, tp)
    planned = []  # the whole plan, in the process that makes it (rank 0's)
    q = _quantize(job, spec)
    plan = agree_parts(store, [lay], world=tp + job["rollout_workers"], name="demo/plan",
                       planned=planned, delta=bool(job.get("delta")), **q)
    if planned and job.get("plan_path"):
        planned[0].save(job["plan_path"])
    steps = [0]

    def train(model):
        steps[0] += 1
        if job.get("delta"):
            sparse_train_step_(model, steps[0])
        else:
            train_step_(model)
    for mode in job["modes"]:
        sender = wb_torch.Sender(model, plan, r, store=store, staging=wb.MODES[mode][0],
                                 name=f"demo/{mode}", timeout=60, wait_timeout=300,
                                 transports=_ucx(r, store, mode, dev), layout=lay,
                                 delta=bool(job.get("delta")), **q)
        params = dict(model.named_parameters())
        in_place = {r: {n: params[n] for n in lay.buffers}} if not q else {}
        _train(job, mode, sender,
               lambda s: (train(model), s.push(),
                          job.get("check") and s.claim(spec, per_tensor=None),
                          _zero_copy(s.workers, in_place))[3],
               result)


# --- rollouts ------------------------------------------------------------------------------------
def _torch_rollout(job, store, spec, ckpt, result):
    import wb
    import torch
    import wb_torch
    from wb_torch.testing import TinyRollout

    tp, r = job["tp"], job["local_rank"]
    first = _trainers_key(store)
    rank = first + job["first_rank"]
    fp8 = _fp8(job)
    kw = ({"fp8": fp8} if fp8 is not None else
          {"dtype": getattr(torch, job["rollout_dtype"])} if job.get("rollout_dtype") else {})
    model = TinyRollout(job["cfg"], tp_rank=r, tp_size=tp, **kw)
    (lay,) = wb_torch.layouts(model, wb_torch.probe(model, model.spec), rank, node=job["node"],
                              role="rollout", local_rank=r)
    plan = agree_parts(store, [lay], world=first + job["rollout_workers"], name="demo/plan",
                       **_quantize(job, spec))
    dev = _cuda_device(job)
    if dev is not None:
        model.to(f"cuda:{dev}")
    params = dict(model.named_parameters())
    ptrs = {n: params[n].data_ptr() for n in lay.buffers}
    step = 0
    for mode in job["modes"]:
        rx = wb_torch.Receiver(model, plan, rank, store=store, staging=wb.MODES[mode][1],
                               name=f"demo/{mode}", timeout=60, wait_timeout=300,
                               transports=_ucx(rank, store, mode, dev), layout=lay)
        checks = bad = 0
        while rx.version < job["steps"]:
            time.sleep(job["gen_s"])  # a decode step (emulated); reads the live weights
            if rx.ready():
                rx.apply()  # the model's own storage now holds the new version
                v = rx.version
                step += 1
                ref = TinyRollout(job["cfg"], tp_rank=r, tp_size=tp, **kw)
                want_ck = expected_checkpoint(ckpt, step + job["expect_offset"],
                                              sparse=bool(job.get("delta")))
                if fp8 is not None:  # its own load of the reference-quantised checkpoint
                    want_ck = fp8_checkpoint(want_ck, fp8, job["cfg"])
                ref.load_weights((n, wb_torch.from_numpy(a)) for n, a in want_ck.items())
                want = dict(ref.named_parameters())
                for n in lay.buffers:
                    checks += 1
                    same = (wb_torch.to_numpy(params[n]).tobytes()
                            == wb_torch.to_numpy(want[n]).tobytes())
                    bad += (not same) or params[n].data_ptr() != ptrs[n]
                _weight_check(job, rx, spec, mode, result)
                _progress(store, mode, v, rank)
        result["modes"].setdefault(mode, {}).update(
            {"stats": [s.to_json() for s in rx.stats], "checks": checks, "bad": int(bad)})
        rx.close()


def _jax_rollout(job, store, spec, ckpt, result):
    import wb_jax

    _jax_devices(job, job["tp"])
    import wb
    from wb_jax.testing import make_load_fn, make_mesh

    mesh = make_mesh(1, job["tp"])
    fp8 = _fp8(job)
    load = make_load_fn(job["cfg"], mesh, fp8=fp8)
    rollout_spec = spec if fp8 is None else fp8.bind(spec).spec
    maps = wb_jax.probe(load, rollout_spec)

    def checkpoint(step):  # what this rollout's own load is fed at a step
        ck = expected_checkpoint(ckpt, step, sparse=bool(job.get("delta")))
        return ck if fp8 is None else fp8_checkpoint(ck, fp8, job["cfg"])

    template = load({n: np.zeros_like(a) for n, a in checkpoint(0).items()})
    first = _trainers_key(store)
    base = first + job["first_rank"]
    ranks = {d: base + i for i, d in enumerate(mesh.devices.flat)}
    layouts = wb_jax.layouts(template, maps, ranks=ranks, node=job["node"], role="rollout")
    plan = agree_parts(store, layouts, world=first + job["rollout_workers"], name="demo/plan",
                       **_quantize(job, spec))
    step = 0
    for mode in job["modes"]:
        rx = wb_jax.Receiver(template, plan, ranks, store=store, staging=wb.MODES[mode][1],
                             name=f"demo/{mode}", timeout=60, wait_timeout=300,
                             transports={r: _jax_ucx(r, store, mode, d)
                                         for d, r in ranks.items()})
        checks = bad = 0
        while rx.version < job["steps"]:
            time.sleep(job["gen_s"])
            if rx.ready():
                params = rx.apply()
                step += 1
                want = wb_jax.leaves(load(checkpoint(step + job["expect_offset"])))
                got = wb_jax.leaves(params)
                names = {k for lay in layouts for k in lay.buffers}
                for k in names:
                    checks += 1
                    bad += np.asarray(got[k]).tobytes() != np.asarray(want[k]).tobytes()
                # zero-copy: the new arrays are the received buffers themselves
                bad += _zero_copy(rx.workers, wb_jax.buffers(params, ranks))[1]
                _weight_check(job, rx, spec, mode, result)
                _progress(store, mode, rx.version, base)
        result["modes"].setdefault(mode, {}).update(
            {"stats": [s.to_json() for s in rx.stats], "checks": checks, "bad": int(bad)})
        rx.close()
