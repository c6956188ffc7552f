"""The README and every page of docs/ run as written, and the README's test command is the one CI runs.

Python blocks are executed, each in a fresh namespace. Bash blocks run one command at a time (a line,
with its ``\\`` continuations), in order, through ``bash`` in one scratch directory per page; a command
that exits non-zero fails the test with the page, the command and the end of its output.

- A block whose first line is ``# needs: ...`` needs something a user would have and the test machine
  does not (a Hugging Face checkpoint, eight GPUs, other nodes, hours of CPU): it is skipped.
- A block of any language whose first line is ``# file: NAME`` (a run config, a sweep spec) is written
  to NAME in the page's scratch directory before the page's commands run, as a reader would save it.
- The scratch directory also holds the data a user brings (``USER_FILES``): ``my_corpus/`` (text
  files) and ``rows.jsonl`` (labelled rows).
- ``lmlab`` and ``torchrun`` are shell functions that run this checkout's lmlab with this Python.
- Every training command (``lmlab train``, ``torchrun ... -m lmlab.cli train``) gets ``QUICK``
  (2 steps, 1 evaluation batch, a 16-token sample) for each of those keys it does not set itself,
  so a documented run takes seconds, not minutes; its flags, keys, files and quoting are as written.
  ``lmlab sweep`` gets ``--quick`` (the spec's own smoke-test sizes) for the same reason.
- ``python -m pip install ... && CMD`` runs CMD only: installing is CI's job (``.ci/run``), and the
  test-suite command is not run from inside the test suite (``test_ci_runs_the_readme_test_command``).
- A ``torchrun`` line runs when it starts at most 2 processes on one node (gloo on CPU processes, as
  tests/test_distributed.py does) or no more than there are CUDA devices; otherwise it is skipped and
  named in the test's output. ``test_documented_torchrun_lines_set_a_grad_accum_their_processes_divide``
  checks every torchrun line, run or not.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmlab.run.config import renamed

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = {"README.md": README} | {f"docs/{p.name}": p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}
BLOCKS = [(page, i, code) for page, text in PAGES.items()
          for i, code in enumerate(re.findall(r"```python\n(.*?)```", text, flags=re.S))]
QUICK = {"train.steps": "2", "eval.batches": "1", "log.sample_tokens": "16"}
WORDS = ("the a model reads writes one word at time small first book next story cat sat on mat dog ran to park "
         "and then it was night morning light river stone tree house door window long short old new").split()
USER_FILES = {  # my_corpus/: 40 documents of 500 words, enough for a 512-token context in validation
    **{f"my_corpus/doc{i:02d}.{'md' if i % 5 == 0 else 'txt'}":
       " ".join(WORDS[(i * 7 + j * j * 13 + j // 3) % len(WORDS)] for j in range(500)) + "\n" for i in range(40)},
    "rows.jsonl": "".join(json.dumps({"text": f"{w} review number {i}", "label": {"good": "pos", "bad": "neg"}[w]})
                          + "\n" for i in range(60) for w in ("good", "bad")),
}
PRELUDE = """
set -euo pipefail
lmlab() { "$DOC_PYTHON" -m lmlab.cli "$@" $DOC_EXTRA; }
torchrun() { "$DOC_PYTHON" -m torch.distributed.run "$@" $DOC_EXTRA; }
"""


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def commands(block: str) -> list[str]:
    """The block's commands: comment-only and blank lines dropped, ``\\`` continuations joined."""
    out, pending = [], ""
    for line in block.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip() + " "
        else:
            out.append(pending)
            pending = ""
    return out


def documented_commands(text: str) -> list[str]:
    return [c for b in blocks(text, "bash") for c in commands(b)]


def words(command: str) -> list[str]:
    return shlex.split(command, comments=True)


def torchrun_processes(argv: list[str]) -> tuple[int, int]:
    """(processes per node, nodes) of a torchrun command line."""
    def value(*flags: str, default: str) -> str:
        for i, a in enumerate(argv):
            for f in flags:
                if a == f:
                    return argv[i + 1]
                if a.startswith(f + "="):
                    return a.split("=", 1)[1]
        return default
    return int(value("--nproc-per-node", "--nproc_per_node", default="1")), int(value("--nnodes", default="1"))


def is_training(argv: list[str]) -> bool:
    if argv[:2] == ["lmlab", "train"]:
        return True
    return argv[:1] == ["torchrun"] and "lmlab.cli" in argv and argv[argv.index("lmlab.cli") + 1:][:1] == ["train"]


def quick_extra(argv: list[str]) -> str:
    given = {renamed(a[2:].split("=")[0]) for a in argv if a.startswith("--")}  # old key names count as given
    if argv[:2] == ["lmlab", "sweep"]:
        return "" if "quick" in given else "--quick"
    return " ".join(f"--{k} {v}" for k, v in QUICK.items() if k not in given) if is_training(argv) else ""


