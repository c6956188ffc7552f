"""eval.tasks: lm-evaluation-harness tasks on the live model during training (run/eval_harness.py), offline.

The task is tests/fixtures/lm_eval_task: 40 multiple-choice items cut from the built-in corpus, a local
JSONL read through the harness's json loader. The adapter's log-likelihoods are checked against sums of
log-probabilities computed by hand from the model's logits, and the logged accuracy against the
accuracy those hand-computed sums give on the checkpoint of the step that was scored.
"""

from __future__ import annotations

import json
import math
import socket
import sys
from pathlib import Path

import pytest
import torch
from helpers import FAST_RUN, TINY_MODEL, corpus

import lmlab
from lmlab import cli
from lmlab.run import eval_harness
from lmlab.run.config import RunConfig
from lmlab.run.data.config import DataConfig
from lmlab.run.data.tokenizer import ByteTokenizer
from lmlab.run.eval_harness import HarnessLM, TaskHarness, task_scores
from lmlab.run.load import load_run
from lmlab.run.progress import Progress
from lmlab.run.trainer import Trainer

pytest.importorskip("lm_eval", reason="the evals extra (lm-eval) is not installed")

TASK_DIR = Path(__file__).parent / "fixtures" / "lm_eval_task"
TASK = TASK_DIR / "corpus_choice.yaml"
DOCS = [json.loads(line) for line in (TASK_DIR / "corpus_choice.jsonl").read_text().splitlines()]
MODEL = {**TINY_MODEL, "max_seq_len": 64}  # the longest item (context, a space, a choice) is 99 bytes


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """The Hugging Face Hub offline and the datasets cache in tmp_path; any connection but a local socket fails."""
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    connect = socket.socket.connect

    def local_only(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise AssertionError(f"a connection to {address} while evaluating tasks offline")
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", local_only)


def tiny_model(seed: int = 0) -> lmlab.Transformer:
    torch.manual_seed(seed)
    return lmlab.Transformer(lmlab.ModelConfig.from_preset("llama", **MODEL)).eval()


def by_hand(model, ids: list[int], n: int) -> tuple[float, bool]:
    """log p of the last ``n`` of ``ids`` given the ones before them, summed, from one forward of the model's
    logits through log_softmax; and whether each of those tokens is the argmax."""
    x = torch.tensor([ids[:-1]])
    with torch.no_grad():
        logp = torch.log_softmax(model(x).logits[0].double(), dim=-1)  # (T, V)
    targets = torch.tensor(ids[1:])
    picked = logp[torch.arange(len(targets)), targets][-n:]
    return float(picked.sum()), bool((logp.argmax(-1)[-n:] == targets[-n:]).all())


def requests(kind: str, *args: tuple) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=0) for a in args]


# ============================================================== the adapter against the model itself
def test_loglikelihood_is_the_sum_of_the_continuations_log_probs_computed_by_hand():
    model, tok = tiny_model(), ByteTokenizer()
    long_context = "a context longer than the model's window of sixty-four bytes, so its start is cut off"
    pairs = [("The cat", " sat on the mat"), ("trailing space ", "moves"), ("", "no context at all"),
             (long_context, " ends"), ("x", "y")]
    want = [
        by_hand(model, tok.encode("The cat sat on the mat"), len(" sat on the mat")),
        by_hand(model, tok.encode("trailing space moves"), len(" moves")),  # the space goes with the continuation
        by_hand(model, [tok.eod_id, *tok.encode("no context at all")], len("no context at all")),  # after <eod>
        by_hand(model, tok.encode(long_context + " ends")[-65:], len(" ends")),  # the last 64 read, 65 with the target
        by_hand(model, tok.encode("xy"), 1),
    ]
    for batch_size in (1, 2, 8):  # one at a time (the reference) and right-padded batches
        got = HarnessLM(model, tok, batch_size=batch_size).loglikelihood(requests("loglikelihood", *pairs))
        assert [(pytest.approx(lp, abs=1e-4), greedy) for lp, greedy in want] == got
    assert all(lp < 0 for lp, _ in want) and want[4][0] > -math.log(256) - 3  # real numbers, not zeros


