"""A sweep spec: a base run config, its variants, the seeds, and how the sweep is sized and tuned.

Parsed from YAML by ``sweep.load_spec``; see ``sweep``'s docstring for the format. Everything is
validated here, before any training: a bad override names the spec, the variant and the field.

    spec = parse_spec(yaml_data, "norm.yaml").resolve(profile="quick")
    spec.configs["post-L24"]          # the RunConfig of one variant (before its seed is applied)
    spec.seed_config("post-L24", 3)    # ... with seed 3: model.init_seed and train.seed both 3
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from pathlib import Path
from typing import Any, Collection, Mapping

import torch

from ..model import Transformer
from ..run.config import RunConfig, build_config, config_changes, upgrade_keys
from ..run.errors import one_line
from ..schema import suggest
from .claims import ClaimSpec, parse_claims
from .registration import AMENDMENT_KEYS, check_block

SEED_FIELDS = ("model.init_seed", "train.seed")  # what a sweep seed sets; a spec may name a subset
SPEC_KEYS = ("name", "description", "base", "variants", "grid", "seeds", "seed_fields", "quick", "profiles",
             "diverged_above", "match_active_params", "corpus", "final_eval", "tune", "registration", "claims",
             "baseline")
VARIANT_KEYS = ("name", "overrides", "init_from", "quick", "profiles", "seeds", "tune")
PROFILE_KEYS = ("overrides", "seeds", "corpus", "final_eval", "tune")
TUNE_KEYS = ("field", "values", "by", "at", "seeds", "overrides", "extend_factor", "max_extensions", "full_length")
# what sets a run's length: a tuning run that changes one is shorter (or longer) than the run it tunes
LENGTH_FIELDS = ("train.steps", "train.batch_size", "train.grad_accum", "train.seq_len", "model.max_seq_len")
AXIS_KEYS = ("axis", "levels", "extend")
EXTEND_KEYS = ("by", "factor", "max", "field")
CORPUS_KEYS = ("name", "max_bytes")
FINAL_EVAL_KEYS = ("tokens", "batch_size")
MATCH_KEYS = ("reference", "tolerance")
MAX_SEEDS = 10_000  # one run per seed and variant: more than this is a typo, and listing them would exhaust memory


def seed_range(count: int, name: str) -> list[int]:
    """Seeds 0 .. count-1, the count (given as ``name``) checked by arithmetic before any list is built."""
    if count < 1 or count > MAX_SEEDS:
        raise ValueError(f"{name}={count} is not valid; give a count from 1 to {MAX_SEEDS:,} "
                         "(each seed trains one run per variant)")
    return list(range(count))


# ============================================================== the parts
@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    overrides: dict[str, Any]  # dotted RunConfig fields, applied to the base
    init_from: str | None = None  # start from this earlier variant's final weights (same seed)
    quick: dict[str, Any] = dataclasses.field(default_factory=dict)  # extra overrides under the quick profile
    labels: dict[str, str] = dataclasses.field(default_factory=dict)  # grid axis -> level, for analysis
    profiles: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # profile -> extra overrides
    max_seeds: int | None = None  # train only the first N of the sweep's seeds (arms no verdict rests on)
    tune: bool | str = True  # False: exempt (its own value stands); a variant's name: that variant's tuned value

    def profile_overrides(self, profile: str | None) -> dict[str, Any]:
        if profile is None:
            return {}
        return {**(self.quick if profile == "quick" else {}), **self.profiles.get(profile, {})}


@dataclasses.dataclass(frozen=True)
class Tune:
    """A hyperparameter chosen per group of variants from a short sweep before the main runs.

    For each group (the levels of the grid axes in ``by``, or each variant when ``by`` is
    ["variant"]), the group's variant at the labels ``at`` is trained once per value in ``values``
    (seeds ``seeds``, plus ``overrides``, e.g. fewer steps); the value with the lowest mean final
    validation loss (a diverged seed counts as infinite) is then used by every variant of the group,
    except a variant marked ``tune: false``, which keeps its own value.

    A group whose best value is the smallest or largest of a numeric grid is trained at the next value
    beyond that edge (``sweep.tuning``), up to ``max_extensions`` times. ``full_length`` declares that
    the tuning runs are as long as the main runs: ``overrides`` may then not change LENGTH_FIELDS."""

    field: str
    values: list[Any]
    by: list[str]
    at: dict[str, str]
    seeds: list[int]
    overrides: dict[str, Any]
    extend_factor: float | None = None  # None: the grid's ratio when its values are log-uniform, else 2
    max_extensions: int = 3  # values added beyond an edge, per group
    full_length: bool = False

    def group(self, variant: Variant) -> str:
        return variant.name if self.by == ["variant"] else "-".join(variant.labels[a] for a in self.by)


@dataclasses.dataclass(frozen=True)
class AxisExtend:
    """A grid axis that grows past its edge (``extend:`` on the axis): after the sweep's runs, each
    group of the ``by`` axes whose best level (lowest mean final loss over its runs, a diverged run
    counting as infinite) is the axis's smallest or largest value gets a new level one ``factor``
    beyond it, trained for that group only (every seed), up to ``max`` times (``sweep.extend``)."""

    axis: str
    field: str  # the dotted field the axis's levels set
    levels: dict[str, Any]  # the spec's levels: name -> value of ``field``
    by: list[str]
    factor: float | None  # None: the levels' ratio when log-uniform, else 2
    max: int


@dataclasses.dataclass
class SweepSpec:
    name: str
    base: dict[str, Any]  # the base config's dotted changes (config_changes: model.preset, data.prepared included)
    variants: list[Variant]
    seeds: list[int]
    quick: dict[
        str, Any
    ]  # base overrides of the quick profile (kept for older specs; == profiles["quick"]["overrides"])
    diverged_above: float | str = "init"  # a final val loss above this counts as diverged; "init" = ln(vocab)
    match_active_params: dict[str, Any] | None = None
    description: str = ""
    registration: dict[str, Any] | None = None  # id, correction, alpha, amendments (experiments/registration.py)
    registration_status: Any = None  # the spec file's Registration, set by the command that runs it
    source: str = "<spec>"
    configs: dict[str, Any] = dataclasses.field(default_factory=dict)  # variant -> RunConfig, filled by resolve()
    is_quick: bool = False
    profiles: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    seed_fields: tuple[str, ...] = SEED_FIELDS
    corpus: dict[str, Any] | None = None  # build the stdlib corpus (experiments.corpus) and train on it
    final_eval: dict[str, Any] | None = None  # {tokens: N}: the final loss over N tokens in windows spread over val
    tune: Tune | None = None
    profile: str | None = None
    tuned: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # variant -> tuned overrides
    axis_extend: AxisExtend | None = None  # a grid axis that grows past its edge (sweep.extend)
    claims: list[ClaimSpec] = dataclasses.field(default_factory=list)  # registered before the runs (claims.py)
    baseline: str | None = None  # the variant a sweep's summary compares every other with (None: the first)

    def variant(self, name: str) -> Variant:
        return next(v for v in self.variants if v.name == name)

    def seeds_of(self, variant: Variant) -> list[int]:
        """The seeds ``variant`` trains: the sweep's, or their first ``max_seeds``."""
        return self.seeds[: variant.max_seeds] if variant.max_seeds else list(self.seeds)

    def tasks(self) -> list[tuple[str, int]]:
        """Every (variant, seed) run, in spec order."""
        return [(v.name, s) for v in self.variants for s in self.seeds_of(v)]

    def resolve(self, *, quick: bool = False, profile: str | None = None) -> "SweepSpec":
        """Apply ``profile`` (``quick=True`` means "quick"), then build and validate every variant's
        RunConfig (and the equal-compute check) before any training. A bad override raises one line
        naming the spec, the variant and the field. Returns the resolved spec (a new object)."""
        profile = profile or ("quick" if quick else None)
        if profile is not None and profile not in self.profiles:
            raise ValueError(f"{self.source}: no profile {profile!r}; this spec has {sorted(self.profiles) or 'none'}")
        p = self.profiles.get(profile, {}) if profile else {}
        spec = dataclasses.replace(
            self, profile=profile, is_quick=profile == "quick", configs={}, seeds=list(p.get("seeds", self.seeds)),
            corpus={**(self.corpus or {}), **p["corpus"]} if self.corpus and p.get("corpus") else self.corpus,
            final_eval={**(self.final_eval or {}), **p.get("final_eval", {})} if self.final_eval else None,
            tune=None if "tune" in p and p["tune"] is None else _tune_for(self.tune, p.get("tune")),
        )
        base = {**self.base, **p.get("overrides", {})}
        try:
            build_config(base)  # alone first, so that a bad base field is named as the base's
        except ValueError as e:
            raise ValueError(f"{self.source}: base config: {one_line(e)}") from None
        for v in spec.variants:
            try:
                changes = {**base, **v.overrides, **v.profile_overrides(profile), **spec.tuned.get(v.name, {})}
                if v.init_from is not None and changes.get("train.init_from") is not None:
                    raise ValueError(f"init_from={v.init_from!r} and train.init_from={changes['train.init_from']!r} "
                                     "both choose its starting weights; give one")
                spec.configs[v.name] = build_config(changes)  # as `lmlab train --config` builds it
            except ValueError as e:
                raise ValueError(f"{self.source}: variant {v.name!r}: {one_line(e)}") from None
        if spec.corpus and any(c.data.prepared is not None for c in spec.configs.values()):
            raise ValueError(f"{self.source}: corpus: and data.prepared both choose the training data; give one")
        if spec.match_active_params:
            check_active_params(spec)
        return spec

    def seed_config(self, name: str, seed: int) -> RunConfig:
        """The RunConfig of variant ``name`` trained with sweep seed ``seed`` (sets ``seed_fields``)."""
        return self.configs[name].override({f: seed for f in self.seed_fields})

    def with_tuned(self, choices: Mapping[str, Any]) -> "SweepSpec":
        """The spec with the tuned value of each variant's group applied (resolved again); a variant
        with ``tune: false`` keeps its own value of the field."""
        source = {v.name: (self.variant(v.tune) if isinstance(v.tune, str) else v) for v in self.variants
                  if v.init_from is None and v.tune}
        tuned = {name: {self.tune.field: choices[self.tune.group(v)]} for name, v in source.items()
                 if self.tune.group(v) in choices}
        return dataclasses.replace(self, tuned=tuned).resolve(profile=self.profile)

    def tune_groups(self) -> dict[str, Variant]:
        """Each tuned group and the variant its tuning runs train: its first variant at ``tune.at``
        (fine-tunes and ``tune: false`` variants are never tuned)."""
        t, groups = self.tune, {}
        for v in self.variants:
            if v.init_from is None and v.tune is True and all(v.labels.get(k) == level for k, level in t.at.items()):
                groups.setdefault(t.group(v), v)
        if not groups:
            raise ValueError(f"{self.source}: tune.at={t.at} matches no variant; name grid levels that exist")
        return groups

    def tune_spec(self, values: Mapping[str, list] | None = None) -> "SweepSpec":
        """The tuning sweep: for each group, its representative variant at every value (``values``:
        group -> the values to train, by default ``tune.values`` for every group)."""
        t = self.tune
        variants, groups = [], self.tune_groups()
        short = t.field.rsplit(".", 1)[-1]
        for g, v in groups.items():
            for value in (t.values if values is None else values.get(g, [])):
                variants.append(
                    Variant(
                        f"tune-{g}-{short}{value:g}" if isinstance(value, float) else f"tune-{g}-{short}{value}",
                        {**v.overrides, t.field: value, **t.overrides},
                        None,
                        v.quick,
                        {**v.labels, "tune_group": g, "tune_value": str(value)},
                        v.profiles,
                    )
                )
        spec = dataclasses.replace(self, name=f"{self.name}-tune", variants=variants, tune=None, tuned={},
                                   match_active_params=None, configs={}).resolve(profile=self.profile)
        spec.seeds = list(t.seeds)  # after resolve, which would apply the profile's seeds
        return spec


