"""Four paper-scale deployments (and a tiny one): Megatron-core trainers and vLLM rollouts on
separate nodes, built from the layout generators of :mod:`wb.layouts.megatron` and
:mod:`wb.layouts.vllm`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from wb.data.layout import Layout
from wb.data.spec import CheckpointSpec
from wb.errors import SpecError
from wb.layouts.dims import ModelDims
from wb.layouts.megatron import VOCAB_MULTIPLE, megatron_trainer, pipeline_stages
from wb.layouts.presets import TINY, load_config, spec_from_config
from wb.layouts.vllm import VOCAB_PADDING, vllm_rollout

__all__ = ["Deployment", "DEPLOYMENTS", "deployment"]


@dataclass(frozen=True, slots=True)
class Deployment:
    """A model on trainer nodes and rollout nodes: every GPU's layout and a description.

    Attributes:
        name: the deployment's name (see :data:`DEPLOYMENTS`).
        spec: the checkpoint spec (HF names) every source map refers to.
        trainers: one trainer Layout per trainer GPU (buffers hold ids), in rank order.
        rollouts: one rollout Layout per rollout GPU (buffers need ids), in rank order, replica
            after replica (``description["rollout"]["gpus_per_replica"]`` GPUs each).
        description: JSON-able: model, node and GPU counts, trainer and rollout parallelism.
    """

    name: str
    spec: CheckpointSpec = field(repr=False)
    trainers: list[Layout] = field(repr=False)
    rollouts: list[Layout] = field(repr=False)
    description: dict = field(repr=False)

    @property
    def replicas(self) -> list[list[Layout]]:
        """The rollout Layouts grouped by replica."""
        g = int(self.description["rollout"]["gpus_per_replica"])
        return [self.rollouts[k:k + g] for k in range(0, len(self.rollouts), g)]

    def __repr__(self) -> str:
        return (f"Deployment({self.name!r}, {self.spec!r}, {len(self.trainers)} trainer GPUs, "
                f"{len(self.rollouts)} rollout GPUs)")


@dataclass(frozen=True, slots=True)
class _Preset:
    """One deployment's numbers: Megatron trainer and vLLM rollout, separate nodes."""

    model: str  # config name, or "tiny" for wb.layouts.presets.TINY
    gpus_per_node: int
    trainer_nodes: int
    tp: int
    pp: int
    ep: int
    etp: int
    r_tp: int
    r_ep: int
    replicas: int
    nodes_per_replica: int
    gpus_per_replica: int


_PRESETS: dict[str, _Preset] = {
    # 16B: 1 trainer node (TP2, dense DP4, EP8) + 1 rollout node of 4 engines of 2 GPUs.
    "moonlight-16b-a3b": _Preset("moonlight-16b-a3b", 8, 1, tp=2, pp=1, ep=8, etp=1, r_tp=2, r_ep=2,
                               replicas=4, nodes_per_replica=1, gpus_per_replica=2),
    # 235B: 4 trainer nodes (TP4 PP4 EP8, DP2) + 4 one-node engines (TP8 EP8).
    "qwen3-235b-a22b": _Preset("qwen3-235b-a22b", 8, 4, tp=4, pp=4, ep=8, etp=1, r_tp=8, r_ep=8,
                             replicas=4, nodes_per_replica=1, gpus_per_replica=8),
    # 671B: 16 trainer nodes (TP2 PP8 EP16, DP8) + 8 two-node engines (TP8 attention x DP2, EP16).
    "deepseek-v3": _Preset("deepseek-v3", 8, 16, tp=2, pp=8, ep=16, etp=1, r_tp=8, r_ep=16,
                         replicas=8, nodes_per_replica=2, gpus_per_replica=16),
    # 1T: 32 trainer nodes (TP4 PP8 EP32, DP8) + 8 four-node engines (TP8 attention x DP4, EP32).
    "kimi-k2": _Preset("kimi-k2", 8, 32, tp=4, pp=8, ep=32, etp=1, r_tp=8, r_ep=32, replicas=8,
                     nodes_per_replica=4, gpus_per_replica=32),
    # wb.layouts.presets.TINY: 1 trainer node of 4 GPUs (TP2, DP2, EP2) + 1 rollout node, 2
    # engines of 2.
    "tiny": _Preset("tiny", 4, 1, tp=2, pp=1, ep=2, etp=1, r_tp=2, r_ep=2, replicas=2,
                  nodes_per_replica=1, gpus_per_replica=2),
}

