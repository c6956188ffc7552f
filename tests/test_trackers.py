"""Trackers: log.trackers, what TensorBoard, W&B and MLflow receive from a run, and `lmlab tb`.

Each tracker is the real package, run offline, and what it received is read back from its own store:
TensorBoard's events with its EventAccumulator, W&B's offline run from its transaction log (the file
`wandb sync` uploads), MLflow's SQLite store in the run directory with MLflow's client. Nothing reaches
the network or the home directory (the ``offline`` fixture). Failures are injected into the real
classes only where no setting makes the package fail (a store that breaks as it opens or mid-run).
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
import types
import zlib
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from helpers import FAST_RUN, TINY_MODEL, corpus

import lmlab
from lmlab import cli
from lmlab.run.checkpoint.directory import RunDir
from lmlab.run.config import LogConfig, RunConfig, load_config, one_section_dict
from lmlab.run.data.config import DataConfig
from lmlab.run.errors import EnvironmentFailure
from lmlab.run.metrics import MetricsLog, read_samples
from lmlab.run.progress import Progress
from lmlab.run.trackers import MlflowTracker, WandbTracker, flat_hparams, grouped_scalars, open_trackers
from lmlab.run.trainer import Trainer

# 4 steps, a record every step, evaluations at 2 and 4, samples at 2 and at the end
TRACKED = {**FAST_RUN, "train.steps": 4, "eval.every": 2, "log.every": 1, "log.tensorboard": True,
           "log.sample_tokens": 6, "log.sample_every": 2, "checkpoint.every": 100}


def tiny_run(tmp_path: Path, **changes) -> RunConfig:
    """The tiny byte-level llama on a word corpus in ``tmp_path``, with TRACKED's settings and ``changes``."""
    source = tmp_path / "corpus.txt"
    if not source.exists():
        corpus(source)
    base = RunConfig(model=lmlab.ModelConfig.from_preset("llama", **TINY_MODEL), data=DataConfig(source=str(source)))
    return base.override({**TRACKED, **changes})


def train(cfg: RunConfig, run_dir: Path, **kw) -> Trainer:
    with Trainer(cfg, run_dir, quiet=True, **kw) as trainer:
        trainer.fit()
    return trainer


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def expected_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as the trackers should get it: each grouped name's (step, value) points."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in records(run_dir):
        for tag, value in grouped_scalars(r).items():
            out.setdefault(tag, []).append((r["step"], value))
    return out


# ============================================================== the config field
def test_log_trackers_is_a_validated_list_and_the_old_switch_still_reads():
    assert LogConfig(trackers="wandb,mlflow").tracker_names() == (("wandb", "mlflow"), True)
    assert load_config(None, {"log.trackers": "[]"}).log.tracker_names() == ((), True)
    assert LogConfig().tracker_names() == (("tensorboard",), False)  # the default: TensorBoard when installed
    for bad, message in [({"trackers": "comet"}, r"^log\.trackers\[0\]='comet' is not a valid choice; choose one of "
                                                 r"\['tensorboard', 'wandb', 'mlflow'\]$"),
                         ({"trackers": "wandb,wandb"}, r"^log\.trackers names wandb twice; name each tracker once$"),
                         ({"trackers": "tensorboard", "tensorboard": False},
                          r"^log\.tensorboard=false and log\.trackers names tensorboard; drop log\.tensorboard")]:
        with pytest.raises(ValueError, match=message):
            LogConfig(**bad)
    # the old spelling, under its old section too: TensorBoard off
    assert load_config(None, {"log.tensorboard": "false"}).log.tracker_names() == ((), False)
    assert load_config(None, {"train.tensorboard": "false"}).log.tracker_names() == ((), False)


def test_trackers_do_not_change_what_a_sweep_counts_as_the_same_run():
    plain, tracked = RunConfig(), RunConfig().override({"log.trackers": ["wandb", "mlflow"]})
    assert one_section_dict(tracked.to_dict()) == one_section_dict(plain.to_dict())


