"""lmlab ladder: the fitted laws, multipliers, trend and held-out check recover known values from synthetic
curves within their intervals (and the intervals cover them most of the time); the spec's budget and rate
rules; moe's all-seeds multiplier; the whole command at --quick size."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from lmlab import cli
from lmlab.experiments import moe
from lmlab.experiments.ladder import law, resolve_spec
from lmlab.experiments.ladder.spec import parse_ladder
from lmlab.experiments.report import read_csv

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"

# ============================================================== synthetic ladders with known answers
# Arm A: L_A(C) = E + A (C/C0)^-alpha. Arm B reaches A's loss with k(C) = K0 (C/C0)^BETA times less compute:
# L_B(C) = L_A(k(C) C), itself a law with E, A K0^-alpha and alpha (1 + BETA); the trend slope is BETA.
E, A, ALPHA, C0, K0, BETA = 2.0, 1.5, 0.3, 1e13, 2.0, 0.05
RUNGS = [C0 * 4.0 ** (i - 2) for i in range(6)]


def loss_a(c):
    return E + A * (c / C0) ** -ALPHA


def k_true(c):
    return K0 * (c / C0) ** BETA


def loss_b(c):
    return loss_a(k_true(c) * c)


def synthetic(draw: int, seeds: int = 8, sd: float = 0.01, wall: bool = False) -> list[law.Point]:
    """Every arm x rung x seed: the law, a per-seed offset shared by both arms (seeds are paired) and noise."""
    rng = np.random.default_rng(100 + draw)
    points = []
    for s in range(seeds):
        offset = rng.normal(0, sd)
        for i, c in enumerate(RUNGS):
            for arm, f, speed in (("A", loss_a, 1e9), ("B", loss_b, 0.8e9)):
                points.append(law.Point(arm, f"r{i}", s, c, f(c) + offset + rng.normal(0, sd),
                                        c / speed if wall else math.nan))
    return points


def truths(a: law.LadderAnalysis) -> dict[str, tuple[law.Estimate, float]]:
    """(estimate, true value) of everything the analysis recovers."""
    out = {"E_A": (a.arms["A"].E, E), "A_A": (a.arms["A"].A, A), "alpha_A": (a.arms["A"].alpha, ALPHA),
           "E_B": (a.arms["B"].E, E), "A_B": (a.arms["B"].A, A * K0 ** -ALPHA),
           "alpha_B": (a.arms["B"].alpha, ALPHA * (1 + BETA)),
           "slope": (a.pairs[0].trend.slope, BETA), "heldout_A": (a.arms["A"].heldout.error, 0.0)}
    out |= {f"m_{r.rung}": (r.flops, k_true(c)) for r, c in zip(a.pairs[0].rungs, RUNGS)}
    return out


def test_a_noise_free_law_is_recovered_exactly_and_inverted():
    c = np.array(RUNGS)
    fit = law.fit_law(c, loss_a(c), C0)
    assert (fit.E, fit.A, fit.alpha) == pytest.approx((E, A, ALPHA), rel=1e-3) and not fit.at_bound
    assert fit.compute_for(float(loss_a(3e13))) == pytest.approx(3e13, rel=1e-3)
    assert fit.compute_for(E - 0.1) == math.inf  # below the asymptote: never reached
    rising = 3.0 + 0.01 * np.arange(len(c))
    flat = law.fit_law(c, rising, C0)  # a loss that rises with compute: A = 0, never a negative law
    # ... which has no inverse: no compute reaches a loss on it (nan), neither below its mean nor above
    assert flat.A == 0 and flat.flat and flat.E == pytest.approx(rising.mean())
    assert math.isnan(flat.compute_for(2.9)) and math.isnan(flat.compute_for(3.5))
    with pytest.raises(ValueError, match="3 or more distinct computes"):
        law.fit_law([1e13, 1e13, 2e13], [3.0, 3.1, 2.9], C0)


def test_synthetic_law_multiplier_and_trend_come_back_within_their_intervals():
    """One fixed draw (draw 1: each value inside its interval, as in 3 of the first 8 draws; with 14 values
    at ~90% coverage each, a draw usually misses one somewhere): how often each is covered is the next test's."""
    a = law.analyze(synthetic(1, wall=True), [("B", "A")], c0=C0, n_resamples=199)
    for name, (est, true) in truths(a).items():
        assert est.covers(true), (name, est, true)
    pair = a.pairs[0]
    assert pair.trend.direction == "grows" and pair.trend.slope.lo > 0
    assert [r.status for r in pair.rungs] == ["interpolated"] * 5 + ["extrapolated"]  # past A's largest rung
    # wall clock: B runs at 0.8x A's speed, so its wall multiplier is its FLOPs multiplier x 0.8
    assert [r.wall.value for r in pair.rungs] == pytest.approx([0.8 * r.flops.value for r in pair.rungs], rel=0.02)
    assert all(r.difference.n == 8 and r.difference.hi < 0 for r in pair.rungs)  # B - A by seed, paired