def _tune_for(tune: Tune | None, change: Mapping[str, Any] | None) -> Tune | None:
    if tune is None or not change:
        return tune
    return _checked_tune(dataclasses.replace(
        tune, **{k: (dict(tune.overrides, **v) if k == "overrides" else v) for k, v in change.items()}
    ), "profile tune")


def _positive_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _checked_tune(t: Tune, where: str) -> Tune:
    """``t`` when its extension and length settings are valid; else a one-line ValueError."""
    if t.extend_factor is not None and not (_positive_number(t.extend_factor) and t.extend_factor > 1):
        raise ValueError(f"{where}: extend_factor={t.extend_factor!r} is not valid; give a number above 1 "
                         "(2: the value beyond an edge is twice the largest or half the smallest)")
    if not isinstance(t.max_extensions, int) or isinstance(t.max_extensions, bool) or t.max_extensions < 0:
        raise ValueError(f"{where}: max_extensions={t.max_extensions!r} is not valid; give how many values may be "
                         "added beyond an edge of the grid, e.g. 3 (0: never)")
    if not isinstance(t.full_length, bool):
        raise ValueError(f"{where}: full_length={t.full_length!r} is not valid; give true or false")
    shorter = [k for k in t.overrides if k in LENGTH_FIELDS]
    if t.full_length and shorter:
        raise ValueError(f"{where}: full_length is true but overrides sets {shorter[0]}; drop it (the tuning runs "
                         "must be as long as the main runs) or set full_length: false")
    return t


