"""Report helpers shared by sweeps and experiments: tables, mean ± std, plots, headers, verdicts.

Nothing here knows about a particular experiment; each experiment's module computes its numbers
and verdict and uses these to write them down.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import platform
import statistics
from pathlib import Path
from typing import Any, Sequence

from ..run.checkpoint.atomic import atomic_write, atomic_write_text
from ..run.metrics import jsonable
from .registration import banner, changes_section


# ============================================================== numbers and tables
def fmt(x: Any) -> str:
    """A float to 4 decimals (non-finite as is), anything else as str."""
    return f"{x:.4f}" if isinstance(x, float) and math.isfinite(x) else str(x)


def mean_std(values: Sequence[float]) -> str:
    """"2.134 ± 0.012" over seeds ("2.134" for one seed; "nan" when none is finite)."""
    v = [x for x in values if isinstance(x, (int, float)) and math.isfinite(x)]
    if not v:
        return "nan"
    digits = 0 if max(abs(x) for x in v) >= 100 else 4
    m = statistics.fmean(v)
    return f"{m:.{digits}f}" if len(v) == 1 else f"{m:.{digits}f} ± {statistics.stdev(v):.{digits}f}"


def cell(v: Any) -> str:
    """A table cell: ints with thousands separators, floats to 4 decimals, anything else as str."""
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else fmt(v) if isinstance(v, float) else str(v)


def markdown_table(rows: list[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    if not rows:
        return "(no rows)\n"
    columns = list(columns or rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def _number(v: Any) -> bool:
    if isinstance(v, str):
        try:
            float(v)
        except ValueError:
            return False
    return isinstance(v, (int, float, str)) and not isinstance(v, bool)


def text_table(rows: list[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """``rows`` as aligned plain-text columns for a terminal: text left-aligned, numbers right-aligned."""
    if not rows:
        return "(no rows)\n"
    columns = list(columns or rows[0])
    cells = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    numeric = [all(_number(r.get(c)) for r in rows) for c in columns]
    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if n else v.ljust(w) for v, w, n in zip(values, widths, numeric)).rstrip()
    return "\n".join([line(columns), *(line(row) for row in cells)]) + "\n"


def write_csv(rows: list[dict[str, Any]], path: Path, columns: Sequence[str]) -> None:
    """``rows`` as CSV with ``columns`` (others ignored), floats to 6 significant digits, written atomically."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items() if k in columns})
    atomic_write_text(path, buf.getvalue())


def _cell_value(text: str) -> Any:
    """A CSV cell as write_csv wrote it: int, float, bool, or the text ("" stays "")."""
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def read_csv(path: Path) -> list[dict[str, Any]]:
    """Rows written by :func:`write_csv`, numbers and booleans parsed back ([] when the file is absent)."""
    if not Path(path).is_file():
        return []
    with open(path, newline="") as f:
        return [{k: _cell_value(v) for k, v in r.items()} for r in csv.DictReader(f)]


def write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(jsonable(data)) + "\n")


