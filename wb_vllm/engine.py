"""The ``weightbridge`` backend of vLLM's weight-transfer API (tested with vLLM 0.33.0).

Inference side: :class:`WeightBridgeEngine`, built by vLLM in every worker with the worker's
model; its init info is :class:`WeightBridgeInitInfo` (a dict over vLLM's RPC). Trainer side:
:class:`WeightBridgeTrainer` (:class:`wb_vllm.trainer.Trainer`, which a trainer without vLLM
installed uses directly) drives a ``wb_torch.Sender`` / ``wb_jax.Sender`` of the trainer's own
and vLLM's four control calls through a client (vLLM's ``VLLMWeightSyncClient``: HTTP routes,
Ray, or anything with those four methods).

The probe goes through vLLM's layerwise reload (:func:`reload_load_weights`), as vLLM's own
checkpoint-format backends (``nccl``, ``ipc``) load every update: the maps describe the weights
after each layer's ``process_weights_after_loading``, which vLLM serves and wb writes into.

Ranks: the trainers are wb ranks ``0 .. first_rank - 1``; vLLM worker ``w`` (its rank in vLLM's
world group: TP x PP x DP) is wb rank ``first_rank + w``. Every process reaches the same store
(``store="dir:/shared/path"`` for a directory every process sees, ``"tcp://host:port"`` for a
``torch.distributed.TCPStore`` someone hosts).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

import wb
import wb_torch
from wb.data.dtypes import dtype_info
from wb_vllm import BACKEND
from wb_vllm.trainer import Trainer, TrainerSetup, open_store

__all__ = ["WeightBridgeEngine", "WeightBridgeInitInfo", "WeightBridgeTrainer",
           "WeightBridgeTrainerInitInfo", "WeightBridgeUpdateInfo", "open_store",
           "held_tensors", "reload_load_weights"]

log = logging.getLogger(__name__)


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
    post_process: bool = True  # probe through vLLM's layerwise reload (reload_load_weights):
    #   the maps describe the weights after process_weights_after_loading, which GPU MoE
    #   backends rearrange (FlashInfer-CUTLASS swaps gate/up, TRTLLM pads). False: the
    #   model's load_weights alone, right only where that processing moves no element


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
    rederive: tuple = ()  # attention layers post-processed again after each update

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
        served = _state(model)  # what the probe overwrites; put back afterwards
        held, self.rederive = held_tensors(model)
        load = (reload_load_weights(model, self.model_config, spec) if init_info.post_process
                else model.load_weights)
        saved = {n: t.detach().to("cpu", copy=True) for n, t in served.items()}
        ptrs = {n: t.data_ptr() for n, t in served.items()}
        try:  # the probe runs the model's own load_weights on id-encoded tensors
            maps = wb_torch.probe(held, spec, load, cache=cache,
                                  key={"backend": BACKEND, "worker": group.rank,
                                       "world": group.world_size,
                                       "post_process": init_info.post_process})
        finally:
            now = _state(model)
            with torch.no_grad():
                for n, t in now.items():
                    if n in saved:
                        t.copy_(saved[n])
        moved = [n for n, t in now.items() if t is not served.get(n) or t.data_ptr() != ptrs[n]]
        if moved:  # wb writes into the served storage, which CUDA graphs captured
            raise wb.ProbeError(f"probing moved {len(moved)} of the model's tensors to new "
                                f"objects or storage (first `{moved[0]}`); they must stay where "
                                f"vLLM serves them from (set post_process=False to probe with "
                                f"load_weights alone)")
        local = self.device.index if self.device.type == "cuda" else group.local_rank
        (self.layout,) = wb_torch.layouts(held, maps, rank, node=init_info.node
                                          or socket.gethostname(), role="rollout",
                                          local_rank=local or 0)
        store = open_store(init_info.store)
        plan = wb.agree_parts(store, [self.layout], world=init_info.world,
                              name=f"{init_info.name}/plan", timeout=init_info.timeout)
        cuda = self.device.index if self.device.type == "cuda" else None
        self.receiver = wb_torch.Receiver(
            held, plan, rank, transports=wb.UcxTransport(rank, store, cuda_device=cuda),
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
        with torch.no_grad():  # as finalize_layerwise_reload ends: from the new weights
            for layer in self.rederive:
                layer.process_weights_after_loading(self.model_config.dtype)
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


def held_tensors(model: torch.nn.Module
                 ) -> tuple[dict[str, torch.Tensor], tuple[torch.nn.Module, ...]]:
    """The model's tensors wb writes, and the attention layers whose own post-processing
    derives the rest from them.

    wb writes a tensor's own storage as one dense block. vLLM's MLA attention derives
    ``W_UV`` and ``W_UK_T`` from ``kv_b_proj`` in ``process_weights_after_loading``, as
    transposed views: wb cannot hold them, but the attention layer makes them again from the
    new ``kv_b_proj`` in place (as ``finalize_layerwise_reload`` does after every reload).

    Args:
        model: a vLLM model, loaded and post-processed.

    Returns:
        ``(held, layers)``: ``{name: tensor}`` of the parameters and persistent buffers but
        the non-contiguous ones, and the attention layers holding those (post-process them
        after each update).

    Raises:
        wb.ProbeError: a non-contiguous tensor outside an attention layer (nothing remakes it).
    """
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    held, layers = {}, {}
    for name, t in _state(model).items():
        if t.is_contiguous():
            held[name] = t
            continue
        owner = name.rpartition(".")[0]
        layer = model.get_submodule(owner)
        if not is_deferred_attention_layer(layer):
            raise wb.ProbeError(f"`{name}` is not contiguous (shape {tuple(t.shape)}, strides "
                                f"{t.stride()}): wb writes a tensor's storage as one dense "
                                f"block, and no attention post-processing remakes it")
        layers[owner] = layer
    if layers:
        log.info("%d attention layers derive tensors wb does not hold (e.g. `%s`): they are "
                 "post-processed again after each update", len(layers), next(iter(layers)))
    return held, tuple(layers.values())


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters, then the persistent buffers, each tensor once (wb_torch's view of a
    module: what ``state_dict()`` holds, without running its hooks)."""
    named = dict(model.named_parameters())
    for name, b in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        mod = model.get_submodule(owner) if owner else model
        if leaf not in mod._non_persistent_buffers_set and name not in named:
            named[name] = b
    return named