def test_wall_times_that_tie_leave_the_wall_figure_missing_not_the_ladder_failed():
    """Runs of a second or less, timed to 0.1 s, can share a wall time at two rungs (CI's fast machine did,
    and the law fit raised). The FLOPs figures stand; the wall figure of that baseline is missing."""
    points = [dataclasses.replace(p, wall_s=0.5 if p.rung in ("r0", "r1", "r2") else 0.7) if p.arm == "A" else p
              for p in synthetic(1, seeds=3, wall=True)]
    a = law.analyze(points, [("B", "A")], c0=C0, n_resamples=49)
    assert a.arms["A"].wall_law is None and a.arms["B"].wall_law is not None
    assert all(r.wall is None and r.wall_status == "" for r in a.pairs[0].rungs)
    timed = law.analyze(synthetic(1, seeds=3, wall=True), [("B", "A")], c0=C0, n_resamples=49)
    assert [r.flops.value for r in a.pairs[0].rungs] == [r.flops.value for r in timed.pairs[0].rungs]
    assert all(r.wall is not None and math.isfinite(r.wall.value) for r in timed.pairs[0].rungs)


def test_the_intervals_cover_the_true_values_in_most_of_20_draws():
    """95% percentile intervals from 8 seeds: each value is covered in at least 15 of 20 draws, and 85% of
    all (value, draw) pairs are (the percentile bootstrap is a little narrow with 8 seeds)."""
    hits: dict[str, int] = {}
    for draw in range(20):
        a = law.analyze(synthetic(draw), [("B", "A")], c0=C0, n_resamples=99, seed=draw)
        for name, (est, true) in truths(a).items():
            hits[name] = hits.get(name, 0) + est.covers(true)
    assert min(hits.values()) >= 15, hits
    assert sum(hits.values()) >= 0.85 * 20 * len(hits), hits


def test_every_seed_counts_and_an_unreachable_loss_is_marked_not_dropped():
    points = synthetic(1, seeds=4)
    # seed 3 of B is worse than A at every rung: it is averaged in, and moves the multiplier down
    worse = [law.Point(p.arm, p.rung, p.seed, p.compute, p.loss + (0.3 if p.arm == "B" and p.seed == 3 else 0.0))
             for p in points]
    base = law.analyze(points, [("B", "A")], c0=C0, n_resamples=0)
    moved = law.analyze(worse, [("B", "A")], c0=C0, n_resamples=0)
    assert moved.seeds == [0, 1, 2, 3]
    assert all(m.flops.value < b.flops.value for m, b in zip(moved.pairs[0].rungs, base.pairs[0].rungs))
    # a loss below A's asymptote: an infinite multiplier, marked, with every other rung still read
    below = [p if not (p.arm == "B" and p.rung == "r5") else law.Point("B", "r5", p.seed, p.compute, E - 0.2)
             for p in points]
    r5 = law.analyze(below, [("B", "A")], c0=C0, n_resamples=0).pairs[0].rungs[-1]
    assert r5.status == "unreachable" and r5.flops.value == math.inf and "∞" in r5.flops.text("x")
    # an arm measured at one compute has no law of its own but is read against its baseline
    one = [p for p in points if p.arm == "A"] + [law.Point("C", "only", s, 1e13, 2.9) for s in range(4)]
    a = law.analyze(one, [("C", "A")], c0=C0, n_resamples=0)
    assert "C" not in a.arms and a.pairs[0].rungs[0].flops.value > 0
    with pytest.raises(ValueError, match="needs 3 or more"):
        law.analyze(one, [("A", "C")], c0=C0)


