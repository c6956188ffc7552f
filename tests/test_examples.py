"""The example sweep specs in examples/: each resolves to the variants it says, and runs at its quick sizes."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from lmlab.experiments.sweep import load_spec, run_sweep

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
QK_NORM = EXAMPLES / "qk_norm_stability.yaml"


def test_qk_norm_example_compares_four_architectures_at_two_rates_with_seeds():
    spec = load_spec(QK_NORM)
    archs = {"pre": ("pre", "none", "none"), "pre-qknorm": ("pre", "head", "none"),
             "pre-gated": ("pre", "none", "elementwise"), "sandwich": ("sandwich", "none", "none")}
    assert sorted(spec.configs) == sorted(f"{a}-{lr}" for a in archs for lr in ("lr3e-3", "lr3e-2"))
    for name, cfg in spec.configs.items():
        arch, lr = name.rsplit("-lr", 1)
        assert (cfg.model.norm_position, cfg.model.qk_norm, cfg.model.attn_gate) == archs[arch]
        assert cfg.optim.lr == float(lr)
        assert cfg.data.source == "builtin"
    assert len(spec.seeds) >= 2


@pytest.mark.slow
def test_qk_norm_example_runs_at_its_quick_sizes(tmp_path):
    spec = load_spec(QK_NORM, quick=True, seeds=1)
    rows = run_sweep(spec, tmp_path / "sweep", log=lambda message: None)
    assert len(rows) == 8
    with open(tmp_path / "sweep" / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == 8
