"""The run config's sections (train, optim, eval, checkpoint, log, parallel): each validates itself
naming ``section.field``; the old one-section keys (``train.lr``, ...) are read as the new ones for
one release, with a one-line note; and a run directory written with the old layout still loads,
evaluates and resumes (tests/fixtures/old_layout_run)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from lmlab import cli
from lmlab.experiments.spec import parse_spec
from lmlab.run import config as run_config
from lmlab.run.config import (
    RENAMED,
    CheckpointConfig,
    EvalConfig,
    LogConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
    build_config,
    load_config,
    one_section_dict,
)

OLD_RUN = Path(__file__).resolve().parent / "fixtures" / "old_layout_run"

# every old key with a valid value that is not its default (with a model that has experts to split)
OLD = {"train.lr": 5e-4, "train.min_lr": 1e-5, "train.warmup_steps": 7, "train.weight_decay": 0.05,
       "train.betas": [0.8, 0.99], "train.eps": 1e-6, "train.grad_clip": 0.5, "train.eval_every": 7,
       "train.eval_batches": 3, "train.save_every": 9, "train.keep_last": 4, "train.save_mode": "async",
       "train.log_every": 3, "train.tensorboard": False, "train.sample_every": 5, "train.sample_tokens": 11,
       "train.sample_prompt": "Once", "train.parallel": "fsdp", "train.expert_parallel": 2,
       "train.activation_checkpointing": "blocks", "train.activation_checkpoint_every": 2,
       "train.collective_timeout": 30.0, "train.setup_timeout": 60.0}
MOE = {"model.preset": "mixtral", "model.n_layers": 1}


@pytest.fixture
def notes(monkeypatch, capsys):
    """A fresh process's view of the notes (none given yet); returns a reader of the lines printed since."""
    monkeypatch.setattr(run_config, "NOTED", set())
    capsys.readouterr()
    return lambda: [line for line in capsys.readouterr().err.splitlines() if line]


def nested(dotted: dict) -> dict:
    """``{"optim.lr": 1}`` -> ``{"optim": {"lr": 1}}`` (one level, as a YAML file writes sections)."""
    out: dict = {}
    for key, value in dotted.items():
        section, field = key.split(".", 1)
        out.setdefault(section, {})[field] = value
    return out


