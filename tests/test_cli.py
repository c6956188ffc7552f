"""The lmlab command end to end: prepare -> train -> eval -> generate, signals, and every bad-input case."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import TINY_ARGS, WORDS, corpus, fast_args

from lmlab import cli
from lmlab.run.checkpoint import local as ckpt
from lmlab.run.load import load_run

TINY = TINY_ARGS
FAST = fast_args(sample_tokens=16)


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()} if root.exists() else {}


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def bad_input(capsys, *args: str) -> str:
    """Run a command that must fail on its input: exit 2, one line on stderr, no traceback."""
    code, out, err = run(capsys, *args)
    assert code == 2, (out, err)
    assert "Traceback" not in err and err.endswith("\n") and err.count("\n") == 1, err
    return err.strip()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """prepare -> train, shared by the eval / generate / bad-input tests."""
    root = tmp_path_factory.mktemp("cli")
    source = corpus(root / "corpus.txt")
    assert cli.main(["prepare", str(source), "--out", str(root / "data"), "--seq-len", "32"]) == 0
    code = cli.main(["train", "--run-dir", str(root / "run"), "--data", str(root / "data"),
                     *TINY, *FAST, "--train.steps", "12", "--eval.every", "6", "--checkpoint.every", "6"])
    assert code == 0
    return root


# ============================================================== the happy path
def test_prepare_train_eval_generate(trained, capsys):
    root = trained
    meta = json.loads((root / "data" / "meta.json").read_text())
    assert meta["tokenizer"] == "byte"  # the corpus and its end-of-document byte
    assert meta["train_tokens"] + meta["val_tokens"] == len((root / "corpus.txt").read_bytes()) + 1
    assert not (root / "run" / "data").exists()  # --data: the prepared data was used where it is, not copied
    records = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    val_bpb = {r["step"]: r["val_bits_per_byte"] for r in records if "val_loss" in r}
    assert sorted(val) == [6, 12] and val[12] < 5.0  # well below ln(256) = 5.55 after 12 steps

    # the trainer's last validation pass: eval_batches=2 batches of batch_size=4, read in order
    code, out, _ = run(capsys, "eval", root / "run", "--json", "--checkpoint", "latest", "--batch-size", "4",
                       "--max-batches", "2")
    report = json.loads(out)
    assert code == 0 and report["step"] == 12 and report["seq_len"] == 32 == report["train_seq_len"]
    assert report["sequences"] == 8 and report["tokens"] == 8 * 32
    assert report["loss"] == pytest.approx(val[12], rel=1e-6)
    assert report["perplexity"] == pytest.approx(torch.tensor(report["loss"]).exp().item())
    assert report["bytes"] == report["tokens"]  # byte tokens, and no end of document among the 256 targets
    assert report["bits_per_byte"] == pytest.approx(report["loss"] / math.log(2), rel=1e-12)
    assert val_bpb[12] == pytest.approx(report["bits_per_byte"], rel=1e-6)  # the trainer logged the same
    assert len(report["per_position"]) == 32 and sum(report["per_position"]) / 32 == pytest.approx(report["loss"])
    assert [(b["start"], b["end"]) for b in report["buckets"]] == [(i * 4, i * 4 + 4) for i in range(8)]
    for b in report["buckets"]:
        assert b["loss"] == pytest.approx(sum(report["per_position"][b["start"]:b["end"]]) / 4)

    code, text, _ = run(
        capsys, "eval", root / "run", "--checkpoint", "latest", "--batch-size", "4", "--max-batches", "2"
    )
    assert code == 0 and text.splitlines()[0] == (
        f"{root / 'run'} @ step_0000012: val loss {report['loss']:.4f}, perplexity {report['perplexity']:.3f}, "
        f"{report['bits_per_byte']:.4f} bits/byte (8 sequences x 32 tokens)")
    whole = json.loads(run(capsys, "eval", root / "run", "--json", "--max-batches", "0")[1])
    assert whole["sequences"] == (meta["val_tokens"] - 1) // 32  # every full window of the split
    assert whole["checkpoint"].endswith("step_0000012")  # "best" is the lowest val loss: step 12 here

    code, first, _ = run(
        capsys, "generate", root / "run", "--prompt", "the model", "--max-new-tokens", "30", "--seed", "3"
    )
    code2, second, _ = run(
        capsys, "generate", root / "run", "--prompt", "the model", "--max-new-tokens", "30", "--seed", "3"
    )
    assert (
        code == code2 == 0 and first == second and first.startswith("the model") and len(first) > len("the model") + 5
    )
    code, greedy, _ = run(
        capsys, "generate", root / "run", "--prompt", "the", "--max-new-tokens", "20", "--temperature", "0"
    )
    loaded = load_run(root / "run")  # greedy decoding by full recomputation, without the CLI or a KV cache
    ids = loaded.tokenizer.encode("the")
    with torch.no_grad():
        for _ in range(20):
            ids.append(int(loaded.model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert code == 0 and greedy == loaded.tokenizer.decode(ids) + "\n"


def test_eval_longer_than_training_with_rope_scaling(trained, capsys):
    code, out, _ = run(capsys, "eval", trained / "run", "--seq-len", "64", "--json", "--max-batches", "2",
                       "--model.rope.scaling", "yarn", "--model.rope.factor", "2")
    report = json.loads(out)
    assert code == 0 and report["seq_len"] == 64 and report["train_seq_len"] == 32
    assert report["overrides"] == {"model.rope.scaling": "yarn", "model.rope.factor": "2"}
    starts = [b["start"] for b in report["buckets"]]
    assert 32 in starts and len(report["per_position"]) == 64  # the training length is a bucket edge
    plain = json.loads(run(capsys, "eval", trained / "run", "--seq-len", "64", "--json", "--max-batches", "2")[1])
    assert plain["per_position"][:4] != report["per_position"][:4]  # yarn rescales every position's angles
    code, text, _ = run(capsys, "eval", trained / "run", "--seq-len", "64", "--max-batches", "1")
    assert "(beyond training length)" in text and "trained at 32" in text


def test_help_shows_defaults_for_every_command(capsys):
    for command, default in [("prepare", "(default: builtin)"), ("train", "(default: runs/default)"),
                             ("eval", "(default: best)"), ("generate", "(default: 0.8)")]:
        code, out, _ = run(capsys, command, "--help")
        out = " ".join(out.split())
        assert code == 0 and f"usage: lmlab {command}" in out and default in out
        assert "exit status" in out
    code, out, _ = run(capsys, "train", "--help")
    sections = help_sections(out)  # the config's defaults, under their sections
    assert "vocab_size=256 d_model=128" in sections["model"] and "steps=1500" in sections["train"]
    code, out, _ = run(capsys, "--help")
    assert code == 0 and all(c in out for c in ("prepare", "train", "eval", "generate", "sweep", "experiment"))
    for command, default in [("sweep", "(default: 1)"), ("experiment", "{moe,mup,norm,positions}")]:
        code, out, _ = run(capsys, command, "--help")
        assert code == 0 and default in " ".join(out.split()) and "(default: None)" not in out  # said in words


def test_export_and_generate_help_name_every_registered_family(capsys):
    """The family list in --help is written out (the registry imports torch); it must be the registry's, in its order,
    and export and generate must both name every family."""
    from lmlab.hf import FAMILIES

    assert cli.HF_FAMILIES == tuple(FAMILIES)
    assert all(family.export is not None for family in FAMILIES.values())  # so export's list is the same list
    for command in ("export", "generate"):
        code, out, _ = run(capsys, command, "--help")
        named = set(re.findall(r"[\w-]+", out))
        assert code == 0 and not set(FAMILIES) - named, (command, set(FAMILIES) - named)


def help_sections(text: str) -> dict[str, str]:
    """``lmlab train --help``'s config defaults: section name -> its text (header and field lines)."""
    lines = text.split("config fields and their defaults", 1)[1].split("\nexit status:")[0].splitlines()
    sections: dict[str, str] = {}
    for line in lines:
        if line.startswith("  ") and not line.startswith("   "):  # a section header: "  model: ..."
            name = line.split(":")[0].strip()
            sections[name] = line
        elif sections and line.strip():
            sections[name] += "\n" + line
    return sections


