"""The shipped experiments: the registered positions claims on made-up rows (a clear win, a clear loss
and a tie for every claim; the norm and moe claims are in test_decide.py), the --quick
runs (the machinery, not the claims), the GPU profile's sizes, and the README's results table against
the verdict files."""

from __future__ import annotations

import csv
import dataclasses
import json
import re
from pathlib import Path

import pytest

from lmlab.experiments import (
    EXPERIMENTS,
    claims,
    load_experiment_spec,
    positions,
    readme_table,
    run_experiment,
)
from lmlab.experiments.spec import model_accounting
from lmlab.experiments.sweep.tables import COLUMNS

PNG = b"\x89PNG\r\n\x1a\n"
SEEDS = (0, 1, 2)
SHARED = (0.0, 0.02, -0.02)  # per-seed noise every arm shares (same seed, same data order): std 0.02
JITTER = (0.001, -0.002, 0.0015)  # a little noise of the arm under test, so its differences have a spread
OFFSET = {"win": None, "loss": None, "tie": 0.0}  # filled per claim: the claimed direction decides win and loss


def expected_verdict(kind: str, claimed: str) -> str:
    """What a clear win, a clear loss and a tie of the arm under test must give."""
    if claimed == "not_higher":  # a non-inferiority claim: a tie means it holds
        return {"win": "reproduced", "loss": "opposite", "tie": "reproduced"}[kind]
    return {"win": "reproduced", "loss": "opposite", "tie": "tie"}[kind]


def offset(kind: str, claimed: str, size: float = 0.3) -> float:
    """How far the arm under test moves: toward the claim for a win, away for a loss."""
    toward = -size if claimed in ("lower", "not_higher") else size
    return {"win": toward, "loss": -toward, "tie": 0.0}[kind]


def verdicts(cs: list) -> dict[str, str]:
    return {c.id: c.verdict for c in cs}


# ============================================================== positions
FT_POINTS = ("12", "25", "50", "100", "150", "200", "300", "400")  # a fine-tune's measured points, its end last


def positions_rows(move: str | None = None, delta: float = 0.0) -> list[dict]:
    """Every scheme's and fine-tune's measurements, flat at 3.0 (+ shared seed noise) unless moved:
    ``zs8``/``zs16`` (YaRN zero-shot beyond range), ``beyond:ARM``, ``snapbeyond:ARM`` (beyond range at
    8x at every fine-tune point) or ``copy:ARM`` (the copy log-prob at the fine-tune's end)."""
    rows = []
    for name in ("none", "sinusoidal", "sinusoidal-scaled", "learned", "relative", "relative-clip16", "alibi", "rope",
                 "rope-scaled", "rope-ft-none", "rope-ft-pi", "rope-ft-yarn", "rope-copy", "rope-copy-ft-none",
                 "rope-copy-ft-pi", "rope-copy-ft-yarn"):
        for s in SEEDS:
            base = 3.0 + SHARED[s]
            j = delta + JITTER[s]
            r = {"variant": name, "seed": s, "final_val_loss": base, "status": "ok", "loss_1x": base,
                 "copy_1x_acc": 0.6, **{f"{p}_{m}x": base for m in positions.LONG for p in ("in", "beyond")},
                 **{f"copy_{m}x_far_logp": -3.0 + SHARED[s] for m in positions.LONG}}
            if name == "rope":
                r.update({f"zs_yarn_beyond_{m}x": base for m in positions.LONG})
                if move in ("zs8", "zs16"):
                    r[f"zs_yarn_beyond_{move[2:]}x"] = base + j
            if move == f"beyond:{name}":
                r["beyond_8x"] = base + j
            if "-ft-" in name:
                snap = {k: v for k, v in r.items() if k.startswith(("in_", "beyond_", "copy_"))}
                r["snapshots"] = {step: dict(snap) for step in FT_POINTS}
                if move == f"snapbeyond:{name}":
                    for point in r["snapshots"].values():
                        point["beyond_8x"] += j
                if move == f"copy:{name}":
                    r["snapshots"][FT_POINTS[-1]]["copy_8x_far_logp"] += j
            rows.append(r)
    return rows


