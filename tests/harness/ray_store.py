"""What ``tests/test_ray.py`` runs in a process of its own (Ray's cluster, actors and an outside
process; ``python -m harness.ray_store DIR`` from ``tests/``, with ``HOME`` and Ray's token path
inside ``DIR``). Prints one JSON line: what each party saw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

OUTSIDE = """
import sys, ray, wb
ray.init(address=sys.argv[1], log_to_driver=False)
s = wb.RayStore(namespace="t")
s.set("outside/said", s.get("driver/said", 10) + b" and back")
"""


def main(workdir: str) -> None:
    import ray

    import wb
    from wb.errors import TransferError
    from wb.runtime.transport.stores import get_large, set_large

    ray.init(num_cpus=2, _temp_dir=os.path.join(workdir, "ray"), include_dashboard=False,
             log_to_driver=False)
    out: dict = {}
    try:
        s = wb.RayStore(namespace="t", max_value_bytes=1 << 20)
        big = np.random.default_rng(0).integers(0, 256, 5 << 20, dtype=np.uint8).tobytes()
        set_large(s, "big", big)
        out["chunks"] = sum(not _refused(s, f"big#{k}") for k in range(8))
        out["big_round_trip"] = get_large(s, "big", 5) == big
        s.set("k", b"1")
        s.set("k", b"2")  # keys are overwritten (heartbeats write one key again and again)
        out["overwritten"] = s.get("k", 1)
        t0 = time.monotonic()
        try:
            s.get("missing", 0.3)
            out["missing"] = "no error"
        except TransferError as e:
            out["missing"] = str(e)
        out["missing_waited_s"] = time.monotonic() - t0
        out["other_namespace_empty"] = _refused(wb.RayStore(namespace="other"), "k")

        @ray.remote
        class Peer:
            """An actor that meets another through the store and sends it bytes over UCX."""

            def run(self, rank: int) -> list:
                import numpy as np

                import wb

                t = wb.UcxTransport(rank, wb.RayStore(namespace="t"), session="actors")
                t.connect([0, 1])
                buf = np.full(1 << 16, 7, np.uint8) if rank == 0 else np.zeros(1 << 16, np.uint8)
                req = t.send(1, buf, 5) if rank == 0 else t.recv(0, buf, 5)
                while not req.done():
                    time.sleep(1e-4)
                t.close()
                return [int(buf.min()), int(buf.max())]

        peers = [Peer.remote() for _ in range(2)]
        out["actors"] = ray.get([p.run.remote(r) for r, p in enumerate(peers)], timeout=120)
        s.set("driver/said", b"hello")
        address = ray.get_runtime_context().gcs_address
        proc = subprocess.run([sys.executable, "-c", OUTSIDE, address], capture_output=True,
                              text=True, timeout=120)
        out["outside_rc"], out["outside_err"] = proc.returncode, proc.stderr[-2000:]
        out["outside_said"] = s.get("outside/said", 5).decode() if proc.returncode == 0 else None
    finally:
        ray.shutdown()
    try:
        wb.RayStore()
        out["after_shutdown"] = "made"
    except TransferError as e:
        out["after_shutdown"] = str(e)
    print(json.dumps(out, default=lambda b: b.decode()))


def _refused(store, key: str) -> bool:
    from wb.errors import TransferError

    try:
        store.get(key, 0.05)
    except TransferError:
        return True
    return False


if __name__ == "__main__":
    main(sys.argv[1])
