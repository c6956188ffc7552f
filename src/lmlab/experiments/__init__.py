"""Many runs compared: the sweep engine, statistics, the corpus, and the design's three claims.

    spec.py        a sweep spec: variants, grid, seeds, profiles (quick, gpu), tuning
    sweep/         ``lmlab sweep SPEC.yaml``: variants of a run config on an equal budget, resumable, parallel
                   (engine, workers, tuning, tables, measure, layout: see its docstring)
    stats.py       Student's t, paired tests, TOST, Holm, sign-flip, power, the compute multiplier, verdicts
    decide.py      registered claims decided: per-seed endpoints, Holm over an experiment, verdict.json
    claims.py      claims with their intervals -> verdict.json and the README's results table
    registration.py  a spec committed before its main runs: its registration commit and the changes after it
    corpus.py      the experiment corpus: the stdlib's source, deduplicated; split overlap
    report.py      tables, mean ± std, seed-band plots, report headers
    norm.py        claim 1: pre-norm vs post-norm vs DeepNorm over init, depth and warmup
    positions.py   claim 2: six position schemes at 1x-16x the training length; rope context extension
    moe.py         claim 3: dense vs Switch, GShard, DeepSeekMoE at equal active parameters; balancing
    mup.py         learning-rate transfer across width: μP against standard parametrization

An experiment is a sweep spec (``<name>.yaml`` beside its module) plus a module with its extra
measurements (sweep ``Hooks``) and ``analyze``, which splits into a pure verdict function over
result rows, plots and markdown. A report's verdicts are computed from the numbers with criteria
the report states before them; nothing is hard-coded.
``lmlab experiment norm|positions|moe [--quick | --profile gpu] --out DIR [--jobs N --threads T]`` runs one.
Main runs (not --quick) start only from a registered spec (committed, unchanged, with a registration
id; see registration.py); ``--draft`` runs anyway and the report says UNREGISTERED.

Dependencies run one way: this package imports ``lmlab.run`` and the model modules, never ``lmlab.cli``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from ..run.checkpoint.atomic import atomic_write_text
from ..run.data.meta import DataMeta
from . import claims, corpus, decide, moe, mup, norm, positions, retrieval, stats
from .ladder import law
from .registration import Registration, spec_status
from .spec import SweepSpec
from .sweep import Outcome, load_spec, sweep_outcome
from .sweep.engine import data_identity

EXPERIMENTS = {"norm": norm, "positions": positions, "moe": moe, "mup": mup}


def spec_path(name: str) -> Path:
    return Path(__file__).with_name(f"{name}.yaml")


def load_experiment_spec(name: str, *, quick: bool = False, seeds: int | None = None,
                         profile: str | None = None, spec_file: str | Path | None = None) -> SweepSpec:
    """Experiment ``name``'s spec: the shipped ``<name>.yaml``, or ``spec_file`` (a copy keeping its variant names)."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose one of {sorted(EXPERIMENTS)}")
    return load_spec(spec_file or spec_path(name), quick=quick, seeds=seeds, profile=profile)


# modules beside an experiment's own whose later commits its registration lists: moe reads its all-seeds
# multiplier on the ladder's law; positions decides its lookup gates and endpoints in retrieval.py
ANALYSED_WITH = {"moe": (law,), "positions": (retrieval,)}


def experiment_registration(name: str, *, spec_file: str | Path | None = None, quick: bool = False,
                            draft: bool = False) -> Registration:
    """The registration of experiment ``name``'s spec file (later commits to its analysis module, those in
    ANALYSED_WITH, stats.py, claims.py and decide.py listed too). Raises NotRegistered (a ValueError: exit 2),
    before anything is written, for a main run (not ``quick``) of a spec that is not registered, unless
    ``draft``."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose one of {sorted(EXPERIMENTS)}")
    related = [EXPERIMENTS[name].__file__, stats.__file__, claims.__file__, decide.__file__,
               *(m.__file__ for m in ANALYSED_WITH.get(name, ()))]
    status = dataclasses.replace(spec_status(spec_file or spec_path(name), related), draft=draft)
    status.refuse_unless(quick or draft)
    return status


def data_report(out: Path, outcome: Outcome) -> dict:
    """The corpus identity, tokenizer, split sizes and verbatim 64-byte overlap of the prepared data
    (the overlap is cached in out/overlap.json, keyed by the data's identity)."""
    meta = DataMeta.open(outcome.data_dir)
    ident = data_identity(outcome.data_dir)
    cache = out / "overlap.json"
    cached = json.loads(cache.read_text()) if cache.is_file() else {}
    if cached.get("data_identity") != ident:
        cached = {"data_identity": ident, **corpus.split_overlap(outcome.data_dir)}
        atomic_write_text(cache, json.dumps(cached, indent=1) + "\n")
    return {"corpus": outcome.corpus, "overlap": cached, "tokenizer": meta.tokenizer, "vocab_size": meta.vocab_size,
            "data_identity": ident, "val_fraction": meta.split.val_fraction}


def run_experiment(name: str, out: str | Path, *, quick: bool = False, seeds: int | None = None,
                   profile: str | None = None, command: str | None = None, log=print, jobs: int = 1,
                   threads: int | None = None, draft: bool = False, spec_file: str | Path | None = None,
                   registration: Registration | None = None) -> Path:
    """Run experiment ``name`` into ``out`` (resuming what is there) and write its report; returns report.md.
    A main run needs a registered spec unless ``draft`` (see :func:`experiment_registration`; pass its
    ``registration`` when already asked). ``spec_file`` replaces the shipped spec."""
    registration = registration or experiment_registration(name, spec_file=spec_file, quick=quick, draft=draft)
    module = EXPERIMENTS[name]
    spec = load_experiment_spec(name, quick=quick, seeds=seeds, profile=profile, spec_file=spec_file)
    spec = dataclasses.replace(spec, registration_status=registration)
    out = Path(out)
    t0 = time.perf_counter()
    outcome = sweep_outcome(spec, out, hooks=module.Hooks(spec), quiet=True, log=lambda m: log(m, flush=True),
                            jobs=jobs, threads=threads)
    data = data_report(out, outcome)
    wall = time.perf_counter() - t0
    flags = (" --quick" if quick else (f" --profile {profile}" if profile else "")) + (" --draft" if draft else "")
    flags += f" --spec {spec_file}" if spec_file else ""
    command = command or f"lmlab experiment {name}{flags} --out {out}"
    return module.analyze(outcome.spec, out, outcome.rows, command=command, wall_s=wall, data=data,
                          limits=outcome.limits, tune=outcome.tune)
