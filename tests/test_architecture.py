"""The house rules, checked: imports point down the layers (import-linter's contracts in
pyproject.toml), no module reaches into another's private names, the library never loads a
framework, and a module over 500 lines says why at its top."""

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("wb", "wb_torch", "wb_jax")
LONG_LINES = 500  # a module longer than this says why in its docstring's first lines ...
LONG_REASON = "Long because"  # ... in a line with these words ("Long because it is one table")
LONG_HEAD = 5  # ... within the docstring's first LONG_HEAD lines


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the three packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _first_party(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def test_import_linter_contracts_are_kept():
    """`lint-imports` (as .ci/run runs it): layers, no framework in the library, no circles."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or \
        shutil.which("lint-imports")
    assert exe, "lint-imports not found: install the test extra (pip install -e '.[test]')"
    out = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, f"import-linter found a broken contract:\n{out.stdout}{out.stderr}"
    assert "0 broken" in out.stdout, out.stdout


def _private_uses(module: str, source: str, where: str) -> list[str]:
    """`from M import _x` and `m._x` (m an imported module) in ``source``, the text of ``module``
    (file ``where``), where M, m is another first-party module; each as 'where:line: what'."""
    tree = ast.parse(source, filename=where)
    package = module if where.endswith("__init__.py") else module.rpartition(".")[0]
    found, aliases = [], {}  # aliases: a name bound by an import -> the module it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    aliases[a.asname] = a.name
                else:
                    aliases[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                up = package.split(".")
                up = up[:len(up) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:
                if f"{base}.{a.name}" in MODULES:  # `from wb.runtime import executor`
                    aliases[a.asname or a.name] = f"{base}.{a.name}"
                elif _private(a.name) and _first_party(base) and base != module:
                    found.append(f"{where}:{node.lineno}: `from {base} import {a.name}` takes a "
                                 f"private name of another module")
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        chain, value = [], node.value
        while isinstance(value, ast.Attribute):
            chain.insert(0, value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in aliases:
            target = ".".join([aliases[value.id], *chain])
            if target in MODULES and target != module:
                found.append(f"{where}:{node.lineno}: `{ast.unparse(node)}` uses a private name "
                             f"of module {target}")
    return sorted(found, key=lambda f: int(f.split(":")[1]))


def test_no_module_uses_another_modules_private_names():
    """A private (`_underscore`) name is its module's own: another module that needs it needs a
    public function (or the helper belongs lower down, where both can import it)."""
    found = [f for module, path in MODULES.items()
             for f in _private_uses(module, path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_the_private_name_check_sees_both_forms():
    """The check above is not vacuous: both ways of reaching in are reported, with file and line;
    dunder names, a module's own names and names of outside packages are not."""
    src = ("import wb.runtime.executor\nimport wb_jax as wj\nfrom wb.runtime import executor\n"
           "from wb.runtime.executor import _as_array, __all__\nfrom ucxx._lib import libucxx\n"
           "wj._leaves(1)\nexecutor._check_buffers\nwb.runtime.executor._schedule\n"
           "executor.Sender._x\n_own = 1\nlibucxx._private\n")
    found = _private_uses("wb.cli.example", src, "wb/cli/example.py")
    assert [f.split(":")[1] for f in found] == ["4", "6", "7", "8"], found
    assert "_as_array" in found[0] and "wb_jax" in found[1]


# Imports every library module (all of wb but the command line) and runs a small probe -> plan ->
# transfer; prints the framework modules that got loaded.
FRAMEWORK_FREE = """
import importlib, json, sys
import numpy as np
import wb
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
spec = wb.CheckpointSpec({"w": ((4, 4), "bfloat16")})
maps = wb.probe(spec, lambda ck: {"x": np.asarray(ck["w"])[:, 1:]})
full = wb.probe(spec, lambda ck: {"w": np.asarray(ck["w"])})
t = wb.Layout(wb.Worker(0, "n0", "trainer"), {"w": wb.BufferSpec(full["w"], "bfloat16")})
r = wb.Layout(wb.Worker(1, "n1", "rollout"), {"x": wb.BufferSpec(maps["x"], "bfloat16")})
p = wb.plan([t], [r])
p.verify()
bf16 = wb.dtypes.dtype_info("bfloat16").numpy
src = np.arange(16, dtype=np.float32).reshape(4, 4).astype(bf16)
out = wb.run_local(p, {0: {"w": src}}, {1: {"x": np.zeros((4, 3), src.dtype)}})
assert (out[1]["x"] == src[:, 1:]).all()
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "jax", "jaxlib"))))
"""


def test_the_library_loads_neither_torch_nor_jax():
    library = [m for m in MODULES if m.split(".")[0] == "wb" and not m.startswith("wb.cli")
               and m != "wb.__main__"]
    out = subprocess.run([sys.executable, "-c", FRAMEWORK_FREE, json.dumps(library)], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [], out.stdout


def test_a_long_module_says_why_at_its_top():
    long = []
    for path in MODULES.values():
        n = len(path.read_text().splitlines())
        if n > LONG_LINES:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            if not any(LONG_REASON in line for line in doc.splitlines()[:LONG_HEAD]):
                long.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not long, (f"modules over {LONG_LINES} lines without a line '{LONG_REASON} ...' in the "
                      f"first {LONG_HEAD} lines of their docstring (split them, or say why they "
                      f"are one module):\n" + "\n".join(long))
