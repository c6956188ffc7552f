"""Where a sweep keeps each run, and the files it adds to a run directory: one place names them.

    runs/<variant>/seed<s>/   a normal run directory (config.yaml, metrics.jsonl, checkpoints/), plus
               .../start.json    the config hash and git revision the run started from (kept across resumes)
               .../result.json   written atomically when the run is finished: its row of the table
               .../curve.jsonl   (step, tokens, wall_s, cpu_s, loss | val_loss) as the run goes
    locks/                    one lock file per run: a run is trained by one process at a time
    sweep.json                the spec file and whether it was committed, at which revision (latest invocation)
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

from ...run.checkpoint.atomic import atomic_write_text
from ...run.checkpoint.directory import CHECKPOINTS, CONFIG_FILE, METRICS_FILE, metrics_record
from ...run.checkpoint.lock import LOCK_FILE
from ...run.errors import CorruptFile
from ...run.metrics import jsonable

__all__ = ["CurveLogger", "check_out", "clean_temporaries", "clear_run", "lock_file", "read_curve", "read_result",
           "read_start", "run_dir_of", "write_result", "write_start", "write_sweep_record"]

_RESULT_FILE = "result.json"  # a finished run: its row of the table
_START_FILE = "start.json"  # config hash, revision, and measurements taken at initialization
_CURVE_FILE = "curve.jsonl"  # (step, tokens, wall_s, cpu_s, loss | val_loss) as the run goes
_SWEEP_FILE = "sweep.json"  # the spec file and its registration status (experiments.registration)


def check_out(out: str | Path, what: str = "sweep directory") -> None:
    """Refuse, before anything is written, an output directory a sweep (or an experiment, a ladder) may
    not write into: a file; a directory that holds files and no sweep.json (a run directory, someone's
    data: the sweep would add its corpus, locks and runs to them); or one that lies inside a run
    directory. An empty or missing directory, or an earlier sweep's (its sweep.json or locks/), is resumed."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{what} {str(out)!r} is a file; choose a directory")
    real = out.resolve()
    for parent in (real, *real.parents):
        if _is_run_dir(parent):
            where = "is" if parent == real else "lies inside"
            raise ValueError(f"{what} {str(out)!r} {where} the run directory {str(parent)!r}; a sweep writes its "
                             "own directory of runs: choose another --out")
    if out.is_dir() and not ((out / _SWEEP_FILE).is_file() or (out / "locks").is_dir()):  # a sweep's own files
        found = sorted(p.name for p in out.iterdir() if p.name != LOCK_FILE)  # .lock: the lock this command holds
        if found:
            shown = ", ".join(found[:3]) + (f" and {len(found) - 3:,} more" if len(found) > 3 else "")
            raise ValueError(f"{what} {str(out)!r} holds files lmlab did not write there ({shown}; no "
                             f"{_SWEEP_FILE}); choose another --out, or an empty directory")


def clean_temporaries(out: str | Path) -> list[Path]:
    """Remove the temporary files (``.<name>.<random>.tmp``, atomic_write's) that a sweep killed mid-write
    left beside its own files: at the top of ``out``, in its corpus/, and beside each run's result.json,
    start.json and curve.jsonl. Call it holding ``out``'s lock (as ``lmlab sweep`` and ``lmlab experiment``
    do): no live writer then owns one. A run's own files (checkpoints) are the trainer's to clean on resume."""
    out = Path(out)
    own = (_RESULT_FILE, _START_FILE, _CURVE_FILE)
    stale = [*out.glob(".*.tmp"), *(out / "corpus").glob(".*.tmp"),
             *(p for name in own for p in out.glob(f"runs/*/seed*/.{name}.*.tmp"))]
    for p in stale:
        if p.is_file() and not p.is_symlink():
            p.unlink()
    return stale


def _is_run_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file() and ((path / METRICS_FILE).exists() or (path / CHECKPOINTS).is_dir())


def run_dir_of(out: Path, variant: str, seed: int) -> Path:
    """The run directory of ``variant`` trained with sweep seed ``seed``."""
    return Path(out) / "runs" / variant / f"seed{seed}"


def lock_file(out: Path, variant: str, seed: int) -> Path:
    """The file whose ``flock`` says which process trains that run."""
    return Path(out) / "locks" / f"{variant}.seed{seed}.lock"


