"""A run's metrics: one JSON record per logged step in metrics.jsonl, mirrored to TensorBoard.

    log = MetricsLog(run_dir, tensorboard=True, purge_step=None)
    log.write({"step": 10, "loss": 2.3, "moe": [{"max_load": 1.4}]})
    records = read_metrics("runs/default")
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Iterator

from .directory import METRICS_FILE, RunDir


class MetricsLog:
    """Appends records to metrics.jsonl (flushed after each) and their numbers to TensorBoard."""

    def __init__(self, run: RunDir, *, tensorboard: bool, purge_step: int | None, say: Callable[[str], None] = print):
        self.file = open(run.metrics, "a")
        self.tb = open_tensorboard(run.tensorboard, purge_step, say) if tensorboard else None

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in scalars(record):
                if key != "step":
                    self.tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


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
    """A run's metrics.jsonl as a list of records (train records have "loss", evaluations "val_loss")."""
    p = Path(path) / METRICS_FILE
    if not p.is_file():
        raise FileNotFoundError(f"{str(p)!r} does not exist")
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
