"""Where a message's time goes, layer by layer: wb's own loop, the transport, and at 1T scale.

Four measurements, each a cost per message (microseconds), every one on the same machine in one
run:

- ``loop``: wb's executor alone. Every rank's part of a plan cut into many small messages (the
  ``tiny`` preset with ``--chunk`` byte pieces) runs through :meth:`Program.run
  <wb.runtime.engine.program.Program.run>` over a transport whose requests complete at once and
  move no bytes; per side (trainers send, rollouts receive and forward), the rank's update time
  over its messages. ``loop_framed``: the same with small messages framed, as over a real
  transport (:mod:`wb.runtime.engine.frames`: the loop then copies them into frames).
- ``transport``: the real transport between two processes on this host, ``--messages`` messages
  of ``--message-bytes`` each, posted and completed through :class:`wb.UcxTransport` alone (no
  executor): per side, the time from the first post to the last completion over the messages.
- ``executor``: the same messages as one plan (one trainer, one rollout, pieces of
  ``--message-bytes``) run by the executor over the real transport, end to end (both processes
  start at one instant; the last completion ends it), beside one stream of the same bytes.
- ``k2`` (``--k2``): the heaviest rollout and trainer rank parts of the ``kimi-k2`` preset's plan
  (what ``wb plan --setup`` cuts) run through the executor over the no-bytes transport, with no
  bytes packed either (buffers are not allocated: the loop's control alone). Their messages per
  rank (min, median, max over every rank) and ``control_share_of_ideal``: the heaviest rank's
  control time per update over the plan's ideal EWTT (its share of the ideal is all of it: every
  rank works through the whole update).

With ``--cuda N`` the transport and executor layers run with buffers on that GPU (CuPy).

    python bench/bench_executor.py [--quick] [--json] [--cuda 0] [--k2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


class _Done:
    """A request that is complete when posted."""

    __slots__ = ("peer", "tag")

    def __init__(self, peer: int, tag: int):
        self.peer, self.tag = peer, tag

    def done(self) -> bool:
        return True


class NullMover:
    """A :class:`~wb.runtime.engine.movers.Mover` that packs, unpacks and copies nothing and
    hands out no memory: with it (and :class:`NullTransport`) an update is the loop's control
    alone, at any scale (no buffers are allocated)."""

    _EMPTY = np.zeros(0, np.uint8)

    def source(self, g):
        return self._EMPTY

    def target(self, g):
        return self._EMPTY

    def staging(self, nbytes: int):
        return self._EMPTY

    def release(self, buf) -> None:
        pass

    def pack(self, g):
        return self._EMPTY

    def unpack(self, g, buf) -> None:
        pass

    def unpack_all(self, items: list) -> list:
        return [(None, g, buf) for g, buf in items]

    def copy_local(self, g) -> None:
        pass

    def fence(self):
        return None

    def wait(self, g):
        return None


class NullTransport:
    """A :class:`wb.Transport` whose requests complete at once and move no bytes: what is left of
    an update is wb's own loop. Its messages cost nothing, so programs over it do not frame small
    messages (``frames``; with ``frames=True`` they do, as over a real transport)."""

    def __init__(self, rank: int, *, frames: bool = False):
        self.rank, self.frames = rank, frames

    def connect(self, peers, *, hello: bytes = b"") -> dict[int, bytes]:
        return {int(p): hello for p in peers if int(p) != self.rank}

    def send(self, peer: int, buf, tag: int) -> _Done:
        return _Done(peer, tag)

    def recv(self, peer: int, buf, tag: int) -> _Done:
        return _Done(peer, tag)

    def describe(self) -> str:
        return "null"

    def close(self) -> None:
        pass


def loop_layer(chunk: int, repeat: int, *, frames: bool = False) -> dict:
    """wb's loop alone: every rank of the ``tiny`` preset planned with ``chunk``-byte pieces
    (``frames``: small messages framed, as over a real transport: copies the loop then makes)."""
    import wb
    from wb.cli.bench.weights import buffers_of
    from wb.layouts import deployment
    from wb.runtime.engine.program import Program

    dep = deployment("tiny")
    plan = wb.plan(dep.trainers, dep.rollouts, chunk_bytes=chunk)
    out: dict[str, list] = {"trainer": [], "rollout": []}
    for part in wb.data.plan.parts(plan):
        prog = Program(part, frames=frames)
        n = len(prog.messages)
        if not n:
            continue
        bufs = buffers_of(part.layout, fill=part.role.value == "trainer")
        transport = NullTransport(part.rank, frames=frames)
        best = float("inf")
        for k in range(repeat + 1):  # the first run checks the buffers and warms up
            t0 = time.perf_counter()
            prog.run(bufs, transport, tag_base=k << 32)
            best = min(best, time.perf_counter() - t0)
        out[part.role.value].append((n, best))
    return {side: _per_message(rows) for side, rows in out.items()}


def _per_message(rows: list[tuple[int, float]]) -> dict:
    """``{messages, us_per_message}`` over ranks: total time over total messages."""
    n = sum(r[0] for r in rows)
    s = sum(r[1] for r in rows)
    return {"ranks": len(rows), "messages": n, "us_per_message": round(s / max(n, 1) * 1e6, 3)}


def transport_layers(message_bytes: int, messages: int, cuda: int | None, tls: str | None
                     ) -> dict:
    """The transport alone and the executor over it, between two processes of this host."""
    sys.path.insert(0, str(ROOT / "tests"))
    from harness.multiproc import raw_messages

    with tempfile.TemporaryDirectory() as tmp:
        raw = raw_messages(message_bytes, messages, tmp + "/raw", tls=tls, cuda_device=cuda)
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_transfer

    chunk = message_bytes
    rep = bench_transfer.run(hidden=512, layers=2, experts=8, replicas=1, repeat=1, tls=tls,
                             chunk=chunk, cuda_device=cuda, shape="single", warmup=1)
    n = rep["messages"]
    return {
        "transport": {side: {"messages": messages,
                             "us_per_message": round(raw[side] / messages * 1e6, 3),
                             "us_to_post": round(raw[f"{side}_post"] / messages * 1e6, 3)}
                      for side in ("send", "recv")},
        "executor": {"messages": n, "bytes": rep["bytes_between_processes"],
                     "ewtt_s": rep["ewtt_s"], "one_stream_s": rep["ideal_s"],
                     "us_per_message": round(rep["ewtt_s"] / n * 1e6, 3),
                     "over_one_stream": round(rep["ewtt_s"] / rep["ideal_s"], 2)},
    }


def k2_layer(models_dir: str | None = None) -> dict:
    """The heaviest K2 rollout and trainer parts through the loop, no bytes moved or packed."""
    import wb
    from wb.algorithms.simulate import simulate
    from wb.layouts import deployment
    from wb.runtime.engine.program import Program

    dep = deployment("kimi-k2", models_dir=models_dir)
    t0 = time.perf_counter()
    plan = wb.plan(dep.trainers, dep.rollouts)
    plan_s = time.perf_counter() - t0
    M = plan.messages
    per_rank = np.bincount(M.src_rank, minlength=len(plan.ranks))
    per_rank += np.bincount(M.dst_rank[M.dst_rank != M.src_rank], minlength=len(plan.ranks))
    roles = {lay.worker.rank: "trainer" for lay in plan.trainers}
    roles.update({lay.worker.rank: "rollout" for lay in plan.rollouts})
    ideal = simulate(plan).ideal_s
    out = {"plan_s": round(plan_s, 1), "ideal_s": ideal}
    for side in ("trainer", "rollout"):
        ranks = [r for r in plan.ranks if roles[r] == side]
        counts = per_rank[ranks]
        heaviest = ranks[int(np.argmax(counts))]
        prog = Program(wb.RankPlan.of(plan, heaviest), frames=False)  # as over NullTransport
        transport, mover = NullTransport(heaviest), NullMover()
        best = float("inf")
        for k in range(3):
            t1 = time.perf_counter()
            prog.run(None, transport, tag_base=k << 32, mover=mover)
            best = min(best, time.perf_counter() - t1)
        n = len(prog.messages)
        out[side] = {"messages_min": int(counts.min()), "messages_median":
                     int(statistics.median(counts.tolist())), "messages_max": int(counts.max()),
                     "heaviest_rank": int(heaviest), "control_s": round(best, 4),
                     "us_per_message": round(best / n * 1e6, 3),
                     "control_share_of_ideal": round(best / ideal, 4)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer messages, one repeat")
    ap.add_argument("--chunk", type=int, default=512, help="the loop layer's piece bytes")
    ap.add_argument("--message-bytes", type=int, default=8192)
    ap.add_argument("--messages", type=int, default=10000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cuda", type=int, default=None, metavar="DEVICE")
    ap.add_argument("--tls", default=None)
    ap.add_argument("--k2", action="store_true", help="also the K2 ranks (plans 1T: ~1 min)")
    ap.add_argument("--skip-transport", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.quick:
        a.messages, a.repeat = 2000, 1
    rep: dict = {"device": f"cuda:{a.cuda}" if a.cuda is not None else "cpu",
                 "time": time.strftime("%Y-%m-%d %H:%M")}
    rep["loop"] = loop_layer(a.chunk, a.repeat)
    rep["loop_framed"] = loop_layer(a.chunk, a.repeat, frames=True)
    if not a.skip_transport:
        rep.update(transport_layers(a.message_bytes, a.messages, a.cuda, a.tls))
    if a.k2:
        rep["k2"] = k2_layer()
    if a.out:
        Path(a.out).write_text(json.dumps(rep, indent=1))
    if a.json:
        print(json.dumps(rep))
    else:
        print(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()
