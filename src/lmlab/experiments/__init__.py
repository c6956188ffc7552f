"""Many runs compared: the sweep engine, report helpers, and the design's three claims as experiments.

    sweep.py       ``lmlab sweep SPEC.yaml``: variants of a run config on an equal budget, resumable
    report.py      tables, mean ± std, plots, report headers
    norm.py        claim 1: pre-norm vs post-norm vs DeepNorm over depth, learning rate and warmup
    positions.py   claim 2: six position schemes at 1x-8x the training length; rope context extension
    moe.py         claim 3: dense vs Switch, GShard, DeepSeekMoE at equal active parameters; balancing

An experiment is a sweep spec (``<name>.yaml`` beside its module) plus a module with its extra
measurements (sweep ``Hooks``) and ``analyze``, which writes PNG plots and report.md. A report's
verdict is computed from the numbers with criteria the report states; nothing is hard-coded.
``lmlab experiment norm|positions|moe [--quick] --out DIR`` runs one.

Dependencies run one way: this package imports ``lmlab.run`` and the model modules, never ``lmlab.cli``.
"""

from __future__ import annotations

import time
from pathlib import Path

from . import moe, norm, positions
from .sweep import SweepSpec, load_spec, run_sweep

EXPERIMENTS = {"norm": norm, "positions": positions, "moe": moe}


def spec_path(name: str) -> Path:
    return Path(__file__).with_name(f"{name}.yaml")


def load_experiment_spec(name: str, *, quick: bool = False, seeds: int | None = None) -> SweepSpec:
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose one of {sorted(EXPERIMENTS)}")
    return load_spec(spec_path(name), quick=quick, seeds=seeds)


def run_experiment(name: str, out: str | Path, *, quick: bool = False, seeds: int | None = None,
                   command: str | None = None, log=print) -> Path:
    """Run experiment ``name`` into ``out`` (resuming what is there) and write its report; returns report.md."""
    module = EXPERIMENTS[name]
    spec = load_experiment_spec(name, quick=quick, seeds=seeds)
    out = Path(out)
    t0 = time.perf_counter()
    rows = run_sweep(spec, out, hooks=module.Hooks(spec), quiet=True, log=lambda m: log(m, flush=True))
    wall = time.perf_counter() - t0
    command = command or f"lmlab experiment {name}{' --quick' if quick else ''} --out {out}"
    return module.analyze(spec, out, rows, command=command, wall_s=wall)
