"""What the command line prints fits an 80-column terminal and carries no UCX warnings.

`python -m wb demo` and `python -m wb bench --quick` take too long for a unit test; their tables
were fitted by hand (`COLUMNS=80 python -m wb demo`), and tests/test_demo.py checks the demo's
processes print no UCX warning."""

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("columns", [80, 200])
def test_plan_fits_80_columns(columns):
    """At 80 columns nothing is wider; at 200 still nothing is (the tables' natural width fits, so
    rich never has to squeeze them), and no cell is cut short with an ellipsis."""
    env = dict(os.environ, COLUMNS=str(columns))
    out = subprocess.run([sys.executable, "-m", "wb", "plan", "--preset", "tiny"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = (out.stdout + out.stderr).splitlines()
    assert any("traffic / lower bound" in line for line in lines), out.stdout
    wide = [line for line in lines if len(line) > 80]
    assert not wide, f"{len(wide)} lines wider than 80 columns, e.g.\n{wide[0]}"
    assert not [line for line in lines if "…" in line], out.stdout
    assert "UCX_WARN" not in out.stdout + out.stderr
