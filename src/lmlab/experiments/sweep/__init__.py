"""Sweeps: train a list of variants of one run config on an equal budget and tabulate them.

    spec = load_spec("ablation.yaml")             # the whole spec is validated before any training
    rows = run_sweep(spec, "sweeps/ablation", jobs=2, threads=1)   # results.csv, summary.md, curves
    lmlab sweep ablation.yaml --out sweeps/ablation --seeds 3 --jobs 2 --threads 1

A spec is a base run config plus variants, each a name and dotted overrides::

    name: depth
    base:                     # a run config (model:, data:, train:), read as `lmlab train --config` reads one
      model: {preset: llama, d_model: 64, n_layers: 4}   # a preset, then fields on top; data: DIR is prepared data
      train: {steps: 300}
    seeds: [0, 1, 2]          # or a count: 3. A seed sets model.init_seed AND train.seed (weights and
    seed_fields: [model.init_seed, train.seed]   #  data order); name one of them to vary only it
    quick: {train.steps: 5}   # overrides for every variant under --quick (tests, smoke runs)
    profiles:                 # other named sizes: --profile gpu
      gpu: {overrides: {model.d_model: 512}, seeds: [0, 1, 2]}
    variants:
      - {name: shallow, overrides: {model.n_layers: 2}}
      - {name: deep, overrides: {model.n_layers: 8}, profiles: {gpu: {model.n_layers: 24}}}
      - {name: deep-ft, init_from: deep, overrides: {train.steps: 50, optim.lr: 3e-4}}   # deep's final weights
      - {name: deep-common, tune: false, overrides: {model.n_layers: 8, optim.lr: 3e-3}}  # keeps its own lr
    grid:                     # optional: the product of these axes is appended to the variants
      - {axis: norm, levels: [{name: pre, overrides: {model.norm_position: pre}},
                              {name: post, overrides: {model.norm_position: post}}]}
      - {axis: depth, levels: [{name: L2, overrides: {model.n_layers: 2}}, {name: L8, overrides: {model.n_layers: 8}}]}
    tune: {field: optim.lr, values: [1e-3, 3e-3, 1e-2], by: [norm], at: {depth: L8}, seeds: [1000]}
    match_active_params: {reference: shallow, tolerance: 0.05}   # optional equal-compute check
    corpus: {name: stdlib}    # optional: train on the deduplicated stdlib corpus (experiments.corpus)
    final_eval: {tokens: 65536}   # optional: the final loss over 65,536 tokens in windows spread over validation
    baseline: shallow         # optional: the variant the summary's paired differences are against (default: the first)
    registration: {id: depth-2026-12-10, correction: holm, alpha: 0.05, amendments: []}   # optional (--register)
    claims:                   # optional: decided as an experiment's are (verdicts.py)
      - {id: depth-helps, claim: "8 layers beat 2", compare: [deep, shallow], endpoint: final_val_loss,
         claimed: lower, margin: 0.02, margin_source: "the smallest gain we would act on"}

Every key of a spec, at every level, is one the format names: an unknown key (or overrides for a
profile the spec does not have) is refused with one line naming it and where it is, never ignored.

Comparisons (``verdicts.py``): summary.md gives each variant's final loss minus the baseline's, paired by
seed, with its 95% t interval. A spec's ``claims:`` (the registered experiments' format: ``compare: [A, B]``
is A - B by seed, or [A] against 0; an arm is a variant, or grid labels selecting variants;
``endpoint`` is final_val_loss or best_over_variants; ``claimed`` lower, higher or not_higher; ``margin``
the smallest effect of interest with its ``margin_source``; optionally ``unit``, ``effect``,
``pilot_sd``, ``pilot_source``) are decided by ``decide.decide_claims``: one-sided paired t tests with
Holm's adjustment over the sweep's claims, TOST against each margin for a tie, the sign-flip p, the
power for each claim's effect, and a verdict, in summary.md, verdict.json and on the console.
``lmlab sweep --register`` refuses a spec that is not registered (committed, unchanged, with a
``registration: id``), as ``lmlab experiment`` does; every sweep records what git says in sweep.json.

Tuning (``tune:``, optional): for each group (``by: variant``, the default: each variant; or the
levels of grid axes, ``by: [norm]``), its first variant at the levels ``at`` trains once per value in
``values`` with seeds ``seeds`` (default [1000]) and ``overrides`` on top (e.g. fewer steps); the value
with the lowest mean final loss (a diverged seed counts as +inf) is then set for every variant of
the group. Fields::

    tune:
      field: optim.lr              # any dotted run-config field
      values: [1.5e-3, 3e-3, 6e-3]
      by: variant                  # or a list of grid axes
      at: {}                       # grid levels the tuning runs train at (by: axes only)
      seeds: [1000, 1001]          # at least 2 where a verdict rests on the arms (tuning.tune_problems)
      overrides: {}                # applied to the tuning runs only
      full_length: true            # declares overrides leave the run's length alone: train.steps,
                                   #   train.batch_size, train.grad_accum, train.seq_len, model.max_seq_len
      extend_factor: 2             # default: the values' ratio when log-uniform (1.5e-3, 3e-3, 6e-3: 2), else 2
      max_extensions: 3            # default 3; 0 never extends

A group whose best value is the smallest or largest it tried (a grid of positive numbers) trains
the next value beyond that edge (edge × factor, or edge / factor), again until its best is interior
or it has ``max_extensions`` new values; a new value that diverged (in any seed) leaves the edge
interior in effect, and the search stops. Every variant but a fine-tune (``init_from``) takes its
group's value, unless it says ``tune: false``: it then keeps the value its own ``overrides`` set
(required), e.g. a pair of arms at one common rate beside the tuned ones. A profile's ``tune:``
changes some of these fields, or turns tuning off (``tune: null``).

Grid axis extension (``extend:`` on one grid axis, optional): when an axis's levels are values of
one field (say ``optim.lr``, every seed trains every level), the sweep, after its runs, groups the
variants by the levels of the ``by`` axes; a group whose best level (lowest mean final loss over its
runs, a diverged run counting as +inf) is the axis's smallest or largest value gets a new level one
``factor`` beyond it, trained for that group only (every seed, every level of the other axes), and
again up to ``max`` new levels. A new level is named <axis><value> (``lr0.008``), and its rows carry
it as their label of the axis::

    grid:
      - {axis: arch, levels: [{name: pre, overrides: {model.norm_position: pre}}, ...]}
      - axis: lr
        levels: [{name: lr1e-3, overrides: {optim.lr: 1.0e-3}}, {name: lr2e-3, overrides: {optim.lr: 2.0e-3}}]
        extend: {by: [arch], factor: 2, max: 3}   # factor: default the levels' ratio when log-uniform,
                                                   #   else 2; max: default 3; field: optim.lr when ambiguous

Equal budget: every variant trains on the same tokens (train.steps x batch x seq_len from the
base) unless its overrides say otherwise, and the table reports total and active parameters and
training FLOPs per token for each, so a comparison at unequal compute is visible.

Out directory::

    corpus/                   the experiment corpus, when the spec names one
    data/                     prepared once, shared by every variant (none with data: DIR, read where it is)
    runs/<variant>/seed<s>/   each a normal run directory (config.yaml, metrics.jsonl, checkpoints/)
                   .../start.json    the config hash and git revision the run started from
                   .../result.json   written atomically when the run is finished: its row
                   .../curve.jsonl   the validation loss curve the plots draw
    locks/                    one lock file per run: a run is trained by one process at a time
    tune.csv, tune.json       the tuning runs; per group the values tried in order, why each extension
                              happened, where the search stopped, and the value chosen (with tune:)
    extend.json               a grid axis's extension: each level's value, per group the levels tried,
                              why each was added, the best level and where the search stopped
    results.csv               one row per variant x seed
    summary.md                mean ± std over seeds per variant (and whether the spec was committed), the
                              paired differences against the baseline, and the claims' verdicts
    verdict.json              the claims decided (decide.py's schema), when the spec has claims:
    sweep.json                the spec file, whether it was committed and at which revision (registration)
    loss_curves.png           validation loss against training tokens, mean and ±1 std band over seeds

Resuming and reuse: run the same command again. A finished run is reused only if its resolved
config (seed, data and the run it starts from included) hashes the same; a changed spec reruns
the runs it changed and says which field changed. A half-finished run continues from its latest
checkpoint. With ``jobs`` > 1, worker processes claim runs through lock files (``fcntl.flock``,
released if a worker dies), so two workers, or two invocations, never train the same run; each
run's numbers do not depend on which worker trained it.

Labels: a run *diverged* if its loss or gradient went non-finite or its final loss is above
``diverged_above`` (default: ln(vocab), the loss of the untrained uniform prediction); a run
whose final loss is at or above the unigram loss (predicting token frequencies only) is labelled
*no better than unigram*: it trained, but learned nothing about context.

Modules, one concern each::

    spec.py (..)   the spec: variants, grid, seeds, profiles, tuning; every config built as `train --config` builds it
    engine.py      shared inputs (corpus, data, limits), each run's config and hash, training or reusing one run
    workers.py     one process or ``jobs`` worker processes claiming runs through lock files
    tuning.py      the tuning stage before the main runs, extended past a grid edge; the rules a verdict's arms meet
    extend.py      a grid axis extended past its edge after the sweep's runs
    tables.py      results.csv, summary.md, loss curves
    verdicts.py    paired differences against the baseline, the spec's claims decided, --register
    measure.py     the final loss over a spread slice, the unigram loss, a run's label
    layout.py      where each run lives, and the files a sweep adds to it (start.json, result.json, curve.jsonl)
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Callable

from ...run.parallel.group import resolve_device
from ...run.trainer import Trainer, check_training_memory
from ...schema import read_yaml
from ..registration import spec_status
from ..spec import SweepSpec, parse_spec, seed_range
from .engine import Hooks, SweepInterrupted, setup
from .extend import extend_axis, only
from .layout import check_out, clean_temporaries, write_sweep_record
from .tables import plot_loss_curves, write_tables
from .tuning import tune_and_apply
from .verdicts import check_claims, compare_variants, sweep_registration, write_verdict
from .workers import SweepFailed, check_parallel, execute

__all__ = ["Hooks", "Outcome", "SweepFailed", "SweepInterrupted", "check_claims", "check_parallel", "load_spec",
           "run_sweep", "sweep_outcome", "sweep_registration"]


def load_spec(
    path: str | Path, *, quick: bool = False, seeds: int | None = None, profile: str | None = None,
) -> SweepSpec:
    """Read, parse and fully validate a spec file (every variant's config is built)."""
    if quick and profile not in (None, "quick"):
        raise ValueError(f"--quick and --profile {profile} exclude each other; --quick is --profile quick")
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"sweep spec {str(p)!r} does not exist")
    data = read_yaml(p, f"sweep spec {str(p)!r}")  # duplicate keys refused, naming key and lines
    spec = parse_spec(data, str(p))
    if seeds is not None:
        spec.seeds = seed_range(seeds, "--seeds")
        for prof in spec.profiles.values():
            prof.pop("seeds", None)
    return spec.resolve(quick=quick, profile=profile)


