"""The positions experiment with a planted-lookup arm (positions-retrieval.yaml, registered as
positions-retrieval-2026-12-06): what its hooks measure, the lookup endpoints and gates in the analysis, the
report's lookup table, and the exploratory reading of the extension effect at single fine-tune snapshots beside
the registered verdicts. The registered positions experiment (positions.yaml) must decide as before:
test_verdicts_recomputed and test_experiments."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lmlab.experiments import load_experiment_spec, positions, retrieval, run_experiment
from lmlab.experiments.decide import decide_claims
from lmlab.experiments.stats import Interval

RERUN = Path(retrieval.__file__).with_name("positions-retrieval.yaml")
T95_2 = 4.302652729911275  # Student's t, 97.5% quantile, 2 degrees of freedom (3 seeds)
LOOKUPS = ("rope-lookup", "rope-lookup-ft-none", "rope-lookup-ft-pi", "rope-lookup-ft-yarn")


@pytest.fixture(scope="module")
def rerun():
    return load_experiment_spec("positions", spec_file=RERUN)


# ============================================================== what the hooks measure
def test_the_hooks_probe_every_lookup_run_with_rope_lookups_config_and_length(rerun):
    hooks = positions.Hooks(rerun)
    assert hooks.lookup_runs == list(LOOKUPS)
    assert hooks.lookup == rerun.configs["rope-lookup"].train.lookup and hooks.lookup_L == 128  # not rope's 64
    assert hooks.lookup.max_distance is None  # the fine-tunes' max_distance bounds their training, not the probes
    assert hooks.lookup_end == {1: 400, 2: 400, 4: 400, 8: 400}  # COPY_N at a run's end
    assert hooks.lookup_snapshot == hooks.copy_snapshot == {1: 400, 8: 100}  # as the copy probes at the snapshots
    quick = positions.Hooks(load_experiment_spec("positions", spec_file=RERUN, quick=True))
    assert set(quick.lookup_end.values()) == set(quick.lookup_snapshot.values()) == {positions.COPY_N_QUICK}
    assert quick.lookup_L == 32
    registered = positions.Hooks(load_experiment_spec("positions"))  # positions.yaml: nothing plants lookups
    assert registered.lookup_runs == [] and registered.lookup is None


def test_lookup_metrics_take_a_count_of_probes_per_multiple():
    seen = []

    class Recorder(torch.nn.Module):
        config = SimpleNamespace(vocab_size=64)

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x):  # (B, T) -> uniform logits
            seen.append(tuple(x.shape))
            return SimpleNamespace(logits=torch.zeros(*x.shape, 64))

    cfg = retrieval.LookupConfig(pairs=1, value_length=1, keys=4, values=4, offset=0)
    data = SimpleNamespace(tokens=np.random.default_rng(0).integers(20, 64, 5000), plantable_ids=torch.arange(1, 64))
    m = retrieval.lookup_metrics(Recorder(), data, cfg, 16, {1: 10, 8: 3})
    windows = {}
    for b, t in seen:
        windows[t] = windows.get(t, 0) + b
    assert windows == {16: 20, 128: 6}  # 1x and 1x farthest: 10 each; 8x far and near: 3 each
    assert set(m) == {f"chance_{k}" for k in ("acc", "exact", "logp", "exact_copy")} | {
        f"lookup_{p}_{s}" for p in ("1x", "1x_far", "8x_far", "8x_near") for s in
        ("exact", "exact_se", "acc", "acc_se", "logp", "logp_se")}
    assert m["lookup_8x_far_logp"] == pytest.approx(-math.log(64))  # uniform over the vocabulary
    assert retrieval.near_distance(cfg, 16) == 8 and retrieval.near_distance(cfg, 3) == 1  # L/2, within what fits


# ============================================================== the endpoints, on hand-made rows
def ft_rows(arm: str, snaps: dict[str, list[tuple[float, float]]], seeds=(40, 41, 42)) -> list[dict]:
    """A fine-tune's rows: per seed, at each snapshot step, (beyond_8x, in_8x)."""
    return [{"variant": arm, "seed": s, "snapshots": {step: {"beyond_8x": v[i][0], "in_8x": v[i][1]}
                                                      for step, v in snaps.items()}} for i, s in enumerate(seeds)]