# ============================================================== parsing
def _changes(data: Any, where: str) -> dict[str, Any]:
    """Dotted RunConfig changes from a spec's mapping (``base:``, a variant's ``overrides:``, a profile's),
    read as ``lmlab train --config`` reads a config file (``run.config.config_changes``)."""
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a mapping of dotted fields to values, e.g. {{model.n_layers: 6}}")
    return config_changes(data, where)


def _check_keys(raw: Mapping, allowed: tuple[str, ...], where: str) -> None:
    unknown = [k for k in raw if k not in allowed]
    if unknown:
        raise ValueError(
            f"{where}: unknown key {unknown[0]!r}{suggest(str(unknown[0]), allowed)}; valid keys: {', '.join(allowed)}"
        )


def _variant(raw: Any, where: str, profile_names: Collection[str] | None = None) -> Variant:
    """A variant (or a grid level) from its mapping; ``profile_names``, when given, are the spec's
    profiles, which its ``profiles:`` and ``quick:`` must name (overrides for a profile the spec does not
    have would never apply)."""
    if not isinstance(raw, Mapping) or "name" not in raw:
        raise ValueError(
            f"{where} must be a mapping with a name, e.g. {{name: deep, overrides: {{model.n_layers: 8}}}}"
        )
    _check_keys(raw, VARIANT_KEYS, f"{where} ({raw['name']!r})")
    name = str(raw["name"])
    if not name or any(c in name for c in "/\\ ") or name.startswith("."):
        raise ValueError(
            f"{where}: variant name {name!r} must be non-empty, without spaces or slashes (it names a directory)"
        )
    profiles = raw.get("profiles") or {}
    if not isinstance(profiles, Mapping):
        raise ValueError(
            f"{where} ({name!r}): profiles must map a profile name to overrides, e.g. {{gpu: {{train.steps: 2000}}}}"
        )
    if profile_names is not None:
        unknown = [k for k in [*profiles, *(["quick"] if raw.get("quick") else [])] if str(k) not in profile_names]
        if unknown:
            raise ValueError(f"{where} ({name!r}): overrides for profile {unknown[0]!r}, which the spec does not "
                             f"have (its profiles: {', '.join(sorted(profile_names)) or 'none'}); add the profile "
                             "or drop them")
    max_seeds = raw.get("seeds")
    if max_seeds is not None and (not isinstance(max_seeds, int) or isinstance(max_seeds, bool) or max_seeds < 1):
        raise ValueError(
            f"{where} ({name!r}): seeds={max_seeds!r} is not valid; "
            "give how many of the sweep's seeds it trains, e.g. 3"
        )
    if not isinstance(raw.get("tune", True), (bool, str)) or raw.get("tune") in ("", True):
        raise ValueError(f"{where} ({name!r}): tune={raw['tune']!r} is not valid; give false to exempt it from the "
                         "tuned value (it then sets the tuned field itself), another variant's name to train at "
                         "that variant's tuned value, or leave it out")
    return Variant(name, _changes(raw.get("overrides"), f"variant {name!r} overrides"), raw.get("init_from"),
                   _changes(raw.get("quick"), f"variant {name!r} quick"), {},
                   {str(k): _changes(v, f"variant {name!r} profile {k!r}") for k, v in profiles.items()}, max_seeds,
                   raw.get("tune", True))


