"""WeightBridge inside SGLang's TP workers: each worker receives every version in place, into
its model's own parameters, from trainers that push with ``wb_torch.Sender`` / ``wb_jax.Sender``.

SGLang 0.5.23 runs a third party's function in every TP worker when an update names it:
``--custom-weight-loader wb_sglang.receive``, then, between ``begin_weight_update()`` and
``end_weight_update()``, ``update_weights_from_tensor(named_tensors=wb_sglang.request(v),
load_format="wb_sglang.receive")`` (SGLang's safe unpickler passes a one-element tensor and a
name). :func:`receive` is that function: at its first call in a worker it sets the worker up
(:class:`Worker`: probes the model through its own ``load_weights``, from ``cache=`` when there;
publishes its layout and gets its part of the plan, the trainers publishing theirs at the same
time; a ``wb_torch.Receiver`` on the model's own storage), then applies versions until it holds
the one asked for. The job's settings come from the worker's environment (:func:`settings`).

Only this package imports SGLang's conventions; it imports neither SGLang nor vLLM, so it runs
wherever SGLang's model classes run (tested on CPU: ``tests_sglang``). Not done yet: SGLang's
plugin entry point (a receiver made at the worker's start rather than at its first update), and a
run under SGLang's engine itself (the tests call :func:`receive` as the engine would, and drive
:class:`EngineClient` through an engine that does so).
"""

from __future__ import annotations

import json
import os
from typing import Any

import wb

__all__ = ["Worker", "EngineClient", "receive", "request", "settings", "close_all",
           "VERSION_KEY", "LOAD_FORMAT"]

#: The tensor name an update carries its version under.
VERSION_KEY = "wb_sglang.version"
#: The custom weight loader an update names (``--custom-weight-loader wb_sglang.receive``).
LOAD_FORMAT = "wb_sglang.receive"

#: id(model) -> its worker: SGLang calls the loader with the model alone, once per update, in the
#: TP process that holds it (one model per process)
_WORKERS: dict[int, "Worker"] = {}


def settings() -> dict:
    """The job's settings, from ``WB_SGLANG`` in the environment (JSON): ``store`` (a
    :func:`wb_vllm.trainer.open_store` URL), ``world`` (trainers + rollout ranks), ``first_rank``
    (the wb rank of this engine's TP rank 0), ``spec`` (the checkpoint, as
    :meth:`wb.CheckpointSpec.to_json`), and optionally ``name``, ``node``, ``cache`` (a folder
    for the maps), ``staging`` (receiver staging, default true), ``timeout``.

    Raises:
        wb.SpecError: ``WB_SGLANG`` is missing or lacks a field.
    """
    raw = os.environ.get("WB_SGLANG")
    if not raw:
        raise wb.SpecError("wb_sglang: set WB_SGLANG (JSON: store, world, first_rank, spec) in the "
                           "environment of every SGLang worker")
    cfg = json.loads(raw)
    missing = [k for k in ("store", "world", "first_rank", "spec") if k not in cfg]
    if missing:
        raise wb.SpecError(f"wb_sglang: WB_SGLANG lacks {missing}")
    return cfg


def request(version: int) -> list:
    """The ``named_tensors`` of an update asking every worker for ``version``."""
    import torch

    return [(VERSION_KEY, torch.tensor([int(version)], dtype=torch.int64))]


