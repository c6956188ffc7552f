"""lmlab compare: runs made by train and by sweep, on data with different tokenizers, side by side in
bits per byte; unreadable runs named; --out kept apart from the runs and from other people's files."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from helpers import TINY_ARGS, corpus, fast_args

from lmlab import cli
from lmlab.experiments import compare

SLOW = pytest.mark.slow  # the fixture trains a run and a sweep of two seeds: about a minute on 2 CPUs

BATCH, EVAL_BATCHES, STEPS = 4, 2, 6
SWEEP_BASE = {  # the tiny CLI model, as a sweep spec's base
    "model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 32},
    "train": {"steps": STEPS, "batch_size": BATCH, "device": "cpu"}, "optim": {"warmup_steps": 2},
    "eval": {"every": 3, "batches": EVAL_BATCHES}, "checkpoint": {"every": 3},
    "log": {"every": 1, "sample_tokens": 0, "tensorboard": False},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A byte-tokenized run trained by `lmlab train`, and a BPE-tokenized sweep of two seeds over
    prepared data (`data: {prepared: DIR}`)."""
    root = tmp_path_factory.mktemp("compare")
    text = corpus(root / "corpus.txt")
    for kind in ("byte", "bpe"):
        assert cli.main(["prepare", str(text), "--out", str(root / kind), "--tokenizer", kind, "--vocab-size", "300",
                         "--seq-len", "32"]) == 0
    assert cli.main(["train", "--run-dir", str(root / "byte-run"), "--data", str(root / "byte"), *TINY_ARGS,
                     *fast_args(), "--train.steps", str(STEPS), "--eval.every", "3", "--checkpoint.every", "3"]) == 0
    spec = {"name": "bpe", "base": {**SWEEP_BASE, "data": {"prepared": str(root / "bpe")}}, "seeds": [0, 1],
            "variants": [{"name": "base"}]}
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    assert cli.main(["sweep", str(root / "spec.yaml"), "--out", str(root / "sweep")]) == 0
    return root


def eval_bpb(capsys, run) -> float:
    """bits per byte of the run's last checkpoint over the windows the trainer evaluates, by `lmlab eval`."""
    capsys.readouterr()
    assert cli.main(["eval", str(run), "--json", "--checkpoint", "latest", "--batch-size", str(BATCH),
                     "--max-batches", str(EVAL_BATCHES)]) == 0
    return json.loads(capsys.readouterr().out)["bits_per_byte"]


def table(out: str) -> dict[str, list[str]]:
    """The printed table: run name -> its cells, and "columns" -> the header (split on 2+ spaces)."""
    lines = [ln for ln in out.splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("run "))
    rows = {"columns": re.split(r"\s{2,}", lines[start].strip())}
    for ln in lines[start + 1:]:
        if ln.startswith("wrote "):
            break
        cells = re.split(r"\s{2,}", ln.strip())
        rows[cells[0]] = cells
    return rows


