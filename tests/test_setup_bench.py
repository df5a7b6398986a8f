"""`python -m wb plan --preset NAME --setup`: the set-up through a real store, every rank here."""

import json
import subprocess
import sys

from wb.cli.plan import run_setup


def test_setup_report_counts_every_byte_through_the_store():
    r = run_setup("tiny", sample=3, quiet=True)
    for k in ("layouts_bytes", "store_bytes_total", "max_rank_part_bytes",
              "max_rank_part_load_s", "coordinator_s"):
        assert k in r
    # the store holds the layouts once and the parts once, nothing else
    assert r["store_bytes_total"] == r["layouts_bytes"] + r["parts_bytes"]
    assert r["mean_rank_part_bytes"] <= r["max_rank_part_bytes"] < r["parts_bytes"]
    assert len(r["sampled_ranks"]) == 3 and r["ranks"] == 8


def test_setup_command_prints_json_last():
    out = subprocess.run([sys.executable, "-m", "wb", "plan", "--preset", "tiny", "--setup",
                          "--json"], capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["preset"] == "tiny" and report["max_rank_part_bytes"] > 0
