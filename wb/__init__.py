"""WeightBridge: move model weights from RL trainers to rollout workers at the network's lower bound."""

from wb import dtypes
from wb.correspond import Correspondence, Overlaps, correspond
from wb.errors import PlanError, ProbeError, SpecError, TransferError, WbError
from wb.layout import BufferSpec, Layout, Role, Worker
from wb.probe import probe
from wb.sourcemap import Blocks, SourceMap
from wb.spec import CheckpointSpec

__all__ = [
    "CheckpointSpec", "SourceMap", "Blocks", "probe",
    "Worker", "BufferSpec", "Layout", "Role",
    "correspond", "Correspondence", "Overlaps",
    "WbError", "SpecError", "ProbeError", "PlanError", "TransferError",
    "dtypes",
]
