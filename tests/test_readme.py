"""The README's Python examples run as written (blocks that start with ``# needs:`` require files
a user would have and are skipped), and its test command is the one CI runs."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_python_block_runs(i):
    code = BLOCKS[i]
    if code.startswith("# needs:"):
        pytest.skip(code.splitlines()[0])
    exec(compile(code, f"README.md block {i}", "exec"), {})


def test_readme_has_runnable_examples():
    assert sum(not b.startswith("# needs:") for b in BLOCKS) >= 1


def test_ci_runs_the_readme_test_command():
    command = re.search(r"^(python -m pip install .*pytest)$", README, flags=re.M).group(1)
    assert command in (ROOT / ".ci" / "run").read_text()


def test_readme_quotes_the_two_norm_placement_lines_as_they_are_in_model_py():
    model_py = (ROOT / "src" / "lmlab" / "model.py").read_text()
    quoted = re.findall(r"^(?:pre|post)-norm\s+\(\w+\):\s+(.*)$", README, flags=re.M)
    assert len(quoted) == 2 and all(line in model_py for line in quoted)
