"""A run's metrics: one JSON record per logged step in metrics.jsonl, its text samples in
samples.jsonl, both mirrored to the run's trackers (TensorBoard, W&B, MLflow: run/trackers.py).

    log = MetricsLog.open(run_dir, cfg, step=0)                  # the trackers of cfg.log get cfg
    log.write({"step": 10, "loss": 2.3, "moe": [{"max_load": 1.4}]})
    log.text(10, "sample", "The cat sat")
    records = read_metrics("runs/default")
    rebuild_tensorboard("runs/default")                          # <run>/tb again, from the files alone

Every line is strict JSON: a non-finite number (a NaN loss, an infinite gradient norm) is written
as ``null``, never as the bare ``NaN`` / ``Infinity`` that Python's json would emit and other
readers refuse. A record reaches the operating system before the step's checkpoint is written
(the trainer calls :meth:`MetricsLog.sync` first), so a crash never loses a record of a step that
a checkpoint covers; records after the checkpoint are dropped on resume and written again.
The trackers get each record as it is written (nulls dropped), so events rebuilt from the files
hold the same numbers as those written during the run.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, TextIO

from .checkpoint.atomic import install_directory
from .checkpoint.directory import METRICS_FILE, SAMPLES_FILE, RunDir, metrics_record
from .checkpoint.lock import locked
from .config import RunConfig, load_config
from .errors import CorruptFile, write_failure
from .trackers import TensorBoardTracker, Trackers, installed, open_trackers


class MetricsLog:
    """Appends records to metrics.jsonl and samples to samples.jsonl (flushed after each), and passes
    both to ``trackers``."""

    def __init__(self, run: RunDir, trackers: Trackers | None = None):
        self.path, self.samples_path = run.metrics, run.samples
        self.file = open_append(self.path)
        self.samples: TextIO | None = None  # opened at the first sample: a run without samples has no file
        self.trackers = trackers or Trackers()

    @classmethod
    def open(cls, run: RunDir, cfg: RunConfig, step: int, say: Callable[[str], None] = print) -> "MetricsLog":
        """The log of a run that starts (``step`` 0) or resumes at ``step``, with the trackers of
        ``cfg.log``, which get ``cfg`` as their hyper-parameters."""
        names, required = cfg.log.tracker_names()
        log = cls(run)
        try:
            log.trackers = open_trackers(names, run.path, purge_step=step + 1 if step else None, required=required,
                                         say=say)
            log.trackers.log_hparams(cfg.to_dict())
        except BaseException:
            log.close()
            raise
        return log

    def write(self, record: dict[str, Any]) -> None:
        written = finite_or_null(record)
        append(self.file, self.path, json.dumps(written, allow_nan=False) + "\n")
        self.trackers.log_record(written)  # as written: a non-finite number is dropped, as it reads back as null

    def text(self, step: int, tag: str, text: str) -> None:
        """A text sample (``tag``: what it is, e.g. "sample") at ``step``."""
        if self.samples is None:
            self.samples = open_append(self.samples_path)
        append(self.samples, self.samples_path, json_line({"step": step, "tag": tag, "text": text}))
        self.trackers.log_text(step, tag, text)

    def sync(self) -> None:
        """Make the records written so far durable (before a checkpoint that covers them)."""
        for file, path in ((self.file, self.path), (self.samples, self.samples_path)):
            try:
                if file is not None:
                    os.fsync(file.fileno())
            except OSError as e:
                write_failure(e, path)
                raise

    def close(self) -> None:
        self.file.close()
        if self.samples is not None:
            self.samples.close()
        self.trackers.close()


def open_append(path: Path) -> TextIO:
    """``path`` opened for appending UTF-8 text; a link planted after the run's checks is refused
    (O_NOFOLLOW) rather than written through."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    return os.fdopen(fd, "a", encoding="utf-8")


def append(file: TextIO, path: Path, line: str) -> None:
    """Write and flush ``line``; a failure names ``path``."""
    try:
        file.write(line)
        file.flush()
    except OSError as e:
        write_failure(e, path)  # names the file
        raise


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
    if p.is_dir():
        raise IsADirectoryError(f"{str(p)!r} is a directory, not a file")
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