def runnable(command: str) -> tuple[str | None, str]:
    """(the command to run, or None to skip it; why)."""
    if command.startswith("python -m pip install "):
        rest = command.split("&&", 1)[1].strip() if "&&" in command else ""
        if not rest or words(rest)[:3] == ["python", "-m", "pytest"]:
            return None, "installing is CI's job, and the test suite does not run itself"
        command = rest
    argv = words(command)
    if argv[:3] == ["python", "-m", "pytest"]:
        return None, "the test suite does not run itself"
    if argv[:1] == ["torchrun"]:
        per_node, nodes = torchrun_processes(argv)
        if nodes > 1 or per_node > max(2, torch.cuda.device_count()):
            return None, f"{per_node} processes on {nodes} node(s) cannot start here"
    return command, ""


def write_files(where: Path, text: str) -> None:
    for rel, content in USER_FILES.items():
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        (where / rel).write_text(content)
    for block in re.findall(r"```\w*\n(# file: (\S+)\n.*?)```", text, flags=re.S):
        (where / block[1]).parent.mkdir(parents=True, exist_ok=True)
        (where / block[1]).write_text(block[0])


# ============================================================== python blocks
@pytest.mark.parametrize("page, i, code", BLOCKS, ids=[f"{p}-{i}" for p, i, _ in BLOCKS])
def test_python_block_runs(page, i, code):
    if code.startswith("# needs:"):
        pytest.skip(code.splitlines()[0])
    exec(compile(code, f"{page} python block {i}", "exec"), {})


def test_every_page_has_runnable_examples():
    for page, text in PAGES.items():
        runnable_blocks = [b for lang in ("python", "bash") for b in blocks(text, lang) if not b.startswith("# needs:")]
        assert runnable_blocks or page == "docs/speed.md", f"{page} has no example that runs"


# ============================================================== bash lines
@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p, text in PAGES.items()
                                  if any(not b.startswith("# needs:") for b in blocks(text, "bash"))])
