"""The run config: the task, the model, the data, and a section per concern of training, saved as a
run's ``config.yaml``.

    cfg = load_config("run.yaml", {"optim.lr": 3e-4})      # defaults < YAML < dotted overrides
    cfg.seq_len                                             # train.seq_len or model.max_seq_len
    build_config(config_changes(mapping, "spec.yaml: base"))  # the same reading, for a sweep's base: and variants

    train:       what is trained, for how long, on what device (TrainConfig)
    optim:       AdamW (or Muon for the hidden matrices) and its warmup + cosine schedule (OptimConfig; run/optim.py)
    eval:        validation passes (EvalConfig)
    checkpoint:  when checkpoints are written, how many are kept, sync or async (CheckpointConfig)
    log:         metrics.jsonl, samples, and the trackers: TensorBoard, W&B, MLflow (LogConfig; run/trackers.py)
    parallel:    several processes under torchrun (ParallelConfig; run/parallel/plan.py)

Each component receives only its own section. The old keys of the one-section layout
(``train.lr``, ``train.eval_every``, ...) are read for one release, with a note (RENAMED, at the end).

The model section starts from the demo model, or from ``model.preset`` (``model: {preset: llama,
d_model: 256}``, ``--model.preset mixtral``), or from the weights of ``train.init_from``; the
other model fields are applied on top. ``data: DIR`` is short for ``data: {prepared: DIR}``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, ClassVar, Iterator, Literal, Mapping, Sequence

from ..config import PRESETS, ModelConfig
from ..schema import Config, added, check_positive, check_range, divisors, read_yaml
from .data.config import DataConfig

Strategy = Literal["ddp", "fsdp"]
ActivationCheckpointing = Literal["none", "blocks"]
SaveMode = Literal["sync", "async"]
TrackerName = Literal["tensorboard", "wandb", "mlflow"]  # run/trackers.py: TRACKERS


@dataclasses.dataclass(kw_only=True, frozen=True)
class Section(Config):
    """A section of the run config: a message about one of its fields names it ``section.field``."""

    section: ClassVar[str]

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except ValueError as e:  # the schema's type checks name the bare field; this section's checks name it in full
            text, names = str(e), self.field_names()
            if any(text.startswith(f"{n}{c}") for n in names for c in "=[ "):
                raise ValueError(f"{self.section}.{text}") from None
            raise

    def positive(self, *names: str, allow_zero: bool = False) -> None:
        """Each field in ``names`` must be > 0 (>= 0 with ``allow_zero``; None passes)."""
        for name in names:
            if getattr(self, name) is not None:
                check_positive(f"{self.section}.{name}", getattr(self, name), allow_zero=allow_zero)


RepeatSource = Literal["text", "random"]  # what train.repeats plants (RepeatsConfig.source)
RepeatPlace = Literal["uniform", "ends"]  # where train.repeats plants it (RepeatsConfig.place)


@dataclasses.dataclass(kw_only=True, frozen=True)
class RepeatsConfig(Section):
    """Planted repeats (``train.repeats``): about ``fraction`` of training windows carry a segment
    written twice, at [p, p+length) and again at [q, q+length) with q >= p + length, so a model can
    learn to retrieve (an induction/copy task, Olsson et al. 2022). ``source``: ``text``, the window's
    own text at p is copied to q; ``random``, ``length`` token ids drawn uniformly (special ids such as
    end-of-document excluded) are written at both p and q, so the second copy is predictable only by
    copying (a loss of ln V without it), the strongest incentive to learn it.

    A field of ``train:``, not ``data:``: it changes how training batches are drawn from the shards,
    not which data they are, so prepared data stays shared between runs with and without it, and
    validation windows never carry it (run/data/batches.py, ``plant_repeats``)."""

    section: ClassVar[str] = "train.repeats"
    fraction: float = 0.1  # share of training windows that carry one planted repeat
    length: int = 16  # tokens in the repeated segment
    # text: copy the window's own text (predictable in part from language statistics, a weak signal:
    # the positions model never learned it); random: uniform token ids, only copying predicts them
    source: RepeatSource = "text"
    # random only: draw from the first ``alphabet`` plantable ids (None: all of them). With all 2047 ids
    # of the positions experiment's vocabulary the copying circuit did not form in 3000 steps (its
    # output must learn an identity over every id); a small alphabet, like the digits of a passkey
    # (Mohtashami & Jaggi 2023, the retrieval test of Peng et al.'s YaRN), is learned in hundreds
    alphabet: int | None = added(None, since="the positions rerun's copy pilots p2-p4 (positions.yaml)")
    # uniform: the distance uniform over [length, T + 1 - length], then the offset; ends: the first copy
    # at the window's start and the second ending at its last input (distance T - length), where the
    # copy probe puts them (positions.copy_metrics), a passkey at a fixed depth. At the positions size
    # no copier formed at uniform distances in 500-600 steps; at the ends it did (in-range copy accuracy
    # 0.57 at step 400, 0.92 at 500): a head that looks a fixed distance back needs no induction circuit
    # (a previous-token head, then a content match), so it forms sooner
    place: RepeatPlace = added("uniform", since="the positions rerun's copy pilot p4 (positions.yaml)")

    def validate(self) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"train.repeats.fraction={self.fraction!r} is out of range; it must be in (0, 1], "
                             "e.g. 0.1 (leave train.repeats unset for none)")
        if self.length < 2:
            raise ValueError(f"train.repeats.length={self.length} is too short; a repeat needs at least 2 tokens "
                             "(the first cues the copy), e.g. 16")
        if self.alphabet is not None and self.source != "random":
            raise ValueError(f"train.repeats.alphabet={self.alphabet} only applies to source=random (text repeats "
                             "copy the window's own tokens); set train.repeats.source=random or leave alphabet unset")
        if self.alphabet is not None and self.alphabet < 2:
            raise ValueError(f"train.repeats.alphabet={self.alphabet} is too small; a segment needs at least 2 ids "
                             "to draw from, e.g. 64")


@dataclasses.dataclass(kw_only=True, frozen=True)
class LookupConfig(Section):
    """Planted key-value lookups (``train.lookup``), a retrieval task written into training text: about
    ``fraction`` of training windows carry ``pairs`` pairs, each a key (one id of a ``keys``-id alphabet,
    distinct within the window) followed by its value (``value_length`` ids of a ``values``-id alphabet,
    disjoint from the keys), written one after another; later the window asks for them in ``queries``
    queries, each a pair's key again followed by its value, which only a lookup predicts. The first
    query's key stands ``distance`` tokens after its pair's key, uniform over [``min_distance``,
    ``max_distance``]. A passkey (Mohtashami & Jaggi 2023) is the one-pair case; several pairs make it
    associative recall (Ba et al. 2016; Arora et al. 2023's MQAR): a model that copies a value without
    matching its key scores 1/pairs. At d_model 64 and context 128, a passkey asked 16 times per window
    is learned in range in a few hundred steps, asked once not in 4,000, and matching among 2 or more
    pairs did not form in 4,000 (results/positions/pilot-retrieval-2026-12-06).

    A field of ``train:``, as ``train.repeats`` is (it changes batches, not data; validation windows never
    carry it); the measurement, which plants the same lookups in validation text at chosen distances, is
    ``experiments/retrieval.py``. Every field is ``added``: the section is newer than the first hashed runs."""

    section: ClassVar[str] = "train.lookup"
    _since: ClassVar[str] = "the positions rerun's retrieval task (issue 40)"
    fraction: float = added(1.0, since=_since)  # share of training windows that carry the pairs and a query
    pairs: int = added(4, since=_since)  # key-value pairs per window; the query asks for one, uniformly
    # queries per window, back to back, each asking another pair until all are asked, then again in a new
    # order (associative recall asks for them all, as MQAR does; more than pairs repeats them): more supervised
    # lookups per window. The distances bound the first; the measurement asks one
    queries: int = added(1, since=_since)
    value_length: int = added(2, since=_since)  # ids per value (the query's key cues them; all are scored)
    # alphabets: from the ``offset``-th plantable id on (data.batches.plantable_ids, increasing), ``keys`` ids
    # are keys and the next ``values`` are values, so a key never reads as a value; a small value alphabet is
    # a passkey's digits. The lowest ids of a byte-level BPE are ASCII punctuation, digits and capitals, 19%
    # of the stdlib corpus's tokens for the first 48; offset 128 starts at bytes 0x80.. (UTF-8 continuation
    # bytes the merges absorb: the next 64 ids are 0.01% of its tokens), symbols the text hardly uses
    keys: int = added(32, since=_since)
    values: int = added(16, since=_since)
    offset: int = added(0, since=_since)
    # None: the nearest that fits (pairs x (1 + value_length): the query right after the pairs) and the farthest
    # (seq_len + 1 - pairs x (1 + value_length): the pairs at the window's start, the query at its end)
    min_distance: int | None = added(None, since=_since)
    max_distance: int | None = added(None, since=_since)

    @property
    def pair_length(self) -> int:
        """Tokens of one pair, and of the query: a key and its value."""
        return 1 + self.value_length

    def distances(self, window: int) -> tuple[int, int]:
        """The (nearest, farthest) distance of the first query planted in windows of ``window`` tokens
        (seq_len + 1 in training); the farthest leaves room for the other queries."""
        block = self.pairs * self.pair_length
        return (self.min_distance if self.min_distance is not None else block,
                self.max_distance if self.max_distance is not None
                else window - block - (self.queries - 1) * self.pair_length)

    def validate(self) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"train.lookup.fraction={self.fraction!r} is out of range; it must be in (0, 1], "
                             "e.g. 1.0 (leave train.lookup unset for none)")
        self.positive("pairs", "queries", "value_length", "min_distance", "max_distance")
        self.positive("offset", allow_zero=True)
        if self.keys < self.pairs:
            raise ValueError(f"train.lookup.keys={self.keys} is fewer than train.lookup.pairs={self.pairs}; the keys "
                             f"of a window are distinct, so choose keys >= {self.pairs}")
        if self.values < 2:
            raise ValueError(f"train.lookup.values={self.values} is too small; a value needs at least 2 ids to "
                             "draw from, e.g. 16")
        block = self.pairs * self.pair_length
        if self.min_distance is not None and self.min_distance < block:
            raise ValueError(f"train.lookup.min_distance={self.min_distance} is nearer than the pairs allow: the "
                             f"query follows all {self.pairs} pairs of {self.pair_length} tokens, so choose "
                             f"min_distance >= {block}")
        lo, hi = self.min_distance or block, self.max_distance
        if hi is not None and hi < lo:
            raise ValueError(f"train.lookup.max_distance={hi} is below min_distance={lo}; choose max_distance >= {lo}")


@dataclasses.dataclass(kw_only=True, frozen=True)
class TrainConfig(Section):
    """What is trained, for how long and where. The defaults of all sections are the ``lmlab train``
    demo: a few minutes on a 2-core CPU."""

    section: ClassVar[str] = "train"
    steps: int = 1500  # optimizer steps
    batch_size: int = 16  # sequences per micro-batch, on each process
    seq_len: int | None = None  # tokens per sequence; None = model.max_seq_len
    grad_accum: int = 1  # micro-batches per step over all processes: global batch = batch_size * grad_accum
    seed: int = 0  # data order and dropout; weights are seeded by model.init_seed
    device: str = "auto"  # auto = cuda if available, else cpu; or cpu, cuda, cuda:1, mps
    compile: bool = (
        False  # torch.compile each block, fullgraph (run/parallel/compile.py; slow to start, worth it on GPUs)
    )
    max_bad_steps: int = 5  # stop after this many consecutive steps with a non-finite loss or gradient
    init_from: str | None = None  # start from these weights: an lmlab run, a checkpoint, or a Hugging Face checkpoint
    max_memory_gib: float | None = None  # refuse to start a run estimated to need more; None = the device's memory
    repeats: RepeatsConfig | None = None  # plant repeated segments in training windows; None = the text as it is
    # plant key-value lookups in training windows (a retrieval task); None = none
    lookup: LookupConfig | None = added(None, since="the positions rerun's retrieval task (issue 40)")

    def validate(self) -> None:
        self.positive("steps", "batch_size", "grad_accum", "max_bad_steps", "seq_len", "max_memory_gib")
        self.positive("seed", allow_zero=True)  # a seed is mixed as unsigned (trainer.mixed_seed)
        if self.init_from is not None and not self.init_from.strip():
            raise ValueError(
                "train.init_from='' is not valid; name a run, a checkpoint or a Hugging Face directory, "
                "or leave it unset"
            )
        try:
            if self.device != "auto":
                import torch  # here, not at the top: the config (and `lmlab train --help`) loads without torch

                torch.device(self.device)
        except RuntimeError:
            raise ValueError(
                f"train.device={self.device!r} is not a device; use auto, cpu, cuda, cuda:N or mps"
            ) from None


OptimizerName = Literal["adamw", "muon"]  # run/optim.py: build_optimizer
MuonScaling = Literal["original", "match_rms_adamw"]  # torch.optim.Muon's adjust_lr_fn
_MUON = "Muon (torch.optim.Muon) for the hidden matrices"


@dataclasses.dataclass(kw_only=True, frozen=True)
class MuonConfig(Section):
    """Muon's settings (``optim.muon``, used with ``optim.name=muon``): momentum SGD whose update of
    each hidden matrix is orthogonalized by Newton-Schulz iterations (Jordan et al. 2024;
    ``torch.optim.Muon``). The other parameters (embeddings, head, norms, biases, routers, gates) keep
    AdamW with the optim fields. Muon's rate follows the same warmup and cosine schedule, in
    proportion: lr x (the schedule's rate / optim.lr) (run/optim.py)."""

    section: ClassVar[str] = "optim.muon"
    lr: float = added(0.02, since=_MUON)  # peak rate of the hidden matrices (Keller Jordan's Muon default)
    momentum: float = added(0.95, since=_MUON)
    nesterov: bool = added(True, since=_MUON)
    weight_decay: float = added(0.0, since=_MUON)  # decoupled: every step multiplies by 1 - lr * weight_decay
    ns_steps: int = added(5, since=_MUON)  # Newton-Schulz iterations (torch's default quintic)
    # original: the step of an out x in matrix times sqrt(max(1, out/in)) (Jordan's; a width-independent
    # spectral norm, what μP needs); match_rms_adamw: times 0.2 sqrt(max(out, in)), the RMS of an AdamW
    # step, so that AdamW's rate and decay carry over (Liu et al. 2025, Moonlight, arXiv:2502.16982)
    adjust_lr: MuonScaling = added("original", since=_MUON)

    def validate(self) -> None:
        self.positive("lr")
        self.positive("weight_decay", allow_zero=True)
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"optim.muon.momentum={self.momentum!r} is out of range; it must be in [0, 1), "
                             "e.g. 0.95")
        if not 1 <= self.ns_steps <= 99:  # torch refuses 100 and more
            raise ValueError(f"optim.muon.ns_steps={self.ns_steps!r} is out of range; it must be in [1, 99], "
                             "e.g. 5")


@dataclasses.dataclass(kw_only=True, frozen=True)
class OptimConfig(Section):
    """The optimizer (AdamW, or Muon for the hidden matrices with AdamW for the rest) and its
    schedule: linear warmup, then cosine decay to ``min_lr`` at the last step (run/optim.py)."""

    section: ClassVar[str] = "optim"
    # adamw: every parameter; muon: Muon for the hidden matrices (optim.muon), AdamW (below) for the rest
    name: OptimizerName = added("adamw", since=_MUON)
    lr: float = 2e-3  # peak learning rate; small models tolerate a high one
    min_lr: float | None = None  # cosine decay ends here; None = lr / 10 (as in Chinchilla)
    warmup_steps: int = 100  # linear warmup from lr / warmup_steps
    weight_decay: float = 0.1  # AdamW decoupled decay; matrices only, never norms, biases or embeddings
    betas: tuple[float, ...] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 = no clipping
    muon: MuonConfig | None = added(None, since=_MUON)  # Muon's settings under name=muon (its defaults if unset)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.name == "muon" and self.muon is None:  # explicit in the saved config
            object.__setattr__(self, "muon", MuonConfig())

    def _editable_dict(self) -> dict[str, Any]:
        data = super()._editable_dict()
        if data["muon"] == MuonConfig()._editable_dict():  # resolved again: name may change
            data["muon"] = None
        return data

    def validate(self) -> None:
        self.positive("lr", "eps")
        self.positive("warmup_steps", "weight_decay", "grad_clip", "min_lr", allow_zero=True)
        if self.min_lr is not None and self.min_lr > self.lr:
            raise ValueError(f"optim.min_lr={self.min_lr} is above optim.lr={self.lr}; choose min_lr <= lr")
        if len(self.betas) != 2:
            raise ValueError(f"optim.betas={list(self.betas)} is not valid; give two numbers, e.g. 0.9,0.95")
        for i, b in enumerate(self.betas):
            check_range(f"optim.betas[{i}]", b, 0.0, 0.9999)
        if self.name != "muon" and self.muon is not None:
            raise ValueError(f"optim.muon sets Muon, and optim.name={self.name!r}; set optim.name=muon, or leave "
                             "optim.muon unset")


@dataclasses.dataclass(kw_only=True, frozen=True)
class EvalConfig(Section):
    """Validation passes during training (at the last step too)."""

    section: ClassVar[str] = "eval"
    every: int = 250  # steps between validation passes
    batches: int = 20  # validation batches of train.batch_size sequences per pass
    windows: Literal["first", "spread"] = "first"  # the split's first windows, or as many spread evenly over it
    # lm-evaluation-harness tasks run at each validation pass (run/eval_harness.py): task YAML files (data on
    # disk) or names of the harness's tasks whose data is in the Hugging Face cache; nothing is downloaded
    tasks: tuple[str, ...] = added((), since="downstream evaluations while training: lm-evaluation-harness")
    task_limit: int | None = added(None, since="downstream evaluations while training")  # documents per task; None: all

    def validate(self) -> None:
        self.positive("every", "batches", "task_limit")
        for i, task in enumerate(self.tasks):
            if not task.strip():
                raise ValueError(f"eval.tasks[{i}] is empty; name a task YAML file or a task lm-evaluation-harness "
                                 "ships")
            if task in self.tasks[:i]:
                raise ValueError(f"eval.tasks names {task!r} twice; name each task once")


@dataclasses.dataclass(kw_only=True, frozen=True)
class CheckpointConfig(Section):
    """When checkpoints are written, how many are kept, and whether training waits for them."""

    section: ClassVar[str] = "checkpoint"
    every: int = 500  # steps between checkpoints (also at a new best, the last step and on a signal)
    keep_last: int = 2  # newest checkpoints kept, besides the best
    mode: SaveMode = "sync"  # async: sharded (DCP) checkpoints are written while training goes on

    def validate(self) -> None:
        self.positive("every", "keep_last")


@dataclasses.dataclass(kw_only=True, frozen=True)
class LogConfig(Section):
    """What a run records and prints: metrics.jsonl, samples of text, and the trackers that mirror them."""

    section: ClassVar[str] = "log"
    every: int = 10  # steps between metrics.jsonl records
    # each an optional extra (pip install 'lmlab[wandb]'), refused at the start when not installed; [] = none.
    # None: tensorboard when it is installed (a note when not), as before log.trackers existed
    trackers: tuple[TrackerName, ...] | None = None
    tensorboard: bool = True  # the switch before log.trackers: false = no TensorBoard while log.trackers is None
    sample_every: int = 0  # steps between printed samples; 0 = only at the end
    sample_tokens: int = 200  # tokens per sample
    sample_prompt: str = "The "

    def validate(self) -> None:
        self.positive("every")
        self.positive("sample_every", "sample_tokens", allow_zero=True)
        if self.trackers is not None:
            twice = [t for i, t in enumerate(self.trackers) if t in self.trackers[:i]]
            if twice:
                raise ValueError(f"log.trackers names {twice[0]} twice; name each tracker once")
            if not self.tensorboard and "tensorboard" in self.trackers:
                raise ValueError("log.tensorboard=false and log.trackers names tensorboard; drop log.tensorboard "
                                 "(log.trackers replaces it)")

    def tracker_names(self) -> tuple[tuple[str, ...], bool]:
        """(the trackers this run writes to, whether each must be installed): log.trackers as given,
        required; or when it is None, tensorboard if log.tensorboard, only when installed."""
        if self.trackers is not None:
            return tuple(self.trackers), True
        return ("tensorboard",) if self.tensorboard else (), False


@dataclasses.dataclass(kw_only=True, frozen=True)
class ParallelConfig(Section):
    """Several processes under torchrun (docs/distributed.md); applied by run/parallel/plan.py."""

    section: ClassVar[str] = "parallel"
    strategy: Strategy = "ddp"  # ddp: every process holds the whole model; fsdp: params, grads, AdamW state sharded
    experts: int = 1  # N > 1: each group of N processes splits every MoE layer's routed experts N ways
    activation_checkpointing: ActivationCheckpointing = "none"  # blocks: recompute block activations in backward
    activation_checkpoint_every: int = 1  # with blocks: checkpoint every k-th block (1 = all of them)
    collective_timeout: float = 600.0  # seconds a process waits for the others in training before it gives up
    setup_timeout: float = 3600.0  # the same before the first step, while rank 0 prepares the data

    def validate(self) -> None:
        self.positive("experts", "activation_checkpoint_every", "collective_timeout", "setup_timeout")


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
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)

    def validate(self) -> None:
        if self.train.seq_len is not None and self.train.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"train.seq_len={self.train.seq_len} is longer than model.max_seq_len={self.model.max_seq_len}, "
                "the model's training context; raise model.max_seq_len or lower train.seq_len"
            )
        mtp = self.model.mtp
        if mtp is not None and mtp.depth >= self.seq_len:  # module k's targets lie k + 1 ahead in the window
            raise ValueError(f"model.mtp.depth={mtp.depth} leaves module {mtp.depth} no target in a window of "
                             f"train.seq_len={self.seq_len} tokens; choose mtp.depth at most {self.seq_len - 1}")
        if self.eval.tasks and self.task != "lm":
            raise ValueError(f"eval.tasks scores a language model's text; task={self.task!r} trains a classifier, "
                             "leave eval.tasks empty")
        r = self.train.repeats
        if r is not None and self.task != "lm":
            raise ValueError(f"train.repeats plants repeats in a token stream; task={self.task!r} trains on rows, "
                             "leave train.repeats unset")
        if r is not None and 2 * r.length > self.seq_len + 1:
            raise ValueError(f"train.repeats.length={r.length} does not fit twice in a window of seq_len + 1 = "
                             f"{self.seq_len + 1} tokens; choose length <= {(self.seq_len + 1) // 2}")
        self._check_lookup()
        n = self.parallel.experts
        if n > 1:
            if self.model.moe is None:
                raise ValueError(f"parallel.experts={n} needs a mixture-of-experts model (model.moe); "
                                 "set parallel.experts=1 for a dense model")
            experts = self.model.moe.routed_experts
            if experts % n:
                raise ValueError(f"parallel.experts={n} does not divide the {experts} routed experts of each MoE "
                                 f"layer; choose parallel.experts in {[d for d in divisors(experts) if d > 1]}")
        muon = self.optim.muon
        if muon is not None and muon.adjust_lr == "match_rms_adamw" and self.model.parametrization == "mup":
            raise ValueError("optim.muon.adjust_lr=match_rms_adamw scales each matrix's step by 0.2 sqrt(max(out, "
                             "in)), which grows with width, so a rate tuned at μP's base would not transfer; use "
                             "optim.muon.adjust_lr=original with model.parametrization=mup")
        if self.checkpoint.mode == "async" and self.parallel.strategy == "ddp" and n == 1:
            raise ValueError("checkpoint.mode=async writes sharded (DCP) checkpoints, which parallel.strategy=fsdp or "
                             "parallel.experts > 1 use; set checkpoint.mode=sync under ddp")

    def _check_lookup(self) -> None:
        """train.lookup against the run: a token stream, no planted repeats beside it, and room in a window."""
        lk = self.train.lookup
        if lk is None:
            return
        if self.task != "lm":
            raise ValueError(f"train.lookup plants lookups in a token stream; task={self.task!r} trains on rows, "
                             "leave train.lookup unset")
        if self.train.repeats is not None:
            raise ValueError("train.lookup and train.repeats both plant into the same windows and would overwrite "
                             "each other; set one of them")
        W, P = self.seq_len + 1, lk.pair_length
        lo, hi = lk.distances(W)
        most = W - (lk.pairs + lk.queries - 1) * P
        if max(lo, hi) > most:
            raise ValueError(f"train.lookup does not fit a window of seq_len + 1 = {W} tokens: {lk.pairs} pairs and "
                             f"{lk.queries} queries of {P} tokens, the first query {lo}-{hi} tokens after its pair, "
                             f"need distances <= {most}; lower max_distance (or pairs, queries, value_length), "
                             "or raise seq_len")
        if lk.offset + lk.keys + lk.values >= self.model.vocab_size:
            raise ValueError(f"train.lookup.offset + keys + values = {lk.offset + lk.keys + lk.values} ids do not "
                             f"fit a vocabulary of {self.model.vocab_size} (one id at least ends documents); "
                             "choose fewer")

    def override(self, changes: Mapping[str, Any]) -> "RunConfig":
        """A copy with dotted overrides applied; the old keys (``train.lr``) are read as their new ones."""
        return super().override(upgrade_keys(changes, "the overrides"))

    @property
    def seq_len(self) -> int:
        return self.train.seq_len or self.model.max_seq_len