def test_a_greedy_continuation_is_recognized_as_greedy():
    model, tok = tiny_model(), ByteTokenizer()
    context = "The "
    ids = tok.encode(context)
    with torch.no_grad():
        for _ in range(5):  # the model's own greedy bytes
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    greedy = bytes(ids[len(context):]).decode("latin-1")
    lm = HarnessLM(model, tok, batch_size=4)
    if all(b < 128 for b in ids[len(context):]):  # ASCII: its UTF-8 is its bytes
        ((_, is_greedy), (_, other)) = lm.loglikelihood(requests("loglikelihood", (context, greedy),
                                                                 (context, "?" + greedy[1:])))
        assert is_greedy and not other
    assert lm.score([(tok.encode(context), ids[len(context):])])[0][1]


def test_rolling_loglikelihood_of_a_short_document_is_its_sum_after_the_end_of_document_id():
    model, tok = tiny_model(), ByteTokenizer()
    text = "Once upon a time."
    lm = HarnessLM(model, tok, batch_size=4)
    (got,) = lm.loglikelihood_rolling(requests("loglikelihood_rolling", (text,)))
    want, _ = by_hand(model, [tok.eod_id, *tok.encode(text)], len(text))
    assert got == pytest.approx(want, abs=1e-4)


def test_generate_until_is_greedy_text_cut_at_the_stop_string():
    model, tok = tiny_model(), ByteTokenizer()
    lm = HarnessLM(model, tok, batch_size=4)
    (free,) = lm.generate_until(requests("generate_until", ("The ", {"until": [], "max_gen_toks": 12})))
    ids = tok.encode("The ")
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert free == tok.decode(ids[4:])
    stop = free[3:5] if len(free) >= 5 else free
    (cut,) = lm.generate_until(requests("generate_until", ("The ", {"until": [stop], "max_gen_toks": 12})))
    assert cut == free[:free.index(stop)]


# ============================================================== the task, loaded offline
def test_the_local_task_loads_offline_and_scores_what_hand_computed_log_likelihoods_give():
    harness = TaskHarness.load([str(TASK)])
    assert harness.names == ["corpus_choice"]
    model, tok = tiny_model(seed=1), ByteTokenizer()
    scores = harness.run(HarnessLM(model, tok, batch_size=8))
    assert scores == pytest.approx(expected_scores(model, tok))
    assert TaskHarness.load([str(TASK)], limit=10).run(HarnessLM(model, tok)) == pytest.approx(
        expected_scores(model, tok, DOCS[:10]))


def expected_scores(model, tok, docs=DOCS) -> dict[str, float]:
    """acc and acc_norm of the multiple-choice task from sums of log-probs computed by hand: the choice with the
    most log-likelihood after the context and a space, and the most per character of the choice."""
    acc = norm = 0
    for doc in docs:
        context = tok.encode(doc["context"])
        lls = [by_hand(model, (context + tok.encode(" " + c))[-65:], len(c) + 1)[0] for c in doc["choices"]]
        acc += max(range(4), key=lambda i: lls[i]) == doc["gold"]
        norm += max(range(4), key=lambda i: lls[i] / len(doc["choices"][i])) == doc["gold"]
    return {"tasks/corpus_choice/acc": acc / len(docs), "tasks/corpus_choice/acc_norm": norm / len(docs)}


def test_the_harness_results_become_metrics_keys():
    assert task_scores({"arc": {"alias": "arc", "acc,none": 0.25, "acc_stderr,none": "N/A", "sample_len": 40},
                        "gsm8k": {"exact_match,strict-match": 0.5, "exact_match,flexible-extract": 0.75}}) == {
        "tasks/arc/acc": 0.25, "tasks/gsm8k/exact_match,strict-match": 0.5,
        "tasks/gsm8k/exact_match,flexible-extract": 0.75}


