"""A ladder's report: its table of points, the markdown, the plots and ladder.json.

    points = ladder_points(rows, init_loss)          # law.Point per run: compute = FLOPs per token x tokens
    write_report(ladder, out, rows, points, analysis, command=..., wall_s=..., data=..., tune=...)

report.md: the spec's header (its leading comment: the size, and what was cut to fit the budget and why), the
registered claims (``claims:``, as in the experiments: arms named by ``{arm:, rung:}``,
decided by ``decide.decide_claims`` with Holm over the ladder's claims; verdict.json beside it), the rungs
(parameters, tokens, FLOPs, rate, the mean final loss as the laws read it, the runs that did not learn), the
paired difference between arms at each rung by seed and its trend across rungs (a line on log compute, with
its held-out rung), each arm's fitted law with its intervals and its held-out check, the FLOPs and
wall-clock multipliers side by side at each rung, and their trend.
loss_vs_compute.png: every rung's mean loss per arm (±1 std over seeds) with the fitted laws;
difference_vs_compute.png: the paired differences with their intervals and lines;
multiplier_vs_compute.png: the multipliers with their intervals.
"""

from __future__ import annotations

import itertools
import math
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from ...run.checkpoint.atomic import atomic_write_text
from ..claims import capped
from ..decide import Decision, registration_text, write_decisions
from ..registration import registration_record
from ..report import figure, markdown_table, report_header, save, write_json
from ..sweep.tables import eval_slice_text
from ..sweep.tuning import grid_edge_text
from .law import LadderAnalysis, Point, analyze
from .spec import Ladder

__all__ = ["ENDPOINTS", "ladder_points", "markdown", "plot_differences", "plot_laws", "plot_multipliers",
           "write_report"]


def final_losses(rows: list[dict], init_loss: float) -> dict[int, float]:
    """seed -> the final loss of one cell (a diverged run counts as ln vocab: ``claims.capped``)."""
    return {r["seed"]: capped(r, init_loss) for r in rows}


ENDPOINTS = {"final_val_loss": final_losses}  # what a ladder's claims: may compare, per cell and seed


def ladder_points(rows: list[dict], init_loss: float, time: str = "wall_s") -> list[Point]:
    """One point per run: its arm, rung and seed, training FLOPs (FLOPs per token x tokens), final loss (a
    diverged run counts as ln vocab: ``claims.capped``, so every seed counts) and the time it took: its wall
    time, or with ``time="cpu_s"`` its process CPU time (NaN where a run recorded none)."""
    return [Point(r["arm"], r["rung"], int(r["seed"]), float(r["flops_per_token"]) * float(r["tokens"]),
                  capped(r, init_loss), _seconds(r.get(time))) for r in rows]


def _seconds(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):  # missing, or "" in a CSV row written before the column was kept
        return math.nan


def cpu_analysis(rows: list[dict], init_loss: float, compare, n_resamples: int) -> LadderAnalysis | None:
    """The ladder's laws and multipliers read on process CPU time instead of wall time (the multipliers'
    time column), or None unless every run recorded its CPU time. On a shared machine other programs
    stretch wall time unevenly between arms; CPU time they disturb far less."""
    points = ladder_points(rows, init_loss, time="cpu_s")
    if not points or not all(math.isfinite(p.wall_s) and p.wall_s > 0 for p in points):
        return None
    return analyze(points, compare, n_resamples=n_resamples)


