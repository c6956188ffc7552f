"""The training loop: one run, from its config to checkpoints, metrics and a sample.

    cfg = load_config("run.yaml", {"optim.lr": 3e-4})
    with Trainer(cfg, "runs/mine") as trainer:
        result = trainer.fit()

One step, seen from one of W processes (W = 1 without ``torchrun``)::

    lr(step) ─▶ for each of my grad_accum / W micro-batches:        x, y drawn with seed (seed, step, j)
                    loss_j = model(x, y).loss / (grad_accum / W);  backward   (DDP syncs grads on the last)
                clip grad norm ─▶ loss or norm non-finite? ─ yes ─▶ skip: no update, count it
                                                           └ no ──▶ AdamW step; MoE router biases

Every random draw of step s is seeded from (seed, s, j), where j numbers the step's micro-batches
over all processes. So no RNG state needs saving: resuming from a checkpoint repeats the
uninterrupted run exactly, and the same config on 1 or W processes sees the same global batch
(``batch_size * grad_accum`` sequences) and the same dropout masks.

The trainer is a few small pieces: setup (data, model, optimizer), the step, evaluation,
checkpointing, logging and stopping on a signal. The run directory's layout and checks are in
checkpoint/directory.py, the records in metrics.py, saving and resuming in checkpoint/checkpointer.py.

Nothing lost, nothing half-done:

- setup locks the run directory (rank 0, for the life of the run), then checks everything
  (the directory, the data, the estimated memory against the device's, the checkpoint to resume)
  before its first write; a refused start leaves the directory as it was, and removes it if this
  run created it;
- each step's record is logged before the step's checkpoint is written, so a crash at any point
  loses no record that a checkpoint covers (resume drops and repeats the records after it);
- a checkpoint is written only from a step whose loss, gradient, weights, and the loss those
  weights give, are finite, so "the last good checkpoint" of a diverged run evaluates finitely.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from ..memory import check_fits, max_memory_bytes, training_memory
from .checkpoint.checkpointer import Checkpointer, TrainState, build_checkpointer, layout_of
from .checkpoint.directory import RunDir
from .checkpoint.lock import DirLock
from .config import RunConfig
from .data.binding import (
    DataPlan,
    RunData,
    check_same_data,
    check_tokenizer,
    identity,
    saved_provenance,
    with_data_vocab,
)
from .metrics import MetricsLog, exp_or_none, jsonable
from .optim import build_optimizer, learning_rate, muon_parameter_count, schedule_warning, set_learning_rate
from .parallel.compile import compile_blocks, eager
from .parallel.group import Dist, lost_peers, peak_flops, resolve_device
from .parallel.plan import Parallel, global_moe_stats, parallelize
from .phases import Phases, timed
from .progress import Progress, banner, mute_stdout_if_closed
from .provenance import provenance
from .tasks import TASKS, Loss, language_model_loss
from .trackers import check_trackers


class TrainingDiverged(RuntimeError):
    """Too many consecutive non-finite steps; the message names the step and the last good checkpoint."""


@dataclasses.dataclass
class TrainResult:
    step: int  # optimizer steps done
    loss: float | None  # last train loss
    val_loss: float | None  # last validation loss
    best_val_loss: float | None
    skipped_steps: int  # steps skipped for a non-finite loss or gradient
    tokens: int  # training tokens processed, all processes
    elapsed_s: float  # this session's training time
    checkpoint: Path | None  # the last checkpoint written
    stopped_by: int | None = None  # the signal that stopped training early, or None
    sample: str | None = None  # text generated at the end
    val_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # the task's, e.g. classify: accuracy
    phases: dict[str, float] = dataclasses.field(default_factory=dict)  # wall seconds per phase (Trainer.phases)


# ============================================================== one step
def forward_backward(
    model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], n: int, *,
    device: torch.device, autocast: Callable[[], Any] = contextlib.nullcontext,
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], Loss] = language_model_loss,
    no_sync: Callable[[], Any] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Accumulate gradients of the mean loss over ``n`` equal-size micro-batches; equal to one
    backward over their concatenation. Under DDP or FSDP, gradients are synchronized on the last
    one only: ``no_sync`` (default: the model's own, if any) is the context for the others.
    ``loss_fn(model, x, y)`` is the task's (language modeling by default). Returns the mean
    cross-entropy and the mean of each auxiliary loss (detached)."""
    ce = torch.zeros((), device=device)
    aux: dict[str, torch.Tensor] = {}
    no_sync = no_sync or getattr(model, "no_sync", contextlib.nullcontext)
    for i, (x, y) in enumerate(batches):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with no_sync() if i < n - 1 else contextlib.nullcontext():
            with autocast():
                loss, ce_loss, aux_losses = loss_fn(model, x, y)
            (loss / n).backward()
        ce += ce_loss.detach() / n
        for k, v in aux_losses.items():
            aux[k] = aux.get(k, 0.0) + v.detach() / n
    return ce, aux