def test_records_are_grouped_as_train_and_val_and_the_config_flattened():
    record = {"step": 4, "loss": 2.5, "lr": 1e-3, "skipped_steps": 0, "val_loss": 2.25, "val_accuracy": 0.5,
              "grad_norm": None, "aux_losses": {"balance": 0.1}, "moe": [{"max_load": 1.5}, {"max_load": 2.0}],
              "flag": True, "nan": math.nan}
    assert grouped_scalars(record) == {
        "train/loss": 2.5, "train/lr": 1e-3, "train/skipped_steps": 0, "val/loss": 2.25, "val/accuracy": 0.5,
        "train/aux_losses/balance": 0.1, "train/moe/0/max_load": 1.5, "train/moe/1/max_load": 2.0}
    assert flat_hparams({"optim": {"lr": 0.01, "betas": [0.9, 0.95], "min_lr": None}, "task": "lm"}) == {
        "optim.lr": 0.01, "optim.betas": "[0.9, 0.95]", "optim.min_lr": "null", "task": "lm"}


# ============================================================== TensorBoard, read back
def tensorboard_events(log_dir: Path) -> dict:
    """What TensorBoard shows of ``log_dir``: scalars, the HParams of the run, and the text samples."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = event_accumulator.EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {tag: [(e.step, pytest.approx(e.value)) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    start = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    hparams = {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}
    texts = {tag.removesuffix("/text_summary"): [(e.step, e.tensor_proto.string_val[0].decode())
                                                 for e in acc.Tensors(tag)]
             for tag in acc.Tags()["tensors"] if tag.endswith("/text_summary")}
    return {"scalars": scalars, "hparams": hparams, "texts": texts}


def test_tensorboard_gets_grouped_scalars_the_config_and_the_samples(tmp_path):
    cfg = tiny_run(tmp_path, **{"log.trackers": ["tensorboard"]})
    train(cfg, tmp_path / "run")
    events = tensorboard_events(tmp_path / "run" / "tb")
    want = expected_scalars(tmp_path / "run")
    assert {"train/loss", "train/lr", "train/grad_norm", "val/loss", "val/perplexity"} <= set(want)
    assert events["scalars"] == want  # every number of metrics.jsonl, under its group, at its step
    assert [s for s, _ in events["scalars"]["val/loss"]] == [2, 4]
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert events["hparams"]["optim.lr"] == pytest.approx(saved["optim"]["lr"])
    assert events["hparams"]["model.d_model"] == 32 and events["hparams"]["task"] == "lm"
    samples = read_samples(tmp_path / "run")
    assert [(s["step"], s["tag"]) for s in samples] == [(2, "sample"), (4, "sample")]
    assert samples[0]["text"].startswith("The ")
    assert events["texts"] == {"samples/sample": [(s["step"], s["text"]) for s in samples]}


def test_lmlab_tb_rebuilds_the_same_events_from_the_run_files(tmp_path, capsys):
    cfg = tiny_run(tmp_path, **{"log.trackers": ["tensorboard"]})
    train(cfg, tmp_path / "run")
    assert cli.main(["tb", str(tmp_path / "run"), "--out", str(tmp_path / "rebuilt")]) == 0
    out = capsys.readouterr().out
    assert "4 metrics records, 2 samples, the config as hyper-parameters" in out
    assert tensorboard_events(tmp_path / "rebuilt") == tensorboard_events(tmp_path / "run" / "tb")

    # into the run's own tb/: refused while events are there, replaced with --overwrite
    before = sorted((tmp_path / "run" / "tb").iterdir())
    assert cli.main(["tb", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("already holds TensorBoard events (1 file(s)); pass --overwrite to replace them, or choose "
                        "another --out") and "\n" not in err
    assert sorted((tmp_path / "run" / "tb").iterdir()) == before
    assert cli.main(["tb", str(tmp_path / "run"), "--overwrite"]) == 0
    assert sorted((tmp_path / "run" / "tb").iterdir()) != before and len(list((tmp_path / "run" / "tb").iterdir())) == 1
    assert tensorboard_events(tmp_path / "run" / "tb") == tensorboard_events(tmp_path / "rebuilt")


def test_lmlab_tb_on_a_run_trained_without_tensorboard(tmp_path, capsys):
    train(tiny_run(tmp_path, **{"log.tensorboard": False, "log.sample_every": 0, "log.sample_tokens": 0}),
          tmp_path / "run")
    assert not (tmp_path / "run" / "tb").exists()  # the old switch: no events
    assert cli.main(["tb", str(tmp_path / "run")]) == 0
    events = tensorboard_events(tmp_path / "run" / "tb")
    assert events["scalars"] == expected_scalars(tmp_path / "run") and events["texts"] == {}


def test_lmlab_tb_refuses_a_missing_or_damaged_metrics_file_in_one_line(tmp_path, capsys, monkeypatch):
    assert cli.main(["tb", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err == f"lmlab tb: error: run directory {str(tmp_path / 'nothing')!r} does not exist\n"
    run = tmp_path / "run"
    run.mkdir()
    assert cli.main(["tb", str(run)]) == 2
    assert capsys.readouterr().err == f"lmlab tb: error: {str(run / 'metrics.jsonl')!r} does not exist\n"
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\nnot json\n{"step": 3, "loss": 1.0}\n')
    assert cli.main(["tb", str(run)]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "metrics.jsonl' line 2 is not a metrics record" in err
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    assert cli.main(["tb", str(run)]) == 2
    assert capsys.readouterr().err == ("lmlab tb: error: tensorboard is not installed; pip install "
                                       "'lmlab[tensorboard]' to write TensorBoard events\n")
    assert not (run / "tb").exists()


# ============================================================== W&B and MLflow: the real packages, offline
@pytest.fixture
def offline(tmp_path, monkeypatch):
    """The user's settings cleared (lmlab's defaults: W&B offline in the run directory, MLflow's SQLite store
    there), nothing written to the home directory, and no tracker reaching the network: W&B offline
    without git, code or system-metrics capture, MLflow's usage telemetry off."""
    for var in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_API_KEY", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME",
                "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "home"
    for var, value in {"WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true",
                       "WANDB_X_DISABLE_STATS": "true", "WANDB_CONFIG_DIR": str(home / "wandb-config"),
                       "WANDB_CACHE_DIR": str(home / "wandb-cache"), "WANDB_DATA_DIR": str(home / "wandb-data"),
                       "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}.items():
        monkeypatch.setenv(var, value)


def wandb_records(run_dir: Path) -> list:
    """The protobuf Records of the one offline W&B run under ``run_dir/wandb``, read from its transaction log
    (``run-ID.wandb``, what ``wandb sync`` uploads): a 7-byte header (":W&B", magic 0xBEE1, a version), then
    LevelDB's log format: 32 KiB blocks of chunks, each a CRC-32 (of its type byte and data), a length and a
    type (1 full, 2 first, 3 middle, 4 last), a block's last < 7 bytes zero padding."""
    from wandb.proto import wandb_internal_pb2

    (log,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data = log.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # padding at the end of a block
            pos += block - pos % block
            continue
        crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind == 0:  # the zeros after the last record
            break
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{log}: a damaged chunk at byte {pos}"
        pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_logged(run_dir: Path) -> dict:
    """What the offline W&B run holds: its project and name, its config, each logged key's (step, value)
    points (wandb's own "_step", "_runtime", ... left out), and whether it finished."""
    records = wandb_records(run_dir)
    kinds = [r.WhichOneof("record_type") for r in records]
    (run,) = [r.run for r, k in zip(records, kinds) if k == "run"]
    config: dict = {}
    history: dict[str, list] = {}
    for r, kind in zip(records, kinds):
        if kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in r.config.update})
        elif kind == "history":
            for item in r.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    history.setdefault(key, []).append((r.history.step.num, json.loads(item.value_json)))
    config.pop("_wandb", None)
    return {"project": run.project, "name": run.display_name, "config": config, "history": history,
            "finished": "exit" in kinds}