def sections() -> str:
    """The run config's sections, for messages: "task:, model:, data:, train:, optim:, ..."."""
    return ", ".join(f"{name}:" for name in RunConfig.field_names())


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
    given twice (``lr:`` twice under ``optim:``, both ``optim: {lr: ..}`` and ``optim.lr:``, or the old
    ``train.lr`` and ``optim.lr``) is refused. Old keys are read as their new ones, with a note."""
    changes: dict[str, Any] = {}
    resolved = False
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file {str(p)!r} does not exist")
        data = read_yaml(p, f"config file {str(p)!r}")
        if data is None:
            raise ValueError(f"config file {str(p)!r} is empty; give at least one of {sections()}")
        if not isinstance(data, dict):
            raise ValueError(f"config file {str(p)!r} must be a mapping with sections {sections()}")
        resolved = data.get("provenance") is not None
        changes.update(config_changes(data, f"config file {str(p)!r}"))
    changes.update(upgrade_keys(overrides or {}, "the overrides"))  # after the file's: an override wins
    return build_config(changes, resolved=resolved)


def config_changes(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The dotted changes a run config mapping asks for, for :func:`build_config`: nested sections
    flattened (``{"model": {"d_model": 64}}`` -> ``{"model.d_model": 64}``; ``model.preset`` stays a
    change), ``data: DIR`` read as ``data.prepared``, and a run's ``provenance`` record dropped. The
    one reading of a config: ``train --config`` and a sweep's ``base:`` and variants all use it.
    A field given twice (nested and dotted, or under its old and new name) is refused, naming
    ``source``; old keys (``train.lr``) are read as their new ones (``optim.lr``), with a note."""
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
    return upgrade_keys(flatten(data), source)


