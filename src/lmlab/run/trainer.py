"""The training loop: one run, from its config to checkpoints, metrics and a sample.

    cfg = load_config("run.yaml", {"train.lr": 3e-4})
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
directory.py, the records in metrics.py, the files in checkpoint.py.
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

from ..model import Transformer
from . import checkpoint as ckpt
from .compile import compile_blocks, eager
from .config import RunConfig
from .data import TokenData, prepare
from .directory import RunDir
from .distributed import Dist, peak_flops, resolve_device
from .evaluate import evaluate
from .metrics import MetricsLog, exp_or_none, jsonable
from .optim import build_optimizer, clip_gradients, learning_rate
from .provenance import provenance
from .tokenizer import load_tokenizer


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


# ============================================================== one step
def forward_backward(
    model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], n: int, *,
    device: torch.device, autocast: Callable[[], Any] = contextlib.nullcontext,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Accumulate gradients of the mean loss over ``n`` equal-size micro-batches; equal to one
    backward over their concatenation. Under DDP, gradients are synchronized on the last one only.
    Returns the mean cross-entropy and the mean of each auxiliary loss (detached)."""
    ce = torch.zeros((), device=device)
    aux: dict[str, torch.Tensor] = {}
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)
    for i, (x, y) in enumerate(batches):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with no_sync() if i < n - 1 else contextlib.nullcontext():
            with autocast():
                out = model(x, y)
            (out.loss / n).backward()
        ce += out.ce_loss.detach() / n
        for k, v in out.aux_losses.items():
            aux[k] = aux.get(k, 0.0) + v.detach() / n
    return ce, aux