def read_samples(path: str | Path) -> list[dict[str, Any]]:
    """A run's samples.jsonl as records {"step", "tag", "text"} ([] when the run wrote none); read as
    :func:`read_metrics` reads metrics.jsonl."""
    p = Path(path) / SAMPLES_FILE
    if not p.is_file():
        return []
    lines = p.read_bytes().splitlines()
    records = []
    for i, line in enumerate(lines, 1):
        record = metrics_record(line) if line.strip() else {}
        if record is None and i < len(lines):  # the last line may be torn by a crash mid-write
            raise CorruptFile(f"{str(p)!r} line {i} is not a sample record; delete that line")
        if record and isinstance(record.get("tag"), str) and isinstance(record.get("text"), str):
            records.append(record)
    return records


TB_MARKER = ".lmlab-tb"  # in every directory ``lmlab tb`` writes: --overwrite replaces only such a one (or RUN/tb)


def rebuild_tensorboard(run_dir: str | Path, out: str | Path | None = None, *,
                        overwrite: bool = False) -> tuple[Path, int, int, bool]:
    """Write TensorBoard events for a run from its files alone: the grouped scalars of metrics.jsonl,
    the samples of samples.jsonl and config.yaml as HParams, into ``out`` (default ``<run>/tb``), as
    the trainer writes them. The directory is written beside ``out`` and renamed into place (see
    ``install_directory``): it is new, empty, or with ``overwrite`` replaced whole, which only the
    run's own tb/ or a directory an earlier ``lmlab tb`` wrote (marked ``.lmlab-tb``) may be; nothing
    else is deleted. Returns (out, records, samples, whether hparams were written)."""
    run = RunDir(run_dir)
    if not run.path.is_dir():
        raise FileNotFoundError(f"run directory {str(run.path)!r} does not exist")
    records, samples = read_metrics(run.path), read_samples(run.path)
    config = load_config(run.config).to_dict() if run.config.is_file() else None
    if not installed(TensorBoardTracker):
        raise ValueError("tensorboard is not installed; pip install 'lmlab[tensorboard]' to write TensorBoard events")
    target = Path(out) if out is not None else run.tensorboard
    own = os.path.realpath(target) == os.path.realpath(run.tensorboard)
    check_tensorboard_out(target, own, overwrite)
    inside = Path(os.path.realpath(target)).is_relative_to(os.path.realpath(run.path))

    def write(tmp: Path) -> None:
        if not own:  # RUN/tb is the run's own by where it is; elsewhere the marker says lmlab tb wrote it
            (tmp / TB_MARKER).write_text("written by lmlab tb; --overwrite replaces this directory's events\n")
        trackers = Trackers([TensorBoardTracker(run.path, None, log_dir=tmp)])
        try:
            if config is not None:
                trackers.log_hparams(config)
            for record in records:
                trackers.log_record(record)
            for sample in samples:
                trackers.log_text(sample["step"], sample["tag"], sample["text"])
        finally:
            trackers.close()
        for f in tmp.rglob("*"):  # SummaryWriter does not fsync
            if f.is_file():
                with open(f, "rb") as handle:
                    os.fsync(handle.fileno())

    with locked(run.path, "run directory") if inside else contextlib.nullcontext():  # not while it trains
        install_directory(target, "tb", write, may_replace=lambda t: check_tensorboard_out(t, own, True))
    return target, len(records), len(samples), config is not None


def check_tensorboard_out(target: Path, own: bool, overwrite: bool) -> None:
    """Refuse a ``target`` that is a link or a file, that holds files neither the run's trainer nor ``lmlab tb``
    wrote (another run, another program: not RUN/tb and no .lmlab-tb), or that holds events without ``overwrite``."""
    if target.is_symlink():
        raise ValueError(f"{str(target)!r} is a symbolic link; give --out the directory itself (lmlab tb replaces "
                         "its events as a whole)")
    if target.exists() and not target.is_dir():
        raise ValueError(f"{str(target)!r} is a file; give --out a directory for the events")
    if not (target.is_dir() and any(target.iterdir())):
        return
    if not own and not (target / TB_MARKER).is_file():
        raise ValueError(f"{str(target)!r} holds files lmlab tb did not write (no {TB_MARKER}); --overwrite replaces "
                         "only the run's own tb/ or an earlier lmlab tb --out: choose another --out")
    if not overwrite:
        existing = sum(1 for _ in target.rglob("events.out.tfevents.*"))
        raise ValueError(f"{str(target)!r} already holds TensorBoard events ({existing} file(s)); pass "
                         "--overwrite to replace them, or choose another --out")