def build_config(changes: Mapping[str, Any], *, resolved: bool = False) -> RunConfig:
    """A RunConfig from dotted ``changes`` on the defaults. ``model.preset`` (a name in
    ``lmlab.PRESETS``) or ``train.init_from`` (its weights' config) replaces the demo model as the
    starting point of the model section; the other ``model.*`` changes apply on top of it.
    ``resolved``: the changes are a run's saved config, whose model needs no starting point.
    Old keys (``train.lr``) are read as their new ones (``optim.lr``), with a note."""
    changes = upgrade_keys(changes, "the config")
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


def differing_fields(configs: Sequence[RunConfig]) -> dict[str, list[Any]]:
    """:func:`config_diff` for any number of runs: {dotted field: its value in each config} for the
    fields whose values are not all the same."""
    flat = [flatten(c.to_dict()) for c in configs]
    keys = sorted(set().union(*flat)) if flat else []
    return {k: [f.get(k) for f in flat] for k in keys if len({repr(f.get(k)) for f in flat}) > 1}


# ============================================================== the old keys, read for one release
# Until the config had a section per concern, ``train:`` held the optimizer, the schedule, evaluation,
# checkpointing, logging, sampling and parallelism. RENAMED is the one table from each old dotted key
# to its new one; upgrade_keys applies it wherever a config is read (YAML files, a run's saved
# config.yaml, --section.field overrides, sweep specs), printing one line per read that names each
# old key and its new one (each key once per process). Delete this part, and the calls to
# upgrade_keys, when the old keys go.
RENAMED = {  # old dotted key -> new dotted key
    "train.lr": "optim.lr",
    "train.min_lr": "optim.min_lr",
    "train.warmup_steps": "optim.warmup_steps",
    "train.weight_decay": "optim.weight_decay",
    "train.betas": "optim.betas",
    "train.eps": "optim.eps",
    "train.grad_clip": "optim.grad_clip",
    "train.eval_every": "eval.every",
    "train.eval_batches": "eval.batches",
    "train.save_every": "checkpoint.every",
    "train.keep_last": "checkpoint.keep_last",
    "train.save_mode": "checkpoint.mode",
    "train.log_every": "log.every",
    "train.tensorboard": "log.tensorboard",
    "train.sample_every": "log.sample_every",
    "train.sample_tokens": "log.sample_tokens",
    "train.sample_prompt": "log.sample_prompt",
    "train.parallel": "parallel.strategy",
    "train.expert_parallel": "parallel.experts",
    "train.activation_checkpointing": "parallel.activation_checkpointing",
    "train.activation_checkpoint_every": "parallel.activation_checkpoint_every",
    "train.collective_timeout": "parallel.collective_timeout",
    "train.setup_timeout": "parallel.setup_timeout",
}