def reload_load_weights(model: torch.nn.Module, model_config: Any, spec: wb.CheckpointSpec
                        ) -> Callable[[Iterable[tuple[str, torch.Tensor]]], None]:
    """``model.load_weights`` through vLLM's layerwise reload, as :func:`wb_torch.probe`'s
    ``load_weights``: the weights land as vLLM serves them, after each layer's
    ``process_weights_after_loading``, in the served tensors' own storage.

    Each call runs ``initialize_layerwise_reload(model)`` (every layer back to its
    checkpoint-format tensors, on the meta device), ``model.load_weights(weights)`` (a layer is
    materialised, loaded and post-processed once all its weights came, then copied into the
    served tensors) and ``finalize_layerwise_reload(model, model_config)`` (the layers still
    waiting, attention last): what vLLM's ``nccl`` and ``ipc`` backends do around an update.

    Two things keep the probe's 0 meaning "never written" (a value the probe reads as an id
    where the checkpoint put none would be a wrong map, not an error):

    - memory vLLM allocates meanwhile reads as zero: it materialises a layer with
      ``torch.empty_strided``, so an element the loader never writes (padding) would otherwise
      hold whatever the allocator left there;
    - the elements post-processing writes whatever the checkpoint holds (attention's
      ``_k_scale`` and friends are set to 1.0, the value of id 0 in every pass) are found once,
      by a reload of an all-zero checkpoint before the first call, and zeroed after every call:
      they are left out of the maps (logged).

    Args:
        model: a model vLLM built (``initialize_model`` records the checkpoint-format metadata
            the reload restores), already loaded and post-processed.
        model_config: the model's ``vllm.config.ModelConfig`` (attention post-processing reads
            its dtype).
        spec: the checkpoint the calls feed (the all-zero one is made from it).

    Returns:
        A function of an iterable of ``(checkpoint name, full tensor)``; it overwrites every
        parameter and persistent buffer the reload reaches.

    Raises:
        wb.ProbeError: ``model`` has no reload metadata (it was not built by vLLM's
            ``initialize_model``).
    """
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    if model not in LAYERWISE_INFO:  # else the reload would leave every layer without tensors
        raise wb.ProbeError(f"{type(model).__name__} has no layerwise-reload metadata: build it "
                            f"with vLLM's initialize_model, or call vLLM's "
                            f"record_metadata_for_reloading(model) before loading it, or set "
                            f"WeightBridgeInitInfo.post_process=False")
    device = next(model.parameters()).device
    constants: dict[str, torch.Tensor] | None = None  # {state entry: (shape) bool, True where
    #                                                    post-processing writes a constant}

    def reload(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        with _ZeroEmpty():
            initialize_layerwise_reload(model)
            try:
                model.load_weights(weights)
            finally:  # the served tensors go back into the layers even if loading failed
                finalize_layerwise_reload(model, model_config)

    def load(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        nonlocal constants
        if constants is None:  # the probe zeroed the model before this first call
            reload((n, wb_torch.from_numpy(np.zeros(spec.shape(n), dtype_info(spec.dtype(n))
                                                    .numpy), device)) for n in spec.names)
            constants = {n: m for n, t in _state(model).items() if (m := _bits(t) != 0).any()}
            if constants:
                log.info("post-processing writes %d elements of %d tensors whatever the "
                         "checkpoint holds (e.g. `%s`): left out of the maps",
                         sum(int(m.sum()) for m in constants.values()), len(constants),
                         next(iter(constants)))
        reload(weights)
        state = _state(model)
        with torch.no_grad():
            for n, mask in constants.items():
                _bits(state[n]).masked_fill_(mask, 0)
    return load


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as same-size integers (a view): 0 exactly where all bits are 0."""
    return t.detach().view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                            8: torch.int64}[t.element_size()])


class _ZeroEmpty(TorchFunctionMode):
    """``torch.empty``, ``empty_like`` and ``empty_strided`` return zeros inside."""

    _EMPTY = frozenset({torch.empty, torch.empty_like, torch.empty_strided})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self._EMPTY and not out.is_meta:
            with torch.no_grad():
                out.zero_()
        return out


@dataclass
class WeightBridgeTrainerInitInfo(TrainerSetup, TrainerInitInfo):
    """:class:`wb_vllm.trainer.TrainerSetup` as vLLM's trainer init info."""

    backend: ClassVar[str] = BACKEND


class WeightBridgeTrainer(Trainer, TrainerWeightTransferEngine[WeightBridgeTrainerInitInfo]):
    """:class:`wb_vllm.trainer.Trainer` as vLLM's ``TrainerWeightTransferEngine``."""

    init_info_cls = WeightBridgeTrainerInitInfo