# ============================================================== the sections
@pytest.mark.parametrize("make, message", [
    (lambda: TrainConfig(steps=0), r"^train\.steps=0 is not valid; it must be > 0$"),
    (lambda: TrainConfig(seq_len=-4), r"^train\.seq_len=-4 is not valid; it must be > 0$"),
    (lambda: TrainConfig(max_memory_gib=0.0), r"^train\.max_memory_gib=0\.0 is not valid; it must be > 0$"),
    (lambda: TrainConfig(device="gpu"), r"^train\.device='gpu' is not a device; use auto, cpu, cuda, cuda:N or mps$"),
    (lambda: TrainConfig(init_from=" "), r"^train\.init_from='' is not valid; name a run"),
    (lambda: TrainConfig(steps="many"), r"^train\.steps='many' is not an integer$"),
    (lambda: OptimConfig(lr=0.0), r"^optim\.lr=0\.0 is not valid; it must be > 0$"),
    (lambda: OptimConfig(warmup_steps=-1), r"^optim\.warmup_steps=-1 is not valid; it must be >= 0$"),
    (lambda: OptimConfig(lr=1e-3, min_lr=1e-2),
     r"^optim\.min_lr=0\.01 is above optim\.lr=0\.001; choose min_lr <= lr$"),
    (lambda: OptimConfig(betas=(0.9, 1.0)),
     r"^optim\.betas\[1\]=1\.0 is out of range; it must be in \[0\.0, 0\.9999\]$"),
    (lambda: OptimConfig(betas=(0.9, "x")), r"^optim\.betas\[1\]='x' is not a number$"),
    (lambda: EvalConfig(every=0), r"^eval\.every=0 is not valid; it must be > 0$"),
    (lambda: EvalConfig(batches=-2), r"^eval\.batches=-2 is not valid; it must be > 0$"),
    (lambda: CheckpointConfig(every=0), r"^checkpoint\.every=0 is not valid; it must be > 0$"),
    (lambda: CheckpointConfig(keep_last=0), r"^checkpoint\.keep_last=0 is not valid; it must be > 0$"),
    (lambda: CheckpointConfig(mode="later"),
     r"^checkpoint\.mode='later' is not a valid choice; choose one of \['sync', 'async'\]$"),
    (lambda: LogConfig(every=0), r"^log\.every=0 is not valid; it must be > 0$"),
    (lambda: LogConfig(sample_tokens=-1), r"^log\.sample_tokens=-1 is not valid; it must be >= 0$"),
    (lambda: LogConfig(tensorboard="maybe"), r"^log\.tensorboard='maybe' is not a boolean; use true or false$"),
    (lambda: ParallelConfig(strategy="tp"),
     r"^parallel\.strategy='tp' is not a valid choice; choose one of \['ddp', 'fsdp'\]$"),
    (lambda: ParallelConfig(experts=0), r"^parallel\.experts=0 is not valid; it must be > 0$"),
    (lambda: ParallelConfig(collective_timeout=0.0),
     r"^parallel\.collective_timeout=0\.0 is not valid; it must be > 0$"),
    (lambda: ParallelConfig(activation_checkpointing="all"),
     r"^parallel\.activation_checkpointing='all' is not a valid choice; choose one of \['none', 'blocks'\]$"),
])
def test_each_section_validates_its_fields_naming_section_and_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_section_defaults_are_the_demo_run_and_each_field_is_in_one_section():
    cfg = RunConfig()
    assert (cfg.train.steps, cfg.train.batch_size, cfg.train.grad_accum, cfg.train.device) == (1500, 16, 1, "auto")
    assert cfg.optim == OptimConfig(lr=2e-3, min_lr=None, warmup_steps=100, weight_decay=0.1, betas=(0.9, 0.95),
                                    eps=1e-8, grad_clip=1.0)
    assert (cfg.eval.every, cfg.eval.batches) == (250, 20)
    assert (cfg.checkpoint.every, cfg.checkpoint.keep_last, cfg.checkpoint.mode) == (500, 2, "sync")
    assert (cfg.log.every, cfg.log.tensorboard, cfg.log.sample_every, cfg.log.sample_tokens) == (10, True, 0, 200)
    assert cfg.parallel == ParallelConfig(strategy="ddp", experts=1, activation_checkpointing="none",
                                          activation_checkpoint_every=1, collective_timeout=600.0, setup_timeout=3600.0)
    assert list(cfg.to_dict()) == ["task", "model", "data", "train", "optim", "eval", "checkpoint", "log", "parallel"]
    assert set(cfg.train.to_dict()) == {"steps", "batch_size", "seq_len", "grad_accum", "seed", "device", "compile",
                                        "max_bad_steps", "init_from", "max_memory_gib", "repeats", "lookup"}
    assert cli.run_sections() == tuple(RunConfig.field_names()[1:])  # every section takes --SECTION.FIELD


@pytest.mark.parametrize("changes, message", [
    ({"train.seq_len": 64, "model.max_seq_len": 32},
     r"^train\.seq_len=64 is longer than model\.max_seq_len=32, the model's training context; raise"),
    ({"parallel.experts": 2},
     r"^parallel\.experts=2 needs a mixture-of-experts model \(model\.moe\); set parallel\.experts=1"),
    ({**MOE, "parallel.experts": 3},
     r"^parallel\.experts=3 does not divide the 8 routed experts of each MoE layer; "
     r"choose parallel\.experts in \[2, 4, 8\]$"),
    ({"checkpoint.mode": "async"},
     r"^checkpoint\.mode=async writes sharded \(DCP\) checkpoints, which parallel\.strategy=fsdp or "
     r"parallel\.experts > 1 use; set checkpoint\.mode=sync under ddp$"),
    ({"eval.every": "0"}, r"^eval\.every=0 is not valid; it must be > 0$"),  # dotted, as from the command line
])
def test_cross_section_checks_name_the_new_keys(changes, message):
    with pytest.raises(ValueError, match=message):
        build_config(changes)


