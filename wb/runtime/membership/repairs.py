"""Repair plans: the trainers -> rollouts-left transfer that a version's next attempt runs once
the trainers' leader calls rollouts dead (:mod:`wb.runtime.membership.finish`), planned then or,
for the rollouts it suspects, ahead of it.

A worker silent for :data:`SUSPECT_AFTER` of the liveness grace is suspected: the leader plans
and publishes the repairs for the deaths of all its suspects and of each alone (one may beat
again), each under a name of its own, while its own part runs or once it is done. Calling the
dead then only writes the attempt's record, which names the parts its workers fetch, where the
rollouts left are those of a repair planned ahead.
"""

from __future__ import annotations

from wb.algorithms import planner
from wb.errors import PlanError
from wb.runtime.membership.records import publish_parts

__all__ = ["ATTEMPT_BITS", "SUSPECT_AFTER", "plan_for", "publish_repair", "plan_ahead"]

#: Bits of a tag for the message index within an attempt; the attempt sits above them and the
#: version above ``32``.
ATTEMPT_BITS = 27
#: A worker silent this long (a third of the liveness grace) is suspected.
SUSPECT_AFTER = 1 / 3
#: Suspects whose deaths alone are planned ahead, at most (beside all of them together).
_ALONE = 4


def plan_for(fin, rollouts: list[int], apart=()):
    """The trainers -> ``rollouts`` plan of the finisher ``fin``'s job, made as its first plan was
    (its roster's layouts, link rates, piece size and packing); ``apart``: as :func:`wb.plan`'s."""
    return planner.plan([fin.layouts[t] for t in fin.trainers],
                        [fin.layouts[r] for r in rollouts], fin.cluster,
                        chunk_bytes=fin.chunk_bytes, pack_below=fin.pack_below, apart=apart)


def publish_repair(fin, left: list[int], name: str) -> None:
    """Plans the trainers -> ``left`` transfer of the finisher ``fin``'s job (its roster) and
    publishes each worker's part under ``name``.

    Raises:
        PlanError: the plan has more messages than a tag's :data:`ATTEMPT_BITS` hold.
    """
    repair = plan_for(fin, left)
    if repair.messages.stage.size >= 1 << ATTEMPT_BITS:
        raise PlanError(f"a repair plan of {repair.messages.stage.size} messages: more than "
                        f"2**{ATTEMPT_BITS} fit a tag")
    publish_parts(fin.end.store, repair, name=name)


def plan_ahead(fin, v: int, a: int, need: list[int], missing: list[int]) -> None:
    """The leader ``fin`` while workers ``missing`` of attempt ``a`` of version ``v`` are not
    done (``need``: the attempt's rollouts): the repairs for its suspects' deaths, published
    ahead, kept in ``fin.ahead`` (``{(v, attempt, rollouts left): parts' name}``)."""
    if not fin.can_plan:
        return
    end = fin.end
    suspects = end.watch.silent([r for r in missing if r != end.rank],
                                grace=end.watch.grace * SUSPECT_AFTER)
    if not suspects or any(r in fin.trainers for r in suspects):
        return
    fin.ahead = {k: n for k, n in fin.ahead.items() if k[:2] == (v, a + 1)}
    done = {r for r in need if r not in missing}
    alone = [{r} for r in sorted(suspects)[:_ALONE]] if len(suspects) > 1 else []
    for dead in [set(suspects), *alone]:
        left = tuple(r for r in need if r not in done and r not in dead)
        if not left or (v, a + 1, left) in fin.ahead:
            continue
        name = end.key("v", v, "part", a + 1, "ahead", len(fin.ahead))
        try:
            publish_repair(fin, list(left), name)
        except PlanError:  # planned again when called dead, and raised then
            return
        fin.ahead[(v, a + 1, left)] = name