def _sweep_name(name: Any, source: str) -> str:
    """The spec's name, which names its directory under sweeps/: one plain path component."""
    name = str(name)
    if name in (".", "..") or any(c in name for c in "/\\\0") or name != name.strip():
        raise ValueError(f"{source}: sweep name {name!r} is not valid; give a plain name without slashes "
                         "(it names the directory sweeps/NAME)")
    return name


def _grid(grid: Any, source: str, profile_names: Collection[str]) -> list[Variant]:
    if not isinstance(grid, list) or not all(isinstance(axis, Mapping) and "levels" in axis for axis in grid):
        raise ValueError(
            f"{source}: grid must be a list of axes, each {{axis: NAME, levels: [{{name:, overrides:}}, ...]}}"
        )
    for i, a in enumerate(grid):
        _check_keys(a, AXIS_KEYS, f"{source}: grid[{i}]")
    axes = [
        (
            str(a.get("axis", f"axis{i}")),
            [_variant(v, f"{source}: grid[{i}].levels[{j}]", profile_names) for j, v in enumerate(a["levels"])],
        )
        for i, a in enumerate(grid)
    ]
    variants = []
    for combo in itertools.product(*(levels for _, levels in axes)):
        overrides: dict[str, Any] = {}
        quick: dict[str, Any] = {}
        profiles: dict[str, dict[str, Any]] = {}
        for level in combo:
            overrides.update(level.overrides)
            quick.update(level.quick)
            for k, v in level.profiles.items():
                profiles.setdefault(k, {}).update(v)
        labels = {axis: level.name for (axis, _), level in zip(axes, combo)}
        variants.append(Variant("-".join(level.name for level in combo), overrides, None, quick, labels, profiles,
                                tune=all(level.tune for level in combo)))
    return variants