# ============================================================== markdown
def _rung_table(ladder: Ladder, rows: list[dict], points: list[Point]) -> list[dict[str, Any]]:
    """A line per rung and arm. Its final loss is the mean the laws and claims read (``points``: a diverged
    run counts as the untrained loss), and "not learned" counts the runs that diverged or ended no better
    than the unigram loss, which a depth ladder asks about."""
    out = []
    for r in ladder.rungs:
        for a in ladder.arms:
            name, b = f"{a}-{r}", ladder.budgets[f"{a}-{r}"]
            cfg = ladder.sweep.configs[name]
            runs = [x for x in rows if x["variant"] == name]
            losses = [p.loss for p in points if p.arm == a and p.rung == r]
            out.append({
                "rung": r, "arm": a, "d_model": cfg.model.d_model, "layers": cfg.model.n_layers,
                "total params": f"{b['total']:,}", "active params": f"{b['active']:,}", "budget": b["rule"],
                "tokens": f"{b['tokens']:,}", "FLOPs": f"{b['flops']:.3g}",
                _field(ladder): f"{_rate(cfg, ladder):g}",
                "final loss": f"{statistics.fmean(losses):.3f}" if losses else "—",
                "not learned": _not_learned(runs) if runs else "—",
                "wall (s)": f"{statistics.fmean(x['wall_s'] for x in runs):.0f}" if runs else "—",
            })
    return out


def _not_learned(runs: list[dict]) -> str:
    """"0 of 4", or "3 of 4 (2 diverged)": the runs that diverged or ended no better than unigram."""
    diverged = sum(x.get("status") == "diverged" for x in runs)
    flat = sum(x.get("status") == "no better than unigram" for x in runs)
    return f"{diverged + flat} of {len(runs)}" + (f" ({diverged} diverged)" if diverged else "")


def budget_note(ladder: Ladder, rows: list[dict]) -> str:
    """A line when a run's model is not the one its budget counted (the data's vocabulary differs from the
    spec's model.vocab_size): the budget then bought tokens for other parameter counts."""
    off = sorted({r["variant"] for r in rows if r["variant"] in ladder.budgets
                  and int(r["active_params"]) != ladder.budgets[r["variant"]]["active"]})
    if not off:
        return ""
    return (f"**Budget counted other models**: the runs of {', '.join(off)} have other parameter counts than their "
            "budget counted (the spec's model.vocab_size is not the tokenizer's?); give model.vocab_size the "
            "tokenizer's vocabulary.\n\n")


def _seeds_note(analysis: LadderAnalysis) -> str:
    n = len(analysis.seeds)
    return (f" With {n} seeds a bootstrap has few distinct resamples: read these intervals as rough." if n < 5
            else "")


def _field(ladder: Ladder) -> str:
    return (ladder.rates or {}).get("field", "optim.lr")


def _rate(cfg, ladder: Ladder) -> float:
    obj = cfg
    for part in _field(ladder).split("."):
        obj = getattr(obj, part)
    return obj


def rates_text(ladder: Ladder, tune: dict | None) -> str:
    if not ladder.rates:
        return "Rates: no tuning; every run trains at the rate its config gives.\n\n"
    r = ladder.rates
    how = ("tuned at the smallest rung and carried to every rung (μP transfer when the model is "
           "parametrized so; under the standard parametrization a choice this report cannot check)"
           if r["mode"] == "transfer" else "tuned at every rung")
    chosen = ", ".join(f"{g} {v:g}" for g, v in (tune or {}).get("chosen", {}).items())
    return (f"Rates: {r['field']} {how}, by arm, from {r['values']} with seeds {r['seeds']} at full length (the grid "
            f"extends past an edge that holds a group's best value); chosen: {chosen or '—'}. "
            + grid_edge_text(tune) + "\n\n")


def _differences(analysis: LadderAnalysis) -> list[dict[str, Any]]:
    out = []
    for p in analysis.pairs:
        for r in p.rungs:
            if r.difference is not None:
                out.append({"rung": r.rung, "comparison": f"{p.arm} − {p.baseline}",
                            "difference [95% CI] (nats)": r.difference.text(), "seeds": r.difference.n})
    return out


def _difference_trends(analysis: LadderAnalysis) -> list[dict[str, Any]]:
    out = []
    for p in analysis.pairs:
        t = p.difference_trend
        if t is None:
            continue
        h = t.heldout
        out.append({
            "comparison": f"{p.arm} − {p.baseline}", "rungs": t.rungs,
            "slope per doubling of FLOPs [95% CI] (nats)": t.slope.text(signed=True), "direction": t.direction,
            "held-out rung": h.rung if h else "— (needs 4 rungs)",
            "predicted": h.predicted.text(signed=True) if h else "—",
            "measured": h.measured.text(signed=True) if h else "—", "error": h.error.text(signed=True) if h else "—",
        })
    return out