def test_the_multiplier_table_gives_every_compared_arms_loss_not_only_the_first_pairs():
    # norm-depth compares two arms with post: the column was named after the first pair's arm ("pre loss"),
    # so the table, keyed by the first row, left deepnorm's loss out
    from lmlab.experiments.ladder import report
    from lmlab.experiments.report import markdown_table
    points = synthetic(2, seeds=3)
    points += [law.Point("C", p.rung, p.seed, p.compute, p.loss + 0.01) for p in points if p.arm == "B"]
    a = law.analyze(points, [("B", "A"), ("C", "A")], c0=C0, n_resamples=0)
    rows = report._multipliers(a)
    table = markdown_table(rows).splitlines()[2:]
    assert len(rows) == len(table) == 2 * len(RUNGS)
    for row, line in zip(rows, table):
        arm, rung = row["comparison"].split()[0], row["rung"]
        mean = np.mean([p.loss for p in points if p.arm == arm and p.rung == rung])
        assert line.split(" | ")[3] == f"{mean:.3f}"


def test_an_asymptote_clamped_at_zero_is_marked_in_the_laws_table_and_said_once():
    # moe-compute's laws had E = 0.000 with a zero-width interval and no mark, while alpha at a bound was marked
    from lmlab.experiments.ladder import report
    from lmlab.experiments.report import markdown_table
    c = np.array(RUNGS)
    steep = 4.0 - 0.3 * np.log(c / C0)  # falls linearly in log C: no floor E > 0 follows it
    fit = law.fit_law(c, steep, C0)
    assert fit.E == 0.0 and fit.A > 0 and fit.E_at_bound
    assert not law.fit_law(c, loss_a(c), C0).E_at_bound  # the synthetic law's floor, E = 2
    assert not law.fit_law(c, 3.0 + 0.01 * np.arange(len(c)), C0).E_at_bound  # flat: E is the mean, A = 0
    points = [law.Point("A", f"r{i}", s, x, 4.0 - 0.3 * math.log(x / C0) + 0.01 * s) for s in range(3)
              for i, x in enumerate(RUNGS)]
    points += [law.Point("B", p.rung, p.seed, p.compute, loss_a(p.compute)) for p in points]
    a = law.analyze(points, [("B", "A")], c0=C0, n_resamples=0)
    rows = {r["arm"]: r for r in report._laws(a)}
    assert rows["A"]["E"].endswith("(at its bound 0)") and "bound" not in rows["B"]["E"]
    assert "| 0.000" in markdown_table(list(rows.values()))
    note = report._bound_note(a)
    assert note.count("E sits at its bound 0") == 1 and note.lstrip().startswith("A:")
    assert report._bound_note(law.analyze([p for p in points if p.arm == "B"] + [
        law.Point("C", p.rung, p.seed, p.compute, p.loss + 0.01) for p in points if p.arm == "B"],
        [("C", "B")], c0=C0, n_resamples=0)) == ""


def depth_shaped(seeds: int = 4, slope_b: float = -0.05) -> list[law.Point]:
    """A depth ladder on a fixed token budget: loss *rises* with compute for both arms (deeper, undertrained),
    and B - A moves by ``slope_b`` nats per doubling of compute, exactly (seed offsets shared by both arms)."""
    rng = np.random.default_rng(7)
    points = []
    for s in range(seeds):
        offset = rng.normal(0, 0.01)
        for i, c in enumerate(RUNGS[:4]):
            a = 3.8 + 0.15 * i + offset
            points += [law.Point("A", f"L{6 * 2 ** i}", s, c, a),
                       law.Point("B", f"L{6 * 2 ** i}", s, c, a + 0.2 + slope_b * math.log2(c / RUNGS[0]))]
    return points


