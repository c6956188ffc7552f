"""Claims and their verdicts: what each experiment decides, written to verdict.json and the README.

    c = Claim("norm", "warmup-post-xavier", "post-norm needs warmup at 24 layers", criterion, iv, margin, "higher")
    c.verdict                      # decided from the interval and margin (stats.decide)
    write_verdicts(out, "norm", claims, extra)        # verdict.json, schema 2
    claims_table("results")                           # the README's table, from every verdict.json

The README's table of results is generated from the verdict files by :func:`claims_table`
(``python -m lmlab.experiments.readme_table results README.md results/README.md`` rewrites it
between its markers), and a test checks that the committed README matches the committed verdict files.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..run.checkpoint.atomic import atomic_write_text
from ..run.metrics import jsonable
from .stats import Claimed, Interval, Verdict, decide, label

SCHEMA = 2
BEGIN, END = (
    "<!-- claims-table: generated from the verdict.json files under results/; do not edit by hand -->",
    "<!-- claims-table end -->",
)


@dataclasses.dataclass
class Claim:
    """One tested statement: the paired difference that decides it and the verdict that follows."""

    experiment: str
    id: str
    claim: str  # the statement, as the paper makes it
    criterion: str  # what decides it, stated before any number
    interval: Interval | None  # the deciding difference (A - B per seed), or None when not measured
    margin: float  # the tie / non-inferiority margin, derived from the seed spread
    claimed: Claimed = "lower"
    unit: str = "nats"
    detail: str = ""  # the numbers behind it, one line
    untestable: str = (
        ""  # why the runs cannot test the claim (e.g. neither arm learned): inconclusive, whatever the interval
    )

    @property
    def verdict(self) -> Verdict | None:
        if self.untestable:
            return "inconclusive"
        return None if self.interval is None else decide(self.interval, self.margin, self.claimed)

    @property
    def negligible(self) -> bool:
        """A difference whose interval excludes zero yet lies inside the tie margin: real, but smaller
        than what reseeding one run moves it by."""
        iv = self.interval
        return bool(
            not self.untestable
            and iv is not None
            and iv.excludes_zero()
            and math.isfinite(self.margin)
            and -self.margin < iv.lo
            and iv.hi < self.margin
        )

    def line(self) -> str:
        """A markdown bullet: the claim, its verdict and the interval."""
        iv = self.interval.text() if self.interval is not None else "not measured"
        margin = f"; margin ±{self.margin:.3f}" if math.isfinite(self.margin) else ""
        small = (
            " (inside the tie margin: a real difference, but smaller than reseeding one run moves it)"
            if self.negligible
            else ""
        )
        small += f" ({self.untestable})" if self.untestable else ""
        return (f"- **{self.id}** — {self.claim}: {label(self.verdict)}{small}. "
                f"Difference {iv} {self.unit}{margin}. {self.detail}").rstrip()

    def to_json(self) -> dict[str, Any]:
        iv = self.interval
        return {"id": self.id, "claim": self.claim, "criterion": self.criterion, "verdict": self.verdict,
                "difference": iv.mean if iv else None, "ci95": [iv.lo, iv.hi] if iv else None, "n": iv.n if iv else 0,
                "margin": self.margin, "claimed": self.claimed, "unit": self.unit, "negligible": self.negligible,
                "detail": self.detail, "untestable": self.untestable}


def capped(row: dict, init_loss: float) -> float:
    """The loss a comparison uses: a diverged run (non-finite, or above ln vocab) counts as ln vocab,
    the loss of the untrained model, so that one bad seed weighs in instead of voiding the interval."""
    v = row.get("final_val_loss")  # read_csv parses a loss written as "4" as int 4: still a loss
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return float(v) if row.get("status") != "diverged" and ok else init_loss


def neither_learned(*arms: list[dict]) -> str:
    """Why a loss comparison between ``arms`` (their result rows) cannot test anything, or "": every
    run of every arm diverged or ended no better than the unigram loss, so no arm learned and their
    difference is noise around a floor."""
    runs = [r for arm in arms for r in arm]
    if runs and all(r.get("status") in ("diverged", "no better than unigram") for r in runs):
        return "untestable: every run of both arms diverged or ended no better than unigram"
    return ""


def criteria_text(claims: list[Claim]) -> str:
    """The criteria, one bullet per claim, for the report's section that precedes the numbers."""
    return "\n".join(f"- **{c.id}** — {c.claim}. {c.criterion}" for c in claims) + "\n"


def write_verdicts(out: Path, experiment: str, claims: list[Claim], extra: dict[str, Any]) -> Path:
    """verdict.json: every claim with its interval and verdict, plus ``extra`` (corpus, revisions, plots)."""
    path = Path(out) / "verdict.json"
    atomic_write_text(path, json.dumps(jsonable({"schema": SCHEMA, "experiment": experiment,
                                                 "claims": [c.to_json() for c in claims], **extra}), indent=1) + "\n")
    return path


