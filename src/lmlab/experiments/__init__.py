"""The design's three claims as shipped sweeps: ``lmlab experiment norm|positions|moe [--quick] --out DIR``.

Each experiment is a sweep spec (``<name>.yaml`` beside this file) plus a module with its extra
measurements (sweep hooks) and its analysis, which writes PNG plots and report.md. A report's
verdict is computed from the numbers with criteria the report states; nothing is hard-coded.

    norm       pre-norm vs post-norm vs DeepNorm over depth, learning rate and warmup
    positions  six position schemes at 1x-8x the training length; rope context extension
    moe        dense vs Switch, GShard, DeepSeekMoE at equal active parameters; balancing
"""

from __future__ import annotations

import importlib
import json
import time
from pathlib import Path
from typing import Any

EXPERIMENTS = {
    "norm": "lmlab.experiments.norm",
    "positions": "lmlab.experiments.positions",
    "moe": "lmlab.experiments.moe",
}


def spec_path(name: str) -> Path:
    return Path(__file__).with_name(f"{name}.yaml")


def load_experiment_spec(name: str, *, quick: bool = False, seeds: int | None = None):
    from ..sweep import load_spec

    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose one of {sorted(EXPERIMENTS)}")
    return load_spec(spec_path(name), quick=quick, seeds=seeds)


def run_experiment(name: str, out: str | Path, *, quick: bool = False, seeds: int | None = None,
                   command: str | None = None, log=print) -> Path:
    """Run experiment ``name`` into ``out`` (resuming what is there) and write its report; returns report.md."""
    from ..sweep import run_sweep

    module = importlib.import_module(EXPERIMENTS[name])
    spec = load_experiment_spec(name, quick=quick, seeds=seeds)
    out = Path(out)
    t0 = time.perf_counter()
    rows = run_sweep(spec, out, hooks=module.Hooks(spec), quiet=True, log=lambda m: log(m, flush=True))
    wall = time.perf_counter() - t0
    command = command or f"lmlab experiment {name}{' --quick' if quick else ''} --out {out}"
    return module.analyze(spec, out, rows, command=command, wall_s=wall)


# ---- shared by the analyses
def report_header(title: str, command: str, spec, wall_s: float, rows: list[dict]) -> str:
    from ..train import git_revision

    train_s = sum(r.get("wall_s") or 0.0 for r in rows)
    timing = (f"the runs trained for {train_s / 60:.1f} min in total (sum of per-run wall times, evaluation included); "
              f"{_session_time(spec, wall_s)}")
    return (
        f"# {title}\n\n"
        f"Made by: `{command}`{'  (quick size: checks the machinery, not the claim)' if spec.is_quick else ''}\n\n"
        f"lmlab git revision {git_revision()}; {timing}. "
        f"Data: {spec.configs[spec.variants[0].name].data.source} corpus, "
        f"{spec.configs[spec.variants[0].name].data.tokenizer} tokenizer; seeds {spec.seeds}. Machine: {_machine()}; "
        "wall times and tokens/s depend on whatever else ran on it at the time.\n\n"
    )


def _session_time(spec, wall_s: float) -> str:
    return f"the invocation that wrote this report took {wall_s / 60:.1f} min (runs finished by an earlier invocation are reused)"


def _machine() -> str:
    import os
    import platform

    import torch

    device = "CUDA " + torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return f"{platform.machine()} {device}, {os.cpu_count()} cores, torch {torch.__version__} with {torch.get_num_threads()} threads"


def figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path.name


def verdict(ok: bool | None) -> str:
    return {True: "**REPRODUCED**", False: "**NOT REPRODUCED**", None: "**INCONCLUSIVE**"}[ok]


def write_json(path: Path, data: Any) -> None:
    from ..atomic import atomic_write_text
    from ..sweep import _jsonable

    atomic_write_text(path, json.dumps(_jsonable(data)) + "\n")