def test_train_help_names_presets_and_every_default_by_section(capsys):
    from lmlab.config import (
        PRESETS,
        CompressedConfig,
        DSAConfig,
        MLAConfig,
        MoEConfig,
        MTPConfig,
        MupConfig,
        StreamsConfig,
    )
    from lmlab.run.config import LookupConfig, MuonConfig, RepeatsConfig, RunConfig, flatten

    code, out, _ = run(capsys, "train", "--help")
    sections = help_sections(out)
    cfg = RunConfig()
    assert code == 0 and list(sections) == [f.name for f in dataclasses.fields(cfg)]  # task, model, data, train, ...
    header = " ".join(sections["model"].split("=")[0].split()[:-1])  # the lines before the first field
    assert "--model.preset NAME" in header and set(PRESETS) <= set(re.findall(r"[\w-]+", header))
    # MoE is off by default (model.moe=None); its fields are shown with the defaults they take when one is set
    assert cfg.model.moe is None and "model.moe.* is off" not in out and "moe.* is off" in sections["model"]
    assert cfg.train.repeats is None and "repeats.* is off" in sections["train"]  # planted repeats: off too
    defaults = {**cfg.to_dict(), "model": {**cfg.model.to_dict(), "moe": MoEConfig().to_dict(),
                                           "mla": MLAConfig().to_dict(), "mtp": MTPConfig().to_dict(),
                                           "dsa": DSAConfig().to_dict(), "compressed": CompressedConfig().to_dict(),
                                           "mup": MupConfig().to_dict(),
                                           "residual_streams": StreamsConfig().to_dict()},
                "train": {**cfg.train.to_dict(), "repeats": RepeatsConfig().to_dict(),
                          "lookup": LookupConfig().to_dict()},
                "optim": {**cfg.optim.to_dict(), "muon": MuonConfig().to_dict()}}
    for name, values in defaults.items():
        shown = " " + " ".join(sections[name].split()) + " "
        expected = [f"{k}={cli.show(v)}" for k, v in flatten(values).items()] if isinstance(values, dict) else [values]
        missing = [item for item in expected if f" {item} " not in shown]
        assert not missing, (name, missing)  # every field, with its default, in its own section
    assert "moe.n_experts=8" in sections["model"].split() and "steps=1500" in sections["train"].split()


