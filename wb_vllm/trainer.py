"""The trainers' end of the ``weightbridge`` vLLM backend, without importing vLLM (a JAX trainer's
venv need not have it): :class:`Trainer` pushes with a ``wb_torch.Sender`` / ``wb_jax.Sender``
and drives vLLM's four control calls through any client with those methods (vLLM's
``VLLMWeightSyncClient``: HTTP routes, Ray, ...). :class:`wb_vllm.engine.WeightBridgeTrainer` is
the same class as vLLM's ``TrainerWeightTransferEngine``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import wb

__all__ = ["Trainer", "TrainerSetup", "open_store"]


def open_store(url: str) -> wb.Store:
    """The store at ``url``: ``"dir:/path"`` (:class:`wb.DirectoryStore`) or
    ``"tcp://host:port"`` (a client of a ``torch.distributed.TCPStore`` hosted there)."""
    if url.startswith("dir:"):
        return wb.DirectoryStore(url[4:])
    if url.startswith("tcp://"):
        host, port = url[6:].rsplit(":", 1)
        from torch.distributed import TCPStore

        return wb.TorchStore(TCPStore(host, int(port), is_master=False))
    raise wb.SpecError(f"store {url!r}: give 'dir:/a/path/every/process/sees' or "
                       f"'tcp://host:port' of a TCPStore")


@dataclass
class TrainerSetup:
    """A trainer rank's set-up: its layouts, how to make its Sender from its part of the plan,
    and the init info the vLLM workers get (``rollouts``: fields of
    :class:`wb_vllm.engine.WeightBridgeInitInfo`, sent by rank 0)."""

    store: str  # "dir:/path" or "tcp://host:port" (open_store)
    world: int  # wb ranks in all: trainers + vLLM workers
    layouts: Sequence[wb.Layout]  # this process's trainer layouts (wb_torch / wb_jax.layouts)
    make_sender: Callable[[Any], Any]  # plan part -> wb_torch.Sender / wb_jax.Sender
    rollouts: dict = field(default_factory=dict)  # WeightBridgeInitInfo fields for the workers
    name: str = "wb"  # keeps the store keys of concurrent jobs apart
    timeout: float = 120.0  # seconds to wait for peers at set-up
    rank: int = field(default=0, kw_only=True)  # this trainer process's rank (0 drives vLLM)

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


class Trainer:
    """The trainers' end: every trainer rank pushes its shards; rank 0 also drives vLLM's
    control calls, concurrently with the push (a worker's ``update_weights`` returns once it
    holds the version)."""

    def __init__(self, *, client, source=None, is_sender: bool = True, rank: int = 0):
        self.client, self.source, self.is_sender, self.rank = client, source, is_sender, rank
        self.sender: Any = None

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        """Rank 0 asks the vLLM workers to set up (they probe and publish their layouts) while
        every rank publishes its own and gets its part of the plan; returns a ready instance."""
        self = cls(client=client, source=source, is_sender=init_info.is_sender,
                   rank=init_info.rank)
        rpc = None
        if self.is_sender:
            info = dict(init_info.rollouts, store=init_info.store, world=init_info.world,
                        name=init_info.name)
            rpc = _Call(client.init_weight_transfer_engine, info)
        store = open_store(init_info.store)
        plan = wb.agree_parts(store, list(init_info.layouts), world=init_info.world,
                              name=f"{init_info.name}/plan", timeout=init_info.timeout)
        self.sender = init_info.make_sender(plan)
        if rpc is not None:
            rpc.result()
        return self

    def send_weights(self, params: Any = None) -> int:
        """Pushes the trainer's weights as the next version (``params``: new ones, for JAX) and,
        on rank 0, runs vLLM's update round trip; returns the version."""
        rpc = None
        if self.is_sender:
            rpc = _Call(self._round_trip, self.sender.version + 1)
        v = self.sender.push(params) if params is not None else self.sender.push()
        if rpc is not None:
            rpc.result()
        return v

    def _round_trip(self, version: int) -> None:
        self.client.start_weight_update()
        self.client.update_weights({"version": version})
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.sender.close()


class _Call:
    """``fn(*args)`` in a thread; ``result()`` joins it and re-raises its error."""

    def __init__(self, fn, *args):
        self.error: BaseException | None = None

        def run():
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - re-raised by result()
                self.error = e
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def result(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error
