"""Registered claims decided: per-seed values in, tests, the correction and a verdict out.

    decisions = decide_claims(spec.claims, rows, previous, ENDPOINTS, init_loss=ln_vocab, gates=gates)
    decisions[0].verdict           # "reproduced" | "opposite" | "tie" | "inconclusive"
    decisions[0].line()            # the report's bullet
    write_decisions(out, "moe", decisions, spec.registration_record, extra)   # verdict.json, schema 3

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
  - the verdict follows ``stats.decide_registered``; a claim whose gate failed, or whose arms all
    failed to learn, is *untestable* and inconclusive whatever the numbers.
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
from .stats import Interval, label

SCHEMA = 3
Endpoint = Callable[[list[dict], float], dict[int, float]]  # (an arm's rows, ln vocab) -> seed -> value


@dataclasses.dataclass
class Decision:
    """One registered claim with the values that decide it and every test's result."""

    spec: ClaimSpec
    seeds: list[int]
    a: list[float]  # arm A's value per seed (the endpoint)
    b: list[float]  # arm B's, or [] when A is tested against 0
    interval: Interval  # 95% t interval of the mean difference
    interval90: Interval  # the TOST interval
    p: float  # one-sided, in the claimed direction (non-inferiority for not_higher)
    p_holm: float
    p_signflip: float
    p_tost: float
    power: float  # for spec.effect at the measured spread
    seeds_needed: int | None  # for 80% power at that spread
    untestable: str = ""
    verdict: str = "inconclusive"

    @property
    def diffs(self) -> list[float]:
        return [x - y for x, y in zip(self.a, self.b)] if self.b else list(self.a)

    def line(self) -> str:
        """The report's bullet: claim, verdict, interval, margin, p-values, n and power."""
        s = self.spec
        iv = self.interval.text() if self.seeds else "not measured"
        why = f" ({self.untestable})" if self.untestable else ""
        again = " *re-analysed (runs made before the registration)*" if s.analysis == "re-analysed" else ""
        return (f"- **{s.id}** — {s.claim}: {label(self.verdict)}{why}{again}. Difference {iv} {s.unit} (95% CI); "
                f"margin ±{s.margin:g}; p {fmt_p(self.p)} (Holm {fmt_p(self.p_holm)}), "
                f"sign-flip {fmt_p(self.p_signflip)}, equivalence (TOST) {fmt_p(self.p_tost)}; "
                f"n = {len(self.seeds)}; power {self.power:.2f} for {s.effect:g}. {self.detail()}").rstrip()

    def detail(self) -> str:
        a = arm_name(self.spec.compare[0])
        if not self.a:
            return ""
        text = f"{a} {_mean(self.a)}"
        if self.b:
            text += f", {arm_name(self.spec.compare[1])} {_mean(self.b)}"
        return text + "."

    def to_json(self) -> dict[str, Any]:
        s, iv = self.spec, self.interval
        return {
            "id": s.id, "claim": s.claim, "criterion": s.criterion(), "verdict": self.verdict,
            "analysis": s.analysis, "compare": [arm_name(a) for a in s.compare], "endpoint": s.endpoint,
            "claimed": s.claimed, "unit": s.unit, "margin": s.margin, "margin_source": s.margin_source,
            "difference": iv.mean if self.seeds else None, "ci95": [iv.lo, iv.hi] if self.seeds else None,
            "ci90": [self.interval90.lo, self.interval90.hi] if self.seeds else None,
            "n": len(self.seeds), "seeds": self.seeds, "a": self.a, "b": self.b,
            "p": self.p, "p_holm": self.p_holm, "p_signflip": self.p_signflip, "p_tost": self.p_tost,
            "effect": s.effect, "power": self.power, "seeds_for_80_power": self.seeds_needed,
            "pilot_sd": s.pilot_sd, "pilot_source": s.pilot_source, "untestable": self.untestable,
            "negligible": self.negligible,
        }

    @property
    def negligible(self) -> bool:
        """A difference whose 95% interval excludes zero yet lies inside the margin: real, but
        smaller than the smallest effect the claim registered as mattering."""
        iv = self.interval
        return bool(self.seeds and iv.excludes_zero() and -self.spec.margin < iv.lo and iv.hi < self.spec.margin)


def fmt_p(p: float) -> str:
    return "—" if p is None or not math.isfinite(p) else ("<0.001" if p < 0.001 else f"{p:.3f}")


def _mean(v: list[float]) -> str:
    v = [x for x in v if math.isfinite(x)]
    return f"{statistics.fmean(v):.3f}" if v else "—"


