"""What workers publish in the rendezvous store and read back: layouts and parts of a plan.

One key per rank under a session's name (``{name}/layout/{rank}``, ``{name}/part/{rank}``),
chunked where the store limits its values; nothing is pickled. The coordinator's set-up
(:func:`wb.agree_parts`) and the finishing of versions (:mod:`wb.runtime.membership.finish`) both use them.
"""

from __future__ import annotations

import time

from wb.data.layout import layouts_from_bytes, layouts_to_bytes
from wb.data.plan import Plan, RankPlan, parts
from wb.errors import TransferError
from wb.runtime.transport.stores import get_large, set_large

__all__ = ["publish_layouts", "gather_layouts", "publish_parts", "fetch_part"]


def publish_layouts(store, layouts, *, world: int, name: str = "wb") -> int:
    """Puts each of this process's workers' layouts in ``store`` (one key per rank).

    Args:
        store: the rendezvous store every process shares.
        layouts: this process's workers' layouts.
        world: the number of workers of the plan.
        name: keeps the keys of concurrent sessions apart.

    Returns:
        The bytes put in the store.

    Raises:
        TransferError: a rank outside ``0 .. world - 1``.
    """
    layouts = list(layouts)
    for lay in layouts:
        if not 0 <= lay.worker.rank < world:
            raise TransferError(f"rank {lay.worker.rank} is outside 0..{world - 1} (world={world})")
    return sum(set_large(store, f"{name}/layout/{lay.worker.rank}", layouts_to_bytes([lay]))
               for lay in layouts)


def gather_layouts(store, *, world: int, name: str = "wb", timeout: float = 600.0) -> list:
    """Every rank's layout from ``store`` (rank order), waiting up to ``timeout`` seconds in all.

    Raises:
        TransferError: a rank did not publish its layout in time.
        SpecError: a key's layout changed since it was written (names the key).
    """
    deadline = time.monotonic() + timeout
    keys = [f"{name}/layout/{r}" for r in range(world)]
    return [layouts_from_bytes(get_large(store, k, max(deadline - time.monotonic(), 0.001)),
                               where=f"store key `{k}`")[0] for k in keys]


def publish_parts(store, plan: Plan, *, name: str = "wb") -> int:
    """Puts every rank's part of ``plan`` in ``store`` under its own key (chunked where the store
    needs it): each rank then reads only its own.

    Returns:
        The bytes put in the store.
    """
    return sum(set_large(store, f"{name}/part/{part.rank}", part.to_bytes())
               for part in parts(plan))


def fetch_part(store, rank: int, *, name: str = "wb", timeout: float = 600.0) -> RankPlan:
    """Rank ``rank``'s part of the plan, from ``store`` (waiting up to ``timeout`` seconds).

    Raises:
        TransferError: no part for ``rank`` was published in time.
        PlanError: the part under the key changed since it was written (corrupt, cut short) or
            is of another format; names the key.
    """
    key = f"{name}/part/{rank}"
    return RankPlan.from_bytes(get_large(store, key, timeout), where=f"store key `{key}`")