def _seeds(seeds: Any, where: str) -> list[int]:
    if isinstance(seeds, int) and not isinstance(seeds, bool):
        seeds = seed_range(seeds, f"{where}: seeds")
    integers = isinstance(seeds, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
    if not integers or not seeds:
        raise ValueError(f"{where}: seeds={seeds!r} is not valid; give a count (3) or a list of integers ([0, 1, 2])")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"{where}: seeds={seeds!r} repeats a seed; each seed names one run")
    return seeds


def _profiles(data: Mapping, source: str) -> dict[str, dict[str, Any]]:
    raw = data.get("profiles") or {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"{source}: profiles must map a name to {{overrides:, seeds:, corpus:, final_eval:, tune:}}")
    out: dict[str, dict[str, Any]] = {}
    for name, p in raw.items():
        if not isinstance(p, Mapping):
            raise ValueError(f"{source}: profile {name!r} must be a mapping with some of {', '.join(PROFILE_KEYS)}")
        _check_keys(p, PROFILE_KEYS, f"{source}: profile {name!r}")
        prof = {**p, "overrides": _changes(p.get("overrides"), f"profile {name!r} overrides")}
        for key, keys in (("corpus", CORPUS_KEYS), ("final_eval", FINAL_EVAL_KEYS)):
            if p.get(key) is not None:
                if not isinstance(p[key], Mapping):
                    raise ValueError(f"{source}: profile {name!r} {key} must be a mapping of {', '.join(keys)}")
                if data.get(key) is None:
                    raise ValueError(f"{source}: profile {name!r} changes {key}:, which the spec does not have; "
                                     f"give the spec a {key}: or drop it from the profile")
                _check_keys(p[key], keys, f"{source}: profile {name!r} {key}")
        if "seeds" in p:
            prof["seeds"] = _seeds(p["seeds"], f"{source}: profile {name!r}")
        if p.get("tune") is not None:  # tune: null turns tuning off under this profile
            if data.get("tune") is None:
                raise ValueError(f"{source}: profile {name!r} changes tune:, which the spec does not have; give the "
                                 "spec a tune: or drop it from the profile")
            if not isinstance(p["tune"], Mapping):
                raise ValueError(f"{source}: profile {name!r} tune must be a mapping of tune fields to change, or null")
            _check_keys(p["tune"], TUNE_KEYS, f"{source}: profile {name!r} tune")
            prof["tune"] = {k: (_changes(v, "tune overrides") if k == "overrides" else v) for k, v in p["tune"].items()}
        out[str(name)] = prof
    if "quick" in data or "quick" in out:
        out["quick"] = {**out.get("quick", {}), "overrides": {**_changes(data.get("quick"), "quick"),
                                                              **out.get("quick", {}).get("overrides", {})}}
    return out