def mlflow_logged(uri: str) -> dict:
    """What the MLflow store at ``uri`` holds of its one run in experiment lmlab, read with MLflow's own client."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("lmlab")
    (run,) = client.search_runs([experiment.experiment_id])
    metrics = {key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
               for key in run.data.metrics}
    artifacts = Path(urlparse(run.info.artifact_uri).path)
    texts = {str(f.relative_to(artifacts)): f.read_text() for f in sorted(artifacts.rglob("*.txt"))}
    return {"experiment_artifacts": experiment.artifact_location, "name": run.info.run_name,
            "status": run.info.status, "params": run.data.params, "metrics": metrics, "texts": texts}


def approx_points(points: dict[str, list]) -> dict[str, list]:
    return {tag: [(step, pytest.approx(value)) for step, value in v] for tag, v in points.items()}


def tracked_run(tmp_path: Path, tracker: str) -> tuple[Path, dict, dict, list]:
    """A tiny run logged to ``tracker``: (its directory, its saved config without provenance, the scalars the
    trackers should hold, its samples as (step, text))."""
    run = tmp_path / "run"
    train(tiny_run(tmp_path, **{"log.trackers": [tracker]}), run)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    del saved["provenance"]
    want = expected_scalars(run)
    assert {"train/loss", "val/loss"} <= set(want) and [s for s, _ in want["val/loss"]] == [2, 4]
    samples = [(s["step"], s["text"]) for s in read_samples(run)]
    assert [s for s, _ in samples] == [2, 4]
    return run, saved, want, samples


def test_wandb_gets_the_config_the_scalars_by_step_and_the_samples_in_an_offline_run(tmp_path, offline):
    run, saved, want, samples = tracked_run(tmp_path, "wandb")
    wb = wandb_logged(run)  # RUN/wandb/offline-run-*: its transaction log, as `wandb sync` would upload it
    assert (wb["project"], wb["name"], wb["finished"]) == ("lmlab", "run", True)
    assert wb["config"] == saved
    assert {t: v for t, v in wb["history"].items() if not t.startswith("samples/")} == approx_points(want)
    assert wb["history"]["samples/sample"] == samples


@pytest.mark.parametrize("quiet", [True, False])
def test_wandb_prints_nothing_of_its_own_and_lmlab_says_where_the_offline_run_is(tmp_path, offline, monkeypatch,
                                                                                capfd, quiet):
    """W&B's console lines ("wandb: ...", its sync hint at the end) would ignore --quiet: it runs silent, and
    lmlab's console says where the offline run went and how to upload it, unless the run is quiet."""
    monkeypatch.delenv("WANDB_SILENT")  # the user's default
    run = tmp_path / "run"
    with Trainer(tiny_run(tmp_path, **{"log.trackers": ["wandb"]}), run, quiet=quiet) as trainer:
        trainer.fit()
    out, err = capfd.readouterr()
    assert "wandb:" not in out + err
    (synced,) = (run / "wandb").glob("offline-run-*")
    note = f"W&B: offline run in {synced}; upload it with: wandb sync {synced}"
    assert (note in out) is not quiet and (out == "" if quiet else True)


