"""Registered claims decided: per-seed values in, tests, the correction and a verdict out.

    decisions = decide_claims(spec.claims, rows, previous, ENDPOINTS, init_loss=ln_vocab, gates=gates)
    decisions[0].verdict           # "reproduced" | "opposite" | "tie" | "inconclusive"
    decisions[0].line()            # the report's bullet (stats.describe)
    write_decisions(out, "moe", decisions, extra)   # verdict.json, schema 3

Each claim (``claims.ClaimSpec``, registered in the spec before the runs) names its arms, its
endpoint and its margin. Here, and nowhere else, the numbers meet the rules:
  - an endpoint (a function of an arm's rows, from the experiment's ``ENDPOINTS``) gives one value
    per seed; A - B is paired by seed (or A alone against 0);
  - the claim's one-sided t test in the claimed direction gives its p-value; Holm's step-down
    adjusts the p-values of the experiment's claims together (the registered correction family);
  - a paired sign-flip test, which does not assume normality, is reported beside it;
  - TOST against the registered margin decides equivalence (TIE);
  - the power of the test for the registered effect, at the seed spread measured in this run
    (the pilot's when fewer than 2 seeds), is reported with the seeds it would need;
  - the verdict follows ``stats.decide_registered`` (its docstring states the rule); a claim whose
    gate failed, or whose arms all failed to learn, is *untestable* and inconclusive whatever the numbers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any, Callable, Mapping

from ..run.checkpoint.atomic import atomic_write_text
from ..run.metrics import jsonable
from . import stats
from .claims import ClaimSpec, arm_name, arm_rows
from .stats import label

SCHEMA = 3
Endpoint = Callable[[list[dict], float], dict[int, float]]  # (an arm's rows, ln vocab) -> seed -> value


@dataclasses.dataclass
class Decision:
    """One registered claim with the values that decide it and its tests (``stats.Comparison``)."""

    spec: ClaimSpec
    seeds: list[int]
    a: list[float]  # arm A's value per seed (the endpoint)
    b: list[float]  # arm B's, or [] when A is tested against 0
    comparison: stats.Comparison | None  # None when no seed measured both arms
    seeds_needed: int | None = None  # for 80% power at the measured spread (the pilot's below 2 seeds)
    untestable: str = ""
    amended: bool = False  # ``untestable`` comes from an amendment made after the results (kept in the family)

    @property
    def registered_verdict(self) -> str:
        """The verdict under the rules as registered: the amendment's gate left out."""
        if (self.untestable and not self.amended) or self.comparison is None:
            return "inconclusive"
        return self.comparison.verdict

    @property
    def verdict(self) -> str:
        if self.untestable or self.comparison is None:
            return "inconclusive"
        return self.comparison.verdict

    @property
    def negligible(self) -> bool:
        """Real but smaller than the registered margin (stats.decide_registered's flag)."""
        return bool(self.comparison and not self.untestable and self.comparison.decision.negligible)

    @property
    def diffs(self) -> list[float]:
        return [x - y for x, y in zip(self.a, self.b)] if self.b else list(self.a)

    def line(self) -> str:
        """The report's bullet: claim, verdict and every test (stats.describe)."""
        s = self.spec
        why = f" ({self.untestable})" if self.untestable else ""
        small = " (negligible: significant, but inside the margin)" if self.negligible else ""
        again = " *re-analysed (runs made before the registration)*" if s.analysis == "re-analysed" else ""
        tests = stats.describe(self.comparison) if self.comparison else "No seed measured every arm"
        need = f"; {self.seeds_needed} seeds would give 0.8" if self.seeds_needed else ""
        if self.amended:
            need += f"; under the rules as registered: {label(self.registered_verdict)}"
        return (f"- **{s.id}** — {s.claim}: {label(self.verdict)}{small}{why}{again}. {tests}{need}. "
                f"{self.detail()}").rstrip()

    def detail(self) -> str:
        if not self.a:
            return ""
        text = f"{arm_name(self.spec.compare[0])} {_mean(self.a)}"
        if self.b:
            text += f", {arm_name(self.spec.compare[1])} {_mean(self.b)}"
        return text + "."

    def to_json(self) -> dict[str, Any]:
        s = self.spec
        tests = self.comparison.to_json() if self.comparison else {"n": 0, "difference": None, "ci95": None}
        return {
            "id": s.id, "claim": s.claim, "criterion": s.criterion(), **tests, "verdict": self.verdict,
            "negligible": self.negligible, "analysis": s.analysis, "compare": [arm_name(a) for a in s.compare],
            "endpoint": s.endpoint, "claimed": s.claimed, "unit": s.unit, "margin": s.margin,
            "margin_source": s.margin_source, "seeds": self.seeds, "a": self.a, "b": self.b, "effect": s.effect,
            "seeds_for_80_power": self.seeds_needed, "pilot_sd": s.pilot_sd, "pilot_source": s.pilot_source,
            "untestable": self.untestable, "amended": self.amended, "registered_verdict": self.registered_verdict,
        }


def _mean(v: list[float]) -> str:
    v = [x for x in v if math.isfinite(x)]
    return f"{statistics.fmean(v):.3f}" if v else "—"


def values(spec: ClaimSpec, rows: list[dict], endpoints: Mapping[str, Endpoint], init_loss: float
           ) -> tuple[list[int], list[float], list[float]]:
    """(seeds, A's values, B's values) over the seeds every arm of the claim measured finitely."""
    per_arm = [endpoints[spec.endpoint](arm_rows(rows, arm), init_loss) for arm in spec.compare]
    seeds = sorted(set.intersection(*(set(v) for v in per_arm))) if per_arm else []
    seeds = [s for s in seeds if all(math.isfinite(v[s]) for v in per_arm)]
    a = [per_arm[0][s] for s in seeds]
    b = [per_arm[1][s] for s in seeds] if len(per_arm) == 2 else []
    return seeds, a, b


