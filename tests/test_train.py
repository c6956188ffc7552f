"""The trainer: param groups, schedule, clipping, accumulation, exact resume, numerical faults, DDP."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import FAST_RUN, TINY_MODEL, corpus

import lmlab
from lmlab.run.checkpoint import local as ckpt
from lmlab.run.config import OptimConfig, RunConfig, TrainConfig, load_config
from lmlab.run.data.config import DataConfig
from lmlab.run.optim import clip_gradients, learning_rate, param_groups
from lmlab.run.phases import Phases, summary
from lmlab.run.trainer import Trainer, TrainingDiverged, TrainResult, forward_backward, seed_dropout

TINY = TINY_MODEL


FAST = FAST_RUN


def run_config(tmp_path: Path, changes: dict | None = None, model: dict | None = None) -> RunConfig:
    """A tiny llama (TINY, then ``model`` fields) on a word corpus in ``tmp_path``; FAST, then dotted ``changes``."""
    source = tmp_path / "corpus.txt"
    if not source.exists():
        corpus(source)
    base = RunConfig(model=lmlab.ModelConfig.from_preset("llama", **{**TINY, **(model or {})}),
                     data=DataConfig(source=str(source)))
    return base.override({**FAST, **(changes or {})})


def train(cfg: RunConfig, run_dir: Path, callbacks=(), **kw) -> tuple[TrainResult, list[dict], Trainer]:
    records: list[dict] = []
    with Trainer(cfg, run_dir, quiet=True, callbacks=[lambda t, r: records.append(r), *callbacks], **kw) as trainer:
        result = trainer.fit()
    return result, records, trainer


def losses(run_dir: Path) -> dict[int, float]:
    return {
        r["step"]: r["loss"]
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    }


# ============================================================== parts
def test_param_groups_decay_only_weight_matrices():
    def groups(**kw):
        model = lmlab.Transformer(lmlab.ModelConfig.from_preset(**{**TINY, "n_kv_heads": None, **kw}))
        decay, no_decay = param_groups(model, 0.1)
        assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
        assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
        return set(decay["names"]), set(no_decay["names"])

    decay, no_decay = groups(name="gpt2")  # biases, LayerNorm, learned positions, tied head
    assert decay == {f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.qkv", "attn.out", "ffn.up", "ffn.down")}
    assert {"embed.weight", "positions.table.weight", "final_norm.weight", "final_norm.bias",
            "blocks.0.attn.qkv.bias", "blocks.1.norm2.weight"} <= no_decay
    assert "head.weight" not in decay | no_decay  # tied: the embedding, listed once

    decay, no_decay = groups(name="llama")  # untied head decays like any projection
    assert "head.weight" in decay and "embed.weight" in no_decay
    decay, no_decay = groups(name="llama", positions="relative")  # Shaw tables are position embeddings
    assert {"blocks.0.attn.term.rel_k", "blocks.1.attn.term.rel_v"} <= no_decay


def test_learning_rate_warmup_then_cosine_to_min():
    cfg = OptimConfig(warmup_steps=2, lr=1.0, min_lr=0.1)
    got = [learning_rate(s, cfg, 11) for s in range(11)]
    assert got[0] == 0.5 and got[1] == 1.0 and got[2] == 1.0  # warmup reaches lr, decay starts from it
    assert got[6] == pytest.approx(0.55)  # half way through the decay: (lr + min_lr) / 2
    assert got[10] == pytest.approx(0.1)  # the last step is at min_lr
    assert got[4] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert all(a >= b for a, b in zip(got[1:], got[2:]))
    assert learning_rate(0, OptimConfig(warmup_steps=0, lr=1.0, min_lr=0.0), 5) == 1.0
    assert learning_rate(4, OptimConfig(warmup_steps=0, lr=0.5), 5) == pytest.approx(0.05)  # default: lr / 10


def test_clip_gradients_scales_to_max_norm_and_reports_non_finite():
    a, b = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    a.grad, b.grad = torch.tensor([3.0]), torch.tensor([4.0])
    assert clip_gradients([a, b], 1.0) == pytest.approx(5.0)
    torch.testing.assert_close(torch.cat([a.grad, b.grad]), torch.tensor([0.6, 0.8]))
    a.grad, b.grad = torch.tensor([3.0]), torch.tensor([4.0])
    assert clip_gradients([a, b], 0.0) == pytest.approx(5.0)  # 0: measure only
    torch.testing.assert_close(torch.cat([a.grad, b.grad]), torch.tensor([3.0, 4.0]))
    b.grad = torch.tensor([float("inf")])
    assert not math.isfinite(clip_gradients([a, b], 1.0))


@pytest.mark.parametrize("max_norm", [0.5, 0.0, 1e9])
def test_clip_gradients_fast_path_equals_clip_grad_norm_bit_for_bit(max_norm):
    g = torch.Generator().manual_seed(5)
    shapes = [(7, 3), (3,), (2, 4, 5), (1,)]
    ours = [torch.zeros(s, requires_grad=True) for s in shapes]
    ref = [torch.zeros(s, requires_grad=True) for s in shapes]
    for p, q in zip(ours, ref):
        p.grad = torch.randn(p.shape, generator=g)
        q.grad = p.grad.clone()
    norm = clip_gradients(ours, max_norm)
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm if max_norm > 0 else float("inf"))
    assert norm == float(want)
    for p, q in zip(ours, ref):
        assert torch.equal(p.grad, q.grad)


def test_seed_dropout_on_the_cpu_draws_what_torch_manual_seed_draws():
    torch.manual_seed(123)
    want = torch.rand(5)
    seed_dropout(123, torch.device("cpu"))
    assert torch.equal(torch.rand(5), want)


def test_gradient_accumulation_equals_one_big_batch():
    cfg = lmlab.ModelConfig.from_preset("llama", **TINY)
    x = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(2))
    grads, losses_ = [], []
    for n in (1, 2, 4):
        model = lmlab.Transformer(cfg)
        chunks = list(zip(x.chunk(n), y.chunk(n)))
        ce, _ = forward_backward(model, chunks, n, device=torch.device("cpu"))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        losses_.append(ce)
    for g, loss in zip(grads[1:], losses_[1:]):
        torch.testing.assert_close(g, grads[0], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(loss, losses_[0])


def test_train_config_validation_names_field_and_fix():
    cases = [
        (OptimConfig, dict(lr=0.01, min_lr=0.1), "optim.min_lr=0.1 is above optim.lr=0.01"),
        (OptimConfig, dict(betas=(0.9,)), r"optim.betas=\[0.9\] is not valid; give two numbers"),
        (TrainConfig, dict(device="gpu"), "train.device='gpu' is not a device; use auto, cpu, cuda"),
        (TrainConfig, dict(steps=0), r"train.steps=0 is not valid; it must be > 0"),
        (OptimConfig, dict(grad_clip=-1.0), r"optim.grad_clip=-1.0 is not valid; it must be >= 0"),
    ]
    for section, kw, message in cases:
        with pytest.raises(ValueError, match=message):
            section(**kw)
    with pytest.raises(ValueError, match="train.seq_len=64 is longer than model.max_seq_len=32"):
        RunConfig(model=lmlab.ModelConfig(**TINY), train=TrainConfig(seq_len=64))


def test_load_config_layers_yaml_and_overrides_on_the_defaults(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  n_layers: 2\noptim:\n  lr: 0.001\n  betas: [0.8, 0.9]\nprovenance: [{}]\n")
    cfg = load_config(path, {"optim.lr": "3e-4", "model.rope.base": "500000"})
    default = RunConfig()
    assert cfg.model.n_layers == 2 and cfg.model.d_model == default.model.d_model  # the rest stays the demo's
    assert cfg.optim.lr == 3e-4 and cfg.optim.betas == (0.8, 0.9) and cfg.model.rope.base == 5e5
    assert cfg.train.steps == default.train.steps and cfg.data == default.data
    # sizes derived from d_model / n_heads follow them, as in ModelConfig.override
    wide = load_config(None, {"model.d_model": 256, "model.n_heads": 8})
    assert wide.model == default.model.override({"d_model": 256, "n_heads": 8})
    assert (wide.model.head_dim, wide.model.d_ff) == (32, 704)
    with pytest.raises(ValueError, match=r"unknown key 'model.n_layer'.*did you mean 'n_layers'"):
        load_config(None, {"model.n_layer": 2})
    (tmp_path / "bad.yaml").write_text("model: [1, 2\n")
    with pytest.raises(ValueError, match="bad.yaml' is not valid YAML at line"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "empty.yaml").write_text("\n")
    with pytest.raises(ValueError, match="empty.yaml' is empty"):
        load_config(tmp_path / "empty.yaml")
    with pytest.raises(FileNotFoundError, match="missing.yaml' does not exist"):
        load_config(tmp_path / "missing.yaml")


# ============================================================== the loop
def test_training_logs_checkpoints_and_config(tmp_path):
    cfg = run_config(tmp_path, {"train.steps": 12, "checkpoint.keep_last": 1, "train.grad_accum": 2})
    result, records, trainer = train(cfg, tmp_path / "run", command=["lmlab", "train", "--x"])
    run = tmp_path / "run"
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(1, 13))
    for r in logged:
        assert r["lr"] == pytest.approx(learning_rate(r["step"] - 1, cfg.optim, cfg.train.steps))
        assert r["tokens"] == r["step"] * 4 * 2 * 32 and r["tokens_per_s"] > 0 and r["skipped_steps"] == 0
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
    vals = {r["step"]: r["val_loss"] for r in logged if "val_loss" in r}
    assert sorted(vals) == [4, 8, 12]
    assert logged[-1]["loss"] < logged[0]["loss"] - 0.5  # it learns: ln(256) = 5.5 at the start
    assert result.val_loss == vals[12] and result.best_val_loss == min(vals.values())
    # keep_last=1 plus the best
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    assert best == {"step": min(vals, key=vals.get), "val_loss": min(vals.values())}
    assert [s for s, _ in ckpt.list_checkpoints(run / "checkpoints")] == sorted({12, best["step"]})
    saved = yaml.safe_load((run / "config.yaml").read_text())
    prov = saved.pop("provenance")
    assert load_config(run / "config.yaml") == trainer.cfg and RunConfig.from_dict(saved) == trainer.cfg
    assert prov[0]["command"] == "lmlab train --x" and prov[0]["torch"] == str(torch.__version__)
    assert prov[0]["lmlab"] == lmlab.__version__ and prov[0]["step"] == 0 and "git" in prov[0]
    state = ckpt.load_state(run / "checkpoints" / "step_0000012")
    assert state["step"] == 12 and state["tokens"] == 12 * 4 * 2 * 32


def test_phases_count_exclusive_time_and_a_run_reports_where_its_time_went(tmp_path, monkeypatch):
    clock = iter(range(100))
    monkeypatch.setattr("lmlab.run.phases.time.perf_counter", lambda: float(next(clock)))
    phases = Phases()
    with phases("save"):  # t=0
        with phases("finite checks"):  # t=1
            pass  # t=2: back in save
        with phases("finite checks"):  # t=3
            pass  # t=4
    # t=5: save had 0-1, 2-3 and 4-5; the checks 1-2 and 3-4
    assert phases.seconds == {"save": 3.0, "finite checks": 2.0} and phases.stack == []
    monkeypatch.undo()

    cfg = run_config(tmp_path, {"log.sample_tokens": 4})
    result, _, trainer = train(cfg, tmp_path / "run")
    assert set(result.phases) == {"setup", "step", "log", "eval", "save", "finite checks", "sample"}
    assert all(s > 0 for s in result.phases.values())
    outside_setup = sum(s for name, s in result.phases.items() if name != "setup")
    assert outside_setup <= result.elapsed_s + 1e-3  # exclusive: no second counted twice
    assert summary({"eval": 1.5, "step": 10.0}) == "time: step 10.0 s, eval 1.5 s"


def test_resume_repeats_the_uninterrupted_run_exactly(tmp_path):
    cfg = run_config(tmp_path, {"train.steps": 8, "train.grad_accum": 2}, model={"dropout": 0.1})
    full, _, _ = train(cfg, tmp_path / "full")

    def stop_at_4(trainer, record):
        if record["step"] == 4:
            trainer.request_stop(signal.SIGTERM)

    part, _, _ = train(cfg, tmp_path / "part", callbacks=[stop_at_4])
    assert part.stopped_by == signal.SIGTERM and part.step == 4 and part.checkpoint.name == "step_0000004"
    resumed, _, t2 = train(cfg, tmp_path / "part", resume=True)
    a, b = losses(tmp_path / "full"), losses(tmp_path / "part")
    assert list(a) == list(b) == list(range(1, 9))
    assert a == b  # bit-identical, steps 5-8 included
    assert resumed.val_loss == full.val_loss
    ref = lmlab.Transformer(t2.cfg.model)
    ckpt.load_weights(ref, ckpt.resolve(tmp_path / "full" / "checkpoints", "latest") / ckpt.WEIGHTS)
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), t2.model.parameters()))
    prov = yaml.safe_load((tmp_path / "part" / "config.yaml").read_text())["provenance"]
    assert [p["step"] for p in prov] == [0, 4]


def test_resume_takes_the_optimizer_hyperparameters_from_the_config(tmp_path):
    """The moments come from the checkpoint, betas, eps and weight decay from the resumed run's config.
    A run saved with weight_decay=0 used to stay undecayed whatever the new config said."""
    cfg = run_config(tmp_path, {"train.steps": 2, "eval.every": 2, "checkpoint.every": 2, "optim.weight_decay": 0.0})
    _, _, first = train(cfg, tmp_path / "run")
    saved = {i: {k: v.clone() for k, v in s.items()} for i, s in first.optimizer.state_dict()["state"].items()}
    changed = cfg.override({"optim.weight_decay": 0.05, "optim.betas": [0.8, 0.99], "optim.eps": 1e-6})
    with Trainer(changed, tmp_path / "run", quiet=True, resume=True) as t:  # resumed at its last step: no update
        state = t.optimizer.state_dict()["state"]
        assert all(torch.equal(state[i][k], v) for i, s in saved.items() for k, v in s.items())
        assert [g["weight_decay"] for g in t.optimizer.param_groups] == [0.05, 0.0]  # matrices decay; norms do not
        assert all(g["betas"] == (0.8, 0.99) and g["eps"] == 1e-6 for g in t.optimizer.param_groups)


def test_non_finite_steps_are_skipped_and_counted(tmp_path):
    cfg = run_config(tmp_path, {"train.steps": 6, "train.max_bad_steps": 2})
    bad_loss, bad_grad = {2}, {4}
    snapshots = {}

    with Trainer(cfg, tmp_path / "run", quiet=True,
                 callbacks=[lambda t, r: snapshots.__setitem__(r["step"],
                                                               t.model.head.weight.detach().clone())]) as trainer:
        # on the final hidden states: the training loss reads the head's weight, not the head module
        trainer.model.final_norm.register_forward_hook(
            lambda m, i, out: out * float("nan") if trainer.step + 1 in bad_loss and m.training else None)
        trainer.model.embed.weight.register_hook(
            lambda g: g * float("inf") if trainer.step + 1 in bad_grad else None)
        result = trainer.fit()
    def strict(line):  # bare NaN / Infinity are not JSON: they must be written as null
        return json.loads(line, parse_constant=lambda c: pytest.fail(f"metrics.jsonl holds a bare {c}"))

    logged = {r["step"]: r for r in map(strict, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    assert logged[2]["loss"] is None and logged[4]["grad_norm"] is None and math.isfinite(logged[4]["loss"])
    assert [logged[s]["skipped_steps"] for s in range(1, 7)] == [0, 1, 1, 2, 2, 2]
    assert result.skipped_steps == 2 and math.isfinite(result.val_loss)
    assert torch.equal(snapshots[2], snapshots[1]) and torch.equal(snapshots[4], snapshots[3])  # no update
    assert not torch.equal(snapshots[3], snapshots[2])  # training went on between the faults


def test_consecutive_faults_stop_the_run_and_keep_the_good_checkpoint(tmp_path):
    cfg = run_config(tmp_path, {"train.steps": 20, "checkpoint.every": 2, "eval.every": 100, "train.max_bad_steps": 3})

    def corrupt(trainer, record):
        if record["step"] == 5:  # weights go bad after a good update: every later loss is NaN
            with torch.no_grad():
                trainer.model.blocks[0].ffn.down.weight[0, 0] = float("nan")

    with pytest.raises(TrainingDiverged) as e:
        train(cfg, tmp_path / "run", callbacks=[corrupt])
    root = tmp_path / "run" / "checkpoints"
    assert str(e.value) == (
        "stopped at step 8: 3 consecutive steps with a non-finite loss or gradient (train.max_bad_steps=3); "
        f"last good checkpoint: {root / 'step_0000004'}"
    )
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [2, 4]  # step 6's save was refused: NaN weights
    model = lmlab.Transformer(cfg.model)
    ckpt.load_weights(model, root / "step_0000004" / ckpt.WEIGHTS)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_moe_statistics_and_aux_losses_are_logged_and_biases_updated(tmp_path):
    moe = {"moe": {"n_experts": 4, "top_k": 2, "load_balance_coef": 0.01, "bias_update_rate": 0.01}, "ffn": "glu"}
    cfg = run_config(tmp_path, {"train.steps": 3, "eval.every": 3}, model=moe)
    _, records, trainer = train(cfg, tmp_path / "run")
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for r in logged:
        assert len(r["moe"]) == 2 and set(r["moe"][0]) >= {"tokens_per_expert", "max_load", "router_entropy"}
        assert sum(r["moe"][1]["tokens_per_expert"]) == 4 * 32 * 2  # every token sent to top_k=2 experts
        assert r["aux_losses"]["load_balance"] > 0
    biases = [m.router.score_bias for m in trainer.model.moe_layers]
    assert all(b.abs().sum() > 0 for b in biases)  # update_router_biases ran after the steps


def test_moe_balances_by_default_and_its_statistics_cover_every_micro_batch(tmp_path):
    """A hand-built MoE trains with the presets' balance loss unless told otherwise, and a step's per-expert load
    counts the tokens of all its micro-batches (it counted the last one only)."""
    moe = {"moe": {"n_experts": 4, "top_k": 2}, "ffn": "glu"}
    cfg = run_config(tmp_path, {"train.steps": 2, "eval.every": 2, "train.grad_accum": 2}, model=moe)
    assert cfg.model.moe.expert_balance_coef == 0.01
    train(cfg, tmp_path / "run")
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2]
    for r in logged:
        assert r["aux_losses"]["expert_balance"] > 0
        for layer in r["moe"]:  # batch 4 x 32 tokens x 2 micro-batches, each token to top_k=2 experts
            assert sum(layer["tokens_per_expert"]) == 4 * 32 * 2 * 2


def test_existing_run_needs_resume_or_overwrite(tmp_path):
    cfg = run_config(tmp_path, {"train.steps": 2, "eval.every": 2, "checkpoint.every": 2})
    train(cfg, tmp_path / "run")
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=r"already holds this run, trained to step 2; pass --resume"):
        Trainer(cfg, tmp_path / "run", quiet=True)
    with pytest.raises(ValueError, match=r"already holds a different run \(model.n_layers: 2 vs 3, there vs here\)"):
        Trainer(cfg.override({"model.n_layers": 3}), tmp_path / "run", quiet=True)
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == before
    result, _, _ = train(cfg.override({"train.steps": 3}), tmp_path / "run", overwrite=True)
    assert result.step == 3 and losses(tmp_path / "run").keys() == {1, 2, 3}


# ============================================================== DDP
def torchrun_train(config: Path, run_dir: Path) -> list[str]:
    """``lmlab train --config CONFIG --run-dir RUN_DIR --quiet`` on 2 processes under torchrun."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "-m", "lmlab.cli", "train", "--config", str(config), "--run-dir", str(run_dir), "--quiet"]