@pytest.mark.slow  # MLflow's migrations of a new SQLite store: 2-3 s of CPU, 15-25 s of a busy disk (fsyncs)
def test_mlflow_gets_the_config_the_scalars_by_step_and_the_samples_in_an_sqlite_store_in_the_run(tmp_path, offline):
    run, saved, want, samples = tracked_run(tmp_path, "mlflow")
    ml = mlflow_logged(f"sqlite:///{run / 'mlruns' / 'mlflow.db'}")  # a store current MLflow accepts by default
    assert ml["experiment_artifacts"] == (run / "mlruns" / "artifacts").as_uri()
    assert (ml["name"], ml["status"]) == ("run", "FINISHED")
    assert ml["params"] == {k: str(v) for k, v in flat_hparams(saved).items()}
    assert ml["metrics"] == approx_points(want)
    assert ml["texts"] == {f"samples/sample_step{s:07d}.txt": text for s, text in samples}
    assert sorted(p.name for p in (run / "mlruns").iterdir()) == ["artifacts", "mlflow.db"]


@pytest.mark.slow  # a new SQLite store, as above
def test_the_user_environment_chooses_wandb_mode_and_the_mlflow_store(tmp_path, offline, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    store = tmp_path / "elsewhere" / "mlflow.db"
    store.parent.mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    train(tiny_run(tmp_path, **{"log.trackers": ["wandb", "mlflow"], "log.sample_every": 0, "log.sample_tokens": 0}),
          tmp_path / "run")
    assert not (tmp_path / "run" / "wandb").exists() and not (tmp_path / "run" / "mlruns").exists()
    assert mlflow_logged(f"sqlite:///{store}")["metrics"] == approx_points(expected_scalars(tmp_path / "run"))


def train_command(tmp_path: Path, *extra: str, steps: int = 2) -> list[str]:
    tmp_path.mkdir(exist_ok=True)
    corpus(tmp_path / "corpus.txt")
    return ["train", "--run-dir", str(tmp_path / "run"), "--data.source", str(tmp_path / "corpus.txt"),
            "--train.steps", str(steps), "--quiet", "--train.device", "cpu", *extra]


def files_of(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("env, code, message", [
    ({"MLFLOW_TRACKING_URI": "file:///{tmp}/mlruns"}, 3,
     r"MLflow cannot use MLFLOW_TRACKING_URI='file:///\S+/mlruns' \(.*filesystem tracking backend.*\); unset "
     r"MLFLOW_TRACKING_URI \(lmlab then writes an SQLite store in the run directory\) or point it at a store "
     r"MLflow accepts \(sqlite:///PATH\.db, http://HOST:PORT\); or drop mlflow from log\.trackers"),
    ({"MLFLOW_TRACKING_URI": "nonsense://store"}, 3, r"MLflow cannot use MLFLOW_TRACKING_URI='nonsense://store' \("),
    ({"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}, 3,
     r"MLflow cannot use MLFLOW_TRACKING_URI='http://127\.0\.0\.1:9' \(.*\); unset MLFLOW_TRACKING_URI"),
    ({"WANDB_MODE": "sometimes"}, 2,
     r"WANDB_MODE='sometimes' is not a mode W&B knows; choose one of \['online', 'offline', 'disabled', 'shared', "
     r"'dryrun', 'run'\], or unset it \(lmlab then runs W&B offline in the run directory\)"),
], ids=["file-store", "unknown-scheme", "no-server", "wandb-mode"])
def test_an_unusable_tracker_is_one_line_before_the_first_step_and_a_resumed_run_loses_nothing(
        tmp_path, offline, monkeypatch, capsys, env, code, message):
    assert cli.main(train_command(tmp_path, "--log.trackers", "tensorboard")) == 0
    before = files_of(tmp_path / "run")
    for var, value in env.items():
        monkeypatch.setenv(var, value.format(tmp=tmp_path))
    tracker = "mlflow" if "MLFLOW_TRACKING_URI" in env else "wandb"
    capsys.readouterr()
    # a new run is refused before its directory exists; a resumed one before it writes a byte
    assert cli.main(train_command(tmp_path / "new", "--log.trackers", tracker)) == code
    err = capsys.readouterr().err
    assert re.fullmatch(f"lmlab train: error: {message}.*\n", err) and err.count("\n") == 1, err
    assert not (tmp_path / "new" / "run").exists()
    assert cli.main(train_command(tmp_path, "--log.trackers", tracker, "--resume", steps=4)) == code
    assert capsys.readouterr().err == err.replace(str(tmp_path / "new"), str(tmp_path))
    assert files_of(tmp_path / "run") == before


def test_mlflow_skinny_without_sqlalchemy_is_refused_naming_the_full_package(tmp_path, offline, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # as mlflow-skinny installs: no SQL stores
    assert cli.main(train_command(tmp_path, "--log.trackers", "mlflow")) == 2
    assert capsys.readouterr().err == (
        "lmlab train: error: log.trackers names mlflow, and its default store, SQLite in the run directory, needs "
        "sqlalchemy, which mlflow-skinny leaves out; pip install 'lmlab[mlflow]' (the full mlflow)\n")
    assert not (tmp_path / "run").exists()


def test_a_tracker_that_cannot_start_is_one_line_and_the_new_run_directory_is_removed(tmp_path, offline, monkeypatch,
                                                                                      capsys):
    def refuses(self, run_dir, purge_step):
        raise RuntimeError("database is locked\n(on its second line)")

    monkeypatch.setattr(MlflowTracker, "__init__", refuses)  # past the checks: the store fails as it opens
    assert cli.main(train_command(tmp_path, "--log.trackers", "mlflow")) == 3
    assert capsys.readouterr().err == (
        "lmlab train: error: mlflow could not start (RuntimeError: database is locked (on its second line)); unset "
        "MLFLOW_TRACKING_URI (lmlab then writes an SQLite store in the run directory) or point it at a store MLflow "
        "accepts (sqlite:///PATH.db, http://HOST:PORT); or drop mlflow from log.trackers\n")
    assert not (tmp_path / "run").exists()


def test_a_tracker_that_fails_mid_run_is_dropped_with_a_note_and_the_run_finishes(tmp_path, offline, monkeypatch):
    logged = WandbTracker.log_scalars

    def fails_from_step_3(self, step, scalars):
        if step >= 3:
            raise ConnectionError("the disk went away")
        logged(self, step, scalars)

    monkeypatch.setattr(WandbTracker, "log_scalars", fails_from_step_3)
    notes: list[str] = []
    monkeypatch.setattr(Progress, "print", lambda self, text: notes.append(text))
    cfg = tiny_run(tmp_path, **{"log.trackers": ["wandb"], "log.sample_every": 0, "log.sample_tokens": 6})
    result = train(cfg, tmp_path / "run")
    assert result.step == 4 and [r["step"] for r in records(tmp_path / "run")] == [1, 2, 3, 4]
    assert ("note: wandb failed at step 3 (ConnectionError: the disk went away) and is dropped for the rest of the "
            "run; metrics.jsonl keeps every record") in notes
    wb = wandb_logged(tmp_path / "run")
    want = {tag: [(s, v) for s, v in points if s < 3] for tag, points in expected_scalars(tmp_path / "run").items()}
    assert wb["history"] == approx_points({tag: points for tag, points in want.items() if points})
    assert wb["finished"]  # dropped, it was closed: what it had is kept


@pytest.mark.parametrize("tracker", ["wandb", "mlflow", "tensorboard"])
def test_a_tracker_named_but_not_installed_stops_the_run_before_it_writes_anything(tmp_path, monkeypatch, capsys,
                                                                                   tracker):
    monkeypatch.setitem(sys.modules, tracker, None)  # as if not installed (import fails)
    corpus(tmp_path / "corpus.txt")
    code = cli.main(["train", "--run-dir", str(tmp_path / "run"), "--data.source", str(tmp_path / "corpus.txt"),
                     "--log.trackers", f"tensorboard,{tracker}" if tracker != "tensorboard" else tracker,
                     "--train.steps", "2", "--quiet", "--train.device", "cpu"])
    assert code == 2
    assert capsys.readouterr().err == (f"lmlab train: error: log.trackers names {tracker}, which is not installed; "
                                       f"pip install 'lmlab[{tracker}]' (or drop {tracker} from log.trackers)\n")
    assert not (tmp_path / "run").exists()


def test_the_default_tensorboard_is_skipped_with_a_note_when_not_installed(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    notes: list[str] = []
    (tmp_path / "run").mkdir()
    MetricsLog.open(RunDir(tmp_path / "run"), tiny_run(tmp_path), 0, say=notes.append).close()
    assert notes == ["note: tensorboard is not installed, so the run writes no tensorboard records "
                     "(pip install 'lmlab[tensorboard]')"]
    assert not (tmp_path / "run" / "tb").exists()


def test_a_broken_tracker_install_is_the_environment_and_a_default_one_only_a_note(tmp_path, monkeypatch):
    def import_fails(*args):
        raise ImportError("bad wheel")

    monkeypatch.setitem(sys.modules, "wandb", types.ModuleType("wandb"))  # installed, but its import fails
    monkeypatch.setattr(WandbTracker, "__init__", import_fails)
    with pytest.raises(EnvironmentFailure, match=r"^wandb is installed but cannot be imported \(bad wheel\); "
                                                 r"reinstall it: pip install --force-reinstall 'lmlab\[wandb\]'$"):
        open_trackers(["wandb"], tmp_path, purge_step=None)
    notes: list[str] = []
    assert not open_trackers(["wandb"], tmp_path, purge_step=None, required=False, say=notes.append)
    assert notes == ["note: wandb is not installed, so the run writes no wandb records (pip install 'lmlab[wandb]')"]


def test_resume_drops_the_samples_after_the_checkpoint(tmp_path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    lines = [json.dumps({"step": s, "tag": "sample", "text": f"t{s}"}) for s in (2, 4, 6)]
    run.samples.write_text("\n".join(lines) + '\n{"step": 8, "ta')  # the last line torn by a crash
    run.metrics.write_text("")
    assert run.trim_metrics(4) == 0
    assert [s["step"] for s in read_samples(run.path)] == [2, 4]


def test_overwrite_clears_the_earlier_runs_samples_and_tracker_records(tmp_path):
    run = RunDir(tmp_path / "run")
    for d in ("tb", "wandb/offline-run-1", "mlruns/0", "checkpoints"):
        (run.path / d).mkdir(parents=True)
    run.samples.write_text('{"step": 2, "tag": "sample", "text": "The "}\n')
    run.clear()
    assert list(run.path.iterdir()) == []