def test_a_baseline_whose_loss_rises_with_compute_gives_no_multiplier_rather_than_an_infinite_one(tmp_path):
    # norm-depth: every arm's loss rose with depth at its fixed token budget, every law was flat (A = 0), and
    # the report read each multiplier as "∞x (unreachable)": an arm 0.3 nats *worse* than post "saved"
    # infinite compute
    from lmlab.experiments.ladder import report
    a = law.analyze(depth_shaped(), [("B", "A")], c0=C0, n_resamples=99)
    assert a.arms["A"].law.flat and a.arms["B"].law.flat
    rungs = a.pairs[0].rungs
    assert [r.status for r in rungs] == ["no law"] * 4 and all(math.isnan(r.flops.value) for r in rungs)
    assert all(r.flops.unreachable == 0 for r in rungs)  # nan is not "unreachable"
    assert a.pairs[0].trend.direction == "not measured"
    table = report._multipliers(a)
    assert all(row["FLOPs multiplier [95% CI]"] == "— (no law)" for row in table)
    assert "∞" not in str(table) and "no trend: A's law is flat" in report.trend_text(a)
    assert report._flat_note(a).lstrip().startswith("A, B: flat (A = 0)")
    assert all(row["A"].endswith("(flat)") for row in report._laws(a))
    # an unreachable multiplier off a law that does fall stays infinite (the earlier test), and is still counted
    path = report.plot_multipliers(a, tmp_path / "m.png")  # nothing finite to draw: says so, no empty legend
    assert (tmp_path / "m.png").read_bytes().startswith(PNG) and path


def test_the_difference_trend_reads_the_paired_differences_across_rungs_and_predicts_the_largest(tmp_path):
    """B - A = 0.2 - 0.05 log2(C/C0') exactly at every seed: the slope, its interval, the held-out rung's
    prediction (error 0) come back; a kink at the largest rung shows as the held-out error, with its sign."""
    from lmlab.experiments.ladder import report
    t = law.analyze(depth_shaped(), [("B", "A")], c0=C0, n_resamples=99).pairs[0].difference_trend
    assert t.rungs == 4 and t.slope.value == pytest.approx(-0.05) and t.direction == "falls"
    assert t.intercept + t.slope.value * math.log2(RUNGS[0]) == pytest.approx(0.2)  # the line at the first rung
    assert t.slope.lo == pytest.approx(-0.05) and t.slope.hi == pytest.approx(-0.05)  # noise-free differences
    assert t.heldout.rung == "L48" and t.heldout.error.value == pytest.approx(0.0, abs=1e-9)
    kinked = [dataclasses.replace(p, loss=p.loss + 0.3) if p.arm == "B" and p.rung == "L48" else p
              for p in depth_shaped()]
    a = law.analyze(kinked, [("B", "A")], c0=C0, n_resamples=99)
    k = a.pairs[0].difference_trend
    assert k.heldout.measured.value == pytest.approx(t.heldout.measured.value + 0.3)
    assert k.heldout.predicted.value == pytest.approx(t.heldout.predicted.value)  # fitted without L48
    assert k.heldout.error.value == pytest.approx(-0.3)
    assert k.slope.value > t.slope.value  # the line over all four rungs bends up with the kink
    rows = report._difference_trends(a)
    assert rows[0]["comparison"] == "B − A" and rows[0]["error"].startswith("-0.300")
    text = report.differences_text(a)
    assert "A description, not a registered claim" in text and "difference_vs_compute.png" in text
    assert report.plot_differences(a, tmp_path / "d.png") and (tmp_path / "d.png").read_bytes().startswith(PNG)
    # the synthetic ladder of the earlier tests: B's compute multiplier grows, yet B - A in nats *rises* toward
    # 0 as both near their floor E: the two trends answer different questions, and the report gives both
    grows = law.analyze(synthetic(1), [("B", "A")], c0=C0, n_resamples=49).pairs[0]
    assert grows.trend.direction == "grows" and grows.difference_trend.direction == "rises"
    assert grows.difference_trend.rungs == len(RUNGS) and all(r.difference.hi < 0 for r in grows.rungs)
    # two arms without a rung in common have no difference trend, and the report leaves it out
    apart = [p for p in synthetic(1, seeds=3) if p.arm == "A"] + [
        law.Point("B", f"other{i}", p.seed, p.compute * 1.1, p.loss) for i, p in enumerate(synthetic(1, seeds=3))
        if p.arm == "B"]
    none = law.analyze(apart, [("B", "A")], c0=C0, n_resamples=0)
    assert none.pairs[0].difference_trend is None and "Across rungs" not in report.differences_text(none)


