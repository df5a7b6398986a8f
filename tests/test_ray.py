"""wb.RayStore: driver, actors and a process outside Ray meet through Ray's own key-value store
(a local cluster of 2 CPUs started by the test, its temp dir and auth token in the test's
temporary directory)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _ray_env(work: str) -> dict:
    """The environment of a process that starts a Ray cluster: its auth token (under $HOME) and
    temp dir (under $TMPDIR) in ``work``."""
    return {**os.environ, "HOME": work, "TMPDIR": work, "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.timeout(240)
def test_driver_actors_and_an_outside_process_meet_through_ray_store():
    import tempfile

    # Ray's socket paths must stay under 108 bytes: a short folder of our own, removed after
    with tempfile.TemporaryDirectory(prefix="wbray", dir="/tmp") as work:
        home_token = Path.home() / ".ray" / "auth_token"
        had_token = home_token.exists()
        out = subprocess.run([sys.executable, "-m", "harness.ray_store", work], cwd=TESTS,
                             env=_ray_env(work), capture_output=True, text=True, timeout=230)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        r = json.loads(out.stdout.strip().splitlines()[-1])
        assert Path(work, ".ray", "auth_token").exists() and home_token.exists() == had_token
    # a 5 MiB value in 1 MiB chunks, back whole; keys overwritten; a missing key times out
    assert r["chunks"] == 5 and r["big_round_trip"] is True and r["overwritten"] == "2"
    assert "`missing` was not published within 0.3 s" in r["missing"]
    assert 0.3 <= r["missing_waited_s"] < 2.0
    assert r["other_namespace_empty"] is True
    # two actors found each other's UCX addresses there and moved bytes
    assert r["actors"] == [[7, 7], [7, 7]]
    # a process outside Ray that joined the cluster by its address read and wrote keys
    assert r["outside_rc"] == 0, r["outside_err"]
    assert r["outside_said"] == "hello and back"
    # a store needs a cluster joined: a clear error after ray.shutdown()
    assert "has not joined a Ray cluster" in r["after_shutdown"]


@pytest.mark.timeout(240)
def test_the_ray_rl_loop_example_verifies_every_version_and_a_restarted_actor_rejoins():
    """examples/ray_rl_loop.py: a JAX trainer actor, two PyTorch rollout actors, one killed
    mid-run and restarted by Ray; every version each rollout applied is bit-identical to its own
    load of the trainer's weights, the restarted one is back within two versions of its join,
    its maps read from the cache its first start wrote."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="wbray", dir="/tmp") as work:
        home_token = Path.home() / ".ray" / "auth_token"
        had_token = home_token.exists()
        out = subprocess.run([sys.executable, str(ROOT / "examples" / "ray_rl_loop.py"),
                              "--versions", "7", "--step-s", "1.5", "--json"], cwd=work,
                             env=_ray_env(work), capture_output=True, text=True, timeout=230)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert home_token.exists() == had_token
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["verified"] is True
    assert r["applied"]["1"] == list(range(1, 8))  # the survivor: every version
    back = r["restart"]
    assert back["restarted"] is True and back["maps_from_cache"] is True
    assert back["killed_after_version"] >= 2 and back["versions_behind"] <= 2
    # the restarted rollout: what it applied before the kill, then every version from its return
    got = r["applied"]["2"]
    assert got[:2] == [1, 2] and got[-(8 - back["first_version_back"]):] == \
        list(range(back["first_version_back"], 8))
