"""Downstream evaluations while training (``eval.tasks``): lm-evaluation-harness tasks, run on the live
model at each evaluation through the harness's Python API, logged as ``tasks/<task>/<metric>``.

    harness = TaskHarness.load(["tasks/corpus_choice.yaml"], limit=None)   # before the first step
    scores = harness.run(HarnessLM(model, tokenizer, batch_size=8))         # {"tasks/corpus_choice/acc": 0.35, ...}

How this differs from lmlab's own evaluation (evaluate.py, tasks.py): those measure the objective the run
trains on, on its own held-out split (validation loss, perplexity, bits per byte; a classifier's accuracy
on its labelled rows). These measure tasks the model was not trained on, scored as the harness scores
any model (the log-likelihood of each choice, of a whole document, or generated text), so a score here
equals ``lm_eval --model hf`` on the exported checkpoint with the same task file.

Nothing is downloaded. A task is a YAML file (``dataset_path: json`` with ``data_files`` on disk; a
relative data file is looked for beside the task file, then in the current directory, where the
``lm_eval`` command line looks) or the name of a task the harness ships whose data set is already in
the Hugging Face cache: the tasks are loaded with the Hub offline, once, before the first step, so a
task that is not on this machine is a one-line error before anything is written.

:class:`HarnessLM` is the harness's model interface (``lm_eval.api.model.LM``) over an lmlab model:

=======================  ================================================================================
request                  what it computes
=======================  ================================================================================
loglikelihood            log p(continuation | context), summed over the continuation's tokens, and
                         whether greedy decoding would write it; padded batches (:meth:`score`), or one
                         at a time (``batch_size=1``, the reference, tested equal)
loglikelihood_rolling    log p(document), in windows of the model's max_seq_len (the harness's own
                         disjoint rolling windows), the first token conditioned on the end-of-document id
generate_until           greedy text after the context, cut at the first of ``until``
                         (:func:`lmlab.generate.sample_text`)
=======================  ================================================================================

Standard errors are not computed (``bootstrap_iters=0``): the harness's bootstrap starts a process pool.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .errors import EnvironmentFailure, one_line

try:  # an optional extra: without it this module still imports, and check_installed refuses eval.tasks
    from lm_eval.api.model import LM

    IMPORT_FAILURE: str | None = None
except ImportError as e:  # pragma: no cover - where lm-eval is not installed
    LM, IMPORT_FAILURE = object, f"{type(e).__name__}: {one_line(e)[:200]}"

EXTRA = "evals"  # pip install 'lmlab[evals]' installs lm-eval
PREFIX = "tasks/"  # metrics.jsonl keys: tasks/<task>/<metric> (trackers.TASKS_PREFIX)
LOCAL_LOADERS = ("json", "csv", "text", "parquet", "arrow")  # datasets' builders that read data_files from disk


def check_installed() -> None:
    """Refuse eval.tasks where lm-eval is not installed (ValueError, naming the extra) or does not import
    (EnvironmentFailure)."""
    if IMPORT_FAILURE is None and LM is not object:
        return
    if importlib.util.find_spec("lm_eval") is None:
        raise ValueError(f"eval.tasks needs lm-evaluation-harness, which is not installed; pip install "
                         f"'lmlab[{EXTRA}]' (or leave eval.tasks empty)")
    raise EnvironmentFailure(f"lm-eval is installed but cannot be imported ({IMPORT_FAILURE}); reinstall it: "
                             f"pip install --force-reinstall 'lmlab[{EXTRA}]'")


# ============================================================== the tasks, found on this machine
def is_task_file(spec: str) -> bool:
    """A path to a task YAML (ends in .yaml / .yml, or names a folder), not a task's name."""
    return spec.endswith((".yaml", ".yml")) or "/" in spec or os.sep in spec


def local_data_files(config: dict[str, Any], task_file: Path) -> dict[str, Any]:
    """``config`` with each relative ``dataset_kwargs.data_files`` path made absolute: beside ``task_file``
    if it is there, else in the current directory (as the lm_eval command line reads it); one missing in
    both is refused, naming it. Only for datasets' local loaders (json, csv, text, ...)."""
    kwargs = config.get("dataset_kwargs") or {}
    if config.get("dataset_path") not in LOCAL_LOADERS or "data_files" not in kwargs:
        return config

    def found(name: str) -> str:
        for where in (task_file.parent / name, Path(name)):
            if where.is_file():
                return str(where.resolve())
        raise ValueError(f"{str(task_file)!r}: its data file {name!r} is neither beside it nor in the current "
                         f"directory; fix data_files (a path relative to the task file)")

    files = kwargs["data_files"]
    if isinstance(files, str):
        files = found(files)
    elif isinstance(files, list):
        files = [found(f) for f in files]
    else:
        files = {split: found(f) if isinstance(f, str) else [found(x) for x in f] for split, f in files.items()}
    return {**config, "dataset_kwargs": {**kwargs, "data_files": files}}


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """The Hugging Face Hub offline for the duration, for the datasets and huggingface_hub already imported
    (both read the setting when imported) and for those that read the environment later; datasets' progress
    bars off (they would print through the run's progress)."""
    import datasets
    import huggingface_hub.constants as hub

    saved_env = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    saved = (hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.utils.logging.is_progress_bar_enabled())
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    hub.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    datasets.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved[0], saved[1]
        if saved[2]:
            datasets.utils.logging.enable_progress_bar()
        for key, value in saved_env.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


