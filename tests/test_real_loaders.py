"""Regression tests for the three defects real loaders showed (issue 13, deliverable 4).

Each small module here behaves like the real loader that exposed the defect: transformers' loader
replaces Parameter objects (``setattr(module, name, nn.Parameter(...))``), DeepSeek-V3 keeps a
checkpoint tensor in a persistent buffer, and a deployment whose rollouts need nothing made the
planner fail with a bare ``IndexError``.
"""


import numpy as np
import pytest
from wb.runtime.transport.local import LocalHub, LocalTransport

torch = pytest.importorskip("torch")

import wb  # noqa: E402
from harness.threads import together  # noqa: E402
import wb_torch  # noqa: E402

SPEC = wb.CheckpointSpec({"proj.weight": ((6, 4), "float32"), "gate.bias": ((6,), "float32"),
                          "norm.weight": ((4,), "float32")})


class Replacing(torch.nn.Module):
    """Loads like transformers 5.x: every loaded tensor becomes a *new* Parameter (setattr),
    rows 2..5 of ``proj.weight`` (a shard) and the whole norm."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4, bias=False)
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.ones(4))

    @torch.no_grad()
    def load_weights(self, weights):
        for name, t in weights:
            if name == "proj.weight":
                self.proj.weight = torch.nn.Parameter(t[2:].clone())
            elif name == "norm.weight":
                setattr(self.norm, "weight", torch.nn.Parameter(t.flip(0).clone()))


class WithBuffers(torch.nn.Module):
    """Loads like transformers' DeepSeek-V3 MoE gate: a checkpoint tensor in a persistent buffer
    (``gate.bias``, as ``e_score_correction_bias``), next to a non-persistent one (rotary
    ``inv_freq``) that no checkpoint feeds and probing must leave alone."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 6, bias=False)
        self.gate = torch.nn.Module()
        self.gate.register_buffer("bias", torch.zeros(6), persistent=True)
        self.register_buffer("inv_freq", torch.arange(1.0, 3.0), persistent=False)

    @torch.no_grad()
    def load_weights(self, weights):
        for name, t in weights:
            if name == "proj.weight":
                self.proj.weight.copy_(t)
            elif name == "gate.bias":
                self.gate.bias.copy_(t)


# --- 1. replaced Parameter objects ---------------------------------------------------------------
def test_a_load_that_replaces_parameters_is_followed():
    model = Replacing()
    maps = wb_torch.probe(model, SPEC)
    np.testing.assert_array_equal(maps["proj.weight"].to_indices(), SPEC.ids("proj.weight")[2:])
    np.testing.assert_array_equal(maps["norm.weight"].to_indices(), SPEC.ids("norm.weight")[::-1])
    (lay,) = wb_torch.layouts(model, maps, 0, node="r", role="rollout")
    assert set(lay.buffers) == {"proj.weight", "norm.weight"}  # was: 0 of 2 kept


def test_a_probe_that_finds_no_id_anywhere_raises():
    with pytest.raises(wb.ProbeError, match="no checkpoint id"):
        wb.probe(SPEC, lambda ck: {"x": np.zeros(3, np.float32)})


def test_a_torch_load_that_writes_nothing_raises():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(wb.ProbeError, match="no checkpoint id"):
        wb_torch.probe(model, SPEC, load_weights=lambda weights: [None for _ in weights])


# --- 2. persistent buffers -----------------------------------------------------------------------
def test_persistent_buffers_are_probed_and_non_persistent_ones_left_alone():
    model = WithBuffers()
    maps = wb_torch.probe(model, SPEC)
    assert set(maps) == {"proj.weight", "gate.bias"}
    np.testing.assert_array_equal(maps["gate.bias"].to_indices(), SPEC.ids("gate.bias"))
    np.testing.assert_array_equal(model.inv_freq.numpy(), [1.0, 2.0])  # never zeroed
    (lay,) = wb_torch.layouts(model, maps, 0, node="r", role="rollout")
    assert set(lay.buffers) == {"proj.weight", "gate.bias"}
    bufs = wb_torch.buffers(model, 0)[0]
    assert set(bufs) == {"proj.weight", "gate.bias"}
    assert np.shares_memory(bufs["gate.bias"], model.gate.bias.numpy())


def test_an_update_moves_persistent_buffers():
    trainer, rollout = WithBuffers(), WithBuffers()
    ck = {n: torch.randn(s) for n, (s, _) in SPEC.items()}
    trainer.load_weights(ck.items())
    tl = wb_torch.layouts(trainer, wb_torch.probe(WithBuffers(), SPEC), 0, node="t",
                          role="trainer")
    rl = wb_torch.layouts(rollout, wb_torch.probe(rollout, SPEC), 1, node="r", role="rollout")
    plan = wb.plan(tl, rl)
    hub, store = LocalHub(), wb.MemoryStore()
    kw = dict(store=store, timeout=30, wait_timeout=30)
    tx, rx = together(
        lambda: wb_torch.Sender(trainer, plan, 0, transports=LocalTransport(0, hub, timeout=30),
                                **kw),
        lambda: wb_torch.Receiver(rollout, plan, 1,
                                  transports=LocalTransport(1, hub, timeout=30), **kw))
    with tx, rx:
        together(tx.push, rx.apply)
    assert torch.equal(rollout.gate.bias, ck["gate.bias"])  # was: stale after every update
    assert torch.equal(rollout.proj.weight, ck["proj.weight"])


def test_checkpoint_layouts_skip_buffers_that_are_not_checkpoint_tensors():
    model = WithBuffers()
    model.register_buffer("step", torch.zeros(1), persistent=True)  # not in the checkpoint
    (lay,) = wb_torch.checkpoint_layouts(model, SPEC, 0, node="t", role="trainer")
    assert set(lay.buffers) == {"proj.weight", "gate.bias"}


# --- 3. rollouts that need nothing ---------------------------------------------------------------
def _layout(rank, role, ids):
    return wb.Layout(wb.Worker(rank, role[0], role),
                     {} if ids is None else
                     {"w": wb.BufferSpec(wb.SourceMap.from_indices(ids), "float32")})


@pytest.mark.parametrize("rollouts", [
    [], [_layout(1, "rollout", None)], [_layout(1, "rollout", np.full((2, 2), -1))],
], ids=["no rollouts", "empty layout", "all -1"])
def test_a_plan_for_rollouts_that_need_nothing_is_a_plan_error(rollouts):
    trainer = _layout(0, "trainer", np.arange(64).reshape(8, 8))
    with pytest.raises(wb.PlanError, match="need no checkpoint id"):
        wb.plan([trainer], rollouts)
