"""Training: the run config, the optimizer and schedule, and the training loop.

    cfg = load_config("run.yaml", {"train.lr": 3e-4})      # defaults < YAML < dotted overrides
    result = Trainer(cfg, "runs/mine").fit()

One step, seen from one of W processes (W = 1 without ``torchrun``)::

    lr(step) ─▶ for each of my grad_accum / W micro-batches:        x, y drawn with seed (seed, step, j)
                    loss_j = model(x, y).loss / (grad_accum / W);  backward   (DDP syncs grads on the last)
                clip grad norm ─▶ loss or norm non-finite? ─ yes ─▶ skip: no update, count it
                                                           └ no ──▶ AdamW step; MoE router biases

Every random draw of step s is seeded from (seed, s, j), where j numbers the step's micro-batches
over all processes. So no RNG state needs saving: resuming from a checkpoint repeats the
uninterrupted run exactly, and the same config on 1 or W processes sees the same global batch
(``batch_size * grad_accum`` sequences) and the same dropout masks.

Run directory::

    config.yaml      the resolved RunConfig, plus the provenance of every session that trained it
    metrics.jsonl    one JSON record per logged step (evaluation steps add val_loss)
    checkpoints/     see checkpoint.py
    data/            the prepared tokens and tokenizer (data.dir, relative to the run; absolute to share)
    tb/              TensorBoard events
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from . import checkpoint as ckpt
from .config import ModelConfig
from .data import DataConfig, TokenData, prepare
from .evaluate import evaluate
from .model import Transformer
from .positions import AttentionTerm, PositionScheme
from .schema import Config, check_positive, check_range
from .tokenizer import load_tokenizer

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
TENSORBOARD = "tb"


# ============================================================== configs
@dataclasses.dataclass(kw_only=True, frozen=True)
class TrainConfig(Config):
    """How to train. The defaults are the ``lmlab train`` demo: a few minutes on a 2-core CPU."""

    steps: int = 1500  # optimizer steps
    batch_size: int = 16  # sequences per micro-batch, on each process
    seq_len: int | None = None  # tokens per sequence; None = model.max_seq_len
    grad_accum: int = 1  # micro-batches per step over all processes: global batch = batch_size * grad_accum
    lr: float = 2e-3  # peak learning rate; small models tolerate a high one
    min_lr: float | None = None  # cosine decay ends here; None = lr / 10 (as in Chinchilla)
    warmup_steps: int = 100  # linear warmup from lr / warmup_steps
    weight_decay: float = 0.1  # AdamW decoupled decay; matrices only, never norms, biases or embeddings
    betas: tuple[float, ...] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 = no clipping
    eval_every: int = 250  # steps between validation passes (and at the last step)
    eval_batches: int = 20  # validation batches of batch_size sequences per pass
    save_every: int = 500  # steps between checkpoints (also at a new best, the last step and on a signal)
    keep_last: int = 2  # newest checkpoints kept, besides the best
    seed: int = 0  # data order and dropout; weights are seeded by model.init_seed
    device: str = "auto"  # auto = cuda if available, else cpu; or cpu, cuda, cuda:1, mps
    compile: bool = False  # torch.compile the model (slow to start; worth it on GPUs)
    max_bad_steps: int = 5  # stop after this many consecutive steps with a non-finite loss or gradient
    log_every: int = 10  # steps between metrics.jsonl records
    sample_every: int = 0  # steps between printed samples; 0 = only at the end
    sample_tokens: int = 200  # tokens per sample
    sample_prompt: str = "The "
    tensorboard: bool = True  # write TensorBoard events to <run>/tb when tensorboard is installed

    def validate(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "lr", "eval_every", "eval_batches", "save_every",
                     "keep_last", "max_bad_steps", "log_every", "eps"):
            check_positive(f"train.{name}", getattr(self, name))
        if self.seq_len is not None:
            check_positive("train.seq_len", self.seq_len)
        for name in ("warmup_steps", "weight_decay", "grad_clip", "sample_every", "sample_tokens"):
            check_positive(f"train.{name}", getattr(self, name), allow_zero=True)
        if self.min_lr is not None:
            check_positive("train.min_lr", self.min_lr, allow_zero=True)
        if self.min_lr is not None and self.min_lr > self.lr:
            raise ValueError(f"train.min_lr={self.min_lr} is above train.lr={self.lr}; choose min_lr <= lr")
        if len(self.betas) != 2:
            raise ValueError(f"train.betas={list(self.betas)} is not valid; give two numbers, e.g. 0.9,0.95")
        for i, b in enumerate(self.betas):
            check_range(f"train.betas[{i}]", b, 0.0, 0.9999)
        try:
            if self.device != "auto":
                torch.device(self.device)
        except RuntimeError:
            raise ValueError(
                f"train.device={self.device!r} is not a device; use auto, cpu, cuda, cuda:N or mps"
            ) from None


def default_model() -> ModelConfig:
    """The demo model: llama-style (RMSNorm, rotary, SwiGLU, grouped-query attention), ~0.8M
    parameters, byte vocabulary: it learns visible structure from a few minutes of CPU."""
    return ModelConfig.from_preset("llama", d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=128)


@dataclasses.dataclass(kw_only=True, frozen=True)
class RunConfig(Config):
    """Everything a training run needs, saved as the run's config.yaml."""

    model: ModelConfig = dataclasses.field(default_factory=default_model)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

    def validate(self) -> None:
        if self.train.seq_len is not None and self.train.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"train.seq_len={self.train.seq_len} is longer than model.max_seq_len={self.model.max_seq_len}, "
                "the model's training context; raise model.max_seq_len or lower train.seq_len"
            )

    @property
    def seq_len(self) -> int:
        return self.train.seq_len or self.model.max_seq_len


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """Defaults, then the YAML file's fields, then dotted ``overrides`` (``{"model.n_layers": 6}``).

    A YAML file may give any subset of fields; a run's own config.yaml (with its ``provenance``) works too."""
    import yaml

    changes: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file {str(p)!r} does not exist")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            line = getattr(getattr(e, "problem_mark", None), "line", None)
            where = f" at line {line + 1}" if line is not None else ""
            raise ValueError(f"config file {str(p)!r} is not valid YAML{where}") from None
        if data is None:
            raise ValueError(f"config file {str(p)!r} is empty; give at least one of model:, data:, train:")
        if not isinstance(data, dict):
            raise ValueError(f"config file {str(p)!r} must be a mapping with model:, data:, train: sections")
        data.pop("provenance", None)
        changes.update(_flatten(data))
    changes.update(overrides or {})
    return RunConfig().override(changes) if changes else RunConfig()


