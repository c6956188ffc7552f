"""Ladders: arms compared over a ladder of model sizes, with a fitted law per arm and the compute multiplier.

    lmlab ladder ladder.yaml --out ladders/moe --jobs 2 --threads 1     # resumable; --quick, --profile gpu
    lmlab ladder example --out /tmp/ladder --quick                     # the shipped ladder-example.yaml
    path = run_ladder("ladder.yaml", "ladders/moe", quick=True)          # report.md

A ladder is one sweep (``experiments/sweep``: the same engine, run directories, resumption, ``--jobs``,
tuning), whose variants are arms x rungs: run ``<arm>-<rung>`` at every seed. A rung is a set of model
overrides (width, depth, experts) and a token budget. The spec::

    name: moe-ladder
    registration: {id: moe-ladder-2027-01-10, correction: holm, alpha: 0.05, amendments: []}   # optional
    base:                          # a run config, read as `lmlab train --config` reads one
      model: {d_model: 64, n_heads: 4, n_layers: 4, max_seq_len: 128}
      train: {batch_size: 16}
    corpus: {name: stdlib}         # optional, as in a sweep; final_eval: too
    seeds: 3                       # seed s sets model.init_seed and train.seed: arms are paired by seed
    arms:
      - {name: dense, overrides: {}}
      - {name: moe, overrides: {model.moe: {n_experts: 8, top_k: 1, granularity: 4}}}
    rungs:                         # smallest first
      - {name: d64, overrides: {model.d_model: 64, model.n_heads: 4}}
      - {name: d96, overrides: {model.d_model: 96, model.n_heads: 4}}
      - {name: d128, overrides: {model.d_model: 128, model.n_heads: 4}, budget: {flops: 4.0e14}}
    budget: {tokens_per_param: 20, params: active, evals: 4, warmup: 0.05}
    rates: {mode: transfer, field: optim.lr, values: [1.0e-3, 3.0e-3, 1.0e-2], seeds: [1000, 1001]}
    compare: [{arm: moe, baseline: dense}]    # default: every arm over the first
    resamples: 999                 # bootstrap resamples of the seeds
    profiles:                      # --quick, --profile gpu: overrides on the base, and rungs, seeds, budget,
      quick: {overrides: {train.batch_size: 2}, rungs: [...], seeds: [0, 1], budget: {tokens: 2048}}
      gpu: {...}                   #   rates, corpus (null: none), final_eval, resamples replaced or merged

Budget (per rung; a rung's ``budget:`` replaces the ladder's kind and keeps its other keys): exactly one
of ``tokens_per_param`` (times the run's ``params``: active (default), total, or non_embedding: active
less the embedding), ``flops`` (training FLOPs: tokens = flops / FLOPs per token) or ``tokens``. The
steps are tokens / (batch x accumulation x sequence), rounded; ``evals`` evaluations are spaced along
each run; ``warmup``, when given, is a fraction of the steps. An arm's cells are sized by its own
parameters, so arms of equal active parameters train on equal tokens.

Rates: ``transfer`` tunes ``field`` per arm at the smallest rung (full length, ``seeds``) and carries
the best value to every rung of that arm. It is meant for ``model.parametrization: mup`` with mup's
base shape set to the smallest rung's (checked, when the model has that field); under the standard
parametrization the carried rate is the spec's assumption, and the report says so. ``grid`` tunes per
arm at every rung. Either extends its grid past an edge that holds the best value (``sweep.tuning``).

Analysis (``law.py``, pure): per rung the paired difference between arms by seed; per arm the law
L(C) = E + A (C/C0)^-alpha with bootstrap intervals over seeds, and a held-out check (fit without the
largest rung, predict it); per compared pair the FLOPs and wall-clock multipliers at each rung (every
seed counted; extrapolated or unreachable values marked, none dropped) and their trend with compute.

Registration, as for ``lmlab experiment``: a main run (not ``--quick``) starts only from a spec that is
committed, unchanged and has a ``registration: id``, or with ``--draft`` (the report then says
UNREGISTERED); the report lists every amendment and every later commit to the spec, this package or
``stats.py``. Out directory: the sweep's (runs/, tune.*, results.csv, summary.md), plus report.md,
ladder.json, loss_vs_compute.png and multiplier_vs_compute.png.

Modules, one concern each::

    spec.py      the ladder spec, profiles, the budget rule; expanded to the sweep spec the engine runs
    law.py       the fitted laws, multipliers, trend, held-out check and bootstrap intervals (pure)
    report.py    the table of points, report.md, the plots, ladder.json
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

from .. import claims, decide, stats
from ..decide import decide_claims
from ..registration import Registration, spec_status
from ..report import read_csv
from ..sweep import sweep_outcome
from . import law, report, spec
from .spec import Ladder, load_ladder

__all__ = ["Ladder", "ladder_registration", "load_ladder", "resolve_spec", "run_ladder", "shipped_ladders"]

SHIPPED_PREFIX = "ladder-"  # src/lmlab/experiments/ladder-<name>.yaml: a shipped ladder, `lmlab ladder <name>`


def shipped_ladders() -> list[str]:
    """The names of the ladder specs shipped beside the experiments (``ladder-<name>.yaml``)."""
    folder = Path(__file__).resolve().parent.parent
    return sorted(p.stem[len(SHIPPED_PREFIX):] for p in folder.glob(f"{SHIPPED_PREFIX}*.yaml"))


def resolve_spec(spec_arg: str | Path) -> Path:
    """A ladder spec file: ``spec_arg`` itself, or the shipped ``ladder-<spec_arg>.yaml``."""
    p = Path(spec_arg)
    if p.is_file() or str(spec_arg) not in shipped_ladders():
        return p
    return Path(__file__).resolve().parent.parent / f"{SHIPPED_PREFIX}{spec_arg}.yaml"


def ladder_registration(path: str | Path, *, quick: bool = False, draft: bool = False) -> Registration:
    """The registration of a ladder spec file (later commits to this package, and to stats.py, claims.py and
    decide.py, which decide its claims, listed too). Raises NotRegistered (exit 2), before anything is written,
    for a main run of an unregistered spec unless ``draft``."""
    related = [law.__file__, spec.__file__, report.__file__, __file__, stats.__file__, claims.__file__,
               decide.__file__]
    status = dataclasses.replace(spec_status(path, related), draft=draft)
    status.refuse_unless(quick or draft)
    return status


def run_ladder(spec_arg: str | Path, out: str | Path, *, quick: bool = False, profile: str | None = None,
               seeds: int | None = None, command: str | None = None, log=print, jobs: int = 1,
               threads: int | None = None, draft: bool = False, registration: Registration | None = None) -> Path:
    """Run the ladder into ``out`` (resuming what is there), analyse it and write its report; returns report.md."""
    from .. import data_report  # the experiments' corpus and split description

    path = resolve_spec(spec_arg)
    registration = registration or ladder_registration(path, quick=quick, draft=draft)
    ladder = load_ladder(path, quick=quick, profile=profile, seeds=seeds)
    ladder.sweep = dataclasses.replace(ladder.sweep, registration_status=registration)
    out = Path(out)
    t0 = time.perf_counter()
    outcome = sweep_outcome(ladder.sweep, out, quiet=True, log=lambda m: log(m, flush=True), jobs=jobs,
                            threads=threads)
    ladder.sweep = outcome.spec  # with the tuned rates applied
    data = data_report(out, outcome)
    init_loss = outcome.limits.get("init", math.log(ladder.sweep.configs[ladder.sweep.variants[0].name]
                                                    .model.vocab_size))
    points = report.ladder_points(outcome.rows, init_loss)
    analysis = law.analyze(points, ladder.compare, n_resamples=ladder.resamples)
    cpu = report.cpu_analysis(outcome.rows, init_loss, ladder.compare, ladder.resamples)
    decisions = decide_claims(ladder.sweep.claims, outcome.rows, None, report.ENDPOINTS, init_loss=init_loss,
                              alpha=(ladder.sweep.registration or {}).get("alpha", 0.05))
    flags = (" --quick" if quick else (f" --profile {profile}" if profile else "")) + (" --draft" if draft else "")
    command = command or f"lmlab ladder {spec_arg}{flags} --out {out}"
    return report.write_report(ladder, out, outcome.rows, points, analysis, command=command,
                               wall_s=time.perf_counter() - t0, data=data, tune=outcome.tune,
                               tuning=read_csv(out / "tune.csv") if outcome.tune else None, decisions=decisions,
                               cpu=cpu)
