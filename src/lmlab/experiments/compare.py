"""Runs side by side: ``lmlab compare RUN... [--out DIR]``.

    paths, failed = find_runs(["runs/a", "sweeps/ablation", "runs/lr-*"])   # run directories; what is not one
    runs, unread = read_runs(paths)                # a RunSummary per readable run; the others with their error
    unit = choose_unit(runs, "auto")               # bits per byte when the tokenizers differ
    print(comparison_text(runs, unit, width=terminal_width()))   # split into parts that fit a terminal
    write_comparison(runs, Path("cmp"), unit, command="lmlab compare ...")   # compare.md (the whole table), PNGs

A RUN is a run directory (what ``lmlab train`` writes), a directory holding runs at any depth (a
sweep's or an experiment's ``runs/<variant>/seed<s>/``), or a glob of either. Everything comes
from the runs' own files: config.yaml, metrics.jsonl, and the prepared data's meta.json (which
tokenizer) and validation split (bytes, for runs logged before bits per byte was).

Units. Losses are nats per token and bits per byte: the trainer logs ``val_bits_per_byte`` with
each evaluation, always over the same validation windows, so a run's validation tokens per byte
is one number that converts any of its validation losses. Runs whose tokenizers differ are
compared in bits per byte by default: nats per token of two tokenizers measure different things.
A train loss in bits per byte uses the validation windows' tokens per byte: an estimate.

Wall time is rebuilt from metrics.jsonl: each record's tokens since the previous record over its
tokens/s (the trainer's throughput window runs from one logged step to the next, evaluation
included). Runs that differ only in their seeds (``train.seed``, ``model.init_seed``) form a group,
drawn as its mean with a ±1 std band.

Columns. After the losses comes the final value of each other evaluation measure a run logs
(``val_accuracy`` of a classifier; ``tasks/<task>/<metric>`` of the downstream evaluations), then the
budget and the config fields that differ. A classifier's loss is cross-entropy over its labels, not
over text: it has no bits per byte (``n/a``, said in the header), and compares only with classifiers
on the same labels. On a terminal the table is cut into parts of whole columns that fit its width,
each led by the run's name; compare.md holds it whole.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import shutil
import statistics
import sys
import textwrap
from pathlib import Path
from typing import Any, Sequence

from ..run.checkpoint.atomic import atomic_write_text, install_directory
from ..run.checkpoint.directory import CHECKPOINTS, CONFIG_FILE, METRICS_FILE
from ..run.config import RunConfig, differing_fields, flatten, load_config
from ..run.data.config import run_data_dir
from ..run.data.meta import DataMeta
from ..run.errors import CorruptFile, EnvironmentFailure, one_line
from ..run.metrics import read_metrics
from .report import band_plot, cell, figure, markdown_table, save, text_table

__all__ = ["MARKER", "RunSummary", "check_out", "choose_unit", "comparison_rows", "comparison_text", "find_runs",
           "fit_table", "groups", "read_runs", "terminal_width", "write_comparison"]

MARKER = ".lmlab-compare"  # in every --out compare writes: --overwrite replaces only such a directory
SEED_FIELDS = ("train.seed", "model.init_seed")  # runs differing only here are seeds of one group
UNITS = {"nats": "nats/token", "bpb": "bits/byte"}
X_AXES = {"steps": "optimizer steps", "tokens": "training tokens", "wall_time": "wall time (s)"}
LOSS_KEYS = ("val_loss", "val_perplexity", "val_bits_per_byte")  # the table's loss columns; other val_* are measures
TASK_PREFIX = "tasks/"  # a downstream evaluation's score in metrics.jsonl: tasks/<task>/<metric>
NO_BPB = "n/a"  # the bits-per-byte cells of a classifier: its loss is over labels, not over text
Failure = tuple[str, Exception]  # (what the user gave or the run found, why it cannot be read)


# ============================================================== finding and reading runs
LISTED = 3  # more unreadable arguments (or runs) than this are summarized in one line with their count


def is_run_dir(path: Path) -> bool:
    """A run directory: a config.yaml with metrics.jsonl (a file; or anything, to be named when read) or
    checkpoints/ beside it."""
    return (path / CONFIG_FILE).is_file() and ((path / METRICS_FILE).exists() or (path / CHECKPOINTS).is_dir())


def runs_under(path: Path) -> list[Path]:
    """``path`` if it is a run, else every run below it (not looking inside runs), in name order.
    Each real directory is visited once: a symbolic link to a directory already seen (a loop, or
    a second name for a run) adds nothing."""
    found: list[Path] = []
    seen: set[str] = set()
    stack = [path]
    while stack:
        p = stack.pop()
        real = os.path.realpath(p)
        if real in seen:
            continue
        seen.add(real)
        if is_run_dir(p):
            found.append(p)
            continue
        children = sorted(e.name for e in os.scandir(p) if not e.name.startswith(".") and e.is_dir())
        stack += [p / name for name in reversed(children)]  # popped in name order
    return found


def printable(text: object) -> str:
    """``text`` with control and other unprintable characters escaped (``\\x1b``), so that a run's name
    never sends terminal escape sequences."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def find_runs(args: Sequence[str]) -> tuple[list[Path], list[Failure]]:
    """The run directories that ``args`` (runs, directories of runs, globs) name, each once (by real
    path), in the order given; and each argument that names none, with why (more than
    :data:`LISTED` summarized as one, see :func:`summarized`). Linear in the paths found."""
    paths: list[Path] = []
    failed: list[Failure] = []
    seen: set[str] = set()
    for arg in args:
        matches = sorted(glob.glob(os.path.expanduser(arg))) if glob.has_magic(arg) else [arg]
        if not matches:
            failed.append((printable(arg), FileNotFoundError(f"{arg!r} matches no file")))
        for m in map(Path, matches):
            if not m.is_dir():
                why = "does not exist" if not m.exists() else "is a file, not a run directory"
                failed.append((printable(m), FileNotFoundError(f"{str(m)!r} {why}")))
                continue
            try:
                found = runs_under(m)
            except OSError as e:  # a folder that cannot be listed
                failed.append((printable(m), e))
                continue
            if not found:
                failed.append((printable(m), ValueError(f"{str(m)!r} is not a run directory (no {CONFIG_FILE} with "
                                                        f"{METRICS_FILE}) and holds none")))
            for p in found:
                real = os.path.realpath(p)
                if real not in seen:
                    seen.add(real)
                    paths.append(p)
    return paths, summarized(failed, "arguments")