def values(spec: ClaimSpec, rows: list[dict], endpoints: Mapping[str, Endpoint], init_loss: float
           ) -> tuple[list[int], list[float], list[float]]:
    """(seeds, A's values, B's values) over the seeds every arm of the claim measured."""
    per_arm = [endpoints[spec.endpoint](arm_rows(rows, arm), init_loss) for arm in spec.compare]
    seeds = sorted(set.intersection(*(set(v) for v in per_arm))) if per_arm else []
    seeds = [s for s in seeds if all(math.isfinite(v[s]) for v in per_arm)]
    a = [per_arm[0][s] for s in seeds]
    b = [per_arm[1][s] for s in seeds] if len(per_arm) == 2 else []
    return seeds, a, b


def decide_claims(specs: list[ClaimSpec], rows: list[dict], previous: list[dict] | None,
                  endpoints: Mapping[str, Endpoint], *, init_loss: float, alpha: float = 0.05,
                  untestable: Mapping[str, str] | None = None) -> list[Decision]:
    """Every registered claim decided, with Holm's correction over them all. ``previous`` holds the
    rows that re-analysed claims read (runs made before the registration); ``untestable`` maps a
    claim id to why its gate failed."""
    out = []
    for s in specs:
        seeds, a, b = values(s, (previous or []) if s.analysis == "re-analysed" else rows, endpoints, init_loss)
        out.append(_tested(s, seeds, a, b, alpha, (untestable or {}).get(s.id, "")))
    adjusted = stats.holm({d.spec.id: d.p for d in out if math.isfinite(d.p)})
    for d in out:
        d.p_holm = adjusted.get(d.spec.id, float("nan"))
        d.verdict = "inconclusive" if d.untestable or not d.seeds else stats.decide_registered(
            d.diffs, d.spec.margin, d.spec.claimed, alpha=alpha, p_adjusted=d.p_holm)
    return out


def _tested(s: ClaimSpec, seeds: list[int], a: list[float], b: list[float], alpha: float, why: str) -> Decision:
    nan = float("nan")
    diffs = [x - y for x, y in zip(a, b)] if b else list(a)
    if not seeds:
        empty = Interval(nan, nan, nan, 0, nan)
        return Decision(s, [], [], [], empty, empty, nan, nan, nan, nan, nan, None, why or "not measured")
    alternative = "less" if s.claimed in ("lower", "not_higher") else "greater"
    shift = s.margin if s.claimed == "not_higher" else 0.0  # non-inferiority: test diff < +margin
    p = stats.paired_t_test([d - shift for d in diffs], alternative) if len(diffs) > 1 else nan
    sd = statistics.stdev(diffs) if len(diffs) > 1 else (s.pilot_sd or nan)
    power = stats.power_paired(s.effect, sd, len(diffs), alpha=alpha) if len(diffs) > 1 and sd > 0 else nan
    needed = stats.seeds_for_power(s.effect, sd, alpha=alpha) if sd > 0 and math.isfinite(sd) else None
    return Decision(s, seeds, a, b, stats.mean_interval(diffs), stats.mean_interval(diffs, 0.90), p, nan,
                    stats.sign_flip_test(diffs, alternative) if len(diffs) > 1 else nan,
                    stats.tost(diffs, s.margin) if len(diffs) > 1 else nan, power, needed, why)


def registration_text(record: Mapping[str, Any] | None) -> str:
    """The correction and verdict rules, as the report states them before the numbers."""
    alpha = (record or {}).get("alpha", 0.05)
    return (f"Registered rules: per claim, the one-sided paired t test in the claimed direction at alpha {alpha:g}, "
            "its p-value Holm-adjusted over this experiment's claims: **REPRODUCED** when the adjusted p is below "
            "alpha; **OPPOSITE** when the test in the other direction is; **TIE** when the 90% interval lies inside "
            "± the claim's margin (two one-sided tests); otherwise **INCONCLUSIVE**. A non-inferiority claim "
            "(no worse) tests the difference against +margin. The sign-flip p-value (exact over all sign patterns) "
            "is reported beside the t test as a check that does not assume normality. Power is for the claim's "
            "registered effect at the spread these seeds measured.\n\n")


def write_decisions(out: Path, experiment: str, decisions: list[Decision], extra: dict[str, Any]) -> Path:
    """verdict.json (schema 3): every claim with its tests and verdict, plus ``extra`` (registration, data, plots)."""
    path = Path(out) / "verdict.json"
    atomic_write_text(path, json.dumps(jsonable({"schema": SCHEMA, "experiment": experiment,
                                                 "claims": [d.to_json() for d in decisions], **extra}),
                                       indent=1) + "\n")
    return path
