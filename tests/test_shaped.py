"""ShapedTransport holds messages back as the emulated links would (lower bounds only: a slow
machine can only make it slower), and delivers the bytes unchanged."""

import time

import numpy as np

from wb.runtime.transport.local import LocalHub, LocalTransport
from wb.cli.bench.shaped import ShapedTransport

GPUS = {0: ("a", 0), 1: ("b", 0), 2: ("c", 0), 3: ("a", 1), 4: ("a", 0)}
NIC, NVL = 2e6, 2e7  # bytes/s


def _t(rank, hub):
    return ShapedTransport(LocalTransport(rank, hub), gpu_of=GPUS, nic_Bps=NIC, nvlink_Bps=NVL)


def _wait(reqs):
    for r in reqs:
        while not r.done():
            time.sleep(1e-4)


def _flow(hub, src, dst, n, count, out, tag0=0):
    s, d = _t(src, hub), _t(dst, hub)
    bufs = [np.full(n, i % 251, np.uint8) for i in range(count)]
    got = [np.zeros(n, np.uint8) for _ in range(count)]
    rr = [d.recv(src, got[i], tag0 + i) for i in range(count)]
    ss = [s.send(dst, bufs[i], tag0 + i) for i in range(count)]
    _wait(ss + rr)
    out.append(all(np.array_equal(a, b) for a, b in zip(bufs, got)))


def test_one_flow_runs_at_the_nic_rate_and_bytes_arrive():
    hub, out = LocalHub(), []
    t0 = time.monotonic()
    _flow(hub, 0, 1, 100_000, 4, out)
    assert out == [True]
    assert time.monotonic() - t0 >= 0.95 * 4 * 100_000 / NIC


def test_nvlink_is_faster_and_the_same_gpu_unshaped():
    hub, out = LocalHub(), []
    t0 = time.monotonic()
    _flow(hub, 0, 3, 100_000, 4, out)
    nvl = time.monotonic() - t0
    assert nvl >= 0.95 * 4 * 100_000 / NVL
    assert nvl < 4 * 100_000 / NIC  # well under the NIC time
    t0 = time.monotonic()
    _flow(hub, 0, 4, 100_000, 4, out, tag0=100)
    assert out == [True, True]


def test_two_senders_share_the_receivers_ingress():
    hub, n = LocalHub(), 100_000
    d = _t(0, hub)  # one receiving worker, one ingress link
    got = [np.zeros(n, np.uint8) for _ in range(6)]
    rr = [d.recv(1 + i % 2, got[i], i) for i in range(6)]
    t0 = time.monotonic()
    senders = {1: _t(1, hub), 2: _t(2, hub)}
    ss = [senders[1 + i % 2].send(0, np.full(n, i, np.uint8), i) for i in range(6)]
    _wait(ss + rr)
    # each sender alone needs 3 n / NIC; together they queue on the receiver's NIC
    assert time.monotonic() - t0 >= 0.95 * 6 * n / NIC
    assert all((g == i).all() for i, g in enumerate(got))


def test_link_stats_count_bytes_and_busy_time():
    hub, n = LocalHub(), 50_000
    s, d = _t(0, hub), _t(1, hub)
    got = [np.zeros(n, np.uint8) for _ in range(3)]
    rr = [d.recv(0, got[i], i) for i in range(3)]
    ss = [s.send(1, np.full(n, i, np.uint8), i) for i in range(3)]
    _wait(ss + rr)
    out, into = s.link_stats()["out/nic"], d.link_stats()["in/nic"]
    assert set(s.link_stats()) == {"out/nic"} and set(d.link_stats()) == {"in/nic"}
    for st in (out, into):
        assert st["bytes"] == 3 * n
        assert abs(st["busy_s"] - 3 * n / NIC) < 1e-9
        assert st["span_s"] >= st["busy_s"] - 1e-9
        assert abs(st["last"] - st["first"] - st["span_s"]) < 1e-6
    s.link_stats(reset=True)
    assert s.link_stats() == {}