def summarized(failed: list[Failure], what: str) -> list[Failure]:
    """``failed`` as it is when short; else one failure that counts them and names the first few,
    with the worst exit status among them (a damaged file over a bad path)."""
    if len(failed) <= LISTED:
        return failed
    names = ", ".join(repr(w) for w, _ in failed[:LISTED])
    first = one_line(failed[0][1])
    text = (f"{len(failed):,} {what} ({names} and {len(failed) - LISTED:,} more) name nothing that can be "
            f"compared; the first: {first}")
    bad_input = all(isinstance(e, (ValueError, FileNotFoundError, NotADirectoryError)) for _, e in failed)
    return [(f"{len(failed):,} {what}", ValueError(text) if bad_input else EnvironmentFailure(text))]


@dataclasses.dataclass
class RunSummary:
    """One run as compare sees it: its config, its metrics records, and how its losses convert."""

    path: Path
    config: RunConfig
    records: list[dict[str, Any]]
    tokenizer: str  # for the table: kind and vocabulary, e.g. "bpe 300"
    tokenizer_id: str  # the prepared data's tokenizer fingerprint (kind and vocabulary when the data is gone)
    tokens_per_byte: float | None  # of the validation windows the trainer evaluates; None: unknown
    parameters: int
    name: str = ""  # relative to the directory all compared runs share

    def val_records(self) -> list[dict[str, Any]]:
        return [r for r in self.records if _finite(r.get("val_loss"))]

    @property
    def is_lm(self) -> bool:
        """A language model: its losses are over text, so they have bits per byte (a classifier's are over labels)."""
        return self.config.task == "lm"

    def measures(self) -> dict[str, float]:
        """The last finite value of each evaluation measure other than the losses: ``val_accuracy`` as
        "final val accuracy", a downstream task's ``tasks/<task>/<metric>`` under its own key."""
        last: dict[str, float] = {}
        for r in self.records:
            for key, value in r.items():
                measure = (key.startswith("val_") and key not in LOSS_KEYS) or key.startswith(TASK_PREFIX)
                if measure and _finite(value):
                    last[f"final val {key[4:]}" if key.startswith("val_") else key] = value
        return last

    def diverged(self) -> bool:
        """Whether the last evaluation's loss is not finite (null in metrics.jsonl): the run diverged,
        and an earlier finite loss is not its final one."""
        evals = [r for r in self.records if "val_loss" in r]
        return bool(evals) and not _finite(evals[-1]["val_loss"])

    def final_val(self) -> float:
        """The last evaluation's loss: inf where it diverged, nan where the run never evaluated."""
        if self.diverged():
            return math.inf
        vals = self.val_records()
        return vals[-1]["val_loss"] if vals else math.nan

    def best_val(self) -> float:
        return min((r["val_loss"] for r in self.val_records()), default=math.nan)

    def in_unit(self, loss: float, unit: str) -> float:
        """A loss in nats per token as ``unit``: itself, or bits per byte (nan when the bytes are unknown)."""
        if unit == "nats":
            return loss
        return loss / math.log(2) * self.tokens_per_byte if self.tokens_per_byte else math.nan

    def axis(self) -> dict[int, dict[str, float]]:
        """step -> {"steps", "tokens", "wall_time"} at every record's step: tokens and wall time from the
        records that log throughput, interpolated by step for the others (an evaluation between logs)."""
        import numpy as np

        logged = [r for r in self.records if "tokens" in r and _finite(r.get("tokens_per_s")) and r["tokens_per_s"] > 0]
        steps, tokens, wall, clock, before = [0], [0.0], [0.0], 0.0, 0
        for r in logged:
            clock += (r["tokens"] - before) / r["tokens_per_s"]
            before = r["tokens"]
            steps.append(r["step"])
            tokens.append(float(r["tokens"]))
            wall.append(clock)
        at = sorted({r["step"] for r in self.records})
        t, w = np.interp(at, steps, tokens), np.interp(at, steps, wall)
        return {s: {"steps": float(s), "tokens": float(t[i]), "wall_time": float(w[i])} for i, s in enumerate(at)}

    def series(self, key: str, unit: str) -> list[tuple[int, float]]:
        """(step, value of ``key`` in ``unit``) for every record that holds a finite one."""
        return [(r["step"], self.in_unit(r[key], unit)) for r in self.records if _finite(r.get(key))]

    def tokens(self) -> int:
        return max((r["tokens"] for r in self.records if "tokens" in r), default=0)

    def wall_s(self) -> float:
        axis = self.axis()
        return axis[max(axis)]["wall_time"] if axis else 0.0

    def tokens_per_s(self) -> float:
        speeds = [r["tokens_per_s"] for r in self.records if _finite(r.get("tokens_per_s"))]
        return statistics.median(speeds) if speeds else math.nan


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def read_run(path: Path) -> RunSummary:
    """A run's config, metrics and tokenizer; FileNotFoundError, ValueError or CorruptFile (each naming
    the file) when it cannot be read."""
    from ..memory import parameter_count

    cfg = load_config(path / CONFIG_FILE)
    records = read_metrics(path)
    check_records(path, records)
    data_dir = run_data_dir(path, cfg.data)
    meta = DataMeta.read(data_dir)
    kind = meta.tokenizer if meta else cfg.data.tokenizer
    vocab = meta.vocab_size if meta else cfg.model.vocab_size
    return RunSummary(path, cfg, records, tokenizer=f"{kind} {vocab}",
                      tokenizer_id=meta.tokenizer_hash if meta else f"{kind} {vocab}",
                      tokens_per_byte=logged_tokens_per_byte(records) or eval_tokens_per_byte(data_dir, cfg, meta),
                      parameters=parameter_count(cfg.model))


