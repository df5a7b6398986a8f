"""WeightBridge: move model weights from RL trainers to rollout workers at the network's lower bound."""

from wb.errors import PlanError, ProbeError, SpecError, TransferError, WbError
from wb.probe import probe
from wb.sourcemap import Blocks, SourceMap
from wb.spec import CheckpointSpec

__all__ = ["CheckpointSpec", "SourceMap", "Blocks", "probe",
           "WbError", "SpecError", "ProbeError", "PlanError", "TransferError"]