def mixed_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (numpy's SeedSequence), so nearby steps get unrelated streams."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, dtype=np.uint64)[0] >> 1)


DATA_STREAM, DROPOUT_STREAM = 0, 1  # the seed streams of a step's random draws


# ============================================================== stopping on a signal
class StopRequest:
    """Ctrl-C or SIGTERM asks the run to finish its step, save a checkpoint and return. Under DDP
    only the all-reduced flag counts, so that every rank leaves the loop after the same step."""

    def __init__(self, world: int):
        self.world = world
        self.signal: int | None = None  # the signal that asked this process to stop
        self.agreed = False  # some rank asked, as of the last all-reduce

    @property
    def stopping(self) -> bool:
        return self.agreed if self.world > 1 else self.signal is not None

    def agree(self, any_rank_asked: bool) -> None:
        if any_rank_asked:
            self.agreed = True
            self.signal = self.signal or signal.SIGTERM  # another rank got the signal

    @contextlib.contextmanager
    def handlers(self, say: Callable[[str], None]) -> Iterator[None]:
        """SIGINT/SIGTERM handlers for the duration (main thread only); a second Ctrl-C stops at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            if self.signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            say(f"\n{signal.Signals(signum).name}: stopping after this step and saving a checkpoint")
            self.signal = signum

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, h in previous.items():
                signal.signal(sig, h)


# ============================================================== the trainer
class Trainer:
    """Train ``cfg`` in ``run_dir``. ``resume`` continues its latest checkpoint; ``overwrite``
    replaces an earlier run there. ``callbacks`` are called as ``cb(trainer, record)`` after each
    step with that step's metrics."""

    def __init__(
        self, cfg: RunConfig, run_dir: str | Path = "runs/default", *, resume: bool = False, overwrite: bool = False,
        callbacks: Sequence[Callable[["Trainer", dict], None]] = (), quiet: bool = False,
        command: Sequence[str] | None = None,
    ):
        if resume and overwrite:
            raise ValueError("resume and overwrite exclude each other; choose one")
        self.run = RunDir(run_dir)
        self.run_dir = self.run.path
        self.callbacks, self.quiet = list(callbacks), quiet
        self.device = resolve_device(cfg.train.device, int(os.environ.get("LOCAL_RANK", "0")))
        self.dist = Dist.from_env(self.device)
        self.log: MetricsLog | None = None
        try:
            self._setup(cfg, resume, overwrite, command)
        except BaseException:
            self.dist.close()
            raise

    # ---- setup
    def _setup(self, cfg: RunConfig, resume: bool, overwrite: bool, command: Sequence[str] | None) -> None:
        if cfg.train.grad_accum % self.dist.world:
            raise ValueError(
                f"train.grad_accum={cfg.train.grad_accum} is not a multiple of the {self.dist.world} processes; the "
                f"global batch is batch_size * grad_accum, so set train.grad_accum to a multiple of {self.dist.world}"
            )
        self.dist.on_main(lambda: self.run.check(cfg, resume=resume, overwrite=overwrite))  # before any rank reads it
        self.cfg = self._setup_data(cfg, overwrite)
        self._setup_model()
        self.step, self.bad_steps, self.skipped_steps, self.tokens = 0, 0, 0, 0
        self.best_val: float | None = None
        self.last_checkpoint: Path | None = None
        self.stop = StopRequest(self.dist.world)
        if resume:
            self._load_latest()
        if self.dist.main:
            if overwrite:
                self.run.clear()
            self.run.write_config(self.cfg, provenance(command, step=self.step, device=str(self.device),
                                                       world_size=self.dist.world))
            self.run.trim_metrics(self.step)
            self.log = MetricsLog(self.run, tensorboard=self.cfg.train.tensorboard, purge_step=self.step or None,
                                  say=self._print)
        self.dist.barrier()

    def _setup_data(self, cfg: RunConfig, overwrite: bool) -> RunConfig:
        """Prepare (or reuse) the run's data on rank 0, open its splits, and take the vocabulary from it."""
        run = self.run_dir
        data_dir = run / cfg.data.dir  # relative to the run; an absolute data.dir can be shared between runs
        created = not run.exists()
        own_data = data_dir.resolve().is_relative_to(run.resolve())

        def prepare_data() -> dict:
            try:
                return prepare(cfg.data, data_dir, seq_len=cfg.seq_len, overwrite=overwrite and own_data)
            except BaseException:
                if created:
                    shutil.rmtree(run, ignore_errors=True)  # leave nothing behind for a run that never started
                raise

        self.meta = self.dist.on_main(prepare_data)
        self.tokenizer = load_tokenizer(data_dir)
        self.data_dir = data_dir
        self.train_data, self.val_data = TokenData(data_dir, "train"), TokenData(data_dir, "val")
        if cfg.model.vocab_size != self.tokenizer.vocab_size:
            cfg = cfg.override({"model.vocab_size": self.tokenizer.vocab_size})  # the data decides the vocabulary
        return cfg

    def _setup_model(self) -> None:
        t = self.cfg.train
        self.model = Transformer(self.cfg.model).to(self.device)
        if t.compile:
            compile_blocks(self.model)  # in place: parameter names and checkpoints are unchanged
        self.train_model: nn.Module = self.model
        if self.dist.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [self.device.index] if self.device.type == "cuda" else None
            # buffers stay in sync without broadcasts: constants, or MoE router biases that every rank
            # updates identically from all-reduced loads (see _train_step)
            self.train_model = DDP(self.train_model, device_ids=ids, broadcast_buffers=False)
        self.optimizer = build_optimizer(self.model, t, self.device)
        use_bf16 = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        self.autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if use_bf16 else contextlib.nullcontext
        self.flops_per_token = self.model.flops_per_token(self.cfg.seq_len)
        self.peak_flops = peak_flops(self.device)

    # ---- the loop
    def fit(self) -> TrainResult:
        t = self.cfg.train
        local_accum = t.grad_accum // self.dist.world
        micro_ids = [self.dist.rank * local_accum + i for i in range(local_accum)]  # global micro-batch numbers
        tokens_per_step = t.batch_size * t.grad_accum * self.cfg.seq_len
        self._print(self._banner(tokens_per_step))
        start = time.perf_counter()
        self._window = (time.perf_counter(), 0)  # (start, tokens) of the throughput window
        loss = val_loss = None
        with self._progress() as bar, self.stop.handlers(self._print):
            while self.step < t.steps and not self.stop.stopping:
                loss, grad_norm, aux = self._train_step(self.step, micro_ids, local_accum)
                self.step += 1
                self.tokens += tokens_per_step
                record = self._record(loss, grad_norm, aux, tokens_per_step, bar)
                self._check_diverged()
                val_loss = self._evaluate_and_save(record, val_loss)
                self._log(record)
            if self.stop.stopping and self.dist.main:
                self._save()
        sample = None
        if not self.stop.stopping:
            if val_loss is None:  # resumed a finished run: report where it stands
                val_loss, _ = self._evaluate()
            sample = self.sample() if self.dist.main and t.sample_tokens else None
        return TrainResult(
            step=self.step, loss=loss, val_loss=val_loss, best_val_loss=self.best_val,
            skipped_steps=self.skipped_steps, tokens=self.tokens, elapsed_s=time.perf_counter() - start,
            checkpoint=self.last_checkpoint, stopped_by=self.stop.signal if self.stop.stopping else None, sample=sample,
        )

    def _train_step(self, step: int, micro_ids: list[int], n: int) -> tuple[float, float, dict[str, float]]:
        t = self.cfg.train
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(step, t)

        def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            for j in micro_ids:
                torch.manual_seed(mixed_seed(t.seed, DROPOUT_STREAM, step, j))
                g = torch.Generator().manual_seed(mixed_seed(t.seed, DATA_STREAM, step, j))
                yield self.train_data.batch(t.batch_size, self.cfg.seq_len, g)

        self.train_model.train()
        ce, aux = forward_backward(self.train_model, batches(), n, device=self.device, autocast=self.autocast)
        # one all-reduce carries the loss and any rank's stop request; gradients are already synchronized
        shared = torch.tensor([float(ce), float(self.stop.signal or 0)], dtype=torch.float64, device=self.device)
        loss, asked = self.dist.all_reduce_sum(shared).tolist()
        loss /= self.dist.world
        self.stop.agree(bool(asked))
        grad_norm = clip_gradients(self.model.parameters(), t.grad_clip)
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.optimizer.step()
            # balance on the load summed over processes, so every rank's biases agree
            self.model.update_router_biases(self.dist.all_reduce_sum if self.dist.world > 1 else None)
            self.bad_steps = 0
        else:
            self.bad_steps += 1
            self.skipped_steps += 1
            self._print(f"step {step + 1}: non-finite {'loss' if not math.isfinite(loss) else 'gradient'}; step skipped")
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm, {k: float(v) for k, v in aux.items()}

    def _check_diverged(self) -> None:
        t = self.cfg.train
        if self.bad_steps >= t.max_bad_steps:
            last = self.last_checkpoint or "none (no checkpoint was written)"
            raise TrainingDiverged(
                f"stopped at step {self.step}: {self.bad_steps} consecutive steps with a non-finite loss or "
                f"gradient (train.max_bad_steps={t.max_bad_steps}); last good checkpoint: {last}"
            )

    def _evaluate_and_save(self, record: dict[str, Any], val_loss: float | None) -> float | None:
        """At evaluation steps add val_loss to ``record``; checkpoint when due, improved or stopping."""
        t, improved = self.cfg.train, False
        if self.step % t.eval_every == 0 or self.step == t.steps:
            val_loss, improved = self._evaluate()
            if val_loss is not None:
                record.update(val_loss=val_loss, val_perplexity=exp_or_none(val_loss))
                self._print(f"step {self.step}: val loss {val_loss:.4f}" + (" (best)" if improved else ""))
        if self.dist.main:
            if self.step % t.save_every == 0 or self.step == t.steps or improved or self.stop.stopping:
                self._save(best=improved)
            if t.sample_every and self.step % t.sample_every == 0 and self.step < t.steps:
                self._print(f"sample at step {self.step}: {self.sample()!r}")
        return val_loss

    # ---- evaluation, checkpoints, samples
    def _evaluate(self) -> tuple[float | None, bool]:
        """(validation loss, whether it is the best so far) on rank 0; (None, False) on other ranks."""
        if not self.dist.main:
            return None, False
        t = self.cfg.train
        loss = evaluate(self.model, self.val_data, batch_size=t.batch_size, seq_len=self.cfg.seq_len,
                        max_batches=t.eval_batches, autocast=self.autocast).loss
        improved = self.best_val is None or loss < self.best_val
        if improved:
            self.best_val = loss
        return loss, improved

    def _save(self, best: bool = False) -> Path | None:
        """Checkpoint the current step (rank 0), unless any weight is non-finite: a bad checkpoint
        never joins the good ones. ``best`` points best.json at it. Prunes to keep_last plus the best."""
        if not all(torch.isfinite(p).all() for p in self.model.parameters()):
            self._print(f"step {self.step}: weights are not finite; checkpoint not written")
            return None
        state = {
            "step": self.step, "optimizer": self.optimizer.state_dict(), "skipped_steps": self.skipped_steps,
            "tokens": self.tokens, "best_val": self.best_val,
        }
        root = self.run.checkpoints
        self.last_checkpoint = ckpt.save_checkpoint(root, self.step, self.model, state, self.cfg.model.to_dict())
        if best:
            ckpt.write_best(root, self.step, self.best_val)
        ckpt.prune(root, self.cfg.train.keep_last)
        return self.last_checkpoint

    def _load_latest(self) -> None:
        found = ckpt.list_checkpoints(self.run.checkpoints)
        if not found:
            self._print(f"no checkpoint in {self.run.checkpoints} yet; starting from step 0")
            return
        step, path = found[-1]
        ckpt.load_weights(self.model, path / ckpt.WEIGHTS)
        state = ckpt.load_state(path)
        self.optimizer.load_state_dict(state["optimizer"])
        for group in self.optimizer.param_groups:  # hyperparameters come from the config, which may have changed
            group.update(betas=tuple(self.cfg.train.betas), eps=self.cfg.train.eps)
            group["weight_decay"] = self.cfg.train.weight_decay if group["weight_decay"] > 0 else 0.0
        self.step, self.skipped_steps, self.tokens = state["step"], state["skipped_steps"], state["tokens"]
        self.best_val = state["best_val"]
        self.last_checkpoint = path
        self._print(f"resumed from {path} (step {step})")

    def sample(self, prompt: str | None = None, max_new_tokens: int | None = None) -> str:
        """Text the model writes after ``prompt`` (default: the config's), seeded by train.seed."""
        from ..generate import context_limit, sample_text

        t = self.cfg.train
        prompt = t.sample_prompt if prompt is None else prompt
        n = max_new_tokens or t.sample_tokens
        limit = context_limit(self.model)  # only a learned position table has an end
        if limit is not None:
            n = max(0, min(n, limit - len(self.tokenizer.encode(prompt))))
        was_training = self.model.training
        self.model.eval()
        try:
            with eager():  # compiled blocks (train.compile) run eagerly while the KV cache grows
                pieces = sample_text(self.model, self.tokenizer, prompt, n, temperature=0.8, top_k=None,
                                     top_p=None, seed=t.seed, eos_id=self.tokenizer.eos_id)
                return prompt + "".join(pieces)  # a generator: consumed inside the eager block
        finally:
            self.model.train(was_training)

    # ---- logging
    def _record(self, loss: float, grad_norm: float, aux: dict[str, float], tokens_per_step: int, bar) -> dict[str, Any]:
        """This step's metrics: only {"step"} between log_every steps, else the full record."""
        t = self.cfg.train
        window_start, window_tokens = self._window
        window_tokens += tokens_per_step
        record: dict[str, Any] = {"step": self.step}
        if self.step % t.log_every == 0 or self.step == t.steps:
            now = time.perf_counter()
            tps = window_tokens / max(now - window_start, 1e-9)
            window_start, window_tokens = now, 0
            record.update(loss=loss, lr=learning_rate(self.step - 1, t), grad_norm=grad_norm,
                          tokens=self.tokens, tokens_per_s=tps, skipped_steps=self.skipped_steps)
            if self.peak_flops:
                record["mfu"] = tps * self.flops_per_token / (self.peak_flops * self.dist.world)
            if aux:
                record["aux_losses"] = aux
            if self.model.moe_layers:
                record["moe"] = jsonable(self.model.moe_stats())
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.3f}", lr=f"{record['lr']:.1e}", tok_s=f"{tps:,.0f}", refresh=False)
        self._window = (window_start, window_tokens)
        if bar is not None:
            bar.update(1)
        return record

    def _log(self, record: dict[str, Any]) -> None:
        for cb in self.callbacks:
            cb(self, record)
        if self.log is not None and len(record) > 1:
            self.log.write(record)

    @contextlib.contextmanager
    def _progress(self) -> Iterator[Any]:
        """A tqdm bar on rank 0 (None when quiet or on other ranks)."""
        if not self.dist.main or self.quiet:
            yield None
            return
        from tqdm.auto import tqdm

        bar = tqdm(total=self.cfg.train.steps, initial=self.step, unit="step", dynamic_ncols=True, leave=True)
        try:
            yield bar
        finally:
            bar.close()

    def _print(self, message: str) -> None:
        if self.dist.main and not self.quiet:
            from tqdm.auto import tqdm

            tqdm.write(message)

    def _banner(self, tokens_per_step: int) -> str:
        m, t = self.cfg.model, self.cfg.train
        n = self.model.num_params()
        return (
            f"training {self.run_dir}: {n['total']:,} parameters ({m.n_layers} layers, d_model {m.d_model}, "
            f"{m.positions} positions), vocab {m.vocab_size}; {t.steps} steps of {tokens_per_step:,} tokens "
            f"({t.batch_size} x {self.cfg.seq_len} x {t.grad_accum} accum) on {self.device}"
            + (f" x {self.dist.world} processes" if self.dist.world > 1 else "")
            + f"; train {len(self.train_data):,} tokens, val {len(self.val_data):,}"
        )

    # ---- signals and teardown
    def request_stop(self, signum: int = signal.SIGINT) -> None:
        """Finish the current step, save a checkpoint and return from ``fit`` (what Ctrl-C does)."""
        self.stop.signal = signum

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None
        self.dist.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
