"""The tuning stage: before the main runs, a short sweep per group of variants chooses one
hyperparameter (the spec's ``tune:``), and the choice is applied to every variant of the group.

    spec, info = tune_and_apply(spec, out, Trainer, quiet=True, log=print, jobs=1, threads=None)
    choose(spec.tune, rows)       # pure: each group's value with the lowest mean final loss
    grid_edge_text(info)          # "Chosen at an edge of the grid, ..." when a choice is at an end

The tuning runs live beside the others (runs/tune-*), and tune.csv / tune.json record them and
the choices.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from ...run.checkpoint.atomic import atomic_write_text
from ...run.metrics import jsonable
from ..report import write_csv
from ..spec import SweepSpec, Tune
from .engine import Hooks, setup
from .tables import scalar_columns
from .workers import execute

__all__ = ["choose", "grid_edge_text", "grid_edges", "tune_and_apply"]


def tune_and_apply(
    spec: SweepSpec, out: Path, trainer_cls, quiet: bool, log, jobs: int, threads,
) -> tuple[SweepSpec, dict]:
    """Run the tuning sweep (its runs live beside the others, named tune-*), choose each group's
    value, write tune.csv and tune.json, and return the spec with the choices applied."""
    tspec = spec.tune_spec()
    log(f"tuning {spec.tune.field} over {spec.tune.values}: {len(tspec.variants)} runs x {len(tspec.seeds)} seeds")
    sw, _ = setup(tspec, out, Hooks(), trainer_cls, quiet, log)
    rows = execute(sw, jobs, threads, log)
    choices, table = choose(spec.tune, rows)
    write_csv(rows, out / "tune.csv", scalar_columns(rows))
    info = jsonable({"field": spec.tune.field, "values": spec.tune.values, "by": spec.tune.by, "at": spec.tune.at,
                     "seeds": spec.tune.seeds, "chosen": choices, "table": table})
    atomic_write_text(out / "tune.json", json.dumps(info, indent=1) + "\n")
    log("chosen " + ", ".join(f"{g}: {v}" for g, v in choices.items()))
    if edges := grid_edge_text(info):
        log("note: " + edges.strip())
    return spec.with_tuned(choices), info


def choose(tune: Tune, rows: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Each group's value with the lowest mean final validation loss over seeds (a diverged seed
    counts as +inf; ties keep the first value). Pure: rows in, choice out."""
    table, choices = [], {}
    for group in dict.fromkeys(r["tune_group"] for r in rows):
        best, best_loss = None, math.inf
        for value in tune.values:
            losses = [r["final_val_loss"] if r["status"] != "diverged" else math.inf
                      for r in rows if r["tune_group"] == group and r["tune_value"] == str(value)]
            loss = statistics.fmean(losses) if losses else math.inf
            table.append({"group": group, "value": value, "mean_final_val_loss": loss if math.isfinite(loss) else None,
                          "runs": len(losses)})
            if loss < best_loss:
                best, best_loss = value, loss
        choices[group] = best if best is not None else tune.values[0]
    return choices, table


def grid_edges(tune: dict | None) -> dict[str, Any]:
    """Groups whose chosen value is the smallest or largest of a numeric grid: their best value may
    lie beyond the grid, so a comparison against them may be against an under-tuned arm."""
    values = (tune or {}).get("values") or []
    if len(values) < 2 or not all(isinstance(v, (int, float)) for v in values):
        return {}
    return {g: v for g, v in tune["chosen"].items() if v in (min(values), max(values))}


def grid_edge_text(tune: dict | None) -> str:
    """One sentence naming the groups tuned to an edge of the grid ("" when none is)."""
    edges = grid_edges(tune)
    if not edges:
        return ""
    return ("Chosen at an edge of the grid, so the best value may lie beyond it: "
            + ", ".join(f"{g} {v:g}" for g, v in edges.items()) + ". ")
