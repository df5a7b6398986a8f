"""WeightBridge as a vLLM weight-transfer backend: ``WeightTransferConfig(backend="weightbridge")``.

The only module of the project that imports vLLM (tested with vLLM 0.33.0). :func:`register`
adds the backend to vLLM's ``WeightTransferEngineFactory``; :mod:`wb_vllm.engine` holds the
inference-side :class:`~wb_vllm.engine.WeightBridgeEngine` and the trainer-side
:class:`~wb_vllm.engine.WeightBridgeTrainer`.

The lifecycle, next to vLLM's:

========================================  =====================================================
vLLM (trainer drives it through a client)  what WeightBridge does
========================================  =====================================================
``init_weight_transfer_engine(info)``      each worker probes its model with the model's own
                                           ``load_weights`` (maps from ``cache=`` when there;
                                           the weights are put back afterwards), publishes its
                                           layout to the store and gets its part of the plan
                                           (the trainers publish theirs at the same time); a
                                           ``wb_torch.Receiver`` on the model's own storage
``start_weight_update()``                  nothing (weights land in place)
``update_weights({"version": v})``         ``Receiver.apply()``: version ``v`` lands in the
                                           parameters' own storage (CUDA graphs stay valid);
                                           with receiver staging, all at once
``finish_weight_update()``                 nothing
``shutdown()``                             closes the Receiver
========================================  =====================================================
"""

from __future__ import annotations

__all__ = ["BACKEND", "register"]

#: The backend name vLLM selects it by.
BACKEND = "weightbridge"


def register() -> None:
    """Registers the backend with vLLM (lazily: vLLM imports :mod:`wb_vllm.engine` when a
    ``WeightTransferConfig(backend="weightbridge")`` engine is created); idempotent."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "wb_vllm.engine",
                                                    "WeightBridgeEngine")