def test_a_ladders_report_states_what_its_spec_cut_and_why(tmp_path):
    """The issue's rule: each report says what was cut to fit the budget and why. The shipped specs say it in
    their header comment, so the report quotes that comment verbatim; a spec without one adds nothing."""
    from lmlab.experiments.ladder import report
    from lmlab.experiments.ladder.spec import load_ladder
    depth = report.spec_header_text(load_ladder(resolve_spec("norm-depth")))
    assert depth.startswith("## Size, and what was cut (the spec's header)")
    assert "> Claim 1 across depth: pre-norm keeps the residual path clean" in depth
    assert "Xavier" in depth and "pilot" in depth  # the dropped arm and the reason
    assert "\n>\n" in depth  # a bare '#' line keeps its paragraph break
    moe_spec = report.spec_header_text(load_ladder(resolve_spec("moe-compute")))
    assert "the + shared arm" in moe_spec and "seeds beyond 4" in moe_spec
    bare = tmp_path / "bare.yaml"
    bare.write_text(yaml.safe_dump(TINY_LADDER))
    assert report.spec_header_text(load_ladder(bare)) == ""


# ============================================================== the spec
TINY_LADDER = {
    "name": "tiny",
    "base": {"model": {"vocab_size": 256, "d_model": 16, "n_heads": 2, "n_layers": 1, "max_seq_len": 16},
             "data": {"source": "builtin", "tokenizer": "byte"}, "train": {"batch_size": 4, "device": "cpu"}},
    "seeds": 2,
    "arms": [{"name": "dense"}, {"name": "moe", "overrides": {"model.moe": {"n_experts": 4, "top_k": 1}}}],
    "rungs": [{"name": "d16", "overrides": {"model.d_model": 16}}, {"name": "d32", "overrides": {"model.d_model": 32}},
              {"name": "d48", "overrides": {"model.d_model": 48}, "budget": {"flops": 5e10}}],
    "budget": {"tokens_per_param": 2, "evals": 2, "warmup": 0.1},
}


def ladder(**changes):
    return parse_ladder({**TINY_LADDER, **changes}, "tiny.yaml")


