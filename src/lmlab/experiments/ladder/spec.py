"""A ladder spec: arms x rungs x seeds, each rung a model size with a token budget, expanded to a sweep spec.

    ladder = load_ladder("ladder.yaml", profile="quick")   # validated; every run's config built
    ladder.sweep                   # the SweepSpec the sweep engine runs: variants <arm>-<rung>, labels arm, rung
    ladder.sweep.configs["moe-r2"].train.steps              # the rung's token budget, in steps
    ladder.budgets["moe-r2"]       # {"tokens": ..., "steps": ..., "params": ..., "flops_per_token": ...}

A ladder is one sweep: its ``arms`` and ``rungs`` are the two axes of a grid (variant ``<arm>-<rung>``,
labels ``arm`` and ``rung``), every cell trains every seed, and each cell's ``train.steps`` comes from
its rung's budget. Rates are the sweep's ``tune:``: by arm at the smallest rung (``transfer``) or by arm
and rung (``grid``). The format is in the package's docstring (``experiments/ladder/__init__.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Mapping

import torch

from ...model import Transformer
from ...run.errors import one_line
from ...schema import read_yaml, suggest
from ..spec import SweepSpec, parse_spec

__all__ = ["BUDGET_KINDS", "Ladder", "accounting", "budget_overrides", "load_ladder", "parse_ladder"]

LADDER_KEYS = ("name", "description", "registration", "base", "corpus", "final_eval", "seeds", "seed_fields",
               "diverged_above", "arms", "rungs", "budget", "rates", "compare", "resamples", "profiles", "claims")
ARM_KEYS = ("name", "overrides")
RUNG_KEYS = ("name", "overrides", "budget")
BUDGET_KINDS = ("tokens_per_param", "flops", "tokens")  # exactly one per rung
BUDGET_KEYS = (*BUDGET_KINDS, "params", "evals", "warmup")
PARAMS = ("active", "total", "non_embedding")  # which count tokens_per_param multiplies
RATES_KEYS = ("mode", "field", "values", "seeds", "max_extensions", "extend_factor")
RATE_MODES = ("transfer", "grid")
PROFILE_KEYS = ("overrides", "rungs", "seeds", "budget", "rates", "corpus", "final_eval", "resamples")


@dataclasses.dataclass
class Ladder:
    """A parsed ladder at one profile: the sweep it runs, and what the analysis needs beside the rows."""

    name: str
    source: str
    arms: list[str]
    rungs: list[str]  # smallest first
    compare: list[tuple[str, str]]  # (arm, baseline): the multiplier of arm over baseline
    rates: dict[str, Any] | None  # mode, field, values, ...
    budgets: dict[str, dict[str, Any]]  # variant -> its budget: tokens, steps, params, flops_per_token, rule
    resamples: int
    sweep: SweepSpec


# ============================================================== accounting and budgets
@functools.lru_cache(maxsize=256)
def accounting(model_cfg, seq_len: int) -> dict[str, float]:
    """Total, active and non-embedding active parameters, and training FLOPs per token, of a model config
    (built on the meta device). non_embedding: the active parameters less the embedding (Kaplan et al. 2020)."""
    with torch.device("meta"):
        model = Transformer(model_cfg)
    n = model.num_params()
    embedding = sum(p.numel() for p in model.embedding_parameters())
    return {"total": n["total"], "active": n["active"], "non_embedding": n["active"] - embedding,
            "flops_per_token": model.flops_per_token(seq_len)}


def budget_overrides(budget: Mapping[str, Any], cfg) -> tuple[dict[str, Any], dict[str, Any]]:
    """(overrides, record) of one run's budget: the steps its token budget buys, evaluation spaced to give
    ``evals`` points, warmup a fraction of the steps when ``warmup`` is given. ``cfg``: the run's RunConfig."""
    acc = accounting(cfg.model, cfg.seq_len)
    per_step = cfg.train.batch_size * cfg.train.grad_accum * cfg.seq_len
    if "tokens_per_param" in budget:
        tokens = budget["tokens_per_param"] * acc[budget.get("params", "active")]
    elif "flops" in budget:
        tokens = budget["flops"] / acc["flops_per_token"]
    else:
        tokens = budget["tokens"]
    steps = max(1, round(tokens / per_step))
    out = {"train.steps": steps, "eval.every": max(1, steps // budget.get("evals", 4))}
    if "warmup" in budget:
        out["optim.warmup_steps"] = round(budget["warmup"] * steps)
    rule = next(f"{k}={budget[k]:g}" for k in BUDGET_KINDS if k in budget)
    if "tokens_per_param" in budget:
        rule += f" ({budget.get('params', 'active')} parameters)"
    record = {"rule": rule, "tokens": steps * per_step, "steps": steps, "flops_per_token": acc["flops_per_token"],
              "flops": steps * per_step * acc["flops_per_token"], **{k: acc[k] for k in PARAMS}}
    return out, record


def _merge_budget(base: Mapping[str, Any] | None, change: Mapping[str, Any] | None) -> dict[str, Any]:
    """``change`` on ``base``; a change naming a budget kind replaces the base's kind."""
    base, change = dict(base or {}), dict(change or {})
    if any(k in change for k in BUDGET_KINDS):
        base = {k: v for k, v in base.items() if k not in BUDGET_KINDS}
    return {**base, **change}


def _check_budget(b: Mapping[str, Any], where: str) -> None:
    _check_keys(b, BUDGET_KEYS, where)
    kinds = [k for k in BUDGET_KINDS if k in b]
    if len(kinds) != 1:
        raise ValueError(f"{where}: give exactly one of {', '.join(BUDGET_KINDS)} (got {kinds or 'none'}), e.g. "
                         "budget: {tokens_per_param: 20}")
    v = b[kinds[0]]
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
        raise ValueError(f"{where}: {kinds[0]}={v!r} is not valid; give a positive number")
    if b.get("params", "active") not in PARAMS:
        raise ValueError(f"{where}: params={b['params']!r} is not valid; choose one of {', '.join(PARAMS)}")
    evals = b.get("evals", 4)
    if not isinstance(evals, int) or isinstance(evals, bool) or evals < 1:
        raise ValueError(f"{where}: evals={evals!r} is not valid; give the evaluations along each run, e.g. 4")
    w = b.get("warmup")
    if w is not None and (not isinstance(w, (int, float)) or isinstance(w, bool) or not 0 <= w < 1):
        raise ValueError(f"{where}: warmup={w!r} is not valid; give the fraction of each run's steps, e.g. 0.05")


# ============================================================== parsing
def _check_keys(raw: Mapping, allowed: tuple[str, ...], where: str) -> None:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} must be a mapping with some of {', '.join(allowed)}")
    unknown = [k for k in raw if k not in allowed]
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}{suggest(str(unknown[0]), allowed)}; "
                         f"valid keys: {', '.join(allowed)}")


