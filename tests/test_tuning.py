"""Tuning that cannot decide a verdict: a grid extended past the edge its best value sits at (the tune
stage, and a grid axis with extend:), variants exempt from the tuned value (one common rate), and
the rules a verdict's arms are checked against (tune_problems). Training is faked: a trainer whose
final loss is a function of its learning rate."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from helpers import corpus

from lmlab.experiments.sweep import load_spec, run_sweep, sweep_outcome
from lmlab.experiments.sweep.tuning import beyond_edge, grid_edge_text, step_factor, stop_reason, tune_problems
from lmlab.run.trainer import Trainer, TrainingDiverged, TrainResult

BASE = {
    "model": {"d_model": 16, "n_heads": 2, "n_layers": 1, "max_seq_len": 16},
    "train": {"steps": 4, "batch_size": 2, "device": "cpu"}, "optim": {"warmup_steps": 1},
    "eval": {"every": 2, "batches": 1}, "checkpoint": {"every": 2},
    "log": {"every": 1, "sample_tokens": 0, "tensorboard": False},
}


def lr_trainer(best: float, diverge_above: float = math.inf, by_layers: dict[int, float] | None = None):
    """A Trainer that trains nothing: its final loss is 1 + 0.1 log2(lr / best)^2 (+ a little per seed),
    lowest at ``best`` (``by_layers``: model.n_layers -> its own best), and it diverges above ``diverge_above``.
    ``made`` lists (run, lr) for every run it was asked to train."""

    class LrLoss(Trainer):
        made: list[tuple[str, float]] = []

        def fit(self) -> TrainResult:
            lr, t = self.cfg.optim.lr, self.cfg.train
            LrLoss.made.append((f"{self.run_dir.parent.name}/{self.run_dir.name}", lr))
            if lr > diverge_above:
                raise TrainingDiverged(f"lr {lr} is too high (fake)")
            self.step, self.tokens = t.steps, t.steps * t.batch_size * self.cfg.seq_len
            target = (by_layers or {}).get(self.cfg.model.n_layers, best)
            loss = 1.0 + 0.1 * math.log2(lr / target) ** 2 + 0.001 * t.seed
            return TrainResult(step=self.step, loss=loss, val_loss=loss, best_val_loss=loss, skipped_steps=0,
                               tokens=self.tokens, elapsed_s=0.0, checkpoint=None)

    return LrLoss


def quiet(message):
    pass


def write_spec(tmp_path, **changes):
    text = corpus(tmp_path / "corpus.txt")
    data = {"name": "tiny", "base": {**BASE, "data": {"source": str(text), "val_fraction": 0.1}},
            "variants": [{"name": "dense"}], **changes}
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def tune(values, **more):
    return {"field": "optim.lr", "values": values, "seeds": [0, 1], **more}


def lr_of(out, run):
    return yaml.safe_load((out / "runs" / run / "config.yaml").read_text())["optim"]["lr"]


# ============================================================== pure: the next value beyond an edge
def test_beyond_edge_follows_the_best_value_past_either_edge_and_stops_inside():
    top = beyond_edge({1e-3: 3.0, 2e-3: 2.5, 4e-3: 2.0}, 2)
    assert (top.value, top.side) == (8e-3, "above") and "the best value 0.004" in top.reason and "largest" in top.reason
    bottom = beyond_edge({1e-3: 2.0, 3e-3: 2.5}, 3)
    assert bottom.value == pytest.approx(1e-3 / 3) and bottom.side == "below" and "smallest" in bottom.reason
    assert beyond_edge({1e-3: 3.0, 2e-3: 2.0, 4e-3: 2.5}, 2) is None  # interior
    # a value beyond the edge that diverged makes the edge interior in effect
    assert beyond_edge({1e-3: 3.0, 2e-3: 2.0, 4e-3: math.inf}, 2) is None
    assert beyond_edge({1e-3: math.inf, 2e-3: math.inf}, 2) is None  # nothing learned: no direction
    assert beyond_edge({"glu": 2.0, "mlp": 3.0}, 2) is None and beyond_edge({3e-3: 2.0}, 2) is None
    assert beyond_edge({50: 3.0, 100: 2.0}, 2).value == 200  # integers stay integers
    assert beyond_edge({1: 2.0, 2: 3.0}, 1.5) is None  # round(1 / 1.5) = 1: nothing new to try
    assert beyond_edge({1e-3: 2.0, 2e-3: 2.0}, 2).value == 5e-4  # a tie keeps the first value tried


def test_the_factor_is_the_grids_ratio_when_log_uniform_else_the_specs_else_two():
    assert step_factor([1e-3, 2e-3, 4e-3]) == 2.0 and step_factor([9e-3, 1e-3, 3e-3]) == 3.0
    assert step_factor([1e-3, 3e-3, 1e-2]) == 2.0 and step_factor([1e-3, 3e-3, 1e-2], 4) == 4.0
    assert step_factor([1e-3, 2e-3], 1.5) == 1.5 and step_factor(["a", "b"]) == 2.0
    assert stop_reason({1e-3: 3.0, 2e-3: 2.0}, 3, 3) == "still at an edge after 3 extensions (max 3)"
    assert stop_reason({1e-3: 3.0, 2e-3: 2.0, 4e-3: math.inf}, 1, 3) == "interior: the value beyond the edge diverged"


# ============================================================== the tune stage extends its grid
def test_a_choice_at_the_top_edge_extends_upward_until_interior_and_a_rerun_trains_nothing(tmp_path):
    path = write_spec(tmp_path, variants=[{"name": "dense"}, {"name": "moe", "overrides": {"model.n_layers": 2}}],
                      tune=tune([2e-3, 4e-3, 8e-3]))
    trainer = lr_trainer(best=4e-3, by_layers={1: 1.6e-2})  # dense: 1.6e-2, beyond the top; moe: interior
    out = tmp_path / "out"
    lines: list[str] = []
    run_sweep(load_spec(path), out, trainer_cls=trainer, log=lines.append)
    info = json.loads((out / "tune.json").read_text())
    dense, moe = info["groups"]["dense"], info["groups"]["moe"]
    assert dense["tried"] == [2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2] and dense["stopped"] == "interior"
    assert [e["value"] for e in dense["extensions"]] == [1.6e-2, 3.2e-2]
    assert all(e["side"] == "above" for e in dense["extensions"])
    assert dense["extensions"][0]["because"].startswith("the best value 0.008 (mean final loss 1.1005) was the largest")
    assert moe == {"tried": [2e-3, 4e-3, 8e-3], "extensions": [], "stopped": "interior"}  # interior: no extension
    assert info["chosen"] == {"dense": 1.6e-2, "moe": 4e-3} and info["extend_factor"] == 2.0
    assert grid_edge_text(info) == ""  # interior after the extensions: nothing to report
    assert lr_of(out, "dense/seed0") == 1.6e-2 and lr_of(out, "moe/seed0") == 4e-3
    assert sorted({run.split("/")[0] for run, _ in trainer.made if run.startswith("tune-dense")}) == [
        "tune-dense-lr0.002", "tune-dense-lr0.004", "tune-dense-lr0.008", "tune-dense-lr0.016", "tune-dense-lr0.032"]
    assert len(trainer.made) == (5 + 3) * 2 + 2 * 1  # tuning runs x 2 seeds, then the main runs at seed 0
    assert any("tuning dense: the best value 0.008" in m and "training optim.lr=0.016" in m for m in lines)
    csv_rows = (out / "tune.csv").read_text().splitlines()
    assert len(csv_rows) == 1 + 16

    trainer.made.clear()
    run_sweep(load_spec(path), out, trainer_cls=trainer, log=quiet)
    assert trainer.made == []  # the extension runs are ordinary runs: reused by their config hash
    assert json.loads((out / "tune.json").read_text()) == info


def test_a_choice_at_the_bottom_edge_extends_downward_by_the_grids_own_ratio(tmp_path):
    path = write_spec(tmp_path, tune=tune([1e-3, 3e-3, 9e-3]))
    trainer = lr_trainer(best=2e-4)
    out = tmp_path / "out"
    run_sweep(load_spec(path), out, trainer_cls=trainer, log=quiet)
    info = json.loads((out / "tune.json").read_text())
    assert info["extend_factor"] == 3.0
    assert info["groups"]["dense"]["tried"] == pytest.approx([1e-3, 3e-3, 9e-3, 1e-3 / 3, 1e-3 / 9])
    assert [e["side"] for e in info["groups"]["dense"]["extensions"]] == ["below", "below"]
    assert info["chosen"]["dense"] == pytest.approx(1e-3 / 3) and info["groups"]["dense"]["stopped"] == "interior"


def test_max_extensions_is_respected_and_a_group_still_at_an_edge_is_reported(tmp_path):
    path = write_spec(tmp_path, tune=tune([1e-3, 2e-3], max_extensions=2, extend_factor=4))
    trainer = lr_trainer(best=0.1)
    out = tmp_path / "out"
    run_sweep(load_spec(path), out, trainer_cls=trainer, log=quiet)
    info = json.loads((out / "tune.json").read_text())
    assert info["groups"]["dense"]["tried"] == [1e-3, 2e-3, 8e-3, 3.2e-2]  # extend_factor 4 over the ratio 2
    assert info["groups"]["dense"]["stopped"] == "still at an edge after 2 extensions (max 2)"
    assert grid_edge_text(info) == "Chosen at an edge of the grid, so the best value may lie beyond it: dense 0.032. "
    assert len(trainer.made) == 4 * 2 + 1
    spec = load_spec(path)
    assert any("still an edge of the values its group tried" in p for p in tune_problems(spec, ["dense"], info))


def test_a_value_beyond_the_edge_that_diverges_ends_the_search_with_the_edge_inside(tmp_path):
    path = write_spec(tmp_path, tune=tune([1e-3, 2e-3, 4e-3]))
    trainer = lr_trainer(best=1e-2, diverge_above=5e-3)
    out = tmp_path / "out"
    run_sweep(load_spec(path), out, trainer_cls=trainer, log=quiet)
    info = json.loads((out / "tune.json").read_text())
    assert info["groups"]["dense"]["tried"] == [1e-3, 2e-3, 4e-3, 8e-3]
    assert info["groups"]["dense"]["stopped"] == "interior: the value beyond the edge diverged"
    assert info["chosen"] == {"dense": 4e-3} and grid_edge_text(info) == ""


def test_tune_settings_are_checked_before_training(tmp_path):
    for more, message in (({"extend_factor": 1}, "extend_factor=1 is not valid"),
                          ({"max_extensions": -1}, "max_extensions=-1 is not valid"),
                          ({"full_length": "yes"}, "full_length='yes' is not valid"),
                          ({"full_length": True, "overrides": {"train.steps": 2}},
                           "full_length is true but overrides sets train.steps")):
        with pytest.raises(ValueError, match=message) as e:
            load_spec(write_spec(tmp_path, tune=tune([1e-3, 2e-3], **more)))
        assert "\n" not in str(e.value) and "spec.yaml: tune" in str(e.value)


# ============================================================== one common rate beside the tuned arms
def test_a_variant_with_tune_false_keeps_its_own_rate_beside_the_tuned_arms(tmp_path):
    path = write_spec(tmp_path, variants=[
        {"name": "dense"}, {"name": "dense-common", "tune": False, "overrides": {"optim.lr": 1e-3}}],
        tune=tune([2e-3, 4e-3, 8e-3]))
    trainer = lr_trainer(best=4e-3)
    out = tmp_path / "out"
    run_sweep(load_spec(path), out, trainer_cls=trainer, log=quiet)
    assert json.loads((out / "tune.json").read_text())["chosen"] == {"dense": 4e-3}  # no tuning group of its own
    assert lr_of(out, "dense/seed0") == 4e-3 and lr_of(out, "dense-common/seed0") == 1e-3
    assert not any(run.startswith("tune-dense-common") for run, _ in trainer.made)


def test_a_variant_with_tune_false_must_set_the_tuned_field_itself(tmp_path):
    path = write_spec(tmp_path, variants=[{"name": "dense"}, {"name": "dense-common", "tune": False}],
                      tune=tune([1e-3, 2e-3]))
    with pytest.raises(ValueError) as e:
        load_spec(path)
    assert str(e.value) == (f"{path}: variant 'dense-common' has tune: false but does not set optim.lr; "
                            "give it overrides: {optim.lr: VALUE} (the common value it trains at)")
    with pytest.raises(ValueError, match="tune=5 is not valid"):
        load_spec(write_spec(tmp_path, variants=[{"name": "dense", "tune": 5}]))
    with pytest.raises(ValueError, match="has tune: 'no', which is not a tuned variant of the spec; name one of "
                                         r"\['dense'\]"):
        load_spec(write_spec(tmp_path, variants=[{"name": "dense"}, {"name": "long", "tune": "no"}],
                             tune=tune([1e-3, 2e-3])))


def test_a_variant_can_train_at_another_variants_tuned_rate(tmp_path):
    """dense-2x (twice the steps) takes dense's tuned rate and has no tuning runs of its own."""
    path = write_spec(tmp_path, variants=[
        {"name": "dense"}, {"name": "dense-2x", "tune": "dense", "overrides": {"train.steps": 8}}],
        tune=tune([2e-3, 4e-3, 8e-3]))
    trainer = lr_trainer(best=4e-3)
    out = tmp_path / "out"
    run_sweep(load_spec(path), out, trainer_cls=trainer, log=quiet)
    assert json.loads((out / "tune.json").read_text())["chosen"] == {"dense": 4e-3}
    assert lr_of(out, "dense/seed0") == 4e-3 and lr_of(out, "dense-2x/seed0") == 4e-3
    assert not any(run.startswith("tune-dense-2x") for run, _ in trainer.made)


