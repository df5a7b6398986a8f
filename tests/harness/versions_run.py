"""Successive versions of a plan's weights through one rank's program, dense or as deltas (the
worker side of ``bench/bench_fp8.py --delta``): version 0 dense (nobody holds one), then each
version changes about ``density`` of the mapped elements (:func:`wb.cli.bench.weights.
version_into`, placed by a hash of each element's bits, made on the device the buffers are on)
and is sent to every peer as a delta (``delta``) or dense. Every rollout checks every version
bit for bit; each version starts at one instant on every rank (a barrier)."""

from __future__ import annotations

import time

import numpy as np

from wb.cli.bench.weights import buffers_of, mapped_of, version_into, version_matches

__all__ = ["run_versions"]


def run_versions(program, part, bufs, transport, xp, options: dict, result: dict,
                 barrier) -> None:
    """Runs ``options["versions"]`` (``{"count", "density", "delta"}``) through ``program``;
    fills ``result`` (``versions``: per version its start, end, bytes received and check;
    ``ok``, ``bit_identical``)."""
    from wb.runtime.engine.deltas.units import DeltaPlan
    from wb.runtime.engine.executor import connect

    spec = options["versions"]
    lay = part.layout
    trainer = lay.worker.role.value == "trainer"
    timeout, staging = options.get("timeout", 60.0), options.get("staging_bytes", 256 << 20)
    base = buffers_of(lay, fill=True, xp=xp)
    mapped = mapped_of(lay, xp)
    program.check(bufs)
    connect(part, transport)
    peers = frozenset(part.peers)
    rows, good = [], True
    for v in range(spec["count"]):
        changed = 0
        if trainer:
            changed = version_into(bufs, base, v, mapped, xp, density=spec["density"])
            if xp is not np:
                xp.cuda.get_current_stream().synchronize()
        plan = (DeltaPlan(v, peers if v else frozenset(), peers if v else frozenset())
                if spec["delta"] else None)
        barrier(f"version{v}")
        stats = program.run(bufs, transport, tag_base=(v + 1) << 32, timeout=timeout,
                            staging_bytes=staging, delta=plan)
        ok = None
        if not trainer:
            ok = version_matches(bufs, base, v, mapped, xp, density=spec["density"])
            good &= ok
        rows.append({"version": v, "start_s": stats.start_s, "end_s": stats.end_s,
                     "received": stats.bytes_received, "changed": changed, "ok": ok,
                     "t": time.time()})
    transport.close()
    result.update(versions=rows, ok=True, bit_identical=good,
                  elements=int(sum(a.size for a in bufs.values())))
