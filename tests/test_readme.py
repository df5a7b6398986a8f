"""The README's first Python example runs as written."""

import pathlib
import re


def test_readme_example_runs():
    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["maps"]["shard"].nnz == 4
    assert scope["corr"].overlaps().src_slot.size == 1