def test_shell_lines_run(page, tmp_path):
    text = PAGES[page]
    write_files(tmp_path, text)
    env = {**os.environ, "DOC_PYTHON": sys.executable, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    skipped = []
    for block in blocks(text, "bash"):
        if block.startswith("# needs:"):
            continue
        for command in commands(block):
            to_run, why = runnable(command)
            if to_run is None:
                skipped.append(f"{command}: {why}")
                continue
            done = subprocess.run(["bash", "-c", PRELUDE + to_run], cwd=tmp_path, capture_output=True, text=True,
                                  env={**env, "DOC_EXTRA": quick_extra(words(to_run))}, timeout=900)
            assert done.returncode == 0, (f"{page}: `{command}` exited {done.returncode}:\n"
                                          f"{(done.stdout + done.stderr)[-3000:]}")
    print("\n".join(f"not run: {s}" for s in skipped))


def test_documented_stop_strings_reach_lmlab_as_real_text():
    """``--stop "\\n\\n"`` hands lmlab backslash-n twice; the docs write ``$'\\n\\n'``, two newlines."""
    lines = [c for text in PAGES.values() for c in documented_commands(text) if "--stop" in c]
    assert lines, "no documented --stop line"
    for line in lines:
        argv = subprocess.run(["bash", "-c", "lmlab() { printf '%s\\0' \"$@\"; }\n" + line], capture_output=True,
                              text=True, check=True).stdout.split("\0")
        stops = [argv[i + 1] for i, a in enumerate(argv) if a == "--stop"]
        assert stops and all("\\" not in s for s in stops), f"`{line}` passes the stop strings {stops}"


def test_documented_torchrun_lines_set_a_grad_accum_their_processes_divide():
    """The trainer refuses train.grad_accum that is not a multiple of the processes (default 1)."""
    lines = [words(c) for text in PAGES.values() for c in documented_commands(text) if c.startswith("torchrun")]
    assert lines
    for argv in lines:
        if "--resume" in argv:
            continue  # the run's saved config holds it
        per_node, nodes = torchrun_processes(argv)
        accum = int(argv[argv.index("--train.grad_accum") + 1]) if "--train.grad_accum" in argv else 1
        assert accum % (per_node * nodes) == 0, f"{shlex.join(argv)}: grad_accum {accum}, {per_node * nodes} processes"


def test_relative_links_resolve_and_the_readme_maps_every_page():
    for page, text in PAGES.items():
        base = (ROOT / page).parent
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (base / target).exists(), f"{page} links to {target}, which does not exist"
    for page in PAGES:
        assert page == "README.md" or f"]({page})" in README, f"the README's map does not link {page}"


# ============================================================== what the docs quote from the code
def test_ci_runs_the_readme_test_command():
    command = re.search(r"^(python -m pip install .*pytest.*)$", README, flags=re.M).group(1)
    ci = (ROOT / ".ci" / "run").read_text()
    assert command in ci and "\npython -m pytest -m slow\n" in ci and "python -m pytest -m slow" in README


def test_design_page_quotes_the_two_norm_placement_lines_as_they_are_in_model_py():
    model_py = (ROOT / "src" / "lmlab" / "model.py").read_text()
    quoted = re.findall(r"^(?:pre|post)-norm\s+\(\w+\):\s+(.*)$", PAGES["docs/design.md"], flags=re.M)
    assert len(quoted) == 2 and all(line in model_py for line in quoted)


def test_design_page_layout_tables_name_every_module_and_only_real_ones():
    """Every file the layout tables name exists, and every module of the package is named."""
    src = ROOT / "src" / "lmlab"
    section = PAGES["docs/design.md"].split("## Every axis and its file")[1].split("The central contrast")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`" in line]
    named: set[str] = set()
    for row in rows:
        cells = row.strip("|").split("|")
        folders = re.findall(r"`([\w/]+/)`", cells[0])  # a layer row: `run/`, `run/data/`, `experiments/`
        folder = folders[0] if folders else ""
        for name in re.findall(r"`([\w/.]+)`", cells[-1]):
            if name.endswith("/"):
                named.add(name.rstrip("/"))
            elif name.endswith(".py"):
                named.add(folder + name)
    for name in named:
        assert (src / name).exists(), f"docs/design.md names {name}, which is not in src/lmlab"
    modules = {str(p.relative_to(src)) for p in src.rglob("*.py") if p.name != "__init__.py"}
    modules = {m for m in modules if not m.startswith("hf/")} | {"hf"}
    missing = sorted(m for m in modules if m not in named)
    assert not missing, f"modules missing from docs/design.md's layout tables: {missing}"


# ============================================================== the offline lm-eval task of docs/export.md
@pytest.mark.slow  # lm_eval in its own process: ~16 s of CPU
def test_the_documented_lm_eval_task_is_local_and_runs_where_lm_eval_is_installed(tmp_path):
    """docs/export.md's local task: a well-formed lm-evaluation-harness task YAML that reads the JSONL its next
    line writes (no download), named by the lm_eval line that runs it; the lm_eval line itself runs where
    lm_eval is installed (not in lmlab's test environment: there it is skipped, saying so)."""
    import importlib.util

    import yaml

    text = PAGES["docs/export.md"]
    write_files(tmp_path, text)
    task = yaml.safe_load((tmp_path / "tasks" / "lmlab_local.yaml").read_text())
    assert task["dataset_path"] == "json" and task["output_type"] == "loglikelihood_rolling"
    assert {m["metric"] for m in task["metric_list"]} == {"word_perplexity", "byte_perplexity", "bits_per_byte"}
    data = task["dataset_kwargs"]["data_files"][task["test_split"]]
    write = next(c for b in blocks(text, "bash") for c in commands(b) if c.startswith("printf") and data in c)
    subprocess.run(["bash", "-c", write], cwd=tmp_path, check=True)
    rows = [json.loads(line) for line in (tmp_path / data).read_text().splitlines()]
    field = re.fullmatch(r"\{\{\s*(\w+)\s*\}\}", task["doc_to_target"]).group(1)
    assert len(rows) == 2 and all(isinstance(r[field], str) and r[field] for r in rows)
    lm_eval = next(c for b in blocks(text, "bash") for c in commands(b) if c.startswith("lm_eval "))
    argv = words(lm_eval)
    assert argv[argv.index("--include_path") + 1] == str(Path(data).parent) == "tasks"
    assert argv[argv.index("--tasks") + 1] == task["task"] and "pip install 'lm_eval[hf]'" in text
    if importlib.util.find_spec("lm_eval") is None:
        pytest.skip("lm_eval is not installed here (pip install 'lm_eval[hf]'); its task file and data are checked")
    env = {**os.environ, "DOC_PYTHON": sys.executable, "DOC_EXTRA": "", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1",  # lm_eval asks the hub about the local model and task otherwise: no network here
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           # the lm_eval script installed beside this interpreter, even when its environment is not activated
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    model = lmlab_tiny_export(tmp_path / "exported" / "mine")
    assert model.is_dir()
    done = subprocess.run(["bash", "-c", lm_eval], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0 and "bits_per_byte" in done.stdout, (done.stdout + done.stderr)[-3000:]


def lmlab_tiny_export(out: Path) -> Path:
    """A tiny byte-level llama with its tokenizer, exported as docs/export.md's `lmlab export` line would."""
    import lmlab
    from lmlab.run.data.tokenizer import ByteTokenizer

    model = lmlab.Transformer(lmlab.ModelConfig.from_preset("llama", d_model=32, n_layers=1, n_heads=2,
                                                             vocab_size=256))
    return lmlab.to_hf(model, out, ByteTokenizer()).path