# effect = (yarn - none) beyond range - (yarn - none) in range, per seed:
#   step 12:  (4.00 - 4.10) - (3.90 - 3.92, 3.91 - 3.92, 3.92 - 3.92) = -0.08, -0.09, -0.10
#   step 400: (3.80 - 3.81, 3.80 - 3.82, 3.80 - 3.83) - 0 = -0.01, -0.02, -0.03
YARN = ft_rows("rope-ft-yarn", {"12": [(4.00, 3.90), (4.00, 3.91), (4.00, 3.92)], "400": [(3.80, 3.75)] * 3})
NONE = ft_rows("rope-ft-none", {"12": [(4.10, 3.92)] * 3, "400": [(3.81, 3.75), (3.82, 3.75), (3.83, 3.75)]})


def test_the_extension_effect_at_one_snapshot_is_computed_per_seed():
    rows = YARN + NONE
    at12 = positions.snapshot_effects(rows, "rope-ft-yarn", "rope-ft-none", "12")
    assert list(at12) == [40, 41, 42] and list(at12.values()) == pytest.approx([-0.08, -0.09, -0.10])
    last = positions.snapshot_effects(rows, "rope-ft-yarn", "rope-ft-none", None)  # each run's last snapshot
    assert list(last.values()) == pytest.approx([-0.01, -0.02, -0.03])
    assert positions.snapshot_effects(rows, "rope-ft-yarn", "rope-ft-none", "25") == {}  # not measured there
    assert positions.snapshot_effects(rows[:2] + NONE, "rope-ft-yarn", "rope-ft-none", "12").keys() == {40, 41}
    # the registered endpoint (extension_gap, the mean over every point) is the mean of the single-point effects
    gap = positions.ENDPOINTS["extension_gap"]
    a, b = gap(YARN, 0.0), gap(NONE, 0.0)
    assert [a[s] - b[s] for s in (40, 41, 42)] == pytest.approx([(-0.08 - 0.01) / 2, (-0.09 - 0.02) / 2, -0.065])


def test_where_an_interval_lies_against_the_margin():
    iv = lambda lo, hi: Interval((lo + hi) / 2, lo, hi, 3, 0.01)  # noqa: E731
    assert positions.margin_reading(iv(-0.01, 0.015), 0.02) == "inside ±0.02"
    assert positions.margin_reading(iv(-0.115, -0.065), 0.02) == "below −0.02"
    assert positions.margin_reading(iv(0.03, 0.05), 0.02) == "above +0.02"
    assert positions.margin_reading(iv(-0.045, 0.005), 0.02) == "across ±0.02"
    assert positions.margin_reading(Interval(-0.01, -math.inf, math.inf, 1, math.nan), 0.02) == "no interval"


def test_the_exploratory_rows_give_each_snapshot_its_paired_interval_and_margin_reading(rerun):
    decisions = [SimpleNamespace(spec=c) for c in rerun.claims]
    table = positions.exploratory_extension(decisions, YARN + NONE)
    assert [(r["claim"], r["step"]) for r in table] == [
        ("ft-extension-yarn", "12"), ("ft-extension-yarn", "400 (last)"), ("ft-extension-pi", "12"),
        ("ft-extension-pi", "400 (last)")]
    half = T95_2 * 0.01 / math.sqrt(3)  # sd 0.01 over 3 seeds: 0.02484
    assert table[0]["per seed"] == "-0.080, -0.090, -0.100" and table[0]["seeds"] == 3
    assert table[0]["effect [95% CI]"] == f"-0.090 [{-0.09 - half:+.3f}, {-0.09 + half:+.3f}]" == (
        "-0.090 [-0.115, -0.065]")
    assert table[0]["95% CI against the margin"] == "below −0.02"
    assert table[1]["effect [95% CI]"] == "-0.020 [-0.045, +0.005]" and table[1]["95% CI against the margin"] == (
        "across ±0.02")
    assert table[2]["seeds"] == 0 and table[2]["effect [95% CI]"] == "—"  # no rope-ft-pi rows


