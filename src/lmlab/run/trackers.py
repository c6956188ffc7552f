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
anything is written (:func:`check_trackers`): not installed, its import broken, or its store unusable
(MLflow's default store without SQLAlchemy, a WANDB_MODE W&B does not know, a MLFLOW_TRACKING_URI that
MLflow refuses or cannot reach) is a one-line error before the first step. None of them needs the
network: W&B runs with ``mode="offline"`` in ``<run>/wandb`` unless WANDB_MODE is set, and MLflow
writes an SQLite store with its artifacts beside it in ``<run>/mlruns`` (``mlflow.db``, ``artifacts/``;
current MLflow refuses the file store it used to default to) unless MLFLOW_TRACKING_URI is set.
A tracker that fails during the run is dropped with a note; metrics.jsonl keeps every record, and
``lmlab tb`` rebuilds TensorBoard's events from it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Mapping, Sequence
from urllib.parse import urlparse

from .checkpoint.directory import MLFLOW, RunDir
from .errors import EnvironmentFailure, one_line

VAL_PREFIX = "val_"  # a record's evaluation fields: val_loss, val_perplexity, val_accuracy
TASKS_PREFIX = "tasks/"  # downstream task scores (eval.tasks: run/eval_harness.py), already named by group
SUMMARY_METRICS = ("val/loss", "train/loss")  # what TensorBoard's HParams table shows per run


