"""A run's metrics: one JSON record per logged step in metrics.jsonl, mirrored to TensorBoard.

    log = MetricsLog(run_dir, tensorboard=True, purge_step=None)
    log.write({"step": 10, "loss": 2.3, "moe": [{"max_load": 1.4}]})
    records = read_metrics("runs/default")

Every line is strict JSON: a non-finite number (a NaN loss, an infinite gradient norm) is written
as ``null``, never as the bare ``NaN`` / ``Infinity`` that Python's json would emit and other
readers refuse. A record reaches the operating system before the step's checkpoint is written
(the trainer calls :meth:`MetricsLog.sync` first), so a crash never loses a record of a step that
a checkpoint covers; records after the checkpoint are dropped on resume and written again.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterator

from .checkpoint.directory import METRICS_FILE, RunDir, metrics_record
from .errors import CorruptFile, write_failure


class MetricsLog:
    """Appends records to metrics.jsonl (flushed after each) and their numbers to TensorBoard."""

    def __init__(self, run: RunDir, *, tensorboard: bool, purge_step: int | None, say: Callable[[str], None] = print):
        self.path = run.metrics
        # O_NOFOLLOW: a link planted after the run's checks is refused rather than written through
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        self.file = os.fdopen(fd, "a", encoding="utf-8")
        self.tb = open_tensorboard(run.tensorboard, purge_step, say) if tensorboard else None

    def write(self, record: dict[str, Any]) -> None:
        try:
            self.file.write(json_line(record))
            self.file.flush()
        except OSError as e:
            write_failure(e, self.path)  # names the file
            raise
        if self.tb is not None:
            for key, value in scalars(record):
                if key != "step":
                    self.tb.add_scalar(key, value, record["step"])

    def sync(self) -> None:
        """Make the records written so far durable (before a checkpoint that covers them)."""
        try:
            os.fsync(self.file.fileno())
        except OSError as e:
            write_failure(e, self.path)
            raise

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def json_line(record: dict[str, Any]) -> str:
    """``record`` as one line of strict JSON, non-finite numbers as null."""
    return json.dumps(finite_or_null(record), allow_nan=False) + "\n"


def finite_or_null(x: Any) -> Any:
    """``x`` with every NaN or infinite float (in dicts, lists and tuples) replaced by None."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite_or_null(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_or_null(v) for v in x]
    return x


def open_tensorboard(path: Path, purge_step: int | None, say: Callable[[str], None]):
    """A SummaryWriter on ``path``, or None (with a note) when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        say("note: tensorboard is not installed, so no event files are written (pip install tensorboard)")
        return None
    return SummaryWriter(str(path), purge_step=purge_step)


def scalars(x: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """(tag, number) pairs of a record for TensorBoard: moe[1]["max_load"] -> "moe/1/max_load"."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        yield prefix, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from scalars(v, f"{prefix}/{k}" if prefix else str(k))
    elif isinstance(x, list) and x and isinstance(x[0], dict):
        for i, v in enumerate(x):
            yield from scalars(v, f"{prefix}/{i}")


def jsonable(x: Any) -> Any:
    """Tensors, numpy scalars and arrays, tuples and non-string keys as plain JSON values."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if hasattr(x, "tolist"):  # torch tensors, numpy arrays and numpy scalars
        return x.tolist()
    return x


def exp_or_none(x: float | None) -> float | None:
    """exp(x) without overflow (perplexity of a loss), None for None."""
    return None if x is None else math.exp(min(x, 700.0))


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """A run's metrics.jsonl as a list of records (train records have "loss", evaluations "val_loss";
    a non-finite value reads as None). A last line cut short by a crash is skipped; any other line
    that is not a record raises :class:`CorruptFile` naming the file and line."""
    p = Path(path) / METRICS_FILE
    if not p.is_file():
        raise FileNotFoundError(f"{str(p)!r} does not exist")
    lines = p.read_bytes().splitlines()
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record = metrics_record(line)
        if record is None:
            if i == len(lines):  # torn by a crash mid-write
                break
            raise CorruptFile(f"{str(p)!r} line {i} is not a metrics record; delete that line (the run's "
                              "checkpoints are unaffected)")
        records.append(record)
    return records