def test_data_files_are_found_beside_the_task_file_then_in_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "choice.yaml").write_text(TASK.read_text().replace("corpus_choice.jsonl",
                                                                             "tasks/choice.jsonl"))
    (tmp_path / "tasks" / "choice.jsonl").write_text("\n".join(json.dumps(d) for d in DOCS[:6]) + "\n")
    monkeypatch.chdir(tmp_path)  # as the lm_eval command line reads it: relative to where it runs
    harness = TaskHarness.load(["tasks/choice.yaml"])
    assert harness.names == ["corpus_choice"] and harness.run(HarnessLM(tiny_model(), ByteTokenizer())) == \
        pytest.approx(expected_scores(tiny_model(), ByteTokenizer(), DOCS[:6]))
    monkeypatch.chdir(tmp_path / "tasks")
    with pytest.raises(ValueError, match=r"^eval\.tasks names 'tasks/choice\.yaml', which is not a file; "):
        TaskHarness.load(["tasks/choice.yaml"])
    with pytest.raises(ValueError, match=r"^'/\S+/choice\.yaml': its data file 'tasks/choice\.jsonl' is neither "
                                         r"beside it nor in the current directory; fix data_files"):
        TaskHarness.load([str(tmp_path / "tasks" / "choice.yaml")])


@pytest.mark.parametrize("spec, message", [
    ("missing.yaml", r"^eval\.tasks names 'missing\.yaml', which is not a file; give a task YAML file or the name "
                     r"of a task lm-evaluation-harness ships$"),
    ("{hub}", r"^eval\.tasks: task '\S+hub\.yaml' cannot be loaded on this machine \(.+\); nothing is downloaded, "
              r"so its data must be on disk \(a task YAML with dataset_path: json and data_files, or a data set "
              r"already in the Hugging Face cache\)$"),
])
def test_a_task_not_on_this_machine_is_one_line_and_nothing_is_downloaded(tmp_path, spec, message):
    hub = tmp_path / "hub.yaml"  # a data set on the Hub, not in the cache: refused offline, never fetched
    head, tail = TASK.read_text().split("dataset_kwargs:")[0], TASK.read_text().split("test_split: test\n")[1]
    hub.write_text(head.replace("dataset_path: json", "dataset_path: lmlab-tests/no-such-dataset") +
                   "test_split: test\n" + tail)
    with pytest.raises(ValueError, match=message) as e:
        TaskHarness.load([spec.format(hub=hub)])
    assert "\n" not in str(e.value) and "connection to" not in str(e.value)


def test_a_task_name_the_harness_does_not_know_is_one_line(monkeypatch):
    import lm_eval.tasks

    class WithoutItsOwnTasks(lm_eval.tasks.TaskManager):  # its ~15,000 task files take seconds to index
        def __init__(self, include_path=None, include_defaults=True, **kw):
            super().__init__(include_path=include_path, include_defaults=False, **kw)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", WithoutItsOwnTasks)
    with pytest.raises(ValueError, match=r"^eval\.tasks names 'no_such_task', which is neither a task file nor a task "
                                         r"lm-evaluation-harness ships; give the path of a task YAML$"):
        TaskHarness.load(["no_such_task"])


@pytest.mark.slow  # the harness indexes its own task files: about 10 s of CPU
def test_a_task_the_harness_ships_whose_data_is_not_cached_is_refused_offline():
    with pytest.raises(ValueError, match=r"^eval\.tasks: task 'arc_easy' cannot be loaded on this machine \(.*Offline"
                                         r".*\); nothing is downloaded, so its data must be on disk"):
        TaskHarness.load(["arc_easy"])


