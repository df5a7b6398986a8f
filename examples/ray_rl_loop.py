"""A Ray RL loop: one JAX trainer actor feeds PyTorch rollout actors through wb, and a rollout
that Ray restarts comes back by itself.

Everything meets through Ray's own key-value store (:class:`wb.RayStore`); bytes move over UCX.
The trainer "trains" (``w <- -2 w``, exact in bf16) and pushes a version per step; each rollout
applies every version it gets and checks its buffers bit for bit against what its own loader
(vLLM's ``load_weights`` contract) makes of the trainer's weights at that version. Halfway
through, one rollout actor is killed; Ray restarts it (``max_restarts``), its maps come from the
cache its first start wrote, and it rejoins the running job with ``Receiver.join``: the
trainer's next push takes it in, fed whole, and nobody waits for it.

    python examples/ray_rl_loop.py [--rollouts 2] [--versions 8] [--step-s 2] [--json]

It starts a local Ray cluster (``--address`` joins a running one instead).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import ray

import wb

NS = "ray-rl-loop"  # the key-value namespace of this job (wb's keys and the example's own)


def weights(spec, version: int) -> dict[str, np.ndarray]:
    """The trainer's weights at ``version``: a seeded checkpoint times (-2) ** version."""
    from wb_jax.testing import checkpoint_arrays  # numpy only; the same arrays everywhere

    k = (-2.0) ** version
    return {n: (a.astype(np.float32) * k).astype(a.dtype)
            for n, a in checkpoint_arrays(spec, seed=0).items()}


@ray.remote(num_cpus=0)
class Trainer:
    """Rank 0: a JAX model on one (CPU) device, pushing a version per step."""

    def __init__(self, world: int):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import jax

        import wb_jax
        from wb.layouts.presets import TINY, spec_from_config
        from wb_jax.testing import make_load_fn, make_mesh

        wb_jax.use_cpu_devices(1)
        self.spec, self.store = spec_from_config(TINY), wb.RayStore(namespace=NS)
        load = make_load_fn(TINY, make_mesh(1, 1))
        maps = wb_jax.probe(load, self.spec)
        self.params = load(weights(self.spec, 0))
        self.ranks = {jax.devices()[0]: 0}  # {device: wb rank}
        self.layouts = wb_jax.layouts(self.params, maps, ranks=self.ranks, node="trainer0",
                                      role="trainer")
        self.world = world

    def train(self, versions: int, step_s: float) -> None:
        import wb_jax
        from wb_jax.testing import train_step

        plan = wb.agree_parts(self.store, self.layouts, world=self.world)
        with wb_jax.Sender(self.params, plan, self.ranks, store=self.store,
                           transports={0: wb.UcxTransport(0, self.store)}) as tx:
            for v in range(1, versions + 1):
                time.sleep(step_s)  # the rest of a training step
                self.params = train_step(self.params)  # w <- -2 w
                tx.push(self.params)
                self.store.set("example/pushed", str(v).encode())


# Ray starts a killed rollout again and runs the call it was serving again, on the new process
@ray.remote(num_cpus=0, max_restarts=1, max_task_retries=1)
class Rollout:
    """A PyTorch rollout (one rank, one replica); joins the running job when Ray restarted it."""

    def __init__(self, rank: int, cache: str, world: int):
        import wb_torch
        from wb.layouts.presets import TINY, spec_from_config
        from wb_torch.testing import TinyRollout

        self.rank, self.spec, self.store = rank, spec_from_config(TINY), wb.RayStore(namespace=NS)
        self.model = TinyRollout(TINY)
        before = _files(cache)
        t0 = time.perf_counter()
        maps = wb_torch.probe(self.model, self.model.spec, cache=cache, key=rank)
        self.probe_s = time.perf_counter() - t0
        self.cache_hit = bool(before) and _files(cache) == before  # read back, not written
        (self.layout,) = wb_torch.layouts(self.model, maps, rank, node=f"rollout{rank}",
                                          role="rollout")
        self.world, self.rx = world, None
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if self.restarted:  # the job runs on: ask to be taken in (the old process counts as dead)
            self.asked_at = self._pushed()
            self.rx = wb_torch.Receiver.join(self.model, [self.layout], rank, store=self.store,
                                             transports=wb.UcxTransport(rank, self.store))

    def _pushed(self) -> int:
        try:
            return int(self.store.get("example/pushed", 0.0))
        except wb.TransferError:
            return 0

    def serve(self, versions: int) -> dict:
        import wb_torch
        from wb.layouts.presets import TINY
        from wb_torch.testing import TinyRollout

        if self.rx is None:  # the first start: the job's set-up
            plan = wb.agree_parts(self.store, [self.layout], world=self.world)
            self.rx = wb_torch.Receiver(self.model, plan, self.rank, store=self.store,
                                        transports=wb.UcxTransport(self.rank, self.store))
        while self.rx.version < versions:
            self.rx.apply()  # a real engine would generate between versions
            v = self.rx.version
            ref = TinyRollout(TINY)  # its own loader, fed the trainer's weights at v
            ref.load_weights((n, wb_torch.from_numpy(a)) for n, a in weights(self.spec, v).items())
            want = dict(ref.named_parameters())
            ok = all(wb_torch.to_numpy(p).tobytes() == wb_torch.to_numpy(want[n]).tobytes()
                     for n, p in self.model.named_parameters() if n in self.layout.buffers)
            self.store.set(f"example/applied/{self.rank}/{v}", b"ok" if ok else b"bad")
        self.rx.close()
        return {"rank": self.rank, "restarted": self.restarted, "probe_s": self.probe_s,
                "cache_hit": self.cache_hit, "asked_at": getattr(self, "asked_at", None)}


