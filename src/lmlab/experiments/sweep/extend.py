"""A grid axis that grows past its edge: the axis's ``extend: {by:, factor:, max:}`` (spec.AxisExtend).

    spec, rows, info = extend_axis(spec, rows, out, run, log)   # after the sweep's runs; info: extend.json
    next_levels(spec, rows)                                # pure: the levels each group trains next

After the sweep's runs, the variants are grouped by the levels of the ``by`` axes. A group whose best
level (lowest mean final loss over its runs, every seed and every level of the other axes, a
diverged run counting as +inf) is the smallest or largest value of the axis it tried gets one new
level one ``factor`` beyond that edge (``sweep.tuning.beyond_edge``), for that group only: every
variant of the group at the edge level is copied at the new value, and trained for every seed. This
repeats until the group's best level is interior or it has ``max`` new levels. A new level is named
``<axis><value>`` (``lr0.008``), and its rows carry it as their axis label, as every row does, so
the analysis groups them like the spec's own levels; extend.json maps each level to its value.
The new runs are ordinary runs: a rerun reuses them by their config hash and trains nothing new.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

from ...run.checkpoint.atomic import atomic_write_text
from ...run.metrics import jsonable
from ..spec import AxisExtend, SweepSpec, Variant
from .engine import Sweep
from .tuning import Extension, beyond_edge, mean_final_loss, step_factor, stop_reason

__all__ = ["extend_axis", "group_of", "next_levels", "only"]


def group_of(ext: AxisExtend, variant: Variant) -> str | None:
    """The variant's group (its levels of the ``by`` axes, joined by "-"; "all" without ``by``), or
    None for a variant outside the grid."""
    if ext.axis not in variant.labels or any(b not in variant.labels for b in ext.by):
        return None
    return "-".join(variant.labels[b] for b in ext.by) or "all"


def _levels(spec: SweepSpec, group: str) -> dict[str, Any]:
    """The axis levels ``group`` has (spec order: the spec's levels, then those added) -> their values."""
    ext = spec.axis_extend
    return {v.labels[ext.axis]: v.overrides[ext.field] for v in spec.variants if group_of(ext, v) == group}


def _losses(spec: SweepSpec, rows: list[dict[str, Any]], group: str) -> dict[Any, float]:
    """Each value the group tried -> the mean final loss of its runs (+inf when one diverged)."""
    ext = spec.axis_extend
    names = {v.name for v in spec.variants if group_of(ext, v) == group}
    return {value: mean_final_loss([r for r in rows if r["variant"] in names and r[ext.axis] == level])
            for level, value in _levels(spec, group).items()}


def next_levels(spec: SweepSpec, rows: list[dict[str, Any]]) -> dict[str, tuple[Extension, str]]:
    """Each group that trains a new level next -> (the extension, the edge level it copies). Pure."""
    ext = spec.axis_extend
    factor = step_factor(list(ext.levels.values()), ext.factor)
    out = {}
    for group in dict.fromkeys(g for v in spec.variants if (g := group_of(ext, v)) is not None):
        levels = _levels(spec, group)
        if len(levels) - len(ext.levels) >= ext.max:
            continue
        if (step := beyond_edge(_losses(spec, rows, group), factor)) is not None:
            edge = next(name for name, value in levels.items() if value == (
                max(levels.values()) if step.side == "above" else min(levels.values())))
            out[group] = (step, edge)
    return out


def _at_level(spec: SweepSpec, v: Variant, level: str, value: Any) -> Variant:
    """``v`` copied at a new level of the extending axis (the field set wherever ``v`` sets it)."""
    ext = spec.axis_extend
    labels = {**v.labels, ext.axis: level}

    def moved(changes: dict[str, Any]) -> dict[str, Any]:
        return {**changes, ext.field: value} if ext.field in changes else changes

    return dataclasses.replace(v, name="-".join(labels.values()), overrides={**v.overrides, ext.field: value},
                               quick=moved(v.quick), labels=labels,
                               profiles={k: moved(p) for k, p in v.profiles.items()})


def extend_axis(
    spec: SweepSpec, rows: list[dict[str, Any]], out: Path,
    run: Callable[[SweepSpec, list[str]], list[dict[str, Any]]], log: Callable[[str], None],
) -> tuple[SweepSpec, list[dict[str, Any]], dict[str, Any]]:
    """Add and train levels beyond the edge of each group whose best level sits at one (see the module's
    docstring); ``run(spec, names)`` trains those variants of ``spec`` and returns their rows. Writes
    extend.json; returns the spec with the new variants (resolved), every row, and extend.json's content."""
    ext, history = spec.axis_extend, {}
    while steps := next_levels(spec, rows):
        new, tuned = [], dict(spec.tuned)
        for group, (step, edge) in steps.items():
            level = f"{ext.axis}{step.value:g}"
            history.setdefault(group, []).append({"level": level, "value": step.value, "side": step.side,
                                                  "because": step.reason})
            log(f"extending {ext.axis} for {group}: {step.reason}; training {ext.field}={step.value:g} ({level})")
            for v in spec.variants:
                if group_of(ext, v) == group and v.labels[ext.axis] == edge:
                    new.append(_at_level(spec, v, level, step.value))
                    tuned.update({new[-1].name: spec.tuned[v.name]} if v.name in spec.tuned else {})
        spec = dataclasses.replace(spec, variants=spec.variants + new, tuned=tuned, configs={}).resolve(
            profile=spec.profile)
        rows = rows + run(spec, [v.name for v in new])
    return spec, rows, _write(spec, rows, history, out)


def _write(spec: SweepSpec, rows: list[dict[str, Any]], history: dict[str, list], out: Path) -> dict[str, Any]:
    ext = spec.axis_extend
    groups = {}
    for group in dict.fromkeys(g for v in spec.variants if (g := group_of(ext, v)) is not None):
        levels, losses = _levels(spec, group), _losses(spec, rows, group)
        best = min(losses.items(), key=lambda kv: kv[1])[0]
        groups[group] = {"tried": [{"level": name, "value": value} for name, value in levels.items()],
                         "extensions": history.get(group, []),
                         "best": next(name for name, value in levels.items() if value == best),
                         "stopped": stop_reason(losses, len(levels) - len(ext.levels), ext.max)}
    levels = {v.labels[ext.axis]: v.overrides[ext.field] for v in spec.variants if group_of(ext, v) is not None}
    info = {"axis": ext.axis, "field": ext.field, "by": ext.by, "factor": step_factor(list(ext.levels.values()),
            ext.factor), "max": ext.max, "levels": levels, "groups": groups}
    info = jsonable(info)
    atomic_write_text(out / "extend.json", json.dumps(info, indent=1) + "\n")
    return info


def only(sw: Sweep, names: list[str]) -> Sweep:
    """``sw`` training only the variants ``names`` (every seed of each)."""
    return dataclasses.replace(sw, spec=dataclasses.replace(sw.spec, variants=[sw.spec.variant(n) for n in names]))