class TaskHarness:
    """The tasks of eval.tasks, loaded once (their documents read), run on a model at each evaluation."""

    def __init__(self, loaded: dict[str, Any], limit: int | None):
        self.loaded, self.limit = loaded, limit
        self.failed: str | None = None  # why the tasks stopped, during a run (see :meth:`scores`)

    @property
    def names(self) -> list[str]:
        return list(self.loaded["tasks"])

    @classmethod
    def load(cls, specs: Sequence[str], limit: int | None = None) -> "TaskHarness":
        """Find and load each task (a YAML path or a name the harness knows) with the Hub offline: a task
        not found, or whose data set is not on this machine, is a one-line ValueError."""
        check_installed()
        from lm_eval.tasks import TaskManager
        from lm_eval.tasks._yaml_loader import load_yaml

        files = [Path(s) for s in specs if is_task_file(s)]
        for f in files:
            if not f.is_file():
                raise ValueError(f"eval.tasks names {str(f)!r}, which is not a file; give a task YAML file or "
                                 f"the name of a task lm-evaluation-harness ships")
        named = [s for s in specs if not is_task_file(s)]
        # the harness indexes its own ~15,000 task files (about 6 s of CPU) only when a task is named
        manager = TaskManager(include_path=sorted({str(f.parent.resolve()) for f in files}) or None,
                              include_defaults=bool(named))
        loaded: dict[str, Any] = {"tasks": {}, "groups": {}, "group_map": {}}
        with hub_offline():
            for spec in specs:
                try:
                    task = (local_data_files(load_yaml(spec, resolve_func=True, recursive=True), Path(spec))
                            if is_task_file(spec) else spec)
                    one = manager.load([task])
                except KeyError:
                    raise ValueError(f"eval.tasks names {spec!r}, which is neither a task file nor a task "
                                     f"lm-evaluation-harness ships; give the path of a task YAML") from None
                except ValueError:
                    raise
                except Exception as e:  # noqa: BLE001 - datasets and the harness raise many kinds
                    raise ValueError(f"eval.tasks: task {spec!r} cannot be loaded on this machine "
                                     f"({type(e).__name__}: {one_line(e)[:240]}); nothing is downloaded, so its "
                                     f"data must be on disk (a task YAML with dataset_path: json and data_files, "
                                     f"or a data set already in the Hugging Face cache)") from None
                for key in loaded:
                    loaded[key].update(one[key])
        for task in loaded["tasks"].values():
            if task.get_config("num_fewshot") is None:  # as lm_eval.simple_evaluate does
                task.set_config(key="num_fewshot", value=0)
            task.set_fewshot_seed(seed=1234)  # the harness's default fewshot seed: the same examples each time
        return cls(loaded, limit)

    def scores(self, lm: "HarnessLM", *, step: int, say: Callable[[str], None] = print) -> dict[str, float]:
        """:meth:`run`, during training: a failure is a note, and the tasks stop for the rest of the run
        (the run itself goes on, its metrics without task scores from then on)."""
        if self.failed is not None:
            return {}
        try:
            return self.run(lm)
        except Exception as e:  # noqa: BLE001 - the harness and its metrics may raise anything; the run goes on
            self.failed = f"{type(e).__name__}: {one_line(e)[:200]}"
            say(f"note: eval.tasks failed at step {step} ({self.failed}); the run goes on without task scores")
            return {}

    def run(self, lm: "HarnessLM") -> dict[str, float]:
        """Every task on ``lm``: {"tasks/<task>/<metric>": value}, a filter other than "none" kept after a
        comma as the harness writes it ("tasks/gsm8k/exact_match,strict-match")."""
        from lm_eval.evaluator import evaluate

        with no_request_bar():
            results = evaluate(lm=lm, task_dict=self.loaded, limit=self.limit, bootstrap_iters=0, log_samples=False)
        return task_scores(results["results"])


@contextlib.contextmanager
def no_request_bar() -> Iterator[None]:
    """The harness's progress bar over each task's documents (lm_eval.api.task's tqdm, which has no switch)
    off for the duration: it would print through the run's own progress at every evaluation."""
    import functools

    import lm_eval.api.task as task_module

    bar = task_module.tqdm
    task_module.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        task_module.tqdm = bar