# ============================================================== what every tracker gets
def grouped_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """A metrics record's finite numbers by grouped name: {"step": 4, "loss": 2.1, "val_loss": 2.3,
    "moe": [{"max_load": 1.4}], "tasks/arc/acc": 0.3} -> {"train/loss": 2.1, "val/loss": 2.3,
    "train/moe/0/max_load": 1.4, "tasks/arc/acc": 0.3}."""
    out = {}
    for key, value in record.items():
        if key == "step":
            continue
        if key.startswith(TASKS_PREFIX):
            out.update(flat_numbers(value, key))
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
    that installs it, ``fix`` what to do when it cannot start; a tracker is built on rank 0 only,
    after every check of the run has passed."""

    name: ClassVar[str]
    module: ClassVar[str]
    extra: ClassVar[str]
    fix: ClassVar[str] = ""
    environment: ClassVar[dict[str, str]] = {}  # set before its import, where the user has not set them

    @classmethod
    def preflight(cls, probe: bool) -> None:
        """Refuse, before anything is written, settings under which the tracker cannot start: a one-line
        ValueError (install something) or EnvironmentFailure. ``probe``: this process will open it, so
        an outside store may be contacted (read only)."""

    note: str | None = None  # one line for the console once it is open (shown unless the run is quiet)

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
    fix = "check that the run directory is writable, or drop tensorboard from log.trackers"

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
    fix = ("unset WANDB_MODE (lmlab then runs W&B offline in the run directory) or, online, log in with "
           "`wandb login`; or drop wandb from log.trackers")
    MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")  # wandb.Settings.mode's choices
    # in the environment, not only passed to wandb.init: wandb's process-wide settings (read from it once)
    # decide whether its own usage analytics go to W&B's server, offline run or not
    environment = {"WANDB_MODE": "offline"}

    @classmethod
    def preflight(cls, probe: bool) -> None:
        mode = os.environ.get("WANDB_MODE")
        if mode and mode not in cls.MODES:
            raise ValueError(f"WANDB_MODE={mode!r} is not a mode W&B knows; choose one of {list(cls.MODES)}, "
                             "or unset it (lmlab then runs W&B offline in the run directory)")

    def __init__(self, run_dir: Path, purge_step: int | None):
        import wandb

        # wandb writes into <dir>/wandb (checkpoint.directory.WANDB, which --overwrite clears)
        # the mode passed too: wandb reads WANDB_MODE once per process, at its first run
        # silent: W&B's own console lines ("wandb: ...", the sync hint at the end) would ignore --quiet and
        # the progress bar; lmlab says where the run went itself (``note``), through the run's console
        mode = os.environ.get("WANDB_MODE") or "offline"
        self.run = wandb.init(dir=str(run_dir), name=run_dir.resolve().name,
                              project=os.environ.get("WANDB_PROJECT", "lmlab"), mode=mode,
                              settings=wandb.Settings(silent=True))
        where = Path(self.run.settings.sync_dir).resolve()  # <run>/wandb/offline-run-<time>-<id>
        self.note = (f"W&B: offline run in {where}; upload it with: wandb sync {where}" if mode == "offline"
                     else f"W&B: {self.run.url or mode}")

    def log_hparams(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def log_text(self, step: int, tag: str, text: str) -> None:
        self.run.log({f"samples/{tag}": text}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker(Tracker):
    """An MLflow run in an SQLite store in the run directory, ``<run>/mlruns/mlflow.db``, its artifacts (the
    samples) in ``<run>/mlruns/artifacts`` (``mlflow ui --backend-store-uri sqlite:///<run>/mlruns/mlflow.db``),
    unless MLFLOW_TRACKING_URI names another store; the experiment is MLFLOW_EXPERIMENT_NAME's, or lmlab."""

    name, module, extra = "mlflow", "mlflow", "mlflow"
    fix = ("unset MLFLOW_TRACKING_URI (lmlab then writes an SQLite store in the run directory) or point it at a "
           "store MLflow accepts (sqlite:///PATH.db, http://HOST:PORT); or drop mlflow from log.trackers")
    MAX_PARAMS, MAX_PARAM_CHARS = 100, 500  # per log_batch call, per value: the limits of every MLflow store
    DATABASE, ARTIFACTS = "mlflow.db", "artifacts"  # in <run>/mlruns (checkpoint.directory.MLFLOW)
    SQL_MODULES = ("sqlalchemy", "alembic")  # what MLflow's SQL stores import; mlflow-skinny leaves them out
    environment = {"MLFLOW_DISABLE_TELEMETRY": "true"}  # MLflow 3 reports usage over the network at import
    PROBE_RETRIES, PROBE_TIMEOUT_S = "0", "20"  # a store that does not answer the first request is named at once

    @staticmethod
    def user_uri() -> str | None:
        return os.environ.get("MLFLOW_TRACKING_URI") or None

    @classmethod
    def preflight(cls, probe: bool) -> None:
        uri = cls.user_uri()
        sql = uri is None or urlparse(uri).scheme.split("+")[0] in ("sqlite", "postgresql", "mysql", "mssql")
        missing = [m for m in cls.SQL_MODULES if not importable(m)] if sql else []
        if missing:
            where = "its default store, SQLite in the run directory," if uri is None else f"the store {uri!r}"
            raise ValueError(f"log.trackers names mlflow, and {where} needs {' and '.join(missing)}, which "
                             "mlflow-skinny leaves out; pip install 'lmlab[mlflow]' (the full mlflow)")
        if uri is not None and probe:  # an outside store, contacted before anything is written
            try:
                with quiet_mlflow(), short_http_retries(cls.PROBE_RETRIES, cls.PROBE_TIMEOUT_S):
                    import mlflow

                    mlflow.MlflowClient(tracking_uri=uri).get_experiment_by_name(cls.experiment_name())
            except Exception as e:  # noqa: BLE001 - MLflow raises its own exceptions, and its stores' and HTTP's
                raise EnvironmentFailure(f"MLflow cannot use MLFLOW_TRACKING_URI={uri!r} ({one_line(e)[:240]}); "
                                         f"{cls.fix}") from None

    @staticmethod
    def experiment_name() -> str:
        return os.environ.get("MLFLOW_EXPERIMENT_NAME", "lmlab")

    def __init__(self, run_dir: Path, purge_step: int | None):
        import mlflow
        from mlflow.entities import Metric, Param

        self.Metric, self.Param = Metric, Param
        uri, artifacts = self.user_uri(), None
        if uri is None:
            store = run_dir.resolve() / MLFLOW
            store.mkdir(exist_ok=True)
            uri, artifacts = f"sqlite:///{store / self.DATABASE}", (store / self.ARTIFACTS).as_uri()
        with quiet_mlflow():  # "Creating initial MLflow database tables..." on every new store
            self.client = mlflow.MlflowClient(tracking_uri=uri)
            name = self.experiment_name()
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(name, artifact_location=artifacts))
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


