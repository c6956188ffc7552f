"""lmlab.experiments.sweep: whole-spec validation, seeds, equal-budget accounting, resumption,
reuse only of identical configs, honest labels, parallel workers, tuning, tables."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import re
import signal

import numpy as np
import pytest
import torch
import yaml

import lmlab
from lmlab import cli
from lmlab.experiments import report
from lmlab.experiments.spec import Tune, check_active_params, parse_spec
from lmlab.experiments.sweep import Hooks, SweepInterrupted, load_spec, run_sweep
from lmlab.experiments.sweep.layout import read_curve
from lmlab.experiments.sweep.measure import SpreadSlice, run_status, spread_starts, unigram_loss
from lmlab.experiments.sweep.tables import COLUMNS
from lmlab.experiments.sweep.tuning import choose, grid_edge_text, grid_edges
from lmlab.experiments.sweep.workers import claim
from lmlab.run.config import load_config
from lmlab.run.data.config import DataConfig
from lmlab.run.data.prepare import prepare
from lmlab.run.trainer import Trainer

TEXT = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog {i % 7}.\n" for i in range(400))

TINY = {
    "model": {"d_model": 16, "n_heads": 2, "n_layers": 1, "max_seq_len": 16},
    "train": {"steps": 4, "batch_size": 2, "device": "cpu"}, "optim": {"warmup_steps": 1},
    "eval": {"every": 2, "batches": 1}, "checkpoint": {"every": 2},
    "log": {"every": 1, "sample_tokens": 0, "tensorboard": False},
}


@pytest.fixture
def corpus(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_text(TEXT)
    return p


def spec_file(tmp_path, text_file, **changes):
    data = {
        "name": "tiny",
        "base": {**TINY, "data": {"source": str(text_file), "val_fraction": 0.1}},
        "variants": [
            {"name": "one", "overrides": {"model.n_layers": 1}},
            {"name": "two", "overrides": {"model.n_layers": 2}},
        ],
    }
    data.update(changes)
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


class CountingTrainer(Trainer):
    made: list = []

    def __init__(self, cfg, run_dir, **kw):
        super().__init__(cfg, run_dir, **kw)
        CountingTrainer.made.append((str(run_dir), self.step, kw.get("resume")))


def quiet(message):
    pass


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

    bad_value = spec_file(tmp_path, corpus, variants=[{"name": "neg", "overrides": {"optim.lr": -1.0}}])
    with pytest.raises(ValueError, match=r"variant 'neg': .*optim\.lr=-1.0 is not valid"):
        load_spec(bad_value)


def test_cli_rejects_a_bad_spec_with_one_line_and_trains_nothing(tmp_path, corpus, capsys):
    path = spec_file(tmp_path, corpus, variants=[{"name": "ok", "overrides": {}},
                                                 {"name": "wide", "overrides": {"model.n_heads": 3}}])
    out = tmp_path / "out"
    assert cli.main(["sweep", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "variant 'wide'" in err and "n_heads=3" in err
    assert not out.exists()  # nothing prepared, nothing trained
    for flags, message in ((["--jobs", "0"], "--jobs=0 is not valid"), (["--threads", "0"], "--threads=0 is not valid"),
                           (["--quick", "--profile", "gpu"], "exclude each other"),
                           (["--profile", "huge"], "no profile 'huge'")):
        assert cli.main(["sweep", str(spec_file(tmp_path, corpus)), "--out", str(out), *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and message in err, (flags, err)
        assert not out.exists()


@pytest.mark.parametrize("change, message", [
    ({"variants": [{"name": "a", "init_from": "b"}, {"name": "b"}]}, "init_from='b' is not an earlier variant"),
    ({"variants": [{"name": "a"}, {"name": "a"}]}, "variant name 'a' appears twice"),
    ({"variants": [{"name": "a", "overides": {}}]}, "unknown key 'overides'"),
    ({"seeds": "three"}, "seeds='three' is not valid"),
    ({"seeds": [1, 1]}, "repeats a seed"),
    ({"variant": []}, "unknown key 'variant'"),
    ({"variants": [{"name": "a/b"}]}, "without spaces or slashes"),
    ({"variants": [{"name": "a", "seeds": 0}]}, "seeds=0 is not valid"),
    ({"seed_fields": ["model.d_model"]}, "seed_fields=['model.d_model'] is not valid"),
    ({"final_eval": {"windows": 3}}, "final_eval must be {tokens: N}"),
    ({"corpus": {"name": "wikipedia"}}, "corpus must be {name: stdlib}"),
    ({"tune": {"field": "optim.lr"}}, "tune needs field"),
    ({"tune": {"field": "optim.lr", "values": [1e-3], "by": ["depth"]}}, "tune names axis 'depth'"),
    ({"profiles": {"gpu": {"overides": {}}}}, "profile 'gpu': unknown key 'overides'"),
    ({"base": {**TINY, "train.steps": 3}}, "base gives 'train.steps' twice (nested and dotted)"),
    ({"variants": [{"name": "a"}, {"name": "b", "init_from": "a", "overrides": {"train.init_from": "runs/x"}}]},
     "variant 'b': init_from='a' and train.init_from='runs/x' both choose its starting weights"),
    ({"base": {**TINY, "data": "prepared/dir"}, "corpus": {"name": "stdlib"}}, "corpus: and data.prepared both choose"),
])
def test_spec_structure_errors(tmp_path, corpus, change, message):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"name": "tiny", "base": TINY, "variants": [{"name": "one"}], **change}))
    with pytest.raises(ValueError, match=re.escape(message)):
        load_spec(path)


def test_a_sweep_reads_its_base_and_variants_as_train_config_reads_a_config(tmp_path, corpus):
    """One loader: a preset, ``data: DIR`` (prepared data) and dotted keys mean in a sweep's base: and
    variants what they mean in ``lmlab train --config``, so both give the same RunConfig."""
    prepared = tmp_path / "prepared"
    prepare(DataConfig(source=str(corpus), val_fraction=0.1), prepared)
    model = {"preset": "llama", "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "n_layers": 1, "max_seq_len": 16}
    base = {"model": model, "data": str(prepared), **{k: v for k, v in TINY.items() if k != "model"}, "optim.lr": 1e-3}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(base))
    mixtral = {"model": {"preset": "mixtral", "moe": {"top_k": 1}}}  # nested in a variant, merged into the preset's moe
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"name": "same", "base": base, "variants": [
        {"name": "as-base"}, {"name": "gpt2", "overrides": {"model.preset": "gpt2", "model.n_layers": 2}},
        {"name": "mixtral", "overrides": mixtral}]}))
    spec = load_spec(path)
    assert spec.configs["as-base"] == load_config(config)
    assert spec.configs["gpt2"] == load_config(config, {"model.preset": "gpt2", "model.n_layers": 2})
    assert spec.configs["mixtral"] == load_config(config, {"model.preset": "mixtral", "model.moe.top_k": 1})
    assert spec.configs["as-base"].model.norm == "rmsnorm" and spec.configs["gpt2"].model.positions == "learned"
    assert spec.configs["mixtral"].model.moe.n_experts == lmlab.ModelConfig.from_preset("mixtral").moe.n_experts
    assert spec.configs["as-base"].data.prepared == str(prepared) and spec.configs["as-base"].optim.lr == 1e-3

    # and the sweep trains on the prepared data where it is: nothing prepared under out/
    out = tmp_path / "out"
    rows = run_sweep(dataclasses.replace(spec, variants=spec.variants[:1], configs={}), out, log=quiet)
    assert [(r["variant"], r["steps"]) for r in rows] == [("as-base", 4)] and not (out / "data").exists()
    saved = yaml.safe_load((out / "runs/as-base/seed0/config.yaml").read_text())
    assert saved["data"]["prepared"] == str(prepared.resolve()) and saved["model"]["norm"] == "rmsnorm"


@pytest.mark.parametrize("form", ["data: DIR", "data: {prepared: DIR}"])
def test_a_sweep_on_bpe_prepared_data_takes_its_vocabulary_and_limits_from_it(tmp_path, corpus, form, capsys):
    """A spec's prepared data is used as it is (nothing prepared under --out), and the model's vocabulary, the
    divergence threshold (ln vocab) and the unigram baseline are that data's, not the built-in byte corpus's."""
    from lmlab.experiments.sweep.engine import setup

    bpe = tmp_path / "bpe"
    prepare(DataConfig(source=str(corpus), tokenizer="bpe", vocab_size=300, val_fraction=0.1), bpe)
    vocab = json.loads((bpe / "meta.json").read_text())["vocab_size"]
    assert vocab != 256
    data = str(bpe) if form == "data: DIR" else {"prepared": str(bpe)}
    path = spec_file(tmp_path, corpus, base={**TINY, "data": data})
    out = tmp_path / "out"
    sw, _ = setup(load_spec(path), out, Hooks(), Trainer, quiet=True, log=quiet)
    assert set(map(str, sw.data_dirs.values())) == {str(bpe.resolve())} and sw.vocab == {str(bpe.resolve()): vocab}
    limits = sw.limits[str(bpe.resolve())]
    assert limits["init"] == pytest.approx(math.log(vocab)) and limits["unigram"] == pytest.approx(unigram_loss(bpe))
    assert cli.main(["sweep", str(path), "--out", str(out)]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("data")) == []  # nothing prepared twice
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == 2 and all(r["status"] != "diverged" for r in rows)
    for name in ("one", "two"):
        saved = yaml.safe_load((out / "runs" / name / "seed0" / "config.yaml").read_text())
        assert saved["model"]["vocab_size"] == vocab and saved["data"]["tokenizer"] == "bpe"


def test_grid_expands_to_the_product_with_labels_and_quick_overrides(tmp_path, corpus):
    spec = parse_spec({
        "base": TINY, "quick": {"train.steps": 1},
        "grid": [
            {"axis": "norm", "levels": [{"name": "pre", "overrides": {"model.norm_position": "pre"}},
                                        {"name": "post", "overrides": {"model.norm_position": "post"}}]},
            {"axis": "depth", "levels": [{"name": "L1", "overrides": {"model.n_layers": 1}},
                                         {"name": "L3", "overrides": {"model.n_layers": 3},
                                          "quick": {"train.steps": 2}}]},
        ],
    }).resolve(quick=True)
    assert [v.name for v in spec.variants] == ["pre-L1", "pre-L3", "post-L1", "post-L3"]
    assert spec.variant("post-L3").labels == {"norm": "post", "depth": "L3"}
    assert spec.configs["post-L3"].model.norm_position == "post" and spec.configs["post-L3"].model.n_layers == 3
    assert [spec.configs[n].train.steps for n in ("pre-L1", "pre-L3")] == [1, 2]  # base quick, then the level's quick


def test_profiles_change_sizes_seeds_and_tuning_and_a_variant_may_train_fewer_seeds():
    data = {
        "base": TINY,
        "seeds": 5,
        "final_eval": {"tokens": 64},
        "tune": {"field": "optim.lr", "values": [1e-3, 3e-3], "seeds": [7]},
        "profiles": {
            "gpu": {"overrides": {"model.d_model": 32}, "seeds": [0], "tune": None, "final_eval": {"tokens": 999}},
            "mid": {"tune": {"values": [2e-3]}},
        },
        "variants": [{"name": "a"}, {"name": "b", "seeds": 3, "profiles": {"gpu": {"model.n_layers": 3}}}],
    }
    full = parse_spec(data).resolve()
    assert full.tasks() == [("a", s) for s in range(5)] + [("b", s) for s in range(3)]
    assert full.configs["b"].model.d_model == 16 and full.tune.values == [1e-3, 3e-3]
    gpu = parse_spec(data).resolve(profile="gpu")
    assert gpu.tune is None and gpu.seeds == [0] and gpu.final_eval == {"tokens": 999}
    assert (
        gpu.configs["a"].model.d_model == 32
        and gpu.configs["b"].model.n_layers == 3
        and gpu.configs["a"].model.n_layers == 1
    )
    assert parse_spec(data).resolve(profile="mid").tune.values == [2e-3]
    # a sweep seed sets both the init seed and the data-order seed, unless the spec names one of them
    assert (full.seed_config("a", 4).model.init_seed, full.seed_config("a", 4).train.seed) == (4, 4)
    only_init = parse_spec({**data, "seed_fields": ["model.init_seed"]}).resolve()
    assert (only_init.seed_config("a", 4).model.init_seed, only_init.seed_config("a", 4).train.seed) == (4, 0)


def test_active_parameter_matching_names_the_variant_that_is_off(tmp_path, corpus):
    base = {"model": {"d_model": 32, "n_heads": 2, "n_layers": 2, "max_seq_len": 16}}
    ok = parse_spec({"base": base, "match_active_params": {"reference": "dense", "tolerance": 0.05}, "variants": [
        {"name": "dense"},
        {"name": "top1", "overrides": {"model.moe": {"n_experts": 4, "top_k": 1}}},
        {"name": "top2-half", "overrides": {"model.moe": {"n_experts": 8, "top_k": 2, "d_expert": 64}}},
    ]}).resolve()
    counts = check_active_params(ok)
    assert counts["top1"]["total_params"] > 2 * counts["dense"]["total_params"]
    assert abs(counts["top2-half"]["active_params"] / counts["dense"]["active_params"] - 1) < 0.05
    bad = parse_spec({"base": base, "match_active_params": {"reference": "dense"}, "variants": [
        {"name": "dense"}, {"name": "top2-full", "overrides": {"model.moe": {"n_experts": 4, "top_k": 2}}}]})
    with pytest.raises(ValueError,
                       match=r"variant 'top2-full' has [\d,]+ active parameters, "
                             r"\+\d+\.\d% from the reference 'dense'"):
        bad.resolve()


# ============================================================== running, resuming, reusing
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
        run_sweep(spec, out, hooks=StopSecondAtStep2(), trainer_cls=CountingTrainer, log=quiet)
    assert [step for _, step, _ in CountingTrainer.made] == [0, 0]
    first = out / "runs/one/seed0/result.json"
    assert first.is_file() and not (out / "runs/two/seed0/result.json").exists()
    before = first.read_text()

    CountingTrainer.made = []
    rows = run_sweep(load_spec(spec_file(tmp_path, corpus)), out, trainer_cls=CountingTrainer, log=quiet)
    # only the half-finished run was constructed again, and it continued from its step-2 checkpoint
    assert CountingTrainer.made == [(str(out / "runs/two/seed0"), 2, True)]
    assert first.read_text() == before
    assert [(r["variant"], r["steps"], r["tokens"]) for r in rows] == [("one", 4, 4 * 2 * 16), ("two", 4, 4 * 2 * 16)]
    curve = read_curve(out / "runs/two/seed0")
    assert [r["step"] for r in curve if "loss" in r] == [1, 2, 3, 4]  # no step logged twice across the resume
    # wall and process CPU time run on across the resume, and the row gives the totals
    for clock in ("wall_s", "cpu_s"):
        times = [r[clock] for r in curve]
        assert all(t > 0 for t in times) and times == sorted(times), (clock, times)
    two = json.loads((out / "runs/two/seed0/result.json").read_text())
    # the row's total (to 0.01 s) is at least the curve's last CPU time (to 0.001 s): rounding the curve's
    # 0.025 again to 0.03 against a total of 0.0249 -> 0.02 failed this once in CI; half a unit is the bound,
    # in whole milliseconds (in floats 0.03 + 0.005 < 0.035, and a total of 0.0347 would fail)
    assert round(two["cpu_s"] * 1000) + 5 >= round(curve[-1]["cpu_s"] * 1000) > 0

    CountingTrainer.made = []
    run_sweep(load_spec(spec_file(tmp_path, corpus)), out, trainer_cls=CountingTrainer, log=quiet)
    assert CountingTrainer.made == []  # everything done: nothing is trained


def test_a_run_resumed_from_a_curve_without_cpu_time_has_none_not_a_part(tmp_path):
    """Curves written before CPU time was kept: a run resumed from one cannot know the CPU time it spent
    before, so it records none (the ladder then reads no CPU-time multiplier) rather than the part after."""
    from lmlab.experiments.sweep.layout import CurveLogger

    run = tmp_path / "run"
    run.mkdir()
    (run / "curve.jsonl").write_text(json.dumps({"step": 2, "tokens": 64, "wall_s": 1.5, "loss": 3.0}) + "\n")
    logger = CurveLogger(run)
    logger.begin(2)

    class T:
        tokens = 96

    logger(T(), {"step": 3, "loss": 2.9})
    rows = read_curve(run)
    assert rows[-1]["step"] == 3 and rows[-1]["wall_s"] >= 1.5 and "cpu_s" not in rows[-1]
    assert math.isnan(logger.cpu_s)
    fresh = CurveLogger(tmp_path)
    fresh.begin(0)
    sum(i * i for i in range(200_000))  # some CPU time
    fresh(T(), {"step": 1, "loss": 3.0})
    assert read_curve(tmp_path)[-1]["cpu_s"] > 0


def test_a_finished_run_is_reused_only_if_its_resolved_config_is_identical(tmp_path, corpus):
    out = tmp_path / "out"
    run_sweep(load_spec(spec_file(tmp_path, corpus)), out, log=quiet)
    one = json.loads((out / "runs/one/seed0/result.json").read_text())
    assert one["config_hash"].startswith("sha256:")
    changed = spec_file(
        tmp_path,
        corpus,
        variants=[
            {"name": "one", "overrides": {"model.n_layers": 1}},
            {"name": "two", "overrides": {"model.n_layers": 2, "optim.lr": 1e-3}},
        ],
    )
    CountingTrainer.made, lines = [], []
    run_sweep(load_spec(changed), out, trainer_cls=CountingTrainer, log=lines.append)
    # the changed variant reran from scratch and said why; the unchanged one was read back
    assert CountingTrainer.made == [(str(out / "runs/two/seed0"), 0, False)]
    assert any(
        "two seed 0: config changed since it ran: optim.lr: 0.002 vs 0.001 (then vs now); rerunning" in m for m in lines
    ), lines
    assert any("one seed 0: done earlier" in m for m in lines)
    assert json.loads((out / "runs/one/seed0/result.json").read_text()) == one
    # a result.json from before config hashes (or of another config) is not trusted either
    legacy = out / "runs/one/seed0/result.json"
    legacy.write_text(json.dumps({k: v for k, v in one.items() if k != "config_hash"}))
    CountingTrainer.made = []
    run_sweep(load_spec(changed), out, trainer_cls=CountingTrainer, log=quiet)
    assert CountingTrainer.made == [(str(out / "runs/one/seed0"), 0, False)]


def test_sweep_writes_rows_summary_and_shares_data(tmp_path, corpus):
    path = spec_file(tmp_path, corpus, seeds=2, variants=[
        {"name": "base"},
        {"name": "ft", "init_from": "base", "overrides": {"train.steps": 2, "optim.lr": 1e-4, "optim.min_lr": 1e-5}},
    ])
    out = tmp_path / "out"
    assert cli.main(["sweep", str(path), "--out", str(out)]) == 0
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["variant"], r["seed"]) for r in rows] == [("base", "0"), ("base", "1"), ("ft", "0"), ("ft", "1")]
    assert set(COLUMNS) <= set(rows[0])
    base0 = rows[0]
    assert int(base0["tokens"]) == 4 * 2 * 16 and int(rows[2]["tokens"]) == 2 * 2 * 16
    assert int(base0["total_params"]) == int(base0["active_params"]) > 0 and float(base0["flops_per_token"]) > 0
    assert float(base0["tokens_per_s"]) > 0 and base0["diverged"] == "False"
    # seed s means init seed s and data order s
    assert [(r["init_seed"], r["data_seed"]) for r in rows[:2]] == [("0", "0"), ("1", "1")]
    assert rows[0]["final_val_loss"] != rows[1]["final_val_loss"]
    assert len(base0["revision"]) == 40 and base0["tree_clean"] in ("True", "False")
    # every run read the one shared prepared copy
    for r in ("base/seed0", "ft/seed1"):
        cfg = yaml.safe_load((out / "runs" / r / "config.yaml").read_text())
        assert cfg["data"]["dir"] == str((out / "data").resolve())
    assert not (out / "runs/base/seed0/data").exists()
    summary = (out / "summary.md").read_text()
    base_vals = [json.loads((out / f"runs/base/seed{s}/result.json").read_text())["final_val_loss"] for s in (0, 1)]
    assert report.mean_std(base_vals) in summary
    assert "| base | 2 | 0/2 |" in summary
    # the fine-tune started from base's final weights (2 small steps away), not from a fresh init
    from safetensors.torch import load_file

    from lmlab.model import Transformer
    from lmlab.run.checkpoint import local as ckpt

    def weights(run):
        return load_file(str(ckpt.resolve(out / "runs" / run / "checkpoints", "latest") / ckpt.WEIGHTS))["embed.weight"]

    ft_cfg = yaml.safe_load((out / "runs/ft/seed0/config.yaml").read_text())
    assert ft_cfg["train"]["init_from"] == str(ckpt.resolve((out / "runs/base/seed0/checkpoints").resolve(), "latest"))
    base_w, ft_w = weights("base/seed0"), weights("ft/seed0")
    init_w = Transformer(load_spec(path).configs["base"].model).embed.weight.detach()
    assert (ft_w - base_w).norm() < 0.2 * (base_w - init_w).norm()


def test_run_status_separates_divergence_from_learning_nothing():
    limits = {"unigram": 3.0, "init": 5.5}
    assert run_status(2.5, "", limits, "init") == ("ok", "")
    status, why = run_status(3.1, "", limits, "init")
    assert status == "no better than unigram" and "3.100 >= the unigram loss 3.000" in why
    assert run_status(5.6, "", limits, "init")[0] == "diverged"
    assert run_status(float("nan"), "", limits, "init") == ("diverged", "non-finite validation loss")
    assert run_status(2.0, "non-finite loss/gradient: x", limits, "init") == ("diverged", "non-finite loss/gradient: x")
    assert run_status(2.0, "", limits, 1.5)[0] == "diverged"


def test_labels_and_unigram_loss_on_a_real_sweep(tmp_path, corpus):
    rows = run_sweep(
        load_spec(spec_file(tmp_path, corpus, diverged_above=0.5, variants=[{"name": "one"}])),
        tmp_path / "out",
        log=quiet,
    )
    assert rows[0]["status"] == "diverged" and "above 0.500" in rows[0]["status_reason"]
    rows = run_sweep(
        load_spec(spec_file(tmp_path, corpus, variants=[{"name": "lazy", "overrides": {"optim.lr": 1e-6}}])),
        tmp_path / "out2",
        log=quiet,
    )
    assert rows[0]["status"] == "no better than unigram" and not rows[0]["diverged"]  # 4 steps at lr 1e-6 learn nothing
    data = tmp_path / "out" / "data"
    from lmlab.run.data.batches import TokenData

    train, val = np.asarray(TokenData(data, "train").tokens), np.asarray(TokenData(data, "val").tokens)
    counts = np.bincount(train, minlength=256) + 1.0
    expected = -np.log(counts / counts.sum())[val].mean()
    assert unigram_loss(data) == pytest.approx(expected, rel=1e-9)
    starts = spread_starts(len(val), 16, 3)
    assert starts.tolist() == [0, (len(val) - 17) // 2, len(val) - 17] or starts[0] == 0 and starts[-1] == len(val) - 17
    on_slice = -np.log(counts / counts.sum())[val[starts[:, None] + 1 + np.arange(16)]].mean()
    assert unigram_loss(data, 16, 3) == pytest.approx(on_slice, rel=1e-9)


def test_final_eval_is_the_same_slice_for_every_run_and_summary(tmp_path, corpus):
    path = spec_file(tmp_path, corpus, final_eval={"tokens": 96}, variants=[{"name": "one"}])
    out = tmp_path / "out"
    rows = run_sweep(load_spec(path), out, log=quiet)
    assert rows[0]["eval_tokens"] == 96  # 6 windows of 16
    from lmlab.model import Transformer
    from lmlab.run.checkpoint import local as ckpt
    from lmlab.run.data.batches import TokenData
    from lmlab.run.evaluate import evaluate

    cfg = yaml.safe_load((out / "runs/one/seed0/config.yaml").read_text())
    from lmlab.run.config import RunConfig

    model = Transformer(RunConfig.from_dict({k: v for k, v in cfg.items() if k != "provenance"}).model)
    ckpt.load_weights(model, ckpt.resolve(out / "runs/one/seed0/checkpoints", "latest") / ckpt.WEIGHTS)
    val = TokenData(out / "data", "val")
    expected = evaluate(model, SpreadSlice(val, 6), batch_size=8, seq_len=16).loss
    assert rows[0]["final_val_loss"] == pytest.approx(expected, rel=1e-6)
    assert "over 96 validation tokens" in (out / "summary.md").read_text()


def test_spread_evaluation_is_the_final_slice_at_every_point_of_the_curve(tmp_path, corpus):
    """eval.windows spread: every pass reads the same windows spread over the whole split, so with
    batches x batch_size windows = the final slice, the curve's last point is the final loss."""
    base = {**TINY, "eval": {"every": 2, "batches": 3, "windows": "spread"},
            "data": {"source": str(corpus), "val_fraction": 0.1}}
    path = spec_file(tmp_path, corpus, base=base, final_eval={"tokens": 96}, variants=[{"name": "one"}])
    rows = run_sweep(load_spec(path), tmp_path / "out", log=quiet)
    curve = [r["val_loss"] for r in read_curve(tmp_path / "out" / "runs/one/seed0") if r.get("val_loss") is not None]
    assert len(curve) == 2 and curve[-1] == pytest.approx(rows[0]["final_val_loss"], rel=1e-6)
    from lmlab.run.data.batches import TokenData

    val = TokenData(tmp_path / "out" / "data", "val")
    spread = [x for x, _ in val.iter_eval(2, 16, 3, spread=True)]
    first = [x for x, _ in val.iter_eval(2, 16, 3)]
    starts = spread_starts(len(val), 16, 6)
    assert starts[-1] == len(val) - 17  # the last window ends at the split's end
    assert torch.equal(torch.cat(spread)[:, 0], torch.from_numpy(np.asarray(val.tokens)[starts]).long())
    assert torch.equal(torch.cat(first)[:, 0], torch.from_numpy(np.asarray(val.tokens)[np.arange(6) * 16]).long())