def check_records(path: Path, records: list[dict[str, Any]]) -> None:
    """Refuse (CorruptFile, naming the file and step) a metrics file whose training records lack the
    token count the trainer writes with every one: the table and the x axes rest on it."""
    for r in records:
        tokens = r.get("tokens")
        if "loss" in r and not (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0):
            raise CorruptFile(f"{str(path / METRICS_FILE)!r}: the training record of step {r['step']} has "
                              f"tokens={tokens!r}, not a count (the trainer writes one with every record); the file "
                              "is damaged or not lmlab's")


def logged_tokens_per_byte(records: list[dict[str, Any]]) -> float | None:
    """Validation tokens per byte from the last evaluation that logged its bits per byte."""
    for r in reversed(records):
        if _finite(r.get("val_bits_per_byte")) and _finite(r.get("val_loss")) and r["val_loss"] > 0:
            return r["val_bits_per_byte"] * math.log(2) / r["val_loss"]
    return None


def eval_tokens_per_byte(data_dir: Path, cfg: RunConfig, meta: DataMeta | None) -> float | None:
    """Tokens per byte of the validation windows the trainer evaluates (the first ``eval.batches`` x
    ``train.batch_size`` windows of ``seq_len``), read from the run's prepared data; None without it
    (or when it cannot be read: the table then says the bits per byte are unknown)."""
    if meta is None or meta.task != "lm":
        return None
    import numpy as np

    from ..run.data.batches import TokenData

    try:
        val, T = TokenData(data_dir, "val"), cfg.seq_len
        n = min(val.num_eval_windows(T), cfg.eval.batches * cfg.train.batch_size) * T
        n_bytes = int(val.byte_lengths[np.asarray(val.tokens[1:n + 1], dtype=np.int64)].sum())
    except (ValueError, OSError, CorruptFile):
        return None
    return n / n_bytes if n and n_bytes else None


