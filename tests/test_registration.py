"""Registration: a spec committed before the main runs, the first commit with its id, the changes after it,
and ``lmlab experiment`` refusing an unregistered spec unless --draft (then the report says UNREGISTERED)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from lmlab import cli
from lmlab.experiments import spec_path
from lmlab.experiments.registration import Registration, changes_section, check_block, spec_status
from lmlab.experiments.report import report_header
from lmlab.experiments.spec import parse_spec

BLOCK = {"id": "exp-1", "correction": "holm", "alpha": 0.05, "amendments": []}
TINY = {"model": {"d_model": 16, "n_heads": 2, "n_layers": 1, "max_seq_len": 16},
        "train": {"steps": 4, "batch_size": 2, "device": "cpu"}, "optim": {"warmup_steps": 1},
        "eval": {"every": 2, "batches": 1}, "checkpoint": {"every": 2},
        "log": {"every": 1, "sample_tokens": 0, "tensorboard": False}}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def commit(repo: Path, message: str, **files: str) -> str:
    """Write ``files`` (name -> text), commit them with ``message``; returns the commit."""
    for name, text in files.items():
        (repo / name).write_text(text)
    git(repo, "add", *files)
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


def spec_text(registration: dict | None = None, **extra) -> str:
    data = {"name": "tiny", "base": TINY, "variants": [{"name": "one"}], **extra}
    return yaml.safe_dump({**data, "registration": registration} if registration else data)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """An empty git checkout in tmp_path/repo (git looks no higher than tmp_path)."""
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    r = tmp_path / "repo"
    r.mkdir()
    git(r, "init", "-q")
    git(r, "config", "user.email", "test@example.com")
    git(r, "config", "user.name", "test")
    git(r, "config", "commit.gpgsign", "false")
    return r


# ============================================================== spec_status
def test_a_committed_unchanged_spec_is_registered_at_its_commit(repo):
    c = commit(repo, "register", **{"spec.yaml": spec_text(BLOCK)})
    s = spec_status(repo / "spec.yaml")
    assert s.registered and s.committed and s.problem == ""
    assert (s.id, s.commit, s.head, s.changes_after) == ("exp-1", c, c, ())
    assert s.text().startswith("spec spec.yaml is registered as 'exp-1' at commit " + c[:12])  # the checkout's path
    assert str(repo) not in s.text() and s.where == "spec.yaml" and s.path == str(repo / "spec.yaml")


@pytest.mark.parametrize("stage", [False, True])
def test_a_spec_edited_after_its_commit_is_not_registered(repo, stage):
    commit(repo, "register", **{"spec.yaml": spec_text(BLOCK)})
    (repo / "spec.yaml").write_text(spec_text(BLOCK, seeds=3))
    if stage:
        git(repo, "add", "spec.yaml")
    s = spec_status(repo / "spec.yaml")
    assert not s.registered and not s.committed and s.tracked and not s.clean
    assert s.problem == "it has uncommitted changes" and s.commit is None


def test_an_untracked_spec_or_one_without_an_id_is_not_registered(repo):
    commit(repo, "something else", **{"README": "x\n"})
    (repo / "spec.yaml").write_text(spec_text(BLOCK))
    assert spec_status(repo / "spec.yaml").problem == "never committed: git does not track it"
    commit(repo, "spec without an id", **{"spec.yaml": spec_text()})
    s = spec_status(repo / "spec.yaml")
    assert s.committed and not s.registered and s.problem == "it has no registration: id"
    assert "is committed at revision" in s.text()


def test_the_registration_commit_is_the_first_with_the_id_and_later_changes_are_listed(repo):
    (repo / "pkg").mkdir()
    commit(repo, "draft spec, no id yet", **{"spec.yaml": spec_text()})
    registered = commit(repo, "register exp-1", **{"spec.yaml": spec_text(BLOCK), "pkg/analysis.py": "A = 1\n"})
    amended = {**BLOCK, "amendments": [{"change": "seeds 3", "reason": "power calculation"}]}
    commit(repo, "seeds 3: the power calculation asks for it", **{"spec.yaml": spec_text(amended, seeds=3)})
    commit(repo, "analysis: a fixed margin", **{"pkg/analysis.py": "A = 2\n"})
    commit(repo, "unrelated", **{"README": "x\n"})
    s = spec_status(repo / "spec.yaml", related=[repo / "pkg/analysis.py", "/elsewhere/stats.py"])
    assert s.registered and s.commit == registered
    assert [c.subject for c in s.changes_after] == ["seeds 3: the power calculation asks for it",
                                                    "analysis: a fixed margin"]
    assert all(len(c.commit) >= 7 and c.date[:2] == "20" for c in s.changes_after)
    # a new id registers again: its registration commit is the first commit with the new id
    again = commit(repo, "register exp-2", **{"spec.yaml": spec_text({**amended, "id": "exp-2"})})
    s = spec_status(repo / "spec.yaml", related=[repo / "pkg/analysis.py"])
    assert (s.id, s.commit, s.changes_after) == ("exp-2", again, ())


def test_outside_a_checkout_or_without_git_the_status_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    p = tmp_path / "spec.yaml"
    p.write_text(spec_text(BLOCK))
    s = spec_status(p)
    assert (s.checkout, s.registered, s.problem, s.id) == (False, False, "not inside a git checkout", "exp-1")
    assert "is not committed: not inside a git checkout" in s.text()
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    assert spec_status(p).problem == "git is not installed"
    assert spec_status(tmp_path / "missing.yaml").problem == "the file does not exist"


# ============================================================== the spec's block and the report
def test_the_registration_block_is_parsed_and_checked(tmp_path):
    amended = {**BLOCK, "amendments": [{"change": "lr 2.4e-2", "reason": "top edge"}]}
    spec = parse_spec(yaml.safe_load(spec_text(amended)), "s.yaml")
    assert spec.registration["id"] == "exp-1" and spec.registration["amendments"][0]["reason"] == "top edge"
    assert parse_spec(yaml.safe_load(spec_text()), "s.yaml").registration is None
    for bad, message in [({"id": ""}, "registration.id must be"), ({**BLOCK, "when": 1}, "unknown key 'when'"),
                         ({**BLOCK, "amendments": [{"change": "x"}]}, "{change: ..., reason: ...}"), ("x", "mapping")]:
        with pytest.raises(ValueError, match="s.yaml: registration") as e:
            check_block(bad, "s.yaml")
        assert message in str(e.value) and "\n" not in str(e.value)


class Spec:
    """What report_header reads of a resolved spec."""

    seeds, seed_fields, is_quick, profile = [0], ("train.seed",), False, None

    def __init__(self, status, block=None):
        self.registration_status, self.registration = status, block


def test_the_report_names_the_registration_or_says_unregistered_then_lists_changes(repo):
    c = commit(repo, "register", **{"spec.yaml": spec_text(BLOCK)})
    block = {**BLOCK, "amendments": [{"change": "lr 2.4e-2", "reason": "dense chose the top edge"}]}
    text = report_header("T", "cmd", Spec(spec_status(repo / "spec.yaml"), block), 1.0, [])
    # the path inside the checkout, not this machine's folder (reports named /work/exp/src-.../spec.yaml)
    assert text.startswith(f"# T\n\nRegistered as `exp-1` at commit {c[:12]} (spec.yaml).\n")
    assert str(repo) not in text and "**UNREGISTERED**" not in text
    assert text.split("## Changes after registration\n\n")[1] == "- lr 2.4e-2 — dense chose the top edge\n\n"
    draft = Registration("s.yaml", problem="it has uncommitted changes", draft=True)
    text = report_header("T", "cmd", Spec(draft), 1.0, [])
    assert text.startswith("# T\n\n**UNREGISTERED** (run with --draft): s.yaml")
    assert text.endswith("## Changes after registration\n\nnone\n\n")
    assert changes_section(None, block) == "" and "UNREGISTERED" not in report_header("T", "c", Spec(None), 1, [])


def test_the_report_header_adds_the_tuning_runs_to_the_run_time():
    rows = [{"wall_s": 1800.0}, {"wall_s": 3600.0}]
    tuning = [{"wall_s": "900"}, {"wall_s": 900.0}]  # read back from tune.csv: numbers, or their text
    text = report_header("T", "cmd", Spec(None), 60.0, rows, tuning=tuning)
    assert ("The runs trained for 1.50 h in total (sum of per-run wall times, evaluation included; longest run "
            "60.0 min), and the 2 tuning runs for 0.50 h more (2.00 h in all); the invocation that wrote this "
            "report took 1.0 min") in text
    assert "tuning runs" not in report_header("T", "cmd", Spec(None), 60.0, rows, tuning=[])


# ============================================================== the commands
def tree(root: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


def experiment_spec(repo: Path) -> Path:
    """The moe experiment's spec with a main-run profile "tiny" at its quick size, one seed, no tuning."""
    data = yaml.safe_load(spec_path("moe").read_text())
    data["profiles"]["tiny"] = {**data["profiles"]["quick"], "tune": None, "seeds": [0]}
    p = repo / "moe.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_an_uncommitted_experiment_spec_refuses_main_runs_and_writes_nothing(repo, tmp_path, capsys):
    spec, out = experiment_spec(repo), tmp_path / "out"
    before = tree(tmp_path)
    assert cli.main(["experiment", "moe", "--spec", str(spec), "--profile", "tiny", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(spec) in err and "never committed" in err
    assert "commit it" in err and "or pass --draft: the report is then marked UNREGISTERED" in err
    assert tree(tmp_path) == before and not out.exists()


@pytest.mark.slow  # trains the moe experiment's 9 arms at the quick size (a minute or two on a busy CPU)
def test_an_uncommitted_experiment_spec_runs_with_draft_marked_unregistered(repo, tmp_path, capsys):
    spec, out = experiment_spec(repo), tmp_path / "out"
    argv = ["experiment", "moe", "--spec", str(spec), "--profile", "tiny", "--draft", "--out", str(out)]
    assert cli.main(argv) == 0
    assert "is not committed: never committed" in capsys.readouterr().out
    text = (out / "report.md").read_text()
    assert text.startswith("# Claim 3") and text.split("\n\n")[1].startswith("**UNREGISTERED** (run with --draft)")
    assert "## Changes after registration\n\nnone\n" in text
    record = json.loads((out / "sweep.json").read_text())["registration"]
    assert (record["registered"], record["draft"], record["path"]) == (False, True, str(spec))


def test_a_sweep_records_whether_its_spec_was_committed_and_at_which_revision(repo, tmp_path, capsys):
    (repo / "corpus.txt").write_text("".join(f"line {i}: the quick brown fox {i % 7}.\n" for i in range(400)))
    base = {**TINY, "data": {"source": str(repo / "corpus.txt"), "val_fraction": 0.1}}
    head = commit(repo, "a sweep", **{"spec.yaml": yaml.safe_dump({"name": "t", "base": base,
                                                                   "variants": [{"name": "one"}]})})
    out = tmp_path / "out"
    assert cli.main(["sweep", str(repo / "spec.yaml"), "--out", str(out)]) == 0
    line = f"spec spec.yaml is committed at revision {head[:12]}; not registered"  # its path in the checkout
    assert line in capsys.readouterr().out and line in (out / "summary.md").read_text()
    record = json.loads((out / "sweep.json").read_text())
    assert record["registration"]["committed"] and record["registration"]["head"] == head