def _files(path: str) -> dict[str, int]:
    """``{file: mtime}`` of the cache ``path`` (a file, or a folder of them; empty: none yet)."""
    p = Path(path)
    return {str(f): f.stat().st_mtime_ns for f in ([p] if p.is_file() else p.rglob("*"))
            if f.is_file()}


def applied(store, rank: int, versions: int) -> dict[int, bool]:
    """``{version: verified}`` of what rollout ``rank`` applied (its own records in the store)."""
    out = {}
    for v in range(1, versions + 1):
        try:
            out[v] = store.get(f"example/applied/{rank}/{v}", 0.0) == b"ok"
        except wb.TransferError:
            pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=2)
    ap.add_argument("--versions", type=int, default=8)
    ap.add_argument("--step-s", type=float, default=2.0, help="seconds of 'training' per step")
    ap.add_argument("--kill-after", type=int, default=2,
                    help="the last rollout is killed once it applied this version")
    ap.add_argument("--address", help="a running Ray cluster (default: start a local one)")
    ap.add_argument("--logs", action="store_true", help="show the actors' output (wb's log lines)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    a = ap.parse_args()
    if a.rollouts < 1 or not 1 <= a.kill_after < a.versions - 2:
        raise SystemExit("--rollouts >= 1 and 1 <= --kill-after < --versions - 2")
    work = tempfile.mkdtemp(prefix="wbray")
    if a.address:
        ray.init(address=a.address, namespace=NS, log_to_driver=a.logs)
    else:
        ray.init(num_cpus=2, namespace=NS, include_dashboard=False, log_to_driver=a.logs,
                 _temp_dir=os.path.join(work, "ray"))
    t0 = time.time()
    try:
        store, world = wb.RayStore(namespace=NS), 1 + a.rollouts
        trainer = Trainer.remote(world)
        rollouts = [Rollout.remote(1 + i, os.path.join(work, f"maps{1 + i}"), world)
                    for i in range(a.rollouts)]
        trained = trainer.train.remote(a.versions, a.step_s)
        served = {r: h.serve.remote(a.versions) for r, h in enumerate(rollouts, 1)}
        victim = a.rollouts  # the last rollout's rank
        while not applied(store, victim, a.versions).get(a.kill_after):
            time.sleep(0.05)
        ray.kill(rollouts[-1], no_restart=False)  # Ray starts it again (max_restarts=1)
        killed_at = int(store.get("example/pushed", 1.0))
        ray.get(trained)  # raises the trainer's error, if any
        served = {r: ray.get(f) for r, f in served.items()}
        runs = {r: applied(store, r, a.versions) for r in served}
    finally:
        ray.shutdown()
    back = served[victim]
    first_back = min(v for v in runs[victim] if v > killed_at)
    report = {
        "versions": a.versions, "rollouts": a.rollouts, "elapsed_s": round(time.time() - t0, 1),
        # every version each rollout applied, each checked bit for bit against its own load
        "applied": {str(r): sorted(vs) for r, vs in runs.items()},
        "verified": all(all(vs.values()) for vs in runs.values()),
        "restart": {"rank": victim, "killed_after_version": killed_at,
                    "restarted": back["restarted"], "asked_at_version": back["asked_at"],
                    "first_version_back": first_back,
                    "versions_behind": first_back - back["asked_at"],
                    "maps_from_cache": back["cache_hit"], "probe_s": round(back["probe_s"], 3)},
        "first_probe_s": round(served[1]["probe_s"], 3),
    }
    print(json.dumps(report) if a.json else json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