def read_runs(paths: Sequence[Path]) -> tuple[list[RunSummary], list[Failure]]:
    """Each run read (and named relative to the directory they share), and each that could not be, with why."""
    runs, failed = [], []
    for p in paths:
        try:
            runs.append(read_run(p))
        except (ValueError, OSError, CorruptFile) as e:
            failed.append((printable(p), e))
    if runs:
        real = {id(r): Path(os.path.realpath(r.path)) for r in runs}
        common = Path(os.path.commonpath([str(p) for p in real.values()]))
        for r in runs:
            rel = real[id(r)].relative_to(common)
            r.name = printable(rel if rel.parts and len(runs) > 1 else real[id(r)].name)
    return runs, summarized(failed, "runs")


# ============================================================== what is compared
def choose_unit(runs: Sequence[RunSummary], unit: str = "auto") -> str:
    """``unit`` (nats or bpb); for auto, bits per byte when the runs' tokenizers differ."""
    if unit != "auto":
        return unit
    return "bpb" if len({r.tokenizer_id for r in runs}) > 1 else "nats"


def groups(runs: Sequence[RunSummary]) -> dict[str, list[RunSummary]]:
    """Runs that differ only in their seeds, by label: the members' shared path, or a lone run's name."""
    by_key: dict[str, list[RunSummary]] = {}
    for r in runs:
        fields = {k: v for k, v in flatten(r.config.to_dict()).items() if k not in SEED_FIELDS}
        by_key.setdefault(json.dumps(fields, sort_keys=True, default=str), []).append(r)
    out = {}
    for members in by_key.values():
        if len(members) == 1:
            out[members[0].name] = members
            continue
        shared = os.path.commonpath([m.name for m in members]) if all("/" in m.name for m in members) else ""
        out[f"{shared or members[0].name} ({len(members)} seeds)"] = members
    return out


def comparison_rows(runs: Sequence[RunSummary], unit: str) -> tuple[list[dict[str, Any]], list[str]]:
    """A row per run, and the columns in order: bits per byte first when that is the unit compared, the other
    evaluation measures (accuracy, downstream tasks), the budget, and the config fields that differ."""
    diff = differing_fields([r.config for r in runs])
    measures = [r.measures() for r in runs]
    extra = sorted(set().union(*measures), key=lambda k: (k.startswith(TASK_PREFIX), k))  # accuracy, then tasks
    rows = []
    for i, r in enumerate(runs):
        final = "diverged" if r.diverged() else r.final_val()
        speed = r.tokens_per_s()
        bpb = (final if r.diverged() else r.in_unit(r.final_val(), "bpb"), r.in_unit(r.best_val(), "bpb"))
        row = {"run": r.name, "tokenizer": printable(r.tokenizer),
               "final val bpb": bpb[0] if r.is_lm else NO_BPB, "best val bpb": bpb[1] if r.is_lm else NO_BPB,
               "final val loss": final, "best val loss": r.best_val(),
               "steps": max((x["step"] for x in r.records), default=0), "tokens": r.tokens(),
               "wall s": f"{r.wall_s():.1f}", "tokens/s": round(speed) if math.isfinite(speed) else math.nan,
               "params": r.parameters}
        row.update({k: measures[i].get(k, "") for k in extra})
        row.update({k: _short(v[i]) for k, v in diff.items()})
        rows.append(row)
    losses = ["final val loss", "best val loss"]
    bpb = ["final val bpb", "best val bpb"]
    order = ["run", "tokenizer", *(bpb + losses if unit == "bpb" else losses + bpb), *extra,
             "steps", "tokens", "wall s", "tokens/s", "params", *diff]
    return rows, order