def provenance(command: Sequence[str] | None, **extra: Any) -> dict[str, Any]:
    """Where a session of a run came from: versions, git revision, command line, time."""
    from . import __version__

    return {
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(command) if command is not None else " ".join(sys.argv),
        "lmlab": __version__,
        "git": git_revision(),
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "host": platform.node(),
        **extra,
    }


def git_revision() -> str | None:
    """The commit lmlab runs from (``-dirty`` with uncommitted changes), or None outside a checkout."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    rev = git("rev-parse", "HEAD")
    if not rev:
        return None
    return rev + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def config_diff(a: RunConfig, b: RunConfig) -> list[str]:
    """Dotted fields that differ: ["model.d_model: 64 vs 128", ...]."""
    fa, fb = _flatten(a.to_dict()), _flatten(b.to_dict())
    return [f"{k}: {fa.get(k)!r} vs {fb.get(k)!r}" for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


# ============================================================== optimizer and schedule
def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW groups: weight matrices decay; norms, biases, token and position embeddings do not.

    Decaying a gain or bias pulls it to 0, which is not a simpler function; decaying an embedding
    shrinks rare tokens' vectors just for being rare. A tied output head is the embedding."""
    embeddings = {
        id(p) for m in model.modules() if isinstance(m, (nn.Embedding, PositionScheme, AttentionTerm)) for p in m.parameters()
    }
    decay: dict[str, nn.Parameter] = {}
    no_decay: dict[str, nn.Parameter] = {}
    for name, p in model.named_parameters():  # tied parameters appear once
        if p.requires_grad:
            (no_decay if p.ndim < 2 or id(p) in embeddings else decay)[name] = p
    return [
        {"params": list(decay.values()), "names": list(decay), "weight_decay": weight_decay},
        {"params": list(no_decay.values()), "names": list(no_decay), "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    # the fused kernel (CUDA, and CPU since torch 2.4) is one pass over each tensor: ~6x faster
    # than the foreach path on CPU for a few-million-parameter model
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
        fused=True if device.type in ("cpu", "cuda") else None,
    )


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """lr for 0-based ``step``: linear warmup to ``lr`` over ``warmup_steps`` (reaching it at step
    warmup_steps - 1), then cosine decay reaching ``min_lr`` at the last step, steps - 1."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = cfg.steps - 1 - cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps) if decay_steps > 0 else 1.0
    min_lr = cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def clip_gradients(parameters: Iterable[torch.Tensor], max_norm: float) -> float:
    """Scale gradients to global L2 norm <= ``max_norm`` (0 = leave them); return the norm before
    clipping, which is non-finite when any gradient is."""
    norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm if max_norm > 0 else float("inf"))
    return float(norm)


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


def _seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (numpy's SeedSequence), so nearby steps get unrelated streams."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, dtype=np.uint64)[0] >> 1)


_DATA, _DROPOUT = 0, 1  # seed streams


# ============================================================== distributed
@dataclasses.dataclass
class Dist:
    """This process's place under ``torchrun`` (rank 0 of 1 without it)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    owns_group: bool = False

    @classmethod
    def from_env(cls, device: torch.device) -> "Dist":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        import torch.distributed as dist

        owns = not dist.is_initialized()
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL object collectives use the current device
        if owns:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return cls(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), owns)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def on_main(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on rank 0 only and give every rank its result, or its ValueError/FileNotFoundError."""
        outcome: list[Any] = [None]
        if self.main:
            try:
                outcome = [("ok", fn())]
            except (ValueError, FileNotFoundError) as e:
                outcome = [(type(e).__name__, str(e))]
                if self.world == 1:
                    raise
        if self.world > 1:
            import torch.distributed as dist

            dist.broadcast_object_list(outcome, src=0)
        kind, value = outcome[0]
        if kind != "ok":
            raise (ValueError if kind == "ValueError" else FileNotFoundError)(value)
        return value

    def close(self) -> None:
        if self.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"train.device={name!r} but CUDA is not available here; use train.device=cpu")
        if device.index is None:
            device = torch.device("cuda", local_rank)
    return device


# peak dense bf16 tensor-core FLOP/s, for MFU on known accelerators (vendor data sheets)
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 70e12,
              "4090": 165e12, "3090": 71e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


# ============================================================== trainer
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
        self.run_dir = Path(run_dir)
        self.callbacks, self.quiet = list(callbacks), quiet
        self.device = resolve_device(cfg.train.device, int(os.environ.get("LOCAL_RANK", "0")))
        self.dist = Dist.from_env(self.device)
        try:
            self._setup(cfg, resume, overwrite, command)
        except BaseException:
            self.dist.close()
            raise

    # ---- setup
    def _setup(self, cfg: RunConfig, resume: bool, overwrite: bool, command: Sequence[str] | None) -> None:
        t, run = cfg.train, self.run_dir
        if t.grad_accum % self.dist.world:
            raise ValueError(
                f"train.grad_accum={t.grad_accum} is not a multiple of the {self.dist.world} processes; the global "
                f"batch is batch_size * grad_accum, so set train.grad_accum to a multiple of {self.dist.world}"
            )
        self.dist.on_main(lambda: self._check_run_dir(cfg, resume, overwrite))  # before any rank reads the dir
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
        if cfg.model.vocab_size != self.tokenizer.vocab_size:
            cfg = cfg.override({"model.vocab_size": self.tokenizer.vocab_size})  # the data decides the vocabulary
        self.cfg, self.data_dir = cfg, data_dir
        self.train_data, self.val_data = TokenData(data_dir, "train"), TokenData(data_dir, "val")

        # model, optimizer
        self.model = Transformer(cfg.model).to(self.device)
        self.train_model: nn.Module = torch.compile(self.model) if t.compile else self.model
        if self.dist.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [self.device.index] if self.device.type == "cuda" else None
            # buffers stay in sync without broadcasts: constants, or MoE router biases that every rank
            # updates identically from all-reduced loads (see _train_step)
            self.train_model = DDP(self.train_model, device_ids=ids, broadcast_buffers=False)
        self.optimizer = build_optimizer(self.model, t, self.device)
        use_bf16 = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        self.autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if use_bf16 else contextlib.nullcontext
        self.flops_per_token = self.model.flops_per_token(cfg.seq_len)
        self.peak_flops = peak_flops(self.device)

        # state
        self.step, self.bad_steps, self.skipped_steps, self.tokens = 0, 0, 0, 0
        self.best_val: float | None = None
        self.last_checkpoint: Path | None = None
        self._stop: int | None = None  # the signal that asked this process to stop
        self._stop_agreed = False  # some rank asked, as of the last all-reduce
        if resume:
            self._load_latest()
        if self.dist.main:
            if overwrite:
                for name in (CHECKPOINTS, TENSORBOARD, METRICS_FILE, CONFIG_FILE):
                    p = run / name
                    shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
            self._write_config(command)
            self._trim_metrics()
        self.dist.barrier()
        self.metrics = open(run / METRICS_FILE, "a") if self.dist.main else None
        self.tb = self._tensorboard() if self.dist.main and t.tensorboard else None

    def _check_run_dir(self, cfg: RunConfig, resume: bool, overwrite: bool) -> None:
        config_path = self.run_dir / CONFIG_FILE
        exists = config_path.is_file() or bool(ckpt.list_checkpoints(self.run_dir / CHECKPOINTS))
        if resume and not config_path.is_file():
            raise ValueError(f"nothing to resume: {str(self.run_dir)!r} holds no run (no {CONFIG_FILE}); drop --resume")
        if exists and not resume and not overwrite:
            found = ckpt.list_checkpoints(self.run_dir / CHECKPOINTS)
            what = "a run"
            with contextlib.suppress(ValueError, FileNotFoundError):
                saved = load_config(config_path)
                # the vocabulary is resolved from the data when a run starts; compare everything else
                diff = config_diff(saved, cfg.override({"model.vocab_size": saved.model.vocab_size}))
                at = f", trained to step {found[-1][0]}" if found else ""
                what = f"a different run ({diff[0]}, there vs here)" if diff else f"this run{at}"
            raise ValueError(
                f"run directory {str(self.run_dir)!r} already holds {what}; pass --resume to continue it "
                "or --overwrite to replace it, or choose another --run-dir"
            )

    def _load_latest(self) -> None:
        found = ckpt.list_checkpoints(self.run_dir / CHECKPOINTS)
        if not found:
            self._print(f"no checkpoint in {self.run_dir / CHECKPOINTS} yet; starting from step 0")
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

    def _write_config(self, command: Sequence[str] | None) -> None:
        import yaml

        path = self.run_dir / CONFIG_FILE
        history = []
        if path.is_file():
            history = (yaml.safe_load(path.read_text()) or {}).get("provenance", [])
        entry = provenance(command, step=self.step, device=str(self.device), world_size=self.dist.world)
        data = {**self.cfg.to_dict(), "provenance": [*history, entry]}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.atomic_write_text(path, yaml.safe_dump(data, sort_keys=False))

    def _trim_metrics(self) -> None:
        """On resume, drop records logged after the checkpoint, which the resumed run logs again."""
        path = self.run_dir / METRICS_FILE
        if not path.is_file():
            return
        def keep(line: str) -> bool:
            try:
                return json.loads(line)["step"] <= self.step
            except (ValueError, KeyError, TypeError):  # a line cut short by a crash
                return False

        lines = [ln for ln in path.read_text().splitlines() if keep(ln)]
        ckpt.atomic_write_text(path, "".join(ln + "\n" for ln in lines))

    def _tensorboard(self):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            self._print("note: tensorboard is not installed, so no event files are written (pip install tensorboard)")
            return None
        return SummaryWriter(str(self.run_dir / TENSORBOARD), purge_step=self.step or None)

    # ---- the loop
    def fit(self) -> TrainResult:
        t = self.cfg.train
        local_accum = t.grad_accum // self.dist.world
        micro_ids = [self.dist.rank * local_accum + i for i in range(local_accum)]  # global micro-batch numbers
        tokens_per_step = t.batch_size * t.grad_accum * self.cfg.seq_len
        self._print(self._banner(tokens_per_step))
        bar = None
        if self.dist.main and not self.quiet:
            from tqdm.auto import tqdm

            bar = tqdm(total=t.steps, initial=self.step, unit="step", dynamic_ncols=True, leave=True)
        previous = self._install_signal_handlers()
        start, window_start, window_tokens = time.perf_counter(), time.perf_counter(), 0
        loss = val_loss = None
        try:
            while self.step < t.steps and not self._stopping():
                loss, grad_norm, aux = self._train_step(self.step, micro_ids, local_accum)
                self.step += 1
                self.tokens += tokens_per_step
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
                        record["moe"] = _jsonable(self.model.moe_stats())
                    if bar is not None:
                        bar.set_postfix(loss=f"{loss:.3f}", lr=f"{record['lr']:.1e}", tok_s=f"{tps:,.0f}", refresh=False)
                if bar is not None:
                    bar.update(1)
                if self.bad_steps >= t.max_bad_steps:
                    last = self.last_checkpoint or "none (no checkpoint was written)"
                    raise TrainingDiverged(
                        f"stopped at step {self.step}: {self.bad_steps} consecutive steps with a non-finite loss or "
                        f"gradient (train.max_bad_steps={t.max_bad_steps}); last good checkpoint: {last}"
                    )
                improved = False
                if self.step % t.eval_every == 0 or self.step == t.steps:
                    val_loss, improved = self._evaluate()
                    if val_loss is not None:
                        record.update(val_loss=val_loss, val_perplexity=_exp(val_loss))
                        self._print(f"step {self.step}: val loss {val_loss:.4f}" + (" (best)" if improved else ""))
                if self.dist.main:
                    if self.step % t.save_every == 0 or self.step == t.steps or improved or self._stopping():
                        self._save(best=improved)
                    if t.sample_every and self.step % t.sample_every == 0 and self.step < t.steps:
                        self._print(f"sample at step {self.step}: {self.sample()!r}")
                self._log(record)
            if self._stopping() and self.dist.main:
                self._save()
        finally:
            self._restore_signal_handlers(previous)
            if bar is not None:
                bar.close()
        sample = None
        if not self._stopping():
            if val_loss is None:  # resumed a finished run: report where it stands
                val_loss, _ = self._evaluate()
            sample = self.sample() if self.dist.main and t.sample_tokens else None
        return TrainResult(
            step=self.step, loss=loss, val_loss=val_loss, best_val_loss=self.best_val,
            skipped_steps=self.skipped_steps, tokens=self.tokens, elapsed_s=time.perf_counter() - start,
            checkpoint=self.last_checkpoint, stopped_by=self._stop if self._stopping() else None, sample=sample,
        )

    def _train_step(self, step: int, micro_ids: list[int], n: int) -> tuple[float, float, dict[str, float]]:
        t = self.cfg.train
        lr = learning_rate(step, t)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            for j in micro_ids:
                torch.manual_seed(_seed(t.seed, _DROPOUT, step, j))
                yield self.train_data.batch(t.batch_size, self.cfg.seq_len, torch.Generator().manual_seed(_seed(t.seed, _DATA, step, j)))

        self.train_model.train()
        ce, aux = forward_backward(self.train_model, batches(), n, device=self.device, autocast=self.autocast)
        # one all-reduce carries the loss and any rank's stop request; gradients are already synchronized
        shared = torch.stack([ce.double(), torch.tensor(float(self._stop or 0), dtype=torch.float64, device=self.device)])
        shared = self.dist.all_reduce_sum(shared).tolist()
        loss, stop = shared[0] / self.dist.world, shared[1]
        if stop:
            self._stop_agreed = True
            self._stop = self._stop or signal.SIGTERM  # another rank got the signal
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
        root = self.run_dir / CHECKPOINTS
        state = {
            "step": self.step, "optimizer": self.optimizer.state_dict(), "skipped_steps": self.skipped_steps,
            "tokens": self.tokens, "best_val": self.best_val,
        }
        self.last_checkpoint = ckpt.save_checkpoint(root, self.step, self.model, state, self.cfg.model.to_dict())
        if best:
            ckpt.write_best(root, self.step, self.best_val)
        ckpt.prune(root, self.cfg.train.keep_last)
        return self.last_checkpoint

    def sample(self, prompt: str | None = None, max_new_tokens: int | None = None) -> str:
        """Text the model writes after ``prompt`` (default: the config's), seeded by train.seed."""
        from .generate import context_limit, sample_text

        t = self.cfg.train
        prompt = t.sample_prompt if prompt is None else prompt
        n = max_new_tokens or t.sample_tokens
        limit = context_limit(self.model)  # only a learned position table has an end
        if limit is not None:
            n = max(0, min(n, limit - len(self.tokenizer.encode(prompt))))
        was_training = self.model.training
        self.model.eval()
        try:
            pieces = sample_text(self.model, self.tokenizer, prompt, n, temperature=0.8, top_k=None, top_p=None,
                                 seed=t.seed, eos_id=self.tokenizer.eos_id)
            return prompt + "".join(pieces)
        finally:
            self.model.train(was_training)

    # ---- logging
    def _log(self, record: dict[str, Any]) -> None:
        for cb in self.callbacks:
            cb(self, record)
        if not self.dist.main or len(record) == 1:
            return
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        if self.tb is not None:
            for key, value in _scalars(record):
                if key != "step":
                    self.tb.add_scalar(key, value, record["step"])

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

    # ---- signals
    def request_stop(self, signum: int = signal.SIGINT) -> None:
        """Finish the current step, save a checkpoint and return from ``fit`` (what Ctrl-C does)."""
        self._stop = signum

    def _stopping(self) -> bool:
        # under DDP only the all-reduced flag counts, so that every rank leaves the loop after the same step
        return self._stop_agreed if self.dist.world > 1 else self._stop is not None

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}

        def handler(signum, frame):
            if self._stop is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt  # a second Ctrl-C stops at once
            self._print(f"\n{signal.Signals(signum).name}: stopping after this step and saving a checkpoint")
            self.request_stop(signum)

        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, handler)
        return previous

    @staticmethod
    def _restore_signal_handlers(previous: dict[int, Any]) -> None:
        for sig, h in previous.items():
            signal.signal(sig, h)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        self.dist.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _exp(x: float | None) -> float | None:
    return None if x is None else math.exp(min(x, 700.0))


def _scalars(x: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """(tag, number) pairs of a record for TensorBoard: moe[1]["max_load"] -> "moe/1/max_load"."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        yield prefix, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _scalars(v, f"{prefix}/{k}" if prefix else str(k))
    elif isinstance(x, list) and x and isinstance(x[0], dict):
        for i, v in enumerate(x):
            yield from _scalars(v, f"{prefix}/{i}")


def _jsonable(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x
