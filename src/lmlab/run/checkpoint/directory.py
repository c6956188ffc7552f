"""A run directory: what is in it, and the checks before a run starts, continues or replaces one.

    config.yaml      the resolved RunConfig, plus the provenance of every session that trained it
    metrics.jsonl    one JSON record per logged step (evaluation steps add val_loss)
    samples.jsonl    the text samples written during the run: {"step", "tag", "text"} per line
    checkpoints/     see checkpoint/checkpointer.py (and local.py, sharded.py for the two layouts)
    data/            the prepared tokens and tokenizer (data.dir, relative to the run; absolute to share)
    tb/              TensorBoard events (wandb/ and mlruns/ with those trackers: run/trackers.py)
    .lock            held (flock) by the process training the run; removed when it ends

One process at a time: a run directory is locked (``lock.DirLock``) before anything in it is
checked or written, and stays locked for the life of the run; a second process is refused at
once with the holder's PID. Prepared data and sweep directories take the same lock.

Nothing is written through a symbolic link that leaves the run directory: a run whose config.yaml,
metrics.jsonl, samples.jsonl, checkpoints/ or tb/ is such a link is refused (:meth:`RunDir.check_links`), and so
is a run whose own data/ is any link (:meth:`RunDir.check_data_link`). Each file must be of its kind (a file, a
directory) before anything is written (:meth:`RunDir.check_kinds`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from ..config import RunConfig, config_diff, load_config
from . import local as ckpt
from .atomic import atomic_write_text, write_atomic
from .lock import DirLock

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
CHECKPOINTS = "checkpoints"
TENSORBOARD = "tb"
WANDB, MLFLOW = "wandb", "mlruns"  # W&B's offline runs; MLflow's sqlite store and artifacts (run/trackers.py)


class RunDir:
    """The files of one run, by role."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @property
    def config(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def samples(self) -> Path:
        return self.path / SAMPLES_FILE

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def tensorboard(self) -> Path:
        return self.path / TENSORBOARD

    def __str__(self) -> str:
        return str(self.path)

    def lock(self) -> DirLock:
        """Take the run's lock (see the module docstring); release it with ``DirLock.release``."""
        return DirLock(self.path, "run directory").acquire()

    # ---- before a run
    def check(self, cfg: RunConfig, *, resume: bool, overwrite: bool) -> None:
        """Refuse to start over an existing run unless asked to ``resume`` it or ``overwrite`` it,
        and to resume where there is nothing; the message says which run is there."""
        self.check_links()
        self.check_kinds()
        self.check_data_link(cfg)
        exists = self.config.is_file() or bool(ckpt.list_checkpoints(self.checkpoints))
        if resume and not self.config.is_file():
            raise ValueError(f"nothing to resume: {str(self.path)!r} holds no run (no {CONFIG_FILE}); drop --resume")
        if exists and not resume and not overwrite:
            raise ValueError(
                f"run directory {str(self.path)!r} already holds {self.describe(cfg)}; pass --resume to continue it "
                "or --overwrite to replace it, or choose another --run-dir"
            )

    def check_links(self) -> None:
        """Refuse a run whose files would be written through a symbolic link that leaves the run directory."""
        root = self.path.resolve()
        for p in (self.config, self.metrics, self.samples, self.checkpoints, self.tensorboard):
            if not p.is_symlink():
                continue
            try:
                inside = p.resolve().is_relative_to(root)
            except (OSError, RuntimeError):  # a loop of links
                inside = False
            if not inside:
                raise ValueError(
                    f"{str(p)!r} is a symbolic link to {os.readlink(p)!r}, outside the run directory; lmlab writes a "
                    "run's files only inside it: remove the link, or make --run-dir the directory it points into"
                )

    def check_kinds(self) -> None:
        """Refuse a run whose config.yaml or metrics.jsonl is not a file, or whose checkpoints/ or tb/ is not a
        directory: found only at the first write, that would come after config.yaml had changed."""
        for p, want in ((self.config, "file"), (self.metrics, "file"), (self.samples, "file"),
                        (self.checkpoints, "directory"), (self.tensorboard, "directory")):
            if not p.exists():
                continue
            kind = "directory" if p.is_dir() else "file" if p.is_file() else "special file"
            if kind != want:
                raise ValueError(f"{str(p)!r} is a {kind}, not a {want}; lmlab writes a run's {p.name} there: "
                                 "move it away, or choose another --run-dir")

    def check_data_link(self, cfg: RunConfig) -> None:
        """Refuse to prepare a run's own data (``data.dir`` relative to the run) through a symbolic link:
        preparing would rewrite the directory it points to, which another run or the user owns."""
        if cfg.data.prepared is not None or Path(cfg.data.dir).is_absolute():
            return
        p = self.path
        for part in Path(cfg.data.dir).parts:
            p = p / part
            if p.is_symlink():
                raise ValueError(
                    f"{str(p)!r} is a symbolic link to {os.readlink(p)!r}; lmlab prepares a run's data inside the run "
                    "only: remove the link, or name that directory as data.dir (an absolute path shares it)")

    def describe(self, cfg: RunConfig) -> str:
        """"this run, trained to step N" or "a different run (field: a vs b, there vs here)"."""
        found = ckpt.list_checkpoints(self.checkpoints)
        with contextlib.suppress(ValueError, FileNotFoundError):
            saved = load_config(self.config)
            # the vocabulary is resolved from the data when a run starts; compare everything else
            diff = config_diff(saved, cfg.override({"model.vocab_size": saved.model.vocab_size}))
            at = f", trained to step {found[-1][0]}" if found else ""
            return f"a different run ({diff[0]}, there vs here)" if diff else f"this run{at}"
        return "a run"

    def clear(self) -> None:
        """Remove an earlier run's config, metrics, samples, checkpoints and trackers' records (``--overwrite``)."""
        trackers = (self.tensorboard, self.path / WANDB, self.path / MLFLOW)
        for p in (self.checkpoints, *trackers, self.metrics, self.samples, self.config):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)

    def sweep_temporaries(self) -> None:
        """Remove the temporary files of atomic writes that a killed run left behind (config.yaml's,
        metrics.jsonl's, samples.jsonl's, and under checkpoints/). Called by the process holding the run's lock."""
        for name in (CONFIG_FILE, METRICS_FILE, SAMPLES_FILE):
            for p in self.path.glob(f".{name}.*.tmp"):
                p.unlink(missing_ok=True)
        ckpt.sweep_temporaries(self.checkpoints)

    # ---- while it runs
    def write_config(self, cfg: RunConfig, entry: dict[str, Any]) -> None:
        """The resolved config, with ``entry`` appended to the provenance of earlier sessions."""
        import yaml

        from ...schema import read_yaml

        history = []
        if self.config.is_file():
            saved = read_yaml(self.config, f"config file {str(self.config)!r}")
            history = saved.get("provenance", []) if isinstance(saved, dict) else []
        data = {**cfg.to_dict(), "provenance": [*history, entry]}
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.config, yaml.safe_dump(data, sort_keys=False))

    def trim_metrics(self, step: int) -> int:
        """On resume, keep the records of steps up to ``step`` (the checkpoint), byte for byte; the
        resumed run logs the later ones again. Lines that cannot be read (one cut short by a crash,
        bytes that are not UTF-8 or not a record) are dropped rather than block the resume; returns
        how many were. samples.jsonl is trimmed the same way (its unreadable lines are not counted)."""
        trim_records(self.samples, step)
        return trim_records(self.metrics, step)


def trim_records(path: Path, step: int) -> int:
    """Keep the records of ``path`` (a JSON-lines file of records with a "step") up to ``step``; returns
    how many unreadable lines were dropped. A missing file stays missing."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        record = metrics_record(line)
        if record is None:
            dropped += 1
        elif record["step"] <= step:
            kept.append(line + b"\n")
    write_atomic(path, b"".join(kept))
    return dropped


def metrics_record(line: bytes | str) -> dict[str, Any] | None:
    """One line of metrics.jsonl as a record with an integer "step", or None if it is not one."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, not UTF-8 (a ValueError too), or nested too deep to parse
        return None
    ok = isinstance(record, dict) and isinstance(record.get("step"), int) and not isinstance(record["step"], bool)
    return record if ok else None
