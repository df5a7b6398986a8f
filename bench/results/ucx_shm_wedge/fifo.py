"""Does a process killed mid-message wedge a receiver's UCX shared-memory queue for every peer?

Three processes on one host over ``wb.UcxTransport``: rank 0 streams 4 KiB messages to rank 1
until it is killed (SIGKILL, 50-300 ms in); then rank 2 sends rank 1 one message. A trial is
``STUCK`` when rank 1 has not received rank 2's message 5 s later.

    python bench/results/ucx_shm_wedge/fifo.py TRIALS [UCX_TLS]
"""

import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import time

import numpy as np


def worker(role, rank, store_dir, q, tls):
    from wb.runtime.rendezvous import DirectoryStore
    from wb.runtime.transport.ucx import UcxTransport

    t = UcxTransport(rank, DirectoryStore(store_dir), tls=tls, timeout=20)
    t.connect([0, 1, 2])
    q.put("ready")
    if role == "victim":
        buf, reqs = np.ones(4096, np.uint8), []
        for i in range(10**9):
            reqs.append(t.send(1, buf, i))
            if len(reqs) > 64:
                reqs = [r for r in reqs if not r.done()]
    elif role == "receiver":
        dst = np.zeros(16, np.uint8)
        r, t0 = t.recv(2, dst, 1 << 40), time.time()
        while not r.done():
            if time.time() - t0 > 5:
                q.put("STUCK")
                return
            time.sleep(0.001)
        q.put("ok" if dst[0] == 7 else "wrong bytes")
    else:
        while not os.path.exists(os.path.join(store_dir, "go")):
            time.sleep(0.001)
        r = t.send(1, np.full(16, 7, np.uint8), 1 << 40)
        while not r.done():
            time.sleep(0.001)
        time.sleep(6)


def main():
    trials, tls = int(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else None)
    ctx, res = mp.get_context("spawn"), []
    for _ in range(trials):
        d = tempfile.mkdtemp(prefix="wedge")
        q = ctx.Queue()
        ps = [ctx.Process(target=worker, args=(role, r, d, q, tls), daemon=True)
              for r, role in enumerate(["victim", "receiver", "sender"])]
        for p in ps:
            p.start()
        for _ in ps:
            q.get(timeout=60)
        time.sleep(random.uniform(0.05, 0.3))
        os.kill(ps[0].pid, signal.SIGKILL)
        time.sleep(0.05)
        open(os.path.join(d, "go"), "w").close()
        res.append(q.get(timeout=30))
        for p in ps:
            p.kill()
    from wb.runtime.transport.ucx import default_tls

    print(f"UCX_TLS={tls or default_tls()}: {trials} kills:",
          {k: res.count(k) for k in sorted(set(res))})


if __name__ == "__main__":
    main()