# ============================================================== parallel workers
def test_claims_are_exclusive_and_released(tmp_path):
    lock = tmp_path / "locks" / "a.lock"
    with claim(lock) as first:
        assert first
        with claim(lock) as second:  # another open file description: refused while held
            assert not second
    with claim(lock) as again:
        assert again


@pytest.mark.slow
def test_two_workers_give_the_rows_one_process_gives(tmp_path, corpus):
    path = spec_file(tmp_path, corpus, seeds=2, variants=[
        {"name": "one"}, {"name": "two", "overrides": {"model.n_layers": 2}},
        {"name": "ft", "init_from": "two", "overrides": {"model.n_layers": 2, "train.steps": 2}}])
    serial = run_sweep(load_spec(path), tmp_path / "serial", log=quiet, threads=1)
    lines: list[str] = []
    parallel = run_sweep(load_spec(path), tmp_path / "parallel", log=lines.append, jobs=2, threads=1)
    keys = ("variant", "seed", "steps", "final_val_loss", "best_val_loss", "final_train_loss", "config_hash")
    assert [tuple(r[k] for k in keys) for r in parallel] == [tuple(r[k] for k in keys) for r in serial]
    made = sorted(p.parent.name + "/" + p.name for p in (tmp_path / "parallel" / "runs").glob("*/seed*"))
    assert made == ["ft/seed0", "ft/seed1", "one/seed0", "one/seed1", "two/seed0", "two/seed1"]
    # every run trained exactly once: one session each in its provenance
    for run in (tmp_path / "parallel" / "runs").glob("*/seed*"):
        assert len(yaml.safe_load((run / "config.yaml").read_text())["provenance"]) == 1