def _named(raw: Any, keys: tuple[str, ...], where: str, what: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}: {what} must be a non-empty list of {{name:, overrides:}}")
    out = []
    for i, item in enumerate(raw):
        _check_keys(item, keys, f"{where}: {what}[{i}]")
        name = str(item.get("name", ""))
        if not name or "-" in name or "/" in name or " " in name:
            raise ValueError(f"{where}: {what}[{i}] name {name!r} is not valid; give a name without '-', '/' or "
                             "spaces (a run is named <arm>-<rung>)")
        out.append(dict(item, name=name))
    names = [x["name"] for x in out]
    if dup := next((n for n in names if names.count(n) > 1), None):
        raise ValueError(f"{where}: {what} name {dup!r} appears twice")
    return out


def _profile(data: Mapping[str, Any], profile: str | None, source: str) -> dict[str, Any]:
    """The ladder with ``profile`` applied: overrides on the base, the rungs/seeds replaced, budget and rates
    merged, corpus and final_eval merged (or dropped by a null)."""
    profiles = data.get("profiles") or {}
    if not isinstance(profiles, Mapping):
        raise ValueError(f"{source}: profiles must map a name (quick, gpu) to {{{', '.join(PROFILE_KEYS)}}}")
    if profile is None:
        return dict(data)
    if profile not in profiles:
        raise ValueError(f"{source}: no profile {profile!r}; this ladder has {sorted(profiles) or 'none'}")
    p = profiles[profile] or {}
    _check_keys(p, PROFILE_KEYS, f"{source}: profile {profile!r}")
    out = dict(data)
    for key in ("rungs", "seeds", "resamples"):
        if key in p:
            out[key] = p[key]
    if "budget" in p:
        out["budget"] = _merge_budget(data.get("budget"), p["budget"])
    if "rates" in p:
        out["rates"] = None if p["rates"] is None else {**(data.get("rates") or {}), **p["rates"]}
    for key in ("corpus", "final_eval"):
        if key in p:
            out[key] = None if p[key] is None else {**(data.get(key) or {}), **p[key]}
    return out


