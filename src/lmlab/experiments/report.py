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

from ..run.atomic import atomic_write_text
from ..run.metrics import jsonable
from ..run.provenance import git_revision


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


def markdown_table(rows: list[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    if not rows:
        return "(no rows)\n"
    columns = list(columns or rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        cells = []
        for c in columns:
            v = r.get(c, "")
            cells.append(f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else fmt(v) if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_csv(rows: list[dict[str, Any]], path: Path, columns: Sequence[str]) -> None:
    """``rows`` as CSV with ``columns`` (others ignored), floats to 6 significant digits, written atomically."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items() if k in columns})
    atomic_write_text(path, buf.getvalue())


def write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(jsonable(data)) + "\n")


def verdict(ok: bool | None) -> str:
    return {True: "**REPRODUCED**", False: "**NOT REPRODUCED**", None: "**INCONCLUSIVE**"}[ok]


# ============================================================== plots
def figure():
    """matplotlib.pyplot with the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> str:
    """Save and close ``fig``; returns the file name for the report."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    figure().close(fig)
    return path.name


# ============================================================== headers
def report_header(title: str, command: str, spec, wall_s: float, rows: list[dict]) -> str:
    train_s = sum(r.get("wall_s") or 0.0 for r in rows)
    timing = (f"the runs trained for {train_s / 60:.1f} min in total (sum of per-run wall times, evaluation included); "
              f"the invocation that wrote this report took {wall_s / 60:.1f} min (runs finished by an earlier "
              "invocation are reused)")
    first = spec.configs[spec.variants[0].name]
    return (
        f"# {title}\n\n"
        f"Made by: `{command}`{'  (quick size: checks the machinery, not the claim)' if spec.is_quick else ''}\n\n"
        f"lmlab git revision {git_revision()}; {timing}. "
        f"Data: {first.data.source} corpus, {first.data.tokenizer} tokenizer; seeds {spec.seeds}. Machine: {machine()}; "
        "wall times and tokens/s depend on whatever else ran on it at the time.\n\n"
    )


def machine() -> str:
    import torch

    device = "CUDA " + torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    return f"{platform.machine()} {device}, {os.cpu_count()} cores, torch {torch.__version__} with {torch.get_num_threads()} threads"