@dataclasses.dataclass
class Outcome:
    """What a finished sweep hands to an experiment's analysis."""

    spec: SweepSpec  # resolved, with tuned values applied and the corpus as data source
    rows: list[dict[str, Any]]
    limits: dict[str, float]  # the first data dir's {"unigram", "init"}
    data_dir: Path
    corpus: dict | None  # corpus.json, when the spec names a corpus
    tune: dict | None  # tune.json, when the spec tunes
    extend: dict | None = None  # extend.json, when a grid axis extends past its edge


def run_sweep(
    spec: SweepSpec, out: str | Path, *, hooks: Hooks | None = None, quiet: bool = True,
    trainer_cls: Any = None, log: Callable[[str], None] = print, jobs: int = 1, threads: int | None = None,
) -> list[dict[str, Any]]:
    """Train every variant x seed of a resolved ``spec`` in ``out`` (resuming and reusing what is
    there; after a tuning sweep when the spec has ``tune``), then write results.csv, summary.md (with
    each variant's paired difference against the baseline and the spec's claims decided: ``verdicts``),
    verdict.json when the spec has claims, and loss_curves.png; the comparisons are also logged. Returns
    the rows. ``jobs`` worker processes with ``threads`` torch threads each."""
    check_claims(spec)  # before any run: a claim the sweep cannot decide is refused, never ignored
    if spec.registration_status is None:
        spec = dataclasses.replace(spec, registration_status=sweep_registration(spec.source))
    return sweep_outcome(spec, out, hooks=hooks, quiet=quiet, trainer_cls=trainer_cls, log=log, jobs=jobs,
                         threads=threads, comparisons=True).rows