def _tune(raw: Any, source: str) -> Tune | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or "field" not in raw or not raw.get("values"):
        raise ValueError(f"{source}: tune needs field: (e.g. optim.lr) and values: [3e-3, 1e-2, 3e-2]")
    _check_keys(raw, TUNE_KEYS, f"{source}: tune")
    by = raw.get("by", ["variant"])
    by = [by] if isinstance(by, str) else list(by)
    at = raw.get("at") or {}
    if not isinstance(at, Mapping):
        raise ValueError(f"{source}: tune.at must map grid axes to levels, e.g. {{depth: L12}}")
    field = next(iter(upgrade_keys({str(raw["field"]): None}, f"{source}: tune field")))
    return _checked_tune(Tune(
        field, list(raw["values"]), by, {str(k): str(v) for k, v in at.items()},
        _seeds(raw.get("seeds", [1000]), f"{source}: tune"), _changes(raw.get("overrides"), "tune overrides"),
        raw.get("extend_factor"), raw.get("max_extensions", 3), raw.get("full_length", False),
    ), f"{source}: tune")


def _check_tuned_variants(tune: Tune, variants: list[Variant], source: str) -> None:
    """Every tuned variant has the ``by`` axes; every ``tune: false`` variant sets the tuned field itself;
    a variant that takes another's value names a tuned variant."""
    names = {v.name: v for v in variants}
    for v in variants:
        if isinstance(v.tune, str) and (names.get(v.tune) is None or names[v.tune].tune is not True
                                        or names[v.tune].init_from is not None):
            raise ValueError(f"{source}: variant {v.name!r} has tune: {v.tune!r}, which is not a tuned variant of the "
                             f"spec; name one of {[n for n, w in names.items() if w.tune is True and not w.init_from]}")
        if not v.tune and tune.field not in v.overrides:
            raise ValueError(f"{source}: variant {v.name!r} has tune: false but does not set {tune.field}; give it "
                             f"overrides: {{{tune.field}: VALUE}} (the common value it trains at)")
    if tune.by != ["variant"]:
        tuned = [v for v in variants if v.init_from is None and v.tune is True]
        missing = [a for a in tune.by + list(tune.at) if not all(a in v.labels for v in tuned)]
        if missing:
            raise ValueError(f"{source}: tune names axis {missing[0]!r}, which is not a grid axis of every variant")


def _extended_field(levels: list[Variant], given: Any, where: str) -> str:
    """The field an extending axis's levels set: ``given``, or the one field every level sets to a
    different positive number."""
    if given is not None:
        field = next(iter(upgrade_keys({str(given): None}, where)))
    else:
        common = set.intersection(*(set(level.overrides) for level in levels))
        numeric = [f for f in sorted(common) if all(_positive_number(lv.overrides[f]) for lv in levels)
                   and len({lv.overrides[f] for lv in levels}) == len(levels)]
        if len(numeric) != 1:
            raise ValueError(f"{where}: cannot tell which field the levels set ({numeric or 'none'} set a different "
                             "positive number per level); give extend: {field: optim.lr, ...}")
        field = numeric[0]
    bad = next((lv for lv in levels if not _positive_number(lv.overrides.get(field))), None)
    if bad is not None:
        raise ValueError(f"{where}: level {bad.name!r} sets {field}={bad.overrides.get(field)!r}; every level of an "
                         "extending axis sets it to a positive number")
    return field