POSITIONS_CLAIMS = {  # id -> (what moves, claimed)
    "zero-shot-yarn-8x": ("zs8", "lower"),
    "zero-shot-yarn-16x": ("zs16", "lower"),
    "ft-extension-yarn": ("snapbeyond:rope-ft-yarn", "lower"),
    "ft-extension-pi": ("snapbeyond:rope-ft-pi", "lower"),
    "retrieval-yarn": ("copy:rope-copy-ft-yarn", "higher"),
    "shaw-flat-from-clip": ("beyond:relative", "higher"),
}


def positions_decisions(rows: list[dict]) -> dict:
    """The registered positions claims decided on ``rows`` (the re-analysed ones read the same rows)."""
    import math

    from lmlab.experiments.decide import decide_claims

    spec = load_experiment_spec("positions")
    decided = decide_claims(spec.claims, rows, rows, positions.ENDPOINTS, init_loss=math.log(2048),
                            untestable=positions.copy_gates(spec, rows), amended=positions.lost_copying(spec, rows))
    return {d.spec.id: d for d in decided}


@pytest.mark.parametrize("kind", ["win", "loss", "tie"])
@pytest.mark.parametrize("claim_id", sorted(POSITIONS_CLAIMS))
def test_positions_verdicts_on_made_up_rows(claim_id, kind):
    move, claimed = POSITIONS_CLAIMS[claim_id]
    decided = positions_decisions(positions_rows(move, offset(kind, claimed)))
    assert decided[claim_id].verdict == expected_verdict(kind, claimed)
    assert all(d.verdict == "tie" for i, d in decided.items() if i != claim_id)  # nothing else moved


def test_a_fine_tune_gain_everywhere_is_not_an_extension_effect():
    rows = positions_rows()
    for r in rows:
        if r["variant"] == "rope-ft-yarn":  # 0.3 better in range and beyond, at every point: a general gain
            for point in r["snapshots"].values():
                for k in ("in_8x", "beyond_8x"):
                    point[k] -= 0.3 + JITTER[r["seed"]]
    assert positions_decisions(rows)["ft-extension-yarn"].verdict == "tie"


def test_the_extension_effect_is_averaged_over_every_fine_tune_point_not_read_at_the_end():
    rows = positions_rows()
    for r in rows:
        if r["variant"] == "rope-ft-yarn":  # 0.4 better beyond range at the first point only, as YaRN was at 25 steps
            r["snapshots"][FT_POINTS[0]]["beyond_8x"] -= 0.4 + JITTER[r["seed"]]
    d = positions_decisions(rows)["ft-extension-yarn"]
    assert d.verdict == "reproduced" and d.diffs == pytest.approx([-(0.4 + j) / len(FT_POINTS) for j in JITTER])
    for r in rows:
        if r["variant"] == "rope-ft-yarn":
            del r["snapshots"][FT_POINTS[3]]["in_8x"]  # a point not measured: the average is not taken
    assert positions_decisions(rows)["ft-extension-yarn"].verdict == "inconclusive"


def test_retrieval_is_untestable_until_the_copy_model_passes_its_gate():
    rows = positions_rows("copy:rope-copy-ft-yarn", 0.3)  # a clear win for the YaRN fine-tune...
    assert positions_decisions(rows)["retrieval-yarn"].verdict == "reproduced"
    for r in rows:
        if r["variant"] == "rope-copy":
            r["copy_1x_acc"] = 0.45 + JITTER[r["seed"]]  # ...by a model that copies, but below the gate 0.5
    d = positions_decisions(rows)["retrieval-yarn"]
    assert d.verdict == "inconclusive" and "0.450, below the gate 0.5" in d.line()
    assert positions_decisions(rows)["shaw-flat-from-clip"].verdict == "tie"  # only retrieval


