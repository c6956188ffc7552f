"""The tuning stage: before the main runs, a sweep per group of variants chooses one hyperparameter
(the spec's ``tune:``), and the choice is applied to every variant of the group (but those marked
``tune: false``, which keep their own value: runs at one common rate beside the tuned arms).

    spec, info = tune_and_apply(spec, out, Trainer, quiet=True, log=print, jobs=1, threads=None)
    choose(spec.tune, rows, tried)    # pure: each group's value with the lowest mean final loss
    beyond_edge({1e-3: 3.1, 2e-3: 2.9}, 2)   # pure: Extension(4e-3, "above", ...): the best sits at an edge
    grid_edge_text(info)              # "Chosen at an edge of the grid, ..." when a choice is still at an end
    tune_problems(spec, ["dense", "moe"])    # why tuning might decide a verdict between these arms

Grid-edge extension: a group whose best value is the smallest or largest value it tried (of a grid of
positive numbers) is trained at the next value beyond that edge (edge / factor or edge * factor; factor
= ``tune.extend_factor``, else the grid's ratio when its values are log-uniform, else 2), and again,
until its best value is interior or ``tune.max_extensions`` values were added. A seed that diverged
counts as +inf, so a value beyond the edge that diverged (in any seed) leaves the edge value interior
in effect, and the search stops there. The extension runs are ordinary sweep runs, reused by their
config hash: running the sweep again trains nothing new and takes the same steps.

The tuning runs live beside the others (runs/tune-*); tune.csv holds their rows, tune.json the
values each group tried in order, why each extension happened, and the choices.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any, Callable, Mapping

from ...run.checkpoint.atomic import atomic_write_text
from ...run.config import RunConfig
from ...run.metrics import jsonable
from ..report import write_csv
from ..spec import SweepSpec, Tune
from .engine import Hooks, setup
from .tables import scalar_columns
from .workers import execute

__all__ = ["Extension", "beyond_edge", "choose", "grid_edge_text", "grid_edges", "mean_final_loss", "numeric_grid",
           "step_factor", "stop_reason", "tune_and_apply", "tune_problems"]


# ============================================================== pure: where the best value sits
@dataclasses.dataclass(frozen=True)
class Extension:
    """A value to train beyond an edge of a grid, and why."""

    value: float | int
    side: str  # "above" the largest value tried, or "below" the smallest
    reason: str


def numeric_grid(values: list[Any]) -> bool:
    """Whether a grid can grow past its edges: two values or more, each a positive finite number."""
    return len(values) >= 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                                    and v > 0 for v in values)


def step_factor(values: list[Any], given: float | None = None) -> float:
    """``given``; else the ratio between neighbours when ``values`` are log-uniform (1e-3, 2e-3, 4e-3: 2); else 2."""
    if given is not None:
        return float(given)
    v = sorted(set(values))
    if numeric_grid(v):
        ratios = [b / a for a, b in zip(v, v[1:])]
        if all(math.isclose(r, ratios[0], rel_tol=1e-6) for r in ratios):
            return float(f"{ratios[0]:.12g}")
    return 2.0


def mean_final_loss(rows: list[Mapping[str, Any]]) -> float:
    """The mean final validation loss of ``rows``; +inf when one diverged or there are none."""
    losses = [r["final_val_loss"] if r["status"] != "diverged" else math.inf for r in rows]
    mean = statistics.fmean(losses) if losses else math.inf
    return mean if math.isfinite(mean) else math.inf


def _best(losses: Mapping[Any, float]) -> tuple[Any, float]:
    return min(losses.items(), key=lambda kv: kv[1])  # the first of equal losses, in the order tried


def beyond_edge(losses: Mapping[Any, float], factor: float) -> Extension | None:
    """The value one ``factor`` beyond the edge where the lowest loss sits; None when it is interior.

    ``losses``: each value tried, in the order tried -> its mean final loss (+inf: a seed diverged).
    None too when the grid is not numeric, when no value has a finite loss (no direction to follow), or
    when the next integer value would repeat one tried. Pure."""
    if not numeric_grid(list(losses)):
        return None
    best, loss = _best(losses)
    if not math.isfinite(loss) or best not in (min(losses), max(losses)):
        return None
    side = "above" if best == max(losses) else "below"
    new = best * factor if side == "above" else best / factor
    new = round(new) if all(isinstance(v, int) for v in losses) else float(f"{new:.12g}")
    if new <= 0 or new in losses:
        return None
    where = "largest" if side == "above" else "smallest"
    return Extension(new, side, f"the best value {best:g} (mean final loss {loss:.4f}) was the {where} tried")


def stop_reason(losses: Mapping[Any, float], extensions: int, most: int) -> str:
    """Why a group's search ended, for tune.json and extend.json."""
    if not numeric_grid(list(losses)):
        return "not a grid of positive numbers: never extended"
    best, loss = _best(losses)
    if not math.isfinite(loss):
        return "every value had a diverged seed: no direction to extend"
    if best in (min(losses), max(losses)):
        return f"still at an edge after {extensions} extensions (max {most})"
    if extensions and not math.isfinite(losses[list(losses)[-1]]):
        return "interior: the value beyond the edge diverged"
    return "interior"