@contextlib.contextmanager
def quiet_mlflow() -> Iterator[None]:
    """MLflow's and alembic's INFO lines (a new store's table creation and migrations) kept off the run's output."""
    loggers = [logging.getLogger(name) for name in ("mlflow", "alembic")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@contextlib.contextmanager
def short_http_retries(retries: str, timeout_s: str) -> Iterator[None]:
    """MLflow's HTTP retries and timeout for the duration, where the user has not set them: its defaults
    retry an unreachable server for about four minutes before saying so."""
    given = {k: os.environ.get(k) for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")}
    for key, value in zip(given, (retries, timeout_s)):
        if given[key] is None:
            os.environ[key] = value
    try:
        yield
    finally:
        for key, value in given.items():
            if value is None:
                os.environ.pop(key, None)


TRACKERS: dict[str, type[Tracker]] = {t.name: t for t in (TensorBoardTracker, WandbTracker, MlflowTracker)}


# ============================================================== choosing and opening them
def installed(tracker: type[Tracker]) -> bool:
    """Is the tracker's package importable? Checked without importing it (wandb and mlflow are slow to import)."""
    return importable(tracker.module)


def importable(module: str) -> bool:
    """Is ``module`` (a top-level package) installed? Found without importing it; None in sys.modules: not."""
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


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

    for key, value in tracker.environment.items():
        os.environ.setdefault(key, value)
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


def check_trackers(names: Sequence[str], required: bool, *, probe: bool = True) -> None:
    """Refuse, before anything is written, a required tracker that is not installed (ValueError), whose
    import fails (EnvironmentFailure; it is imported here, once: later uses find it imported), or whose
    settings cannot work (:meth:`Tracker.preflight`). ``probe``: this process opens the trackers (rank 0),
    so an outside store may be contacted."""
    if not required:
        return
    for name in names:
        if not installed(TRACKERS[name]):
            raise ValueError(missing_extra(name))
        why = import_failure(TRACKERS[name])
        if why is not None:
            raise broken_install(name, why)
        TRACKERS[name].preflight(probe)


def open_trackers(names: Sequence[str], run_dir: Path, *, purge_step: int | None, required: bool = True,
                  say: Callable[[str], None] = print) -> "Trackers":
    """The named trackers, opened for the run in ``run_dir``. Not ``required`` (the default TensorBoard), a
    tracker that is not installed is skipped with a note; required, it is refused (see :func:`check_trackers`),
    one installed but broken (its import fails) is an :class:`EnvironmentFailure`, and so is one that
    cannot start (whatever its package raises, in one line with the tracker's fix)."""
    check_trackers(names, required, probe=False)
    opened: list[Tracker] = []
    try:
        for name in names:
            tracker = TRACKERS[name]
            why = import_failure(tracker) if installed(tracker) else f"No module named {tracker.module!r}"
            try:
                if why is None:
                    opened.append(tracker(run_dir, purge_step))
                    if opened[-1].note:
                        say(opened[-1].note)
            except ImportError as e:
                why = one_line(e)[:200]
            except Exception as e:  # noqa: BLE001 - a tracker's package may raise anything; one line, no traceback
                raise EnvironmentFailure(f"{name} could not start ({type(e).__name__}: {one_line(e)[:240]}); "
                                         f"{tracker.fix}") from None
            if why is not None:
                if required:
                    raise broken_install(name, why)
                say(f"note: {name} is not installed, so the run writes no {name} records "
                    f"(pip install 'lmlab[{tracker.extra}]')")
    except BaseException:
        Trackers(opened).close()
        raise
    return Trackers(opened, say=say)


class Trackers:
    """Several trackers as one: each call goes to every tracker. One that fails (a server gone, a full disk)
    is dropped with a note naming it, and the run goes on: metrics.jsonl keeps every record."""

    def __init__(self, trackers: Sequence[Tracker] = (), say: Callable[[str], None] = print):
        self.trackers, self.say = list(trackers), say

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def _each(self, call: Callable[[Tracker], None], what: str) -> None:
        for t in list(self.trackers):
            try:
                call(t)
            except Exception as e:  # noqa: BLE001 - a tracker's package may raise anything
                self.trackers.remove(t)
                if what != "closing":
                    with contextlib.suppress(Exception):  # what it has is kept, where it can be
                        t.close()
                self.say(f"note: {t.name} failed {what} ({type(e).__name__}: {one_line(e)[:200]}) and is dropped "
                         f"for the rest of the run; metrics.jsonl keeps every record")

    def log_hparams(self, config: dict[str, Any]) -> None:
        """The config, once, as the session opens (before the first step): a tracker that fails here is
        unusable, and that is an :class:`EnvironmentFailure` naming it and its fix, not a note."""
        for t in self.trackers:
            try:
                t.log_hparams(config)
            except Exception as e:  # noqa: BLE001 - a tracker's package may raise anything
                raise EnvironmentFailure(f"{t.name} could not log the run's config ({type(e).__name__}: "
                                         f"{one_line(e)[:240]}); {t.fix}") from None

    def log_record(self, record: Mapping[str, Any]) -> None:
        """A metrics.jsonl record (with its "step"), as grouped scalars."""
        scalars = grouped_scalars(record)
        if scalars:
            self._each(lambda t: t.log_scalars(record["step"], scalars), f"at step {record['step']}")

    def log_text(self, step: int, tag: str, text: str) -> None:
        self._each(lambda t: t.log_text(step, tag, text), f"logging a sample at step {step}")

    def close(self) -> None:
        """Close every tracker, even when one of them fails (a note, as for any other call)."""
        self._each(lambda t: t.close(), "closing")
        self.trackers = []
