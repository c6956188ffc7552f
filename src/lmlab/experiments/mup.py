"""Learning-rate transfer across width, measured: μP against standard parametrization (``lmlab.mup``).

Arms: standard and μP (base shape d_model 64), each at four widths and every rate of a grid (mup.yaml;
the grid extends past an edge that holds a width's best rate). A seed's best rate at a width is read
from its whole loss-vs-rate curve (:func:`optimum`), and a claim compares how far it moves from the
narrowest width to the widest, in grid steps (log2 of the rate).

The claims, their arms, endpoints and margins are registered in mup.yaml before the runs; this module
supplies the endpoints they name (``ENDPOINTS``), the plots and the report.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from ..run.checkpoint.atomic import atomic_write_text
from .claims import capped
from .decide import decide_claims, registration_text, write_decisions
from .norm import by_seed, extension_text, with_rates
from .registration import registration_record
from .report import band_plot, figure, markdown_table, report_header, save
from .sweep import Hooks as SweepHooks
from .sweep.tables import eval_slice_text

__all__ = ["ENDPOINTS", "Hooks", "analyze", "optimum"]
COLORS = {64: "tab:blue", 128: "tab:green", 256: "tab:orange", 512: "tab:red"}


class Hooks(SweepHooks):
    """No measurement beyond the sweep's own: the final losses are the data."""

    def __init__(self, spec):
        pass


# ============================================================== the best rate of one curve
def optimum(points: list[tuple[float, float]]) -> tuple[float, bool]:
    """(log2 of the best rate, at_edge) of one loss-vs-rate curve, ``points`` = [(rate, loss)]. The
    vertex of the parabola through the lowest loss and its two neighbours in log2(rate), clipped to
    the neighbours; the rate of the lowest loss itself, flagged, when that is an end of the grid (or
    the parabola opens downward, which three points around a minimum cannot do unless two tie)."""
    pts = sorted((math.log2(rate), loss) for rate, loss in points)
    i = min(range(len(pts)), key=lambda j: pts[j][1])
    if i == 0 or i == len(pts) - 1:
        return pts[i][0], True
    (x0, y0), (x1, y1), (x2, y2) = pts[i - 1 : i + 2]
    # the parabola's vertex, Lagrange form: -b / 2a of the quadratic through the three points
    num = (x1 - x0) ** 2 * (y1 - y2) - (x1 - x2) ** 2 * (y1 - y0)
    den = (x1 - x0) * (y1 - y2) - (x1 - x2) * (y1 - y0)
    if den == 0:
        return x1, False
    return min(max(x1 - 0.5 * num / den, x0), x2), False


def optima(rows: list[dict], init_loss: float) -> dict[tuple[int, int], tuple[float, bool]]:
    """(seed, d_model) -> :func:`optimum` of that seed's curve at that width (a diverged run's loss is ln vocab)."""
    curves: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for r in rows:
        curves.setdefault((r["seed"], r["d_model"]), []).append((r["lr_value"], capped(r, init_loss)))
    return {key: optimum(points) for key, points in curves.items() if len(points) >= 3}


# ============================================================== endpoints (pure: an arm's rows in, seed -> value out)
def optimum_shift(rows: list[dict], init_loss: float) -> dict[int, float]:
    """seed -> log2(best rate at the widest width) - log2(best rate at the narrowest): the move in grid steps."""
    found = optima(rows, init_loss)
    widths = sorted({w for _, w in found})
    out = {}
    for seed in sorted({s for s, _ in found}):
        if (seed, widths[0]) in found and (seed, widths[-1]) in found:
            out[seed] = found[seed, widths[-1]][0] - found[seed, widths[0]][0]
    return out


def abs_optimum_shift(rows: list[dict], init_loss: float) -> dict[int, float]:
    """seed -> |optimum_shift|: how far the best rate moves, either way."""
    return {s: abs(v) for s, v in optimum_shift(rows, init_loss).items()}


ENDPOINTS = {"optimum_shift": optimum_shift, "abs_optimum_shift": abs_optimum_shift}


# ============================================================== tables and plots
def with_widths(spec, rows: list[dict]) -> list[dict]:
    """Rows with their rate (``lr_value``) and width (``d_model``) as numbers, from their variant's config."""
    return [{**r, "d_model": spec.configs[r["variant"]].model.d_model} for r in with_rates(spec, rows)]