def _read_record(p: Path) -> dict | None:
    """A record the sweep wrote atomically (result.json, start.json), or None when absent; a damaged
    one is a one-line CorruptFile naming it and the fix, never a traceback and never skipped."""
    if not p.is_file():
        return None
    try:
        data = json.loads(p.read_text())
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        data = e
    if not isinstance(data, dict):
        raise CorruptFile(f"{p} is damaged ({'not valid JSON' if isinstance(data, Exception) else 'not a record'}); "
                          f"delete {p.parent} to train that run again")
    return data


def read_result(run_dir: Path) -> dict | None:
    """A finished run's row (result.json), or None while it is unfinished."""
    return _read_record(run_dir / _RESULT_FILE)


def write_result(run_dir: Path, row: dict[str, Any]) -> None:
    """Mark the run finished with its row; written last and atomically."""
    atomic_write_text(run_dir / _RESULT_FILE, json.dumps(jsonable(row), indent=1) + "\n")


def read_start(run_dir: Path) -> dict | None:
    """What was recorded when the run first started (start.json), or None."""
    return _read_record(run_dir / _START_FILE)


def write_start(run_dir: Path, start: dict[str, Any]) -> None:
    atomic_write_text(run_dir / _START_FILE, json.dumps(start) + "\n")


def write_sweep_record(out: Path, record: dict[str, Any]) -> None:
    """sweep.json: the spec file and whether it was committed and at which revision (each invocation rewrites it)."""
    atomic_write_text(Path(out) / _SWEEP_FILE, json.dumps(jsonable(record), indent=1) + "\n")


def clear_run(run_dir: Path) -> None:
    """Remove a run's files so it starts again (its lock lives elsewhere and stays held)."""
    if run_dir.is_dir():
        shutil.rmtree(run_dir)


def read_curve(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of a run's curve.jsonl (empty before it logged any). A last line cut short by a crash
    is skipped; any other line that is not a row (garbage, JSON nested too deep) is a CorruptFile
    naming the file and line."""
    p = Path(run_dir) / _CURVE_FILE
    lines = p.read_bytes().splitlines() if p.is_file() else []
    rows = []
    for i, line in enumerate(lines, 1):
        row = metrics_record(line) if line.strip() else {}
        if row is None and i < len(lines):
            raise CorruptFile(f"{str(p)!r} line {i} is not a curve record; delete that line (the run's checkpoints "
                              "are unaffected)")
        if row:
            rows.append(row)
    return rows


class CurveLogger:
    """Trainer callback: appends (step, tokens, cumulative wall time and process CPU time, loss / val_loss) to
    curve.jsonl.

    It goes into the Trainer's constructor with the other callbacks; once the trainer knows the step
    it resumed at, :meth:`begin` drops the rows after that step and starts the clocks, so a resumed
    run logs no step twice and its times continue. CPU time is the process's (every thread), which other
    programs on a shared machine disturb far less than wall time; a run resumed from a curve that recorded
    none (written before it was kept) has none (NaN), not a part."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / _CURVE_FILE
        self.offset = self.wall_s = self.cpu_offset = self.cpu_s = 0.0
        self.start, self.cpu_start = time.perf_counter(), time.process_time()

    def begin(self, resumed_step: int) -> None:
        kept = [r for r in read_curve(self.path.parent) if r["step"] <= resumed_step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self.offset = self.wall_s = kept[-1]["wall_s"] if kept else 0.0
        self.cpu_offset = self.cpu_s = float(kept[-1].get("cpu_s", math.nan)) if kept else 0.0
        self.start, self.cpu_start = time.perf_counter(), time.process_time()

    def __call__(self, trainer, record: dict) -> None:
        self.wall_s = self.offset + time.perf_counter() - self.start
        self.cpu_s = self.cpu_offset + time.process_time() - self.cpu_start
        if "loss" in record or "val_loss" in record:
            row = {"step": record["step"], "tokens": trainer.tokens, "wall_s": round(self.wall_s, 3)}
            if math.isfinite(self.cpu_s):
                row["cpu_s"] = round(self.cpu_s, 3)
            for key in ("loss", "val_loss", "grad_norm", "tokens_per_s"):
                if key in record:
                    row[key] = record[key]
            if "moe" in record:
                row["max_load"] = [layer.get("max_load") for layer in record["moe"]]
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
