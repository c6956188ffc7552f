"""Trackers: where a run's records go besides metrics.jsonl: TensorBoard, Weights & Biases, MLflow.

    trackers = open_trackers(("tensorboard", "wandb"), run_dir, purge_step=None)
    trackers.log_hparams(cfg.to_dict())                          # the resolved run config
    trackers.log_record({"step": 10, "loss": 2.3, "val_loss": 2.5})  # train/loss, val/loss at step 10
    trackers.log_text(10, "sample", "The cat sat")               # samples/sample
    trackers.close()

Every tracker gets the same records the run writes to metrics.jsonl (non-finite numbers dropped, as
they are written there as null), so ``lmlab tb RUN`` rebuilds the same TensorBoard events from the
run's files later. A record's numbers are grouped: evaluation fields (``val_loss``) as ``val/loss``,
the others as ``train/...``; nested ones by path (``train/moe/0/max_load``).

Each tracker is an optional extra, imported only when ``log.trackers`` names it, and checked before
anything is written (:func:`check_trackers`). None of them needs the network: W&B runs with
``mode="offline"`` in the run directory unless WANDB_MODE is set, and MLflow writes a local file
store (``<run>/mlruns``) unless MLFLOW_TRACKING_URI is set.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Mapping, Sequence

from .checkpoint.directory import MLFLOW, RunDir
from .errors import EnvironmentFailure, one_line

VAL_PREFIX = "val_"  # a record's evaluation fields: val_loss, val_perplexity, val_accuracy
SUMMARY_METRICS = ("val/loss", "train/loss")  # what TensorBoard's HParams table shows per run


# ============================================================== what every tracker gets
def grouped_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """A metrics record's finite numbers by grouped name: {"step": 4, "loss": 2.1, "val_loss": 2.3,
    "moe": [{"max_load": 1.4}]} -> {"train/loss": 2.1, "val/loss": 2.3, "train/moe/0/max_load": 1.4}."""
    out = {}
    for key, value in record.items():
        if key == "step":
            continue
        group, name = ("val", key[len(VAL_PREFIX):]) if key.startswith(VAL_PREFIX) else ("train", key)
        out.update(flat_numbers(value, f"{group}/{name}"))
    return out


def flat_numbers(x: Any, prefix: str) -> Iterator[tuple[str, float]]:
    """(path, number) pairs of nested dicts and lists of dicts; booleans, strings and non-finite numbers skipped."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        if math.isfinite(x):
            yield prefix, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from flat_numbers(v, f"{prefix}/{k}")
    elif isinstance(x, list) and x and isinstance(x[0], dict):
        for i, v in enumerate(x):
            yield from flat_numbers(v, f"{prefix}/{i}")