def test_retrieval_is_untestable_when_the_fine_tunes_it_compares_forgot_how_to_copy():
    # the amendment after the results (positions.yaml): rope-copy copies, its text-only fine-tunes do not
    rows = positions_rows("copy:rope-copy-ft-yarn", 0.3)  # a clear win for the YaRN fine-tune...
    before = positions_decisions(rows)
    for r in rows:
        if r["variant"] == "rope-copy-ft-none":
            r["copy_1x_acc"] = 0.012 + JITTER[r["seed"]] / 10  # ...over a fine-tune that copies at chance
    after = positions_decisions(rows)
    d = after["retrieval-yarn"]
    assert d.verdict == "inconclusive" and d.amended and d.registered_verdict == "reproduced"
    assert "rope-copy-ft-none's in-range copy accuracy is 0.012, below the gate 0.5" in d.line()
    assert "under the rules as registered: **REPRODUCED**" in d.line()
    assert d.to_json()["registered_verdict"] == "reproduced" and d.to_json()["amended"] is True
    # decided after the results, it stays in the Holm family: no other claim's adjusted p-value moves
    for cid, other in after.items():
        assert other.comparison.decision.p_adjusted == pytest.approx(before[cid].comparison.decision.p_adjusted)
    assert d.comparison.decision.p_adjusted == pytest.approx(before["retrieval-yarn"].comparison.decision.p_adjusted)
    for r in rows:
        if r["variant"] == "rope-copy-ft-none":
            r["copy_1x_acc"] = 0.5  # at the gate: tested as registered
    d = positions_decisions(rows)["retrieval-yarn"]
    assert d.verdict == "reproduced" and not d.amended and not d.untestable


def test_a_claim_untestable_by_its_registered_gate_leaves_the_holm_family_but_an_amended_one_does_not():
    from lmlab.experiments import stats as experiment_stats
    from lmlab.experiments.decide import decide_claims

    spec = load_experiment_spec("positions")
    rows = positions_rows("copy:rope-copy-ft-yarn", 0.3)
    args = (spec.claims, rows, rows, positions.ENDPOINTS)
    base = {d.spec.id: d for d in decide_claims(*args, init_loss=7.6)}
    gated = {d.spec.id: d for d in decide_claims(*args, init_loss=7.6, untestable={"retrieval-yarn": "untestable: x"})}
    late = {d.spec.id: d for d in decide_claims(*args, init_loss=7.6, amended={"retrieval-yarn": "untestable: y"})}
    alone = gated["retrieval-yarn"].comparison.decision  # out of the family: its own p, unadjusted
    assert alone.p_adjusted == pytest.approx(alone.p)
    p = {k: d.comparison.decision.p for k, d in base.items()}  # the family of six as registered, and of five without it
    holm6 = experiment_stats.holm(p)
    holm5 = experiment_stats.holm({k: v for k, v in p.items() if k != "retrieval-yarn"})
    for cid in p:
        assert late[cid].comparison.decision.p_adjusted == pytest.approx(holm6[cid])
        if cid != "retrieval-yarn":
            assert gated[cid].comparison.decision.p_adjusted == pytest.approx(holm5[cid])
    assert late["retrieval-yarn"].untestable == "untestable: y" and late["retrieval-yarn"].verdict == "inconclusive"


def test_positions_report_names_the_unscaled_sinusoidal_setup_only_when_it_lost():
    from types import SimpleNamespace

    from lmlab import ModelConfig

    cfg = SimpleNamespace(model=ModelConfig(vocab_size=2048, d_model=128, n_heads=4, max_seq_len=64), seq_len=64)
    rows = positions_rows()
    decided = list(positions_decisions(rows).values())
    assert "swamps" not in positions.paper_note(decided, cfg, rows)  # equal losses: nothing to explain
    for r in rows:
        if r["variant"] == "sinusoidal":
            r["final_val_loss"] += 0.8
    for r in rows:
        if r["variant"] == "rope-scaled":
            r["final_val_loss"] -= 0.1
    note = positions.paper_note(decided, cfg, rows)
    assert "0.80 nats worse" in note and "the two schemes differ by +0.100 nats" in note
    rows = [r for r in rows if r["variant"] != "sinusoidal-scaled"]  # the control arm missing: no claim made
    assert "swamps" not in positions.paper_note(decided, cfg, rows)


