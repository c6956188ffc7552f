"""A run's starting point and bookkeeping: presets and init_from in the config, the classifier's
loss, honest warnings, and TensorBoard points that survive a resume."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from helpers import FAST_RUN, TINY_MODEL, corpus

import lmlab
from lmlab.run.checkpoint import local as ckpt
from lmlab.run.config import RunConfig, build_config, load_config
from lmlab.run.data.config import DataConfig
from lmlab.run.trainer import Trainer

TINY = TINY_MODEL


FAST = FAST_RUN


def run_config(tmp_path: Path, changes: dict | None = None) -> RunConfig:
    """A tiny run on a word corpus in ``tmp_path``: FAST, then dotted ``changes``."""
    source = tmp_path / "corpus.txt"
    if not source.exists():
        corpus(source)
    base = RunConfig(model=lmlab.ModelConfig.from_preset("llama", **TINY), data=DataConfig(source=str(source)))
    return base.override({**FAST, **(changes or {})})


def fit(cfg: RunConfig, run_dir: Path, callbacks=(), **kw):
    with Trainer(cfg, run_dir, quiet=kw.pop("quiet", True), callbacks=list(callbacks), **kw) as trainer:
        return trainer.fit(), trainer


# ============================================================== presets and init_from in the config
def test_presets_in_yaml_and_on_the_command_line(tmp_path):
    (tmp_path / "run.yaml").write_text("model:\n  preset: gpt2\n  n_layers: 2\n  d_model: 64\ndata: prepared/here\n")
    cfg = load_config(tmp_path / "run.yaml")
    assert cfg.model == lmlab.ModelConfig.from_preset("gpt2", n_layers=2, d_model=64)
    assert cfg.data.prepared == "prepared/here"  # data: DIR is data.prepared
    cfg = load_config(tmp_path / "run.yaml", {"model.preset": "mixtral"})  # the command line's preset wins ...
    assert cfg.model == lmlab.ModelConfig.from_preset("mixtral", n_layers=2, d_model=64)  # ... YAML fields still apply
    assert build_config({"model.preset": "deepseek-v3"}).model == lmlab.ModelConfig.from_preset("deepseek-v3")
    with pytest.raises(ValueError, match=r"unknown preset 'lama' \(did you mean 'llama'\?\)"):
        build_config({"model.preset": "lama"})
    with pytest.raises(ValueError, match=r"model.preset chooses the model of a new run"):
        build_config({"model.preset": "llama"}, resolved=True)


def test_init_from_a_run_or_its_checkpoint_starts_from_its_config_and_weights(tmp_path):
    cfg = run_config(tmp_path, {"train.steps": 4, "eval.every": 4, "checkpoint.every": 4})
    cfg = cfg.override({"model.n_layers": 3, "model.positions": "alibi"})
    fit(cfg, tmp_path / "base")
    base = ckpt.resolve(tmp_path / "base" / "checkpoints", "best")
    for source in (tmp_path / "base", base):
        tuned = load_config(None, {"train.init_from": str(source), "train.steps": "1", "optim.lr": "1e-12",
                                   "optim.weight_decay": "0", "data.source": str(tmp_path / "corpus.txt"),
                                   "eval.every": "1", "log.tensorboard": "false", "log.sample_tokens": "0",
                                   "train.batch_size": "4", "eval.batches": "1", "train.device": "cpu"})
        assert tuned.model == cfg.model  # the model section starts from the weights' config
        _, trainer = fit(tuned, tmp_path / f"tuned-{source.name}")
        reference = lmlab.Transformer(cfg.model)
        ckpt.load_weights(reference, base / ckpt.WEIGHTS)
        for p, q in zip(trainer.model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    saved = yaml.safe_load((tmp_path / f"tuned-{base.name}" / "config.yaml").read_text())
    assert saved["train"]["init_from"] == str(base)
    # the byte data the base run trained on is the tokenizer the fine-tune used
    assert saved["data"]["tokenizer"] == str(tmp_path / "base" / "data")


# ============================================================== the classifier's loss
def test_the_classifier_loss_includes_the_moe_auxiliary_losses():
    cfg = lmlab.ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16,
                            moe={"n_experts": 4, "top_k": 2, "load_balance_coef": 0.5, "z_loss_coef": 0.1})
    clf = lmlab.SequenceClassifier(cfg, n_classes=3, pad_token_id=0)
    idx = torch.randint(1, 64, (4, 10), generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1, 2, 1])
    logits, loss = clf(idx, labels)
    aux = sum(v for moe in clf.body.moe_layers for v in moe.aux_losses.values())
    assert float(aux.detach()) > 0.05
    torch.testing.assert_close(loss, F.cross_entropy(logits, labels) + aux)
    loss.backward()  # the routers learn from the balancing terms too
    assert all(
        moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0 for moe in clf.body.moe_layers
    )


# ============================================================== honest warnings
def test_warmup_longer_than_the_run_is_warned_about(tmp_path, capsys):
    fit(run_config(tmp_path, {"train.steps": 3, "optim.warmup_steps": 5, "eval.every": 3}), tmp_path / "run",
                              quiet=False)
    out = capsys.readouterr().out
    assert "warning: optim.warmup_steps=5 >= train.steps=3: the learning rate never leaves its warmup" in out
    fit(run_config(tmp_path, {"train.steps": 3, "optim.warmup_steps": 2, "eval.every": 3}), tmp_path / "ok",
                              quiet=False)
    assert "warning" not in capsys.readouterr().out


# ============================================================== TensorBoard across a resume
def test_resuming_keeps_every_tensorboard_point(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    cfg = run_config(tmp_path, {"train.steps": 6, "log.tensorboard": True, "eval.every": 2, "checkpoint.every": 100})

    def stop_at_3(trainer, record):
        if record["step"] == 3:
            trainer.request_stop(signal.SIGTERM)

    part, _ = fit(cfg, tmp_path / "run", callbacks=[stop_at_3])
    assert part.step == 3  # checkpoint at step 3, whose record is already logged
    fit(cfg, tmp_path / "run", resume=True)  # steps 4-6
    fit(cfg, tmp_path / "run", resume=True)  # a finished run: nothing to do, nothing to erase

    def scalars(tag: str) -> list[tuple[int, float]]:
        acc = event_accumulator.EventAccumulator(str(tmp_path / "run" / "tb"))
        acc.Reload()
        return [(e.step, e.value) for e in acc.Scalars(tag)]

    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6]
    assert scalars("train/loss") == [(r["step"], pytest.approx(r["loss"])) for r in logged]
    assert [s for s, _ in scalars("val/loss")] == [2, 4, 6]