def test_the_lookup_endpoints_read_a_fine_tunes_last_snapshot_and_a_base_runs_own_row():
    rows = [{"variant": "rope-lookup-ft-yarn", "seed": 40, "lookup_8x_far_logp": -9.0,
             "snapshots": {"12": {"lookup_8x_far_logp": -2.5}, "400": {"lookup_8x_far_logp": -1.25}}},
            {"variant": "rope-lookup-ft-yarn", "seed": 41, "snapshots": {"400": {"lookup_8x_far_exact": 0.5}}},
            {"variant": "rope-lookup", "seed": 40, "lookup_8x_far_logp": -2.0, "lookup_8x_far_exact": 0.125}]
    logp, exact = positions.ENDPOINTS["lookup_8x_far_logp"], positions.ENDPOINTS["lookup_8x_far_exact"]
    assert logp(rows[:2], 0.0) == {40: -1.25}  # seed 41 measured no log-prob
    assert exact(rows[:2], 0.0) == {41: 0.5}
    assert logp(rows[2:], 0.0) == {40: -2.0} and exact(rows[2:], 0.0) == {40: 0.125}


def test_the_lookup_table_gives_mean_and_std_over_seeds_per_probe():
    rows = [{"variant": "rope-lookup", "seed": s, "lookup_1x_exact": e, "lookup_8x_far_exact": f,
             "lookup_8x_far_logp": lp, "zs_yarn_lookup_8x_far_exact": z, "zs_yarn_lookup_8x_far_logp": -3.0}
            for s, e, f, lp, z in ((40, 1.0, 0.04, -2.5, 0.05), (41, 0.98, 0.06, -2.7, 0.07))]
    rows.append({"variant": "rope-lookup-ft-yarn", "seed": 40, "lookup_1x_exact": 0.9, "lookup_8x_far_exact": 0.25,
                 "lookup_8x_far_logp": -1.0})
    table = {r["variant"]: r for r in positions.lookup_table(rows, ["rope-lookup", "rope-lookup-ft-yarn"])}
    assert list(table) == ["rope-lookup", "rope-lookup-ft-yarn", "rope-lookup, YaRN zero-shot ×8"]  # no PI measured
    base = table["rope-lookup"]
    assert base["1× in range"] == "0.99 ± 0.01" and base["8× far"] == "0.05 ± 0.01"  # std sqrt(0.0002) = 0.014
    assert base["8× far logp"] == "-2.60 ± 0.14" and base["2× far"] == "—"
    assert table["rope-lookup-ft-yarn"]["8× far"] == "0.25"  # one seed: no spread
    zs = table["rope-lookup, YaRN zero-shot ×8"]
    assert zs["8× far"] == "0.06 ± 0.01" and zs["8× far logp"] == "-3.00 ± 0.00" and zs["1× in range"] == "—"


