"""Repairs planned ahead (``wb.runtime.membership.repairs``), the leader's side alone: for the
rollouts it suspects, a repair for all of them and one for each alone, each under a name of its
own, whose parts are the trainers -> rollouts-left plan; nothing planned for a suspected trainer
or a job that cannot plan, nothing planned twice, and the plans of another attempt dropped."""

from types import SimpleNamespace

import numpy as np
import pytest

import wb
from wb.errors import TransferError
from wb.runtime.membership.records import fetch_part
from wb.runtime.membership.repairs import SUSPECT_AFTER, plan_ahead
from wb.runtime.transport.stores import MemoryStore


class _Watch:
    """Silences by peer: ``silent`` names those silent longer than the grace asked for."""

    grace = 3.0

    def __init__(self, silence: dict):
        self.silence = silence

    def silent(self, peers, grace=None):
        g = self.grace if grace is None else grace
        return {p: self.silence[p] for p in peers if self.silence.get(p, 0.0) > g}


def _finisher(silence: dict, *, can_plan: bool = True):
    w = np.arange(32 * 24, dtype=np.int64).reshape(32, 24)
    f32 = lambda ids: wb.BufferSpec(wb.SourceMap.from_indices(ids), "float32")  # noqa: E731
    trainers = [wb.Layout(wb.Worker(t, "t0", "trainer", t), {"w": f32(w[:, 12 * t:12 * (t + 1)].T)})
                for t in range(2)]
    rollouts = [wb.Layout(wb.Worker(2 + n * 2 + g, f"r{n}", "rollout", g),
                          {"w": f32(w[16 * g:16 * (g + 1)])}) for n in range(3) for g in range(2)]
    plan = wb.plan(trainers, rollouts)
    store = MemoryStore()
    end = SimpleNamespace(rank=0, store=store, watch=_Watch(silence),
                          key=lambda *parts: "/".join(("job", *map(str, parts))))
    return SimpleNamespace(
        can_plan=can_plan, end=end, trainers=[0, 1], ahead={}, cluster=plan.cluster,
        chunk_bytes=1024, pack_below=1 << 20,
        layouts={lay.worker.rank: lay for lay in (*trainers, *rollouts)})


def test_repairs_for_all_suspects_and_each_alone_are_published_under_names_of_their_own():
    suspect = _Watch.grace * SUSPECT_AFTER + 0.1
    fin = _finisher({3: suspect, 6: suspect + 1, 4: 0.2})  # 4 is late, not suspected
    need, missing = [2, 3, 4, 5, 6, 7], [3, 4, 6, 7]  # 2 and 5 are done
    plan_ahead(fin, 9, 0, need, missing)
    assert set(fin.ahead) == {(9, 1, (4, 7)), (9, 1, (4, 6, 7)), (9, 1, (3, 4, 7))}
    assert len(set(fin.ahead.values())) == 3  # a name each
    for (_, _, left), name in fin.ahead.items():
        for r in (0, 1, *left):  # every worker of the repair has its part there
            part = fetch_part(fin.end.store, r, name=name, timeout=1)
            assert part.rank == r
            if r >= 2:
                assert set(part.peers) <= {0, 1, *left}  # only the trainers and the others left
        for r in set(need) - set(left):  # nobody else has
            with pytest.raises(TransferError):
                fin.end.store.get(f"{name}/part/{r}", 0.01)
    before = dict(fin.ahead)
    plan_ahead(fin, 9, 0, need, missing)  # nothing planned twice
    assert fin.ahead == before
    plan_ahead(fin, 10, 0, need, missing)  # another version's: the old ones dropped
    assert {k[:2] for k in fin.ahead} == {(10, 1)}


def test_nothing_is_planned_ahead_for_a_suspected_trainer_or_without_a_roster():
    suspect = _Watch.grace * SUSPECT_AFTER + 0.1
    fin = _finisher({1: suspect, 3: suspect})
    plan_ahead(fin, 2, 0, [2, 3, 4, 5, 6, 7], [1, 3])
    assert fin.ahead == {}
    fin = _finisher({3: suspect}, can_plan=False)
    plan_ahead(fin, 2, 0, [2, 3, 4, 5, 6, 7], [3])
    assert fin.ahead == {}
    fin = _finisher({3: 0.1})  # silent, but not for long enough
    plan_ahead(fin, 2, 0, [2, 3, 4, 5, 6, 7], [3])
    assert fin.ahead == {}
