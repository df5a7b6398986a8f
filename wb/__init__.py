"""WeightBridge: move model weights from RL trainers to rollout workers at the network's lower
bound.

The layers, from the bottom: :mod:`wb.errors`; :mod:`wb.data` (specs, source maps, layouts, the
correspondence, plans); :mod:`wb.algorithms` (probe, planner, simulator, FP8 quantising tasks);
:mod:`wb.runtime` (transports and stores, the engine, membership, the endpoints users hold);
beside it :mod:`wb.layouts` (real framework layouts and presets) and :mod:`wb.testing` (strategies
and oracles for users' own tests); on top :mod:`wb.cli` (``python -m wb``).

The names below are what a user calls, grouped by the layer they live in; everything else stays
importable from its module (``wb.runtime.engine.executor.execute``, ``wb.data.plan.parts``...).
"""

from wb.errors import (AuthError, ChecksumError, PeersLost, PlanError, ProbeError, SpecError,
                       TransferError, WbError)

from wb.data.fp8 import FP8Blocks
from wb.data.layout import BufferSpec, Cluster, Layout, Worker
from wb.data.plan import Plan, RankPlan, Traffic, run_local
from wb.data.sourcemap import SourceMap
from wb.data.spec import CheckpointSpec

from wb.algorithms.planner import lower_bound, plan
from wb.algorithms.probing import probe
from wb.algorithms.simulate import simulate

from wb.runtime.transport import Request, Transport
from wb.runtime.transport.stores import (DirectoryStore, JaxStore, MemoryStore, RayStore, Store,
                                         TorchStore)
from wb.runtime.transport.keyed import KeyedStore
from wb.runtime.transport.ucx import UcxTransport
from wb.runtime.membership.agree import agree_parts
from wb.runtime.endpoints.group import ParamsAdapter, ReceiverGroup, SenderGroup
from wb.runtime.endpoints.modes import MODES
from wb.runtime.endpoints.receiver import Receiver
from wb.runtime.endpoints.sender import Sender
from wb.runtime.endpoints.session import LocalSession
from wb.runtime.endpoints.stats import summarize

__all__ = [
    # data: what a checkpoint, a map, a layout and a plan are
    "CheckpointSpec", "SourceMap", "Worker", "BufferSpec", "Layout", "Cluster", "Plan",
    "RankPlan", "Traffic", "FP8Blocks",
    # algorithms: functions over them
    "probe", "plan", "lower_bound", "simulate", "run_local",
    # runtime, transport: moving bytes, meeting through a store
    "Transport", "Request", "UcxTransport", "Store", "MemoryStore", "DirectoryStore",
    "TorchStore", "JaxStore", "RayStore", "KeyedStore",
    # runtime, membership and endpoints: set-up, then versions
    "agree_parts", "Sender", "Receiver", "SenderGroup", "ReceiverGroup", "ParamsAdapter",
    "LocalSession", "MODES", "summarize",
    # errors
    "WbError", "SpecError", "ProbeError", "PlanError", "TransferError", "PeersLost",
    "ChecksumError", "AuthError",
]
