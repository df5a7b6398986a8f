"""The processes of ``tests_sglang/test_sglang_receiver.py`` (run in the SGLang venv).

    python tests_sglang/receiver.py trainer MODEL STORE_DIR VERSIONS OUT.json WORLD
    python tests_sglang/receiver.py torch-trainer MODEL STORE_DIR VERSIONS OUT.json WORLD PORT
    python tests_sglang/receiver.py spec MODEL SPEC.json     # then, with JAX (WB_JAX_PYTHON):
    python tests_sglang/receiver.py jax-trainer SPEC.json STORE_DIR VERSIONS OUT.json WORLD
    python tests_sglang/receiver.py worker MODEL TP RANK PORT STORE_DIR VERSIONS OUT.json WORLD
    python tests_sglang/receiver.py api-trainer MODEL STORE_DIR VERSIONS OUT.json WORLD TP
    python tests_sglang/receiver.py engine-worker MODEL TP RANK PORT STORE_DIR VERSIONS OUT.json WORLD

``api-trainer`` pushes the same versions through ``wb_vllm.trainer.Trainer`` (the vLLM
backend's trainer API) with a ``wb_sglang.EngineClient`` over :class:`FileEngine`, a stand-in
for SGLang's engine: ``update_weights_from_tensor`` hands the request to every TP worker
(``engine-worker``: it calls the loader the request names, as SGLang's model runner does) and
returns once all hold it; ``begin/end_weight_update`` are recorded.

The trainer holds the whole checkpoint (numpy, named as on disk), version ``v`` being the seeded
checkpoint times ``(-2) ** v`` (exact in float32), and pushes versions 1..VERSIONS with a
:class:`wb.Sender`; the PyTorch trainer is SGLang's own class at TP=1 pushed by
``wb_torch.Sender``. Each worker builds SGLang's class for its TP rank, as the engine would, and
asks :func:`wb_sglang.receive` (SGLang's custom weight loader) for every version in turn; after
each, every parameter must be bit-identical to what SGLang's own ``load_weights`` of that
version makes in a second model of the same rank, and still in the same storage.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

TRAINER_RANK, FIRST_ROLLOUT = 0, 1


def version(spec, v: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(11)
    return {n: (rng.standard_normal(spec.shape(n)).astype(np.float32) * np.float32((-2.0) ** v))
            for n in spec.names}


def trainer(model: str, store_dir: str, versions: int, out: str, world: int) -> None:
    import wb

    harness.prepare_sglang()  # the spec comes from transformers' config, as the workers'
    cfg, _ = harness.hf_config(model)
    spec = harness.checkpoint_spec(cfg)
    store = wb.DirectoryStore(store_dir)
    lay = wb.Layout(wb.Worker(TRAINER_RANK, "trainer0", "trainer"),
                    {n: wb.BufferSpec(wb.SourceMap.from_indices(spec.ids(n)), "float32")
                     for n in spec.names})
    plan = wb.agree_parts(store, [lay], world=world, name="wb/plan", timeout=200)
    bufs = version(spec, 0)
    with wb.Sender(plan, TRAINER_RANK, bufs, transport=wb.UcxTransport(TRAINER_RANK, store),
                   store=store) as tx:
        for v in range(1, versions + 1):
            for n, a in version(spec, v).items():
                bufs[n][...] = a  # the training step, in place
            tx.push()
            time.sleep(0.2)
    Path(out).write_text(json.dumps({"pushed": versions}))


def torch_trainer(model: str, store_dir: str, versions: int, out: str, world: int,
                  port: int) -> None:
    """A PyTorch trainer: SGLang's own class at TP=1 (fused ``qkv_proj``, ``gate_up_proj``,
    stacked experts: another layout than the TP=2 rollouts'), probed and pushed with
    ``wb_torch.Sender``; each version loaded into it through its own ``load_weights``."""
    harness.prepare_sglang()
    import torch

    import wb
    import wb_torch

    harness.init_tp(1, 0, port)
    cfg, cls = harness.hf_config(model)
    spec = harness.checkpoint_spec(cfg)
    with torch.device("cpu"):
        m = cls(cfg, quant_config=None)
    maps = wb_torch.probe(m, spec)
    (lay,) = wb_torch.layouts(m, maps, TRAINER_RANK, node="trainer0", role="trainer")
    store = wb.DirectoryStore(store_dir)
    plan = wb.agree_parts(store, [lay], world=world, name="wb/plan", timeout=200)
    m.load_weights((n, torch.from_numpy(a)) for n, a in version(spec, 0).items())
    with wb_torch.Sender(m, plan, TRAINER_RANK, transports=wb.UcxTransport(TRAINER_RANK, store),
                         store=store) as tx:
        for v in range(1, versions + 1):
            m.load_weights((n, torch.from_numpy(a)) for n, a in version(spec, v).items())
            tx.push()
            time.sleep(0.2)
    Path(out).write_text(json.dumps({"pushed": versions}))


def jax_trainer(spec_json: str, store_dir: str, versions: int, out: str, world: int) -> None:
    """A JAX trainer (run by an interpreter with JAX and wb, without SGLang: ``WB_JAX_PYTHON``):
    ``{checkpoint name: jax.Array}`` on one device, described by ``wb_jax.checkpoint_layouts``
    (nothing probed), pushed with ``wb_jax.Sender``; each version a new pytree."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    import wb
    import wb_jax

    spec = wb.CheckpointSpec.from_json(json.loads(Path(spec_json).read_text()))
    dev = jax.devices()[0]

    def params(v):
        return {n: jax.device_put(jnp.asarray(a), dev) for n, a in version(spec, v).items()}

    p = params(0)
    (lay,) = wb_jax.checkpoint_layouts(p, spec, {dev: TRAINER_RANK}, node="trainer0",
                                      role="trainer")
    store = wb.DirectoryStore(store_dir)
    plan = wb.agree_parts(store, [lay], world=world, name="wb/plan", timeout=200)
    with wb_jax.Sender(p, plan, {dev: TRAINER_RANK}, store=store,
                       transports={TRAINER_RANK: wb.UcxTransport(TRAINER_RANK, store)}) as tx:
        for v in range(1, versions + 1):
            tx.push(params(v))
            time.sleep(0.2)
    Path(out).write_text(json.dumps({"pushed": versions}))


