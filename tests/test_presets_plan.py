"""The four paper-like deployments plan at the traffic lower bound and, with free messages, within
10% of ideal EWTT (the bandwidth model: the plan's quality; what messages cost is measured).

(Plan time and memory are measured by bench/bench_plan.py, not asserted here.)
"""

import pytest

import wb
from harness.presets import real_deployment
from wb.algorithms.planner import traffic_ratio
from wb.algorithms.simulate import simulate, simulate_broadcast, simulate_p2p


@pytest.mark.parametrize("preset", ["moonlight-16b-a3b", "qwen3-235b-a22b", "deepseek-v3", "kimi-k2"])
def test_preset_plans_at_the_bound(preset):
    dep = real_deployment(preset)  # its config ships in the package (wb/layouts/models)
    p = wb.plan(dep.trainers, dep.rollouts)
    assert traffic_ratio(p) == 1.0
    sim = simulate(p, message_s=0)
    assert sim.ewtt_s <= 1.10 * sim.ideal_s
    assert simulate_broadcast(p).ewtt_s > sim.ewtt_s
    assert simulate_p2p(p).ewtt_s >= sim.ewtt_s
    p.verify()
