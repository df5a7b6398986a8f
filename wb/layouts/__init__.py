"""The catalogue of real framework layouts: which GPU holds or needs which checkpoint elements.

Where things are:

- :mod:`wb.layouts.presets`: model configs (:func:`load_config`, the JSON files in
  :data:`MODELS_DIR`, the tiny test model :data:`TINY`) and their checkpoint specs
  (:func:`spec_from_config`).
- :mod:`wb.layouts.dims`: :class:`ModelDims`, the config numbers read once (the only place that
  reads them), with the padded-vocabulary rule.
- :mod:`wb.layouts.blocks`: affine block helpers (tensor slices as source-map blocks).
- :mod:`wb.layouts.shards`: what the generators share (per-shard entries, argument checks).
- One module per framework, each a layout generator (model config + parallelism -> one
  :class:`~wb.data.layout.Layout` per GPU): :mod:`wb.layouts.megatron`
  (:func:`megatron_trainer`), :mod:`wb.layouts.fsdp` (:func:`fsdp_trainer`),
  :mod:`wb.layouts.jax_mesh` (:func:`jax_trainer`), :mod:`wb.layouts.vllm` (:func:`vllm_rollout`).
- :mod:`wb.layouts.deployments`: the paper-scale :class:`Deployment` presets
  (:data:`DEPLOYMENTS`, :func:`deployment`), Megatron trainers and vLLM rollouts.

Examples:
    >>> from wb.layouts import deployment
    >>> dep = deployment("tiny")
    >>> len(dep.trainers), len(dep.rollouts)
    (4, 4)
"""

from wb.layouts.deployments import DEPLOYMENTS, Deployment, deployment
from wb.layouts.dims import ModelDims
from wb.layouts.fsdp import fsdp_trainer
from wb.layouts.jax_mesh import jax_trainer
from wb.layouts.megatron import megatron_trainer
from wb.layouts.presets import MODELS_DIR, TINY, load_config, spec_from_config
from wb.layouts.vllm import VOCAB_PADDING, vllm_rollout

__all__ = ["ModelDims", "megatron_trainer", "fsdp_trainer", "jax_trainer", "vllm_rollout",
           "Deployment", "DEPLOYMENTS", "deployment", "load_config", "spec_from_config", "TINY",
           "MODELS_DIR", "VOCAB_PADDING"]