def _axis_extend(grid: Any, source: str, tune: Tune | None) -> AxisExtend | None:
    """The grid axis that declares ``extend: {by:, factor:, max:}`` (at most one), checked."""
    found = [(i, a) for i, a in enumerate(grid or []) if a.get("extend") is not None]
    if len(found) > 1:
        raise ValueError(f"{source}: grid axes {found[0][0]} and {found[1][0]} both declare extend:; "
                         "give it to one axis")
    if not found:
        return None
    i, raw = found[0]
    where, ext = f"{source}: grid[{i}].extend", raw["extend"]
    if not isinstance(ext, Mapping):
        raise ValueError(f"{where} must be a mapping, e.g. {{by: [arch], factor: 2, max: 3}}")
    _check_keys(ext, EXTEND_KEYS, where)
    axis, axes = str(raw.get("axis", f"axis{i}")), [str(a.get("axis", f"axis{j}")) for j, a in enumerate(grid)]
    by = ext.get("by") or []
    by = [by] if isinstance(by, str) else [str(b) for b in by]
    if bad := [b for b in by if b not in axes or b == axis]:
        raise ValueError(f"{where}: by names {bad[0]!r}, which is not another grid axis; "
                         f"choose from {[a for a in axes if a != axis]}")
    levels = [_variant(v, f"{source}: grid[{i}].levels[{j}]") for j, v in enumerate(raw["levels"])]
    field = _extended_field(levels, ext.get("field"), where)
    factor, most = ext.get("factor"), ext.get("max", 3)
    if factor is not None and not (_positive_number(factor) and factor > 1):
        raise ValueError(f"{where}: factor={factor!r} is not valid; give a number above 1, e.g. 2")
    if not isinstance(most, int) or isinstance(most, bool) or most < 0:
        raise ValueError(f"{where}: max={most!r} is not valid; give how many levels may be added per group, e.g. 3")
    if tune is not None and tune.field == field:
        raise ValueError(f"{where}: the axis sets {field}, which tune: also chooses; give one of them")
    return AxisExtend(axis, field, {lv.name: lv.overrides[field] for lv in levels}, by, factor, most)


def _options(data: Mapping, source: str, names: list[str]) -> dict[str, Any]:
    """The spec's scalar options, each checked."""
    diverged_above = data.get("diverged_above", "init")
    if diverged_above == "unigram":  # older specs: that label is now separate ("no better than unigram")
        diverged_above = "init"
    if diverged_above != "init" and (not isinstance(diverged_above, (int, float)) or isinstance(diverged_above, bool)):
        raise ValueError(
            f"{source}: diverged_above={diverged_above!r} is not valid; give a loss in nats or 'init' (ln vocab)"
        )
    match = data.get("match_active_params")
    if match is not None and (not isinstance(match, Mapping) or match.get("reference") not in names):
        raise ValueError(
            f"{source}: match_active_params needs reference: <a variant name> (and tolerance: 0.05); variants: {names}"
        )
    if match is not None:
        _check_keys(match, MATCH_KEYS, f"{source}: match_active_params")
    baseline = data.get("baseline")
    if baseline is not None and baseline not in names:
        raise ValueError(f"{source}: baseline={baseline!r} is not a variant of the spec; choose one of {names}")
    seed_fields = tuple(data.get("seed_fields", SEED_FIELDS))
    if not seed_fields or any(f not in SEED_FIELDS for f in seed_fields):
        raise ValueError(
            f"{source}: seed_fields={list(seed_fields)} is not valid; choose a non-empty subset of {list(SEED_FIELDS)}"
        )
    corpus, final_eval = data.get("corpus"), data.get("final_eval")
    if corpus is not None:
        if not isinstance(corpus, Mapping) or corpus.get("name") != "stdlib":
            raise ValueError(
                f"{source}: corpus must be {{name: stdlib}} (optionally max_bytes: N), the one experiment corpus"
            )
        _check_keys(corpus, CORPUS_KEYS, f"{source}: corpus")
    if final_eval is not None:
        tokens = final_eval.get("tokens") if isinstance(final_eval, Mapping) else None
        if not isinstance(tokens, int) or tokens < 1:
            raise ValueError(
                f"{source}: final_eval must be {{tokens: N}} with N >= 1: "
                "validation tokens, in windows spread over the split"
            )
        _check_keys(final_eval, FINAL_EVAL_KEYS, f"{source}: final_eval")
    return {"diverged_above": diverged_above, "match_active_params": dict(match) if match else None,
            "seed_fields": seed_fields, "corpus": dict(corpus) if corpus else None,
            "final_eval": dict(final_eval) if final_eval else None, "baseline": baseline}