# ============================================================== plots
def figure():
    """matplotlib.pyplot with the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path, *, layout: bool = True) -> str:
    """Save ``fig`` atomically (written beside and renamed: a plot of an earlier report stays whole until the
    new one is complete) and close it; returns the file name for the report. ``layout``: tight_layout first."""
    if layout:
        fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=100, format=Path(path).suffix.lstrip(".") or "png"))
    figure().close(fig)
    return path.name


def band_plot(ax, curves: Sequence[Sequence[tuple[float, float]]], *, label: str, color=None, linestyle: str = "-",
              marker: str | None = ".") -> None:
    """Mean over seeds of curves sampled at the same x (one list of (x, y) per seed), with a
    shaded ±1 std band; points where a seed has no finite value are averaged over the others."""
    curves = [c for c in curves if c]
    if not curves:
        return
    xs = sorted({x for c in curves for x, _ in c})
    by_seed = [dict(c) for c in curves]
    mean, lo, hi = [], [], []
    for x in xs:
        ys = [d[x] for d in by_seed if x in d and isinstance(d[x], (int, float)) and math.isfinite(d[x])]
        m = statistics.fmean(ys) if ys else float("nan")
        s = statistics.stdev(ys) if len(ys) > 1 else 0.0
        mean.append(m)
        lo.append(m - s)
        hi.append(m + s)
    (line,) = ax.plot(xs, mean, linestyle=linestyle, marker=marker, color=color, label=f"{label} (n={len(curves)})")
    if len(curves) > 1:
        ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)


# ============================================================== headers
def provenance_text(rows: list[dict]) -> str:
    """The revisions the runs *started* from (recorded in each run at its start), and whether the tree was clean."""
    revs = list(dict.fromkeys(str(r.get("revision", "unknown")) for r in rows))
    dirty = sum(not r.get("tree_clean", False) for r in rows)
    clean = (
        "every run started from a clean tree"
        if dirty == 0
        else f"{dirty} of {len(rows)} runs started from a tree with uncommitted changes"
    )
    moved = sum(r.get("revision_end", r.get("revision")) != r.get("revision") for r in rows)
    return (
        f"The runs started from lmlab revision{'s' if len(revs) > 1 else ''} {', '.join(r[:12] for r in revs)}; {clean}"
        + (f"; {moved} runs were resumed at another revision" if moved else "")
        + "."
    )


def data_text(data: dict | None) -> str:
    """The corpus identity, the split sizes and the verbatim overlap between validation and training."""
    if not data:
        return ""
    c, o = data.get("corpus") or {}, data.get("overlap") or {}
    parts = []
    if c:
        parts.append(
            f"Corpus: the Python {c['recipe']['python']} standard library's source and pydoc topics "
            f"(experiments/corpus.py, recipe v{c['recipe']['version']}), {c['documents']:,} documents, "
            f"{c['bytes'] / 1e6:.1f} MB after removing {c['exact_duplicates']} exact and "
            f"{c['near_duplicates']} near-duplicate "
            f"documents and {c.get('repeated_span_bytes_removed', 0) / 1e6:.2f} MB of repeated 64-byte spans; content "
            f"{c['content_hash']} (it changes with the Python version)"
        )
    if o:
        parts.append(
            f"Tokenizer: {data.get('tokenizer', '?')} (vocab {data.get('vocab_size', '?')}). Split by prepare: train "
            f"{o['train_tokens']:,} tokens ({o['train_bytes'] / 1e6:.1f} MB), validation {o['val_tokens']:,} tokens "
            f"({o['val_bytes'] / 1e6:.1f} MB); {o['val_windows_in_train']:.3%} "
            f"of validation's {o['window']}-byte windows "
            "occur verbatim in training"
        )
    return ". ".join(parts) + ".\n\n" if parts else ""


def report_header(title: str, command: str, spec, wall_s: float, rows: list[dict], data: dict | None = None,
                  tuning: list[dict] | None = None) -> str:
    """The report's top: title, registration banner, command, revisions, run time, corpus, seeds and the
    changes after registration. ``tuning``: the tuning runs' rows (tune.csv), whose run time is added."""
    train_s = sum(r.get("wall_s") or 0.0 for r in rows)
    tune_s = sum(float(r.get("wall_s") or 0.0) for r in tuning or ())
    timing = (
        f"the runs trained for {train_s / 3600:.2f} h in total (sum of per-run wall times, evaluation included; "
        f"longest run {max((r.get('wall_s') or 0.0 for r in rows), default=0) / 60:.1f} min)"
        + (f", and the {len(tuning)} tuning runs for {tune_s / 3600:.2f} h more ({(train_s + tune_s) / 3600:.2f} h "
           "in all)" if tuning else "")
        + f"; the invocation that wrote this report took {wall_s / 60:.1f} min (finished runs are reused)"
    )
    seeds = f"seeds {spec.seeds}, each setting {' and '.join(spec.seed_fields)}"
    size = "  (quick size: checks the machinery, not the claim)" if spec.is_quick else (
        f"  (profile {spec.profile})" if spec.profile else "")
    status = getattr(spec, "registration_status", None)  # the spec file's Registration, when a command set it
    return (
        f"# {title}\n\n" + banner(status)
        + f"Made by: `{command}`{size}\n\n"
        f"{provenance_text(rows)} {timing.capitalize()}. Machine: {machine(rows)}; wall times and tokens/s depend on "
        f"whatever else ran on it at the time.\n\n" + data_text(data)
        + f"Runs: {len(rows)}, {seeds}.\n\n" + changes_section(status, getattr(spec, "registration", None))
    )


def machine(rows: Sequence[dict] = ()) -> str:
    """This machine; with ``rows``, the torch thread counts the runs recorded at their start."""
    import torch

    device = "CUDA " + torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    threads = sorted({r["threads"] for r in rows if r.get("threads")})
    used = f"runs used {'/'.join(map(str, threads))} torch thread{'s' if threads != [1] else ''} each" if threads else (
        f"torch with {torch.get_num_threads()} threads")
    return f"{platform.machine()} {device}, {os.cpu_count()} cores, torch {torch.__version__}; {used}"