# ============================================================== the gates
def rerun_rows(spec, exact: dict[str, float] | None = None, gain: float = 0.0) -> list[dict]:
    """Every variant of the rerun on 4 seeds: losses flat at 3.0 plus seed noise, every lookup arm retrieving
    in range (lookup_1x_exact 1.0 unless ``exact`` says otherwise), rope-lookup-ft-yarn's 8x far log-prob
    ``gain`` above the others'."""
    exact, rows = exact or {}, []
    for v in spec.variants:
        for i, s in enumerate(spec.seeds):
            noise, j = (0.0, 0.02, -0.02, 0.01)[i], (0.001, -0.002, 0.002, 0.0)[i]
            r = {"variant": v.name, "seed": s, "final_val_loss": 3.0 + noise, "status": "ok", "wall_s": 1.0}
            if v.name in LOOKUPS:
                lp = -2.0 + noise + (gain + j if v.name == "rope-lookup-ft-yarn" else 0.0)
                r.update({"lookup_1x_exact": exact.get(v.name, 1.0), "lookup_8x_far_exact": 0.1,
                          "lookup_8x_far_logp": lp, "lookup_8x_near_exact": 0.9})
                if v.name == "rope-lookup":
                    r.update({"zs_yarn_lookup_8x_far_exact": 0.08, "zs_pi_lookup_8x_far_exact": 0.07})
            else:
                r.update({"loss_1x": 3.0 + noise, **{f"{p}_{m}x": 3.0 + noise for m in positions.LONG
                                                      for p in ("in", "beyond")}})
                if v.name == "rope":
                    r.update({f"zs_yarn_beyond_{m}x": 3.0 + noise for m in positions.LONG})
            if v.init_from:
                keep = {k: val for k, val in r.items() if k.startswith(("in_", "beyond_", "lookup_"))}
                r["snapshots"] = {step: dict(keep) for step in ("12", "25", "50", "100", "150", "200", "300", "400")}
                if v.name == "rope-ft-yarn":  # beyond range better by 0.03 + j at every point: an extension effect
                    for point in r["snapshots"].values():
                        point["beyond_8x"] -= 0.03 + j
            rows.append(r)
    return rows


def decided(spec, rows) -> dict:
    return {d.spec.id: d for d in decide_claims(spec.claims, rows, [], positions.ENDPOINTS, init_loss=math.log(2048),
                                                untestable=positions.gates(spec, rows),
                                                amended=positions.lost_copying(spec, rows))}


def test_a_base_model_that_does_not_retrieve_leaves_the_retrieval_claims_untestable(rerun):
    rows = rerun_rows(rerun, gain=0.3)
    ok = decided(rerun, rows)
    assert ok["retrieval-yarn"].verdict == "reproduced" and not ok["retrieval-yarn"].untestable  # it retrieves
    assert ok["retrieval-yarn"].diffs == pytest.approx([0.301, 0.298, 0.302, 0.3])
    failed = decided(rerun, rerun_rows(rerun, {"rope-lookup": 0.3}, gain=0.3))
    for cid in ("retrieval-yarn", "retrieval-pi"):
        assert failed[cid].verdict == "inconclusive" and failed[cid].untestable == (
            "untestable: rope-lookup's in-range exact match is 0.300, below the gate 0.9: it does not retrieve within "
            "its training length")
        assert not failed[cid].amended  # registered before the runs, not an amendment
    assert failed["ft-extension-yarn"].verdict == ok["ft-extension-yarn"].verdict == "reproduced"  # the others stand
    assert positions.copy_gates(rerun, rows) == {} and positions.lost_copying(rerun, rows) == {}  # no copy claim here


def test_the_registered_experiment_is_gated_as_before():
    spec = load_experiment_spec("positions")  # positions.yaml: retrieval-yarn is a copy claim
    rows = [{"variant": "rope-copy", "seed": s, "copy_1x_acc": 0.3} for s in spec.seeds]
    assert positions.gates(spec, rows) == positions.copy_gates(spec, rows) == {
        "retrieval-yarn": "untestable: rope-copy's in-range copy accuracy is 0.300, below the gate 0.5: the model does "
                          "not copy within its training length"}
    assert retrieval.lookup_gates(spec, rows) == {}