def test_cross_section_checks_pass_what_they_should():
    assert build_config({"checkpoint.mode": "async", "parallel.strategy": "fsdp"}).checkpoint.mode == "async"
    assert build_config({**MOE, "checkpoint.mode": "async", "parallel.experts": 4}).parallel.experts == 4
    assert build_config({"train.seq_len": 32, "model.max_seq_len": 32}).seq_len == 32


# ============================================================== the old keys, for one release
def test_every_old_key_reads_as_its_new_one_with_one_note_once(notes):
    new = {RENAMED[k]: v for k, v in OLD.items()}
    assert len(RENAMED) == len(OLD) == 23 and len(set(RENAMED.values())) == 23
    want = build_config({**MOE, **new})
    assert notes() == []
    got = build_config({**MOE, **OLD})
    assert got == want
    assert want.optim == OptimConfig(lr=5e-4, min_lr=1e-5, warmup_steps=7, weight_decay=0.05, betas=(0.8, 0.99),
                                     eps=1e-6, grad_clip=0.5)
    assert want.eval == EvalConfig(every=7, batches=3)
    assert want.checkpoint == CheckpointConfig(every=9, keep_last=4, mode="async")
    assert want.log == LogConfig(every=3, tensorboard=False, sample_every=5, sample_tokens=11, sample_prompt="Once")
    assert want.parallel == ParallelConfig(strategy="fsdp", experts=2, activation_checkpointing="blocks",
                                           activation_checkpoint_every=2, collective_timeout=30.0, setup_timeout=60.0)
    lines = notes()
    assert len(lines) == 1 and lines[0].startswith("lmlab: note: old config keys in the config, read as the new ones")
    assert all(f"{old} -> {new_key}" in lines[0] for old, new_key in RENAMED.items())
    assert build_config({**MOE, **OLD}) == want and notes() == []  # each key is noted once per process
    assert RunConfig().override({"train.lr": 1e-4}).optim.lr == 1e-4 and notes() == []


def test_old_keys_in_a_yaml_file_and_in_overrides_give_the_same_config(tmp_path, notes):
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text("model: {n_layers: 2}\n"
                   "train: {steps: 30, lr: 1.0e-3, eval_every: 6, parallel: ddp, tensorboard: false}\n")
    new.write_text("model: {n_layers: 2}\ntrain: {steps: 30}\noptim: {lr: 1.0e-3}\neval: {every: 6}\n"
                   "parallel: {strategy: ddp}\nlog: {tensorboard: false}\n")
    cfg = load_config(new)
    assert notes() == []
    assert load_config(old) == cfg
    assert (cfg.optim.lr, cfg.eval.every, cfg.log.tensorboard, cfg.train.steps) == (1e-3, 6, False, 30)
    assert notes() == [f"lmlab: note: old config keys in config file {str(old)!r}, read as the new ones in this "
                       "release only; rename them: train.lr -> optim.lr, train.eval_every -> eval.every, "
                       "train.parallel -> parallel.strategy, train.tensorboard -> log.tensorboard"]
    assert load_config(new, {"train.save_every": "12"}) == cfg.override({"checkpoint.every": 12})
    assert notes() == ["lmlab: note: old config keys in the overrides, read as the new ones in this release only; "
                       "rename them: train.save_every -> checkpoint.every"]
    assert load_config(old, {"optim.lr": "2e-3"}).optim.lr == 2e-3  # an override wins over the file, old name or new
    assert load_config(new, {"train.lr": "3e-3"}).optim.lr == 3e-3


