"""The run config's old keys, read for one release: ``train.lr`` is now ``optim.lr``, and so on.

Until the config had a section per concern, ``train:`` held the optimizer, the schedule,
evaluation, checkpointing, logging, sampling and parallelism. :data:`RENAMED` is the one table
from each old dotted key to its new one; :func:`upgrade_keys` applies it to dotted changes
wherever a config is read (YAML files, a run's saved config.yaml, ``--section.field`` overrides,
sweep specs), printing one note per read that names each old key and its new one (each key once
per process). Giving a key under both names is refused. Delete this module, and its callers'
lines, when the old keys go.

    upgrade_keys({"train.lr": 1e-3, "train.steps": 10}, "config file 'run.yaml'")
    # -> {"optim.lr": 1e-3, "train.steps": 10}, and on stderr:
    # lmlab: note: old config keys in config file 'run.yaml', read as the new ones in this release only;
    #   rename them: train.lr -> optim.lr          (one line)
"""

from __future__ import annotations

import os
import sys
from typing import Any, Mapping

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
    """``changes`` with each old key renamed to its new one, in place (order kept). ``where`` names
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