# ============================================================== tuning
def test_choose_takes_each_groups_lowest_mean_loss_and_never_a_failed_value():
    tune = Tune("optim.lr", [1e-3, 3e-3, 1e-2], ["arch"], {}, [7, 8], {})

    def row(group, value, loss, status="ok"):
        return {"tune_group": group, "tune_value": str(value), "final_val_loss": loss, "status": status}

    rows = [row("post", 1e-3, 3.0), row("post", 1e-3, 3.2), row("post", 3e-3, 2.9), row("post", 3e-3, 3.2),
            row("post", 1e-2, 1.0, "diverged"), row("post", 1e-2, 2.0),
            row("pre", 1e-3, 3.0), row("pre", 1e-3, 3.0), row("pre", 3e-3, 2.5), row("pre", 3e-3, 2.6),
            row("pre", 1e-2, 2.4), row("pre", 1e-2, 2.45)]
    choices, table = choose(tune, rows)
    assert choices == {"post": 3e-3, "pre": 1e-2}  # post's 1e-2 has a diverged seed: +inf
    assert next(t for t in table if t["group"] == "post" and t["value"] == 1e-2)["mean_final_val_loss"] is None
    assert math.isclose(
        next(t for t in table if t["group"] == "pre" and t["value"] == 3e-3)["mean_final_val_loss"], 2.55
    )


