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
