"""The run config: the task, the model, the data and how to train, saved as a run's ``config.yaml``.

    cfg = load_config("run.yaml", {"train.lr": 3e-4})      # defaults < YAML < dotted overrides
    cfg.seq_len                                             # train.seq_len or model.max_seq_len
    build_config(config_changes(mapping, "spec.yaml: base"))  # the same reading, for a sweep's base: and variants

The model section starts from the demo model, or from ``model.preset`` (``model: {preset: llama,
d_model: 256}``, ``--model.preset mixtral``), or from the weights of ``train.init_from``; the
other model fields are applied on top. ``data: DIR`` is short for ``data: {prepared: DIR}``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping

from ..config import PRESETS, ModelConfig
from ..schema import Config, check_positive, check_range, divisors, read_yaml
from .data.config import DataConfig

Parallel = Literal["ddp", "fsdp"]
ActivationCheckpointing = Literal["none", "blocks"]
SaveMode = Literal["sync", "async"]


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
    compile: bool = False  # torch.compile each block, fullgraph (run/parallel/compile.py; slow to start, worth it on GPUs)
    max_bad_steps: int = 5  # stop after this many consecutive steps with a non-finite loss or gradient
    log_every: int = 10  # steps between metrics.jsonl records
    sample_every: int = 0  # steps between printed samples; 0 = only at the end
    sample_tokens: int = 200  # tokens per sample
    sample_prompt: str = "The "
    tensorboard: bool = True  # write TensorBoard events to <run>/tb when tensorboard is installed
    init_from: str | None = None  # start from these weights: an lmlab run, a checkpoint, or a Hugging Face checkpoint
    # ---- several processes under torchrun (docs/distributed.md); applied by run/parallel/plan.py
    parallel: Parallel = "ddp"  # ddp: each process holds the whole model; fsdp: params, grads, optimizer sharded (FSDP2)
    expert_parallel: int = 1  # N > 1: each group of N processes splits every MoE layer's routed experts N ways
    activation_checkpointing: ActivationCheckpointing = "none"  # blocks: recompute block activations in backward
    activation_checkpoint_every: int = 1  # with blocks: checkpoint every k-th block (1 = all of them)
    collective_timeout: float = 600.0  # seconds a process waits for the others in training before it gives up
    setup_timeout: float = 3600.0  # the same before the first step, while rank 0 prepares the data
    save_mode: SaveMode = "sync"  # async: sharded (DCP) checkpoints are written while training goes on
    max_memory_gib: float | None = None  # refuse to start a run estimated to need more; None = the device's memory

    def validate(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "lr", "eval_every", "eval_batches", "save_every",
                     "keep_last", "max_bad_steps", "log_every", "eps"):
            check_positive(f"train.{name}", getattr(self, name))
        if self.seq_len is not None:
            check_positive("train.seq_len", self.seq_len)
        for name in ("expert_parallel", "activation_checkpoint_every", "collective_timeout", "setup_timeout"):
            check_positive(f"train.{name}", getattr(self, name))
        for name in ("warmup_steps", "weight_decay", "grad_clip", "sample_every", "sample_tokens"):
            check_positive(f"train.{name}", getattr(self, name), allow_zero=True)
        if self.min_lr is not None:
            check_positive("train.min_lr", self.min_lr, allow_zero=True)
        if self.max_memory_gib is not None:
            check_positive("train.max_memory_gib", self.max_memory_gib)
        if self.min_lr is not None and self.min_lr > self.lr:
            raise ValueError(f"train.min_lr={self.min_lr} is above train.lr={self.lr}; choose min_lr <= lr")
        if len(self.betas) != 2:
            raise ValueError(f"train.betas={list(self.betas)} is not valid; give two numbers, e.g. 0.9,0.95")
        for i, b in enumerate(self.betas):
            check_range(f"train.betas[{i}]", b, 0.0, 0.9999)
        if self.init_from is not None and not self.init_from.strip():
            raise ValueError("train.init_from='' is not valid; name a run, a checkpoint or a Hugging Face directory, or leave it unset")
        try:
            if self.device != "auto":
                import torch  # here, not at the top: the config (and `lmlab train --help`) loads without torch

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

    task: Literal["lm", "classify"] = "lm"  # lm: next-token prediction; classify: a label per row (SequenceClassifier)
    model: ModelConfig = dataclasses.field(default_factory=default_model)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

    def validate(self) -> None:
        if self.train.seq_len is not None and self.train.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"train.seq_len={self.train.seq_len} is longer than model.max_seq_len={self.model.max_seq_len}, "
                "the model's training context; raise model.max_seq_len or lower train.seq_len"
            )
        n = self.train.expert_parallel
        if n > 1:
            if self.model.moe is None:
                raise ValueError(f"train.expert_parallel={n} needs a mixture-of-experts model (model.moe); "
                                 "set train.expert_parallel=1 for a dense model")
            experts = self.model.moe.routed_experts
            if experts % n:
                raise ValueError(f"train.expert_parallel={n} does not divide the {experts} routed experts of each MoE "
                                 f"layer; choose train.expert_parallel in {[d for d in divisors(experts) if d > 1]}")
        if self.train.save_mode == "async" and self.train.parallel == "ddp" and n == 1:
            raise ValueError("train.save_mode=async writes sharded (DCP) checkpoints, which train.parallel=fsdp or "
                             "train.expert_parallel > 1 use; set train.save_mode=sync under ddp")

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


def _leaves(data: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """The dotted key of every leaf of ``data``, repeats included (``flatten`` keeps only the last)."""
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """Defaults, then the YAML file's fields, then dotted ``overrides`` (``{"model.n_layers": 6}``).

    A YAML file may give any subset of fields; a run's own config.yaml (with its ``provenance``) works
    too, and is taken as resolved: its model is not rebuilt from a preset or ``init_from``. A field
    given twice (``lr:`` twice under ``train:``, or both ``train: {lr: ..}`` and ``train.lr:``) is refused."""
    changes: dict[str, Any] = {}
    resolved = False
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file {str(p)!r} does not exist")
        data = read_yaml(p, f"config file {str(p)!r}")
        if data is None:
            raise ValueError(f"config file {str(p)!r} is empty; give at least one of model:, data:, train:")
        if not isinstance(data, dict):
            raise ValueError(f"config file {str(p)!r} must be a mapping with model:, data:, train: sections")
        resolved = data.get("provenance") is not None
        changes.update(config_changes(data, f"config file {str(p)!r}"))
    changes.update(overrides or {})
    return build_config(changes, resolved=resolved)


def config_changes(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The dotted changes a run config mapping asks for, for :func:`build_config`: nested sections
    flattened (``{"model": {"d_model": 64}}`` -> ``{"model.d_model": 64}``; ``model.preset`` stays a
    change), ``data: DIR`` read as ``data.prepared``, and a run's ``provenance`` record dropped. The
    one reading of a config: ``train --config`` and a sweep's ``base:`` and variants all use it.
    A field given twice (nested and dotted) is refused, naming ``source``."""
    provenance = data.get("provenance")
    if provenance is not None and not isinstance(provenance, list):
        raise ValueError(f"{source}: provenance must be the list of sessions lmlab writes, "
                         f"got {type(provenance).__name__}; restore it or delete the section")
    data = {k: v for k, v in data.items() if k != "provenance"}
    if isinstance(data.get("data"), str):  # data: DIR
        data["data"] = {"prepared": data["data"]}
    leaves = list(_leaves(data))
    twice = next((k for i, k in enumerate(leaves) if k in leaves[:i]), None)
    if twice is not None:
        raise ValueError(f"{source} gives {twice!r} twice (nested and dotted); keep one")
    return flatten(data)