# ============================================================== the rules a verdict's arms are checked against
def test_tune_problems_names_what_lets_tuning_decide_a_verdict(tmp_path):
    arms = [{"name": "dense"}, {"name": "moe", "overrides": {"model.n_layers": 2}},
            {"name": "dense-common", "tune": False, "overrides": {"optim.lr": 1e-3}},
            {"name": "moe-common", "tune": False, "overrides": {"optim.lr": 1e-3, "model.n_layers": 2}}]

    def problems(names, **more):
        return tune_problems(load_spec(write_spec(tmp_path, variants=arms, tune=tune([1e-3, 2e-3], **more))), names)

    assert problems(["dense", "moe"], full_length=True) == []
    assert problems(["dense-common", "moe-common"]) == []  # both at one common rate: nothing tuned favours one
    assert problems(["dense", "moe"], seeds=[7]) == [
        f"{tmp_path / 'spec.yaml'}: tune.seeds=[7] is fewer than 2 seeds; give at least 2, so that one seed's luck "
        "does not choose the value"]
    short = problems(["dense", "moe"], overrides={"train.steps": 2})
    assert len(short) == 2 and "arm 'dense' is tuned with train.steps=2 but trained with 4" in short[0]
    mixed = problems(["dense", "moe-common"])
    assert len(mixed) == 1 and "arm 'moe-common' is not tuned while 'dense' are" in mixed[0]
    assert problems(["dense", "nope"])[0].endswith("no variant 'nope'; variants: dense, moe, dense-common, moe-common")
    no_tune = load_spec(write_spec(tmp_path, variants=arms[:2]))
    assert tune_problems(no_tune, ["dense", "moe"]) == []


