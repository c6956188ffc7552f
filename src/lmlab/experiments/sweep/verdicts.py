"""A user's sweep decided: every variant's paired difference against a baseline, and the spec's own
``claims:`` under the rules the registered experiments use (``decide.decide_claims``).

    check_claims(spec)                                 # before any run: claims a sweep can decide, or one line
    found = compare_variants(spec, rows, init_loss)    # differences by seed; the claims decided, Holm over them
    found.markdown, found.console, found.decisions     # summary.md's sections, what ``lmlab sweep`` prints
    write_verdict(out, spec, found.decisions)          # verdict.json (decide.py's schema), or none without claims
    sweep_registration("ablation.yaml", register=True)  # refuses a spec not committed unchanged with an id

Without ``claims:``, the summary gives each variant's final loss minus the baseline's (``baseline:``, by
default the first variant), paired by seed, with its 95% t interval: numbers, not verdicts. With
``claims:`` (the experiments' format: ``compare: [A, B]``, ``endpoint``, ``claimed``, ``margin``, ...),
each claim is decided as an experiment's is: a one-sided paired t test in the claimed direction with
Holm's adjustment over the sweep's claims, TOST against the claim's margin for a tie, the sign-flip p
beside it, and the power for the claim's effect at the spread the seeds measured.

A sweep's endpoints (``ENDPOINTS``): ``final_val_loss`` (one variant per arm) and ``best_over_variants``
(per seed, the lowest final loss over the variants an arm's grid labels select, e.g. each
architecture at its best rate). Either counts a diverged run at ln vocab (``claims.capped``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path
from typing import Any

from .. import claims as claims_module
from .. import decide as decide_module
from .. import stats
from ..claims import arm_name, arm_rows, capped
from ..decide import Decision, decide_claims, registration_text, write_decisions
from ..registration import NotRegistered, Registration, banner, changes_section, registration_record, spec_status
from ..report import markdown_table, text_table
from ..spec import SweepSpec

__all__ = ["ENDPOINTS", "Found", "check_claims", "compare_variants", "sweep_registration", "write_verdict"]


# ============================================================== endpoints (an arm's rows in, seed -> value out)
def final_losses(rows: list[dict], init_loss: float) -> dict[int, float]:
    """seed -> the run's final loss (a diverged run counts as ln vocab)."""
    return {r["seed"]: capped(r, init_loss) for r in rows}


def best_over_variants(rows: list[dict], init_loss: float) -> dict[int, float]:
    """seed -> the lowest final loss over the arm's variants (each capped at ln vocab)."""
    out: dict[int, float] = {}
    for r in rows:
        out[r["seed"]] = min(out.get(r["seed"], math.inf), capped(r, init_loss))
    return out


ENDPOINTS = {"final_val_loss": final_losses, "best_over_variants": best_over_variants}
ONE_RUN = ("final_val_loss",)  # endpoints that read one run per seed: each arm names one variant


# ============================================================== before the runs
def check_claims(spec: SweepSpec) -> None:
    """Refuse, in one line naming the claim, what a sweep cannot decide as written: an endpoint it does
    not measure, a gate or a re-analysis (an experiment's module supplies those), an arm of a one-run
    endpoint that selects several variants, or a correction or alpha other than Holm's at (0, 0.5)."""
    block = spec.registration or {}
    if spec.claims and block.get("correction", "holm") != "holm":
        raise ValueError(f"{spec.source}: registration.correction={block['correction']!r}; a sweep's claims are "
                         "corrected by Holm's step-down over the sweep: give correction: holm")
    alpha = block.get("alpha", 0.05)
    if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and 0 < alpha < 0.5):
        raise ValueError(f"{spec.source}: registration.alpha={alpha!r} is not valid; give a level in (0, 0.5), "
                         "e.g. 0.05")
    for c in spec.claims:
        where = f"{spec.source}: claim {c.id!r}"
        if c.endpoint not in ENDPOINTS:
            raise ValueError(f"{where}: endpoint {c.endpoint!r} is not one a sweep measures; choose final_val_loss "
                             "(one variant per arm) or best_over_variants (per seed, the best over an arm's variants)")
        if c.gate:
            raise ValueError(f"{where}: gate: is a precondition an experiment's module checks; a sweep has none, "
                             "so it would be ignored: drop it")
        if c.analysis != "rerun":
            raise ValueError(f"{where}: analysis: {c.analysis} reads an experiment's earlier runs; a sweep decides "
                             "on its own runs: drop it")
        if c.endpoint in ONE_RUN:
            for arm in c.compare:
                names = [r["variant"] for r in arm_rows([{"variant": v.name, **v.labels} for v in spec.variants], arm)]
                if len(names) != 1:
                    raise ValueError(f"{where}: arm {arm_name(arm)!r} selects {len(names)} variants {names}; "
                                     f"endpoint {c.endpoint} compares one run per seed: name one variant, or use "
                                     "endpoint best_over_variants")


