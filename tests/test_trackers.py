"""Trackers: log.trackers, what TensorBoard, W&B and MLflow receive from a run, and `lmlab tb`.

TensorBoard is read back with its own EventAccumulator. W&B and MLflow are replaced by fake modules
in sys.modules that record every call (the extras are not installed by the test suite); where the
real package is importable, its offline path is exercised too.
"""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

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
from lmlab.run.trackers import WandbTracker, flat_hparams, grouped_scalars, open_trackers
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


# ============================================================== W&B and MLflow, as fakes
class FakeWandbRun:
    def __init__(self, options: dict):
        self.options, self.config_updates, self.logged, self.finished = options, [], [], False
        self.config = types.SimpleNamespace(update=lambda d, allow_val_change=False: self.config_updates.append(d))

    def log(self, data: dict, step: int | None = None) -> None:
        self.logged.append((step, dict(data)))

    def finish(self) -> None:
        self.finished = True


class FakeMlflowClient:
    def __init__(self, tracking_uri: str):
        self.tracking_uri, self.experiments, self.metrics, self.params, self.texts = tracking_uri, [], [], [], []
        self.terminated = []
        FAKE_MLFLOW.clients.append(self)

    def get_experiment_by_name(self, name: str):
        return None

    def create_experiment(self, name: str) -> str:
        self.experiments.append(name)
        return "7"

    def create_run(self, experiment_id: str, run_name: str | None = None):
        assert experiment_id == "7"
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id=f"run-{run_name}"))

    def log_batch(self, run_id: str, metrics=(), params=()) -> None:
        assert len(params) <= 100
        self.metrics += [(m.key, m.value, m.step) for m in metrics]
        self.params += [(p.key, p.value) for p in params]

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.texts.append((artifact_file, text))

    def set_terminated(self, run_id: str) -> None:
        self.terminated.append(run_id)


FAKE_MLFLOW = types.SimpleNamespace(clients=[])


@pytest.fixture
def fake_trackers(monkeypatch):
    """Fake wandb and mlflow modules in sys.modules; returns (the wandb runs, the mlflow clients) made."""
    runs: list[FakeWandbRun] = []
    wandb = types.ModuleType("wandb")
    wandb.init = lambda **options: runs.append(FakeWandbRun(options)) or runs[-1]
    mlflow, entities = types.ModuleType("mlflow"), types.ModuleType("mlflow.entities")
    mlflow.MlflowClient, mlflow.entities = FakeMlflowClient, entities
    entities.Metric = lambda key, value, timestamp, step: types.SimpleNamespace(key=key, value=value, step=step)
    entities.Param = lambda key, value: types.SimpleNamespace(key=key, value=value)
    for name, module in (("wandb", wandb), ("mlflow", mlflow), ("mlflow.entities", entities)):
        monkeypatch.setitem(sys.modules, name, module)
    for var in ("WANDB_MODE", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    FAKE_MLFLOW.clients = []
    return runs, FAKE_MLFLOW.clients


def test_wandb_and_mlflow_get_the_config_the_scalars_by_step_the_samples_and_close(tmp_path, fake_trackers):
    runs, clients = fake_trackers
    cfg = tiny_run(tmp_path, **{"log.trackers": ["wandb", "mlflow"]})
    train(cfg, tmp_path / "run")
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    del saved["provenance"]
    want = expected_scalars(tmp_path / "run")
    samples = [(s["step"], s["text"]) for s in read_samples(tmp_path / "run")]

    (run,) = runs  # W&B: offline, in the run directory, never the network
    assert run.options == {"dir": str(tmp_path / "run"), "name": "run", "project": "lmlab", "mode": "offline"}
    assert run.config_updates == [saved]
    got: dict[str, list] = {}
    for step, data in run.logged:
        for tag, value in data.items():
            got.setdefault(tag, []).append((step, value))
    assert {t: v for t, v in got.items() if not t.startswith("samples/")} == want
    assert got["samples/sample"] == samples and run.finished

    (client,) = clients  # MLflow: a local file store in the run directory
    assert client.tracking_uri == (tmp_path / "run" / "mlruns").resolve().as_uri()
    assert client.tracking_uri.startswith("file:") and client.experiments == ["lmlab"]
    assert dict(client.params)["optim.lr"] == str(saved["optim"]["lr"])
    assert len(client.params) == len(flat_hparams(saved))
    mlflow_got: dict[str, list] = {}
    for key, value, step in client.metrics:
        mlflow_got.setdefault(key, []).append((step, value))
    assert mlflow_got == want
    assert client.texts == [(f"samples/sample_step{s:07d}.txt", text) for s, text in samples]
    assert client.terminated == ["run-run"]


def test_the_user_environment_chooses_wandb_mode_and_the_mlflow_store(tmp_path, fake_trackers, monkeypatch):
    runs, clients = fake_trackers
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    train(tiny_run(tmp_path, **{"log.trackers": ["wandb", "mlflow"], "log.sample_every": 0, "log.sample_tokens": 0}),
          tmp_path / "run")
    assert "mode" not in runs[0].options and clients[0].tracking_uri == "http://127.0.0.1:1"


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


# ============================================================== the real packages, where installed
def test_wandb_offline_writes_its_run_inside_the_run_directory(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed; the fakes above cover the calls")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    train(tiny_run(tmp_path, **{"log.trackers": ["wandb"]}), tmp_path / "run")
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))


def test_mlflow_writes_a_local_file_store_inside_the_run_directory(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow", reason="the mlflow extra is not installed; the fakes above cover the calls")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    train(tiny_run(tmp_path, **{"log.trackers": ["mlflow"]}), tmp_path / "run")
    client = mlflow.MlflowClient(tracking_uri=(tmp_path / "run" / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("lmlab").experiment_id])
    history = sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)
    assert [(m.step, pytest.approx(m.value)) for m in history] == expected_scalars(tmp_path / "run")["train/loss"]
    assert run.data.params["optim.lr"] == str(load_config(tmp_path / "run" / "config.yaml").optim.lr)


def test_overwrite_clears_the_earlier_runs_samples_and_tracker_records(tmp_path):
    run = RunDir(tmp_path / "run")
    for d in ("tb", "wandb/offline-run-1", "mlruns/0", "checkpoints"):
        (run.path / d).mkdir(parents=True)
    run.samples.write_text('{"step": 2, "tag": "sample", "text": "The "}\n')
    run.clear()
    assert list(run.path.iterdir()) == []