def write_spec(model: str, out: str) -> None:
    """The checkpoint spec of ``model`` as JSON (for the JAX trainer, which has no SGLang)."""
    harness.prepare_sglang()
    cfg, _ = harness.hf_config(model)
    Path(out).write_text(json.dumps(harness.checkpoint_spec(cfg).to_json()))


def _tp_worker(model: str, tp: int, rank: int, port: int, store_dir: str, versions: int,
               world: int):
    """A TP worker's model, built as the engine builds it, with ``WB_SGLANG`` set, and
    ``check(v)``: how many of its parameters are bit-identical to what SGLang's own
    ``load_weights`` makes of version ``v`` (made before any update) and which moved storage."""
    harness.prepare_sglang()
    import torch

    import wb_torch

    harness.init_tp(tp, rank, port)
    cfg, cls = harness.hf_config(model)
    spec = harness.checkpoint_spec(cfg)
    with torch.device("cpu"):
        m, ref = cls(cfg, quant_config=None), cls(cfg, quant_config=None)
    os.environ["WB_SGLANG"] = json.dumps({"store": f"dir:{store_dir}", "world": world,
                                          "first_rank": FIRST_ROLLOUT, "spec": spec.to_json(),
                                          "node": "sglang0", "timeout": 200})
    ptrs = {n: p.data_ptr() for n, p in m.named_parameters()}
    want = {}
    for v in range(1, versions + 1):
        ref.load_weights((n, torch.from_numpy(a)) for n, a in version(spec, v).items())
        want[v] = {n: wb_torch.to_numpy(p).tobytes() for n, p in ref.named_parameters()}

    def check(v: int) -> dict:
        same = [n for n, p in m.named_parameters()
                if wb_torch.to_numpy(p).tobytes() == want[v][n]]
        moved = [n for n, p in m.named_parameters() if p.data_ptr() != ptrs[n]]
        return {"version": v, "params": len(ptrs), "identical": len(same), "moved": moved}
    return m, check


def worker(model: str, tp: int, rank: int, port: int, store_dir: str, versions: int,
           out: str, world: int) -> None:
    import torch

    import wb
    import wb_sglang

    m, check = _tp_worker(model, tp, rank, port, store_dir, versions, world)
    rows = []
    for v in range(1, versions + 1):
        wb_sglang.receive(m, wb_sglang.request(v))  # as SGLang calls its custom loader
        rows.append(check(v))
    try:
        wb_sglang.receive(m, wb_sglang.request(1))  # older than the one held
        stale = "no error"
    except wb.TransferError as e:
        stale = str(e)
    try:
        wb_sglang.receive(m, [("something.else", torch.zeros(1))])
        foreign = "no error"
    except wb.SpecError as e:
        foreign = str(e)
    wb_sglang.close_all()
    Path(out).write_text(json.dumps({"rows": rows, "stale": stale, "foreign": foreign}))