# ============================================================== registered claims (the spec's claims:)
CLAIM_KEYS = ("id", "claim", "compare", "endpoint", "claimed", "unit", "margin", "margin_source", "effect",
              "pilot_sd", "pilot_source", "gate", "analysis")
ANALYSES = ("rerun", "re-analysed")  # trained under the registration, or old runs read under its rules


@dataclasses.dataclass(frozen=True)
class ClaimSpec:
    """One claim as the spec registers it, before any run: which arms it compares, on which
    endpoint, in which direction, and the smallest effect that matters (its margin), with where
    that margin and the seed count come from.

    ``compare`` is [A, B] (A - B paired by seed) or [A] (A against 0). An arm is a variant name,
    or a mapping of grid labels selecting several variants (e.g. every rate of one architecture),
    which the experiment's endpoint reduces to one value per seed (e.g. the best over rates)."""

    id: str
    claim: str
    compare: tuple[Any, ...]
    endpoint: str  # a name in the experiment module's ENDPOINTS
    claimed: Claimed
    unit: str
    margin: float  # smallest effect of interest, in ``unit``: TIE means the 90% interval lies inside +-margin
    margin_source: str  # the paper's effect, or why another value was chosen
    effect: float  # the effect the seed count is sized to detect (power)
    pilot_sd: float | None  # seed spread of the per-seed difference in a pilot, for the power calculation
    pilot_source: str
    gate: str = ""  # a precondition the experiment checks before the claim is tested ("" = none)
    analysis: str = "rerun"

    def arms(self) -> tuple[Any, ...]:
        return self.compare

    def criterion(self) -> str:
        """The registered rule, in words, for the report's criteria section."""
        a = arm_name(self.compare[0])
        against = f" minus {arm_name(self.compare[1])}" if len(self.compare) == 2 else ""
        side = {"lower": "below 0", "higher": "above 0", "not_higher": f"below +{self.margin:g}"}[self.claimed]
        gate = f" Tested only if {self.gate}." if self.gate else ""
        return (f"{self.endpoint} of {a}{against}, paired by seed, {side}; smallest effect of interest "
                f"{self.margin:g} {self.unit} ({self.margin_source}).{gate}")


def arm_name(arm: Any) -> str:
    """'dense', or 'arch=pre-normal, warmup=w0' for a grid selection."""
    return ", ".join(f"{k}={v}" for k, v in arm.items()) if isinstance(arm, Mapping) else str(arm)


def arm_rows(rows: list[dict], arm: Any) -> list[dict]:
    """The result rows an arm covers: one variant's, or every variant whose labels match the mapping."""
    if isinstance(arm, Mapping):
        return [r for r in rows if all(str(r.get(k)) == str(v) for k, v in arm.items())]
    return [r for r in rows if r["variant"] == arm]


def _number(raw: Mapping, key: str, where: str, *, required: bool = True, positive: bool = True) -> float | None:
    v = raw.get(key)
    if v is None and not required:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or (positive and v <= 0):
        raise ValueError(f"{where}: {key}={v!r} is not valid; give a positive number in the claim's unit")
    return float(v)