def _amendments_checked(block: Any, source: str) -> Any:
    """The registration block, each amendment's keys checked first (so that a misspelt key is named)."""
    amendments = block.get("amendments") if isinstance(block, Mapping) else None
    for i, a in enumerate(amendments if isinstance(amendments, list) else []):
        if isinstance(a, Mapping):
            _check_keys(a, AMENDMENT_KEYS, f"{source}: registration.amendments[{i}]")
    return block


def parse_spec(data: Any, source: str = "<spec>") -> SweepSpec:
    """A spec from its parsed YAML (see ``sweep``'s docstring); raises a one-line ValueError."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: a sweep spec is a mapping with base: and variants: (or grid:)")
    _check_keys(data, SPEC_KEYS, source)
    base = data.get("base") or {}
    if not isinstance(base, Mapping):
        raise ValueError(f"{source}: base must be a run config mapping with model:, data:, train: sections")
    listed = data.get("variants") or []
    if not isinstance(listed, list):
        raise ValueError(f"{source}: variants must be a list of {{name:, overrides:}} mappings, got {listed!r}")
    profiles = _profiles(data, source)
    variants = [_variant(v, f"{source}: variants[{i}]", profiles) for i, v in enumerate(listed)]
    variants += _grid(data["grid"], source, profiles) if data.get("grid") else []
    if not variants:
        raise ValueError(f"{source}: no variants; list some under variants: or grid:")
    names = [v.name for v in variants]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise ValueError(f"{source}: variant name {dup!r} appears twice; names must be unique")
    for i, v in enumerate(variants):
        if v.init_from is not None and v.init_from not in names[:i]:
            raise ValueError(f"{source}: variant {v.name!r}: init_from={v.init_from!r} is not an earlier variant; "
                             f"choose one of {names[:i]}")
    tune = _tune(data.get("tune"), source)
    if tune is not None:
        _check_tuned_variants(tune, variants, source)
    return SweepSpec(
        name=_sweep_name(data.get("name") or Path(source).stem, source), base=_changes(base, f"{source}: base"),
        variants=variants,
        seeds=_seeds(data.get("seeds", [0]), source), quick=profiles.get("quick", {}).get("overrides", {}),
        description=str(data.get("description") or ""), source=source, profiles=profiles, tune=tune,
        axis_extend=_axis_extend(data.get("grid"), source, tune),
        registration=check_block(_amendments_checked(data.get("registration"), source), source),
        claims=parse_claims(data.get("claims"), source, variants), **_options(data, source, names),
    )


# ============================================================== accounting
@functools.lru_cache(maxsize=256)
def model_accounting(model_cfg, seq_len: int) -> dict[str, float]:
    """Total and active parameters and training FLOPs per token of a model config (built on the
    meta device; cached, since configs are frozen and a GPU-size MoE takes seconds to draw)."""
    with torch.device("meta"):
        model = Transformer(model_cfg)
    n = model.num_params()
    return {"total_params": n["total"], "active_params": n["active"], "flops_per_token": model.flops_per_token(seq_len)}


def check_active_params(spec: SweepSpec) -> dict[str, dict[str, float]]:
    """Equal compute: every variant's active parameters per token within ``tolerance`` of the reference's."""
    ref_name = spec.match_active_params["reference"]
    tol = float(spec.match_active_params.get("tolerance", 0.05))
    counts = {name: model_accounting(cfg.model, cfg.seq_len) for name, cfg in spec.configs.items()}
    ref = counts[ref_name]["active_params"]
    for name, c in counts.items():
        rel = c["active_params"] / ref - 1
        if abs(rel) > tol or not math.isfinite(rel):
            raise ValueError(
                f"{spec.source}: variant {name!r} has {c['active_params']:,} active parameters, {rel:+.1%} from the "
                f"reference {ref_name!r} ({ref:,}); match_active_params allows ±{tol:.0%}: adjust its expert widths"
            )
    return counts