class FileEngine:
    """SGLang's engine as the trainers' client sees it, its TP workers other processes: each
    ``update_weights_from_tensor`` is request ``n`` in the store (its version and loader), done
    once every worker said so."""

    def __init__(self, store, tp: int):
        self.store, self.tp, self.n, self.calls = store, tp, 0, []

    def update_weights_from_tensor(self, *, named_tensors, load_format):
        version = int(dict(named_tensors)["wb_sglang.version"].reshape(-1)[0])
        self.calls.append(["update", version])
        n, self.n = self.n, self.n + 1
        self.store.set(f"engine/req/{n}", json.dumps({"version": version,
                                                      "load_format": load_format}).encode())
        for r in range(self.tp):
            err = self.store.get(f"engine/done/{n}/{r}", 300).decode()
            if err:
                raise RuntimeError(f"worker {r}: {err}")

    def begin_weight_update(self):
        self.calls.append(["begin"])

    def end_weight_update(self):
        self.calls.append(["end"])

    def stop(self):
        self.store.set(f"engine/req/{self.n}", b"stop")


def api_trainer(model: str, store_dir: str, versions: int, out: str, world: int,
                tp: int) -> None:
    import wb
    import wb_sglang
    from wb_vllm.trainer import Trainer, TrainerSetup

    harness.prepare_sglang()
    cfg, _ = harness.hf_config(model)
    spec = harness.checkpoint_spec(cfg)
    store = wb.DirectoryStore(store_dir)
    lay = wb.Layout(wb.Worker(TRAINER_RANK, "trainer0", "trainer"),
                    {n: wb.BufferSpec(wb.SourceMap.from_indices(spec.ids(n)), "float32")
                     for n in spec.names})
    bufs = version(spec, 0)
    setup = TrainerSetup(store=f"dir:{store_dir}", world=world, layouts=[lay], timeout=200,
                         make_sender=lambda plan: wb.Sender(
                             plan, TRAINER_RANK, bufs, store=store,
                             transport=wb.UcxTransport(TRAINER_RANK, store)))
    engine = FileEngine(store, tp)
    t = Trainer.trainer_init(setup, client=wb_sglang.EngineClient(engine))
    pushed = []
    for v in range(1, versions + 1):
        for n, a in version(spec, v).items():
            bufs[n][...] = a  # the training step, in place
        pushed.append(t.send_weights())
    engine.stop()
    t.shutdown()
    Path(out).write_text(json.dumps({"pushed": pushed, "calls": engine.calls}))


def engine_worker(model: str, tp: int, rank: int, port: int, store_dir: str, versions: int,
                  out: str, world: int) -> None:
    """One TP worker under :class:`FileEngine`: each request calls the loader it names (found by
    its dotted name, as SGLang finds a ``--custom-weight-loader``) with the request's tensors."""
    import importlib

    import wb
    import wb_sglang

    m, check = _tp_worker(model, tp, rank, port, store_dir, versions, world)
    store, rows, n = wb.DirectoryStore(store_dir), [], 0
    while True:
        req = store.get(f"engine/req/{n}", 300)
        if req == b"stop":
            break
        req = json.loads(req)
        mod, fn = req["load_format"].rsplit(".", 1)
        err = ""
        try:
            getattr(importlib.import_module(mod), fn)(m, wb_sglang.request(req["version"]))
        except Exception as e:  # noqa: BLE001 - reported to the engine and the test
            err = f"{type(e).__name__}: {e}"
        v = req["version"]
        if v >= 1 and not err:
            rows.append(check(v))
        store.set(f"engine/done/{n}/{rank}", err.encode())
        n += 1
    wb_sglang.close_all()
    Path(out).write_text(json.dumps({"rows": rows}))


if __name__ == "__main__":
    a = sys.argv[1:]
    if a[0] == "trainer":
        trainer(a[1], a[2], int(a[3]), a[4], int(a[5]))
    elif a[0] == "jax-trainer":
        jax_trainer(a[1], a[2], int(a[3]), a[4], int(a[5]))
    elif a[0] == "spec":
        write_spec(a[1], a[2])
    elif a[0] == "api-trainer":
        api_trainer(a[1], a[2], int(a[3]), a[4], int(a[5]), int(a[6]))
    elif a[0] == "engine-worker":
        engine_worker(a[1], int(a[2]), int(a[3]), int(a[4]), a[5], int(a[6]), a[7], int(a[8]))
    elif a[0] == "torch-trainer":
        torch_trainer(a[1], a[2], int(a[3]), a[4], int(a[5]), int(a[6]))
    else:
        worker(a[1], int(a[2]), int(a[3]), int(a[4]), a[5], int(a[6]), a[7], int(a[8]))
