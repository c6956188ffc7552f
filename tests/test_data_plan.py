"""The data is resolved once: ``lmlab train`` builds one DataPlan from ``--data`` / ``data.*`` and hands it
to the trainer, which opens (or prepares) the data through it; nothing on the way resolves the paths again.

The walk is counted, not assumed: every call of the resolving functions is seen by a profiler hook on
their code objects, whichever module imported them under whatever name."""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import pytest
import yaml
from helpers import TINY_ARGS, corpus, fast_args

from lmlab import cli
from lmlab.run.config import RunConfig
from lmlab.run.data import binding, config, meta, prepare
from lmlab.run.data.binding import DataPlan
from lmlab.run.trainer import Trainer

FAST = [*TINY_ARGS, *fast_args(), "--train.steps", "2", "--eval.every", "2", "--checkpoint.every", "2"]
WATCHED = {"resolve": DataPlan.resolve.__func__, "resolve_paths": config.resolve_paths,
           "prepare": prepare.prepare, "meta.json read": meta.DataMeta.read.__func__}


@contextlib.contextmanager
def calls(functions: dict[str, Callable]) -> Iterator[Counter]:
    """How many times each of ``functions`` is called inside the block, by name."""
    codes = {f.__code__: name for name, f in functions.items()}
    counts: Counter = Counter()

    def hook(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            counts[codes[frame.f_code]] += 1

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        yield counts
    finally:
        sys.setprofile(previous)


def train(*args) -> Counter:
    with calls(WATCHED) as counts:
        assert cli.main([str(a) for a in args]) == 0
    return counts


def test_cmd_train_resolves_its_data_once_fresh_resumed_prepared_and_printed(tmp_path, capsys):
    text = corpus(tmp_path / "corpus.txt")
    fresh = train("train", "--run-dir", tmp_path / "run", "--data.source", text, *FAST)
    assert (fresh["resolve"], fresh["resolve_paths"], fresh["prepare"]) == (1, 1, 1)
    resumed = train("train", "--run-dir", tmp_path / "run", "--resume", "--train.steps", "3")
    assert (resumed["resolve"], resumed["resolve_paths"], resumed["prepare"]) == (1, 1, 0)

    assert cli.main(["prepare", str(text), "--out", str(tmp_path / "data"), "--quiet"]) == 0
    on_prepared = train("train", "--run-dir", tmp_path / "other", "--data", tmp_path / "data", *FAST)
    assert (on_prepared["resolve"], on_prepared["resolve_paths"], on_prepared["prepare"]) == (1, 1, 0)
    printed = train("train", "--run-dir", tmp_path / "third", "--data", tmp_path / "data", "--print-config")
    assert (printed["resolve"], printed["resolve_paths"], printed["meta.json read"]) == (1, 1, 1)
    capsys.readouterr()


def test_prepare_alone_resolves_once_and_records_the_source_as_given(tmp_path, monkeypatch):
    """``lmlab prepare`` has no plan: prepare resolves the paths itself, once; meta.json's config keeps
    the relative source it was given, its ``source`` the absolute one."""
    corpus(tmp_path / "corpus.txt")
    monkeypatch.chdir(tmp_path)
    with calls(WATCHED) as counts:
        assert cli.main(["prepare", "corpus.txt", "--out", "data", "--quiet"]) == 0
    assert counts["resolve_paths"] == 1 and counts["resolve"] == 0
    written = meta.DataMeta.read(tmp_path / "data")
    assert written.config["source"] == "corpus.txt" and written.source == str(tmp_path / "corpus.txt")


def test_the_plan_holds_what_the_run_records(tmp_path, monkeypatch):
    """Relative paths made absolute; the run's own data inside the run (``own``: --overwrite may replace it);
    with --data, the prepared data's settings and its meta.json, read once while resolving."""
    corpus(tmp_path / "corpus.txt")
    monkeypatch.chdir(tmp_path)
    cfg = RunConfig().override({"data.source": "corpus.txt"})
    plan = DataPlan.resolve(cfg, "run")
    assert plan.config.data.source == str(tmp_path / "corpus.txt") and plan.asked == cfg
    assert plan.dir == Path("run") / "data" and plan.own and not plan.prepared and plan.meta is None

    shared = DataPlan.resolve(cfg.override({"data.dir": str(tmp_path / "shared")}), "run")
    assert shared.dir == tmp_path / "shared" and not shared.own

    prepare.prepare(cfg.data, "data", seq_len=32)
    with calls(WATCHED) as counts:
        on_data = DataPlan.resolve(RunConfig().override({"data.prepared": "data"}), "run")
    assert counts["meta.json read"] == 1
    assert on_data.prepared and on_data.dir == tmp_path / "data" and on_data.meta.data_hash
    assert on_data.config.data.source == str(tmp_path / "corpus.txt")
    assert on_data.planned()[0].model.vocab_size == 256


def test_a_trainer_refuses_a_plan_resolved_for_another_run(tmp_path):
    """The Python API: a Trainer handed a plan checks it was resolved for its config, directory and resume,
    before anything is written."""
    cfg = RunConfig().override({**{f"model.{k}": v for k, v in
                                   dict(d_model=32, n_layers=2, n_heads=4, max_seq_len=32).items()},
                                "train.device": "cpu", "log.tensorboard": False})
    plan = DataPlan.resolve(cfg, tmp_path / "a")
    for other in (dict(run_dir=tmp_path / "b"), dict(resume=True), dict(cfg=cfg.override({"train.seed": 7}))):
        kwargs = {"cfg": cfg, "run_dir": tmp_path / "a", **other}
        with pytest.raises(ValueError, match="the data was resolved for another run"):
            Trainer(kwargs.pop("cfg"), kwargs.pop("run_dir"), data=plan, quiet=True, **kwargs)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_run_records_the_resolved_data(tmp_path, capsys):
    """What the plan resolved is what config.yaml holds: absolute paths, the data the run trained on."""
    text = corpus(tmp_path / "corpus.txt")
    train("train", "--run-dir", tmp_path / "run", "--data.source", text, *FAST)
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["data"]["source"] == str(text) and saved["data"].get("prepared") is None
    assert saved["provenance"][-1]["data"]["path"] == str(tmp_path / "run" / "data")
    assert binding.recorded_identity(saved["provenance"])["data_hash"].startswith("sha256:")
    capsys.readouterr()