def sweep_outcome(
    spec: SweepSpec, out: str | Path, *, hooks: Hooks | None = None, quiet: bool = True,
    trainer_cls: Any = None, log: Callable[[str], None] = print, jobs: int = 1, threads: int | None = None,
    comparisons: bool = False,
) -> Outcome:
    """:func:`run_sweep`, returning everything the analysis needs (see :class:`Outcome`). An experiment's
    analysis decides its own claims: ``comparisons`` (the paired differences and the spec's claims in
    summary.md, and verdict.json) is :func:`run_sweep`'s, for a user's sweep."""
    check_parallel(jobs, threads)
    if not spec.configs:
        spec = spec.resolve(profile=spec.profile)
    out = Path(out)
    check_out(out)  # before anything is written: never into a run directory or someone else's files
    for cfg in spec.configs.values():  # before the shared data is prepared: a refused size leaves nothing behind
        check_training_memory(cfg, resolve_device(cfg.train.device))
    if spec.tune is not None:  # the tuning runs' configs (tune.overrides) are built, and refused, here too
        for cfg in spec.tune_spec().configs.values():
            check_training_memory(cfg, resolve_device(cfg.train.device))
    out.mkdir(parents=True, exist_ok=True)
    clean_temporaries(out)  # what a killed sweep left mid-write (the caller holds out's lock)
    status = spec.registration_status or spec_status(spec.source)
    spec = dataclasses.replace(spec, registration_status=status)
    write_sweep_record(out, {"spec": spec.source, "registration": status.to_json()})
    trainer_cls, hooks = trainer_cls or Trainer, hooks or Hooks()
    tune = None
    if spec.tune is not None:
        spec, tune = tune_and_apply(spec, out, trainer_cls, quiet, log, jobs, threads)
    sw, corpus_meta = setup(spec, out, hooks, trainer_cls, quiet, log)
    rows = execute(sw, jobs, threads, log)
    extended = None
    if spec.axis_extend is not None:  # new levels beyond an edge, trained after the spec's own
        def run(s: SweepSpec, names: list[str]) -> list[dict[str, Any]]:
            return execute(only(setup(s, out, hooks, trainer_cls, quiet, log)[0], names), jobs, threads, log)

        spec, rows, extended = extend_axis(spec, rows, out, run, log)
        sw, corpus_meta = setup(spec, out, hooks, trainer_cls, quiet, log)
    first = sw.data_dirs[sw.spec.variants[0].name]
    found = compare_variants(sw.spec, rows, sw.limits[str(first)]["init"]) if comparisons else None
    write_tables(sw.spec, rows, out, found.markdown if found else "")
    if found:
        write_verdict(out, sw.spec, found.decisions)
        log(found.console.rstrip())
    with contextlib.suppress(ImportError):
        plot_loss_curves(sw.spec, out, out / "loss_curves.png")
    return Outcome(sw.spec, rows, sw.limits[str(first)], first, corpus_meta, tune, extended)
