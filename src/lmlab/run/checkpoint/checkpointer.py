"""The Checkpointer: one run's checkpoints (save, resume, prune, the best one), whatever their layout.

    checkpointer = build_checkpointer("local", run.checkpoints, model, optimizer, plan, dist, keep_last=3, ...)
    state = checkpointer.load_latest()            # a TrainState: step 0 when there is no checkpoint yet
    checkpointer.save(TrainState(step=200, ...), best=True)
    checkpointer.best                             # Best(step=200, val_loss=1.83), or None

The writer is chosen once, at construction, from the run's layout (:data:`CHECKPOINTERS`):

- ``local``: one process (rank 0) writes model.safetensors and state.pt (local.py); plain and DDP runs;
- ``sharded``: every process writes its shards with DCP, and rank 0 state.pt (sharded.py); FSDP and
  expert-parallel runs.

Reading is by what is on disk, not by who reads: either checkpointer resumes a checkpoint of either
layout, on any number of processes (:func:`sharded.load_into` reshards). Resume is one path,
:meth:`Checkpointer.load_latest`: the weights, the optimizer's state through its own state dict (DCP's
``set_state_dict`` when resharding), the optimizer's hyper-parameters from the run's config
(:func:`optim.apply_hyperparameters`: the config wins, a changed value is noted), the counters as a
validated :class:`TrainState`, and best.json checked (and pointed at the best step again after a crash
between a checkpoint and its best.json). Files are written atomically and read without running
pickled code (safetensors, ``torch.load(weights_only=True)``, DCP's index through a safe unpickler).
"""

from __future__ import annotations

import abc
import dataclasses
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..errors import CorruptFile
from ..optim import apply_hyperparameters, hyperparameters
from ..parallel.group import Dist
from ..parallel.plan import Parallel
from . import local as ckpt
from . import sharded