# a loss comparison needs an arm that learned (best_over_variants: a sweep's, sweep/verdicts.py)
LOSS_ENDPOINTS = ("final_val_loss", "best_over_rates", "sensitivity", "best_over_variants")


def neither_learned(spec: ClaimSpec, rows: list[dict]) -> str:
    """Why a loss claim cannot test anything, or "": every run of every arm diverged or ended no
    better than the unigram loss, so no arm learned and their difference is noise around a floor."""
    runs = [r for arm in spec.compare for r in arm_rows(rows, arm)]
    if spec.endpoint in LOSS_ENDPOINTS and runs and all(
            r.get("status") in ("diverged", "no better than unigram") for r in runs):
        return "untestable: every run of every arm diverged or ended no better than unigram"
    return ""


def decide_claims(specs: list[ClaimSpec], rows: list[dict], previous: list[dict] | None,
                  endpoints: Mapping[str, Endpoint], *, init_loss: float, alpha: float = 0.05,
                  untestable: Mapping[str, str] | None = None,
                  amended: Mapping[str, str] | None = None) -> list[Decision]:
    """Every registered claim decided, with Holm's correction over them all. ``previous`` holds the
    rows that re-analysed claims read (runs made before the registration); ``untestable`` maps a
    claim id to why its gate failed (an arm that never learned is found here). ``amended`` maps a claim
    id to why a gate added by an amendment after the results leaves it untestable: such a claim stays
    in the Holm family with its p-value as registered, so an amendment cannot move another claim's
    verdict, and its report line gives the verdict under the rules as registered beside it."""
    measured = []
    for s in specs:
        used = (previous or []) if s.analysis == "re-analysed" else rows
        seeds, a, b = values(s, used, endpoints, init_loss)
        why = (untestable or {}).get(s.id, "") or neither_learned(s, used)
        measured.append((s, seeds, a, b, why))
    late = {s.id: (amended or {}).get(s.id, "") for s, _, _, _, why in measured if not why}
    diffs = {s.id: ([x - y for x, y in zip(a, b)] if b else list(a)) for s, _, a, b, _ in measured}
    raw = {s.id: stats.claim_pvalue(diffs[s.id], s.margin, s.claimed)  # the family: claims measured and testable
           for s, seeds, _, _, why in measured if len(seeds) > 1 and not why}
    adjusted = stats.holm({k: p for k, p in raw.items() if math.isfinite(p)})
    out = []
    for s, seeds, a, b, why in measured:
        c = (stats.compare(diffs[s.id], s.margin, s.claimed, alpha, p_adjusted=adjusted.get(s.id, raw.get(s.id)),
                           power_effect=s.effect, unit=s.unit) if seeds else None)
        sd = c.decision.interval.std if c and len(seeds) > 1 else (s.pilot_sd or float("nan"))
        needed = seeds_needed(s.effect, sd, alpha)
        out.append(Decision(s, seeds, a, b, c, needed, why or late.get(s.id) or ("" if seeds else "not measured"),
                            amended=bool(late.get(s.id)) and bool(seeds)))
    return out


def seeds_needed(effect: float, sd: float, alpha: float) -> int | None:
    """Seeds for 80% power at ``sd``, or None when ``sd`` is unusable or more than ``stats.seeds_for_power``'s
    max_n would be needed (one diverged seed, counted at ln vocab, spreads a loss difference that far): the
    report's power column then shows how far short the seeds fall, instead of the analysis stopping."""
    if not (math.isfinite(sd) and sd > 0):
        return None
    try:
        return stats.seeds_for_power(effect, sd, alpha=alpha)
    except ValueError:
        return None


def registration_text(record: Mapping[str, Any] | None, family: str = "experiment") -> str:
    """The correction and verdict rules, as the report states them before the numbers; ``family`` names
    what Holm's correction runs over (this experiment's claims, or a sweep's)."""
    alpha = (record or {}).get("alpha", 0.05)
    return (f"Registered rules (``stats.decide_registered``), at alpha {alpha:g}: per claim, the paired differences "
            "over seeds (A - B, or A alone against 0) and Student's t. **TIE** when the 90% interval lies inside ± "
            "the claim's margin (two one-sided tests), even when a difference is also significant (then marked "
            "negligible: real, but smaller than the smallest effect registered as mattering); otherwise "
            "**REPRODUCED** when the one-sided test in the claimed direction rejects at alpha after Holm's "
            f"adjustment over this {family}'s claims that were measured and testable; **OPPOSITE** when the "
            "one-sided test the other way rejects; otherwise **INCONCLUSIVE**. A non-inferiority claim (no worse) "
            "is reproduced when the test of the difference against +margin rejects, and has no tie. The sign-flip "
            "p-value (exact over all sign patterns) is reported beside the t test as a check that does not assume "
            "normality, and the power is for the claim's registered effect at the spread these seeds measured. A "
            "loss claim whose arms never learned (every run diverged or ended no better than the unigram loss) is "
            "untestable, so inconclusive.\n\n")


def write_decisions(out: Path, experiment: str, decisions: list[Decision], extra: dict[str, Any]) -> Path:
    """verdict.json (schema 3): every claim with its tests and verdict, plus ``extra`` (registration, data, plots)."""
    path = Path(out) / "verdict.json"
    atomic_write_text(path, json.dumps(jsonable({"schema": SCHEMA, "experiment": experiment,
                                                 "claims": [d.to_json() for d in decisions], **extra}),
                                       indent=1) + "\n")
    return path