def test_tune_problems_names_an_arm_tuned_on_another_variants_runs(tmp_path):
    grid = [{"axis": "arch", "levels": [{"name": "pre"}, {"name": "post",
                                                         "overrides": {"model.norm_position": "post"}}]},
            {"axis": "depth", "levels": [{"name": "L1"}, {"name": "L2", "overrides": {"model.n_layers": 2}}]}]
    spec = load_spec(write_spec(tmp_path, variants=None, grid=grid,
                                tune=tune([1e-3, 2e-3], by=["arch"], at={"depth": "L1"})))
    assert tune_problems(spec, ["pre-L1", "post-L1"]) == []
    found = tune_problems(spec, ["pre-L2", "post-L2"])
    assert len(found) == 2 and "arm 'pre-L2' takes the value tuned on 'pre-L1'" in found[0]
    by_both = load_spec(write_spec(tmp_path, variants=None, grid=grid, tune=tune([1e-3, 2e-3], by=["arch", "depth"])))
    assert tune_problems(by_both, ["pre-L2", "post-L2"]) == []
    assert sorted(by_both.tune_groups()) == ["post-L1", "post-L2", "pre-L1", "pre-L2"]


# ============================================================== a grid axis grows past its edge
LR_GRID = [
    {"axis": "depth", "levels": [{"name": "L1"}, {"name": "L2", "overrides": {"model.n_layers": 2}}]},
    {"axis": "warm", "levels": [{"name": "w1"}, {"name": "w2", "overrides": {"optim.warmup_steps": 2}}]},
    {"axis": "lr", "levels": [{"name": "lr1e-3", "overrides": {"optim.lr": 1e-3}},
                              {"name": "lr2e-3", "overrides": {"optim.lr": 2e-3}},
                              {"name": "lr4e-3", "overrides": {"optim.lr": 4e-3}}],
     "extend": {"by": ["depth"], "max": 3}},
]