# ============================================================== the report
def test_the_rerun_report_shows_the_lookups_and_the_exploratory_reading(rerun, tmp_path):
    rows = rerun_rows(rerun, {"rope-lookup": 0.3})
    report = positions.analyze(rerun, tmp_path, rows, command="lmlab experiment positions --draft", wall_s=1.0)
    text = report.read_text()
    lookup = text.split("### Retrieval: the planted lookup")[1].split("## Verdicts")[0]
    assert "| variant | 1× in range | 1× farthest | 2× far | 2× near | 4× far | 4× near | 8× far | 8× near |" in lookup
    assert "| rope-lookup | 0.30 ± 0.00 |" in lookup and "| rope-lookup, YaRN zero-shot ×8 |" in lookup
    assert "| rope-lookup-ft-yarn | 400 | 1.00 ± 0.00 | 0.10 ± 0.00 | 0.90 ± 0.00 |" in lookup  # its snapshots
    assert "L = 128" in lookup and "400 probes per distance" in lookup
    verdicts = text.split("## Verdicts")[1]
    exploratory = verdicts.split("### Exploratory: the extension effect at single fine-tune snapshots")[1]
    assert "Exploratory, not tested, outside the Holm family" in exploratory
    assert "ft-extension-yarn, registered (extension_gap, the mean over every measured point): **REPRODUCED**" in (
        exploratory)
    assert "| ft-extension-yarn | 400 (last) | 4 | -0.031, -0.028, -0.032, -0.030 | -0.030 [" in exploratory
    assert "below −0.02" in exploratory
    assert "untestable: rope-lookup's in-range exact match is 0.300" in verdicts.split("### Exploratory")[0]
    assert "no in-range retrieval for an extension to carry further" in text
    claims = [c.split("**")[1] for c in verdicts.splitlines() if c.startswith("- **")]
    assert claims == [c.id for c in rerun.claims]  # the exploratory section adds no verdict line
    record = json.loads((tmp_path / "verdict.json").read_text())
    assert [c["id"] for c in record["claims"]] == claims  # nor a claim


def test_the_registered_experiments_report_gets_the_exploratory_reading_and_no_lookup_table(tmp_path):
    spec = load_experiment_spec("positions")
    rows = rerun_rows(spec)
    text = positions.analyze(spec, tmp_path, rows, command="lmlab experiment positions", wall_s=1.0).read_text()
    assert "### Retrieval: the planted lookup" not in text
    assert "| ft-extension-pi | 400 (last) | 3 | +0.000, +0.000, +0.000 | +0.000 [+0.000, +0.000] | inside ±0.02 |" in (
        text)


# ============================================================== end to end
@pytest.mark.slow
def test_the_rerun_runs_end_to_end_at_quick_size(tmp_path):
    out = tmp_path / "rerun"
    report = run_experiment("positions", out, quick=True, spec_file=RERUN, log=lambda *a, **k: None)
    text = report.read_text()
    table = text.split("### Retrieval: the planted lookup")[1].split("## Verdicts")[0]
    for arm in LOOKUPS:
        row = next(line for line in table.splitlines() if line.startswith(f"| {arm} |"))
        assert all(cell.strip()[0] in "0123456789-" and cell.strip() != "—" for cell in row.split("|")[2:-1]), row
    exploratory = text.split("### Exploratory: the extension effect at single fine-tune snapshots")[1]
    assert "Exploratory, not tested, outside the Holm family" in exploratory
    assert "| ft-extension-yarn | 4 (last) | 2 | " in exploratory and "inside ±0.02" in exploratory
    ft = json.loads((out / "runs/rope-lookup-ft-yarn/seed40/result.json").read_text())
    assert sorted(ft["snapshots"], key=int) == ["1", "2", "3", "4"]
    assert {"lookup_1x_exact", "lookup_8x_far_logp", "lookup_8x_near_exact"} <= set(ft["snapshots"]["1"])
    assert not any(k.startswith(("copy_", "loss_")) for k in ft)  # lookup runs take lookup probes only
    base = json.loads((out / "runs/rope-lookup/seed40/result.json").read_text())
    assert {f"lookup_{m}x_far_exact" for m in positions.LOOKUP_MULTIPLES[1:]} <= set(base)
    assert {"zs_pi_lookup_8x_far_logp", "zs_yarn_lookup_8x_near_exact"} <= set(base)
    rope = json.loads((out / "runs/rope-ft-yarn/seed40/result.json").read_text())
    assert "copy_8x_far_logp" in rope["snapshots"]["1"] and "lookup_1x_exact" not in rope  # text runs as before
    verdict = json.loads((out / "verdict.json").read_text())
    assert {c["id"]: c["untestable"].split(":")[0] for c in verdict["claims"] if c["id"].startswith("retrieval")} == {
        "retrieval-yarn": "untestable", "retrieval-pi": "untestable"}  # 4 steps: nothing retrieves