# ============================================================== during training
def tiny_run(tmp_path: Path, **changes) -> RunConfig:
    source = tmp_path / "corpus.txt"
    if not source.exists():
        corpus(source)
    base = RunConfig(model=lmlab.ModelConfig.from_preset("llama", **MODEL), data=DataConfig(source=str(source)))
    return base.override({**FAST_RUN, "train.steps": 4, "eval.every": 2, "checkpoint.every": 2,
                          "checkpoint.keep_last": 4, "eval.tasks": [str(TASK)], **changes})


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_run_logs_the_tasks_accuracy_at_each_evaluation_to_metrics_and_every_tracker(tmp_path):
    run = tmp_path / "run"
    cfg = tiny_run(tmp_path, **{"log.trackers": ["tensorboard"], "log.tensorboard": True})
    with Trainer(cfg, run, quiet=True) as trainer:
        result = trainer.fit()
    assert trainer.phases.seconds["tasks"] > 0
    evaluated = [r for r in records(run) if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [2, 4]
    for r in evaluated:  # each evaluation's scores are the model's at that step, as the checkpoint holds it
        loaded = load_run(run, checkpoint=r["step"])
        want = expected_scores(loaded.model, loaded.tokenizer)
        assert {k: v for k, v in r.items() if k.startswith("tasks/")} == pytest.approx(want)
    assert result.val_metrics == {"bits_per_byte": evaluated[-1]["val_bits_per_byte"]}  # the task's own, as before
    from test_trackers import tensorboard_events

    events = tensorboard_events(run / "tb")["scalars"]
    assert events["tasks/corpus_choice/acc"] == [(r["step"], pytest.approx(r["tasks/corpus_choice/acc"]))
                                                 for r in evaluated]
    assert "train/tasks/corpus_choice/acc" not in events and "val/tasks/corpus_choice/acc" not in events


def test_the_saved_config_names_the_task_file_by_its_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(TASK_DIR.parent)
    cfg = tiny_run(tmp_path, **{"eval.tasks": ["lm_eval_task/corpus_choice.yaml"], "train.steps": 2})
    with Trainer(cfg, tmp_path / "run", quiet=True) as trainer:
        trainer.fit()
    assert trainer.cfg.eval.tasks == (str(TASK.resolve()),)
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert str(TASK.resolve()) in saved  # so --resume finds it from any directory


def test_a_task_that_fails_during_the_run_is_a_note_and_the_run_goes_on(tmp_path, monkeypatch):
    def fails(self, reqs):
        raise RuntimeError("out of memory\nwhile scoring")

    monkeypatch.setattr(HarnessLM, "loglikelihood", fails)
    notes: list[str] = []
    monkeypatch.setattr(Progress, "print", lambda self, text: notes.append(text))
    with Trainer(tiny_run(tmp_path), tmp_path / "run", quiet=True) as trainer:
        result = trainer.fit()
    assert result.step == 4
    assert notes.count("note: eval.tasks failed at step 2 (RuntimeError: out of memory while scoring); the run goes on "
                       "without task scores") == 1
    assert not any(k.startswith("tasks/") for r in records(tmp_path / "run") for k in r)


def train_command(tmp_path: Path, *extra: str) -> list[str]:
    corpus(tmp_path / "corpus.txt")
    return ["train", "--run-dir", str(tmp_path / "run"), "--data.source", str(tmp_path / "corpus.txt"),
            "--train.steps", "2", "--quiet", "--train.device", "cpu", *extra]


def test_eval_tasks_without_lm_eval_installed_is_refused_naming_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(eval_harness, "IMPORT_FAILURE", "ModuleNotFoundError: No module named 'lm_eval'")
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed
    assert cli.main(train_command(tmp_path, "--eval.tasks", str(TASK))) == 2
    assert capsys.readouterr().err == ("lmlab train: error: eval.tasks needs lm-evaluation-harness, which is not "
                                       "installed; pip install 'lmlab[evals]' (or leave eval.tasks empty)\n")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("tasks, message", [
    ("nowhere/task.yaml", "eval.tasks names 'nowhere/task.yaml', which is not a file; give a task YAML file or the "
                          "name of a task lm-evaluation-harness ships"),
    ("{task},{task}", "eval.tasks names '{task}' twice; name each task once"),
])
def test_a_bad_task_list_is_refused_before_anything_is_written(tmp_path, capsys, tasks, message):
    assert cli.main(train_command(tmp_path, "--eval.tasks", tasks.format(task=TASK))) == 2
    assert capsys.readouterr().err == f"lmlab train: error: {message.format(task=TASK)}\n"
    assert not (tmp_path / "run").exists()


# ============================================================== lmlab eval --task
def test_lmlab_eval_scores_a_checkpoint_on_a_task_as_the_run_scored_it(tmp_path, capsys):
    """`lmlab eval RUN --task FILE` (and --task run, the run's own eval.tasks) gives the scores training logged
    for the same checkpoint, and what hand-computed log-likelihoods give, beside the loss."""
    run = tmp_path / "run"
    with Trainer(tiny_run(tmp_path, **{"eval.every": 4}), run, quiet=True) as trainer:
        trainer.fit()
    logged = {k: v for k, v in records(run)[-1].items() if k.startswith("tasks/")}
    loaded = load_run(run)
    want = expected_scores(loaded.model, loaded.tokenizer)
    assert logged == pytest.approx(want)
    for spec in (str(TASK), "run"):
        assert cli.main(["eval", str(run), "--task", spec, "--max-batches", "1", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["tasks"] == pytest.approx(want) and math.isfinite(report["loss"])
    assert cli.main(["eval", str(run), "--task", str(TASK), "--task-limit", "10", "--max-batches", "1"]) == 0
    text = capsys.readouterr().out
    limited = expected_scores(loaded.model, loaded.tokenizer, DOCS[:10])
    shown = dict(line.split() for line in text.split("tasks:\n", 1)[1].splitlines())
    assert {k: float(v) for k, v in shown.items()} == pytest.approx(limited, abs=5e-5)


@pytest.mark.parametrize("argv, message", [
    (["--task", "nowhere/task.yaml"], "--task names 'nowhere/task.yaml', which is not a file; give a task YAML "
                                      "file or the name of a task lm-evaluation-harness ships"),
    (["--task", "run"], "--task run: '{run}' has no eval.tasks; give a task YAML or a task's name"),
    (["--task", str(TASK), "--task-limit", "0"], "--task-limit 0 is not valid; give 1 or more documents per task"),
])
def test_lmlab_eval_refuses_a_bad_task_in_one_line_before_evaluating(tmp_path, capsys, argv, message):
    run = tmp_path / "run"
    with Trainer(tiny_run(tmp_path, **{"eval.tasks": [], "train.steps": 2}), run, quiet=True) as trainer:
        trainer.fit()
    capsys.readouterr()
    assert cli.main(["eval", str(run), *argv]) == 2
    assert capsys.readouterr().err == f"lmlab eval: error: {message.format(run=run)}\n"


# ============================================================== the same numbers as the harness's own hf model
def test_the_adapter_gives_what_lm_evals_hf_model_gives_on_the_exported_checkpoint(tmp_path):
    """The reference: lm-eval's HFLM on the same model exported to Hugging Face (`lmlab export`), so eval.tasks'
    scores equal `lm_eval --model hf` on the exported run: choices (a context cut to the window too), a
    document longer than the window (rolling windows) and greedy generation."""
    hf_model = pytest.importorskip("lm_eval.models.huggingface", reason="lm-eval's hf model needs transformers")
    model, tok = tiny_model(), ByteTokenizer()
    exported = lmlab.to_hf(model, tmp_path / "exported", tok).path
    reference = hf_model.HFLM(pretrained=str(exported), device="cpu", batch_size=1, dtype="float32")
    ours = HarnessLM(model, tok, batch_size=4)
    pairs = requests("loglikelihood", ("The cat", " sat on the mat"), ("trailing space ", "moves"),
                     ("", "no context at all"), ("a context longer than the window of sixty-four bytes, so it is cut "
                                                  "from the left", " ends"))
    assert [(pytest.approx(lp, abs=1e-4), g) for lp, g in reference.loglikelihood(pairs, disable_tqdm=True)] == \
        ours.loglikelihood(pairs)
    document = requests("loglikelihood_rolling", (" ".join(d["context"] for d in DOCS[:3]),))  # over 2 windows
    assert len(document[0].args[0]) > 2 * MODEL["max_seq_len"]
    assert ours.loglikelihood_rolling(document) == pytest.approx(
        reference.loglikelihood_rolling(document, disable_tqdm=True), abs=1e-3)
    generate = requests("generate_until", ("The ", {"until": ["e"], "max_gen_toks": 16, "do_sample": False}))
    assert ours.generate_until(generate) == reference.generate_until(generate, disable_tqdm=True)