def test_help_loads_without_torch():
    """--help is answered before torch (or anything that imports it) is loaded: it answers at once."""
    script = ("import sys; from lmlab import cli\n"
              "codes = [cli.main([*c, '--help']) for c in ([], ['train'], ['eval'], ['generate'], ['prepare'])]\n"
              "print(codes, sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[0, 0, 0, 0, 0] []"
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "lmlab.cli", "--help"], capture_output=True,
                          text=True, timeout=120)
    imported = [line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert proc.returncode == 0 and "usage: lmlab" in proc.stdout and "lmlab.run.errors" in imported
    assert not [m for m in imported if m.split(".")[0] == "torch"]


def test_every_help_answers_without_torch_and_says_each_default_once():
    """`lmlab CMD --help` imports no torch (export, sweep and experiment did: ~4 s more), and no option's help
    prints its default twice ("(default: the training length) (default: None)")."""
    from lmlab.experiments import EXPERIMENTS
    from lmlab.experiments import sweep as sweep_pkg
    from lmlab.hf.export import DEFAULT_SHARD_SIZE

    for name in cli.COMMANDS:
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "lmlab", name, "--help"], capture_output=True,
                              text=True, timeout=120)
        imported = [line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
        assert proc.returncode == 0 and f"usage: lmlab {name}" in proc.stdout, proc.stderr[-2000:]
        assert not [m for m in imported if m.split(".")[0] == "torch"], name
        for action in subparser(name)._actions:
            shown = cli.Formatter(prog="lmlab")._get_help_string(action) or ""
            assert shown.count("(default:") <= 1 and "(default: None)" not in shown, (name, action.dest, shown)
    assert cli.experiment_names() == sorted(EXPERIMENTS)  # the choices --help lists without importing them
    assert cli.module_doc("experiments/sweep/__init__.py") == sweep_pkg.__doc__
    export_help = " ".join(subparser("export").format_help().split())
    assert f"(default: {DEFAULT_SHARD_SIZE})" in export_help  # written out, not imported


def subparser(name: str):
    return cli.build_parser([name])._subparsers._group_actions[0].choices[name]


@pytest.mark.slow
def test_progress_off_a_terminal_is_one_plain_line_per_record(tmp_path):
    """Under `| tee` or in a batch job's log: no progress-bar redraws (\r), and every step's line starts a line,
    so that `grep ^step` finds them all (a logged step, a validation, the final one)."""
    env = {**os.environ, "PYTHONPATH": str(Path(cli.__file__).parents[1]), "COLUMNS": "80"}
    proc = subprocess.run([sys.executable, "-m", "lmlab", "train", "--run-dir", str(tmp_path / "run"),
                           "--data.source", str(corpus(tmp_path / "corpus.txt")), *TINY,
                           *fast_args(quiet=False), "--train.steps", "4", "--eval.every", "2"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300, env=env)
    text = proc.stdout.decode()
    assert proc.returncode == 0, text
    assert "\r" not in text and "\x1b" not in text
    steps = re.findall(r"(?m)^step .*$", text)  # grep ^step
    assert [s.split(":")[0] for s in steps if "loss" in s and "val" not in s] == [f"step {i}/4" for i in range(1, 5)]
    assert [s.split(":")[0] for s in steps if "val loss" in s] == ["step 2", "step 4"]


def test_moe_balancing_is_named_in_the_first_lines(capsys, tmp_path):
    """A run's first lines say how its experts are balanced, and say loudly when they are not (an explicit 0)."""
    source, moe = corpus(tmp_path / "corpus.txt"), ["--model.moe.n_experts", "4", "--model.moe.top_k", "2"]
    fast = [*fast_args(quiet=False), "--train.steps", "3"]
    code, out, err = run(capsys, "train", "--run-dir", tmp_path / "on", "--data.source", source, *TINY, *moe, *fast)
    assert code == 0, err
    first = out.splitlines()[:3]  # training ..., data: ..., moe: ...
    assert first[0].startswith("training ") and first[2] == "moe: 4 experts, top 2; balancing: expert_balance_coef=0.01"
    code, out, err = run(capsys, "train", "--run-dir", tmp_path / "off", "--data.source", source, *TINY, *moe, *fast,
                         "--model.moe.expert_balance_coef", "0")
    assert code == 0, err
    assert out.splitlines()[2].startswith("moe: 4 experts, top 2; balancing: OFF (every balancing coefficient")


def other_thread_count() -> int:
    """A torch thread count different from the current one, so that setting it is observable."""
    return 2 if torch.get_num_threads() == 1 else 1


def test_train_prints_next_steps_that_run(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # export writes exported/<run name> here
    source, threads, before = corpus(tmp_path / "corpus.txt"), other_thread_count(), torch.get_num_threads()
    try:
        code, out, err = run(capsys, "train", "--run-dir", "runs/my run", "--data.source", source, *TINY,
                             *[a for a in FAST if a != "--quiet"], "--train.steps", "2", "--threads", str(threads))
        assert code == 0, err
        assert torch.get_num_threads() == threads  # --threads reached torch
    finally:
        torch.set_num_threads(before)
    done = next(line for line in out.splitlines() if line.startswith("done: "))
    assert re.search(r"\(perplexity [\d.]+, [\d.]+ bits/byte\)", done), done  # a language model's measures
    spent = next(line for line in out.splitlines() if line.startswith("time: "))  # where the time went
    assert re.fullmatch(r"time: \w[\w ]* [\d.]+ s(, \w[\w ]* [\d.]+ s)+", spent) and "step " in spent, spent
    steps = out.split("\nnext:\n", 1)[1].splitlines()
    commands = [shlex.split(line, comments=True) for line in steps]
    assert [c[:3] for c in commands] == [["lmlab", "generate", "runs/my run"], ["lmlab", "eval", "runs/my run"],
                                         ["lmlab", "export", "runs/my run"]]
    for command in commands:  # each runs as printed
        assert cli.main(command[1:]) == 0, (command, capsys.readouterr().err)
    assert (tmp_path / "exported" / "my run" / "config.json").is_file()
    capsys.readouterr()
    code, out, err = run(capsys, "train", "--run-dir", "runs/quiet", "--data.source", source, *TINY, *FAST,
                         "--train.steps", "1", "--optim.lr", "1e-9")  # a sample, and a note: no better than unigram
    assert code == 0 and (out, err) == ("", "")  # --quiet: no done:, note:, sample:, time: or next: lines
    assert json.loads(Path("runs/quiet/metrics.jsonl").read_text().splitlines()[-1])["step"] == 1  # trained


def test_next_steps_follow_the_task():
    """After a classifier run, next: suggested 'perplexity and loss by position' (a language model's)."""
    lm, clf = cli.next_steps(Path("runs/a"), "lm"), cli.next_steps(Path("runs/c"), "classify")
    assert [line.split("#")[1].strip() for line in lm.splitlines()[1:]] == [
        "sample text", "validation loss, perplexity and loss by position", "a Hugging Face transformers checkpoint"]
    assert clf == "next:\n  lmlab eval runs/c  # validation loss, accuracy and the confusion matrix"


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_threads_sets_torch_threads_and_refuses_zero(trained, capsys, command):
    before, threads = torch.get_num_threads(), other_thread_count()
    extra = ["--max-batches", "1"] if command == "eval" else ["--max-new-tokens", "2"]
    try:
        code, _, err = run(capsys, command, trained / "run", *extra, "--threads", str(threads))
        assert code == 0 and torch.get_num_threads() == threads, err
    finally:
        torch.set_num_threads(before)
    err = bad_input(capsys, command, trained / "run", *extra, "--threads", "0")
    assert f"lmlab {command}: error: --threads 0 is not valid; give 1 or more" in err
    assert torch.get_num_threads() == before


def test_prepare_takes_threads_for_torch_and_the_tokenizer(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)  # restored after the test, as torch's count is
    before, threads, source = torch.get_num_threads(), other_thread_count(), corpus(tmp_path / "corpus.txt")
    try:
        code, out, err = run(capsys, "prepare", source, "--out", tmp_path / "data", "--tokenizer", "bpe",
                             "--vocab-size", "300", "--quiet", "--threads", str(threads))
        assert code == 0 and out == "", err  # --quiet: not even the summary line
        assert (tmp_path / "data" / "meta.json").is_file()
        assert torch.get_num_threads() == threads and os.environ["RAYON_NUM_THREADS"] == str(threads)
    finally:
        torch.set_num_threads(before)
    err = bad_input(capsys, "prepare", source, "--out", tmp_path / "other", "--threads", "0")
    assert "lmlab prepare: error: --threads 0 is not valid; give 1 or more" in err
    assert not (tmp_path / "other").exists()


def test_threads_as_a_config_field_points_at_the_flag(capsys, tmp_path):
    for command, field in ((["train", "--run-dir", str(tmp_path / "run")], "train.threads"),
                           (["eval", str(tmp_path / "run")], "model.threads")):
        err = bad_input(capsys, *command, f"--{field}", "1")
        assert err.endswith(f"--{field} is not a config field; torch's CPU threads are --threads N"), err
    assert not (tmp_path / "run").exists()


def test_threads_is_one_flag_on_every_command_that_computes():
    """train, eval, generate, prepare, sweep and experiment share one --threads (add_threads_arg)."""
    for name in ("train", "eval", "generate", "prepare", "sweep", "experiment"):
        action = next(a for a in subparser(name)._actions if "--threads" in a.option_strings)
        assert action.type is int and action.default is None and action.metavar == "N", name


def test_sweep_and_experiment_bad_input_is_one_line_exit_2(capsys, tmp_path):
    code, _, err = run(capsys, "sweep", tmp_path / "missing.yaml")
    assert code == 2 and "missing.yaml" in err and "does not exist" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "experiment", "attention", "--out", tmp_path / "x")
    assert code == 2 and "invalid choice" in err and not (tmp_path / "x").exists()


def test_print_config_resolves_overrides(capsys, tmp_path):
    (tmp_path / "run.yaml").write_text("model:\n  n_layers: 3\noptim:\n  lr: 0.01\n")
    code, out, _ = run(capsys, "train", "--config", tmp_path / "run.yaml", "--optim.lr", "1e-4", "--print-config")
    assert code == 0 and "n_layers: 3" in out and "lr: 0.0001" in out and not (Path("runs") / "default").exists()


def test_print_config_is_what_the_run_uses_on_prepared_data(capsys, tmp_path):
    """With --data DIR, --print-config shows the prepared data's fields and vocabulary, exactly the config the
    run then saves (it printed vocab_size 256, tokenizer byte, source builtin before)."""
    import yaml

    source, data = corpus(tmp_path / "corpus.txt"), tmp_path / "bpe"
    assert run(capsys, "prepare", source, "--out", data, "--tokenizer", "bpe", "--vocab-size", "300", "--quiet")[0] == 0
    vocab = json.loads((data / "meta.json").read_text())["vocab_size"]
    args = ["train", "--data", data, "--run-dir", tmp_path / "run", *TINY, *FAST, "--train.steps", "1"]
    code, out, err = run(capsys, *args, "--print-config")
    assert code == 0 and not (tmp_path / "run").exists(), err
    printed = yaml.safe_load(out)
    assert printed["model"]["vocab_size"] == vocab != 256
    assert printed["data"]["tokenizer"] == "bpe" and printed["data"]["source"] == str(source.resolve())
    assert printed["data"]["prepared"] == str(data.resolve())
    assert cli.main([str(a) for a in args]) == 0
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    saved.pop("provenance")
    assert saved == printed


def test_print_config_says_when_only_preparing_decides_the_vocabulary(capsys, tmp_path):
    source = corpus(tmp_path / "corpus.txt")
    code, out, err = run(capsys, "train", "--data.source", source, "--data.tokenizer", "char", "--print-config")
    assert code == 0 and "model.vocab_size is the vocabulary of tokenizer 'char'" in err and "vocab_size" in out
    code, out, err = run(capsys, "train", "--data.source", source, "--model.vocab_size", "512", "--print-config")
    assert code == 0 and "vocab_size: 256" in out and not err  # the byte tokenizer's, as the run trains with


# ============================================================== bad input: exit 2, one line, nothing written
def test_missing_and_empty_files(capsys, tmp_path):
    err = bad_input(capsys, "train", "--run-dir", tmp_path / "run", "--data.source", tmp_path / "nope.txt")
    assert "nope.txt" in err and err.startswith("lmlab train: error:")
    (tmp_path / "empty.txt").write_text("")
    err = bad_input(capsys, "train", "--run-dir", tmp_path / "run", "--data.source", tmp_path / "empty.txt")
    assert "empty.txt is empty" in err
    err = bad_input(capsys, "train", "--config", tmp_path / "none.yaml", "--run-dir", tmp_path / "run")
    assert "config file" in err and "none.yaml' does not exist" in err
    err = bad_input(capsys, "prepare", tmp_path / "nope.txt", "--out", tmp_path / "data")
    assert "nope.txt" in err
    err = bad_input(capsys, "eval", tmp_path / "no-run")
    assert "no-run' does not exist" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt"]  # no run or data directory was left


def test_corpus_shorter_than_a_context(capsys, tmp_path):
    (tmp_path / "short.txt").write_text("too short to fill a context of 32 bytes")
    err = bad_input(capsys, "train", "--run-dir", tmp_path / "run", "--data.source", tmp_path / "short.txt", *TINY)
    assert "too short for seq_len=32" in err
    assert not (tmp_path / "run").exists()


def test_undecodable_bytes_are_reported_or_replaced(capsys, tmp_path):
    text = corpus(tmp_path / "c.txt").read_bytes()
    (tmp_path / "bad.txt").write_bytes(text[:500] + b"\xff\xfe" + text[500:])
    err = bad_input(capsys, "prepare", tmp_path / "bad.txt", "--out", tmp_path / "data")
    assert f"{tmp_path / 'bad.txt'}: byte offset 500 (line 1) is not valid UTF-8 (byte 0xff)" in err
    assert "data.errors='replace'" in err
    err = bad_input(capsys, "train", "--run-dir", tmp_path / "run", "--data.source", tmp_path / "bad.txt")
    assert "byte offset 500" in err
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()
    code, out, _ = run(capsys, "prepare", tmp_path / "bad.txt", "--out", tmp_path / "data", "--errors", "replace")
    assert code == 0 and out.startswith(f"prepared {tmp_path / 'data'}")


def test_unknown_config_keys_suggest_the_closest(capsys, tmp_path):
    err = bad_input(capsys, "train", "--run-dir", tmp_path / "run", "--model.n_layer", "2")
    assert "unknown key 'model.n_layer'" in err and "did you mean 'n_layers'?" in err
    err = bad_input(capsys, "train", "--run-dir", tmp_path / "run", "--modle.n_layers", "2")
    assert "unknown config section 'modle'" in err and "did you mean 'model'?" in err
    err = bad_input(capsys, "train", "--run-dir", tmp_path / "run", "--optim.lr", "fast")
    assert "lr='fast' is not a number" in err
    (tmp_path / "run.yaml").write_text("model:\n  positon: rope\n")
    err = bad_input(capsys, "train", "--config", tmp_path / "run.yaml", "--run-dir", tmp_path / "run")
    assert "did you mean 'positions'?" in err
    err = bad_input(capsys, "train", "--run-dir", tmp_path / "run", "--bogus")
    assert "unrecognized arguments: --bogus" in err
    err = bad_input(capsys, "eval", tmp_path, "--optim.lr", "1")
    assert "unknown config section 'optim'" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]


def test_checkpoint_not_matching_the_config(trained, capsys):
    before = snapshot(trained / "run")
    err = bad_input(capsys, "eval", trained / "run", "--model.n_kv_heads", "4")
    assert (
        "does not match the model: tensor 'blocks.0.attn.qkv.weight' has shape (64, 32) in the checkpoint but (96, 32)"
        in err
    )
    assert "model.n_kv_heads is 2 in the checkpoint but 4 here" in err
    err = bad_input(capsys, "train", "--run-dir", trained / "run", "--resume", "--model.n_layers", "3")
    assert "tensor 'blocks.2.attn.qkv.weight' is missing from the checkpoint" in err and "model.n_layers is 2" in err
    assert snapshot(trained / "run") == before


def test_data_that_does_not_fit_the_model_is_refused_by_eval_and_by_train_init_from_alike(trained, capsys, tmp_path):
    """One check (DataMeta.check_tokenizer) behind both: another tokenizer, or ids beyond the vocabulary."""
    wide = tmp_path / "wide.txt"  # 300 distinct characters: a char vocabulary past the model's 256 ids
    wide.write_text("".join(" ".join(chr(0x4E00 + (i * 7 + j) % 300) * 3 for j in range(60)) + "\n" for i in range(40)))
    assert run(capsys, "prepare", wide, "--tokenizer", "char", "--out", tmp_path / "wide")[0] == 0
    top = json.loads((tmp_path / "wide" / "meta.json").read_text())["max_token_id"]
    model, data = str(trained / "run"), str(trained / "data")
    err = bad_input(capsys, "eval", model, "--data", data, "--tokenizer", tmp_path / "wide")
    assert err.endswith(f"the data in {data!r} was tokenized with another tokenizer than the model {model!r} "
                        f"(byte, vocab 256); prepare it with --tokenizer {tmp_path / 'wide'}"), err
    err = bad_input(capsys, "eval", model, "--data", tmp_path / "wide")
    assert err.endswith(f"the data in {str(tmp_path / 'wide')!r} holds token id {top}, beyond the vocabulary of the "
                        f"model {model!r} (model.vocab_size=256); prepare it with that model's tokenizer"), err

    train = ["train", "--run-dir", tmp_path / "run", "--data", tmp_path / "wide", *FAST, "--train.steps", "1"]
    err = bad_input(capsys, *train, "--train.init_from", model)  # the run's tokenizer: its data's
    assert err.endswith(f"the data in {str(tmp_path / 'wide')!r} was tokenized with another tokenizer than "
                        f"train.init_from {model!r} (char, vocab {top + 1}); prepare it with --tokenizer {data}"), err
    lone = tmp_path / "step_0000012"  # a checkpoint outside its run: no tokenizer to compare, the vocabulary still
    lone.mkdir()
    (lone / ckpt.WEIGHTS).write_bytes((trained / "run" / "checkpoints" / "step_0000012" / ckpt.WEIGHTS).read_bytes())
    err = bad_input(capsys, *train, "--train.init_from", lone)
    assert err.endswith(f"the data in {str(tmp_path / 'wide')!r} holds token id {top}, beyond the vocabulary of "
                        f"train.init_from {str(lone)!r} (model.vocab_size=256); prepare it with that model's tokenizer")
    assert not (tmp_path / "run").exists()


def test_a_mistyped_meta_json_field_is_one_line_naming_the_file_and_field(trained, capsys, tmp_path):
    (tmp_path / "data").mkdir()
    for p in (trained / "data").iterdir():
        (tmp_path / "data" / p.name).write_bytes(p.read_bytes())
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    (tmp_path / "data" / "meta.json").write_text(json.dumps({**meta, "train_tokens": "many"}))
    for args in (["eval", trained / "run"], ["train", "--run-dir", tmp_path / "run", *FAST]):
        code, _, err = run(capsys, *args, "--data", tmp_path / "data")
        assert code == 3 and "Traceback" not in err and err.count("\n") == 1, err
        assert f"{tmp_path / 'data' / 'meta.json'}: field 'train_tokens' is 'many' (str), not int; prepare again" in err


def test_run_dir_holding_another_run(trained, capsys):
    before = snapshot(trained / "run")
    err = bad_input(capsys, "train", "--run-dir", trained / "run", "--data", trained / "data",
                    *[("3" if k == "--model.n_layers" else a) for k, a in zip(["", *TINY], TINY)], *FAST,
                    "--train.steps", "12", "--eval.every", "6", "--checkpoint.every", "6")  # one field given once
    assert "already holds a different run (model.n_layers: 2 vs 3, there vs here)" in err and "--resume" in err
    err = bad_input(capsys, "train", "--run-dir", trained / "run")
    assert "already holds a different run" in err and "--overwrite" in err
    err = bad_input(capsys, "train", "--run-dir", trained / "run", "--resume", "--config", trained / "x.yaml")
    assert "--config cannot be combined with --resume" in err
    err = bad_input(capsys, "train", "--run-dir", trained / "run", "--resume", "--overwrite")
    assert "not allowed with argument" in err
    err = bad_input(capsys, "train", "--run-dir", trained / "nothing", "--resume")
    assert "nothing to resume" in err
    assert snapshot(trained / "run") == before


def test_learned_positions_past_their_table(capsys, tmp_path):
    source = corpus(tmp_path / "c.txt")
    code = cli.main(["train", "--run-dir", str(tmp_path / "run"), "--data.source", str(source), *TINY, *fast_args(),
                     "--model.positions", "learned", "--train.steps", "2", "--eval.every", "2"])
    assert code == 0
    err = bad_input(capsys, "eval", tmp_path / "run", "--seq-len", "64")
    assert "positions='learned' has a table of max_seq_len=32 positions" in err
    err = bad_input(capsys, "generate", tmp_path / "run", "--max-new-tokens", "100")
    assert "exceeds max_seq_len=32" in err


# ============================================================== signals
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_saves_a_checkpoint_and_resume_continues(capsys, tmp_path, sig):
    source = corpus(tmp_path / "c.txt")
    run_dir = tmp_path / "run"
    args = ["train", "--run-dir", str(run_dir), "--data.source", str(source), *TINY, *FAST, "--train.steps", "100000",
            "--eval.every", "100000", "--checkpoint.every", "100000"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "lmlab.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.1)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err[-2000:]
    (step, path), = ckpt.list_checkpoints(run_dir / "checkpoints")
    assert step >= 2 and f"stopped at step {step}; checkpoint {path}" in out and "--resume" in out
    assert ckpt.load_state(path)["step"] == step
    code, out, _ = run(capsys, "train", "--run-dir", run_dir, "--resume", "--train.steps", str(step + 2))
    assert code == 0 and f"done: step {step + 2}" in out
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == step + 2


# ============================================================== a Hugging Face checkpoint
def test_generate_from_a_hugging_face_directory(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("lmlab.hf")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())  # GPT-2 style byte-level BPE: spaces live in the tokens
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    prompt_ids = tok.encode("the model learns").ids
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0]
    code, out, _ = run(capsys, "generate", tmp_path / "hf", "--prompt", "the model learns", "--max-new-tokens", "8",
                       "--temperature", "0")
    assert code == 0
    assert out == "the model learns" + tok.decode(want[len(prompt_ids):].tolist()) + "\n"
    (tmp_path / "hf" / "tokenizer.json").unlink()
    err = bad_input(capsys, "generate", tmp_path / "hf")
    assert "has no tokenizer.json" in err
    err = bad_input(capsys, "eval", tmp_path / "hf")
    assert "is a Hugging Face checkpoint; give prepared data" in err


# ============================================================== export to transformers
def test_export_a_run_and_load_it_with_transformers(trained, capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    code, out, _ = run(capsys, "export", "--help")
    assert code == 0 and "(default: 5GB)" in " ".join(out.split()) and "exit status" in out
    code, out, _ = run(capsys, "export", trained / "run", "--out", tmp_path / "hf", "--checkpoint", "latest")
    assert code == 0 and "(step_0000012) as llama to" in out and "tokenizer: byte tokenizer as tokenizer.json" in out
    loaded = load_run(trained / "run", checkpoint="latest")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")("the model learns")["input_ids"]
    assert ids == loaded.tokenizer.encode("the model learns")
    with torch.no_grad():
        torch.testing.assert_close(hf(torch.tensor([ids])).logits, loaded.model(torch.tensor([ids])).logits,
                                   rtol=1e-4, atol=1e-4)
    # the exported directory serves lmlab too: greedy text as from the run itself
    greedy = ["--prompt", "the ", "--max-new-tokens", "12", "--temperature", "0"]
    assert run(capsys, "generate", trained / "run", "--checkpoint", "latest", *greedy)[1] == \
        run(capsys, "generate", tmp_path / "hf", *greedy)[1]
    # one checkpoint directory of the run; and an exported directory exported again, unchanged
    code, out, _ = run(capsys, "export", trained / "run" / "checkpoints" / "step_0000006", "--out", tmp_path / "six")
    assert code == 0 and "(step_0000006)" in out
    assert run(capsys, "export", tmp_path / "hf", "--out", tmp_path / "again")[0] == 0
    assert snapshot(tmp_path / "again") == snapshot(tmp_path / "hf")


def test_export_bad_input_is_one_line_exit_2_and_writes_nothing(trained, capsys, tmp_path):
    import shutil

    import yaml

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    err = bad_input(capsys, "export", trained / "run", "--out", tmp_path / "full")
    assert "exists and is not empty; pass --overwrite" in err
    untrained = tmp_path / "untrained"
    untrained.mkdir()
    shutil.copy(trained / "run" / "config.yaml", untrained)
    assert "no checkpoint in" in bad_input(capsys, "export", untrained, "--out", tmp_path / "o1")
    alibi = tmp_path / "alibi"  # same weights (ALiBi has no parameters), a position scheme transformers lacks
    shutil.copytree(trained / "run", alibi)
    config = yaml.safe_load((alibi / "config.yaml").read_text())
    config["model"]["positions"] = "alibi"
    (alibi / "config.yaml").write_text(yaml.safe_dump(config))
    err = bad_input(capsys, "export", alibi, "--out", tmp_path / "o2")
    assert "positions='alibi' has no exact transformers architecture" in err
    err = bad_input(capsys, "export", trained / "run", "--out", tmp_path / "o3", "--architecture", "gpt2")
    assert "cannot export as 'gpt2'" in err
    loose = tmp_path / "loose" / "checkpoints" / "step_0000006"  # a checkpoint copied out of its run
    shutil.copytree(trained / "run" / "checkpoints" / "step_0000006", loose)
    assert "is not inside a run directory" in bad_input(capsys, "export", loose, "--out", tmp_path / "o4")
    assert "does not exist" in bad_input(capsys, "export", tmp_path / "nothing", "--out", tmp_path / "o5")
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 6))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"


def test_load_run_and_read_metrics_are_lmlab_names(trained):
    """Reading a run back is public API: ``lmlab.load_run`` and ``lmlab.read_metrics`` (documented in training.md)."""
    import lmlab
    from lmlab.run.metrics import read_metrics

    assert {"load_run", "read_metrics"} <= set(lmlab.__all__) and lmlab.read_metrics is read_metrics
    assert lmlab.load_run is load_run and lmlab.load_run(trained / "run").step == 12
    assert [r["step"] for r in lmlab.read_metrics(trained / "run") if "val_loss" in r] == [6, 12]