# ============================================================== the quick runs
EXPECTED = {
    "norm": {  # every arm at every rate of the grid; the grid may extend past an edge after these
        "rows": [f"{a}-{w}-{lr}" for a in ("post-normal", "post-xavier", "pre-normal", "deepnorm")
                 for w in ("w0", "w100") for lr in ("lr1e-3", "lr3e-3", "lr1e-2")],
        "columns": ["arch", "warmup", "lr", "grad_top_bottom", "update_at_10", "update_at_50"],
        "plots": ["grad_norm_init.png", "loss_curves.png", "loss_vs_rate.png", "update_size.png"],
    },
    "positions": {
        "rows": ["none", "sinusoidal", "sinusoidal-scaled", "learned", "relative", "relative-clip16", "alibi", "rope",
                 "rope-scaled", "rope-ft-none", "rope-ft-pi", "rope-ft-yarn", "rope-copy", "rope-copy-ft-none",
                 "rope-copy-ft-pi", "rope-copy-ft-yarn"],
        "columns": ["loss_1x", "loss_16x", "in_8x", "beyond_16x", "copy_1x_acc", "copy_1x_logp", "copy_8x_far_logp",
                    "copy_8x_far_logp_se", "copy_8x_near_acc"],
        "plots": ["loss_by_length.png", "per_position.png", "rope_extension_per_position.png", "finetune_steps.png"],
    },
    "mup": {  # every width at every rate of the grid, in both parametrizations; the grid may extend past an edge
        "rows": [f"{p}-{w}-{lr}" for p in ("standard", "mup") for w in ("w64", "w128", "w256", "w512")
                 for lr in ("lr5e-4", "lr1e-3", "lr2e-3", "lr4e-3", "lr8e-3", "lr1.6e-2", "lr3.2e-2")],
        "columns": ["param", "width", "lr"],
        "plots": ["loss_vs_rate.png", "optimum_vs_width.png"],
    },
    "moe": {
        "rows": ["dense", "fg-m4", "fg-m4-shared", "dense-2x", "dense-common", "fg-m4-shared-common"],
        "columns": ["max_load_val"],
        "plots": ["val_loss_vs_tokens.png", "val_loss_vs_wall_time.png", "expert_load_heatmaps.png"],
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_quick_experiment_makes_its_files(name, tmp_path):
    out = tmp_path / name
    report = run_experiment(
        name, out, quick=True, command=f"lmlab experiment {name} --quick --out {out}", log=lambda *a, **k: None
    )
    want = EXPECTED[name]
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    names = list(dict.fromkeys(r["variant"] for r in rows))
    assert names[: len(want["rows"])] == want["rows"]
    if name in ("norm", "mup"):  # levels added past an edge of the rate grid, for some arms
        added = {"norm": r"[a-z-]+-w(0|100)-lr[0-9.e-]+", "mup": r"(standard|mup)-w[0-9]+-lr[0-9.e-]+"}[name]
        assert all(re.fullmatch(added, n) for n in names[len(want["rows"]):])
    else:
        assert names == want["rows"]
    assert {r["seed"] for r in rows} == {"0", "1"}  # seed s = init seed s and data order s
    assert all(r["init_seed"] == r["data_seed"] == r["seed"] for r in rows)
    assert set(COLUMNS + want["columns"]) <= set(rows[0])
    assert all(int(r["steps"]) > 0 and float(r["final_val_loss"]) > 0 for r in rows)
    for plot in want["plots"]:
        assert (out / plot).read_bytes()[:8] == PNG, plot
        assert f"({plot})" in report.read_text(), plot
    text = report.read_text()
    assert text.startswith("# Claim") and f"Made by: `lmlab experiment {name} --quick --out {out}`" in text
    assert text.index("## Criteria") < text.index("## Results") < text.index("## Verdicts")  # criteria before numbers
    assert (
        "sha256:" in text
        and "64-byte windows occur verbatim in training" in text
        and "The runs started from lmlab revision" in text
    )
    data = json.loads((out / "verdict.json").read_text())
    assert (
        data["schema"] == 3  # the registered claims (decide.py)
        and data["experiment"] == name
        and data["data"]["corpus"]["content_hash"].startswith("sha256:")
    )
    assert all(c["verdict"] in ("reproduced", "opposite", "tie", "inconclusive", None) for c in data["claims"])
    assert [c["id"] for c in data["claims"]] == [
        c.split("**")[1] for c in text.split("## Verdicts")[1].splitlines() if c.startswith("- **")
    ]
    summary = (out / "summary.md").read_text()
    by = {(r["variant"], r["seed"]): r for r in rows}
    first = next(iter(by.values()))
    assert f"{float(first['final_val_loss']):.3f}"[:4] in summary  # summary and report read the same final loss
    if name == "norm":  # no tuning stage: every arm trains at every rate, the grid extended past an edge
        assert not (out / "tune.json").exists()
        extend = json.loads((out / "extend.json").read_text())
        assert extend["axis"] == "lr" and set(extend["groups"]) == {
            f"{a}-{w}" for a in ("post-normal", "post-xavier", "pre-normal", "deepnorm") for w in ("w0", "w100")}
    if name == "moe":  # the arms at the common rate and dense-2x take no tuning group of their own
        assert json.loads((out / "tune.json").read_text())["chosen"].keys() == {"dense", "fg-m4", "fg-m4-shared"}
        data = json.loads((out / "verdict.json").read_text())
        assert data["registration"]["id"] and "multiplier" in data
    if name == "mup":  # each seed's best rate per width, read from its curve, is kept beside the verdicts
        optima = json.loads((out / "verdict.json").read_text())["optima"]
        assert {(o["param"], o["d_model"]) for o in optima} == {(p, w) for p in ("standard", "mup")
                                                                for w in (16, 32, 48, 64)}
    if name == "positions":
        learned = next(r for r in rows if r["variant"] == "learned")
        assert learned["loss_2x"] == "n/a — learned table ends at 16" and float(learned["loss_1x"]) > 0
        ft = json.loads((out / "runs/rope-ft-yarn/seed0/result.json").read_text())
        assert sorted(ft["snapshots"], key=int) == ["1", "2", "3", "4"] and "copy_8x_far_logp" in ft["snapshots"]["1"]
    if name == "moe":
        by_arm = {r["variant"]: r for r in rows}
        dense = int(by_arm["dense"]["active_params"])
        assert all(abs(int(r["active_params"]) / dense - 1) < 0.05 for r in rows)
        assert int(by_arm["fg-m4-shared"]["total_params"]) > 3 * dense
        assert int(by_arm["dense-2x"]["tokens"]) == 2 * int(by_arm["dense"]["tokens"])


def test_experiment_specs_ship_with_the_package_and_validate_at_every_size():
    for name in EXPERIMENTS:
        for profile in (None, "quick", "gpu"):
            spec = load_experiment_spec(name, profile=profile)
            assert spec.configs and spec.is_quick == (profile == "quick")
    full = load_experiment_spec("moe")
    assert (
        full.configs["dense"].train.steps * full.configs["dense"].train.batch_size * full.configs["dense"].seq_len
        >= 10 * 512_000
    )
    seeds = {v.name: len(full.seeds_of(v)) for v in full.variants}
    assert seeds == {"dense": 10, "fg-m4": 10, "fg-m4-shared": 10, "dense-2x": 10, "dense-common": 5,
                     "fg-m4-shared-common": 5}  # 10 paired seeds for the arms the capacity and shared claims rest on
    norm = load_experiment_spec("norm")
    assert norm.seeds == [0, 1, 2, 3, 4] and {c.model.n_layers for c in norm.configs.values()} == {12}
    assert {c.train.steps for c in norm.configs.values()} == {600}
    assert {c.optim.warmup_steps for c in norm.configs.values()} == {0, 100}
    assert load_experiment_spec("positions").seeds == [0, 1, 2]
    assert (
        load_experiment_spec("positions").configs["relative"].model.relative_clip >= 64
    )  # clip >= the training length


def test_gpu_profile_sizes_models_of_10_to_100_million_parameters():
    """The mechanism is tested here at full size without training (the profile has not run on a GPU)."""
    # mup's gpu profile is a width ladder, d_model 256 to 2048 (8x): its narrowest model is the base shape
    bounds = {"mup": (5e6, 250e6)}
    for name in EXPERIMENTS:
        spec = load_experiment_spec(name, profile="gpu")
        sizes = [model_accounting(cfg.model, cfg.seq_len) for cfg in spec.configs.values()]  # cached by the spec check
        low, high = bounds.get(name, (10e6, 100e6))
        assert low <= min(n["active_params"] for n in sizes), name
        assert max(n["total_params"] for n in sizes) <= high, (name, sorted(n["total_params"] for n in sizes))
        assert spec.seeds == [0] and all(c.train.device == "auto" for c in spec.configs.values())


# ============================================================== the README's table
def test_claims_table_is_generated_from_verdict_files(tmp_path):
    results = tmp_path / "results"
    (results / "norm").mkdir(parents=True)
    from lmlab.experiments.stats import Interval

    c = claims.Claim(
        "norm",
        "warmup-post-xavier",
        "post-norm needs warmup",
        "criterion",
        Interval(0.2, 0.1, 0.3, 3, 0.04),
        0.05,
        "higher",
    )
    small = claims.Claim(
        "norm",
        "tiny",
        "a real but tiny effect",
        "criterion",
        Interval(-0.005, -0.008, -0.001, 3, 0.002),
        0.026,
        "lower",
    )
    stuck = claims.Claim(
        "norm",
        "stuck",
        "arms that never learned",
        "criterion",
        Interval(-0.001, -0.0012, -0.0008, 3, 0.0001),
        0.05,
        "lower",
        untestable="untestable: every run of both arms diverged or ended no better than unigram",
    )
    claims.write_verdicts(results / "norm", "norm", [c, small, stuck], {})
    (results / "old").mkdir()
    (results / "old" / "verdict.json").write_text(json.dumps({"gradients": False}))
    (results / "moe").mkdir()
    (results / "moe" / "verdict.json").write_text(json.dumps({"schema": 3, "experiment": "moe", "claims": [
        {"id": "capacity", "claim": "MoE adds capacity", "verdict": "reproduced", "difference": -0.03,
         "ci95": [-0.05, -0.01], "unit": "nats", "margin": 0.02, "p_holm": 0.0123, "n": 10, "negligible": False,
         "untestable": "", "analysis": "rerun"},
        {"id": "loss-free", "claim": "loss-free balancing", "verdict": "tie", "difference": 0.001,
         "ci95": [-0.002, 0.004], "unit": "nats", "margin": 0.006, "p_holm": 0.0004, "n": 5, "negligible": True,
         "untestable": "", "analysis": "re-analysed"}]}))
    # a later study inside an experiment's folder joins the table under both names; a previous analysis does not
    study = json.loads((results / "moe" / "verdict.json").read_text())
    (results / "moe" / "compute-ladder").mkdir()
    (results / "moe" / "compute-ladder" / "verdict.json").write_text(json.dumps(
        {**study, "experiment": "moe-compute", "claims": [{**study["claims"][0], "id": "capacity-d96"}]}))
    (results / "moe" / "previous").mkdir()
    (results / "moe" / "previous" / "verdict.json").write_text(json.dumps(
        {**study, "claims": [{**study["claims"][0], "id": "superseded"}]}))
    assert [p.relative_to(results).as_posix() for p in claims.verdict_files(results)] == [
        "moe/compute-ladder/verdict.json", "moe/verdict.json", "norm/verdict.json", "old/verdict.json"]
    table = claims.claims_table(results)
    assert ("| [moe/compute-ladder](moe/compute-ladder/report.md) | capacity-d96: MoE adds capacity | "
            "**REPRODUCED** | -0.030 [-0.050, -0.010] nats | ±0.020 | 0.012 | 10 |") in table
    assert "superseded" not in table
    assert ("| [norm](norm/report.md) | warmup-post-xavier: post-norm needs warmup | **REPRODUCED** | "
            "+0.200 [+0.100, +0.300] nats | ±0.050 (from the seed spread) | — | 3 |") in table
    assert ("| tiny: a real but tiny effect | **REPRODUCED** (negligible) | "
            "-0.005 [-0.008, -0.001] nats | ±0.026 (from the seed spread) | — | 3 |") in table
    assert ("| stuck: arms that never learned | **INCONCLUSIVE** (untestable) | -0.001 [-0.001, -0.001] nats | "
            "±0.050 (from the seed spread) | — | 3 |") in table
    assert ("| [moe](moe/report.md) | capacity: MoE adds capacity | **REPRODUCED** | -0.030 [-0.050, -0.010] nats "
            "| ±0.020 | 0.012 | 10 |") in table
    assert ("| loss-free: loss-free balancing | **TIE** (negligible, re-analysed) | +0.001 [-0.002, +0.004] nats "
            "| ±0.006 | <0.001 | 5 |") in table
    assert "an older report without intervals" in table
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{claims.BEGIN}\nstale\n{claims.END}\noutro\n")
    assert readme_table.main([str(results), str(readme)]) == 0
    text = readme.read_text()
    assert (
        "stale" not in text
        and "](results/norm/report.md)" in text
        and text.startswith("intro")
        and text.endswith("outro\n")
    )
    with pytest.raises(ValueError, match="no claims table markers"):
        claims.replace_table("no markers", table)


def test_the_committed_readmes_match_the_committed_verdict_files():
    root = Path(__file__).resolve().parents[1]
    results = root / "results"
    assert claims.verdict_files(results)  # reports older than verdict intervals get a line of their own
    table = claims.claims_table(results)
    for readme, link in ((root / "README.md", "results/"), (results / "README.md", "")):
        text = readme.read_text()
        assert claims.replace_table(text, table, link) == text, (
            f"{readme}: rerun python -m lmlab.experiments.readme_table results README.md results/README.md"
        )


def test_a_figure_traces_only_to_the_report_line_that_states_it(tmp_path):
    from lmlab.experiments import provenance

    results = tmp_path / "results"
    (results / "moe" / "previous").mkdir(parents=True)
    (results / "moe" / "report.md").write_text(
        "fg-m4-shared 3.273, dense 3.320; 1,228,800 tokens; 19.47 h\n| dense-common | -0.109 | 1.18x |\n")
    (results / "moe" / "verdict.json").write_text(json.dumps({"claims": [{"difference": -0.04712, "p": 0.0266}]}))
    (results / "moe" / "previous" / "report.md").write_text("dense 3.456 before the rerun\n")
    (results / "README.md").write_text("hand-typed dense 2.22 h\n")  # a README is not evidence, not even its own
    text = (f"{claims.BEGIN}\n| 9.999 |\n{claims.END}\n"  # the generated table is not read
            "```bash\nlmlab train --lr 7.77\n```\n"  # nor a code block, nor `inline 8.88` code
            "Dense 3.320 against fg-m4-shared 3.273, 1,228,800 tokens, 19.47 h in moe, `inline 8.88`. "
            "Dense-common differs by −0.109, a 1.18× multiplier. The registered dense ended 3.456.\n"
            "Unlabelled: 3.320 by itself. Rounded from data: dense −0.047 with p 0.027. Drifted: dense 3.321, "
            "1,228,801 tokens, 2.22 h, 0.5 nats, 12.5%. Current dense 3.456; settings are not figures: "
            "12 layers, lr 3e-3, Python 3.11.7, sha256:d056d5f4.62.\n")
    assert [f for f, _ in provenance.untraced(text, results)] == [
        "3.320", "0.047", "0.027", "3.321", "1,228,801", "2.22", "0.5", "12.5%", "3.456"]
    context = dict(provenance.untraced(text, results))["1,228,801"]
    assert context.startswith("Drifted: dense 3.321, 1,228,801 tokens")
    readme = "# lmlab\nPython 3.10.5\n## The design's claims, measured\nmoe dense 4.44\n## Next\n7.77\n"
    assert [f for f, _ in provenance.untraced(provenance.claims_prose(readme), results)] == ["4.44"]
    with pytest.raises(ValueError, match="claims, measured"):
        provenance.claims_prose("# no such section\n")


def test_every_figure_the_readmes_give_about_the_claims_is_in_a_results_file():
    """The prose beside the generated table quotes the reports; a figure typed by hand, or left behind by a
    rerun, fails here (lmlab.experiments.provenance says what traces)."""
    from lmlab.experiments import provenance

    root = Path(__file__).resolve().parents[1]
    pages = {"README.md": provenance.claims_prose((root / "README.md").read_text()),
             "results/README.md": (root / "results" / "README.md").read_text(),
             "docs/experiments.md": (root / "docs" / "experiments.md").read_text()}
    bad = [f"{page}: {figure!r} in '...{context}...'" for page, text in pages.items()
           for figure, context in provenance.untraced(text, root / "results")]
    assert not bad, "figures found in no generated results file:\n" + "\n".join(bad)


def test_shipped_experiments_resolve_to_the_models_their_runs_were_hashed_with():
    """Every variant of every shipped experiment, in every profile, resolves to the model config it resolved to
    when MoE balancing became the default (hashes in fixtures/experiment_models.json): the runs are keyed by their
    resolved config, so a changed default must not change an arm (the no-balancing arm sets its 0 explicitly).
    Update the fixture only for a change that is meant to rerun those arms."""
    import hashlib

    from lmlab.experiments import EXPERIMENTS, load_experiment_spec, spec_path
    from lmlab.schema import read_yaml

    expected = json.loads((Path(__file__).parent / "fixtures" / "experiment_models.json").read_text())
    now = {}
    for name in sorted(EXPERIMENTS):
        for profile in [None, *sorted(read_yaml(spec_path(name), name).get("profiles") or {})]:
            for variant, cfg in load_experiment_spec(name, profile=profile).configs.items():
                blob = json.dumps(cfg.model.identity_dict(), sort_keys=True).encode()
                now[f"{name}/{profile or 'default'}/{variant}"] = hashlib.sha256(blob).hexdigest()[:16]
    assert now == expected
    for name, cfg in load_experiment_spec("moe").configs.items():  # every arm the rerun trains balances its experts
        assert cfg.model.moe is None or cfg.model.moe.balancing, name


def _config_fields(cls, prefix=""):
    """(dotted path, dataclass field) for every field of ``cls`` and of the configs nested in it."""
    import typing

    from lmlab.schema import Config, _unwrap_optional

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        yield prefix + f.name, f
        sub = _unwrap_optional(hints[f.name])[0]
        if isinstance(sub, type) and issubclass(sub, Config):
            yield from _config_fields(sub, prefix + f.name + ".")


def test_every_field_added_since_the_first_hashed_runs_is_declared_with_added():
    """Sweeps key finished runs by a hash of their config (``Config.identity_dict``). A new field would change
    every key, and the next ``lmlab experiment`` would train every finished run again, unless it is declared
    with ``schema.added``, which leaves it out of the identity while it holds its default.
    fixtures/config_fields.json lists the fields of the runs first hashed (the issue-21 registration, 779e261)."""
    from lmlab.run.config import RunConfig

    baseline = set(json.loads((Path(__file__).parent / "fixtures" / "config_fields.json").read_text()))
    now = dict(_config_fields(RunConfig))
    undeclared = [p for p, f in now.items() if p not in baseline and "added" not in f.metadata]
    assert not undeclared, (f"new config field(s) {undeclared} change the hash of every finished sweep run; "
                            "declare each with schema.added(default, since=...)")
    gone = sorted(baseline - set(now))
    assert not gone, f"config field(s) {gone} were removed or renamed: that changes the hash of every finished run"


from lmlab.schema import Config, added  # noqa: E402  (the two configs below, module-level for their type hints)


@dataclasses.dataclass(kw_only=True, frozen=True)
class _Inner(Config):
    a: int = 1
    b: str = added("x", since="test")


@dataclasses.dataclass(kw_only=True, frozen=True)
class _Outer(Config):
    size: int = 2
    inner: _Inner = dataclasses.field(default_factory=_Inner)
    extra: _Inner | None = added(None, since="test")
    late: _Inner = added(since="test", factory=_Inner)


def test_identity_dict_leaves_out_an_added_field_only_while_it_holds_its_default():
    assert _Outer().identity_dict() == {"size": 2, "inner": {"a": 1}}
    assert _Outer().to_dict()["inner"] == {"a": 1, "b": "x"}  # the saved config stays explicit
    changed = _Outer(inner=_Inner(b="y"), extra=_Inner(), late=_Inner(a=3))
    assert changed.identity_dict() == {"size": 2, "inner": {"a": 1, "b": "y"}, "extra": {"a": 1}, "late": {"a": 3}}


def test_a_plot_that_fails_to_save_leaves_the_earlier_plot_whole(tmp_path):
    """Report plots are written beside and renamed (report.save): a crash mid-write keeps the last complete one."""
    from lmlab.experiments.report import figure, save

    fig, ax = figure().subplots()
    ax.plot([1, 2], [3, 4])
    assert save(fig, tmp_path / "curves.png") == "curves.png"
    first = (tmp_path / "curves.png").read_bytes()
    assert first[:4] == b"\x89PNG"

    fig, ax = figure().subplots()

    def half_then_fail(target, **kwargs):
        Path(target).write_bytes(first[:10])
        raise OSError("disk full")

    fig.savefig = half_then_fail
    with pytest.raises(OSError):
        save(fig, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes() == first and [p.name for p in tmp_path.iterdir()] == ["curves.png"]