def flat_hparams(config: Mapping[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
    """A nested config as dotted keys with plain values: lists as JSON text, None as "null"
    ({"optim": {"betas": [0.9, 0.95]}} -> {"optim.betas": "[0.9, 0.95]"}), as hyper-parameter tables take them."""
    out: dict[str, bool | int | float | str] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out.update(flat_hparams(value, f"{prefix}{key}."))
        elif isinstance(value, (bool, int, float, str)):
            out[f"{prefix}{key}"] = value
        else:
            out[f"{prefix}{key}"] = json.dumps(value)
    return out


# ============================================================== the interface
class Tracker:
    """One destination of a run's records. ``module`` is what it imports, ``extra`` the lmlab extra
    that installs it; a tracker is built on rank 0 only, after every check of the run has passed."""

    name: ClassVar[str]
    module: ClassVar[str]
    extra: ClassVar[str]

    def __init__(self, run_dir: Path, purge_step: int | None):
        """Open the tracker for the run in ``run_dir``; a resumed run drops its events from ``purge_step`` on."""

    def log_hparams(self, config: dict[str, Any]) -> None:
        """The resolved run config (nested sections), once per session."""

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """Grouped numbers at ``step``: {"train/loss": 2.1, "val/loss": 2.3}."""

    def log_text(self, step: int, tag: str, text: str) -> None:
        """A text sample at ``step``."""

    def close(self) -> None:
        """Flush and close."""


class TensorBoardTracker(Tracker):
    """Events in ``<run>/tb`` (or any directory): grouped scalars, the config as HParams, samples as text."""

    name, module, extra = "tensorboard", "tensorboard", "tensorboard"

    def __init__(self, run_dir: Path, purge_step: int | None, *, log_dir: Path | None = None):
        from torch.utils.tensorboard import SummaryWriter

        # TensorBoard drops events at purge_step and later: a resumed run keeps every step up to its checkpoint
        self.writer = SummaryWriter(str(log_dir or RunDir(run_dir).tensorboard), purge_step=purge_step)

    def log_hparams(self, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        # into this run's own event file (SummaryWriter.add_hparams would start a second run beside it)
        for summary in hparams(flat_hparams(config), dict.fromkeys(SUMMARY_METRICS)):
            self.writer.file_writer.add_summary(summary)

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def log_text(self, step: int, tag: str, text: str) -> None:
        self.writer.add_text(f"samples/{tag}", text, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """A Weights & Biases run in ``<run>/wandb``, offline unless WANDB_MODE says otherwise (sync it later
    with ``wandb sync``). The project is WANDB_PROJECT's, or lmlab; the run is named after its directory."""

    name, module, extra = "wandb", "wandb", "wandb"

    def __init__(self, run_dir: Path, purge_step: int | None):
        import wandb

        # wandb writes into <dir>/wandb (checkpoint.directory.WANDB, which --overwrite clears)
        options: dict[str, Any] = {"dir": str(run_dir), "name": run_dir.resolve().name,
                                   "project": os.environ.get("WANDB_PROJECT", "lmlab")}
        if not os.environ.get("WANDB_MODE"):  # never the network unless the user asked for it
            options["mode"] = "offline"
        self.run = wandb.init(**options)

    def log_hparams(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def log_text(self, step: int, tag: str, text: str) -> None:
        self.run.log({f"samples/{tag}": text}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker(Tracker):
    """An MLflow run in a local file store, ``<run>/mlruns`` (``mlflow ui --backend-store-uri <run>/mlruns``),
    unless MLFLOW_TRACKING_URI names another; the experiment is MLFLOW_EXPERIMENT_NAME's, or lmlab."""

    name, module, extra = "mlflow", "mlflow", "mlflow"
    MAX_PARAMS, MAX_PARAM_CHARS = 100, 500  # per log_batch call, per value: the limits of every MLflow store

    def __init__(self, run_dir: Path, purge_step: int | None):
        import mlflow
        from mlflow.entities import Metric, Param

        self.Metric, self.Param = Metric, Param
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir.resolve() / MLFLOW).as_uri()
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "lmlab")
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment is not None else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=run_dir.resolve().name).info.run_id

    def log_hparams(self, config: dict[str, Any]) -> None:
        params = [self.Param(k, str(v)[: self.MAX_PARAM_CHARS]) for k, v in flat_hparams(config).items()]
        for i in range(0, len(params), self.MAX_PARAMS):
            self.client.log_batch(self.run_id, params=params[i:i + self.MAX_PARAMS])

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self.Metric(k, float(v), now, step) for k, v in scalars.items()])

    def log_text(self, step: int, tag: str, text: str) -> None:
        self.client.log_text(self.run_id, text, f"samples/{tag}_step{step:07d}.txt")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


TRACKERS: dict[str, type[Tracker]] = {t.name: t for t in (TensorBoardTracker, WandbTracker, MlflowTracker)}


# ============================================================== choosing and opening them
def installed(tracker: type[Tracker]) -> bool:
    """Is the tracker's package importable? Checked without importing it (wandb and mlflow are slow to import)."""
    if tracker.module in sys.modules:
        return sys.modules[tracker.module] is not None
    return importlib.util.find_spec(tracker.module) is not None


def missing_extra(name: str) -> str:
    """The one-line refusal for a tracker that log.trackers names but that is not installed."""
    extra = TRACKERS[name].extra
    return (f"log.trackers names {name}, which is not installed; pip install 'lmlab[{extra}]' "
            f"(or drop {name} from log.trackers)")


def import_failure(tracker: type[Tracker]) -> str | None:
    """Import the tracker's package; None when it imports, else why not in one line. Whatever its import
    raises (an ImportError, any other exception, a ``sys.exit`` inside it) is caught: a broken install
    is the environment's failure, not a traceback, and never ends lmlab with the package's own status."""
    import importlib

    try:
        importlib.import_module(tracker.module)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - a third-party import may raise anything
        sys.modules.pop(tracker.module, None)  # a half-imported package is not "installed"
        what = f"sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"{type(e).__name__}: {one_line(e)[:200]}"
        return what
    return None


def broken_install(name: str, why: str) -> EnvironmentFailure:
    extra = TRACKERS[name].extra
    return EnvironmentFailure(f"{name} is installed but cannot be imported ({why}); reinstall it: "
                              f"pip install --force-reinstall 'lmlab[{extra}]'")


def check_trackers(names: Sequence[str], required: bool) -> None:
    """Refuse, before anything is written, a required tracker that is not installed (ValueError) or whose
    import fails (EnvironmentFailure): it is imported here, once (later uses find it imported)."""
    if not required:
        return
    for name in names:
        if not installed(TRACKERS[name]):
            raise ValueError(missing_extra(name))
        why = import_failure(TRACKERS[name])
        if why is not None:
            raise broken_install(name, why)


def open_trackers(names: Sequence[str], run_dir: Path, *, purge_step: int | None, required: bool = True,
                  say: Callable[[str], None] = print) -> "Trackers":
    """The named trackers, opened for the run in ``run_dir``. Not ``required`` (the default TensorBoard), a
    tracker that is not installed is skipped with a note; required, it is refused (see :func:`check_trackers`),
    and one installed but broken (its import fails) is an :class:`EnvironmentFailure`."""
    check_trackers(names, required)
    opened: list[Tracker] = []
    try:
        for name in names:
            tracker = TRACKERS[name]
            why = import_failure(tracker) if installed(tracker) else f"No module named {tracker.module!r}"
            try:
                if why is None:
                    opened.append(tracker(run_dir, purge_step))
            except ImportError as e:
                why = one_line(e)[:200]
            if why is not None:
                if required:
                    raise broken_install(name, why)
                say(f"note: {name} is not installed, so the run writes no {name} records "
                    f"(pip install 'lmlab[{tracker.extra}]')")
    except BaseException:
        Trackers(opened).close()
        raise
    return Trackers(opened)


class Trackers:
    """Several trackers as one: each call goes to every tracker."""

    def __init__(self, trackers: Sequence[Tracker] = ()):
        self.trackers = list(trackers)

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def log_hparams(self, config: dict[str, Any]) -> None:
        for t in self.trackers:
            t.log_hparams(config)

    def log_record(self, record: Mapping[str, Any]) -> None:
        """A metrics.jsonl record (with its "step"), as grouped scalars."""
        scalars = grouped_scalars(record)
        if scalars:
            for t in self.trackers:
                t.log_scalars(record["step"], scalars)

    def log_text(self, step: int, tag: str, text: str) -> None:
        for t in self.trackers:
            t.log_text(step, tag, text)

    def close(self) -> None:
        """Close every tracker, even when one of them fails (the first failure is raised)."""
        failure = None
        for t in self.trackers:
            try:
                t.close()
            except Exception as e:  # noqa: BLE001 - the others still close
                failure = failure or e
        self.trackers = []
        if failure is not None:
            raise failure