def build_config(changes: Mapping[str, Any], *, resolved: bool = False) -> RunConfig:
    """A RunConfig from dotted ``changes`` on the defaults. ``model.preset`` (a name in
    ``lmlab.PRESETS``) or ``train.init_from`` (its weights' config) replaces the demo model as the
    starting point of the model section; the other ``model.*`` changes apply on top of it.
    ``resolved``: the changes are a run's saved config, whose model needs no starting point."""
    changes = dict(changes)
    preset = changes.pop("model.preset", None)
    init = changes.get("train.init_from")
    base = RunConfig()
    if preset is not None and resolved:
        raise ValueError("model.preset chooses the model of a new run; this run's model is already in its config.yaml")
    if preset is not None and init is not None:
        raise ValueError(f"model.preset={preset!r} and train.init_from={init!r} both choose the model; give one")
    if preset is not None:
        if not isinstance(preset, str):
            raise ValueError(f"model.preset={preset!r} is not a preset name; choose one of {sorted(PRESETS)}")
        base = base.replace(model=ModelConfig.from_preset(preset))
    elif init is not None and not resolved:
        from .init_from import init_source

        base = base.replace(model=init_source(str(init)).model)
    return base.override(changes) if changes else base


def config_diff(a: RunConfig, b: RunConfig) -> list[str]:
    """Dotted fields that differ: ["model.d_model: 64 vs 128", ...]."""
    fa, fb = flatten(a.to_dict()), flatten(b.to_dict())
    return [f"{k}: {fa.get(k)!r} vs {fb.get(k)!r}" for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]
