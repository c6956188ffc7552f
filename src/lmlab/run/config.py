"""The run config: the model, the data and how to train, saved as a run's ``config.yaml``.

    cfg = load_config("run.yaml", {"train.lr": 3e-4})      # defaults < YAML < dotted overrides
    cfg.seq_len                                             # train.seq_len or model.max_seq_len
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

import torch

from ..config import ModelConfig
from ..schema import Config, check_positive, check_range
from .data import DataConfig


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
    compile: bool = False  # torch.compile each block, fullgraph (run/compile.py; slow to start, worth it on GPUs)
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


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys: ``{"model": {"d_model": 64}}`` -> ``{"model.d_model": 64}``."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{prefix}{key}."))
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
        changes.update(flatten(data))
    changes.update(overrides or {})
    return RunConfig().override(changes) if changes else RunConfig()


def config_diff(a: RunConfig, b: RunConfig) -> list[str]:
    """Dotted fields that differ: ["model.d_model: 64 vs 128", ...]."""
    fa, fb = flatten(a.to_dict()), flatten(b.to_dict())
    return [f"{k}: {fa.get(k)!r} vs {fb.get(k)!r}" for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]