def test_a_grid_axis_extends_past_its_edge_for_that_group_only_and_a_rerun_trains_nothing(tmp_path):
    path = write_spec(tmp_path, variants=None, grid=LR_GRID, seeds=2)
    trainer = lr_trainer(best=2e-3, by_layers={1: 1.6e-2})  # L1's best lies beyond the grid's top; L2's inside
    out = tmp_path / "out"
    lines: list[str] = []
    outcome = sweep_outcome(load_spec(path), out, trainer_cls=trainer, log=lines.append)
    info = json.loads((out / "extend.json").read_text())
    assert outcome.extend == info and info["axis"] == "lr" and info["field"] == "optim.lr" and info["factor"] == 2.0
    l1, l2 = info["groups"]["L1"], info["groups"]["L2"]
    assert [t["level"] for t in l1["tried"]] == ["lr1e-3", "lr2e-3", "lr4e-3", "lr0.008", "lr0.016", "lr0.032"]
    assert [e["value"] for e in l1["extensions"]] == [8e-3, 1.6e-2, 3.2e-2]
    assert l1["best"] == "lr0.016" and l1["stopped"] == "interior"
    assert l1["extensions"][0]["because"].startswith("the best value 0.004 (mean final loss 1.4005) was the largest")
    assert l2 == {"tried": [{"level": "lr1e-3", "value": 1e-3}, {"level": "lr2e-3", "value": 2e-3},
                            {"level": "lr4e-3", "value": 4e-3}], "extensions": [], "best": "lr2e-3",
                  "stopped": "interior"}
    assert info["levels"]["lr0.032"] == 3.2e-2 and info["levels"]["lr1e-3"] == 1e-3
    # every seed of every variant of the group (both warmups) trained at each new level; L2 at none
    assert len(trainer.made) == (12 + 3 * 2) * 2
    new = [r for r in outcome.rows if r["lr"] not in ("lr1e-3", "lr2e-3", "lr4e-3")]
    assert sorted({(r["variant"], r["depth"], r["warm"], r["lr"]) for r in new}) == [
        (f"L1-{w}-{lv}", "L1", w, lv) for w in ("w1", "w2") for lv in ("lr0.008", "lr0.016", "lr0.032")]
    assert lr_of(out, "L1-w2-lr0.016/seed1") == 1.6e-2 and outcome.spec.configs["L1-w2-lr0.016"].optim.warmup_steps == 2
    csv_rows = (out / "results.csv").read_text().splitlines()
    assert len(csv_rows) == 1 + 36 and any(",lr0.032," in line for line in csv_rows)
    assert any(m.startswith("extending lr for L1: the best value 0.004") and "(lr0.008)" in m for m in lines)

    trainer.made.clear()
    again = sweep_outcome(load_spec(path), out, trainer_cls=trainer, log=quiet)
    assert trainer.made == [] and again.extend == info and len(again.rows) == 36


