"""``python -m wb check``: asks a running job's workers to check the weights they serve.

Every worker that serves checks (``Sender.serve_checks`` / ``Receiver.serve_checks``, or their
groups') answers at its next pushes and applies (:mod:`wb.runtime.endpoints.asks`): the
trainers claim what they push, each rollout checks its live buffers against the claim of the
version it serves, through its source maps, and publishes its report. This command opens the
ask in the job's store, prints each answer as it comes and returns whether every rollout
answered and matched.
"""

from __future__ import annotations

import os
import time

from wb.errors import SpecError, TransferError
from wb.runtime.endpoints import asks
from wb.runtime.transport.keyed import keyed

__all__ = ["open_store", "run_check"]


def open_store(where: str):
    """The job's store from the command line, signed with ``WB_JOB_KEY`` as the workers' are:
    ``tcp://HOST:PORT`` or ``dir:/path`` as :func:`wb_vllm.trainer.open_store` takes them, or a
    bare directory (a ``wb.DirectoryStore``)."""
    from wb_vllm.trainer import open_store as by_url  # imports neither vLLM nor torch

    if not where.startswith(("tcp://", "dir:")):
        if not os.path.isdir(where):
            raise SpecError(f"--store {where!r}: no such directory (the job's DirectoryStore), "
                            f"nor tcp://HOST:PORT")
        where = "dir:" + where
    return keyed(by_url(where))


def run_check(where: str, *, name: str = "wb", timeout: float = 120.0,
              quiet: bool = False) -> dict:
    """Asks job ``name`` (store ``where``) for a weight check; returns the answers as a report
    (``ok``: every serving rollout answered and matched)."""
    store = open_store(where)
    ranks = asks.serving(store, name)
    if not any(role == "rollout" for role in ranks.values()):
        raise TransferError(f"no rollout of job `{name}` in {where} serves weight checks: call "
                            f"Receiver.serve_checks(spec) (and Sender.serve_checks on the "
                            f"trainers) in the job; serving: {ranks or 'none'}")
    t0 = time.perf_counter()
    n = asks.ask(store, name)
    say = (lambda *_: None) if quiet else print
    say(f"ask {n} of job `{name}`: {sum(r == 'trainer' for r in ranks.values())} trainers, "
        f"{sum(r == 'rollout' for r in ranks.values())} rollouts serve checks; waiting for "
        f"their next pushes and applies (up to {timeout:.0f} s)")

    def show(rank: int, a: dict) -> None:
        if a["role"] == "trainer":
            say(f"  trainer {rank}: claims version {a['version']} ({a['claimed']:,} elements)")
        else:
            say(("  OK   " if a["ok"] else "  FAIL ") + a["report"].replace("\n", "\n       "))

    got = asks.gather(store, name, n, ranks, timeout=timeout, on_answer=show)
    rollouts = sorted(r for r, role in ranks.items() if role == "rollout")
    silent = [r for r in rollouts if r not in got]
    if silent:
        say(f"  no answer within {timeout:.0f} s from rollouts {silent} (not applying?)")
    ok = not silent and all(got[r]["ok"] for r in rollouts)
    say("every rollout serves the trainers' weights" if ok else "CHECK FAILED")
    return {"ok": ok, "ask": n, "name": name, "answers": {str(r): a for r, a in got.items()},
            "silent": silent, "seconds": round(time.perf_counter() - t0, 3)}