def _short(value: Any) -> Any:
    """A config value for a table cell: a long path by its last two parts."""
    if isinstance(value, str) and os.sep in value and len(value) > 32:
        return printable("…/" + "/".join(Path(value).parts[-2:]))
    return printable(value) if isinstance(value, str) else value


def header(runs: Sequence[RunSummary], unit: str) -> str:
    """What the table's losses mean, and which unit compares the runs."""
    kinds = sorted({r.tokenizer for r in runs})
    if len({r.tokenizer_id for r in runs}) > 1:
        first = (f"The runs use different tokenizers ({', '.join(kinds)}), so they are compared in bits per byte "
                 "(bpb: summed validation loss / ln 2 / the UTF-8 bytes the evaluated tokens cover); nats per token "
                 "do not compare across tokenizers.")
    else:
        first = (f"One tokenizer ({kinds[0]}): losses are compared in "
                 f"{'nats per token' if unit == 'nats' else 'bits per byte'}; bpb = summed validation loss / ln 2 / "
                 "the UTF-8 bytes the evaluated tokens cover.")
    classifiers = [r.name for r in runs if not r.is_lm]
    if classifiers:
        first += (f" Classifiers ({', '.join(classifiers)}): their loss is cross-entropy over their labels, not "
                  f"over text, so they have no bits per byte ({NO_BPB}) and compare only with classifiers on the same "
                  "labels (accuracy in 'final val accuracy').")
    missing = [r.name for r in runs if r.is_lm and not r.tokens_per_byte]
    if missing:
        first += f" Bits per byte unknown (no val_bits_per_byte logged, no prepared data): {', '.join(missing)}."
    diverged = [r.name for r in runs if r.diverged()]
    if diverged:
        first += (f" Diverged (the last evaluation's loss is not finite; best is over the finite ones): "
                  f"{', '.join(diverged)}.")
    return first


def comparison_text(runs: Sequence[RunSummary], unit: str, width: int | None = None) -> str:
    """The header, then the table, for a terminal: lines of at most ``width`` characters where it is given
    (the table cut into parts by :func:`fit_table`; a single cell wider than that stays whole), else the
    table in one piece."""
    rows, columns = comparison_rows(runs, unit)
    if width is None:
        return header(runs, unit) + "\n\n" + text_table(rows, columns)
    parts = fit_table(rows, columns, width)
    text = textwrap.fill(header(runs, unit), width) + "\n\n" + "\n".join(text_table(rows, p) for p in parts)
    if len(parts) > 1:
        text += textwrap.fill(f"(the table is cut into {len(parts)} parts to fit {width} columns; compare.md, written "
                              "with --out DIR, holds it whole)", width) + "\n"
    return text


def fit_table(rows: list[dict[str, Any]], columns: Sequence[str], width: int) -> list[list[str]]:
    """``columns`` cut into consecutive parts, each led by the first (the run) and as many more whole
    columns as fit ``width`` characters in :func:`text_table`'s layout (at least one more per part)."""
    def column_width(c: str) -> int:
        return max(len(c), *(len(cell(r.get(c, ""))) for r in rows))

    lead, *rest = columns
    parts: list[list[str]] = []
    used = width + 1  # no part open yet
    for c in rest:
        w = 2 + column_width(c)  # two spaces before each column
        if used + w > width and (not parts or len(parts[-1]) > 1):
            parts.append([lead])
            used = column_width(lead)
        parts[-1].append(c)
        used += w
    return parts or [[lead]]


def terminal_width() -> int | None:
    """The width to fit the table to: the terminal's where stdout is one, or ``COLUMNS`` where it is set (as
    shutil reads it); None (the table whole) where the output goes to a file or a pipe."""
    try:
        fits = sys.stdout.isatty() or "COLUMNS" in os.environ
    except (AttributeError, ValueError):  # replaced or closed streams
        fits = "COLUMNS" in os.environ
    return max(shutil.get_terminal_size().columns, 40) if fits else None