def test_a_grid_axis_extension_stops_at_max_and_is_checked_before_training(tmp_path):
    grid = [LR_GRID[0], {**LR_GRID[2], "extend": {"by": "depth", "max": 1, "factor": 4}}]
    trainer = lr_trainer(best=0.1)
    outcome = sweep_outcome(load_spec(write_spec(tmp_path, variants=None, grid=grid)), tmp_path / "out",
                            trainer_cls=trainer, log=quiet)
    assert [t["value"] for t in outcome.extend["groups"]["L2"]["tried"]] == [1e-3, 2e-3, 4e-3, 1.6e-2]
    assert outcome.extend["groups"]["L2"]["stopped"] == "still at an edge after 1 extensions (max 1)"

    for change, message in (
        ({"by": ["width"]}, r"grid\[2\].extend: by names 'width', which is not another grid axis"),
        ({"by": ["lr"]}, "by names 'lr', which is not another grid axis"),
        ({"max": -1}, "max=-1 is not valid"), ({"factor": 0.5}, "factor=0.5 is not valid"),
        ({"step": 2}, "unknown key 'step'"), ({"field": "optim.min_lr"}, "level 'lr1e-3' sets optim.min_lr=None"),
    ):
        bad = [*LR_GRID[:2], {**LR_GRID[2], "extend": {"by": ["depth"], **change}}]
        with pytest.raises(ValueError, match=message):
            load_spec(write_spec(tmp_path, variants=None, grid=bad))
    with pytest.raises(ValueError, match="grid axes 0 and 1 both declare extend:"):
        load_spec(write_spec(tmp_path, variants=None, grid=[{**LR_GRID[0], "extend": {"by": []}},
                                                            {**LR_GRID[2], "extend": {}}]))
    with pytest.raises(ValueError, match=r"cannot tell which field the levels set \(none"):
        load_spec(write_spec(tmp_path, variants=None, grid=[{**LR_GRID[0], "extend": {}}]))
    with pytest.raises(ValueError, match="the axis sets optim.lr, which tune: also chooses"):
        load_spec(write_spec(tmp_path, variants=None, grid=LR_GRID, tune=tune([1e-3, 2e-3], by=["depth"])))
    with pytest.raises(ValueError, match=r"grid\[0\]: unknown key 'extends'"):
        load_spec(write_spec(tmp_path, variants=None, grid=[{**LR_GRID[0], "extends": {}}]))


def test_moe_report_names_a_tuning_problem_of_the_arms_a_registered_claim_compares():
    """The moe report checks issue 21's tuning rule per rerun claim: a chosen rate at a grid edge is named
    under the claim it could decide; interior choices read as a passed check; re-analysed claims are skipped."""
    from lmlab.experiments import load_experiment_spec
    from lmlab.experiments.moe import tuning_check_text

    spec = load_experiment_spec("moe")
    edge = tuning_check_text(spec, {"values": [1e-3, 2e-3, 4e-3], "seeds": [1000, 1001],
                                    "chosen": {"dense": 2e-3, "fg-m4-shared": 4e-3, "fg-m4": 2e-3}})
    assert edge.startswith("**Tuning problems**")
    assert "capacity: " in edge and "shared: " in edge and "'fg-m4-shared' was tuned to 0.004" in edge
    assert "'dense' was tuned" not in edge and "loss-free" not in edge
    ok = tuning_check_text(spec, {"values": [1e-3, 2e-3, 4e-3], "seeds": [1000, 1001],
                                  "chosen": {"dense": 2e-3, "fg-m4-shared": 2e-3, "fg-m4": 2e-3}})
    assert ok.startswith("Tuning check (capacity, capacity-common, shared)")