def _ms(values: list[float], fmt: str = ".3f") -> str:
    v = [x for x in values if math.isfinite(x)]
    if len(v) > 1:
        return f"{statistics.fmean(v):{fmt}} ± {statistics.stdev(v):{fmt}}"
    return f"{v[0]:{fmt}}" if v else "—"


def rate_table(rows: list[dict], init_loss: float) -> list[dict]:
    """Per parametrization and width: the best rate (per seed, then its geometric mean and the spread in grid
    steps), the seeds whose best was at a grid edge, the best loss, and the loss at the narrowest width's best
    rate carried over (what a transferred rate costs)."""
    table = []
    for param in dict.fromkeys(r["param"] for r in rows):
        arm = [r for r in rows if r["param"] == param]
        found = optima(arm, init_loss)
        widths = sorted({w for _, w in found})
        for width in widths:
            logs = [v for (s, w), (v, _) in found.items() if w == width]
            edges = sum(edge for (s, w), (_, edge) in found.items() if w == width)
            cells = [r for r in arm if r["d_model"] == width]
            best = [min(capped(r, init_loss) for r in runs) for runs in by_seed(cells).values()]
            table.append({
                "param": param, "d_model": width,
                "best rate (geo. mean)": f"{2 ** statistics.fmean(logs):.2e}" if logs else "—",
                "log2 best rate": _ms(logs, ".2f"), "at a grid edge": f"{edges} of {len(logs)}",
                "best loss": _ms(best),
                "loss at w{}'s best grid rate".format(widths[0]): _ms(transferred_loss(arm, width, widths[0],
                                                                                        init_loss)),
            })
    return table


def transferred_loss(arm: list[dict], width: int, base: int, init_loss: float) -> list[float]:
    """Per seed, the loss at ``width`` at the grid rate that was best at width ``base`` for that seed."""
    out = []
    for seed, runs in by_seed(arm).items():
        at_base = [r for r in runs if r["d_model"] == base]
        if not at_base:
            continue
        rate = min(at_base, key=lambda r: capped(r, init_loss))["lr_value"]
        there = [capped(r, init_loss) for r in runs if r["d_model"] == width and r["lr_value"] == rate]
        out += there[:1]
    return out