def _rates(raw: Any, rungs: list[dict], where: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(rates, the sweep's tune: block) from ``rates:``; (None, None) without one."""
    if raw is None:
        return None, None
    _check_keys(raw, RATES_KEYS, f"{where}: rates")
    mode = raw.get("mode")
    if mode not in RATE_MODES:
        raise ValueError(f"{where}: rates.mode={mode!r} is not valid; choose transfer (tune at the smallest rung, "
                         "carry the rate to every rung: meant for model.parametrization: mup) or grid (tune at every "
                         "rung)")
    if not isinstance(raw.get("values"), list) or len(raw["values"]) < 2:
        raise ValueError(f"{where}: rates.values must list 2 or more values, e.g. [1.0e-3, 3.0e-3, 1.0e-2]")
    rates = {"field": "optim.lr", "seeds": [1000, 1001], **raw}
    tune = {"field": rates["field"], "values": rates["values"], "seeds": rates["seeds"], "full_length": True,
            "by": ["arm"] if mode == "transfer" else ["arm", "rung"],
            "at": {"rung": rungs[0]["name"]} if mode == "transfer" else {}}
    tune |= {k: raw[k] for k in ("max_extensions", "extend_factor") if k in raw}
    return rates, tune


def parse_ladder(data: Any, source: str = "<ladder>", *, profile: str | None = None,
                 seeds: list[int] | None = None) -> Ladder:
    """A ladder from its parsed YAML at ``profile`` (``quick``, ``gpu``, ...), expanded to a resolved sweep spec
    with each run's budget in its steps. Raises a one-line ValueError naming the spec and the field."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: a ladder spec is a mapping with base:, arms:, rungs: and budget:")
    _check_keys(data, LADDER_KEYS, source)
    data = _profile(data, profile, source)
    arms = _named(data.get("arms"), ARM_KEYS, source, "arms")
    rungs = _named(data.get("rungs"), RUNG_KEYS, source, "rungs")
    budget = data.get("budget")
    for r in rungs:
        _check_budget(_merge_budget(budget, r.get("budget")), f"{source}: rung {r['name']!r} budget")
    rates, tune = _rates(data.get("rates"), rungs, source)
    names = [a["name"] for a in arms]
    compare = [(c.get("arm"), c.get("baseline")) if isinstance(c, Mapping) else (None, None)
               for c in data.get("compare") or [{"arm": n, "baseline": names[0]} for n in names[1:]]]
    if bad := next((c for c in compare if c[0] not in names or c[1] not in names or c[0] == c[1]), None):
        raise ValueError(f"{source}: compare entry {bad} is not valid; give {{arm: A, baseline: B}}, two different "
                         f"arms of {names}")
    resamples = data.get("resamples", 999)
    if not isinstance(resamples, int) or isinstance(resamples, bool) or resamples < 1:
        raise ValueError(f"{source}: resamples={resamples!r} is not valid; give the bootstrap resamples, e.g. 999")
    sweep_data = {
        "name": data.get("name") or Path(source).stem, "description": data.get("description") or "",
        "base": data.get("base") or {}, "seeds": seeds if seeds is not None else data.get("seeds", [0]),
        "grid": [{"axis": "arm", "levels": [{"name": a["name"], "overrides": a.get("overrides") or {}} for a in arms]},
                 {"axis": "rung", "levels": [{"name": r["name"], "overrides": r.get("overrides") or {}}
                                             for r in rungs]}],
        **{k: data[k] for k in ("registration", "corpus", "final_eval", "seed_fields", "diverged_above", "claims")
           if data.get(k) is not None},
        **({"tune": tune} if tune else {}),
        # the sweep applies the profile's base overrides, and its reports name the profile
        **({"profiles": {profile: {"overrides": (data.get("profiles") or {})[profile].get("overrides") or {}}}}
           if profile else {}),
    }
    spec = parse_spec(sweep_data, source).resolve(profile=profile)  # every cell's config, before its budget
    by_rung = {r["name"]: _merge_budget(budget, r.get("budget")) for r in rungs}
    variants, budgets = [], {}
    for v in spec.variants:
        try:
            extra, budgets[v.name] = budget_overrides(by_rung[v.labels["rung"]], spec.configs[v.name])
        except ValueError as e:
            raise ValueError(f"{source}: run {v.name!r}: {one_line(e)}") from None
        variants.append(dataclasses.replace(v, overrides={**v.overrides, **extra}))
    spec = dataclasses.replace(spec, variants=variants, configs={}).resolve(profile=profile)
    ladder = Ladder(spec.name, source, names, [r["name"] for r in rungs], compare, rates, budgets, resamples, spec)
    _check_order(ladder)
    if rates and rates["mode"] == "transfer":
        _check_transfer(ladder)
    return ladder


def _check_order(ladder: Ladder) -> None:
    """Rungs are listed smallest first (by the first arm's training FLOPs): transfer tunes at the first."""
    flops = [ladder.budgets[f"{ladder.arms[0]}-{r}"]["flops"] for r in ladder.rungs]
    if any(b <= a for a, b in zip(flops, flops[1:])):
        raise ValueError(f"{ladder.source}: rungs must be listed smallest first, each with more training FLOPs than "
                         f"the one before; arm {ladder.arms[0]!r} has " + ", ".join(
                             f"{r} {f:.3g}" for r, f in zip(ladder.rungs, flops)))


def _check_transfer(ladder: Ladder) -> None:
    """Under μP (``model.parametrization: mup``), a rate transfers from the base shape: every rung must
    share the smallest rung's. Without μP nothing is checked (the transfer is then the spec's choice)."""
    for arm in ladder.arms:
        cfgs = [ladder.sweep.configs[f"{arm}-{r}"].model for r in ladder.rungs]
        if getattr(cfgs[0], "parametrization", "standard") != "mup":
            continue
        first = cfgs[0]
        want = (first.d_model, first.head_dim)
        for r, m in zip(ladder.rungs, cfgs):
            base = getattr(m, "mup", None)
            got = (getattr(base, "base_d_model", None), getattr(base, "base_head_dim", None))
            if got != want:
                raise ValueError(
                    f"{ladder.source}: rates.mode transfer under μP needs every rung's base shape to be the smallest "
                    f"rung's (d_model {want[0]}, head_dim {want[1]}); rung {r!r} of arm {arm!r} has {got}. Set "
                    f"base: {{model: {{mup: {{base_d_model: {want[0]}, base_head_dim: {want[1]}}}}}}}")


def load_ladder(path: str | Path, *, profile: str | None = None, quick: bool = False,
                seeds: int | None = None) -> Ladder:
    """Read and validate a ladder spec file at ``profile`` (``quick=True`` is profile quick)."""
    if quick and profile not in (None, "quick"):
        raise ValueError(f"--quick and --profile {profile} exclude each other; --quick is --profile quick")
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"ladder spec {str(p)!r} does not exist")
    from ..spec import seed_range

    return parse_ladder(read_yaml(p, f"ladder spec {str(p)!r}"), str(p), profile="quick" if quick else profile,
                        seeds=seed_range(seeds, "--seeds") if seeds is not None else None)
