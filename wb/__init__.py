"""WeightBridge: move model weights from RL trainers to rollout workers at the network's lower bound."""

from wb import dtypes
from wb.coordinator import MODES, Receiver, Sender, Summary, UpdateStats, agree_plan, summarize
from wb.correspond import Correspondence, Overlaps, correspond
from wb.errors import PlanError, ProbeError, SpecError, TransferError, WbError
from wb.layout import BufferSpec, Cluster, Layout, Role, Worker
from wb.plan import Plan, Traffic, run_local
from wb.planner import lower_bound, plan
from wb.probe import probe
from wb.session import LocalSession
from wb.simulate import Simulation, simulate
from wb.sourcemap import Blocks, SourceMap
from wb.spec import CheckpointSpec

__all__ = [
    "CheckpointSpec", "SourceMap", "Blocks", "probe",
    "Worker", "BufferSpec", "Layout", "Role", "Cluster",
    "plan", "Plan", "Traffic", "lower_bound", "run_local", "simulate", "Simulation",
    "Sender", "Receiver", "LocalSession", "UpdateStats", "Summary", "summarize", "MODES",
    "agree_plan",
    "correspond", "Correspondence", "Overlaps",
    "WbError", "SpecError", "ProbeError", "PlanError", "TransferError",
    "dtypes",
]
