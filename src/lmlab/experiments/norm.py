"""Claim 1, measured: pre-norm trains deep models stably where post-norm struggles.

Beyond the sweep's losses, each run records
  - the gradient norm of each layer's parameters at initialization, on one fixed training batch
    (Xiong et al. 2020, arXiv:2002.04745, sec. 3 and fig. 3: post-norm's grows toward the top
    layers, pre-norm's is flat in depth), and
  - the size of the first updates, ||theta_t - theta_0|| / ||theta_0|| for t = 1..UPDATE_STEPS
    (Xiong et al.'s explanation of why post-norm needs warmup: large early updates).

Verdict criteria (stated in the report too):
  gradients  reproduced if, at the deepest depth, post-norm's top-quarter / bottom-quarter mean
             layer gradient norm is > GRAD_GROWS and pre-norm's lies within [1/GRAD_FLAT, GRAD_FLAT];
  stability  reproduced if at the deepest depth pre-norm never diverges, ends at a lower validation
             loss than post-norm in at least 3 of the 4 (lr, warmup) settings, and post-norm
             struggles (diverges, or ends more than STRUGGLE nats above pre-norm) in at least one.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import torch

from ..run.atomic import atomic_write_text
from .sweep import Hooks as SweepHooks
from .sweep import read_curve, run_dir_of, unigram_loss
from .report import figure, markdown_table, report_header, save, verdict, write_json

UPDATE_STEPS = 50  # steps over which the relative parameter change is recorded
GRAD_GROWS = 2.0  # post-norm's top/bottom gradient ratio must exceed this
GRAD_FLAT = 2.0  # pre-norm's must lie within [1/2, 2]
STRUGGLE = 0.05  # nats: "clearly worse" at one seed
STUCK = 0.1  # nats: a final loss this close to the unigram loss learned little beyond byte frequencies
NORMS = ("post", "pre", "deepnorm")
COLORS = {"post": "tab:red", "pre": "tab:blue", "deepnorm": "tab:green"}


# ============================================================== measurements
def layer_grad_norms(model, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """L2 norm of d loss / d (all parameters of block i), for each block i, at the model's current weights."""
    model.zero_grad(set_to_none=True)
    was_training = model.training
    model.train()
    model(x, y).loss.backward()
    norms = []
    for block in model.blocks:
        sq = sum(float(p.grad.double().pow(2).sum()) for p in block.parameters() if p.grad is not None)
        norms.append(math.sqrt(sq))
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    return norms


