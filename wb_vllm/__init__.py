"""WeightBridge as a vLLM weight-transfer backend: ``WeightTransferConfig(backend="weightbridge")``.

The only module of the project that imports vLLM (tested with vLLM 0.33.0 only, on a CPU-only
machine: see ``tests_vllm/README.md``). :func:`register` adds the backend to vLLM's
``WeightTransferEngineFactory``; :mod:`wb_vllm.engine` holds the inference-side
:class:`~wb_vllm.engine.WeightBridgeEngine` and the trainer-side
:class:`~wb_vllm.engine.WeightBridgeTrainer`.

The lifecycle, next to vLLM's:

========================================  =====================================================
vLLM (trainer drives it through a client)  what WeightBridge does
========================================  =====================================================
``init_weight_transfer_engine(info)``      each worker probes its model through vLLM's
                                           layerwise reload (``load_weights``, then each layer's
                                           ``process_weights_after_loading``, copied into the
                                           served storage: the maps describe the weights vLLM
                                           serves; ``post_process=False``: ``load_weights``
                                           alone); maps from ``cache=`` when there; the weights
                                           are put back afterwards, in the same storage. It
                                           publishes its layout to the store and gets its part
                                           of the plan (the trainers publish theirs at the same
                                           time); a ``wb_torch.Receiver`` on the model's own
                                           storage
``start_weight_update()``                  nothing (weights land in place)
``update_weights({"version": v})``         ``Receiver.apply()``: version ``v`` lands in the
                                           parameters' own storage (CUDA graphs stay valid);
                                           with receiver staging, all at once. Attention layers
                                           that derive tensors wb cannot hold (MLA's transposed
                                           ``W_UV``, ``W_UK_T``) are post-processed again
``finish_weight_update()``                 nothing
``shutdown()``                             closes the Receiver
========================================  =====================================================

What was tested (vLLM 0.33.0, CPU): dense Qwen3 with vLLM's real post-processing; Qwen3-MoE and
DeepSeek-V3 with vLLM's real post-processing except the experts', which the CPU build cannot run
(``_C.prepack_moe_weight``): there the tests patch the unquantized MoE method's
``process_weights_after_loading`` to do what FlashInfer-CUTLASS does on a GPU (swap ``w13``'s gate
and up halves). No GPU backend (FlashInfer, TRTLLM padding, AITER) has run against it.
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