def mixed_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (numpy's SeedSequence), so nearby steps get unrelated streams."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, dtype=np.uint64)[0] >> 1)


DATA_STREAM, DROPOUT_STREAM = 0, 1  # the seed streams of a step's random draws


def seed_dropout(seed: int, device: torch.device) -> None:
    """Seed the generator a step's dropout draws from: ``torch.manual_seed`` off the CPU; on the CPU
    the CPU generator alone, the same seeding without what ``torch.manual_seed`` adds (a queued seed
    for every CUDA device, with a stack trace: about 0.3 ms a step on a 2-core CPU)."""
    if device.type == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def check_diverged(step: int, bad_steps: int, max_bad_steps: int, last: Path | None) -> None:
    """Raise :class:`TrainingDiverged` after ``max_bad_steps`` consecutive non-finite steps, naming
    ``last``, the last good checkpoint."""
    if bad_steps >= max_bad_steps:
        raise TrainingDiverged(
            f"stopped at step {step}: {bad_steps} consecutive steps with a non-finite loss or gradient "
            f"(train.max_bad_steps={max_bad_steps}); last good checkpoint: {last or 'none (no checkpoint was written)'}"
        )


# ============================================================== setup checks, samples
def check_processes(cfg: RunConfig, world: int) -> None:
    """Refuse a gradient accumulation that ``world`` processes cannot share equally."""
    if cfg.train.grad_accum % world:
        raise ValueError(
            f"train.grad_accum={cfg.train.grad_accum} is not a multiple of the {world} processes; the "
            f"global batch is batch_size * grad_accum, so set train.grad_accum to a multiple of {world}"
        )


def check_training_memory(cfg: RunConfig, device: torch.device) -> None:
    """Refuse, before allocating, a run estimated to need more than the device has (or train.max_memory_gib),
    the samples of log.sample_tokens included: they are written at the end, long after a late refusal."""
    t = cfg.train
    bf16 = device.type == "cuda"
    sample = cfg.log.sample_tokens if TASKS[cfg.task].writes_text else 0
    if cfg.model.positions == "learned":  # sample_from stops at the end of the table
        sample = min(sample, cfg.model.max_seq_len)
    fix = "make the model, train.batch_size or the sequence length smaller"
    if sample:
        fix = "make the model, train.batch_size, the sequence length or log.sample_tokens smaller"
    if t.max_memory_gib is None:
        fix += " (or set train.max_memory_gib if the estimate is wrong for this machine)"
    muon = muon_parameter_count(cfg.model) if cfg.optim.name == "muon" else 0  # one momentum each, not two
    check_fits(
        lambda n: training_memory(cfg.model, batch_size=t.batch_size, seq_len=cfg.seq_len, parameters=n,
                                  bytes_per_activation=2 if bf16 else 4, sample_tokens=sample, muon_parameters=muon),
        cfg.model, device, what="training this model", limit_bytes=max_memory_bytes(t.max_memory_gib), fix=fix,
    )


def sample_from(model: nn.Module, tokenizer: Any, parallel: Parallel, prompt: str, n: int, seed: int) -> str:
    """``prompt`` and up to ``n`` tokens a training model writes after it (temperature 0.8), its mode kept."""
    from ..generate import context_limit, sample_text

    limit = context_limit(model)  # only a learned position table has an end
    if limit is not None:
        n = max(0, min(n, limit - len(tokenizer.encode(prompt))))
    was_training = model.training
    model.eval()
    try:
        # compiled blocks (train.compile) run eagerly while the KV cache grows
        with parallel.whole_root(), eager():
            pieces = sample_text(model, tokenizer, prompt, n, temperature=0.8, top_k=None, top_p=None,
                                 seed=seed, eos_id=tokenizer.eos_id)
            return prompt + "".join(pieces)  # pieces is a generator: consume it gathered
    finally:
        model.train(was_training)


# ============================================================== downstream tasks (eval.tasks)
def task_harness(cfg: RunConfig) -> tuple[RunConfig, Any]:
    """``cfg`` with eval.tasks' files as absolute paths (a resumed run finds them from any directory), and
    its tasks loaded (run/eval_harness.py: offline, before the run writes anything); None without any."""
    if not cfg.eval.tasks:
        return cfg, None
    from .eval_harness import TaskHarness, is_task_file

    tasks = [str(Path(t).resolve()) if is_task_file(t) and Path(t).is_file() else t for t in cfg.eval.tasks]
    return cfg.override({"eval.tasks": tasks}), TaskHarness.load(tasks, cfg.eval.task_limit)


def downstream_scores(t: "Trainer") -> dict[str, float]:
    """eval.tasks' scores of the live model, {"tasks/<task>/<metric>": value} (run/eval_harness.py); {} without."""
    if t.harness is None:
        return {}
    from .eval_harness import HarnessLM

    with t.phases("tasks"):
        lm = HarnessLM(t.model, t.tokenizer, batch_size=t.cfg.train.batch_size, autocast=t.autocast,
                       generation=t.parallel.whole_root)
        return t.harness.scores(lm, step=t.step, say=t.progress.print)


# ============================================================== stopping on a signal
class StopRequest:
    """Ctrl-C or SIGTERM asks the run to finish its step, save a checkpoint and return. Under DDP
    only the all-reduced flag counts, so that every rank leaves the loop after the same step."""

    def __init__(self, world: int):
        self.world = world
        self.signal: int | None = None  # the signal that asked this process to stop
        self.agreed = False  # some rank asked, as of the last all-reduce
        self.notice: str | None = None  # what to tell the user, printed by the loop (a handler does no I/O)

    @property
    def stopping(self) -> bool:
        return self.agreed if self.world > 1 else self.signal is not None

    def agree(self, any_rank_asked: bool) -> None:
        if any_rank_asked:
            self.agreed = True
            self.signal = self.signal or signal.SIGTERM  # another rank got the signal

    @contextlib.contextmanager
    def handlers(self) -> Iterator[None]:
        """SIGINT/SIGTERM handlers for the duration (main thread only); a second Ctrl-C stops at once.
        The handler only sets the flag and leaves a notice for :meth:`take_notice`: a print there could
        raise (a closed pipe under ``| tee``) before the flag was set, and no checkpoint would be saved."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self.signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.signal = signum
            self.notice = f"\n{signal.Signals(signum).name}: stopping after this step and saving a checkpoint"

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, h in previous.items():
                signal.signal(sig, h)

    def take_notice(self) -> str | None:
        """The stop notice a handler left, once."""
        notice, self.notice = self.notice, None
        return notice


# ============================================================== the trainer
class Trainer:
    """Train ``cfg`` in ``run_dir``. ``resume`` continues its latest checkpoint; ``overwrite``
    replaces an earlier run there. ``callbacks`` are called as ``cb(trainer, record)`` after each
    step with that step's metrics. ``data``: ``cfg``'s DataPlan, where resolved already (``lmlab train``)."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path = "runs/default", *, resume: bool = False,
                 overwrite: bool = False, callbacks: Sequence[Callable[["Trainer", dict], None]] = (),
                 quiet: bool = False, command: Sequence[str] | None = None, data: DataPlan | None = None):
        if resume and overwrite:
            raise ValueError("resume and overwrite exclude each other; choose one")
        self.run = RunDir(run_dir)
        self.run_dir = self.run.path
        self.callbacks, self.quiet, self.phases = list(callbacks), quiet, Phases()  # phases: wall seconds per phase
        self.device = resolve_device(cfg.train.device, int(os.environ.get("LOCAL_RANK", "0")))
        self.dist = Dist.from_env(self.device, cfg.parallel.collective_timeout, cfg.parallel.setup_timeout)
        self.progress = Progress(show=self.dist.main and not quiet)
        self.log: MetricsLog | None = None
        self.data: RunData | None = None
        self.checkpointer: Checkpointer | None = None
        self.lock: DirLock | None = None  # rank 0's hold on the run directory
        try:
            with self.dist.collectives(), self.phases("setup"):
                self._setup(cfg, resume, overwrite, command, data)
        except BaseException as e:
            self._abandon(peers_lost=lost_peers(e))
            raise

    # ---- setup
    def _setup(self, cfg: RunConfig, resume: bool, overwrite: bool, command: Sequence[str] | None,
               data: DataPlan | None) -> None:
        check_processes(cfg, self.dist.world)
        check_trackers(*cfg.log.tracker_names(), probe=self.dist.main)  # one that cannot work: refused before any write
        data = DataPlan.for_run(cfg, self.run_dir, resume=resume, given=data)
        cfg, self.harness = task_harness(data.config)  # absolute paths; with --data DIR, how DIR was prepared

        def claim() -> None:  # rank 0 locks the run directory for the life of the run, then checks what it holds
            self.lock = self.run.lock()
            self.run.check(cfg, resume=resume, overwrite=overwrite)

        self.dist.on_main(claim)  # before any rank reads it
        check_training_memory(cfg, self.device)  # before the data is prepared: a refused size leaves nothing behind
        self.task = TASKS[cfg.task]()
        self.cfg = self._setup_data(cfg, data, overwrite)
        if self.cfg.model.vocab_size != cfg.model.vocab_size:
            check_training_memory(self.cfg, self.device)
        self._setup_model()
        if resume:
            check_same_data(self.data, saved_provenance(self.run.config))
        state = self.checkpointer.load_latest() if resume else TrainState()
        self.step, self.skipped_steps, self.tokens = state.step, state.skipped_steps, state.tokens
        self.best_val, self.best_step = state.best_val, state.best_step
        self.bad_steps, self.stop = 0, StopRequest(self.dist.world)
        if self.step == 0 and self.cfg.train.init_from is not None:
            from .init_from import init_source

            init_source(self.cfg.train.init_from).load_into(self.model)
        if (warning := schedule_warning(self.cfg.optim, self.cfg.train.steps)) is not None:
            self.progress.print(warning)
        if self.dist.main:
            self._start_records(overwrite, command)
        self.dist.barrier()

    def _start_records(self, overwrite: bool, command: Sequence[str] | None) -> None:
        """Rank 0's first writes, after every check has passed: replace an earlier run (``overwrite``),
        drop records after the resumed step, append this session's provenance, open the log."""
        if overwrite:
            self.run.clear()
        self.run.sweep_temporaries()
        dropped = self.run.trim_metrics(self.step)
        if dropped:
            self.progress.print(f"note: dropped {dropped} unreadable line(s) of {self.run.metrics}")
        self.run.write_config(self.cfg, provenance(command, step=self.step, device=str(self.device),
                                                   world_size=self.dist.world, data=identity(self.data)))
        self.log = MetricsLog.open(self.run, self.cfg, self.step, say=self.progress.print)

    def _abandon(self, peers_lost: bool = False) -> None:
        """A start that failed leaves nothing behind: close what was opened; remove the run directory
        if this run created it (rank 0, which holds the lock), or else data this run prepared."""
        if self.lock is not None and self.data is not None and self.data.prepared_now and not self.lock.created:
            shutil.rmtree(self.data.dir, ignore_errors=True)
        self._release(peers_lost, remove_created=True)

    def _setup_data(self, cfg: RunConfig, plan: DataPlan, overwrite: bool) -> RunConfig:
        """Prepare (or open) the run's data on rank 0, open its splits on every rank, and take the
        vocabulary from it (or, fine-tuning, check it against the starting model's)."""
        def prepare_on_main() -> tuple[str, bool]:
            self.data = plan.open(overwrite=overwrite, progress=not self.quiet)  # a failure from here on removes it
            return str(self.data.dir), self.data.prepared_now

        where, fresh = self.dist.on_main(prepare_on_main)
        self.data = self.data or RunData.open(Path(where), prepared_now=fresh)  # the other ranks read rank 0's
        self.tokenizer, self.data_dir, self.meta = self.data.tokenizer, self.data.dir, self.data.meta
        self.train_data, self.val_data = self.task.open(self.data_dir, "train"), self.task.open(self.data_dir, "val")
        if note := check_tokenizer(self.data, cfg.train.init_from, cfg.model.vocab_size):
            self.progress.print(note)
        return with_data_vocab(cfg, self.tokenizer.vocab_size)

    def _setup_model(self) -> None:
        p = self.cfg.parallel
        self.model = self.task.build_model(self.cfg.model, self.meta).to(self.device)
        self.transformer = self.task.body(self.model)  # the Transformer itself, for accounting and MoE biases
        self.transformer.warn_unbalanced &= self.dist.main and not self.progress.show  # else the first lines say it
        if self.model is not self.transformer and (p.strategy == "fsdp" or p.experts > 1):
            raise ValueError(f"task={self.cfg.task!r} trains with parallel.strategy=ddp and parallel.experts=1; "
                             "FSDP and expert parallelism shard language models only")
        # expert parallelism, activation checkpointing and FSDP change the model in place; DDP wraps it
        self.parallel = parallelize(self.transformer, p, self.dist, self.device)
        if self.cfg.train.compile:
            compile_blocks(self.transformer)  # in place: parameter names and checkpoints are unchanged
        self.train_model: nn.Module = self.parallel.wrap(self.model)
        self.optimizer = build_optimizer(self.model, self.cfg.optim, self.device)
        self.checkpointer = build_checkpointer(
            layout_of(self.parallel), self.run.checkpoints, self.model, self.optimizer, self.parallel, self.dist,
            keep_last=self.cfg.checkpoint.keep_last, save_mode=self.cfg.checkpoint.mode,
            model_config=self.cfg.model.to_dict(), say=self.progress.print)
        # under FSDP its MixedPrecisionPolicy computes in bf16 instead of autocast
        use_bf16 = self.device.type == "cuda" and torch.cuda.is_bf16_supported() and not self.parallel.fsdp
        self.autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if use_bf16 else contextlib.nullcontext
        self.flops_per_token = self.transformer.flops_per_token(self.cfg.seq_len)
        self.peak_flops = peak_flops(self.device)

    # ---- the loop
    def fit(self) -> TrainResult:
        with self.dist.collectives():
            return self._fit()

    def _fit(self) -> TrainResult:
        t = self.cfg.train
        local_accum = t.grad_accum // self.dist.world
        micro_ids = [self.dist.rank * local_accum + i for i in range(local_accum)]  # global micro-batch numbers
        tokens_per_step = t.batch_size * t.grad_accum * self.cfg.seq_len
        self.progress.print(banner(self.cfg, noun=self.task.noun, run_dir=self.run_dir, device=self.device,
                                   parameters=self.transformer.num_params()["total"], tokens_per_step=tokens_per_step,
                                   world=self.dist.world, data=self.data.describe()))
        start = time.perf_counter()
        loss = val_loss = None
        with self.progress.running(t.steps, self.step), self.stop.handlers():
            while self.step < t.steps and not self.stop.stopping:
                loss, grad_norm, aux = self._train_step(self.step, micro_ids, local_accum)
                self.step += 1
                self.tokens += tokens_per_step
                record = self._record(loss, grad_norm, aux, tokens_per_step)
                now, improved = None, False
                if self.bad_steps < t.max_bad_steps:
                    now, improved = self._evaluate_if_due(record)
                    val_loss = now if now is not None else val_loss
                self._log(record)  # before the checkpoint: a crash in between loses no record
                check_diverged(self.step, self.bad_steps, t.max_bad_steps, self.checkpointer.latest)
                self._save_if_due(improved, now)
            if self.stop.stopping:
                mute_stdout_if_closed()  # `| tee` died with the same Ctrl-C: nothing printed may stop the save
                if (notice := self.stop.take_notice()) is not None:
                    self.progress.print(notice)
                if self._takes_part:
                    self._save()
        self.checkpointer.finish()  # an async checkpoint still being written (DCP): waited for here
        sample = None
        if not self.stop.stopping:
            if val_loss is None:  # resumed a finished run: report where it stands
                val_loss, _ = self._evaluate()
            writes = self._takes_part and self.cfg.log.sample_tokens and self.task.writes_text
            sample = self.sample(record=True) if writes else None
        return TrainResult(
            step=self.step, loss=loss, val_loss=val_loss, best_val_loss=self.best_val, skipped_steps=self.skipped_steps,
            tokens=self.tokens, elapsed_s=time.perf_counter() - start, checkpoint=self.checkpointer.latest,
            stopped_by=self.stop.signal if self.stop.stopping else None, sample=sample,
            val_metrics=dict(last.metrics) if (last := getattr(self, "last_eval", None)) is not None else {},
            phases=dict(self.phases.seconds),
        )

    @timed("step")
    def _train_step(self, step: int, micro_ids: list[int], n: int) -> tuple[float, float, dict[str, float]]:
        t = self.cfg.train
        set_learning_rate(self.optimizer, learning_rate(step, self.cfg.optim, t.steps))

        def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            for j in micro_ids:
                seed_dropout(mixed_seed(t.seed, DROPOUT_STREAM, step, j), self.device)
                g = torch.Generator().manual_seed(mixed_seed(t.seed, DATA_STREAM, step, j))
                yield self.train_data.batch(t.batch_size, self.cfg.seq_len, g, t.repeats, lookup=t.lookup)

        if not self.train_model.training:  # evaluation and samples restore the mode they found; a callback may not
            self.train_model.train()
        with self.transformer.summing_moe_stats():  # the step's load statistics: every micro-batch
            ce, aux = forward_backward(self.train_model, batches(), n, device=self.device, autocast=self.autocast,
                                       loss_fn=self.task.loss, no_sync=self.parallel.no_sync(self.train_model))
        self.parallel.sync_gradients()
        # one all-reduce carries the loss and any rank's stop request; gradients are already synchronized
        shared = torch.tensor([float(ce), float(self.stop.signal or 0)], dtype=torch.float64, device=self.device)
        loss, asked = self.dist.all_reduce_sum(shared).tolist()
        loss /= self.dist.world
        self.stop.agree(bool(asked))
        grad_norm = self.parallel.clip_gradients(self.model, self.cfg.optim.grad_clip)
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.optimizer.step()
            # balance on the load summed over processes, so every rank's biases agree
            self.transformer.update_router_biases(self.dist.all_reduce_sum if self.dist.world > 1 else None)
            self.bad_steps = 0
        else:
            self.bad_steps += 1
            self.skipped_steps += 1
            what = "loss" if not math.isfinite(loss) else "gradient"
            self.progress.print(f"step {step + 1}: non-finite {what}; step skipped")
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm, {k: float(v) for k, v in aux.items()}

    def _evaluate_if_due(self, record: dict[str, Any]) -> tuple[float | None, bool]:
        """When due, val_loss, the task's metrics and eval.tasks' scores into ``record``; (val loss, improved)."""
        if not (self.step % self.cfg.eval.every == 0 or self.step == self.cfg.train.steps):
            return None, False
        val_loss, improved = self._evaluate()
        if val_loss is not None:
            scores = {**{f"val_{k}": v for k, v in self.last_eval.metrics.items()}, **downstream_scores(self)}
            record.update(val_loss=val_loss, val_perplexity=exp_or_none(val_loss), **scores)
            extra = "".join(f", {k.removeprefix('val_')} {v:.4f}" for k, v in scores.items())
            self.progress.print(f"step {self.step}: val loss {val_loss:.4f}{extra}" + (" (best)" if improved else ""))
        return val_loss, improved

    def _save_if_due(self, improved: bool, val_loss: float | None) -> None:
        """Checkpoint when due, improved or stopping; print a sample when due (where :attr:`_takes_part`)."""
        steps, every, log = self.cfg.train.steps, self.cfg.checkpoint.every, self.cfg.log
        if not self._takes_part:
            return
        if self.step % every == 0 or self.step == steps or improved or self.stop.stopping:
            self._save(best=improved, val_loss=val_loss)
        if log.sample_every and self.step % log.sample_every == 0 and self.step < steps and self.task.writes_text:
            self.progress.print(f"sample at step {self.step}: {self.sample(record=True)!r}")

    # ---- evaluation, checkpoints, samples
    @property
    def _takes_part(self) -> bool:
        """Does this process evaluate, sample and save? Rank 0, or all when sharded (a forward needs all)."""
        return self.dist.main or self.parallel.sharded

    @timed("eval")
    def _evaluate(self) -> tuple[float | None, bool]:
        """(validation loss, whether it is the best so far) where :attr:`_takes_part`; (None, False) elsewhere.
        Sharded, every process evaluates the same batches and takes rank 0's value, so all decide alike."""
        if not self._takes_part:
            return None, False
        self.last_eval = self.task.evaluate(self.model, self.val_data, batch_size=self.cfg.train.batch_size,
                                            seq_len=self.cfg.seq_len, max_batches=self.cfg.eval.batches,
                                            autocast=self.autocast, spread=self.cfg.eval.windows == "spread")
        loss = self.last_eval.loss
        if self.parallel.sharded:
            mine = torch.tensor([loss if self.dist.main else 0.0], dtype=torch.float64, device=self.device)
            loss = float(self.dist.all_reduce_sum(mine)[0])
        improved = math.isfinite(loss) and (self.best_val is None or loss < self.best_val)
        if improved:
            self.best_val, self.best_step = loss, self.step
        return loss, improved

    @timed("save")
    def _save(self, best: bool = False, val_loss: float | None = None) -> Path | None:
        """Checkpoint the current step through the checkpointer (rank 0; every rank when sharded) if
        it is a good one (see :meth:`_unsaveable`): a bad checkpoint never joins the good ones.
        ``best``: it is the best so far. The records logged so far are made durable first."""
        why_not = self._unsaveable(val_loss)
        if why_not:
            self.progress.print(f"step {self.step}: checkpoint not written: {why_not}")
            return None
        if self.log is not None:
            self.log.sync()
        return self.checkpointer.save(TrainState(step=self.step, skipped_steps=self.skipped_steps, tokens=self.tokens,
                                                 best_val=self.best_val, best_step=self.best_step), best=best)

    @timed("finite checks")
    def _unsaveable(self, val_loss: float | None) -> str | None:
        """Why this step must not be checkpointed, or None: its own loss or gradient was not finite,
        a weight is not finite, or the weights give a non-finite loss (``val_loss`` when this step
        was evaluated, else one validation batch). A huge but finite update passes the first two
        and fails the third: the checkpoint named after a divergence must evaluate finitely."""
        if self.bad_steps:
            return "this step's loss or gradient was not finite"
        if not self.parallel.all_finite(self.model.parameters(), self.dist):
            return "weights are not finite"
        if val_loss is None:  # every process that saves evaluates the same batch with the same weights
            t = self.cfg.train
            val_loss = self.task.evaluate(self.model, self.val_data, batch_size=t.batch_size, seq_len=self.cfg.seq_len,
                                          max_batches=1, autocast=self.autocast).loss
        if not math.isfinite(val_loss):
            return f"the weights give a validation loss of {val_loss}"
        return None

    @timed("sample")
    def sample(self, prompt: str | None = None, max_new_tokens: int | None = None, *, record: bool = False) -> str:
        """Text after ``prompt`` (default: log.sample_prompt), seeded by train.seed; ``record``: logged (rank 0)."""
        log = self.cfg.log
        text = sample_from(self.model, self.tokenizer, self.parallel, log.sample_prompt if prompt is None else prompt,
                           max_new_tokens or log.sample_tokens, self.cfg.train.seed)
        if record and self.log is not None:
            self.log.text(self.step, "sample", text)
        return text

    # ---- logging
    @timed("log")
    def _record(self, loss: float, grad_norm: float, aux: dict[str, float], tokens_per_step: int) -> dict[str, Any]:
        """This step's metrics: only {"step"} between log.every steps, else the full record."""
        last = self.cfg.train.steps
        record: dict[str, Any] = {"step": self.step}
        tps = self.progress.throughput(tokens_per_step, logged=self.step % self.cfg.log.every == 0 or self.step == last)
        if tps is not None:
            record.update(loss=loss, lr=learning_rate(self.step - 1, self.cfg.optim, last), grad_norm=grad_norm,
                          tokens=self.tokens, tokens_per_s=tps, skipped_steps=self.skipped_steps)
            if self.peak_flops:
                record["mfu"] = tps * self.flops_per_token / (self.peak_flops * self.dist.world)
            if aux:
                record["aux_losses"] = aux
            if self.transformer.moe_layers:
                stats = self.transformer.moe_stats()
                if self.dist.world > 1:  # every process's tokens, not rank 0's alone
                    stats = global_moe_stats(stats, self.dist.all_reduce_sum, self.device)
                record["moe"] = jsonable(stats)
        self.progress.advance(record)
        return record

    @timed("log")
    def _log(self, record: dict[str, Any]) -> None:
        for cb in self.callbacks:
            cb(self, record)
        if self.log is not None and len(record) > 1:
            self.log.write(record)

    # ---- signals and teardown
    def request_stop(self, signum: int = signal.SIGINT) -> None:
        """Finish the current step, save a checkpoint and return from ``fit`` (what Ctrl-C does)."""
        self.stop.signal = signum

    def close(self, peers_lost: bool = False) -> None:
        """Finish the checkpoints, close the metrics, leave the group; ``peers_lost``: see :meth:`Dist.close`."""
        if self.checkpointer is not None and not peers_lost:
            self.checkpointer.finish()
        self._release(peers_lost)

    def _release(self, peers_lost: bool, remove_created: bool = False) -> None:
        """Close the metrics, unlock the run directory (``remove_created``: delete it if this run made it), leave."""
        if self.log is not None:
            self.log.close()
            self.log = None
        if self.lock is not None:
            self.lock.release(remove_created=remove_created, with_contents=remove_created)
            self.lock = None
        self.dist.close(peers_lost=peers_lost)

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.close(peers_lost=lost_peers(exc))