NOTED: set[str] = set()  # old keys already noted by this process


def renamed(key: str) -> str:
    """The current name of dotted ``key`` (itself unless it is an old one)."""
    return RENAMED.get(key, key)


def upgrade_keys(changes: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A copy of ``changes`` with each old key renamed to its new one (order kept). ``where`` names
    the source in the note and the error, e.g. "config file 'run.yaml'". A field given under both
    names is refused: ValueError naming both."""
    old = [k for k in changes if k in RENAMED]
    for key in old:
        if RENAMED[key] in changes:
            raise ValueError(f"{where}: {key!r} and {RENAMED[key]!r} are the same field given twice ({key} is its "
                             f"old name); keep {RENAMED[key]}")
    _note([k for k in old if k not in NOTED], where)
    return {renamed(k): v for k, v in changes.items()}


def _note(keys: list[str], where: str) -> None:
    """One line on stderr for ``keys`` (rank 0 only under torchrun); each key is noted once per process."""
    if not keys:
        return
    NOTED.update(keys)
    if os.environ.get("RANK", "0") == "0":
        pairs = ", ".join(f"{k} -> {RENAMED[k]}" for k in keys)
        print(f"lmlab: note: old config keys in {where}, read as the new ones in this release only; rename them: "
              f"{pairs}", file=sys.stderr)


def one_section_dict(config: Mapping[str, Any]) -> dict[str, Any]:
    """A new-layout config dict (``RunConfig.to_dict()``) in the old one-section layout: the renamed
    fields back under ``train:`` by their old names. Sweeps hash this form, so that results they
    recorded before the sections were split still count as the same runs."""
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in config.items()}
    sections = {new.split(".")[0] for new in RENAMED.values()}
    for old, new in RENAMED.items():
        section, field = new.split(".")
        out["train"][old.split(".")[1]] = out[section][field]
    return {k: v for k, v in out.items() if k not in sections}