def test_a_field_given_under_its_old_and_its_new_name_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"^the config: 'train\.lr' and 'optim\.lr' are the same field given twice "
                                         r"\(train\.lr is its old name\); keep optim\.lr$"):
        build_config({"train.lr": 1e-3, "optim.lr": 2e-3})
    both = tmp_path / "both.yaml"
    both.write_text("train:\n  eval_every: 5\neval:\n  every: 6\n")
    with pytest.raises(ValueError, match=r"both\.yaml': 'train\.eval_every' and 'eval\.every' are the same field"):
        load_config(both)
    with pytest.raises(ValueError, match=r"^the overrides: 'train\.parallel' and 'parallel\.strategy' are the same"):
        load_config(None, {"train.parallel": "ddp", "parallel.strategy": "ddp"})
    code = cli.main(["train", "--train.save_mode", "sync", "--checkpoint.mode", "sync", "--print-config"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "lmlab train: error: the overrides: 'train.save_mode' and 'checkpoint.mode' are the same field" in err


def test_print_config_shows_the_sections_and_takes_old_keys_with_a_note(capsys, notes):
    code = cli.main(["train", "--train.lr", "1e-4", "--log.every", "3", "--print-config"])
    out, err = capsys.readouterr()
    printed = yaml.safe_load(out)
    assert code == 0
    assert list(printed) == ["task", "model", "data", "train", "optim", "eval", "checkpoint", "log", "parallel"]
    assert printed["optim"]["lr"] == 1e-4 and printed["log"]["every"] == 3 and "lr" not in printed["train"]
    assert printed["parallel"] == {"strategy": "ddp", "experts": 1, "activation_checkpointing": "none",
                                   "activation_checkpoint_every": 1, "collective_timeout": 600.0,
                                   "setup_timeout": 3600.0}
    assert err.splitlines() == ["lmlab: note: old config keys in the overrides, read as the new ones in this release "
                                "only; rename them: train.lr -> optim.lr"]


def test_sweep_specs_take_old_keys_in_base_variants_and_tune(notes):
    def spec(train, optim, lr_key):
        return {"name": "t", "base": {"model": {"d_model": 32, "n_layers": 1, "n_heads": 4, "max_seq_len": 32},
                                      "train": train, **optim},
                "variants": [{"name": "a", "overrides": {lr_key: 1e-3}}, {"name": "b", "overrides": {}}],
                "tune": {"field": lr_key, "values": [1e-3, 3e-3], "overrides": {"train.steps": 2}}}

    new = parse_spec(spec({"steps": 4}, {"eval": {"every": 2}, "optim": {"warmup_steps": 1}}, "optim.lr")).resolve()
    assert notes() == []
    old = parse_spec(spec({"steps": 4, "eval_every": 2, "warmup_steps": 1}, {}, "train.lr"), "old.yaml").resolve()
    assert old.configs == new.configs and old.tune.field == new.tune.field == "optim.lr"
    assert (new.configs["a"].optim.lr, new.configs["b"].optim.lr, new.configs["b"].eval.every) == (1e-3, 2e-3, 2)
    assert old.tune_spec().configs == new.tune_spec().configs
    assert notes() == [
        "lmlab: note: old config keys in variant 'a' overrides, read as the new ones in this release only; "
        "rename them: train.lr -> optim.lr",
        "lmlab: note: old config keys in old.yaml: base, read as the new ones in this release only; rename them: "
        "train.eval_every -> eval.every, train.warmup_steps -> optim.warmup_steps"]  # the tune field's train.lr: noted


# ============================================================== a run written with the old layout
def test_an_old_layout_saved_config_loads_as_the_new_sections(notes):
    saved = yaml.safe_load((OLD_RUN / "config.yaml").read_text())
    assert "lr" in saved["train"] and "optim" not in saved  # the fixture is the old layout
    cfg = load_config(OLD_RUN / "config.yaml")
    assert (cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len, cfg.train.device) == (4, 2, 16, "auto")
    assert cfg.optim == OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1)
    assert (cfg.eval, cfg.checkpoint) == (EvalConfig(every=1, batches=1), CheckpointConfig(every=1, keep_last=1))
    assert cfg.log == LogConfig(every=1, tensorboard=False, sample_tokens=8) and cfg.parallel == ParallelConfig()
    # the table covers every old key: the new config, laid out the old way, is the saved file
    del saved["provenance"]
    got = one_section_dict(cfg.identity_dict())  # fields declared with schema.added are left out at their defaults
    assert got["train"].pop("repeats") is None  # a field newer than the fixture: off, its default
    assert got == saved
    lines = notes()
    assert len(lines) == 1 and lines[0].count(" -> ") == 23 and "old_layout_run/config.yaml'" in lines[0]


def test_an_old_layout_run_evaluates_and_resumes_exactly_with_the_new_code(tmp_path, capsys):
    run = tmp_path / "old"
    shutil.copytree(OLD_RUN, run)
    before = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in before] == [1, 2]  # stopped after 2 of its 4 steps

    def evaluate(checkpoint: str) -> dict:
        code = cli.main(["eval", str(run), "--checkpoint", checkpoint, "--json", "--batch-size", "2",
                         "--max-batches", "1", "--device", "cpu"])
        assert code == 0
        return json.loads(capsys.readouterr().out)

    report = evaluate("latest")
    assert report["step"] == 2 and report["loss"] == pytest.approx(before[1]["val_loss"], rel=1e-6)

    code = cli.main(["train", "--run-dir", str(run), "--resume", "--quiet", "--train.device", "cpu"])
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    after = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in after] == [1, 2, 3, 4] and after[:2] == before
    saved = yaml.safe_load((run / "config.yaml").read_text())  # rewritten in the new layout, history kept
    assert saved["optim"]["lr"] == 1e-2 and saved["eval"]["every"] == 1 and "lr" not in saved["train"]
    assert [p["step"] for p in saved["provenance"]] == [0, 2]
    assert evaluate("latest")["loss"] == pytest.approx(after[3]["val_loss"], rel=1e-6)

    # the same checkpoint resumed under a config written by hand with the new keys only: the same state on
    # the same machine, so steps 3-4 match exactly; this is what pins the translation of every old key
    keys = ("step", "loss", "lr", "grad_norm", "val_loss")
    ref = tmp_path / "new_layout"
    shutil.copytree(OLD_RUN, ref)
    old_config = yaml.safe_load((OLD_RUN / "config.yaml").read_text())
    (ref / "config.yaml").write_text(yaml.safe_dump({
        "task": "lm", "model": old_config["model"], "data": old_config["data"],
        "train": {"steps": 4, "batch_size": 2, "seq_len": 16, "seed": 0, "device": "cpu"},
        "optim": {"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 1, "weight_decay": 0.1, "betas": [0.9, 0.95],
                  "eps": 1e-8, "grad_clip": 1.0},
        "eval": {"every": 1, "batches": 1}, "checkpoint": {"every": 1, "keep_last": 1},
        "log": {"every": 1, "tensorboard": False, "sample_every": 0},
        "provenance": old_config["provenance"]}))
    code = cli.main(["train", "--run-dir", str(ref), "--resume", "--quiet"])
    assert code == 0, capsys.readouterr().err
    by_hand = [json.loads(line) for line in (ref / "metrics.jsonl").read_text().splitlines()]
    assert [{k: r[k] for k in keys} for r in by_hand] == [{k: r[k] for k in keys} for r in after]

    # the same 4 steps from scratch with the new keys: the trajectory the resumed run continues. Not bit for
    # bit: the fixture's steps 1-2 were computed on another CPU, whose kernels round differently (the step-2
    # weights differ by ~6e-8 on an AVX-512 machine), so the losses agree to float32 accumulation, not exactly
    (tmp_path / "new.yaml").write_text(yaml.safe_dump({
        "model": saved["model"], "data": {"prepared": str(run / "data")},
        "train": {"steps": 4, "batch_size": 2, "seq_len": 16, "device": "cpu"},
        "optim": {"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 1}, "eval": {"every": 1, "batches": 1},
        "checkpoint": {"every": 1, "keep_last": 1}, "log": {"every": 1, "tensorboard": False, "sample_tokens": 0}}))
    code = cli.main(["train", "--config", str(tmp_path / "new.yaml"), "--run-dir", str(tmp_path / "fresh"), "--quiet"])
    assert code == 0, capsys.readouterr().err
    fresh = [json.loads(line) for line in (tmp_path / "fresh" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["lr"]) for r in fresh] == [(r["step"], r["lr"]) for r in after]
    for key in ("loss", "grad_norm", "val_loss"):
        assert [r[key] for r in fresh] == pytest.approx([r[key] for r in after], rel=1e-5), key
