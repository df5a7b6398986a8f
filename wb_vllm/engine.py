"""The ``weightbridge`` backend of vLLM's weight-transfer API (tested with vLLM 0.33.0).

Inference side: :class:`WeightBridgeEngine`, built by vLLM in every worker with the worker's
model; its init info is :class:`WeightBridgeInitInfo` (a dict over vLLM's RPC). Trainer side:
:class:`WeightBridgeTrainer` (:class:`wb_vllm.trainer.Trainer`, which a trainer without vLLM
installed uses directly) drives a ``wb_torch.Sender`` / ``wb_jax.Sender`` of the trainer's own
and vLLM's four control calls through a client (vLLM's ``VLLMWeightSyncClient``: HTTP routes,
Ray, or anything with those four methods).

Ranks: the trainers are wb ranks ``0 .. first_rank - 1``; vLLM worker ``w`` (its rank in vLLM's
world group: TP x PP x DP) is wb rank ``first_rank + w``. Every process reaches the same store
(``store="dir:/shared/path"`` for a directory every process sees, ``"tcp://host:port"`` for a
``torch.distributed.TCPStore`` someone hosts).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

import wb
import wb_torch
from wb_vllm import BACKEND
from wb_vllm.trainer import Trainer, TrainerSetup, open_store

__all__ = ["WeightBridgeEngine", "WeightBridgeInitInfo", "WeightBridgeTrainer",
           "WeightBridgeTrainerInitInfo", "WeightBridgeUpdateInfo", "open_store"]


@dataclass
class WeightBridgeInitInfo(WeightTransferInitInfo):
    """What every vLLM worker is told at ``init_weight_transfer_engine`` (JSON-able)."""

    store: str  # "dir:/path" or "tcp://host:port" (open_store)
    spec: dict  # the trainers' checkpoint spec (wb.CheckpointSpec.to_json())
    world: int  # wb ranks in all: trainers + vLLM workers
    first_rank: int  # the wb rank of vLLM worker 0 (the trainers come first)
    name: str = "wb"  # keeps the store keys of concurrent jobs apart
    staging: bool = True  # receiver staging: the model changes only inside update_weights
    cache: str | None = None  # a directory for the probed maps, one file per worker (a
    #                           restart reads them back instead of probing)
    fp8: dict | None = None  # wb.FP8Blocks JSON: the model serves that FP8 checkpoint
    node: str | None = None  # the host's name in the plan (default: its hostname)
    timeout: float = 120.0  # seconds to wait for peers at set-up and per transfer


@dataclass
class WeightBridgeUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights`` info: the version the trainers pushed (checked when given)."""

    version: int | None = None


class WeightBridgeEngine(WeightTransferEngine[WeightBridgeInitInfo, WeightBridgeUpdateInfo]):
    """A vLLM worker's end: probes its model, joins the plan, receives each version in place."""

    init_info_cls = WeightBridgeInitInfo
    update_info_cls = WeightBridgeUpdateInfo

    receiver: Any = None  # the wb_torch.Receiver, once init_transfer_engine ran
    layout: wb.Layout | None = None  # this worker's layout

    def init_transfer_engine(self, init_info: WeightBridgeInitInfo) -> None:
        from vllm.distributed.parallel_state import get_world_group

        group = get_world_group()
        rank = init_info.first_rank + group.rank
        spec = wb.CheckpointSpec.from_json(init_info.spec)
        if init_info.fp8 is not None:
            spec = wb.FP8Blocks.from_json(init_info.fp8).bind(spec).spec
        model = self.model
        cache = None
        if init_info.cache is not None:  # a directory the workers share, one file per worker
            cache = os.path.join(init_info.cache, "")
            os.makedirs(cache, exist_ok=True)
        saved = {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
        try:  # the probe runs the model's own load_weights on id-encoded tensors
            maps = wb_torch.probe(model, spec, cache=cache,
                                  key={"backend": BACKEND, "worker": group.rank,
                                       "world": group.world_size})
        finally:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(saved[n])
        local = self.device.index if self.device.type == "cuda" else group.local_rank
        (self.layout,) = wb_torch.layouts(model, maps, rank, node=init_info.node
                                          or socket.gethostname(), role="rollout",
                                          local_rank=local or 0)
        store = open_store(init_info.store)
        plan = wb.agree_parts(store, [self.layout], world=init_info.world,
                              name=f"{init_info.name}/plan", timeout=init_info.timeout)
        cuda = self.device.index if self.device.type == "cuda" else None
        self.receiver = wb_torch.Receiver(
            model, plan, rank, transports=wb.UcxTransport(rank, store, cuda_device=cuda),
            store=store, staging=init_info.staging, name=init_info.name, layout=self.layout,
            timeout=init_info.timeout, wait_timeout=init_info.timeout)

    def start_weight_update(self) -> None:
        pass  # weights land in the parameters' own storage

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """As vLLM's, synchronising this worker's device only (vLLM's ``torch.accelerator``
        sync fails on a CPU worker of a CUDA build of torch)."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: WeightBridgeUpdateInfo) -> None:
        if self.receiver is None:
            raise wb.TransferError("update_weights before init_weight_transfer_engine")
        self.receiver.apply()
        got = self.receiver.version
        if update_info.version is not None and got != update_info.version:
            raise wb.TransferError(f"update_weights(version={update_info.version}) applied "
                                   f"version {got}: the trainers pushed another version")

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None


@dataclass
class WeightBridgeTrainerInitInfo(TrainerSetup, TrainerInitInfo):
    """:class:`wb_vllm.trainer.TrainerSetup` as vLLM's trainer init info."""

    backend: ClassVar[str] = BACKEND


class WeightBridgeTrainer(Trainer, TrainerWeightTransferEngine[WeightBridgeTrainerInitInfo]):
    """:class:`wb_vllm.trainer.Trainer` as vLLM's ``TrainerWeightTransferEngine``."""

    init_info_cls = WeightBridgeTrainerInitInfo