def task_scores(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The harness's results ({"arc": {"alias": "arc", "acc,none": 0.3, "acc_stderr,none": "N/A",
    "sample_len": 40}}) as metrics.jsonl keys ({"tasks/arc/acc": 0.3}): its metrics ("metric,filter") only,
    numbers only (a standard error not computed is "N/A")."""
    out = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            metric, comma, filt = key.partition(",")
            if comma and isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"{PREFIX}{task}/{metric if filt == 'none' else key}"] = float(value)
    return out


# ============================================================== the model, as the harness sees it
class HarnessLM(LM):
    """lm-evaluation-harness's model interface over an lmlab model and tokenizer (see the module's table).
    ``max_length``: the longest window read (default the model's max_seq_len, what an exported checkpoint
    declares); ``generation``: a context for generating (FSDP gathers the root's parameters in it)."""

    def __init__(self, model: nn.Module, tokenizer: Any, *, batch_size: int = 8, max_length: int | None = None,
                 autocast: Callable[[], Any] = contextlib.nullcontext,
                 generation: Callable[[], Any] = contextlib.nullcontext):
        super().__init__()
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.max_length = max_length or model.config.max_seq_len
        self.autocast, self.generation = autocast, generation
        self._device = next(model.parameters()).device
        self.prefix = self.prefix_ids()

    def prefix_ids(self) -> list[int]:
        """What an empty context conditions on: the end-of-document id (a training window reads one before
        each document), else the tokenizer's bos id, else a newline (as lmlab.generate starts an empty prompt)."""
        for i in (self.tokenizer.eod_id, getattr(self.tokenizer, "bos_id", None)):
            if i is not None:
                return [i]
        return list(self.tokenizer.encode("\n"))

    # ---- the three requests
    def loglikelihood(self, requests: Sequence[Any]) -> list[tuple[float, bool]]:
        return self.score([self.encode_pair(*r.args) for r in requests])

    def loglikelihood_rolling(self, requests: Sequence[Any]) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for r in requests:
            ids = list(self.tokenizer.encode(r.args[0]))
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                ids, prefix_token=self.prefix[-1], max_seq_len=self.max_length, context_len=1)]
            out.append(sum(logprob for logprob, _ in self.score(windows)))
        return out

    def generate_until(self, requests: Sequence[Any]) -> list[str]:
        from ..generate import sample_text
        from .parallel.compile import eager

        out = []
        for r in requests:
            context, kwargs = r.args
            until = kwargs.get("until") or []
            n = int(kwargs.get("max_gen_toks", 256))
            with self.generation(), eager():
                pieces = sample_text(self.model, self.tokenizer, context, n, stop=[until] if isinstance(until, str)
                                     else list(until), temperature=0.0)  # greedy, as the harness's defaults
                out.append("".join(pieces))
        return out

    # ---- scoring
    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) as the harness splits them (TemplateLM._encode_pair): trailing spaces
        of the context move to the continuation, the pair is encoded whole and the context's length cut off
        (a BPE merge across the boundary stays with the continuation); an empty context is :attr:`prefix`."""
        if not context:
            return list(self.prefix), list(self.tokenizer.encode(continuation))
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole, ctx = self.tokenizer.encode(context + continuation), self.tokenizer.encode(context)
        return list(ctx), list(whole[len(ctx):])

    def window(self, context: list[int], continuation: list[int]) -> list[int]:
        """The tokens read to score ``continuation``: context + continuation but its last token, the oldest
        context cut to fit max_length. A continuation longer than that is refused."""
        if len(continuation) > self.max_length:
            raise ValueError(f"a continuation of {len(continuation)} tokens is longer than the model's window of "
                             f"{self.max_length}; the harness's rolling requests split long text, choices do not")
        return (context + continuation)[-(self.max_length + 1):][:-1]

    @torch.no_grad()
    def score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p of each continuation token, whether each is the model's argmax) per (context,
        continuation) pair. Windows are read ``batch_size`` at a time, longest first, padded on the right
        (a causal model's earlier positions never see the padding); ``batch_size=1`` reads each alone."""
        was_training = self.model.training
        self.model.eval()
        out: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
        order = sorted(range(len(pairs)), key=lambda i: -len(self.window(*pairs[i])))
        try:
            for start in range(0, len(order), self.batch_size):
                rows = order[start:start + self.batch_size]
                windows = [self.window(*pairs[i]) for i in rows]
                T = max(len(w) for w in windows)
                x = torch.zeros(len(rows), T, dtype=torch.long)  # (B, T), right-padded with id 0
                for b, w in enumerate(windows):
                    x[b, :len(w)] = torch.tensor(w)
                with self.autocast():
                    logits = self.model(x.to(self._device)).logits  # (B, T, V)
                logp = F.log_softmax(logits.float(), dim=-1)
                for b, i in enumerate(rows):
                    cont = torch.tensor(pairs[i][1], device=logp.device)  # (n,)
                    end = len(windows[b])
                    lp = logp[b, end - len(cont):end]  # (n, V): the predictions of the continuation's tokens
                    out[i] = (float(lp.gather(-1, cont[:, None]).sum()), bool((lp.argmax(-1) == cont).all()))
        finally:
            self.model.train(was_training)
        return out