def differences_text(analysis: LadderAnalysis) -> str:
    """The per-rung table, then the line through it across rungs (a description, not a registered claim)."""
    text = "## Per rung: paired differences\n\n" + markdown_table(_differences(analysis))
    trends = _difference_trends(analysis)
    if not trends:
        return text
    return (text + "\nAcross rungs: a least-squares line through each rung's mean difference against log2 of the "
            "arm's FLOPs (the slope is nats per doubling of compute; < 0: the arm gains on its baseline as compute "
            "grows), and the same line fitted without the largest rung, predicting it (error = predicted − "
            "measured). It reads the arms' losses directly, without a law per arm, so it reads a ladder whose loss "
            "does not fall with compute. A description, not a registered claim.\n\n"
            + markdown_table(trends) + "\n![difference vs compute](difference_vs_compute.png)\n")


def _laws(analysis: LadderAnalysis) -> list[dict[str, Any]]:
    out = []
    for a in analysis.arms.values():
        h = a.heldout
        out.append({
            "arm": a.arm, "E": a.E.text() + (" (at its bound 0)" if a.law.E_at_bound else ""),
            "A": a.A.text() + (" (flat)" if a.law.flat else ""),
            "α": a.alpha.text() + (" (at a bound)" if a.law.at_bound else ""),
            "points": a.points, "seeds": a.seeds,
            "held-out rung": h.rung if h else "— (needs 4 rungs)",
            "predicted": h.predicted.text() if h else "—", "measured": h.measured.text() if h else "—",
            "error": h.error.text(signed=True) if h else "—",
        })
    return out


def _bound_note(analysis: LadderAnalysis) -> str:
    """A sentence when an arm's E sits at its bound 0: what that says about the law its multipliers read."""
    at = [a.arm for a in analysis.arms.values() if a.law.E_at_bound]
    if not at:
        return ""
    return (f"\n{' and '.join(at)}: E sits at its bound 0. Over these rungs the loss falls faster than a law with "
            "a floor E > 0 can follow, so the fit is a pure power law; the multipliers read that shape, and the "
            "held-out check below says how well it predicts.\n")


def _flat_note(analysis: LadderAnalysis) -> str:
    """A sentence when an arm's law is flat (A = 0): its loss does not fall with compute, so no multiplier."""
    flat = [a.arm for a in analysis.arms.values() if a.law.flat]
    if not flat:
        return ""
    return (f"\n{', '.join(flat)}: flat (A = 0). Over these rungs the loss does not fall with compute, so the best "
            "law of this shape is the mean loss and α is not identified; it reaches no loss at any particular "
            "compute, and no multiplier is read off it (*no law* below). The paired differences and their trend "
            "across rungs (above) read the ladder without a law.\n")


def _multipliers(analysis: LadderAnalysis, cpu: LadderAnalysis | None = None) -> list[dict[str, Any]]:
    out = []
    cpu_rungs = {(p.arm, p.baseline, r.rung): r for p in (cpu.pairs if cpu else ()) for r in p.rungs}
    for p in analysis.pairs:
        for r in p.rungs:
            row = {
                "comparison": f"{p.arm} over {p.baseline}", "rung": r.rung, "FLOPs": f"{r.compute:.3g}",
                "arm's loss": f"{r.loss:.3f}", "FLOPs multiplier [95% CI]": _multiplier(r.flops, r.status),
                "wall-clock multiplier [95% CI]": _multiplier(r.wall, r.wall_status),
            }
            if cpu:
                c = cpu_rungs.get((p.arm, p.baseline, r.rung))
                row["CPU-time multiplier [95% CI]"] = _multiplier(c.wall, c.wall_status) if c else "—"
            out.append(row)
    return out


