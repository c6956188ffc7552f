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
from typing import Any

from ..run.checkpoint.atomic import atomic_write_text
from ..run.metrics import jsonable
from .stats import Claimed, Interval, Verdict, decide, label

SCHEMA = 2
BEGIN, END = (
    "<!-- claims-table: generated from results/*/verdict.json; do not edit by hand -->",
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
    v = row.get("final_val_loss")
    return v if row.get("status") != "diverged" and isinstance(v, float) and math.isfinite(v) else init_loss


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


# ============================================================== the README's table
def _cell(x: float | None) -> str:
    return f"{x:+.3f}" if isinstance(x, (int, float)) and math.isfinite(x) else "—"


def claims_table(results: str | Path) -> str:
    """A markdown table of every claim in ``results``/*/verdict.json (schema 2), with its verdict and interval."""
    lines = ["| experiment | claim | verdict | difference [95% CI] | tie margin | seeds |", "|---|---|---|---|---|---|"]
    for path in sorted(Path(results).glob("*/verdict.json")):
        data = json.loads(path.read_text())
        if data.get("schema") != SCHEMA:
            lines.append(
                f"| [{path.parent.name}]({path.parent.name}/report.md) | (an older report without intervals) "
                "| — | — | — | — |"
            )
            continue
        for c in data["claims"]:
            ci = c.get("ci95") or [None, None]
            diff = (
                f"{_cell(c['difference'])} [{_cell(ci[0])}, {_cell(ci[1])}] {c['unit']}"
                if c["difference"] is not None
                else "—"
            )
            margin = (
                f"±{c['margin']:.3f}"
                if isinstance(c.get("margin"), (int, float)) and math.isfinite(c["margin"])
                else "—"
            )
            small = (
                " (inside the tie margin)" if c.get("negligible") else " (untestable)" if c.get("untestable") else ""
            )
            lines.append(f"| [{data['experiment']}]({path.parent.name}/report.md) | {c['id']}: {c['claim']} | "
                         f"{label(c['verdict'])}{small} | {diff} | {margin} | {c['n']} |")
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