def test_a_rung_budget_sets_the_steps_and_the_sweep_is_arms_by_rungs():
    lad = ladder()
    assert [v.name for v in lad.sweep.variants] == [f"{a}-{r}" for a in ("dense", "moe") for r in ("d16", "d32", "d48")]
    assert lad.sweep.variant("moe-d32").labels == {"arm": "moe", "rung": "d32"} and lad.compare == [("moe", "dense")]
    for name, b in lad.budgets.items():
        cfg = lad.sweep.configs[name]
        assert cfg.train.steps == b["steps"] == max(1, round(b["tokens"] / 64))  # 4 sequences of 16 tokens a step
        assert cfg.eval.every == max(1, b["steps"] // 2) and cfg.optim.warmup_steps == round(0.1 * b["steps"])
    d16 = lad.budgets["dense-d16"]
    assert d16["steps"] == round(2 * d16["active"] / 64)  # tokens per active parameter
    d48 = lad.budgets["moe-d48"]  # the rung's own kind replaces the ladder's: a FLOPs budget
    assert d48["rule"] == "flops=5e+10" and d48["flops"] == pytest.approx(5e10, rel=0.02)
    assert lad.sweep.tune is None


def test_rates_transfer_tunes_each_arm_at_the_smallest_rung_and_grid_at_every_rung():
    t = ladder(rates={"mode": "transfer", "values": [1e-3, 3e-3]}).sweep.tune
    assert (t.field, t.by, t.at, t.seeds, t.full_length) == ("optim.lr", ["arm"], {"rung": "d16"}, [1000, 1001], True)
    g = ladder(rates={"mode": "grid", "values": [1e-3, 3e-3], "seeds": [7, 8]}).sweep.tune
    assert (g.by, g.at, g.seeds) == (["arm", "rung"], {}, [7, 8])


@pytest.mark.parametrize("change, message", [
    ({"budget": {"tokens_per_param": 2, "flops": 1e9}}, "exactly one of"),
    ({"budget": {"tokens_per_param": 2, "params": "some"}}, "params='some'"),
    ({"rungs": [{"name": "big", "overrides": {"model.d_model": 48}}, {"name": "small"}]}, "smallest first"),
    ({"rungs": [{"name": "a-b"}]}, "without '-'"),
    ({"rates": {"mode": "both", "values": [1e-3, 3e-3]}}, "rates.mode='both'"),
    ({"compare": [{"arm": "moe", "baseline": "moe"}]}, "two different arms"),
    ({"rungs": [{"name": "d16", "overides": {}}]}, "unknown key 'overides'"),
    ({"arms": [{"name": "dense", "overrides": {"model.d_modle": 3}}]}, "d_modle"),
])
def test_a_bad_ladder_is_refused_naming_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        ladder(**change)


def test_transfer_under_mup_needs_the_smallest_rungs_base_shape():
    """Checked only where the model has μP's fields (another module adds them); skipped otherwise."""
    from lmlab.config import ModelConfig

    if "parametrization" not in ModelConfig.__dataclass_fields__:
        pytest.skip("model.parametrization is not in this checkout yet")
    mup = {**TINY_LADDER["base"], "model": {**TINY_LADDER["base"]["model"], "parametrization": "mup"}}
    with pytest.raises(ValueError, match="base shape"):
        ladder(base=mup, rates={"mode": "transfer", "values": [1e-3, 3e-3]})
    mup["model"]["mup"] = {"base_d_model": 16, "base_head_dim": 8}
    ladder(base=mup, rates={"mode": "transfer", "values": [1e-3, 3e-3]})


def test_the_shipped_example_validates_at_every_profile_and_is_no_experiment():
    for profile in (None, "quick", "gpu"):
        lad = parse_ladder(yaml.safe_load(resolve_spec("example").read_text()), "example", profile=profile)
        assert len(lad.rungs) == 4 and lad.rates["mode"] == "transfer"
    assert "ladder-example" not in cli.experiment_names()


def test_every_shipped_ladder_validates_at_every_profile_with_its_claims():
    """The registered ladders parse at each profile, and their claims name cells of every profile (the quick and
    gpu profiles keep the main rungs' names), each claim comparing two cells of one rung."""
    from lmlab.experiments.ladder import shipped_ladders

    assert {"example", "norm-depth"} <= set(shipped_ladders())
    for name in shipped_ladders():
        data = yaml.safe_load(resolve_spec(name).read_text())
        for profile in (None, *(data.get("profiles") or {})):
            lad = parse_ladder(data, name, profile=profile)
            for claim in lad.sweep.claims:
                cells = [(arm["arm"], arm["rung"]) for arm in claim.compare]
                assert all(a in lad.arms and r in lad.rungs for a, r in cells), (name, claim.id)
    depth = parse_ladder(yaml.safe_load(resolve_spec("norm-depth").read_text()), "norm-depth")
    assert depth.sweep.registration["id"] == "norm-depth-2026-12-06" and depth.rungs == ["L6", "L12", "L24", "L48"]
    assert not set(depth.sweep.seeds) & set(range(10))  # new seeds: none of a committed run's
    assert {c.model.n_layers for c in depth.sweep.configs.values()} == {6, 12, 24, 48}


# ============================================================== moe's multiplier over every seed
def test_moe_all_seeds_multiplier_reads_dense_law_at_the_moe_loss_with_every_seed(tmp_path):
    """Dense's curves follow a known law; m=4 + shared's final loss is dense's at 1.5x its tokens (seeds 0-3)
    and at 0.8x (seeds 4-5, which the registered reading would leave out): every seed enters the mean."""
    fpt = 2e6
    e, a_, alpha = 1.0, 3.0, 0.2

    def dense_loss(t):
        return e + a_ * (t / 1e6) ** -alpha

    rows = []
    for s in range(6):
        for arm, steps in (("dense", [1, 2, 3, 4, 5]), ("dense-2x", [2, 4, 6, 8, 10])):
            d = tmp_path / "runs" / arm / f"seed{s}"
            d.mkdir(parents=True)
            d.joinpath("curve.jsonl").write_text("".join(
                json.dumps({"step": k, "tokens": k * 1e6, "wall_s": k * 10.0, "val_loss": dense_loss(k * 1e6)}) + "\n"
                for k in steps))
            end = steps[-1] * 1e6
            rows.append({"variant": arm, "seed": s, "tokens": end, "final_val_loss": dense_loss(end), "status": "ok",
                         "flops_per_token": fpt, "wall_s": steps[-1] * 10.0})
        ratio = 1.5 if s < 4 else 0.8
        rows.append({"variant": "fg-m4-shared", "seed": s, "tokens": 5e6, "final_val_loss": dense_loss(ratio * 5e6),
                     "status": "ok", "flops_per_token": fpt, "wall_s": 60.0})
    registered = moe.multiplier(rows, math.log(2048))
    assert registered["status"].count("before_first") == 2  # the registered reading drops seeds 4 and 5
    m = moe.all_seeds_multiplier(tmp_path, rows, math.log(2048), registered, n_resamples=99)
    mean_loss = (4 * dense_loss(7.5e6) + 2 * dense_loss(4e6)) / 6
    want = (a_ / (mean_loss - e)) ** (1 / alpha) * 1e6 / 5e6
    assert m["seeds"] == list(range(6)) and m["tokens"]["value"] == pytest.approx(want, rel=1e-3)
    assert m["tokens"]["lo"] <= want <= m["tokens"]["hi"] and m["status"] == "interpolated"
    assert [round(m["per_seed"][s], 3) for s in range(6)] == [1.5] * 4 + [0.8] * 2
    assert m["wall"]["value"] == pytest.approx(want * 5e6 * 10 / 1e6 / 60.0, rel=1e-3)  # dense's 10 s per 1M tokens
    text = moe.all_seeds_text(m, registered)
    assert "left out seeds [4, 5]" in text and f"{m['tokens']['value']:.2f}x" in text and "0.80x*" in text


def test_the_moe_report_states_the_all_seeds_multiplier_the_committed_records_give(tmp_path):
    """results/moe/report.md's added figure is what the code computes from the committed run records."""
    (tmp_path / "runs").symlink_to(ROOT / "results" / "moe" / "run-records")
    rows = read_csv(ROOT / "results" / "moe" / "results.csv")
    registered = moe.multiplier(rows, math.log(2048))
    m = moe.all_seeds_multiplier(tmp_path, rows, math.log(2048), registered)
    assert len(m["seeds"]) == 10 and m["status"] == "interpolated"
    t = m["tokens"]
    report = (ROOT / "results" / "moe" / "report.md").read_text()
    assert f"{t['value']:.2f}x [{t['lo']:.2f}, {t['hi']:.2f}] the tokens" in report
    assert "1.39x [1.18, 1.63] (n=7 seeds; 3 below dense's first point)" in report  # the registered one stays


def test_the_rung_table_counts_a_diverged_run_as_the_laws_do_and_says_which_runs_did_not_learn():
    from lmlab.experiments.ladder import report
    from lmlab.experiments.report import markdown_table
    lad = ladder()

    def row(arm, seed, loss, status="ok"):
        return {"variant": f"{arm}-d16", "arm": arm, "rung": "d16", "seed": seed, "flops_per_token": 1e5,
                "tokens": 1000, "final_val_loss": loss, "status": status, "wall_s": 2.0}
    rows = [row("dense", 0, 4.0), row("dense", 1, math.nan, "diverged"),
            row("moe", 0, 5.2, "no better than unigram"), row("moe", 1, 4.2)]
    table = report._rung_table(lad, rows, report.ladder_points(rows, 5.5))
    cells = {(t["rung"], t["arm"]): t for t in table}
    assert cells["d16", "dense"]["final loss"] == "4.750"  # the diverged run at the untrained loss 5.5, not NaN
    assert cells["d16", "dense"]["not learned"] == "1 of 2 (1 diverged)"
    assert cells["d16", "moe"]["final loss"] == "4.700" and cells["d16", "moe"]["not learned"] == "1 of 2"
    assert cells["d32", "moe"]["final loss"] == cells["d32", "moe"]["not learned"] == "—"  # no runs yet
    assert "| not learned |" in markdown_table(table)


# ============================================================== the command
def test_quick_ladder_runs_end_to_end_and_resumes(tmp_path, capsys):
    out = tmp_path / "ladder"
    t0 = time.perf_counter()
    assert cli.main(["ladder", "example", "--out", str(out), "--quick", "--threads", "1"]) == 0
    took = time.perf_counter() - t0
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    cells = {(a, r) for a in ("dense", "moe") for r in ("d8", "d16", "d24", "d32")}
    assert {(r["arm"], r["rung"]) for r in rows} == cells
    assert {r["seed"] for r in rows} == {"0", "1"} and all(float(r["final_val_loss"]) > 0 for r in rows)
    assert all(float(r["cpu_s"]) > 0 for r in rows)  # each run's process CPU time, beside its wall time
    assert json.loads((out / "tune.json").read_text())["chosen"].keys() == {"dense", "moe"}  # transfer: by arm
    for plot in ("loss_vs_compute.png", "difference_vs_compute.png", "multiplier_vs_compute.png"):
        assert (out / plot).read_bytes()[:8] == PNG
    text = (out / "report.md").read_text()
    assert text.startswith("# Ladder ladder-example") and "quick size" in text
    assert "## Changes after registration" in text
    assert text.index("## Per rung") < text.index("## Laws") < text.index("## Compute multiplier")
    # the spec's header, verbatim: how it was sized and what was cut (the example says it is not registered)
    assert text.index("## Size, and what was cut") < text.index("## Method")
    assert "> An example ladder (`lmlab ladder example --out DIR`): dense against a fine-grained MoE" in text
    assert "moe over dense: the FLOPs multiplier **" in text
    data = json.loads((out / "ladder.json").read_text())
    assert set(data["analysis"]["arms"]) == {"dense", "moe"} and len(data["analysis"]["pairs"][0]["rungs"]) == 4
    # the multipliers read on CPU time too: its own laws, a column beside wall clock
    assert len(data["analysis_cpu_time"]["pairs"][0]["rungs"]) == 4
    assert "| CPU-time multiplier [95% CI] |" in text and "the CPU-time multiplier the same laws fitted" in text
    assert data["registration"]["id"] is None
    capsys.readouterr()
    assert cli.main(["ladder", "example", "--out", str(out), "--quick", "--threads", "1"]) == 0  # resumes: reuses all
    assert "done earlier" in capsys.readouterr().out
    print(f"quick ladder: {took:.1f} s")
    # a main run of the unregistered example is refused before anything is written
    assert cli.main(["ladder", "example", "--out", str(tmp_path / "main")]) == 2
    assert not (tmp_path / "main").exists()


def test_registered_claims_are_decided_per_rung(tmp_path):
    """A ladder's claims: compare cells {arm:, rung:} paired by seed, as an experiment's do: criteria before the
    numbers, verdicts after, verdict.json beside the report (what the README's claims table reads)."""
    spec = yaml.safe_load(resolve_spec("example").read_text())
    quick = spec["profiles"]["quick"]
    for rung, main in zip(quick["rungs"], spec["rungs"]):  # the quick rungs keep the main rungs' names
        rung["name"] = main["name"]
    spec["claims"] = [{
        "id": "moe-at-d128", "claim": "the MoE arm ends below dense at the largest rung",
        "compare": [{"arm": "moe", "rung": "d128"}, {"arm": "dense", "rung": "d128"}],
        "endpoint": "final_val_loss", "claimed": "lower", "margin": 0.02, "margin_source": "a test",
        "effect": 0.05, "pilot_sd": 0.05, "pilot_source": "a test"}]
    path = tmp_path / "ladder-claims.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    from lmlab.experiments.ladder import run_ladder

    text = run_ladder(path, out, quick=True, threads=1, log=lambda *a, **k: None).read_text()
    assert text.index("## Criteria") < text.index("## Method") < text.index("## Verdicts")
    verdict = json.loads((out / "verdict.json").read_text())
    (claim,) = verdict["claims"]
    assert claim["id"] == "moe-at-d128" and claim["verdict"] in ("reproduced", "opposite", "tie", "inconclusive")
    rows = {(r["arm"], r["rung"], r["seed"]): float(r["final_val_loss"]) for r in read_csv(out / "results.csv")}
    diffs = [rows["moe", "d128", s] - rows["dense", "d128", s] for s in (0, 1)]
    # the paired difference by seed (results.csv keeps 6 significant digits)
    assert claim["difference"] == pytest.approx(sum(diffs) / 2, abs=2e-5)
    bad = dict(spec, claims=[dict(spec["claims"][0], compare=[{"arm": "moe", "rung": "d999"}])])
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ValueError, match="d999"):
        run_ladder(path, tmp_path / "bad", quick=True, log=lambda *a, **k: None)
    assert not (tmp_path / "bad").exists()