# ============================================================== files
def check_out(out: str | Path, runs: Sequence[Path], overwrite: bool) -> None:
    """Refuse an --out that is or lies inside one of ``runs``, a file, a directory of someone else's
    files (no marker), or an earlier comparison without ``overwrite``: before anything is read."""
    out = Path(out)
    if out.is_symlink():
        raise ValueError(f"--out {str(out)!r} is a symbolic link; give the directory itself (compare replaces "
                         "its --out as a whole)")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file; give a directory for the plots and compare.md")
    real = out.resolve()
    for run in runs:
        if real == run.resolve() or run.resolve() in real.parents:
            raise ValueError(f"--out {str(out)!r} is inside the run {str(run)!r}; a comparison is written outside "
                             "the runs it reads: choose another --out")
    if out.is_dir() and any(out.iterdir()):
        _ours(out)
        if not overwrite:
            raise ValueError(f"--out {str(out)!r} holds an earlier comparison; pass --overwrite to replace it")


def plot_losses(runs: Sequence[RunSummary], path: Path, x: str, unit: str) -> str:
    """Validation and train loss against ``x`` (steps, tokens or wall_time), a line or seed band per group."""
    plt = figure()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, what in zip(axes, ("val_loss", "loss"), ("validation loss", "train loss")):
        for label, members in groups(runs).items():
            band_plot(ax, group_curves(members, key, x, unit), label=label,
                      marker="." if key == "val_loss" else None)
        ax.set_xlabel(X_AXES[x])
        ax.set_ylabel(f"{what} ({UNITS[unit]}{', estimated' if key == 'loss' and unit == 'bpb' else ''})")
        ax.set_title(f"{what} vs {X_AXES[x]}")
        ax.grid(alpha=0.3)
        if ax.lines and len(ax.lines) <= 16:
            ax.legend(fontsize=7)
    return save(fig, path)


def group_curves(members: Sequence[RunSummary], key: str, x: str, unit: str) -> list[list[tuple[float, float]]]:
    """Each member's (x, loss) points, with x the group's mean at that step (seeds share their x for the band)."""
    axes = [m.axis() for m in members]
    steps = {s for a in axes for s in a}
    mean_x = {s: statistics.fmean(a[s][x] for a in axes if s in a) for s in steps}
    return [[(mean_x[s], y) for s, y in m.series(key, unit)] for m in members]


def write_comparison(runs: Sequence[RunSummary], out: Path, unit: str, command: str) -> list[Path]:
    """compare.md (header, table, groups, plots) and loss_vs_{steps,tokens,wall_time}.png in ``out``
    (checked by :func:`check_out` first); returns the files written. The directory appears whole or
    not at all (written beside it, then renamed; see ``install_directory``): a kill or a full disk
    leaves the earlier comparison or nothing, and the next compare removes what a killed one left."""
    out = Path(out)
    names: list[str] = []

    def write(tmp: Path) -> None:
        atomic_write_text(tmp / MARKER, "written by lmlab compare; --overwrite replaces this directory's comparison\n")
        pngs = [plot_losses(runs, tmp / f"loss_vs_{x}.png", x, unit) for x in X_AXES]
        rows, columns = comparison_rows(runs, unit)
        banded = [f"- {label}: {', '.join(m.name for m in members)}" for label, members in groups(runs).items()
                  if len(members) > 1]
        text = (f"# {len(runs)} runs compared\n\nMade by: `{printable(command)}`\n\n{header(runs, unit)} Wall time is "
                "rebuilt from each record's tokens/s; tokens/s is the median over logged steps.\n\n"
                + markdown_table(rows, columns)
                + ("\nRuns that differ only in their seeds, drawn as mean ± 1 std:\n\n" + "\n".join(banded) + "\n"
                   if banded else "")
                + "".join(f"\n![loss vs {x}]({name})\n" for x, name in zip(X_AXES, pngs)))
        atomic_write_text(tmp / "compare.md", text)
        names[:] = ["compare.md", *pngs]

    install_directory(out, "compare", write, may_replace=_ours)
    return [out / n for n in names]


def _ours(out: Path) -> None:
    """Refuse to replace ``out`` unless an earlier compare wrote it (checked again just before the swap)."""
    if not (out / MARKER).is_file():
        raise ValueError(f"--out {str(out)!r} holds files lmlab compare did not write (no {MARKER}); choose "
                         "another --out, or empty it yourself")
