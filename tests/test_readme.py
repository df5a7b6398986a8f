"""The README says what is true: its commands are the ones CI runs, its code compiles (the first
example runs), every ``wb`` / ``wb_torch`` / ``wb_jax`` name it mentions exists, it stays short and
points at nothing outside the repository."""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "README.md").read_text()
LINES = TEXT.splitlines()

# The two quick-start lines, verbatim: CI runs the second and the task's checks rely on both.
QUICK_START = [
    "pip install torch==2.13.0 -e '.[torch,jax,ucx]' && python -m wb demo              # the main job",
    "pip install torch==2.13.0 -e '.[torch,jax,test,bench]' && python -m pytest        # the whole test suite",
]


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", TEXT, re.S | re.M)


def test_short():
    assert len(LINES) <= 220, f"README.md has {len(LINES)} lines; keep it <= 220 (move detail to " \
                              f"bench/RESULTS.md or CHANGELOG.md)"


def test_quick_start_lines_exact():
    section = TEXT.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    bash = re.findall(r"^```bash\n(.*?)^```", section, re.S | re.M)
    assert bash, "the Quick start section has no ```bash block"
    assert bash[0].splitlines() == QUICK_START


def test_ci_runs_the_readme_test_command():
    command = QUICK_START[1].split("#")[0].strip()
    assert command in (ROOT / ".ci" / "run").read_text()


def test_python_blocks_compile():
    blocks = _blocks("python")
    assert blocks
    for i, code in enumerate(blocks):
        compile(code, f"README.md python block {i}", "exec")  # SyntaxError names the block


def test_first_example_runs():
    scope: dict = {}
    exec(compile(_blocks("python")[0], "README.md", "exec"), scope)  # it asserts its own results
    assert scope["maps"]["shard"].to_indices().tolist() == [[3, 9, 15, 21], [4, 10, 16, 22],
                                                            [5, 11, 17, 23]]
    assert (scope["shard"] == scope["w"][:, 3:].T).all()


def test_nothing_outside_the_repository():
    bad = [(i + 1, line) for i, line in enumerate(LINES)
           if "../" in line or "://" in line or "/work/" in line]
    assert not bad, f"README lines point outside the repository: {bad}"
    for target in re.findall(r"\]\(([^)#]+)", TEXT):
        assert (ROOT / target).exists(), f"README links to `{target}`, which is not in the repository"


def _resolve(dotted: str):
    """The object a dotted name such as ``wb.layouts.presets.spec_from_config`` names."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        if not hasattr(obj, part):
            importlib.import_module(".".join(parts[:i + 1]))  # a submodule not imported yet
        obj = getattr(obj, part)
    return obj


NAMES = sorted(set(re.findall(r"(?<![\w.])((?:wb|wb_torch|wb_jax)(?:\.[A-Za-z_]\w*)+)", TEXT)))


@pytest.mark.parametrize("name", NAMES)
def test_named_api_exists(name):
    if name.startswith("wb_torch"):
        pytest.importorskip("torch")
    if name.startswith("wb_jax"):
        pytest.importorskip("jax")
    try:
        _resolve(name)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"README.md mentions `{name}`, which does not exist: {e}")


def test_shim_names_in_examples_exist():
    """``wb_torch.X`` in the README's text is checked above; the shims mirror each other, so a
    function the README names bare (``layouts(...)``, ``checkpoint_layouts(...)``) exists in both."""
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    import wb_jax
    import wb_torch
    for name in ("probe", "layouts", "checkpoint_layouts", "buffers", "Sender", "Receiver",
                 "to_numpy", "from_numpy"):
        assert hasattr(wb_torch, name) and hasattr(wb_jax, name), name