def sweep_registration(path: str | Path, *, register: bool = False) -> Registration:
    """What git says about the sweep's spec (later commits to the deciding code listed as an experiment's
    are). With ``register``, a spec that is not registered (committed, no staged or unstaged change, with a
    ``registration: id``) is refused with NotRegistered (exit 2) before anything is written."""
    related = [stats.__file__, claims_module.__file__, decide_module.__file__, __file__]
    status = spec_status(path, related)
    if register and not status.registered:
        raise NotRegistered(f"--register: spec {path} is not registered ({status.problem}); commit it unchanged "
                            "with a registration: {id: ...} block, or run without --register")
    return status


# ============================================================== after the runs
@dataclasses.dataclass
class Found:
    """What a sweep's summary states beyond mean ± std: the differences table and the claims decided."""

    baseline: str
    differences: list[dict[str, Any]]  # one row per other variant
    decisions: list[Decision]
    markdown: str  # summary.md's sections
    console: str  # the same, shorter, for the terminal


def _paired(rows: list[dict], a: str, b: str, init_loss: float) -> tuple[list[int], list[float], list[float]]:
    va = final_losses([r for r in rows if r["variant"] == a], init_loss)
    vb = final_losses([r for r in rows if r["variant"] == b], init_loss)
    seeds = sorted(set(va) & set(vb))
    return seeds, [va[s] for s in seeds], [vb[s] for s in seeds]


def _mean(values: list[float]) -> str:
    return f"{statistics.fmean(values):.4f}" if values else "—"


def differences(spec: SweepSpec, rows: list[dict], init_loss: float) -> tuple[str, list[dict[str, Any]]]:
    """(baseline, one row per other variant): its final loss minus the baseline's, paired by seed, with the
    95% t interval over the seeds both trained."""
    base = spec.baseline or spec.variants[0].name
    table = []
    for v in spec.variants:
        if v.name == base:
            continue
        seeds, a, b = _paired(rows, v.name, base, init_loss)
        iv = stats.paired_interval(a, b)
        table.append({"variant": v.name, "paired seeds": len(seeds), "final_val_loss": _mean(a),
                      f"{base}": _mean(b), f"minus {base} [95% CI]": iv.text(4) if seeds else "—"})
    return base, table


def compare_variants(spec: SweepSpec, rows: list[dict], init_loss: float) -> Found:
    """The differences against the baseline and, with ``claims:``, every claim decided (Holm over the sweep)."""
    base, table = differences(spec, rows, init_loss)
    cap = f"a diverged run counts as ln vocab = {init_loss:.3f}"
    head = (f"## Paired differences against {base}\n\nEach variant's final_val_loss minus {base}'s, seed by seed "
            f"({cap}): the mean over the seeds both trained and its 95% Student's t interval. An interval that "
            "excludes 0 is not a verdict; a claim registered in the spec's claims: is decided below.\n\n")
    markdown = head + (markdown_table(table) if table else "(one variant: nothing to compare)\n")
    console = f"final_val_loss minus {base}'s, paired by seed (95% t interval):\n" + (text_table(table) if table
                                                                                        else "(one variant)\n")
    decisions: list[Decision] = []
    if spec.claims:
        alpha = (spec.registration or {}).get("alpha", 0.05)
        decisions = decide_claims(spec.claims, rows, None, ENDPOINTS, init_loss=init_loss, alpha=alpha)
        status = spec.registration_status
        markdown += (
            "\n## Claims\n\n" + banner(status) + registration_text(spec.registration, family="sweep")
            + "### Criteria (stated in the spec before the runs)\n\n"
            + "\n".join(f"- **{d.spec.id}** — {d.spec.claim}. {d.spec.criterion()}" for d in decisions) + "\n\n"
            + "### Verdicts\n\n" + "\n".join(d.line() for d in decisions) + "\n\n"
            + (changes_section(status, spec.registration) if status is not None and status.registered else ""))
        family = sum(1 for d in decisions if len(d.seeds) > 1 and not d.untestable)  # what Holm adjusted over
        console += (f"\nclaims (Holm over {family}" + (f" of {len(decisions)}" if family < len(decisions) else "")
                    + f", alpha {alpha:g}"
                    + ("" if status is not None and status.registered else "; the spec is not registered")
                    + "):\n" + "\n".join(d.line() for d in decisions) + "\n")
    return Found(base, table, decisions, markdown, console)


def write_verdict(out: Path, spec: SweepSpec, decisions: list[Decision]) -> Path | None:
    """out/verdict.json (``decide.write_decisions``) when the spec has claims; without claims, an earlier
    invocation's verdict.json is removed, so that no file states verdicts the spec no longer makes."""
    path = Path(out) / "verdict.json"
    if not spec.claims:
        path.unlink(missing_ok=True)
        return None
    return write_decisions(out, spec.name, decisions, {"seeds": spec.seeds, "baseline": spec.baseline,
                                                       "registration": registration_record(spec)})