def choose(tune: Tune, rows: list[dict[str, Any]],
           tried: Mapping[str, list[Any]] | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Each group's value with the lowest mean final validation loss over seeds (a diverged seed
    counts as +inf; ties keep the first value) among the values it ``tried`` (default ``tune.values``).
    Pure: rows in, choice out."""
    table, choices = [], {}
    for group in dict.fromkeys(r["tune_group"] for r in rows):
        values = (tried or {}).get(group, tune.values)
        losses = _group_losses(rows, group, values)
        for value, loss in losses.items():
            table.append({"group": group, "value": value, "mean_final_val_loss": loss if math.isfinite(loss) else None,
                          "runs": sum(r["tune_group"] == group and r["tune_value"] == str(value) for r in rows)})
        best, loss = _best(losses)
        choices[group] = best if math.isfinite(loss) else values[0]
    return choices, table


def _group_losses(rows: list[dict[str, Any]], group: str, values: list[Any]) -> dict[Any, float]:
    return {v: mean_final_loss([r for r in rows if r["tune_group"] == group and r["tune_value"] == str(v)])
            for v in values}


# ============================================================== the stage
def tune_and_apply(
    spec: SweepSpec, out: Path, trainer_cls, quiet: bool, log, jobs: int, threads,
) -> tuple[SweepSpec, dict]:
    """Run the tuning sweep (its runs live beside the others, named tune-*), extend each group's grid
    past an edge its best value sits at, choose each group's value, write tune.csv and tune.json, and
    return the spec with the choices applied."""
    t = spec.tune
    tried = {g: list(t.values) for g in spec.tune_groups()}
    log(f"tuning {t.field} over {t.values}: {len(tried)} groups x {len(t.seeds)} seeds")

    def run(tspec: SweepSpec) -> list[dict[str, Any]]:
        return execute(setup(tspec, out, Hooks(), trainer_cls, quiet, log)[0], jobs, threads, log)

    rows, extensions = _until_interior(spec, tried, run, log)
    choices, table = choose(t, rows, tried)
    write_csv(rows, out / "tune.csv", scalar_columns(rows))
    groups = {g: {"tried": values, "extensions": extensions[g],
                  "stopped": stop_reason(_group_losses(rows, g, values), len(extensions[g]), t.max_extensions)}
              for g, values in tried.items()}
    info = jsonable({"field": t.field, "values": t.values, "by": t.by, "at": t.at, "seeds": t.seeds,
                     "extend_factor": step_factor(t.values, t.extend_factor), "max_extensions": t.max_extensions,
                     "full_length": t.full_length, "chosen": choices, "groups": groups, "table": table})
    atomic_write_text(out / "tune.json", json.dumps(info, indent=1) + "\n")
    log("chosen " + ", ".join(f"{g}: {v}" for g, v in choices.items()))
    if edges := grid_edge_text(info):
        log("note: " + edges.strip())
    return spec.with_tuned(choices), info


def _until_interior(
    spec: SweepSpec, tried: dict[str, list[Any]], run: Callable[[SweepSpec], list[dict[str, Any]]], log,
) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """Train every group's values, then one value beyond the edge of each group whose best sits at one,
    until none does or it has ``max_extensions``. Appends to ``tried``; returns every row and each group's
    extensions (value, side, why)."""
    t = spec.tune
    factor = step_factor(t.values, t.extend_factor)
    extensions: dict[str, list[dict[str, Any]]] = {g: [] for g in tried}
    rows: list[dict[str, Any]] = []
    new = {g: list(values) for g, values in tried.items()}
    while new:
        rows += run(spec.tune_spec(new))
        new = {}
        for g, values in tried.items():
            if len(extensions[g]) >= t.max_extensions:
                continue
            if (ext := beyond_edge(_group_losses(rows, g, values), factor)) is not None:
                values.append(ext.value)
                new[g] = [ext.value]
                extensions[g].append({"value": ext.value, "side": ext.side, "because": ext.reason})
                log(f"tuning {g}: {ext.reason}; training {t.field}={ext.value:g}")
    return rows, extensions


# ============================================================== reading it back
def grid_edges(tune: dict | None) -> dict[str, Any]:
    """Groups whose chosen value is still the smallest or largest of the numeric values they tried
    (after any extension): their best value may lie beyond, so a comparison against them may be
    against an under-tuned arm. Reads tune.json (older ones, without per-group values, too)."""
    tune = tune or {}
    edges = {}
    for g, v in (tune.get("chosen") or {}).items():
        values = ((tune.get("groups") or {}).get(g) or {}).get("tried") or tune.get("values") or []
        if numeric_grid(values) and v in (min(values), max(values)):
            edges[g] = v
    return edges


def grid_edge_text(tune: dict | None) -> str:
    """One sentence naming the groups tuned to an edge of the grid ("" when none is)."""
    edges = grid_edges(tune)
    if not edges:
        return ""
    return ("Chosen at an edge of the grid, so the best value may lie beyond it: "
            + ", ".join(f"{g} {v:g}" for g, v in edges.items()) + ". ")


def _lengths(cfg: RunConfig) -> dict[str, int]:
    """What sets a run's length (and so its schedule's): steps, tokens per step."""
    t = cfg.train
    return {"train.steps": t.steps, "train.batch_size": t.batch_size, "train.grad_accum": t.grad_accum,
            "seq_len": cfg.seq_len}


def tune_problems(spec: SweepSpec, arms: list[str], info: Mapping[str, Any] | None = None) -> list[str]:
    """Why the tuning of ``arms`` (the variants a verdict rests on) could decide the verdict, one line
    each; [] when it cannot. The rule: every arm is tuned on its own runs, at full length (steps, batch
    and context as in its main runs), with at least 2 seeds; or no arm is tuned (all at fixed values,
    e.g. one common rate: ``tune: false``). With ``info`` (tune.json), an arm whose value is still at an
    edge of its grid is named too. ``spec`` is resolved."""
    if unknown := [a for a in arms if a not in spec.configs]:
        return [f"{spec.source}: no variant {unknown[0]!r}; variants: {', '.join(spec.configs)}"]
    t = spec.tune
    groups = spec.tune_groups() if t is not None else {}
    tuned = [a for a in arms if t is not None and (v := spec.variant(a)).init_from is None and v.tune
             and t.group(v) in groups]
    if not tuned:
        return []  # every arm at its own fixed value: no tuning favours one
    problems = [f"{spec.source}: arm {a!r} is not tuned while {', '.join(map(repr, tuned))} are; tune it, or compare "
                "arms that all train at one common value (tune: false)" for a in arms if a not in tuned]
    if len(t.seeds) < 2:
        problems.append(f"{spec.source}: tune.seeds={t.seeds} is fewer than 2 seeds; give at least 2, so that one "
                        "seed's luck does not choose the value")
    tspec = spec.tune_spec({g: t.values[:1] for g in groups})
    runs = {v.labels["tune_group"]: tspec.configs[v.name] for v in tspec.variants}
    edges = grid_edges(dict(info) if info else None)
    for a in tuned:
        g = t.group(spec.variant(a))
        if groups[g].name != a:
            problems.append(f"{spec.source}: arm {a!r} takes the value tuned on {groups[g].name!r} (tune.at={t.at}), "
                            "not on its own runs; tune by every axis it differs in")
        was, now = _lengths(runs[g]), _lengths(spec.configs[a])
        problems += [f"{spec.source}: arm {a!r} is tuned with {f}={was[f]} but trained with {now[f]}; tune at full "
                     "length (drop it from tune.overrides)" for f in was if was[f] != now[f]]
        if g in edges:
            problems.append(f"{spec.source}: arm {a!r} was tuned to {edges[g]:g}, still an edge of the values its "
                            "group tried; widen tune.values or raise tune.max_extensions")
    return problems
