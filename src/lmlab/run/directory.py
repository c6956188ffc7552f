"""A run directory: what is in it, and the checks before a run starts, continues or replaces one.

    config.yaml      the resolved RunConfig, plus the provenance of every session that trained it
    metrics.jsonl    one JSON record per logged step (evaluation steps add val_loss)
    checkpoints/     see checkpoint.py
    data/            the prepared tokens and tokenizer (data.dir, relative to the run; absolute to share)
    tb/              TensorBoard events
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any

from . import checkpoint as ckpt
from .atomic import atomic_write_text
from .config import RunConfig, config_diff, load_config

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
TENSORBOARD = "tb"


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
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def tensorboard(self) -> Path:
        return self.path / TENSORBOARD

    def __str__(self) -> str:
        return str(self.path)

    # ---- before a run
    def check(self, cfg: RunConfig, *, resume: bool, overwrite: bool) -> None:
        """Refuse to start over an existing run unless asked to ``resume`` it or ``overwrite`` it,
        and to resume where there is nothing; the message says which run is there."""
        exists = self.config.is_file() or bool(ckpt.list_checkpoints(self.checkpoints))
        if resume and not self.config.is_file():
            raise ValueError(f"nothing to resume: {str(self.path)!r} holds no run (no {CONFIG_FILE}); drop --resume")
        if exists and not resume and not overwrite:
            raise ValueError(
                f"run directory {str(self.path)!r} already holds {self.describe(cfg)}; pass --resume to continue it "
                "or --overwrite to replace it, or choose another --run-dir"
            )

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
        """Remove an earlier run's config, metrics, checkpoints and events (``--overwrite``)."""
        for p in (self.checkpoints, self.tensorboard, self.metrics, self.config):
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)

    # ---- while it runs
    def write_config(self, cfg: RunConfig, entry: dict[str, Any]) -> None:
        """The resolved config, with ``entry`` appended to the provenance of earlier sessions."""
        import yaml

        history = []
        if self.config.is_file():
            history = (yaml.safe_load(self.config.read_text()) or {}).get("provenance", [])
        data = {**cfg.to_dict(), "provenance": [*history, entry]}
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.config, yaml.safe_dump(data, sort_keys=False))

    def trim_metrics(self, step: int) -> None:
        """On resume, drop records logged after ``step`` (the checkpoint), which the resumed run logs again."""
        if not self.metrics.is_file():
            return

        def keep(line: str) -> bool:
            try:
                return json.loads(line)["step"] <= step
            except (ValueError, KeyError, TypeError):  # a line cut short by a crash
                return False

        lines = [ln for ln in self.metrics.read_text().splitlines() if keep(ln)]
        atomic_write_text(self.metrics, "".join(ln + "\n" for ln in lines))