def _multiplier(estimate, status: str) -> str:
    if estimate is None:
        return "—"
    return "— (no law)" if status == "no law" else f"{estimate.text('x')} ({status})"


def trend_text(analysis: LadderAnalysis) -> str:
    lines = []
    for p in analysis.pairs:
        t = p.trend
        if all(r.status == "no law" for r in p.rungs):
            lines.append(f"- {p.arm} over {p.baseline}: no multiplier, so no trend: {p.baseline}'s law is flat.")
            continue
        lines.append(f"- {p.arm} over {p.baseline}: the FLOPs multiplier **{t.direction}** with compute; slope of "
                     f"log(multiplier) on log(FLOPs) over {t.rungs} rungs {t.slope.text(signed=True)} "
                     f"(> 0: {p.arm}'s saving grows with compute).")
    return "\n".join(lines) + "\n"


def spec_header_text(ladder: Ladder) -> str:
    """The spec file's leading comment, verbatim: a ladder spec says there how it was sized and what was cut to
    fit the budget, and why, which its report must state too. "" when the spec has none or is not a file."""
    try:
        lines = Path(ladder.source).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return ""
    head = list(itertools.takewhile(lambda line: line.startswith("#"), lines))
    if not head:
        return ""
    quoted = "\n".join(f"> {line[1:].strip()}".rstrip() for line in head)  # a bare '#' keeps its paragraph break
    return ("## Size, and what was cut (the spec's header)\n\n"
            f"The leading comment of `{Path(ladder.source).name}`, as committed (a change to it after registration is "
            "listed above):\n\n" + quoted + "\n\n")


def criteria_text(ladder: Ladder, decisions: list[Decision]) -> str:
    """The registered claims and their rules, stated before any number ("" for a ladder without claims:)."""
    if not decisions:
        return ""
    return ("## Criteria (registered before the runs)\n\n" + registration_text(ladder.sweep.registration)
            + "\n".join(f"- **{d.spec.id}** — {d.spec.claim}. {d.spec.criterion()}" for d in decisions) + "\n\n")


def verdicts_text(decisions: list[Decision]) -> str:
    return ("## Verdicts\n\n" + "\n".join(d.line() for d in decisions) + "\n\n") if decisions else ""


def markdown(ladder: Ladder, rows: list[dict], points: list[Point], analysis: LadderAnalysis, *, command: str,
             wall_s: float, data: dict | None, tune: dict | None, tuning: list[dict] | None,
             decisions: list[Decision] = (), cpu: LadderAnalysis | None = None) -> str:
    spec = ladder.sweep
    c0 = analysis.c0
    text = report_header(f"Ladder {ladder.name}: {' vs '.join(ladder.arms)} over {len(ladder.rungs)} rungs", command,
                         spec, wall_s, rows, data, tuning=tuning)
    text += (
        "## What was measured\n\n" + (spec.description + "\n\n" if spec.description else "")
        + f"Arms {ladder.arms} at rungs {ladder.rungs} (smallest first), every cell trained at seeds {spec.seeds}. "
        "A rung is a model size and a token budget; a run's compute C is its training FLOPs (FLOPs per token, "
        "6N + attention, times the tokens it trained on). " + eval_slice_text(spec) + ".\n\n"
        + rates_text(ladder, tune) + markdown_table(_rung_table(ladder, rows, points)) + "\n"
        + budget_note(ladder, rows)
        + "\n" + spec_header_text(ladder) + criteria_text(ladder, list(decisions)) + "## Method\n\n"
        f"Per arm, L(C) = E + A·(C/C0)^-α with C0 = {c0:.3g} FLOPs, fitted by least squares over every run of every "
        "seed (E ≥ 0, A ≥ 0; the exponent searched over [0.001, 3], `ladder/law.py`). The multiplier of an arm "
        "over its baseline at a rung is the compute the baseline's law needs to reach the arm's mean loss there, "
        "over the compute the arm spent (> 1: the arm saves compute); *extrapolated* when the baseline's law "
        "reaches it outside the baseline's measured compute, *unreachable* when the loss lies below the "
        "baseline's asymptote E, *no law* when the baseline's law is flat (A = 0: its loss does not fall with "
        "compute, so it reaches no loss at any particular compute). Every seed counts: none is dropped. The "
        "wall-clock multiplier reads laws fitted to wall time on the machine in the header"
        + (", the CPU-time multiplier the same laws fitted to each run's "
        "process CPU time (all its threads), which other programs on a shared machine disturb far less"
        if cpu else "") + ". Intervals: 95% percentile bootstrap over seeds "
        f"({analysis.n_resamples} resamples of the seeds, paired across arms, everything refitted; "
        "`scipy.stats.bootstrap`; on synthetic ladders of 8 seeds they cover the true value about 90% of the "
        "time, tests/test_ladder.py)." + _seeds_note(analysis) + " Per rung, the paired difference between arms by "
        "seed is Student's t, as in the experiments.\n\n"
        + differences_text(analysis)
        + "\n## Laws\n\n" + markdown_table(_laws(analysis))
        + _bound_note(analysis) + _flat_note(analysis)
        + "\nHeld-out check: each arm's law fitted on every rung but the largest predicts the largest rung's mean "
        "loss; the error is predicted − measured.\n\n![loss vs compute](loss_vs_compute.png)\n\n"
        "## Compute multiplier\n\n" + markdown_table(_multipliers(analysis, cpu))
        + "\n" + trend_text(analysis) + "\n![multiplier vs compute](multiplier_vs_compute.png)\n\n"
        "Wall-clock figures are this machine and this implementation (see the header), not a property of the "
        "architecture; the FLOPs multiplier is.\n\n" + verdicts_text(list(decisions))
    )
    return text