def plot_loss_vs_rate(rows: list[dict], out: Path, limits: dict) -> str:
    """Final loss against rate, a line per width, a panel per parametrization (mean ± 1 std over seeds)."""
    plt = figure()
    params = list(dict.fromkeys(r["param"] for r in rows))
    fig, axes = plt.subplots(1, len(params), figsize=(6 * len(params), 4.3), sharey=True, squeeze=False)
    for ax, param in zip(axes[0], params):
        arm = [r for r in rows if r["param"] == param]
        for width in sorted({r["d_model"] for r in arm}):
            cells = [r for r in arm if r["d_model"] == width]
            curves = [sorted((r["lr_value"], capped(r, limits["init"])) for r in runs)
                      for runs in by_seed(cells).values()]
            band_plot(ax, curves, label=f"d_model {width}", color=COLORS.get(width), marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("peak learning rate")
        ax.set_title(f"{param} parametrization", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    axes[0, 0].set_ylabel("final val loss (diverged = ln vocab)")
    return save(fig, out / "loss_vs_rate.png")


def plot_optimum_vs_width(rows: list[dict], out: Path, init_loss: float) -> str:
    """Each seed's best rate against width, a line per parametrization."""
    plt = figure()
    fig, ax = plt.subplots(figsize=(6, 4.3))
    for param, color in zip(dict.fromkeys(r["param"] for r in rows), ("tab:gray", "tab:purple")):
        found = optima([r for r in rows if r["param"] == param], init_loss)
        curves = [sorted((w, 2 ** v) for (s, w), (v, _) in found.items() if s == seed)
                  for seed in sorted({s for s, _ in found})]
        band_plot(ax, curves, label=param, color=color, marker="o")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("d_model")
    ax.set_ylabel("best rate (parabola vertex per seed)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return save(fig, out / "optimum_vs_width.png")


# ============================================================== markdown
def markdown(spec, rows, decisions, *, command, wall_s, data, limits, extended) -> str:
    cfg = spec.configs[rows[0]["variant"]]
    t = cfg.train
    text = report_header("Claim (Tensor Programs V): under μP the learning rate transfers across width",
                         command, spec, wall_s, rows, data)
    text += (
        "## What was measured\n\n" + spec.description + "\n\n"
        f"Model: {cfg.model.n_layers} layers, {cfg.model.n_heads} heads, {cfg.model.norm}, {cfg.model.ffn}/"
        f"{cfg.model.activation}, {cfg.model.positions} positions, context {cfg.seq_len}, vocab "
        f"{cfg.model.vocab_size}; widths {', '.join(str(w) for w in sorted({r['d_model'] for r in rows}))}. "
        f"Every run: {t.steps} AdamW steps of {t.batch_size}×{cfg.seq_len} tokens "
        f"({t.steps * t.batch_size * cfg.seq_len:,} tokens), {cfg.optim.warmup_steps} warmup steps, cosine decay "
        f"to lr/10, gradient clipping {cfg.optim.grad_clip:g}, weight decay {cfg.optim.weight_decay:g}. "
        f"{eval_slice_text(spec)}. ln(vocab) {limits['init']:.3f}. Rates trained: "
        f"{', '.join(f'{lr:g}' for lr in sorted({r['lr_value'] for r in rows}))}"
        + (f"; the grid was extended for {extended}" if extended else "") + ".\n\n"
        "## Criteria (registered before the runs)\n\n" + registration_text(spec.registration)
        + "\n".join(f"- **{d.spec.id}** — {d.spec.claim}. {d.spec.criterion()}" for d in decisions) + "\n\n"
        "## Results\n\n### Best rate by width (per seed, from its whole curve)\n\n"
        + markdown_table(rate_table(rows, limits["init"]))
        + "\n![loss vs rate](loss_vs_rate.png)\n\n![best rate vs width](optimum_vs_width.png)\n\n"
        "## Verdicts\n\n" + "\n".join(d.line() for d in decisions) + "\n\n" + scale_note(spec, rows)
    )
    return text


def scale_note(spec, rows: list[dict]) -> str:
    """What size these results hold at: layers, widths, tokens, and tokens per parameter at the widest width."""
    widest = max(rows, key=lambda r: r["d_model"])
    cfg = spec.configs[widest["variant"]]
    tokens = cfg.train.steps * cfg.train.batch_size * cfg.seq_len
    params = widest.get("non_embedding_params") or widest.get("total_params")
    per = f"; the widest model sees {tokens / float(params):.2f} tokens per parameter" if params else ""
    return (f"A result at this size: {cfg.model.n_layers} layers, d_model {min(r['d_model'] for r in rows)}-"
            f"{cfg.model.d_model}, {tokens:,} tokens per run{per}. Transfer at larger widths, depths or budgets "
            "is not tested here.\n")


def analyze(spec, out: Path, rows: list[dict], *, command: str, wall_s: float, data: dict | None = None,
            limits: dict | None = None, tune: dict | None = None) -> Path:
    """Plots, verdict.json and report.md from the rows."""
    rows = with_widths(spec, rows)
    limits = limits or {"unigram": float("nan"), "init": math.log(spec.configs[rows[0]["variant"]].model.vocab_size)}
    decisions = decide_claims(spec.claims, rows, None, ENDPOINTS, init_loss=limits["init"],
                              alpha=(spec.registration or {}).get("alpha", 0.05))
    plots = [plot_loss_vs_rate(rows, out, limits), plot_optimum_vs_width(rows, out, limits["init"])]
    extended = extension_text(out / "extend.json")
    atomic_write_text(out / "report.md", markdown(spec, rows, decisions, command=command, wall_s=wall_s, data=data,
                                                  limits=limits, extended=extended))
    optimum_rows: list[dict[str, Any]] = [
        {"param": p, "seed": s, "d_model": w, "log2_best_rate": v, "at_edge": edge}
        for p in dict.fromkeys(r["param"] for r in rows)
        for (s, w), (v, edge) in sorted(optima([r for r in rows if r["param"] == p], limits["init"]).items())]
    write_decisions(out, "mup", decisions, {"plots": plots, "data": data, "seeds": spec.seeds, "optima": optimum_rows,
                                            "registration": registration_record(spec)})
    return out / "report.md"
