"""An experiment, not a bench: NIXL (``nixl-cu13``) one-sided WRITEs between two processes of
this host, ``N`` descriptors of ``SIZE`` bytes (shuffled, so NIXL cannot merge neighbours)
prepared once and run by one ``transfer`` call; prints one JSON line (``again_s``: the second run
of the prepared transfer, what a version would cost). Needs ``pip install nixl-cu13``.

    N=10000 SIZE=8192 python bench/results/nixl/write_descriptors.py
"""
import os, sys, time, json, pathlib
import multiprocessing as mp
import numpy as np

N, SIZE = int(os.environ.get("N", 10000)), int(os.environ.get("SIZE", 8192))
D = pathlib.Path(os.environ.get("NIXL_DIR", "/tmp/wb-nixl")); D.mkdir(parents=True, exist_ok=True)

def wait_file(p):
    while not p.exists(): time.sleep(0.001)
    time.sleep(0.01)
    return p.read_bytes()

def target():
    from nixl_cu13 import nixl_agent, nixl_agent_config
    ag = nixl_agent("target", nixl_agent_config(backends=["UCX"]))
    buf = np.zeros(N * SIZE, np.uint8)
    reg = ag.register_memory(np.array([[buf.ctypes.data, buf.nbytes, 0]], np.uint64), "DRAM")
    (D / "target.meta").write_bytes(ag.get_agent_metadata())
    (D / "target.addr").write_text(json.dumps([buf.ctypes.data, N * SIZE]))
    t0 = None
    while True:
        notifs = ag.get_new_notifs()
        if "initiator" in notifs and notifs["initiator"]:
            break
        time.sleep(0)
    ok = bool((buf.reshape(N, SIZE)[:, 0] == (np.arange(N) % 251 + 1)).all())
    (D / "target.done").write_text(json.dumps({"ok": ok}))
    wait_file(D / "initiator.done")

def initiator():
    from nixl_cu13 import nixl_agent, nixl_agent_config
    ag = nixl_agent("initiator", nixl_agent_config(backends=["UCX"]))
    src = np.zeros((N, SIZE), np.uint8)
    src[:, 0] = np.arange(N) % 251 + 1
    reg = ag.register_memory(np.array([[src.ctypes.data, src.nbytes, 0]], np.uint64), "DRAM")
    remote = ag.add_remote_agent(wait_file(D / "target.meta"))
    addr, total = json.loads(wait_file(D / "target.addr"))
    t0 = time.perf_counter()
    k = np.arange(N, dtype=np.uint64)
    ld = np.stack([src.ctypes.data + k * SIZE, np.full(N, SIZE, np.uint64), np.zeros(N, np.uint64)], 1)
    rd = np.stack([addr + k * SIZE, np.full(N, SIZE, np.uint64), np.zeros(N, np.uint64)], 1)
    local = ag.get_xfer_descs(ld, "DRAM")
    rdescs = ag.get_xfer_descs(rd, "DRAM")
    lp = ag.prep_xfer_dlist("", local, "DRAM")
    rp = ag.prep_xfer_dlist(remote if isinstance(remote, str) else remote.decode(), rdescs, "DRAM")
    t1 = time.perf_counter()
    idx = np.random.default_rng(0).permutation(N)  # shuffled: adjacent descriptors are merged
    h = ag.make_prepped_xfer("WRITE", lp, idx, rp, idx, b"done")
    t2 = time.perf_counter()
    st = ag.transfer(h)
    while True:
        st = ag.check_xfer_state(h)
        if st == "DONE": break
        if st == "ERR": raise SystemExit("xfer error")
    t3 = time.perf_counter()
    # again, the handle prepared once: what a version costs
    t4 = time.perf_counter()
    ag.transfer(h)
    while ag.check_xfer_state(h) != "DONE": pass
    t5 = time.perf_counter()
    res = json.loads(wait_file(D / "target.done"))
    print(json.dumps({"N": N, "SIZE": SIZE, "prep_s": t1 - t0, "make_s": t2 - t1, "first_s": t3 - t2,
                      "again_s": t5 - t4, "us_per_desc_again": (t5 - t4) / N * 1e6,
                      "GBps_again": N * SIZE / (t5 - t4) / 1e9, "ok": res["ok"]}))
    (D / "initiator.done").write_text("1")

if __name__ == "__main__":
    for f in D.glob("*"): f.unlink()
    os.environ.pop("UCX_RNDV_THRESH", None)
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=target); p.start()
    initiator()
    p.join(30)
