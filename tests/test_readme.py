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


def test_readme_layout_tables_name_every_module_and_only_real_ones():
    """Every file the README's layout tables name exists, and every module of the package is named."""
    src = ROOT / "src" / "lmlab"
    section = README.split("## The design, one file per axis")[1].split("The central contrast")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`" in line]
    named: set[str] = set()
    for row in rows:
        cells = row.strip("|").split("|")
        folders = [n for n in re.findall(r"`([\w]+/)`", cells[0])]  # a layer row: `run/`, `experiments/`
        folder = folders[0] if folders else ""
        for name in re.findall(r"`([\w/.]+)`", cells[-1]):
            if name.endswith("/"):
                named.add(name.rstrip("/"))
            elif name.endswith(".py"):
                named.add(folder + name)
    for name in named:
        assert (src / name).exists(), f"README names {name}, which is not in src/lmlab"
    modules = {str(p.relative_to(src)) for p in src.rglob("*.py") if p.name != "__init__.py"}
    modules = {m for m in modules if not m.startswith("hf/")} | {"hf"}
    missing = sorted(m for m in modules if m not in named)
    assert not missing, f"modules missing from the README's layout tables: {missing}"