# ============================================================== plots
def plot_laws(analysis: LadderAnalysis, points: list[Point], path: Path) -> str:
    plt = figure()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm, fit in analysis.arms.items():
        pts = [p for p in points if p.arm == arm]
        rungs = sorted({p.rung for p in pts}, key=lambda r: statistics.fmean(p.compute for p in pts if p.rung == r))
        c = [statistics.fmean(p.compute for p in pts if p.rung == r) for r in rungs]
        ys = [[p.loss for p in pts if p.rung == r] for r in rungs]
        m = [statistics.fmean(y) for y in ys]
        s = [statistics.stdev(y) if len(y) > 1 else 0.0 for y in ys]
        line = ax.errorbar(c, m, yerr=s, fmt="o", capsize=3, label=f"{arm} (±1 std over {fit.seeds} seeds)")
        grid = np.geomspace(min(c) / 1.5, max(c) * 1.5, 100)
        ax.plot(grid, fit.law.loss(grid), color=line[0].get_color(), alpha=0.7,
                label=f"{arm}: {fit.law.E:.2f} + {fit.law.A:.2f}·(C/{analysis.c0:.0e})^-{fit.law.alpha:.3f}")
    _finish(ax, "training FLOPs", "final validation loss (nats/token)", "Loss vs compute, with each arm's fitted law",
            "no arm with a law")
    return save(fig, path)


def plot_multipliers(analysis: LadderAnalysis, path: Path) -> str:
    plt = figure()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in analysis.pairs:
        for kind, get in (("FLOPs", lambda r: r.flops), ("wall clock", lambda r: r.wall)):
            rs = [r for r in p.rungs if get(r) is not None and math.isfinite(get(r).value)]
            if not rs:
                continue
            c = [r.compute for r in rs]
            v = [get(r).value for r in rs]
            ax.errorbar(c, v, yerr=_error_bars(v, [get(r).lo for r in rs], [get(r).hi for r in rs]),
                        fmt="o-" if kind == "FLOPs" else "s--", capsize=3,
                        label=f"{p.arm} over {p.baseline}, {kind} (slope {p.trend.slope.value:+.3f})"
                        if kind == "FLOPs" else f"{p.arm} over {p.baseline}, {kind}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    _finish(ax, "training FLOPs of the arm", "multiplier (95% bootstrap interval)",
            "Compute the baseline needs for the arm's loss, over the arm's",
            "no finite multiplier: each baseline's law is flat or out of reach (report.md)")
    return save(fig, path)


