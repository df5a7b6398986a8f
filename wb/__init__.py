"""WeightBridge: move model weights from RL trainers to rollout workers at the network's lower bound.

The layers, from the bottom: :mod:`wb.errors`; :mod:`wb.data` (specs, source maps, layouts, the
correspondence, plans); :mod:`wb.algorithms` (probe, planner, simulator); :mod:`wb.runtime`
(transports, stores, executor, Sender/Receiver); beside it :mod:`wb.layouts` (real framework
layouts and presets) and :mod:`wb.testing` (strategies and oracles for users' own tests); on top
:mod:`wb.cli` (``python -m wb``). Everything a user needs is re-exported here.
"""

from wb.algorithms.blockplan import Quantized, quantize_layouts
from wb.algorithms.planner import lower_bound, plan
from wb.algorithms.probe import probe
from wb.algorithms.simulate import Simulation, simulate
from wb.data import dtypes
from wb.data.blockscale import BlockScaled, FP8Blocks
from wb.data.correspondence import Correspondence, Overlaps, correspond
from wb.data.layout import BufferSpec, Cluster, Layout, Role, Worker
from wb.data.plan import Plan, Traffic, run_local
from wb.data.rankplan import RankPlan, RankPlans
from wb.data.sourcemap import Blocks, SourceMap
from wb.data.spec import CheckpointSpec
from wb.errors import PlanError, ProbeError, SpecError, TransferError, WbError
from wb.runtime.buffers import aligned_empty
from wb.runtime.coordinator import MODES, SyncMode, agree_parts, agree_plan
from wb.runtime.executor import connect, execute
from wb.runtime.group import ArrayParams, ParamsAdapter, ReceiverGroup, SenderGroup
from wb.runtime.program import Program
from wb.runtime.receiver import Receiver
from wb.runtime.sender import Sender
from wb.runtime.stats import Summary, UpdateStats, summarize
from wb.runtime.update import ExecStats, TraceEntry
from wb.runtime.rendezvous import DirectoryStore, JaxStore, MemoryStore, Store, TorchStore
from wb.runtime.session import LocalSession
from wb.runtime.transport import Transport
from wb.runtime.transport.local import LocalHub, LocalTransport
from wb.runtime.transport.ucx import UcxTransport

__all__ = [
    # data
    "CheckpointSpec", "SourceMap", "Blocks", "Worker", "BufferSpec", "Layout", "Role", "Cluster",
    "Plan", "Traffic", "RankPlan", "RankPlans", "Correspondence", "Overlaps", "dtypes",
    "FP8Blocks", "BlockScaled",
    # algorithms
    "probe", "correspond", "plan", "lower_bound", "run_local", "simulate", "Simulation",
    "quantize_layouts", "Quantized",
    # runtime
    "Sender", "Receiver", "SenderGroup", "ReceiverGroup", "ParamsAdapter", "ArrayParams", "MODES", "SyncMode", "LocalSession",
    "agree_plan", "agree_parts", "UpdateStats", "Summary", "summarize", "aligned_empty",
    "execute", "connect", "Program", "ExecStats", "TraceEntry",
    "Store", "MemoryStore", "DirectoryStore", "TorchStore", "JaxStore",
    "Transport", "UcxTransport", "LocalTransport", "LocalHub",
    # errors
    "WbError", "SpecError", "ProbeError", "PlanError", "TransferError",
]