def test_a_choice_at_either_edge_of_the_grid_is_flagged_and_an_interior_one_is_not():
    tune = {"values": [1.5e-3, 3e-3, 6e-3], "chosen": {"dense": 6e-3, "moe": 3e-3, "tiny": 1.5e-3}}
    assert grid_edges(tune) == {"dense": 6e-3, "tiny": 1.5e-3}
    assert (
        grid_edge_text(tune)
        == "Chosen at an edge of the grid, so the best value may lie beyond it: dense 0.006, tiny 0.0015. "
    )
    assert grid_edges({"values": [1e-3, 2e-3, 3e-3, 1.2e-2], "chosen": {"dense": 3e-3}}) == {}
    assert grid_edge_text({"values": [1e-3, 3e-3], "chosen": {"a": 2e-3}}) == ""
    assert grid_edges({"values": ["glu", "mlp"], "chosen": {"a": "glu"}}) == {}  # not an ordered grid
    assert grid_edges(None) == {} and grid_edges({"values": [3e-3], "chosen": {"a": 3e-3}}) == {}


def test_tuning_runs_first_and_its_choice_reaches_the_main_runs(tmp_path, corpus):
    path = spec_file(tmp_path, corpus, variants=None, grid=[
        {"axis": "arch", "levels": [{"name": "pre", "overrides": {"model.norm_position": "pre"}},
                                    {"name": "post", "overrides": {"model.norm_position": "post"}}]},
        {"axis": "depth", "levels": [{"name": "L1", "overrides": {"model.n_layers": 1}},
                                     {"name": "L2", "overrides": {"model.n_layers": 2}}]}],
        tune={"field": "optim.lr", "values": [1e-6, 3e-3], "by": ["arch"], "at": {"depth": "L2"}, "seeds": [9],
              "overrides": {"train.steps": 3}, "max_extensions": 0})  # extension: test_tuning.py
    out = tmp_path / "out"
    rows = run_sweep(load_spec(path), out, log=quiet)
    tune = json.loads((out / "tune.json").read_text())
    assert tune["chosen"] == {"pre": 3e-3, "post": 3e-3}  # 1e-6 learns nothing in 3 steps
    assert sorted(p.name for p in (out / "runs").iterdir()) == [
        "post-L1",
        "post-L2",
        "pre-L1",
        "pre-L2",
        "tune-post-lr0.003",
        "tune-post-lr1e-06",
        "tune-pre-lr0.003",
        "tune-pre-lr1e-06",
    ]
    assert all((out / "runs" / n / "seed9").is_dir() for n in ("tune-pre-lr0.003", "tune-post-lr1e-06"))
    for r in rows:
        cfg = yaml.safe_load((out / "runs" / r["variant"] / "seed0" / "config.yaml").read_text())
        assert cfg["optim"]["lr"] == 3e-3 and cfg["train"]["steps"] == 4


# ============================================================== tables
def test_mean_std_and_markdown():
    assert report.mean_std([1.0, 2.0, 3.0]) == "2.0000 ± 1.0000"
    assert report.mean_std([2.5]) == "2.5000"
    assert report.mean_std([float("nan")]) == "nan"
    assert report.markdown_table([{"a": 1234, "b": 0.5}]) == "| a | b |\n|---|---|\n| 1,234 | 0.5000 |\n"


def test_subcommands_show_defaults_in_help(capsys):
    assert cli.main(["experiment", "--help"]) == 0
    text = capsys.readouterr().out
    assert "norm" in text and "positions" in text and "moe" in text and "(default: 1)" in text  # --jobs
    assert "(default: None)" not in text  # an option that is not given says in words what happens then
    assert "--jobs" in text and "--profile" in text
    assert cli.main(["sweep", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--seeds" in text and "--jobs" in text and "--threads" in text
