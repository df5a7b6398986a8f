# %% [markdown]
# # WeightBridge in a notebook: probe -> plan -> plot -> transfer
#
# Everything runs in this process: a JAX trainer on a 2x2 mesh of emulated CPU devices feeds two
# replicas of a vLLM-style PyTorch rollout at TP 2, through `wb.LocalSession` (every worker is a
# thread; bytes move over the in-process transport, by the same executor UCX uses between
# processes). Open it as a notebook (Jupyter / VS Code read the `# %%` cells; `jupytext` converts
# it to `.ipynb`) or run it as a script: `python examples/notebook_session.py`.

# %%
import os
import sys

import numpy as np

import wb_jax

wb_jax.use_cpu_devices(4)  # before JAX starts: a 2x2 mesh on this machine

import wb  # noqa: E402
import wb_torch  # noqa: E402
from wb.cli.demo.runner import random_checkpoint  # noqa: E402
from wb.layouts.presets import TINY, spec_from_config  # noqa: E402
from wb_jax.testing import make_load_fn, make_mesh, train_step  # noqa: E402
from wb_torch.testing import TinyRollout  # noqa: E402

spec = spec_from_config(TINY)  # the checkpoint: names, shapes, dtypes
ckpt = random_checkpoint(seed=0)
print(f"checkpoint: {len(spec.names)} tensors, {spec.nbytes:,} bytes")

# %% [markdown]
# ## 1. Probe each side through its own load path
# The trainer's load function builds sharded `jax.Array`s from a checkpoint; the rollouts'
# `load_weights` fills their parameters (fused qkv, stacked experts, padded vocab...). WeightBridge
# runs both on index-encoded tensors and keeps a source map per buffer: no mapping rules.

# %%
mesh = make_mesh(dp=2, tp=2)
load = make_load_fn(TINY, mesh)
params = load(ckpt)
maps = wb_jax.probe(load, spec)
devices = list(mesh.devices.flat)
trial = wb_jax.layouts(params, maps, {d: i for i, d in enumerate(devices)}, node="t0",
                       role="trainer")
holders = [d for d, lay in zip(devices, trial) if lay.buffers]  # replica 0's shards
t_ranks = {d: i for i, d in enumerate(holders)}
trainers = wb_jax.layouts(params, maps, t_ranks, node="t0", role="trainer")

models, rollouts = {}, []
for replica in range(2):
    for tp_rank in range(2):
        rank = len(trainers) + len(rollouts)
        model = TinyRollout(TINY, tp_rank=tp_rank, tp_size=2)
        rmaps = wb_torch.probe(model, spec)  # runs model.load_weights (overwrites the weights)
        rollouts += wb_torch.layouts(model, rmaps, rank, node=f"rollout{replica}", role="rollout",
                                     local_rank=tp_rank)
        models[rank] = model
print(f"{len(trainers)} trainer workers, {len(rollouts)} rollout workers")

# %% [markdown]
# ## 2. Plan, check, plot
# The plan's traffic equals the lower bound: every byte leaves the trainers once and enters each
# rollout node once; the rest moves inside nodes.

# %%
plan = wb.plan(trainers, rollouts)
plan.verify()
bound = wb.lower_bound(trainers, rollouts)
print(f"trainer bytes sent {sum(plan.traffic().trainer_out.values()):,} "
      f"= lower bound {sum(bound.trainer_out.values()):,}")
sim = wb.simulate(plan)
print(f"simulated EWTT {sim.ewtt_s * 1e6:.1f} us vs ideal {sim.ideal_s * 1e6:.1f} us")

from wb.cli.plan import plot_links  # noqa: E402
from wb.algorithms.simulate import simulate_p2p  # noqa: E402

out_png = os.environ.get("WB_EXAMPLE_PLOT", "plan_links.png")
plot_links({"wb": sim, "naive p2p": simulate_p2p(plan)}, sim.ideal_s, out_png, title="tiny")
print(f"wrote {out_png}")

# %% [markdown]
# ## 3. Transfer, several training steps, both sides staging
# The trainer's buffers are its shards; the rollouts' are their parameters' own storage (written
# in place). Each step changes the trainer's weights, pushes, and applies on the rollouts.

# %%
live = {r: bufs for lay in rollouts
        for r, bufs in wb_torch.buffers(models[lay.worker.rank], lay.worker.rank).items()}
session = wb.LocalSession(plan, wb_jax.buffers(params, t_ranks), live, mode="both")
for step in range(1, 4):
    params = train_step(params)  # a training step (w <- -2 w): a new pytree
    summary = session.update(wb_jax.buffers(params, t_ranks))
    print(f"step {step}: EWTT {summary.ewtt_s * 1e3:.2f} ms, AGST {summary.agst_s * 1e3:.2f} ms")
session.close()

# %% [markdown]
# ## 4. Check: the rollouts hold what their own loader makes of the trainer's weights

# %%
final = {n: (a * np.asarray(-8, a.dtype)).astype(a.dtype) for n, a in ckpt.items()}  # (-2)**3
ok = True
for lay in rollouts:
    ref = TinyRollout(TINY, tp_rank=lay.worker.local_rank, tp_size=2)
    ref.load_weights((n, wb_torch.from_numpy(a)) for n, a in final.items())
    want, got = dict(ref.named_parameters()), dict(models[lay.worker.rank].named_parameters())
    ok &= all(wb_torch.to_numpy(got[n]).tobytes() == wb_torch.to_numpy(want[n]).tobytes()
              for n in lay.buffers)
print("every rollout parameter bit-identical:", ok)
if not ok:
    sys.exit(1)