@SLOW
def test_compare_runs_of_two_tokenizers_in_bits_per_byte(runs, capsys, tmp_path):
    out = tmp_path / "cmp"
    capsys.readouterr()
    code = cli.main(["compare", str(runs / "byte-run"), str(runs / "sweep"), "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "different tokenizers" in printed and "compared in bits per byte" in printed
    rows = table(printed)
    names = ["byte-run", "sweep/runs/base/seed0", "sweep/runs/base/seed1"]
    assert sorted(rows) == sorted(["columns", *names])
    columns = rows["columns"]
    assert columns[:4] == ["run", "tokenizer", "final val bpb", "best val bpb"]  # bits per byte lead
    for field in ("model.vocab_size", "train.seed", "model.init_seed", "data.prepared"):
        assert field in columns  # the config fields that differ between the runs
    cell = {name: dict(zip(columns, rows[name])) for name in names}
    assert cell["byte-run"]["tokenizer"] == "byte 256" and cell["sweep/runs/base/seed0"]["tokenizer"] == "bpe 300"
    for name, run in zip(names, [runs / "byte-run", runs / "sweep/runs/base/seed0", runs / "sweep/runs/base/seed1"]):
        expected = eval_bpb(capsys, run)  # recomputed from the last checkpoint by lmlab eval
        assert float(cell[name]["final val bpb"]) == pytest.approx(expected, abs=6e-5), name
        assert int(cell[name]["steps"]) == STEPS and int(cell[name]["tokens"].replace(",", "")) == STEPS * BATCH * 32
        assert int(cell[name]["params"].replace(",", "")) > 0 and float(cell[name]["tokens/s"].replace(",", "")) > 0
    # the summary and the curves, PNG files
    summary = (out / "compare.md").read_text()
    assert "different tokenizers" in summary and "| byte-run | byte 256 |" in summary
    assert "sweep/runs/base (2 seeds): sweep/runs/base/seed0, sweep/runs/base/seed1" in summary
    for x in ("steps", "tokens", "wall_time"):
        png = out / f"loss_vs_{x}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({png.name})" in summary


@SLOW
def test_bits_per_byte_of_runs_logged_before_it_come_from_their_data(runs, capsys, tmp_path):
    """A run whose metrics.jsonl has no val_bits_per_byte (trained before it was logged) gets the same
    bits per byte from its prepared data's validation windows."""
    old = tmp_path / "old-run"
    shutil.copytree(runs / "byte-run", old)
    lines = (old / "metrics.jsonl").read_text().splitlines()
    stripped = [{k: v for k, v in json.loads(ln).items() if k != "val_bits_per_byte"} for ln in lines]
    (old / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in stripped))
    (new,), _ = compare.read_runs([runs / "byte-run"])
    (was,), _ = compare.read_runs([old])
    assert new.tokens_per_byte and was.tokens_per_byte == pytest.approx(new.tokens_per_byte, rel=1e-9)
    assert was.in_unit(was.final_val(), "bpb") == pytest.approx(eval_bpb(capsys, runs / "byte-run"), rel=1e-6)


@SLOW
def test_unreadable_runs_are_named_and_the_rest_compared(runs, capsys, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(runs / "byte-run", damaged)
    with open(damaged / "metrics.jsonl", "a") as f:
        f.write("not a record\n{\"step\": 99}\n")
    capsys.readouterr()
    code = cli.main(["compare", str(runs / "byte-run"), str(damaged), str(tmp_path / "missing")])
    out, err = capsys.readouterr()
    assert code == 3  # a damaged file (3) outranks a missing path (2); the readable run is still compared
    assert "byte-run" in table(out)
    assert len(err.strip().splitlines()) == 2
    assert f"cannot read {damaged}:" in err and "metrics.jsonl" in err and f"cannot read {tmp_path / 'missing'}" in err
    assert cli.main(["compare", str(tmp_path / "missing"), str(tmp_path / "nothing-*")]) == 2  # none readable
    assert "none of the runs could be read" in capsys.readouterr().err


@SLOW
def test_out_stays_outside_the_runs_and_off_other_files(runs, capsys, tmp_path):
    run = str(runs / "byte-run")
    assert cli.main(["compare", run, "--out", str(runs / "byte-run" / "cmp")]) == 2
    assert "inside the run" in capsys.readouterr().err and not (runs / "byte-run" / "cmp").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert cli.main(["compare", run, "--out", str(mine), "--overwrite"]) == 2
    assert "did not write" in capsys.readouterr().err and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    out = tmp_path / "cmp"
    assert cli.main(["compare", run, "--out", str(out)]) == 0
    assert cli.main(["compare", run, "--out", str(out)]) == 2  # an earlier comparison: only with --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert cli.main(["compare", run, "--out", str(out), "--overwrite"]) == 0
    assert (out / "compare.md").is_file() and (out / compare.MARKER).is_file()


def test_help_loads_neither_torch_nor_matplotlib():
    script = ("import sys; from lmlab import cli; code = cli.main(['compare', '--help']); "
              "print(code, sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'matplotlib', 'numpy'}))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "bits per byte" in proc.stdout, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "0 []"


# ============================================================== issue 44: runs found once, read honestly, named safely
CONFIG = "model: {d_model: 32, n_layers: 1, n_heads: 4, max_seq_len: 32}\n"


def fake_run(path, records=None, config=CONFIG):
    """A run directory as compare reads it, without training: config.yaml and metrics.jsonl."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(config)
    records = records if records is not None else [
        {"step": 1, "loss": 3.0, "tokens": 128, "tokens_per_s": 100.0}, {"step": 1, "val_loss": 3.1},
        {"step": 2, "loss": 2.9, "tokens": 256, "tokens_per_s": 100.0}, {"step": 2, "val_loss": 2.8}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_run_reached_through_links_is_listed_once(tmp_path):
    """A link to a run and a link loop below a directory listed the run once per name it could be
    reached by (up to ~40 for a loop): seed bands then counted the copies as seeds."""
    runs = tmp_path / "runs"
    fake_run(runs / "a")
    (runs / "b").symlink_to(runs / "a")
    (runs / "nest").mkdir()
    (runs / "nest" / "loop").symlink_to(runs)
    paths, failed = compare.find_runs([str(runs), str(runs / "a"), str(tmp_path / "r*")])
    assert paths == [runs / "a"] and failed == []


def test_finding_1200_runs_is_linear(tmp_path):
    """find_runs rebuilt a set of every resolved path found so far for each match: 140 s for 1,200 runs."""
    import time

    for i in range(1200):
        run = tmp_path / f"run{i:04d}"
        run.mkdir()
        (run / "config.yaml").write_text("")
        (run / "metrics.jsonl").write_text("")
    start = time.perf_counter()
    paths, failed = compare.find_runs([str(tmp_path / "run*")])
    assert len(paths) == 1200 and not failed and time.perf_counter() - start < 5


def test_a_run_whose_last_evaluation_diverged_shows_it(tmp_path, capsys):
    """val_loss null at the last evaluation: the table showed the earlier finite loss as the final one."""
    fake_run(tmp_path / "good")
    fake_run(tmp_path / "bad", [{"step": 1, "loss": 3.0, "tokens": 128, "tokens_per_s": 100.0},
                                {"step": 1, "val_loss": 3.1}, {"step": 2, "loss": None, "tokens": 256,
                                                               "tokens_per_s": 100.0}, {"step": 2, "val_loss": None}])
    (bad,), _ = compare.read_runs([tmp_path / "bad"])
    assert bad.diverged() and bad.final_val() == float("inf") and bad.best_val() == 3.1
    assert cli.main(["compare", str(tmp_path / "good"), str(tmp_path / "bad")]) == 0
    rows = table(capsys.readouterr().out)
    cell = dict(zip(rows["columns"], rows["bad"]))
    assert cell["final val loss"] == "diverged" and cell["best val loss"] == "3.1000"
    assert dict(zip(rows["columns"], rows["good"]))["final val loss"] == "2.8000"


def test_a_damaged_run_is_named_and_skipped(tmp_path, capsys):
    """A training record without its token count aborted the whole comparison ("cannot convert float
    NaN to integer"); a metrics.jsonl that is a directory was reported as missing."""
    fake_run(tmp_path / "good")
    fake_run(tmp_path / "notokens", [{"step": 1, "loss": 3.0}, {"step": 1, "val_loss": 3.1}])
    fake_run(tmp_path / "dir", [])
    (tmp_path / "dir" / "metrics.jsonl").unlink()
    (tmp_path / "dir" / "metrics.jsonl").mkdir()
    code = cli.main(["compare", str(tmp_path / "good"), str(tmp_path / "notokens"), str(tmp_path / "dir")])
    out, err = capsys.readouterr()
    assert code == 3 and "good" in table(out) and "notokens" not in table(out), err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in err
    assert "notokens/metrics.jsonl': the training record of step 1 has tokens=None, not a count" in lines[0]
    assert "dir/metrics.jsonl' is a directory, not a file" in lines[1]


def test_many_unreadable_arguments_are_one_line(tmp_path, capsys):
    """3,000 empty directories printed 3,001 lines."""
    for i in range(3000):
        (tmp_path / f"e{i:04d}").mkdir()
    fake_run(tmp_path / "run")
    assert cli.main(["compare", str(tmp_path / "run"), str(tmp_path / "e*")]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "3,000 arguments (" in err and "and 2,997 more" in err, err[:2000]
    assert "run" in table(out)


def test_names_are_printed_with_control_characters_escaped(tmp_path, capsys):
    """A run directory named with a terminal escape sequence reached the terminal raw."""
    fake_run(tmp_path / "x\x1b[2J\x07")
    fake_run(tmp_path / "plain")
    assert cli.main(["compare", str(tmp_path / "plain"), str(tmp_path / "x\x1b[2J\x07"),
                     str(tmp_path / "gone\x1b]0;owned\x07")]) == 2
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err and "\x07" not in out + err
    assert "x\\x1b[2J\\x07" in out


def test_a_full_disk_leaves_no_comparison_and_no_temporaries(tmp_path, monkeypatch, capsys):
    """ENOSPC at the second PNG left .lmlab-compare and one PNG in --out."""
    import errno

    from lmlab.experiments import report

    fake_run(tmp_path / "runs" / "a")
    real, calls = report.save, []

    def save(fig, path):
        calls.append(path)
        if len(calls) == 2:
            path.write_bytes(b"\x89PNG half")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fig, path)

    monkeypatch.setattr(compare, "save", save)
    assert cli.main(["compare", str(tmp_path / "runs" / "a"), "--out", str(tmp_path / "cmp")]) == 3
    err = capsys.readouterr().err
    assert err.startswith("lmlab compare: error: no space left on the device holding") and err.count("\n") == 1
    assert f"{str(tmp_path / 'cmp')!r}" in err  # the directory the user named, not the temporary one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


# ============================================================== a terminal's width, classifiers, downstream tasks
@pytest.fixture(autouse=True)
def no_columns(monkeypatch):
    """Output to a pipe or a capture is the whole table unless COLUMNS says a width: none here unless a test sets it."""
    monkeypatch.delenv("COLUMNS", raising=False)


def wide_runs(root, n=3):
    """``n`` runs whose configs differ in a dozen fields: the table runs to several hundred characters."""
    fields = ["d_model: 32", "n_layers: 1", "n_heads: 4", "max_seq_len: 32"]
    for i in range(n):
        config = ("model: {" + ", ".join(fields) + f", init_seed: {i}, norm_eps: 1.0e-0{i + 5}, dropout: 0.{i}, "
                  f"relative_clip: {16 + i}, init_std: 0.0{i + 1}, tie_embeddings: {str(i % 2 == 1).lower()}}}\n"
                  f"train: {{steps: {10 + i}, batch_size: {4 + i}, seed: {i}, grad_accum: {1 + i}}}\n"
                  f"optim: {{lr: 0.00{i + 1}, warmup_steps: {i}, weight_decay: 0.{i}}}\n"
                  f"eval: {{every: {2 + i}, batches: {3 + i}}}\n")
        fake_run(root / f"variant-{i}", config=config)
    return root


def test_the_table_fits_a_terminal_and_compare_md_holds_it_whole(tmp_path, capsys, monkeypatch):
    """The table ran to 945 characters on an 80-column terminal; now it is cut into parts of whole columns,
    each led by the run's name, and compare.md keeps every column in one table."""
    wide_runs(tmp_path / "runs")
    runs, _ = compare.read_runs(compare.find_runs([str(tmp_path / "runs")])[0])
    rows, columns = compare.comparison_rows(runs, "nats")
    whole = compare.comparison_text(runs, "nats")
    assert max(len(line) for line in whole.splitlines()) > 300  # as wide as before, without a width
    parts = compare.fit_table(rows, columns, 80)
    assert len(parts) >= 4 and all(p[0] == "run" and len(p) >= 2 for p in parts)
    assert [c for p in parts for c in p[1:]] == columns[1:]  # every column once, in order
    monkeypatch.setenv("COLUMNS", "80")  # what a terminal of 80 columns (or a user) sets
    assert cli.main(["compare", str(tmp_path / "runs"), "--out", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out.split("\nwrote ")[0]  # the files written: paths, not cut
    assert max(len(line) for line in printed.splitlines()) <= 80, printed
    headers = [line.split() for line in printed.splitlines() if line.startswith("run ")]
    assert len(headers) == len(parts) and sorted(c for h in headers for c in h[1:]) == sorted(
        c for c in columns[1:] for c in c.split())  # the same columns, cut at the same places
    for name in ("variant-0", "variant-1", "variant-2"):
        assert sum(line.startswith(name + " ") for line in printed.splitlines()) == len(parts)  # a line per part
    assert f"cut into {len(parts)} parts to fit 80 columns" in " ".join(printed.split())
    md = (tmp_path / "cmp" / "compare.md").read_text()
    header_line = next(line for line in md.splitlines() if line.startswith("| run |"))
    assert header_line == "| " + " | ".join(columns) + " |"  # the whole table, one row of columns
    # a column wider than the terminal is never cut, nor left without a part of its own; nor is a long run name
    assert compare.fit_table([{"run": "x", "a": "y" * 100}], ["run", "a", "b"], 40) == [["run", "a"], ["run", "b"]]
    assert compare.fit_table([{"run": "r" * 100, "a": 1}], ["run", "a", "b"], 40) == [["run", "a"], ["run", "b"]]
    assert compare.fit_table([{"run": "r", "a": 1}], ["run", "a", "b"], 40) == [["run", "a", "b"]]


def test_terminal_width_is_none_for_a_pipe_and_columns_where_set(monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False, raising=False)
    assert compare.terminal_width() is None  # a pipe or a file: the whole table, for grep and less -S
    monkeypatch.setenv("COLUMNS", "132")
    assert compare.terminal_width() == 132


CLASSIFY = "task: classify\n" + CONFIG


def test_a_classifier_has_no_bits_per_byte_and_the_table_says_why(tmp_path, capsys):
    """A classifier among language models showed `nan` bits per byte without a word; its accuracy was not shown."""
    fake_run(tmp_path / "lm", [{"step": 2, "loss": 2.9, "tokens": 256, "tokens_per_s": 100.0},
                               {"step": 2, "val_loss": 2.8, "val_bits_per_byte": 4.0}])
    fake_run(tmp_path / "clf", [{"step": 2, "loss": 0.6, "tokens": 256, "tokens_per_s": 100.0},
                                {"step": 2, "val_loss": 0.5, "val_accuracy": 0.75, "val_perplexity": 1.65}],
             config=CLASSIFY)
    assert cli.main(["compare", str(tmp_path / "lm"), str(tmp_path / "clf")]) == 0
    out = capsys.readouterr().out
    rows = table(out)
    clf, lm = (dict(zip(rows["columns"], rows[n])) for n in ("clf", "lm"))
    assert clf["final val bpb"] == clf["best val bpb"] == "n/a" and clf["final val loss"] == "0.5000"
    assert clf["final val accuracy"] == "0.7500" and lm["final val bpb"] == "4.0000"
    assert "final val perplexity" not in rows["columns"]  # a loss, not another measure
    assert "nan" not in out
    head = " ".join(out.split("\n\n")[0].split())
    assert ("Classifiers (clf): their loss is cross-entropy over their labels, not over text, so they have no bits "
            "per byte (n/a)") in head
    assert "Bits per byte unknown" not in head  # not for want of data: a classifier has none


def test_downstream_task_scores_are_columns(tmp_path, capsys):
    """``tasks/<task>/<metric>`` records (the downstream evaluations) show as a column each: the last value."""
    fake_run(tmp_path / "a", [{"step": 1, "loss": 3.0, "tokens": 128, "tokens_per_s": 100.0},
                              {"step": 1, "val_loss": 3.1, "tasks/arith/acc": 0.25, "tasks/arith/acc_stderr": 0.1},
                              {"step": 2, "loss": 2.9, "tokens": 256, "tokens_per_s": 100.0},
                              {"step": 2, "val_loss": 2.8, "tasks/arith/acc": 0.5, "tasks/arith/acc_stderr": 0.125,
                               "tasks/copy/exact_match": 1}])
    fake_run(tmp_path / "b")  # logged no task: its cells are empty
    assert cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "cmp")]) == 0
    rows = table(capsys.readouterr().out)
    tasks = ["tasks/arith/acc", "tasks/arith/acc_stderr", "tasks/copy/exact_match"]
    assert [c for c in rows["columns"] if c.startswith("tasks/")] == tasks
    a = dict(zip(rows["columns"], rows["a"]))
    assert (a["tasks/arith/acc"], a["tasks/arith/acc_stderr"], a["tasks/copy/exact_match"]) == ("0.5000", "0.1250", "1")
    (_, b), _ = compare.comparison_rows(compare.read_runs([tmp_path / "a", tmp_path / "b"])[0], "nats")
    assert [b[t] for t in tasks] == ["", "", ""]
    assert "| tasks/arith/acc | tasks/arith/acc_stderr | tasks/copy/exact_match |" in (
        tmp_path / "cmp" / "compare.md").read_text()
