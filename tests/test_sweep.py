"""lmlab.experiments.sweep: whole-spec validation, equal-budget accounting, resumption, tables."""

from __future__ import annotations

import csv
import signal

import numpy as np
import pytest
import yaml

from lmlab import cli
from lmlab.experiments import report, sweep
from lmlab.experiments.sweep import Hooks, SweepInterrupted, load_spec, parse_spec, run_sweep
from lmlab.run.trainer import Trainer

TEXT = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog {i % 7}.\n" for i in range(400))

TINY = {
    "model": {"d_model": 16, "n_heads": 2, "n_layers": 1, "max_seq_len": 16},
    "train": {"steps": 4, "batch_size": 2, "warmup_steps": 1, "eval_every": 2, "eval_batches": 1, "log_every": 1,
              "save_every": 2, "sample_tokens": 0, "tensorboard": False, "device": "cpu"},
}


@pytest.fixture
def corpus(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_text(TEXT)
    return p


def spec_file(tmp_path, corpus, **changes):
    data = {"name": "tiny", "base": {**TINY, "data": {"source": str(corpus), "val_fraction": 0.1}},
            "variants": [{"name": "one", "overrides": {"model.n_layers": 1}}, {"name": "two", "overrides": {"model.n_layers": 2}}]}
    data.update(changes)
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


class CountingTrainer(Trainer):
    made: list = []

    def __init__(self, cfg, run_dir, **kw):
        super().__init__(cfg, run_dir, **kw)
        CountingTrainer.made.append((str(run_dir), self.step, kw.get("resume")))


# ============================================================== validation before training
def test_bad_override_is_rejected_before_training_naming_variant_and_field(tmp_path, corpus):
    path = spec_file(tmp_path, corpus, variants=[
        {"name": "fine", "overrides": {"model.n_layers": 2}},
        {"name": "typo", "overrides": {"model.n_layer": 3}},
    ])
    with pytest.raises(ValueError) as e:
        load_spec(path)
    msg = str(e.value)
    assert "\n" not in msg
    assert "variant 'typo'" in msg and "'model.n_layer'" in msg and "n_layers" in msg  # the closest field suggested

    bad_value = spec_file(tmp_path, corpus, variants=[{"name": "neg", "overrides": {"train.lr": -1.0}}])
    with pytest.raises(ValueError, match=r"variant 'neg': .*train\.lr"):
        load_spec(bad_value)


def test_cli_rejects_a_bad_spec_with_one_line_and_trains_nothing(tmp_path, corpus, capsys):
    path = spec_file(tmp_path, corpus, variants=[{"name": "ok", "overrides": {}},
                                                 {"name": "wide", "overrides": {"model.n_heads": 3}}])
    out = tmp_path / "out"
    assert cli.main(["sweep", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "variant 'wide'" in err and "n_heads=3" in err
    assert not out.exists()  # nothing prepared, nothing trained


@pytest.mark.parametrize("change, message", [
    ({"variants": [{"name": "a", "init_from": "b"}, {"name": "b"}]}, "init_from='b' is not an earlier variant"),
    ({"variants": [{"name": "a"}, {"name": "a"}]}, "variant name 'a' appears twice"),
    ({"variants": [{"name": "a", "overides": {}}]}, "unknown key 'overides'"),
    ({"seeds": "three"}, "seeds='three' is not valid"),
    ({"variant": []}, "unknown key 'variant'"),
    ({"variants": [{"name": "a/b"}]}, "without spaces or slashes"),
])
def test_spec_structure_errors(tmp_path, corpus, change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_spec(spec_file(tmp_path, corpus, **change))


def test_grid_expands_to_the_product_with_labels_and_quick_overrides(tmp_path, corpus):
    spec = parse_spec({
        "base": TINY, "quick": {"train.steps": 1},
        "grid": [
            {"axis": "norm", "levels": [{"name": "pre", "overrides": {"model.norm_position": "pre"}},
                                        {"name": "post", "overrides": {"model.norm_position": "post"}}]},
            {"axis": "depth", "levels": [{"name": "L1", "overrides": {"model.n_layers": 1}},
                                         {"name": "L3", "overrides": {"model.n_layers": 3}, "quick": {"train.steps": 2}}]},
        ],
    }).resolve(quick=True)
    assert [v.name for v in spec.variants] == ["pre-L1", "pre-L3", "post-L1", "post-L3"]
    assert spec.variant("post-L3").labels == {"norm": "post", "depth": "L3"}
    assert spec.configs["post-L3"].model.norm_position == "post" and spec.configs["post-L3"].model.n_layers == 3
    assert [spec.configs[n].train.steps for n in ("pre-L1", "pre-L3")] == [1, 2]  # base quick, then the level's quick


def test_active_parameter_matching_names_the_variant_that_is_off(tmp_path, corpus):
    base = {"model": {"d_model": 32, "n_heads": 2, "n_layers": 2, "max_seq_len": 16}}
    ok = parse_spec({"base": base, "match_active_params": {"reference": "dense", "tolerance": 0.05}, "variants": [
        {"name": "dense"},
        {"name": "top1", "overrides": {"model.moe": {"n_experts": 4, "top_k": 1}}},
        {"name": "top2-half", "overrides": {"model.moe": {"n_experts": 8, "top_k": 2, "d_expert": 64}}},
    ]}).resolve()
    counts = sweep.check_active_params(ok)
    assert counts["top1"]["total_params"] > 2 * counts["dense"]["total_params"]
    assert abs(counts["top2-half"]["active_params"] / counts["dense"]["active_params"] - 1) < 0.05
    bad = parse_spec({"base": base, "match_active_params": {"reference": "dense"}, "variants": [
        {"name": "dense"}, {"name": "top2-full", "overrides": {"model.moe": {"n_experts": 4, "top_k": 2}}}]})
    with pytest.raises(ValueError, match=r"variant 'top2-full' has [\d,]+ active parameters, \+\d+\.\d% from the reference 'dense'"):
        bad.resolve()


# ============================================================== running and resuming
def test_interrupted_sweep_resumes_without_rerunning_finished_variants(tmp_path, corpus):
    spec = load_spec(spec_file(tmp_path, corpus))
    out = tmp_path / "out"

    class StopSecondAtStep2(Hooks):
        def callbacks(self, variant, seed, run_dir):
            if variant.name != "two":
                return []
            return [lambda trainer, record: trainer.request_stop(signal.SIGINT) if record["step"] == 2 else None]

    CountingTrainer.made = []
    with pytest.raises(SweepInterrupted, match="two seed 0 stopped at step 2"):
        run_sweep(spec, out, hooks=StopSecondAtStep2(), trainer_cls=CountingTrainer, log=lambda m: None)
    assert [step for _, step, _ in CountingTrainer.made] == [0, 0]
    first = out / "runs/one/seed0/result.json"
    assert first.is_file() and not (out / "runs/two/seed0/result.json").exists()
    before = first.read_text()

    CountingTrainer.made = []
    rows = run_sweep(load_spec(spec_file(tmp_path, corpus)), out, trainer_cls=CountingTrainer, log=lambda m: None)
    # only the half-finished run was constructed again, and it continued from its step-2 checkpoint
    assert CountingTrainer.made == [(str(out / "runs/two/seed0"), 2, True)]
    assert first.read_text() == before
    assert [(r["variant"], r["steps"], r["tokens"]) for r in rows] == [("one", 4, 4 * 2 * 16), ("two", 4, 4 * 2 * 16)]
    curve = sweep.read_curve(out / "runs/two/seed0")
    assert [r["step"] for r in curve if "loss" in r] == [1, 2, 3, 4]  # no step logged twice across the resume

    CountingTrainer.made = []
    run_sweep(load_spec(spec_file(tmp_path, corpus)), out, trainer_cls=CountingTrainer, log=lambda m: None)
    assert CountingTrainer.made == []  # everything done: nothing is trained


def test_sweep_writes_rows_summary_and_shares_data(tmp_path, corpus):
    path = spec_file(tmp_path, corpus, seeds=2, diverged_above=100.0, variants=[
        {"name": "base"},
        {"name": "ft", "init_from": "base", "overrides": {"train.steps": 2, "train.lr": 1e-4, "train.min_lr": 1e-5}},
    ])
    out = tmp_path / "out"
    assert cli.main(["sweep", str(path), "--out", str(out)]) == 0
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["variant"], r["seed"]) for r in rows] == [("base", "0"), ("base", "1"), ("ft", "0"), ("ft", "1")]
    assert set(sweep.COLUMNS) <= set(rows[0])
    base0 = rows[0]
    assert int(base0["tokens"]) == 4 * 2 * 16 and int(rows[2]["tokens"]) == 2 * 2 * 16
    assert int(base0["total_params"]) == int(base0["active_params"]) > 0 and float(base0["flops_per_token"]) > 0
    assert float(base0["tokens_per_s"]) > 0 and base0["diverged"] == "False"
    assert rows[0]["final_val_loss"] != rows[1]["final_val_loss"]  # seeds differ in data order
    # every run read the one shared prepared copy
    for r in ("base/seed0", "ft/seed1"):
        cfg = yaml.safe_load((out / "runs" / r / "config.yaml").read_text())
        assert cfg["data"]["dir"] == str(out / "data")
    assert not (out / "runs/base/seed0/data").exists()
    summary = (out / "summary.md").read_text()
    base_vals = [float(r["final_val_loss"]) for r in rows[:2]]
    assert f"{np.mean(base_vals):.4f} ± {np.std(base_vals, ddof=1):.4f}" in summary
    assert "| base | 2 | 0/2 |" in summary
    # the fine-tune started from base's final weights (2 small steps away), not from a fresh init
    from safetensors.torch import load_file

    from lmlab.run import checkpoint as ckpt
    from lmlab.model import Transformer

    def weights(run):
        return load_file(str(ckpt.resolve(out / "runs" / run / "checkpoints", "latest") / ckpt.WEIGHTS))["embed.weight"]

    base_w, ft_w = weights("base/seed0"), weights("ft/seed0")
    init_w = Transformer(load_spec(path).configs["base"].model).embed.weight.detach()
    assert (ft_w - base_w).norm() < 0.2 * (base_w - init_w).norm()


def test_divergence_threshold_and_unigram_loss(tmp_path, corpus):
    spec = load_spec(spec_file(tmp_path, corpus, diverged_above=0.5, variants=[{"name": "one"}]))
    rows = run_sweep(spec, tmp_path / "out", log=lambda m: None)
    assert rows[0]["diverged"] and "above 0.500" in rows[0]["diverge_reason"]
    data = tmp_path / "out" / "data"
    from lmlab.run.data import TokenData

    train, val = np.asarray(TokenData(data, "train").tokens), np.asarray(TokenData(data, "val").tokens)
    counts = np.bincount(train, minlength=256) + 1.0
    expected = -np.log(counts / counts.sum())[val].mean()
    assert sweep.unigram_loss(data) == pytest.approx(expected, rel=1e-9)


def test_mean_std_and_markdown():
    assert report.mean_std([1.0, 2.0, 3.0]) == "2.0000 ± 1.0000"
    assert report.mean_std([2.5]) == "2.5000"
    assert report.mean_std([float("nan")]) == "nan"
    assert report.markdown_table([{"a": 1234, "b": 0.5}]) == "| a | b |\n|---|---|\n| 1,234 | 0.5000 |\n"


def test_subcommands_show_defaults_in_help(capsys):
    assert cli.main(["experiment", "--help"]) == 0
    text = capsys.readouterr().out
    assert "norm" in text and "positions" in text and "moe" in text and "(default: None)" in text
    assert cli.main(["sweep", "--help"]) == 0
    assert "--seeds" in capsys.readouterr().out
