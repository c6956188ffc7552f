"""Claim 2, measured: rotary positions let context be extended by adjusting the rotation range.

Every trained model is evaluated on the validation split at 1x, 2x, 4x and 8x its training length
L (loss by evaluation length, and loss at each position). Learned positions stop at their table:
recorded as "n/a", never a crash. The trained rope model is also evaluated with linear, NTK-aware
and YaRN scaling applied zero-shot at factor = evaluation length / L; the *-ft variants are the
same three (and no scaling, a control) after a short fine-tune at 8L from rope's weights.

Verdict criteria (stated in the report too):
  zero-shot  reproduced if at every length > L some scaling method gives a lower loss than
             unscaled rope at that length;
  fine-tune  reproduced if the best scaled fine-tune's loss at 8L is below rope's own loss at L
             (the model reads 8x the context at no cost per token) and below the unscaled
             fine-tune's at 8L by more than TIE nats (the adjustment, not the fine-tune, did it).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..model import Transformer
from ..run.evaluate import evaluate
from ..run.atomic import atomic_write_text
from .sweep import Hooks as SweepHooks
from .report import figure, markdown_table, report_header, save, verdict, write_json

MULTIPLES = (1, 2, 4, 8)
METHODS = ("linear", "ntk", "yarn")
EVAL_WINDOWS = 256  # validation tokens per evaluation length = EVAL_WINDOWS x training length (16,384 at 64)
TIE = 0.01  # nats
NA_LEARNED = "n/a — learned table ends at {L}"


def eval_at(model, data, seq_len: int, tokens: int) -> tuple[float, list[float]]:
    """Loss and loss at each position over about ``tokens`` validation tokens, in windows of ``seq_len``."""
    bs = max(1, min(8, tokens // (4 * seq_len)))
    batches = max(1, math.ceil(tokens / (bs * seq_len)))
    r = evaluate(model, data, batch_size=bs, seq_len=seq_len, max_batches=batches)
    return r.loss, r.per_position


def rescaled(model, method: str, factor: float, original: int):
    """The same weights under another rope scaling (rotary has no parameters; only the angles change)."""
    cfg = model.config.override({"rope.scaling": method, "rope.factor": factor, "rope.original_max_seq_len": original})
    m = Transformer(cfg)
    m.load_state_dict(model.state_dict())
    return m.to(next(model.parameters()).device)


class Hooks(SweepHooks):
    def __init__(self, spec):
        self.spec = spec
        self.L = spec.configs["rope"].seq_len  # the training length of every scheme

    def after_fit(self, trainer, variant, seed, run_dir) -> dict[str, Any]:
        model, data, L = trainer.model, trainer.val_data, self.L
        out: dict[str, Any] = {}
        for m in MULTIPLES:
            try:
                loss, pp = eval_at(model, data, m * L, EVAL_WINDOWS * L)
            except ValueError as e:
                if "learned" not in str(e):
                    raise
                out[f"loss_{m}x"] = NA_LEARNED.format(L=model.config.max_seq_len)
                continue
            out[f"loss_{m}x"], out[f"pp_{m}x"] = loss, pp
        if variant.name == "rope":  # zero-shot context extension of the trained model
            for method in METHODS:
                for m in MULTIPLES[1:]:
                    loss, pp = eval_at(rescaled(model, method, float(m), L), data, m * L, EVAL_WINDOWS * L)
                    out[f"zs_{method}_{m}x"] = loss
                    out[f"pp_zs_{method}_{m}x"] = pp
        return out


# ============================================================== analysis
def _num(x: Any) -> float:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else float("nan")


def _smooth(v: list[float], w: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(v):
        acc += x - (v[i - w] if i >= w else 0.0)
        out.append(acc / min(i + 1, w))
    return out


def analyze(spec, out: Path, rows: list[dict], *, command: str, wall_s: float) -> Path:
    plt = figure()
    L = spec.configs["rope"].seq_len
    by = {r["variant"]: r for r in rows if r["seed"] == spec.seeds[0]}
    schemes = [v.name for v in spec.variants if v.init_from is None]
    fts = [v.name for v in spec.variants if v.init_from is not None]
    lengths = [m * L for m in MULTIPLES]
    rope = by["rope"]
    w = max(1, L // 4)  # smoothing window for per-position curves
    plots = []

    # 1. loss by evaluation length
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in schemes + fts:
        ys = [_num(by[name].get(f"loss_{m}x")) for m in MULTIPLES]
        ax.plot(lengths, ys, marker="o", linestyle="-" if name in schemes else "--", label=name)
    ax.axvline(L, color="gray", linestyle=":", label=f"training length {L}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("mean validation loss (nats/token)")
    ax.set_title("Loss by evaluation length (trained at %d)" % L)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    plots.append(save(fig, out / "loss_by_length.png"))

    # 2. per-position loss at 8x, each scheme
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in schemes:
        key = f"pp_{MULTIPLES[-1]}x" if f"pp_{MULTIPLES[-1]}x" in by[name] else "pp_1x"
        pp = by[name].get(key)
        if pp:
            ax.plot(range(len(pp)), _smooth(pp, w), label=name + (" (up to its table)" if key == "pp_1x" else ""))
    ax.axvline(L, color="gray", linestyle=":", label=f"training length {L}")
    ax.set_xlabel("position in the sequence (tokens)")
    ax.set_ylabel(f"loss at position (nats/token, mean of {w})")
    ax.set_title(f"Per-position loss at {MULTIPLES[-1] * L} tokens")
    ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    plots.append(save(fig, out / "per_position.png"))

    # 3. rope context extension: zero-shot and fine-tuned, loss against length
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    ax = axes[0]
    ax.plot(lengths, [_num(rope.get(f"loss_{m}x")) for m in MULTIPLES], "k-o", label="rope, no scaling")
    for method in METHODS:
        ax.plot(lengths, [_num(rope.get("loss_1x"))] + [_num(rope.get(f"zs_{method}_{m}x")) for m in MULTIPLES[1:]],
                marker="o", label=f"{method} (factor = length / {L})")
    ax.set_title("zero-shot")
    ax = axes[1]
    ax.plot(lengths, [_num(rope.get(f"loss_{m}x")) for m in MULTIPLES], "k-o", label="rope, no scaling, no fine-tune")
    for name in fts:
        ax.plot(lengths, [_num(by[name].get(f"loss_{m}x")) for m in MULTIPLES], marker="s", linestyle="--", label=name)
    ax.set_title(f"after fine-tuning at {MULTIPLES[-1] * L} tokens")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_xlabel("evaluation length (tokens)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
    axes[0].set_ylabel("mean validation loss (nats/token)")
    plots.append(save(fig, out / "rope_extension.png"))

    # 4. per-position at 8x for the rope extensions
    fig, ax = plt.subplots(figsize=(8, 4.5))
    M = MULTIPLES[-1]
    ax.plot(_smooth(rope.get(f"pp_{M}x", []), w), "k", label="rope, no scaling")
    for method in METHODS:
        ax.plot(_smooth(rope.get(f"pp_zs_{method}_{M}x", []), w), alpha=0.7, label=f"{method}, zero-shot")
    for name in fts:
        ax.plot(_smooth(by[name].get(f"pp_{M}x", []), w), linestyle="--", label=name)
    ax.axvline(L, color="gray", linestyle=":", label=f"training length {L}")
    ax.set_xlabel("position in the sequence (tokens)")
    ax.set_ylabel(f"loss at position (nats/token, mean of {w})")
    ax.set_title(f"Rope extended to {M * L} tokens: per-position loss")
    ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    plots.append(save(fig, out / "rope_extension_per_position.png"))

    # ---- tables
    def cell(r, key):
        v = r.get(key)
        return v if isinstance(v, str) else (f"{v:.3f}" if isinstance(v, float) and math.isfinite(v) else "nan")

    length_table = [{"scheme": n, **{f"{m * L} ({m}×)": cell(by[n], f"loss_{m}x") for m in MULTIPLES},
                     "8× − 1×": (f"{_num(by[n].get(f'loss_{MULTIPLES[-1]}x')) - _num(by[n].get('loss_1x')):+.3f}"
                                 if not isinstance(by[n].get(f"loss_{MULTIPLES[-1]}x"), str) else "n/a")}
                    for n in schemes + fts]
    ext_table = [{"rope variant": "no scaling", **{f"{m * L}": cell(rope, f"loss_{m}x") for m in MULTIPLES[1:]}}]
    ext_table += [{"rope variant": f"{method}, zero-shot", **{f"{m * L}": cell(rope, f"zs_{method}_{m}x") for m in MULTIPLES[1:]}}
                  for method in METHODS]
    ext_table += [{"rope variant": f"{n} (fine-tuned)", **{f"{m * L}": cell(by[n], f"loss_{m}x") for m in MULTIPLES[1:]}} for n in fts]

    # ---- verdicts
    zs_wins = {}
    for m in MULTIPLES[1:]:
        best = min(METHODS, key=lambda k: _num(rope.get(f"zs_{k}_{m}x")) if math.isfinite(_num(rope.get(f"zs_{k}_{m}x"))) else 1e9)
        zs_wins[m] = (best, _num(rope.get(f"zs_{best}_{m}x")), _num(rope.get(f"loss_{m}x")))
    zs_ok = all(b < plain for _, b, plain in zs_wins.values())
    scaled_fts = [n for n in fts if not n.endswith("-none")]
    control = next((n for n in fts if n.endswith("-none")), None)
    ft_ok, ft_line = None, "no fine-tune variants"
    if scaled_fts:
        best_ft = min(scaled_fts, key=lambda n: _num(by[n].get(f"loss_{M}x")))
        b = _num(by[best_ft].get(f"loss_{M}x"))
        base1 = _num(rope.get("loss_1x"))
        ctrl = _num(by[control].get(f"loss_{M}x")) if control else float("nan")
        ft_ok = b < base1 and (not control or b < ctrl - TIE)
        ft_line = (f"best scaled fine-tune {best_ft}: {b:.3f} at {M * L} tokens vs rope's {base1:.3f} at {L}; "
                   f"unscaled fine-tune control {control}: {ctrl:.3f} at {M * L}")
    ranking = sorted(schemes, key=lambda n: _num(by[n].get(f"loss_{M}x")) if not isinstance(by[n].get(f"loss_{M}x"), str) else 1e9)

    cfg0 = spec.configs["rope"]
    t = cfg0.train
    ftc = spec.configs[fts[0]] if fts else None
    text = report_header("Claim 2: rotary positions let context be extended by adjusting the rotation range", command, spec, wall_s, rows)
    text += (
        "## What was measured\n\n"
        f"Six position schemes ({', '.join(schemes)}), each a {cfg0.model.n_layers}-layer, d_model {cfg0.model.d_model} "
        f"{cfg0.model.ffn}/{cfg0.model.activation} model trained at context {L} for {t.steps} steps of {t.batch_size}×{L} tokens "
        f"({t.steps * t.batch_size * L:,} tokens, identical data order). Each was evaluated on up to {EVAL_WINDOWS * L:,} validation "
        f"tokens at {', '.join(map(str, lengths))} tokens (loss by evaluation length; loss at every position). "
        + (f"Rope was then fine-tuned at {ftc.seq_len} tokens for {ftc.train.steps} steps of {ftc.train.batch_size}×{ftc.seq_len} "
           f"tokens (lr {ftc.train.lr:g}) with each scaling at factor {ftc.model.rope.factor:g}, and once without scaling "
           "as a control. " if ftc else "")
        + "Zero-shot scaling uses factor = evaluation length / training length.\n\n"
        "### Loss by evaluation length (nats/token)\n\n" + markdown_table(length_table)
        + "\n![loss by length](loss_by_length.png)\n\n![per-position loss](per_position.png)\n\n"
        "### Rope context extension (nats/token at each length)\n\n" + markdown_table(ext_table)
        + "\n![rope extension](rope_extension.png)\n\n![rope extension per position](rope_extension_per_position.png)\n\n"
        "## Verdict\n\n"
        "Criteria, fixed before the runs: (a) zero-shot: at every length beyond training, at least one of linear / NTK / "
        f"YaRN scaling gives a lower loss than unscaled rope; (b) fine-tune: the best scaled fine-tune's loss at {M}× is below "
        f"rope's own loss at 1× (the model uses {M}× the context at no cost per token) and more than {TIE} nats below the "
        "unscaled fine-tune's (the rotation-range adjustment, not the extra training, does it). One seed.\n\n"
        f"- (a) Zero-shot extension by adjusting the rotation range: {verdict(zs_ok)}. "
        + "; ".join(f"{m}×: best {k} {b:.3f} vs unscaled {p:.3f}" for m, (k, b, p) in zs_wins.items()) + ".\n"
        f"- (b) Extension after a short fine-tune: {verdict(ft_ok)}. {ft_line}.\n\n"
        f"Length extrapolation without any adjustment, best first by loss at {M * L} tokens: "
        + ", ".join(f"{n} ({cell(by[n], f'loss_{M}x')})" for n in ranking) + ". "
        "The claim that rotary encodes relative position \"at many scales\" is not tested directly here; what is measured is "
        "its consequence for extension.\n"
    )
    atomic_write_text(out / "report.md", text)
    # per-position curves at the longest length, small enough to commit
    lines = ["variant,eval_len,position,loss"]
    for name in schemes + fts:
        for key, label in [(f"pp_{M}x", name)] + ([(f"pp_zs_{k}_{M}x", f"rope-zs-{k}") for k in METHODS] if name == "rope" else []):
            for i, v in enumerate(by[name].get(key) or []):
                lines.append(f"{label},{M * L},{i},{v:.5f}")
    atomic_write_text(out / "per_position.csv", "\n".join(lines) + "\n")
    write_json(out / "verdict.json", {"zero_shot": zs_ok, "fine_tune": ft_ok, "plots": plots})
    return out / "report.md"