def top_bottom_ratio(norms: list[float]) -> float:
    """Mean gradient norm of the top quarter of layers over that of the bottom quarter (one layer each for L < 4)."""
    k = max(1, len(norms) // 4)
    bottom, top = statistics.fmean(norms[:k]), statistics.fmean(norms[-k:])
    return top / bottom if bottom > 0 else float("inf")


class UpdateSize:
    """Trainer callback: ||theta_t - theta_0|| / ||theta_0|| after each of the first ``steps`` steps."""

    def __init__(self, model, steps: int):
        self.theta0 = [p.detach().clone() for p in model.parameters()]
        self.norm0 = math.sqrt(sum(float(p.double().pow(2).sum()) for p in self.theta0))
        self.steps, self.curve = steps, []

    @torch.no_grad()
    def __call__(self, trainer, record: dict) -> None:
        if record["step"] > self.steps or len(self.curve) >= self.steps:
            return
        diff = sum(float((p.detach() - p0).double().pow(2).sum()) for p, p0 in zip(trainer.model.parameters(), self.theta0))
        self.curve.append(math.sqrt(diff) / self.norm0)


class Hooks(SweepHooks):
    """Gradient norms per layer and theta_0 at step 0; the update size over the first steps."""

    def __init__(self, spec):
        self.spec = spec
        self.updates: dict[str, UpdateSize] = {}

    def before_fit(self, trainer, variant, seed, run_dir) -> dict[str, Any]:
        self.updates[f"{variant.name}/{seed}"] = UpdateSize(trainer.model, min(UPDATE_STEPS, trainer.cfg.train.steps))
        g = torch.Generator().manual_seed(1234)  # the same batch for every variant
        x, y = trainer.train_data.batch(trainer.cfg.train.batch_size, trainer.cfg.seq_len, g)
        norms = layer_grad_norms(trainer.model, x.to(trainer.device), y.to(trainer.device))
        return {"grad_norm_init": norms, "grad_top_bottom": top_bottom_ratio(norms)}

    def callbacks(self, variant, seed, run_dir):
        key = f"{variant.name}/{seed}"

        def update_size(trainer, record):  # absent when the run was resumed after its start
            if key in self.updates:
                self.updates[key](trainer, record)

        return [update_size]

    def after_fit(self, trainer, variant, seed, run_dir) -> dict[str, Any]:
        upd = self.updates.pop(f"{variant.name}/{seed}", None)
        curve = upd.curve if upd is not None else []
        out: dict[str, Any] = {"update_curve": curve}
        for t in (10, UPDATE_STEPS):
            out[f"update_at_{t}"] = curve[t - 1] if len(curve) >= t else (curve[-1] if curve else float("nan"))
        return out


# ============================================================== analysis
def _setting(r: dict) -> str:
    return f"{r['lr']}, {r['warmup']}"


def analyze(spec, out: Path, rows: list[dict], *, command: str, wall_s: float) -> Path:
    plt = figure()
    depths = list(dict.fromkeys(r["depth"] for r in rows))
    settings = list(dict.fromkeys(_setting(r) for r in rows))
    deepest = depths[-1]
    by = {(r["norm"], r["depth"], _setting(r)): r for r in rows if r["seed"] == spec.seeds[0]}
    n_layers = {d: spec.configs[next(v.name for v in spec.variants if v.labels["depth"] == d)].model.n_layers for d in depths}
    plots = []
    unigram = unigram_loss(out / "data")

    # 1. gradient norm per layer at initialization, deepest model (the same at every lr / warmup)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for norm in NORMS:
        r = by.get((norm, deepest, settings[0]))
        if r and r.get("grad_norm_init"):
            g = r["grad_norm_init"]
            ax.semilogy(range(1, len(g) + 1), g, marker="o", color=COLORS[norm], label=f"{norm} (top/bottom {r['grad_top_bottom']:.2f}x)")
    ax.set_xlabel("layer index (1 = bottom, next to the embedding)")
    ax.set_ylabel("||dL/d(layer parameters)|| at init (log scale)")
    ax.set_title(f"Gradient norm per layer at initialization, {n_layers[deepest]} layers")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    plots.append(save(fig, out / "grad_norm_init.png"))

    # 2. validation loss curves: one panel per (setting, depth)
    fig, axes = plt.subplots(len(settings), len(depths), figsize=(3.2 * len(depths), 2.6 * len(settings)),
                             sharex=True, squeeze=False)
    for i, s in enumerate(settings):
        for j, d in enumerate(depths):
            ax = axes[i][j]
            ys: list[float] = []
            for norm in NORMS:
                r = by.get((norm, d, s))
                if r is None:
                    continue
                curve = read_curve(run_dir_of(out, r["variant"], r["seed"]))
                train = [c for c in curve if c.get("loss") is not None]
                val = [c for c in curve if c.get("val_loss") is not None]
                ax.plot([c["step"] for c in train], [c["loss"] for c in train], color=COLORS[norm], lw=1,
                        label=norm + (" (diverged)" if r["diverged"] else ""))
                ax.plot([c["step"] for c in val], [c["val_loss"] for c in val], color=COLORS[norm], ls="", marker="o", ms=4)
                ys += [c["loss"] for c in train if math.isfinite(c["loss"])]
            if ys:  # the learning phase, not the first steps' ~ln(vocab)
                ax.set_ylim(min(ys) - 0.1, min(max(ys), min(ys) + 2.5) + 0.1)
            ax.set_title(f"{n_layers[d]} layers; {s}", fontsize=9)
            ax.grid(alpha=0.3)
            if i == len(settings) - 1:
                ax.set_xlabel("optimizer step")
            if j == 0:
                ax.set_ylabel("loss (nats/token)\nline: train, dots: val", fontsize=8)
            ax.legend(fontsize=6)
    plots.append(save(fig, out / "loss_curves.png"))

    # 3. final validation loss against depth
    fig, axes = plt.subplots(1, len(settings), figsize=(3.6 * len(settings), 3.6), sharey=True, squeeze=False)
    for i, s in enumerate(settings):
        ax = axes[0][i]
        for norm in NORMS:
            pts = [(n_layers[d], by[(norm, d, s)]) for d in depths if (norm, d, s) in by]
            ax.plot([p for p, _ in pts], [r["final_val_loss"] if math.isfinite(r["final_val_loss"]) else float("nan") for _, r in pts],
                    marker="o", color=COLORS[norm], label=norm)
            for p, r in pts:
                if r["diverged"]:
                    ax.scatter([p], [min(r["final_val_loss"], 6) if math.isfinite(r["final_val_loss"]) else 6],
                               marker="x", s=80, color=COLORS[norm])
        ax.axhline(unigram, color="gray", linestyle=":", label=f"unigram loss {unigram:.2f}")
        ax.set_xscale("log", base=2)
        ax.set_xticks([n_layers[d] for d in depths], [str(n_layers[d]) for d in depths])
        ax.set_xlabel("layers")
        ax.set_title(s, fontsize=9)
        ax.grid(alpha=0.3)
        if i == 0:
            ax.set_ylabel("final val loss (nats/token); x = diverged")
            ax.legend()
    plots.append(save(fig, out / "final_loss_vs_depth.png"))

    # 4. update size over the first steps, deepest model
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in settings:
        for norm in NORMS:
            r = by.get((norm, deepest, s))
            if r and r.get("update_curve"):
                style = "-" if "nowarmup" in s else "--"
                ax.plot(range(1, len(r["update_curve"]) + 1), r["update_curve"], style, color=COLORS[norm],
                        alpha=1.0 if s.startswith(settings[-1].split(",")[0]) else 0.5, label=f"{norm}; {s}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("||theta_t - theta_0|| / ||theta_0|| (dimensionless)")
    ax.set_title(f"Size of the update over the first steps, {n_layers[deepest]} layers")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    plots.append(save(fig, out / "update_size.png"))

    # ---- verdicts
    ratio = {norm: by[(norm, deepest, settings[0])].get("grad_top_bottom", float("nan"))
             for norm in NORMS if (norm, deepest, settings[0]) in by}
    grad_ok = None
    if "post" in ratio and "pre" in ratio:
        grad_ok = ratio["post"] > GRAD_GROWS and 1 / GRAD_FLAT <= ratio["pre"] <= GRAD_FLAT
    wins, struggles, pre_div = 0, [], 0
    lines = []
    for s in settings:
        post, pre = by.get(("post", deepest, s)), by.get(("pre", deepest, s))
        if not post or not pre:
            continue
        pre_div += bool(pre["diverged"])
        pl = post["final_val_loss"] if not post["diverged"] else float("inf")
        if pre["final_val_loss"] < pl or (post["diverged"] and not pre["diverged"]):
            wins += 1
        gap = (post["final_val_loss"] - pre["final_val_loss"]) if math.isfinite(post["final_val_loss"]) else float("inf")
        struggling = post["diverged"] or gap > STRUGGLE
        if struggling:
            struggles.append(s)
        lines.append(f"- {s}: post {_l(post)} vs pre {_l(pre)} (post − pre = {gap:+.3f} nats); DeepNorm "
                     f"{_l(by.get(('deepnorm', deepest, s)))}")
    stab_ok = None if not lines else (pre_div == 0 and wins >= min(3, len(lines)) and bool(struggles))

    # ---- tables
    table = []
    for norm in NORMS:
        for s in settings:
            row = {"norm": norm, "lr, warmup": s}
            for d in depths:
                r = by.get((norm, d, s))
                row[f"{n_layers[d]} layers"] = (_l(r) if r else "")
            table.append(row)
    grad_table = [{"norm": norm, **{f"{n_layers[d]} layers": f"{by[(norm, d, settings[0])].get('grad_top_bottom', float('nan')):.2f}"
                                    for d in depths if (norm, d, settings[0]) in by}} for norm in NORMS]
    upd_table = [{"norm": norm, "lr, warmup": s,
                  "update after 10 steps": f"{by[(norm, deepest, s)].get('update_at_10', float('nan')):.4f}",
                  f"after {UPDATE_STEPS}": f"{by[(norm, deepest, s)].get(f'update_at_{UPDATE_STEPS}', float('nan')):.4f}"}
                 for norm in NORMS for s in settings if (norm, deepest, s) in by]
    n_div = {norm: sum(bool(r["diverged"]) for r in rows if r["norm"] == norm) for norm in NORMS}
    n_stuck = {norm: sum(not r["diverged"] and r["final_val_loss"] > unigram - STUCK for r in rows if r["norm"] == norm)
               for norm in NORMS}
    cfg0 = spec.configs[spec.variants[0].name]
    t = cfg0.train

    text = report_header("Claim 1: pre-norm trains deep models stably where post-norm struggles", command, spec, wall_s, rows)
    text += (
        "## What was measured\n\n"
        f"{len(rows)} runs: norm placement {{post, pre, DeepNorm}} × depth {{{', '.join(str(n_layers[d]) for d in depths)}}} × "
        f"{{{'; '.join(settings)}}}. Model: d_model {cfg0.model.d_model}, {cfg0.model.n_heads} heads, {cfg0.model.norm}, "
        f"{cfg0.model.ffn}/{cfg0.model.activation}, {cfg0.model.positions} positions, context {cfg0.seq_len}. Every run: {t.steps} AdamW "
        f"steps of {t.batch_size}×{cfg0.seq_len} tokens ({t.steps * t.batch_size * cfg0.seq_len:,} tokens), cosine decay to "
        f"{t.min_lr:g}, gradient clipping {t.grad_clip:g}, warmup as named. "
        "A run counts as diverged if its loss or gradient went non-finite or its final validation loss is above the unigram loss "
        f"(here {unigram:.3f} nats: the loss of predicting byte frequencies only, i.e. it learned no context); a run ending "
        f"within {STUCK} nats below it learned little beyond byte frequencies.\n\n"
        f"Divergences: post {n_div['post']}, pre {n_div['pre']}, DeepNorm {n_div['deepnorm']} of {len(rows) // 3} runs each. "
        f"Runs that did not diverge but ended within {STUCK} nats of the unigram loss: post {n_stuck['post']}, pre "
        f"{n_stuck['pre']}, DeepNorm {n_stuck['deepnorm']}.\n\n"
        "### Final validation loss (nats/token; `DIV` = diverged)\n\n" + markdown_table(table) + "\n"
        "![final loss vs depth](final_loss_vs_depth.png)\n\n![loss curves](loss_curves.png)\n\n"
        "### Gradient norm per layer at initialization\n\n"
        "Norm of the gradient of the loss w.r.t. all parameters of each layer, on one fixed batch, before any update. "
        "Table: mean over the top quarter of layers / mean over the bottom quarter (> 1: grows toward the top).\n\n"
        + markdown_table(grad_table) + f"\n![gradient norm per layer](grad_norm_init.png)\n\n"
        f"### Size of the first updates ({n_layers[deepest]} layers)\n\n||θ_t − θ_0|| / ||θ_0|| after t steps.\n\n"
        + markdown_table(upd_table) + "\n![update size](update_size.png)\n\n"
        "## Verdict\n\n"
        f"Criteria, fixed before the runs: (a) gradients: at {n_layers[deepest]} layers post-norm's top/bottom ratio > {GRAD_GROWS:g} "
        f"and pre-norm's within [{1 / GRAD_FLAT:g}, {GRAD_FLAT:g}]; (b) stability: at {n_layers[deepest]} layers pre-norm never "
        f"diverges, beats post-norm in at least 3 of the {len(lines)} settings, and post-norm struggles (diverges or ends more "
        f"than {STRUGGLE} nats above pre-norm) in at least one. One seed per run, so gaps under ~{STRUGGLE} nats are within noise.\n\n"
        f"- (a) Gradient growth toward the top layers: {verdict(grad_ok)}. Top/bottom ratio at {n_layers[deepest]} layers: "
        + ", ".join(f"{k} {v:.2f}" for k, v in ratio.items()) + ".\n"
        f"- (b) Deep training stability: {verdict(stab_ok)}. At {n_layers[deepest]} layers pre-norm beat post-norm in {wins} of "
        f"{len(lines)} settings, diverged {pre_div} times; post-norm struggled in: {', '.join(struggles) or 'none'}.\n\n"
        + "\n".join(lines) + "\n\n"
        f"At this scale (d_model {cfg0.model.d_model}, {t.steps} steps, one seed) these are statements about the start of "
        "training of small models; they are what was observed, nothing more.\n"
    )
    atomic_write_text(out / "report.md", text)
    write_json(out / "verdict.json", {"gradients": grad_ok, "stability": stab_ok, "grad_top_bottom": ratio, "plots": plots})
    return out / "report.md"


def _l(r: dict | None) -> str:
    if r is None:
        return "—"
    v = r["final_val_loss"]
    s = f"{v:.3f}" if isinstance(v, float) and math.isfinite(v) else "nan"
    return f"{s} DIV" if r["diverged"] else s