class Worker:
    """One SGLang TP worker's end of the job.

    Args:
        model: the worker's model (SGLang's class, as its model runner holds it).
        tp_rank: its TP rank (its wb rank is ``first_rank + tp_rank``).
        cfg: :func:`settings`.
        transport: this rank's transport (default: a :class:`wb.UcxTransport` on the store).
    """

    def __init__(self, model, tp_rank: int, cfg: dict, *, transport=None):
        import wb_torch
        from wb_vllm.trainer import open_store

        self.model, self.cfg = model, cfg
        self.rank = int(cfg["first_rank"]) + int(tp_rank)
        name = cfg.get("name", "wb")
        spec = wb.CheckpointSpec.from_json(cfg["spec"])
        cache = cfg.get("cache")
        maps = wb_torch.probe(model, spec, cache=os.path.join(cache, f"rank{self.rank}")
                              if cache else None, key={"rank": self.rank})
        device = next(iter(model.parameters())).device
        gpu = (device.index or 0) if device.type == "cuda" else None
        (self.layout,) = wb_torch.layouts(model, maps, self.rank, node=cfg.get("node", "sglang"),
                                          role="rollout", local_rank=gpu or 0)
        self.store = open_store(cfg["store"])
        timeout = float(cfg.get("timeout", 120.0))
        plan = wb.agree_parts(self.store, [self.layout], world=int(cfg["world"]),
                              name=f"{name}/plan", timeout=timeout)
        if transport is None:
            transport = wb.UcxTransport(self.rank, self.store, timeout=timeout, cuda_device=gpu)
        self.rx = wb_torch.Receiver(model, plan, self.rank, transports=transport,
                                    store=self.store, name=name,
                                    staging=bool(cfg.get("staging", True)))

    @property
    def version(self) -> int:
        return self.rx.version

    def update(self, version: int) -> int:
        """Applies versions until this worker holds ``version`` (in the model's own storage);
        returns it.

        Raises:
            wb.TransferError: a failed update (with staging the previous version stays live), or
                ``version`` is older than the one held.
        """
        if version < self.rx.version:
            raise wb.TransferError(f"wb_sglang rank {self.rank}: asked for version {version}, "
                                   f"holds {self.rx.version} already")
        while self.rx.version < version:
            self.rx.apply()
        return self.rx.version

    def close(self) -> None:
        self.rx.close()


def receive(model, named_tensors) -> None:
    """SGLang's custom weight loader (``--custom-weight-loader wb_sglang.receive``): ``named_tensors``
    is :func:`request`'s; the worker of ``model`` (set up at its first call) applies versions
    until it holds the one asked for.

    Raises:
        wb.SpecError: an update without wb_sglang's version tensor.
    """
    named = dict(named_tensors)
    if VERSION_KEY not in named:
        raise wb.SpecError(f"wb_sglang.receive: the update carries no `{VERSION_KEY}` tensor; "
                           f"make its named_tensors with wb_sglang.request(version)")
    version = int(named[VERSION_KEY].reshape(-1)[0])
    worker = _WORKERS.get(id(model))
    if worker is None:
        worker = _WORKERS[id(model)] = Worker(model, _tp_rank(), settings())
    worker.update(version)


def _tp_rank() -> int:
    """This process's TP rank in SGLang's parallel state (0 without one)."""
    try:
        from sglang.srt.distributed import parallel_state

        return int(parallel_state.get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, AttributeError):
        return 0


class EngineClient:
    """An SGLang engine as the client :class:`wb_vllm.trainer.Trainer` drives, so trainers push
    to SGLang rollouts through the same API as to vLLM ones (``Trainer.trainer_init(setup,
    client=wb_sglang.EngineClient(engine))``, then ``send_weights()``).

    ``engine``: anything with SGLang's ``update_weights_from_tensor(named_tensors=,
    load_format=)`` (``sglang.Engine``, or a client of its HTTP server), and, where it has them,
    ``begin_weight_update()`` / ``end_weight_update()`` (called around each update). The
    engine's workers read the job from their ``WB_SGLANG`` (:func:`settings`): it must name the
    store, world and name the trainers' :class:`wb_vllm.trainer.TrainerSetup` does; the init
    info vLLM's workers get through ``init_weight_transfer_engine`` is not sent to SGLang's.
    """

    def __init__(self, engine):
        self.engine = engine

    def _update(self, version: int) -> None:
        self.engine.update_weights_from_tensor(named_tensors=request(version),
                                               load_format=LOAD_FORMAT)

    def init_weight_transfer_engine(self, info: dict) -> None:
        """Sets every TP worker up (probe or cached maps, its layout published, its part of the
        plan) by asking for version 0, which it holds once set up."""
        self._update(0)

    def start_weight_update(self) -> None:
        begin = getattr(self.engine, "begin_weight_update", None)
        if begin is not None:
            begin()

    def update_weights(self, request_: dict) -> None:
        """Every TP worker receives ``request_["version"]`` in place (returns once all hold it)."""
        self._update(int(request_["version"]))

    def finish_weight_update(self) -> None:
        end = getattr(self.engine, "end_weight_update", None)
        if end is not None:
            end()


def close_all() -> None:
    """Closes every worker's receiver (the engine is shutting down)."""
    for w in list(_WORKERS.values()):
        w.close()
    _WORKERS.clear()