def plot_differences(analysis: LadderAnalysis, path: Path) -> str:
    """Each pair's paired difference at each rung (95% t interval over seeds) and its line on log2 FLOPs."""
    plt = figure()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in analysis.pairs:
        rs = [r for r in p.rungs if r.difference is not None and math.isfinite(r.difference.mean)]
        if not rs:
            continue
        c = [r.compute for r in rs]
        m = [r.difference.mean for r in rs]
        line = ax.errorbar(c, m, yerr=_error_bars(m, [r.difference.lo for r in rs], [r.difference.hi for r in rs]),
                           fmt="o", capsize=3, label=f"{p.arm} − {p.baseline} (95% t interval)")
        for r, x, y in zip(rs, c, m):
            ax.annotate(r.rung, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        t = p.difference_trend
        if t is not None and math.isfinite(t.slope.value):  # the line the report's table gives
            grid = np.geomspace(min(c), max(c), 50)
            ax.plot(grid, t.intercept + t.slope.value * np.log2(grid), color=line[0].get_color(), alpha=0.7,
                    label=f"{p.arm} − {p.baseline}: {t.slope.value:+.3f} nats per doubling")
    ax.axhline(0.0, color="grey", linewidth=0.8)
    _finish(ax, "training FLOPs of the arm", "final loss, arm − baseline (nats)",
            "Paired difference at each rung, and its trend", "no rung that both arms of a pair have")
    return save(fig, path)


def _error_bars(values: list[float], lo: list[float], hi: list[float]) -> list[list[float]]:
    """matplotlib's [below, above] error lengths from intervals; an end that is not finite draws no bar."""
    return [[max(0.0, v - a) if math.isfinite(a) else 0.0 for v, a in zip(values, lo)],
            [max(0.0, b - v) if math.isfinite(b) else 0.0 for v, b in zip(values, hi)]]


def _finish(ax, xlabel: str, ylabel: str, title: str, empty: str) -> None:
    """Log compute axis, labels, grid; the legend, or where nothing was drawn, a line saying why (an empty
    legend only warns)."""
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", va="center", fontsize=8, wrap=True)


def write_report(ladder: Ladder, out: Path, rows: list[dict], points: list[Point], analysis: LadderAnalysis, *,
                 command: str, wall_s: float, data: dict | None, tune: dict | None,
                 tuning: list[dict] | None, decisions: list[Decision] = (), cpu: LadderAnalysis | None = None) -> Path:
    """report.md, the two plots and ladder.json (the analysis, the budgets, the registration) in ``out``; with
    registered claims, verdict.json too (``decide.write_decisions``, as an experiment's)."""
    out = Path(out)
    plots = [plot_laws(analysis, points, out / "loss_vs_compute.png"),
             plot_differences(analysis, out / "difference_vs_compute.png"),
             plot_multipliers(analysis, out / "multiplier_vs_compute.png")]
    atomic_write_text(out / "report.md", markdown(ladder, rows, points, analysis, command=command, wall_s=wall_s,
                                                  data=data, tune=tune, tuning=tuning, decisions=decisions, cpu=cpu))
    if decisions:
        write_decisions(out, ladder.name, list(decisions), {"plots": plots, "data": data, "seeds": ladder.sweep.seeds,
                                                            "registration": registration_record(ladder.sweep)})
    write_json(out / "ladder.json", {"ladder": ladder.name, "arms": ladder.arms, "rungs": ladder.rungs,
                                     "budgets": ladder.budgets, "rates": ladder.rates, "tune": tune,
                                     "analysis": analysis.to_json(),
                                     "analysis_cpu_time": cpu.to_json() if cpu else None, "plots": plots, "data": data,
                                     "registration": registration_record(ladder.sweep)})
    return out / "report.md"
