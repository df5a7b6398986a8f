"""`python -m wb bench --quick --json`: all three methods run between processes over UCX, come out
bit-identical, and the report has the fields the README and DESIGN promise. No speed asserts:
ratios are the benchmark's to report, not a test's (shared, noisy machines)."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("ucxx")


@pytest.mark.timeout(400)
def test_bench_quick_json():
    out = subprocess.run([sys.executable, "-m", "wb", "bench", "--quick", "--json",
                          "--replicas", "1", "4"], capture_output=True, text=True, timeout=380)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["verified"] is True
    for key in ("speedup_vs_broadcast", "speedup_vs_p2p", "ewtt_over_ideal"):
        assert r[key] > 0
    assert set(r["agst_s"]) >= {"sync", "sender", "receiver", "both", "broadcast (synchronous)"}
    four = r["by_replicas"]["4"]
    assert set(four["ewtt_s"]) == {"wb", "p2p", "broadcast"} and four["traffic_ratio"] == 1.0
    assert four["measured_nic_MBps"] > 0 and four["ideal_s"] > 0
    # every method's emulated links: the busiest trainer NIC carried its share, busy <= its span
    for method in ("wb", "p2p", "broadcast"):
        out_nic = four["link_usage"][method]["out/nic"]
        assert 0 < out_nic["busiest_busy_s"] <= out_nic["busiest_span_s"] + 1e-6