def parse_claims(raw: Any, source: str, variants: list, endpoints: Iterable[str] | None = None) -> list[ClaimSpec]:
    """The spec's ``claims:`` list, each checked against the spec's variants (and, when given, the
    experiment's endpoint names); a one-line ValueError names the claim and the field."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ValueError(f"{source}: claims must be a list of {{id:, claim:, compare: [A, B], endpoint:, ...}}")
    out, seen = [], set()
    for i, c in enumerate(raw):
        where = f"{source}: claims[{i}]"
        if not isinstance(c, Mapping) or not c.get("id"):
            raise ValueError(f"{where} must be a mapping with an id")
        where = f"{source}: claim {c['id']!r}"
        unknown = [k for k in c if k not in CLAIM_KEYS]
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r}; valid keys: {', '.join(CLAIM_KEYS)}")
        if c["id"] in seen:
            raise ValueError(f"{where}: the id appears twice; each claim has its own")
        seen.add(c["id"])
        for key in ("claim", "endpoint", "margin_source", "compare"):
            if not c.get(key):
                raise ValueError(f"{where}: {key} is missing; a registered claim states it before the runs")
        compare = c["compare"]
        if not isinstance(compare, list) or len(compare) not in (1, 2):
            raise ValueError(f"{where}: compare={compare!r} must be [A, B] (A - B by seed) or [A] (A against 0)")
        analysis = c.get("analysis", "rerun")
        if analysis not in ANALYSES:
            raise ValueError(f"{where}: analysis={analysis!r} is not valid; choose one of {list(ANALYSES)}")
        for arm in compare if analysis == "rerun" else ():  # re-analysed arms are in the previous runs' rows
            labels = [getattr(v, "labels", {}) for v in variants]
            names = [v.name for v in variants]
            found = (any(all(lab.get(k) == str(val) for k, val in arm.items()) for lab in labels)
                     if isinstance(arm, Mapping) else arm in names)
            if not found:
                raise ValueError(f"{where}: arm {arm_name(arm)!r} matches no variant of the spec; variants: {names}")
        if endpoints is not None and c["endpoint"] not in endpoints:
            raise ValueError(f"{where}: endpoint {c['endpoint']!r} is not one this experiment measures; "
                             f"choose one of {sorted(endpoints)}")
        claimed = c.get("claimed", "lower")
        if claimed not in ("lower", "higher", "not_higher"):
            raise ValueError(f"{where}: claimed={claimed!r} is not valid; choose lower, higher or not_higher")
        margin = _number(c, "margin", where)
        out.append(ClaimSpec(
            str(c["id"]), str(c["claim"]), tuple(compare), str(c["endpoint"]), claimed, str(c.get("unit", "nats")),
            margin, str(c["margin_source"]), _number(c, "effect", where, required=False) or margin,
            _number(c, "pilot_sd", where, required=False), str(c.get("pilot_source", "")), str(c.get("gate") or ""),
            analysis))
    return out


# ============================================================== the README's table
def _cell(x: float | None) -> str:
    return f"{x:+.3f}" if isinstance(x, (int, float)) and math.isfinite(x) else "—"


def _p(p: Any) -> str:
    return "—" if not isinstance(p, (int, float)) or not math.isfinite(p) else ("<0.001" if p < 0.001 else f"{p:.3f}")


NOT_CURRENT = ("previous", "run-records")  # a superseded analysis; run records hold no verdicts


def verdict_files(results: str | Path) -> list[Path]:
    """Every current verdict.json under ``results``: an experiment's (``norm/verdict.json``) and a later
    study's inside its folder (``norm/depth-ladder/verdict.json``), not those of ``previous/`` analyses
    or of exploratory pilots (``pilot-*``, which write none)."""
    root = Path(results)
    found = [*root.glob("*/verdict.json"), *root.glob("*/*/verdict.json")]
    return sorted(p for p in found if not any(part in NOT_CURRENT or part.startswith("pilot-")
                                              for part in p.relative_to(root).parts[:-1]))


def claims_table(results: str | Path) -> str:
    """A markdown table of every claim in ``results``' verdict files (:func:`verdict_files`), with its
    verdict, interval, margin and p-value: schema 3 (registered claims: the registered margin, Holm's p)
    and schema 2 (the margin derived from the seed spread, no p-value). A study inside an experiment's
    folder is named by both (``norm/depth-ladder``)."""
    lines = ["| experiment | claim | verdict | difference [95% CI] | margin | p (Holm) | seeds |",
             "|---|---|---|---|---|---|---|"]
    for path in verdict_files(results):
        data = json.loads(path.read_text())
        folder = path.parent.relative_to(results).as_posix()
        name = folder if "/" in folder else data.get("experiment", folder)
        link = f"[{name}]({folder}/report.md)"
        if data.get("schema") not in (2, 3):
            lines.append(f"| {link} | (an older report without intervals) | — | — | — | — | — |")
            continue
        for c in data["claims"]:
            ci = c.get("ci95") or [None, None]
            diff = (f"{_cell(c['difference'])} [{_cell(ci[0])}, {_cell(ci[1])}] {c['unit']}"
                    if c.get("difference") is not None else "—")
            m = c.get("margin")
            margin = f"±{m:.3f}" if isinstance(m, (int, float)) and math.isfinite(m) else "—"
            if data["schema"] == 2 and margin != "—":
                margin += " (from the seed spread)"
            notes = [w for w, on in (("negligible", c.get("negligible")), ("untestable", c.get("untestable")),
                                     ("amended after the results", c.get("amended")),
                                     ("re-analysed", c.get("analysis") == "re-analysed")) if on]
            small = f" ({', '.join(notes)})" if notes else ""
            lines.append(f"| {link} | {c['id']}: {c['claim']} | {label(c['verdict'])}{small} | {diff} | {margin} | "
                         f"{_p(c.get('p_holm'))} | {c['n']} |")
    return "\n".join(lines) + "\n"


def replace_table(text: str, table: str, results_link: str = "") -> str:
    """``text`` with the block between the markers replaced by ``table`` (links prefixed by ``results_link``)."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"no claims table markers in the file; add the lines {BEGIN!r} and {END!r} where it goes")
    if results_link:
        table = table.replace("](", f"]({results_link}")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}{END}{tail}"
