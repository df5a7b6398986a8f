"""`wb` is framework-free: importing it (and its algorithms) never imports torch or jax."""

import subprocess
import sys

CODE = """
import sys
import numpy as np
import wb, wb.data.correspondence, wb.algorithms.probe, wb.layouts.presets, wb.cli.demo.runner, wb.testing, wb.__main__, wb.algorithms.planner, wb.algorithms.simulate
import wb.layouts.deployments, wb.runtime.executor, wb.runtime.rendezvous, wb.runtime.transport.ucx, wb.runtime.transport.local, harness.multiproc
spec = wb.CheckpointSpec({"w": ((4, 4), "bfloat16")})
maps = wb.probe(spec, lambda ck: {"x": np.asarray(ck["w"])[:, 1:]})
lay = lambda r, role: wb.Layout(wb.Worker(r, "n", role), {"x": wb.BufferSpec(maps["x"], "bfloat16")})
wb.correspond([lay(0, "trainer")], [lay(1, "rollout")])
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "jax", "jaxlib")))
"""


def test_wb_imports_neither_torch_nor_jax():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_no_import_statement_of_a_framework_in_the_core():
    import pathlib
    import re

    import wb
    root = pathlib.Path(wb.__file__).parent
    pattern = re.compile(r"^\s*(import|from)\s+(torch|jax)\b", re.M)
    offenders = [str(p) for p in root.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
