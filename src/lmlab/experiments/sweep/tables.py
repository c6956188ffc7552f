"""A sweep's tables and curves: results.csv (one row per variant x seed), summary.md (mean ± std
over seeds per variant), and the validation-loss curves with their ±1 std band over seeds. Losses
are in nats per token, each with its bits per byte beside it (``*_bpb``).

    write_tables(spec, rows, out)                         # results.csv and summary.md
    plot_loss_curves(spec, out, out / "loss_curves.png")  # mean and ±1 std band per variant
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ...run.checkpoint.atomic import atomic_write, atomic_write_text
from ..report import band_plot, figure, markdown_table, mean_std, write_csv
from ..spec import SweepSpec
from .layout import read_curve, run_dir_of

__all__ = ["COLUMNS", "eval_slice_text", "plot_loss_curves", "scalar_columns", "seed_curves", "write_tables"]

# columns every sweep reports, in table order
COLUMNS = [
    "variant", "seed", "steps", "tokens", "final_val_loss", "best_val_loss", "final_val_bpb", "best_val_bpb",
    "final_train_loss", "status", "diverged", "status_reason", "wall_s", "cpu_s", "tokens_per_s",
    "total_params", "active_params", "flops_per_token", "eval_tokens",
    "init_seed", "data_seed", "revision", "tree_clean", "config_hash",
]
BPB_TEXT = ("the same loss in bits per UTF-8 byte of the text those tokens cover (summed nats / ln 2 / bytes), "
            "which compares across tokenizers")
_SUMMARY_COLUMNS = ["final_val_loss", "best_val_loss", "final_val_bpb", "wall_s", "tokens_per_s"]


def scalar_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The standard columns, then any label and scalar extra columns the rows carry (lists go elsewhere)."""
    extra = []
    for r in rows:
        for k, v in r.items():
            if k not in COLUMNS and k not in extra and not isinstance(v, (list, dict)):
                extra.append(k)
    labels = [k for k in extra if all(isinstance(r.get(k), str) for r in rows)]
    return COLUMNS[:1] + labels + COLUMNS[1:] + [k for k in extra if k not in labels]


def _summarize(rows: list[dict[str, Any]], columns: Sequence[str] = _SUMMARY_COLUMNS) -> list[dict[str, Any]]:
    """One row per variant (in first-seen order): mean ± std over seeds of ``columns``, statuses counted."""
    out = []
    for name in dict.fromkeys(r["variant"] for r in rows):
        group = [r for r in rows if r["variant"] == name]
        first = group[0]
        out.append({
            "variant": name, "seeds": len(group),
            "diverged": f"{sum(r.get('status') == 'diverged' for r in group)}/{len(group)}",
            "no better than unigram": f"{sum(r.get('status') == 'no better than unigram' for r in group)}/{len(group)}",
            **{c: mean_std([r.get(c, float("nan")) for r in group]) for c in columns},
            "total_params": first["total_params"], "active_params": first["active_params"],
            "flops_per_token": f"{first['flops_per_token'] / 1e6:.2f}M",
        })
    return out


def eval_slice_text(spec: SweepSpec) -> str:
    """How final_val_loss was measured, for summary.md and every report (the same slice for both)."""
    if spec.final_eval:
        return (f"final_val_loss: mean next-token loss over {spec.final_eval['tokens']:,} validation tokens, "
                "in windows of the run's seq_len spread evenly over the whole validation split, after the last step")
    cfg = spec.configs[spec.variants[0].name]
    return (
        f"final_val_loss: the trainer's last evaluation, over the first {cfg.eval.batches} x {cfg.train.batch_size} "
        "windows of the validation split"
    )


def write_tables(spec: SweepSpec, rows: list[dict[str, Any]], out: Path, comparisons: str = "") -> None:
    """results.csv (every row, scalar columns) and summary.md (mean ± std over seeds per variant, then
    ``comparisons``: a user's sweep's paired differences and claims, ``verdicts.compare_variants``)."""
    write_csv(rows, out / "results.csv", scalar_columns(rows))
    text = (f"# Sweep {spec.name}\n\n{spec.description}\n\nMean ± std over seeds {spec.seeds} (each seed sets "
            f"{' and '.join(spec.seed_fields)}). {eval_slice_text(spec)}; final_val_bpb: {BPB_TEXT}. "
            "diverged: the loss went non-finite or ended "
            f"above {'ln(vocab)' if spec.diverged_above == 'init' else spec.diverged_above}; no better than unigram: "
            "ended at or above the loss of predicting token frequencies only.\n\n" + markdown_table(_summarize(rows)))
    if spec.registration_status is not None:
        text += f"\n{spec.registration_status.text()}.\n"
    atomic_write_text(out / "summary.md", text + (f"\n{comparisons}" if comparisons else ""))


def seed_curves(
    out: Path, name: str, seeds: Sequence[int], key: str = "val_loss", x: str = "tokens",
) -> list[list[tuple[float, float]]]:
    """Per seed, the (x, key) points of a variant's curve where ``key`` was logged."""
    return [[(r[x], r[key]) for r in read_curve(run_dir_of(out, name, s)) if r.get(key) is not None] for s in seeds]


def plot_loss_curves(spec: SweepSpec, out: Path, path: Path, variants: Sequence[str] | None = None,
                     x: str = "tokens", title: str | None = None) -> None:
    """Validation loss against training tokens (or wall_s) for every variant: mean over seeds, ±1 std band."""
    plt = figure()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in variants or [v.name for v in spec.variants]:
        band_plot(ax, seed_curves(out, name, spec.seeds_of(spec.variant(name)), x=x), label=name)
    ax.set_xlabel("training tokens" if x == "tokens" else "wall time (s)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(title or f"{spec.name}: validation loss (mean ± 1 std over {len(spec.seeds)} seeds)")
    ax.grid(alpha=0.3)
    if len(ax.lines) <= 16:
        ax.legend(fontsize=7)
    fig.tight_layout()
    try:  # atomically: a kill mid-write leaves the previous plot, never half of one
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format=Path(path).suffix.lstrip(".") or "png"))
    finally:
        plt.close(fig)
