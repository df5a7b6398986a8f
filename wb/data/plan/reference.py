"""The reference executor: a plan run in this process with numpy (:func:`run_local`)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from wb.data.dtypes import CODES, convert, dtype_info
from wb.data.layout import Role
from wb.data.plan.plan import Plan, need_plan
from wb.errors import PlanError

__all__ = ["run_local"]


def run_local(plan: Plan, trainer_buffers: Mapping[int, Mapping[str, np.ndarray]],
              rollout_buffers: Mapping[int, Mapping[str, np.ndarray]]
              ) -> dict[int, dict[str, np.ndarray]]:
    """Executes a plan in this process with numpy: fills the rollout buffers (in place).

    Args:
        plan: the plan.
        trainer_buffers: ``{trainer rank: {buffer name: array}}`` holding the weights.
        rollout_buffers: ``{rollout rank: {buffer name: array}}`` to fill (written in place; any
            contiguous arrays of the layouts' shapes and dtypes). Where the plan converts an
            element (a rollout needs it in another dtype than the trainers hold it), it is
            converted as the executor does (:func:`wb.data.dtypes.convert`).

    Returns:
        ``rollout_buffers`` (as dicts), filled.

    Raises:
        PlanError: ``plan`` is not a plan, or a buffer is missing or has the wrong shape.
    """
    need_plan(plan, "run_local")
    for what, given in (("trainer_buffers", trainer_buffers), ("rollout_buffers", rollout_buffers)):
        if not isinstance(given, Mapping) or not all(isinstance(b, Mapping)
                                                     for b in given.values()):
            raise PlanError(f"run_local: {what} must be {{rank: {{buffer name: array}}}}, got "
                            f"{type(given).__name__}")
    bufs: dict[int, np.ndarray] = {}
    for si, s in enumerate(plan.slots):
        lays = plan.trainers if s.role == Role.TRAINER else plan.rollouts
        src = trainer_buffers if s.role == Role.TRAINER else rollout_buffers
        spec = lays[s.layout].buffers[s.buffer]
        try:
            arr = src[s.rank][s.buffer]
        except KeyError:
            raise PlanError(f"run_local needs buffer `{s.buffer}` of {s.role.value} rank "
                            f"{s.rank}") from None
        arr = np.asarray(arr)
        if arr.shape != spec.shape:
            raise PlanError(f"{s.role.value} rank {s.rank} buffer `{s.buffer}` has shape "
                            f"{arr.shape}, the layout says {spec.shape}")
        if s.role == Role.ROLLOUT and not arr.flags.c_contiguous:
            raise PlanError(f"rollout rank {s.rank} buffer `{s.buffer}` must be C-contiguous")
        bufs[si] = arr.reshape(-1)
    P, T = plan.pieces, plan.transfers
    tab, _ = plan.table
    for t in range(T.piece.size):
        p = T.piece[t]
        i = np.arange(P.na[p])[:, None]
        j = np.arange(P.nb[p])[None, :]
        src = bufs[T.src_slot[t]][T.src_f0[t] + i * T.src_fa[t] + j * T.src_fb[t]]
        dst = bufs[T.dst_slot[t]]
        # as the executor does: converted to the dtype the piece travels in, then to the need's
        # (where the layouts' dtypes differ from it)
        if tab.dtype[T.src_slot[t]] != P.dtype[p]:
            wire = np.empty(src.shape, dtype_info(CODES[P.dtype[p]]).numpy)
            convert(wire, src)
            src = wire
        if tab.dtype[T.dst_slot[t]] != P.dtype[p]:
            out = np.empty(src.shape, dst.dtype)
            convert(out, src)
            src = out
        dst[T.dst_f0[t] + i * T.dst_fa[t] + j * T.dst_fb[t]] = src
    return {int(r): dict(b) for r, b in rollout_buffers.items()}