#: Names :func:`deployment` accepts.
DEPLOYMENTS: tuple[str, ...] = tuple(_PRESETS)


def deployment(name: str, *, replicas: int | None = None,
               models_dir: Path | str | None = None) -> Deployment:
    """Builds one of the :data:`DEPLOYMENTS`: Megatron-core trainers and vLLM rollouts.

    Trainer and rollout GPUs are on separate nodes (``trainer{i}``, ``rollout{i}``); trainer
    ranks come first, rollout ranks follow, all consecutive. Builds from block descriptions
    only: ``"kimi-k2"`` (1T parameters, 512 GPUs) takes a few seconds.

    Args:
        name: one of :data:`DEPLOYMENTS`.
        replicas: rollout engines (default: the deployment's own count), to scale the rollout
            side alone.
        models_dir: where the model JSON files are (default ``wb.layouts.presets.MODELS_DIR``).

    Returns:
        The :class:`Deployment`.

    Raises:
        SpecError: unknown ``name``, ``replicas`` below 1, or the model config is not found.

    Examples:
        >>> dep = deployment("tiny")
        >>> len(dep.trainers), len(dep.rollouts), dep.description["trainer"]["dp"]
        (4, 4, 2)
    """
    plan = _PRESETS.get(name)
    if plan is None:
        raise SpecError(f"unknown deployment {name!r}; choose one of {list(DEPLOYMENTS)}")
    if replicas is None:
        replicas = plan.replicas
    elif not isinstance(replicas, int) or replicas < 1:
        raise SpecError(f"deployment: `replicas` must be an integer >= 1, got {replicas!r}")
    cfg = dict(TINY) if plan.model == "tiny" else load_config(plan.model, models_dir)
    gpn = plan.gpus_per_node
    trainer_nodes = [f"trainer{i}" for i in range(plan.trainer_nodes)]
    trainers = megatron_trainer(cfg, tp=plan.tp, pp=plan.pp, ep=plan.ep, etp=plan.etp,
                                nodes=trainer_nodes, gpus_per_node=gpn, first_rank=0)
    rollouts = vllm_rollout(cfg, tp=plan.r_tp, ep=plan.r_ep, replicas=replicas,
                            nodes_per_replica=plan.nodes_per_replica,
                            gpus_per_replica=plan.gpus_per_replica, gpus_per_node=gpn,
                            first_rank=len(trainers))
    spec = spec_from_config(cfg)
    d = ModelDims.of(cfg)
    world = len(trainers)
    rollout_nodes = -(-len(rollouts) // gpn)
    description = {
        "name": name,
        "model": cfg.get("name", plan.model),
        "architecture": d.arch,
        "params": spec.numel,
        "bytes": spec.nbytes,
        "dtype": d.dtype,
        "nodes": plan.trainer_nodes + rollout_nodes,
        "gpus_per_node": gpn,
        "trainer": {
            "framework": "megatron-core", "nodes": plan.trainer_nodes, "gpus": world,
            "tp": plan.tp, "pp": plan.pp, "ep": plan.ep, "etp": plan.etp,
            "dp": world // (plan.tp * plan.pp),
            "edp": world // (plan.pp * plan.etp * plan.ep),
            "layers_per_stage": [len(r) for r in pipeline_stages(d.layers, plan.pp)],
            "padded_vocab": d.padded_vocab(VOCAB_MULTIPLE * plan.tp),
        },
        "rollout": {
            "framework": "vllm", "nodes": rollout_nodes, "gpus": len(rollouts),
            "tp": plan.r_tp, "ep": plan.r_ep, "replicas": replicas,
            "nodes_per_replica": plan.gpus_per_replica / gpn if plan.gpus_per_replica < gpn
            else plan.gpus_per_replica // gpn,
            "gpus_per_replica": plan.gpus_per_replica,
            "attention_dp": plan.gpus_per_replica // plan.r_tp,
            "padded_vocab": d.padded_vocab(VOCAB_PADDING),
        },
    }
    return Deployment(name, spec, trainers, rollouts, description)