# ============================================================== the training state
@dataclasses.dataclass(frozen=True)
class TrainState:
    """How far a run got: the counters of a checkpoint's state.pt. No RNG state: every random draw
    of step s is seeded from (seed, s, j) (trainer.py), so the step alone resumes a run exactly.

    state.pt holds these fields plus, by layout, ``optimizer`` (local: the optimizer's state dict;
    sharded: it is in dcp/) or ``model_config`` (sharded: local keeps it in the safetensors metadata)."""

    step: int = 0  # optimizer steps done
    skipped_steps: int = 0  # steps skipped for a non-finite loss or gradient
    tokens: int = 0  # training tokens processed, all processes
    best_val: float | None = None  # the best validation loss so far
    best_step: int | None = None  # the step that gave it (absent from checkpoints older than the field)

    def to_dict(self) -> dict[str, Any]:
        """The fields as state.pt stores them."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: Path, *, also: Sequence[str] = ()) -> "TrainState":
        """The state in ``raw`` (state.pt's contents, file ``where``), or CorruptFile naming the first
        problem: a missing key (``also`` names the layout's own, such as "optimizer") or a mistyped value."""
        missing = [k for k in ("step", *also, "skipped_steps", "tokens", "best_val") if k not in raw]
        if missing:
            raise CorruptFile(f"checkpoint state {str(where)!r} lacks {missing}: it is not lmlab's training state; "
                              f"{ckpt.REMEDY}")
        fields = {f.name: raw.get(f.name) for f in dataclasses.fields(cls)}
        for key, value in fields.items():
            what, ok = ("a number", _is_number) if key == "best_val" else ("a whole number", _is_whole)
            if not (ok(value) or (value is None and key in ("best_val", "best_step"))):
                raise CorruptFile(f"checkpoint state {str(where)!r} has {key}={value!r}, which is not {what}; "
                                  f"{ckpt.REMEDY}")
        state = cls(**fields)
        named = ckpt.step_of(where.parent)
        if named is not None and named != state.step:
            raise CorruptFile(f"checkpoint state {str(where)!r} is at step {state.step}, but its directory says step "
                              f"{named}: it belongs to another checkpoint; {ckpt.REMEDY}")
        return state


def optimizer_name(groups: Sequence[dict[str, Any]]) -> str:
    """``optim.name`` of an optimizer, from its parameter groups (live or saved): Muon's carry ``ns_steps``."""
    return "muon" if any("ns_steps" in g for g in groups) else "adamw"


def check_optimizer_state(saved: Any, optimizer: torch.optim.Optimizer, step: int, where: Path) -> None:
    """CorruptFile naming the first way ``saved`` (state.pt's optimizer state dict, file ``where``,
    checkpoint ``step``) does not fit ``optimizer``: groups of other sizes, a moment whose shape is not
    its parameter's, a step counter past the checkpoint's. torch's own ``load_state_dict`` checks only
    the group sizes, and a moment of another shape fails (or broadcasts) later, inside a step."""
    def bad(what: str) -> CorruptFile:
        return CorruptFile(f"checkpoint state {str(where)!r}: {what}; it is damaged or from another run; "
                           f"{ckpt.REMEDY}")

    groups, state = (saved.get("param_groups"), saved.get("state")) if isinstance(saved, dict) else (None, None)
    if not (isinstance(groups, list) and isinstance(state, dict)
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)):
        raise bad("its optimizer entry is not an optimizer's state dict")
    theirs, ours = optimizer_name(groups), optimizer_name(optimizer.param_groups)
    if theirs != ours:  # a changed optim.name, not a damaged file
        raise ValueError(f"optim.name: the checkpoint in {str(where.parent)!r} was trained with {theirs}, this run "
                         f"asks for {ours}; resume with --optim.name {theirs}, or start a new run from its weights "
                         f"with --train.init_from {str(where.parent)!r}")
    sizes, ours = [len(g["params"]) for g in groups], [len(g["params"]) for g in optimizer.param_groups]
    if sizes != ours:
        raise bad(f"its optimizer has parameter groups of {sizes} tensors, this model's {ours}")
    params = [(p, name) for g in optimizer.param_groups
              for p, name in zip(g["params"], g.get("names") or [f"#{i}" for i in range(len(g["params"]))])]
    by_id = dict(zip([i for g in groups for i in g["params"]], params))
    for i, entry in state.items():
        if i not in by_id or not isinstance(entry, dict):
            raise bad(f"its optimizer state has an entry {i!r} for no parameter")
        param, name = by_id[i]
        for key, value in entry.items():
            if key == "step":
                count = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
                if not (_is_number(count) and 0 <= count <= step and float(count).is_integer()):
                    raise bad(f"the optimizer's step counter for {name!r} is {count!r}, but the checkpoint is at step "
                              f"{step}")
            elif isinstance(value, torch.Tensor) and value.shape != param.shape:
                raise bad(f"the optimizer's {key} for {name!r} has shape {tuple(value.shape)}, but the parameter "
                          f"{tuple(param.shape)}")


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ============================================================== the component
class Checkpointer(abc.ABC):
    """A run's checkpoints under ``root`` (its checkpoints/ directory) for ``model`` and ``optimizer``,
    laid out by ``plan``. :meth:`save` is called by every process that takes part in a save (rank 0;
    every rank when sharded), :meth:`load_latest` by every process; rank 0 alone prunes and writes
    best.json. ``say`` prints a note (rank 0's console)."""

    def __init__(self, root: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, plan: Parallel,
                 dist: Dist, *, keep_last: int, model_config: dict[str, Any], save_mode: str = "sync",
                 say: Callable[[str], None] = lambda message: None):
        self.root = Path(root)
        self.model, self.optimizer, self.plan, self.dist = model, optimizer, plan, dist
        self.keep_last, self.model_config, self.save_mode, self.say = keep_last, model_config, save_mode, say
        self.latest: Path | None = None  # the last checkpoint written or resumed from

    # ---- the layout's own
    @abc.abstractmethod
    def write(self, state: TrainState) -> Path:
        """Write checkpoint ``state.step`` (an existing one is kept as is); return its directory."""

    @abc.abstractmethod
    def restore(self, path: Path) -> TrainState:
        """Load checkpoint ``path`` into the model and the optimizer (its state dict, saved
        hyper-parameters included); return its counters."""

    def finish(self) -> None:
        """Wait for a checkpoint still being written in the background, and put it in place."""

    # ---- shared by both
    @property
    def best(self) -> ckpt.Best | None:
        """The best checkpoint's record (best.json), None before the first evaluation."""
        return ckpt.Best.read(self.root)

    def save(self, state: TrainState, *, best: bool = False) -> Path:
        """Checkpoint ``state.step``; ``best``: it is the best so far (best.json points at it). Then
        rank 0 prunes to keep_last plus the best."""
        self.latest = self.write(state)
        if self.dist.main:
            if best:
                ckpt.Best(state.step, state.best_val).write(self.root)
            self.prune()
        return self.latest

    def prune(self) -> list[int]:
        """Delete all but the newest keep_last checkpoints and the best one; return the deleted steps."""
        return ckpt.prune(self.root, self.keep_last)

    def load_latest(self) -> TrainState:
        """Resume from the newest checkpoint (see the module docstring); a fresh TrainState if there is none."""
        found = ckpt.list_checkpoints(self.root)
        if not found:
            self.say(f"no checkpoint in {self.root} yet; starting from step 0")
            return TrainState()
        step, path = found[-1]
        config = hyperparameters(self.optimizer)  # as built from the run's config; restoring replaces them
        state = self.restore(path)
        for note in apply_hyperparameters(self.optimizer, config):
            self.say(f"note: {note}")
        best = self.best  # a damaged best.json is refused now, not at the first save
        lost = state.best_step is not None and (best is None or best.step != state.best_step)
        if self.dist.main and lost and ckpt.step_dir(self.root, state.best_step).is_dir():
            ckpt.Best(state.best_step, state.best_val).write(self.root)  # a crash between a checkpoint and best.json
        self.latest = path
        self.say(f"resumed from {path} (step {step})")
        return state

    def reshard(self, path: Path) -> TrainState:
        """Load checkpoint ``path``, of either layout, into this run's layout through DCP (every
        process calls it)."""
        return TrainState.from_dict(sharded.load_into(path, self.model, self.optimizer, self.plan), path / ckpt.STATE)


class LocalCheckpointer(Checkpointer):
    """One process writes each checkpoint: model.safetensors and state.pt, which holds the
    optimizer's state dict (local.py). Saves are synchronous."""

    def write(self, state: TrainState) -> Path:
        payload = {**state.to_dict(), "optimizer": self.optimizer.state_dict()}
        return ckpt.save_checkpoint(self.root, state.step, self.model, payload, self.model_config)

    def restore(self, path: Path) -> TrainState:
        if sharded.is_distributed(path):  # written by a sharded run
            return self.reshard(path)
        ckpt.load_weights(self.model, path / ckpt.WEIGHTS)
        raw = ckpt.load_state(path)
        state = TrainState.from_dict(raw, path / ckpt.STATE, also=("optimizer",))
        check_optimizer_state(raw["optimizer"], self.optimizer, state.step, path / ckpt.STATE)
        self.optimizer.load_state_dict(raw["optimizer"])
        return state


class ShardedCheckpointer(Checkpointer):
    """Every process writes its shards of the model and optimizer with DCP; rank 0 adds state.pt
    (sharded.py). ``save_mode="async"`` writes in the background: a checkpoint appears at the next
    save or at :meth:`finish`."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.saver = sharded.ShardedSaver(self.plan, self.dist, self.save_mode)

    def write(self, state: TrainState) -> Path:
        return self.saver.save(self.root, state.step, self.model, self.optimizer, state.to_dict(), self.model_config)

    def restore(self, path: Path) -> TrainState:
        return self.reshard(path)

    def finish(self) -> None:
        self.saver.finish()


CHECKPOINTERS: dict[str, type[Checkpointer]] = {"local": LocalCheckpointer, "sharded": ShardedCheckpointer}


def layout_of(plan: Parallel) -> str:
    """The checkpoint layout of a run laid out by ``plan``: sharded when a forward needs every process."""
    return "sharded" if plan.sharded else "local"


def build_checkpointer(layout: str, root: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                       plan: Parallel, dist: Dist, **options: Any) -> Checkpointer:
    """The :data:`CHECKPOINTERS` entry for ``layout``; ``options`` as :class:`Checkpointer` takes them."""
    if layout not in CHECKPOINTERS:
        raise ValueError(f"checkpoint layout {layout!r} is not one of {sorted(CHECKPOINTERS)}")
    return CHECKPOINTERS[layout](root, model, optimizer, plan, dist, **options)
