"""A rollout's side of joining a running job (:mod:`wb.runtime.finish` has the leader's): its
layout and join request published, then admission awaited; the leader admits joiners when a
version finishes, and a process's ranks all together.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from wb.data.layout import Layout, layouts_to_bytes
from wb.data.rankplan import RankPlan
from wb.errors import TransferError
from wb.runtime.liveness import new_incarnation
from wb.runtime.records import fetch_part
from wb.runtime.rendezvous import set_large

__all__ = ["request_join", "request_joins"]


def request_join(store, layout: Layout, *, name: str = "wb", timeout: float = 600.0,
                 meanwhile: Callable[[], Any] | None = None) -> tuple[RankPlan, int, int, str]:
    """Asks the running job of ``store`` (session ``name``) to take in rollout ``layout``: a new
    replica's worker, or a restarted one. Publishes the layout and a join request, calls
    ``meanwhile()`` (set-up that should be done by admission: starting the transport), then waits
    until the trainers' leader admits it at the end of a version.

    Returns:
        ``(part, version, epoch, incarnation)``: this rank's part of the plan from then on, the
        first version it receives (whole), the membership epoch it joins, and the incarnation
        its heartbeat must carry.

    Raises:
        TransferError: not admitted within ``timeout`` seconds (is the job pushing versions?).
    """
    return request_joins(store, [layout], name=name, timeout=timeout,
                         meanwhile=meanwhile)[layout.worker.rank]


def request_joins(store, layouts, *, name: str = "wb", timeout: float = 600.0,
                  meanwhile: Callable[[], Any] | None = None
                  ) -> dict[int, tuple[RankPlan, int, int, str]]:
    """:func:`request_join` for several ranks of one process at once: the leader admits them at
    the same version end, all or none (a process's ranks must start together: one of them
    admitted a version before the others would hold that version up until they are).

    Returns:
        ``{rank: (part, version, epoch, incarnation)}``, as :func:`request_join`.
    """
    lays = {int(lay.worker.rank): lay for lay in layouts}
    token = new_incarnation()
    if len(lays) > 1:  # the leader admits none of them until it sees every one's request
        store.set(f"{name}/joingroup/{token}", json.dumps(sorted(lays)).encode())
    for rank, layout in lays.items():
        # beat as this incarnation from now on: the leader takes it for the member it admits
        store.set(f"{name}/alive/{rank}", f"{token}:0".encode())
        set_large(store, f"{name}/member/{rank}", layouts_to_bytes([layout]))
        store.set(f"{name}/joinreq/{rank}", token.encode())
    deadline = time.monotonic() + timeout
    if meanwhile is not None:
        meanwhile()
    recs = {}
    for rank in lays:
        while True:
            try:
                rec = json.loads(store.get(f"{name}/admitted/{rank}", 0.2))
                if rec["token"] == token:
                    recs[rank] = rec
                    break
            except TransferError:
                pass
            if time.monotonic() > deadline:
                raise TransferError(f"rank {rank}: not admitted to session `{name}` within "
                                    f"{timeout:.0f} s; the trainers' leader admits joiners when "
                                    f"a version finishes: is the job pushing versions?")
            time.sleep(0.05)
    return {rank: (fetch_part(store, rank, name=f"{name}/epoch/{rec['epoch']}", timeout=timeout),
                   int(rec["version"]), int(rec["epoch"]), token) for rank, rec in recs.items()}