@pytest.mark.slow
def test_two_process_ddp_matches_one_process_with_the_same_global_batch(tmp_path):
    cfg = run_config(tmp_path, {"train.steps": 4, "train.grad_accum": 2, "eval.every": 4, "checkpoint.every": 4})
    train(cfg, tmp_path / "one")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = torchrun_train(tmp_path / "run.yaml", tmp_path / "two")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert list(one) == list(two) == [1, 2, 3, 4]
    torch.testing.assert_close(torch.tensor(list(two.values())), torch.tensor(list(one.values())), rtol=1e-5, atol=1e-6)
    prov = yaml.safe_load((tmp_path / "two" / "config.yaml").read_text())["provenance"]
    assert prov[0]["world_size"] == 2
    a, b = lmlab.Transformer(cfg.model), lmlab.Transformer(cfg.model)
    ckpt.load_weights(a, tmp_path / "one" / "checkpoints" / "step_0000004" / ckpt.WEIGHTS)
    ckpt.load_weights(b, tmp_path / "two" / "checkpoints" / "step_0000004" / ckpt.WEIGHTS)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)


def test_tensorboard_events_mirror_the_metrics(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    cfg = run_config(tmp_path, {"train.steps": 4, "log.tensorboard": True, "eval.every": 2})
    train(cfg, tmp_path / "run")
    acc = event_accumulator.EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "val/loss"} <= set(acc.Tags()["scalars"])
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (r["step"], pytest.approx(r["loss"])) for r in logged]
    assert [e.step for e in acc.Scalars("val/loss")] == [2, 4]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the rank-1 process through /proc")
def test_a_signal_to_one_ddp_rank_stops_every_rank_after_the_same_step(tmp_path):
    cfg = run_config(tmp_path, {"train.steps": 100000, "train.grad_accum": 2, "eval.every": 100000,
                                "checkpoint.every": 100000})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = torchrun_train(tmp_path / "run.yaml", tmp_path / "run")
    agent = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.1)

    def rank_of(pid: int) -> str | None:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return None
        return next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"RANK=")), None)

    def parent_of(pid: int) -> int | None:
        try:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None

    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    (rank1,) = [p for p in pids if parent_of(p) == agent.pid and rank_of(p) == "1"]
    os.kill(rank1, signal.SIGTERM)  # rank 0 never sees a signal: it learns of it through the step's all-reduce
    agent.communicate(timeout=120)
    (step, path), = ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert step >= 2 and steps[-1] == step and ckpt.load_state(path)["step"] == step
