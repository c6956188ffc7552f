"""Reading a run back: its config, a checkpoint's model and its tokenizer (metrics: ``metrics.read_metrics``).

    run = load_run("runs/default", checkpoint="best")            # or a Hugging Face checkpoint directory
    run.model, run.tokenizer, run.config, run.checkpoint
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

import torch

from ..hf import from_hf
from ..memory import check_fits, loading_memory
from ..model import Transformer
from .checkpoint import local as ckpt
from .checkpoint.directory import CHECKPOINTS, CONFIG_FILE
from .config import RunConfig, load_config
from .data.config import run_data_dir
from .data.meta import DataMeta
from .data.tokenizer import HF_FILE, load_tokenizer, tokenizer_from_path
from .tasks import TASKS


@dataclasses.dataclass
class LoadedRun:
    model: torch.nn.Module  # a Transformer (or a run's SequenceClassifier), in eval mode, on the requested device
    tokenizer: Any  # encode(str) -> list[int], decode(ids) -> str, vocab_size, eos_id
    config: RunConfig | None  # None for a Hugging Face directory
    checkpoint: Path  # the checkpoint directory (or the Hugging Face directory)
    step: int | None  # optimizer steps behind these weights, where known
    data_dir: Path | None  # the run's prepared data


def is_hf_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / "config.json").is_file() and not (p / CONFIG_FILE).is_file()


def load_run(
    path: str | Path, *, checkpoint: str | int = "best", overrides: Mapping[str, Any] | None = None,
    device: str | torch.device = "cpu", tokenizer: str | Path | None = None, require_tokenizer: bool = True,
) -> LoadedRun:
    """Load a run directory's model at ``checkpoint`` ("best", "latest" or a step), with dotted
    config ``overrides`` such as ``{"model.rope.scaling": "yarn", "model.rope.factor": 4}``;
    or a Hugging Face checkpoint directory (config.json + safetensors + tokenizer.json) via ``from_hf``.
    A classification run's model is its ``SequenceClassifier``. ``tokenizer``: use this one (a
    tokenizer.json, a directory holding one, or prepared data) instead of the run's own; without
    ``require_tokenizer``, a Hugging Face directory with no tokenizer.json loads with tokenizer None."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"run directory {str(path)!r} does not exist")
    if is_hf_dir(path):
        return _load_hf(path, overrides, device, tokenizer, require_tokenizer)
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(
            f"{str(path)!r} is neither a run directory (no {CONFIG_FILE}) "
            "nor a Hugging Face checkpoint (no config.json)"
        )
    cfg = load_config(path / CONFIG_FILE, overrides)
    where = ckpt.resolve(path / CHECKPOINTS, checkpoint)
    ckpt.require_weights(where, path)
    check_fits(lambda n: loading_memory(cfg.model, parameters=n), cfg.model, torch.device(device),
               what=f"the model of {str(path)!r}", fix="check its config (and any --model.* overrides)")
    data_dir = run_data_dir(path, cfg.data)
    meta = DataMeta.read(data_dir) if cfg.task != "lm" else None
    if cfg.task != "lm" and meta is None:
        raise ValueError(f"the classifier's data {str(data_dir)!r} is missing; its meta.json names the classes")
    model = TASKS[cfg.task]().build_model(cfg.model, meta)
    ckpt.load_weights(model, where / ckpt.WEIGHTS)
    tok = tokenizer_from_path(tokenizer) if tokenizer is not None else load_tokenizer(data_dir)
    _check_vocab(tok, model, tokenizer)
    step = int(where.name.split("_")[-1])
    return LoadedRun(model.to(device).eval(), tok, cfg, where, step, data_dir)


def _check_vocab(tok, model, given) -> None:
    vocab = model.config.vocab_size if hasattr(model, "config") else model.body.config.vocab_size
    if given is not None and tok.vocab_size > vocab:
        raise ValueError(f"tokenizer {str(given)!r} has {tok.vocab_size} ids, more than the model's vocabulary of "
                         f"{vocab}; give the tokenizer the model was trained with")


def _load_hf(path: Path, overrides: Mapping[str, Any] | None, device: str | torch.device, tokenizer,
             require_tokenizer: bool) -> LoadedRun:
    model_overrides = {}
    for key, value in (overrides or {}).items():
        if not key.startswith("model."):
            raise ValueError(
                f"{key!r} does not apply to a Hugging Face checkpoint; only model.* fields can be overridden"
            )
        model_overrides[key[len("model."):]] = value
    model = from_hf(path)
    if model_overrides:  # e.g. rope scaling: rebuild from the overridden config and keep the weights
        state = model.state_dict()
        cfg = model.config.override(model_overrides)
        check_fits(
            lambda n: loading_memory(cfg, parameters=n),
            cfg,
            torch.device(device),
            what=f"the model of {str(path)!r} with {sorted(overrides or {})}",
            fix="check the --model.* overrides",
        )
        model = Transformer(cfg)
        model.load_state_dict(state)
    if tokenizer is None and not (path / HF_FILE).is_file():
        if not require_tokenizer:
            return LoadedRun(model.to(device).eval(), None, None, path, None, None)
        raise FileNotFoundError(
            f"{str(path)!r} has no tokenizer.json; lmlab reads Hugging Face tokenizers from that file only "
            "(save one with tokenizer.save_pretrained on a fast tokenizer), or give one with --tokenizer PATH"
        )
    tok = tokenizer_from_path(tokenizer) if tokenizer is not None else tokenizer_from_path(path, checkpoint=True)
    _check_vocab(tok, model, tokenizer)
    return LoadedRun(model.to(device).eval(), tok, None, path, None, None)
