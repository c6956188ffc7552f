"""The shipped experiments at --quick size: each makes its files, its table has the expected rows
and columns, and its report states a verdict. This checks the machinery, not the claims."""

from __future__ import annotations

import csv
import json

import pytest

from lmlab.experiments import sweep
from lmlab.experiments import EXPERIMENTS, load_experiment_spec, run_experiment

PNG = b"\x89PNG\r\n\x1a\n"

EXPECTED = {
    "norm": {
        "rows": [f"{n}-L{d}-lr{lr}-{w}" for n in ("post", "pre", "deepnorm") for d in (2, 6, 12, 24)
                 for lr in ("1e-3", "5e-3") for w in ("warmup", "nowarmup")],
        "columns": ["norm", "depth", "lr", "warmup", "grad_top_bottom", "update_at_10", "update_at_50"],
        "plots": ["grad_norm_init.png", "loss_curves.png", "final_loss_vs_depth.png", "update_size.png"],
        "verdicts": ["gradients", "stability"],
    },
    "positions": {
        "rows": ["none", "sinusoidal", "learned", "relative", "alibi", "rope",
                 "rope-ft-linear", "rope-ft-ntk", "rope-ft-yarn", "rope-ft-none"],
        "columns": ["loss_1x", "loss_2x", "loss_4x", "loss_8x"] + [f"zs_{m}_{k}x" for m in ("linear", "ntk", "yarn") for k in (2, 4, 8)],
        "plots": ["loss_by_length.png", "per_position.png", "rope_extension.png", "rope_extension_per_position.png"],
        "verdicts": ["zero_shot", "fine_tune"],
    },
    "moe": {
        "rows": ["dense", "switch-top1", "gshard-top2", "deepseek-fg2", "deepseek-fg4", "deepseek-fg4-shared",
                 "deepseek-fg4-shared-nobalance", "deepseek-fg4-shared-lossfree"],
        "columns": ["max_load_val"],
        "plots": ["val_loss_vs_tokens.png", "val_loss_vs_wall_time.png", "expert_load_heatmaps.png", "balance_max_load.png"],
        "verdicts": ["capacity", "fine_grained", "shared", "balance"],
    },
}


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_quick_experiment_makes_its_files(name, tmp_path):
    out = tmp_path / name
    report = run_experiment(name, out, quick=True, command=f"lmlab experiment {name} --quick --out {out}", log=lambda *a, **k: None)
    want = EXPECTED[name]

    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["variant"] for r in rows] == want["rows"]
    assert set(sweep.COLUMNS + want["columns"]) <= set(rows[0])
    assert all(r["seed"] == "0" and int(r["steps"]) > 0 and float(r["final_val_loss"]) > 0 for r in rows)
    for plot in want["plots"]:
        assert (out / plot).read_bytes()[:8] == PNG, plot
    text = report.read_text()
    assert text.startswith("# Claim") and f"Made by: `lmlab experiment {name} --quick --out {out}`" in text
    assert "## What was measured" in text and "## Verdict" in text and "Criteria" in text
    for plot in want["plots"]:
        if plot != "loss_curves.png" or name == "norm":
            assert f"({plot})" in text, plot
    verdicts = json.loads((out / "verdict.json").read_text())
    assert set(want["verdicts"]) <= set(verdicts)
    assert all(verdicts[k] in (True, False, None) for k in want["verdicts"])

    if name == "positions":
        learned = next(r for r in rows if r["variant"] == "learned")
        assert learned["loss_2x"] == "n/a — learned table ends at 16" and float(learned["loss_1x"]) > 0
        assert "n/a — learned table ends at 16" in text
        rope = next(r for r in rows if r["variant"] == "rope")
        assert all(float(rope[f"zs_{m}_8x"]) > 0 for m in ("linear", "ntk", "yarn"))
    if name == "moe":
        by = {r["variant"]: r for r in rows}
        dense = int(by["dense"]["active_params"])
        for r in rows:  # equal active parameters by construction; MoE has several times the total
            assert abs(int(r["active_params"]) / dense - 1) < 0.05
        assert int(by["switch-top1"]["total_params"]) > 3 * int(by["dense"]["total_params"])
    if name == "norm":
        by = {r["variant"]: r for r in rows}
        assert float(by["pre-L24-lr1e-3-warmup"]["grad_top_bottom"]) > 0


def test_experiment_specs_ship_with_the_package_and_validate_at_full_size():
    for name in EXPERIMENTS:
        spec = load_experiment_spec(name)
        assert spec.configs and not spec.is_quick
    spec = load_experiment_spec("moe")
    counts = sweep.check_active_params(spec)
    assert max(abs(c["active_params"] / counts["dense"]["active_params"] - 1) for c in counts.values()) < 0.05
