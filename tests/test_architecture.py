"""The house rules, checked: imports point down the layers (import-linter's contracts in
pyproject.toml), no module reaches into another's private names, the shims use only the core's
public API, the library never loads a framework, no module is over 500 lines, no public function
takes a private parameter, and the code says what is, not what was."""

import ast
import importlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("wb", "wb_torch", "wb_jax", "wb_vllm")
LONG_LINES = 500  # no module is longer: split it by concern
SHIMS = ("wb_torch", "wb_jax", "wb_vllm")
#: The core's modules the shims may import (each name they take must be in its ``__all__``): the
#: top-level API, and the public modules a framework adapter builds on.
PUBLIC_MODULES = ("wb", "wb.errors", "wb.data.dtypes", "wb.algorithms.probing",
                  "wb.algorithms.probing.idcode", "wb.runtime.engine.dlpack", "wb.layouts",
                  "wb.testing")
#: Words that tell history, not what is (checked over the packages' sources).
HISTORY = re.compile(r"issue [0-9]|session [0-9]|as before", re.IGNORECASE)


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
    src = ("import wb.runtime.engine.executor\nimport wb_jax as wj\n"
           "from wb.runtime.engine import executor\n"
           "from wb.runtime.engine.executor import _as_array, __all__\n"
           "from ucxx._lib import libucxx\nwj._leaves(1)\nexecutor._check_buffers\n"
           "wb.runtime.engine.executor._schedule\nexecutor.Sender._x\n_own = 1\n"
           "libucxx._private\n")
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
from wb.data.dtypes import dtype_info
bf16 = dtype_info("bfloat16").numpy
src = np.arange(16, dtype=np.float32).reshape(4, 4).astype(bf16)
out = wb.run_local(p, {0: {"w": src}}, {1: {"x": np.zeros((4, 3), src.dtype)}})
assert (out[1]["x"] == src[:, 1:]).all()
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "jax", "jaxlib", "ray"))))
"""


def test_the_library_loads_neither_torch_nor_jax():
    library = [m for m in MODULES if m.split(".")[0] == "wb" and not m.startswith("wb.cli")
               and m != "wb.__main__"]
    out = subprocess.run([sys.executable, "-c", FRAMEWORK_FREE, json.dumps(library)], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [], out.stdout


def test_no_module_is_over_500_lines():
    long = [f"{path.relative_to(ROOT)}: {n} lines" for path in MODULES.values()
            if (n := len(path.read_text().splitlines())) > LONG_LINES]
    assert not long, f"modules over {LONG_LINES} lines (split them by concern):\n" + "\n".join(long)


def test_the_code_says_what_is_not_what_was():
    found = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}" for path in MODULES.values()
             for i, line in enumerate(path.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not found, "history in the code (say what is):\n" + "\n".join(found)


def _signatures(source: str, where: str) -> list[tuple[str, list[str]]]:
    """``(qualified name, parameter names)`` of every public function and every public method of
    a public class in ``source`` (``__init__`` counts as public)."""
    out = []

    def params(fn):
        a = fn.args
        return [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)] + [
            x.arg for x in (a.vararg, a.kwarg) if x is not None]
    for node in ast.parse(source, filename=where).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _private(node.name):
            out.append((node.name, params(node)))
        elif isinstance(node, ast.ClassDef) and not _private(node.name):
            for item in node.body:
                if (isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                        and (not item.name.startswith("_") or item.name == "__init__")):
                    out.append((f"{node.name}.{item.name}", params(item)))
    return out


def test_no_public_function_takes_a_private_parameter():
    found = [f"{path.relative_to(ROOT)}: {name}({p})"
             for path in MODULES.values()
             for name, ps in _signatures(path.read_text(), str(path)) for p in ps
             if p.startswith("_")]
    assert not found, "public signatures with private parameters:\n" + "\n".join(found)


def test_the_signature_check_sees_methods_and_functions():
    src = ("def f(a, _b): ...\ndef _g(_c): ...\nclass C:\n    def __init__(self, _d): ...\n"
           "    def m(self, *, _e=1): ...\n    def _n(self, _f): ...\nclass _D:\n"
           "    def m(self, _g): ...\n")
    got = [(n, p) for n, ps in _signatures(src, "x.py") for p in ps if p.startswith("_")]
    assert got == [("f", "_b"), ("C.__init__", "_d"), ("C.m", "_e")]


def _core_imports(source: str, where: str) -> list[tuple[int, str, str | None]]:
    """``(line, module, name)`` of every import of a ``wb`` module in ``source`` (``name`` None
    for ``import m``), and ``(line, module, attribute)`` of ``wb.x.y`` attribute chains."""
    tree = ast.parse(source, filename=where)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "wb"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "wb":
            out += [(node.lineno, node.module, a.name) for a in node.names]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
              and id(node) not in inner):  # the whole chain, once
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id == "wb" and len(chain) >= 2:
                out.append((node.lineno, ".".join(["wb", *chain[:-1]]), chain[-1]))
    return out


def _outside_public_api(module: str, name: str | None) -> str | None:
    """Why ``from module import name`` (or ``import module``) is not public core API, or None."""
    if module not in PUBLIC_MODULES:
        if name is not None and f"{module}.{name}" in PUBLIC_MODULES:
            return None  # `from wb.algorithms import probing`
        if any(module.startswith(f"{m}.") for m in PUBLIC_MODULES) and f"{module}" not in MODULES:
            return None  # an attribute chain through a public module (`wb.layouts.x.y`)
        return f"module {module} is not one of the public modules {PUBLIC_MODULES}"
    if name is None or f"{module}.{name}" in PUBLIC_MODULES:
        return None
    public = getattr(importlib.import_module(module), "__all__", ())
    return None if name in public else f"{name} is not in {module}.__all__"


def test_the_shims_use_only_the_core_s_public_api():
    found = []
    for mod, path in MODULES.items():
        if mod.split(".")[0] not in SHIMS:
            continue
        for line, module, name in _core_imports(path.read_text(), str(path)):
            why = _outside_public_api(module, name)
            if why:
                found.append(f"{path.relative_to(ROOT)}:{line}: {module} {name or ''}: {why}")
    assert not found, "the shims reach past the core's public API:\n" + "\n".join(found)


def test_the_public_api_check_is_not_vacuous():
    src = ("import wb\nfrom wb.data.sourcemap import Runs\nfrom wb.data.dtypes import CODES\n"
           "from wb.algorithms import probing\nwb.data.layout.Role\nwb.SourceMap\n")
    got = [(line, _outside_public_api(m, n) is not None)
           for line, m, n in _core_imports(src, "x.py")]
    assert got == [(1, False), (2, True), (3, False), (4, False), (5, True)], got
