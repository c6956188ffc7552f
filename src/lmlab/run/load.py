"""Reading a run back: its config, a checkpoint's model and its tokenizer (metrics: ``metrics.read_metrics``).

    run = load_run("runs/default", checkpoint="best")            # or a Hugging Face checkpoint directory
    run.model, run.tokenizer, run.config, run.checkpoint
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

import torch

from ..hf import from_hf
from ..model import Transformer
from . import checkpoint as ckpt
from .config import RunConfig, load_config
from .directory import CHECKPOINTS, CONFIG_FILE
from .errors import CorruptFile
from .tokenizer import load_tokenizer


@dataclasses.dataclass
class LoadedRun:
    model: Transformer  # in eval mode, on the requested device
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
    device: str | torch.device = "cpu",
) -> LoadedRun:
    """Load a run directory's model at ``checkpoint`` ("best", "latest" or a step), with dotted
    config ``overrides`` such as ``{"model.rope.scaling": "yarn", "model.rope.factor": 4}``;
    or a Hugging Face checkpoint directory (config.json + safetensors + tokenizer.json) via ``from_hf``."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"run directory {str(path)!r} does not exist")
    if is_hf_dir(path):
        return _load_hf(path, overrides, device)
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(f"{str(path)!r} is neither a run directory (no {CONFIG_FILE}) nor a Hugging Face checkpoint (no config.json)")
    cfg = load_config(path / CONFIG_FILE, overrides)
    where = ckpt.resolve(path / CHECKPOINTS, checkpoint)
    model = Transformer(cfg.model)
    ckpt.load_weights(model, where / ckpt.WEIGHTS)
    data_dir = path / cfg.data.dir
    tokenizer = load_tokenizer(data_dir)
    step = int(where.name.split("_")[-1])
    return LoadedRun(model.to(device).eval(), tokenizer, cfg, where, step, data_dir)


def _load_hf(path: Path, overrides: Mapping[str, Any] | None, device: str | torch.device) -> LoadedRun:
    model_overrides = {}
    for key, value in (overrides or {}).items():
        if not key.startswith("model."):
            raise ValueError(f"{key!r} does not apply to a Hugging Face checkpoint; only model.* fields can be overridden")
        model_overrides[key[len("model."):]] = value
    model = from_hf(path)
    if model_overrides:  # e.g. rope scaling: rebuild from the overridden config and keep the weights
        state = model.state_dict()
        model = Transformer(model.config.override(model_overrides))
        model.load_state_dict(state)
    return LoadedRun(model.to(device).eval(), HFTokenizer(path), None, path, None, None)


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` behind lmlab's tokenizer interface."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"{str(path)!r} has no tokenizer.json; lmlab reads Hugging Face tokenizers from that file only "
                "(save one with tokenizer.save_pretrained on a fast tokenizer)"
            )
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError("reading tokenizer.json needs the tokenizers package: pip install tokenizers") from None
        self.tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.vocab_size = self.tok.get_vocab_size()
        eos = json.loads((path / "config.json").read_text()).get("eos_token_id")
        generation = path / "generation_config.json"  # where generate() reads its EOS ids, possibly several
        if generation.is_file():
            try:
                eos = json.loads(generation.read_text()).get("eos_token_id", eos)
            except (ValueError, AttributeError):
                raise CorruptFile(f"{str(generation)!r} is not a JSON object; restore it or delete it") from None
        self.eos_ids = [eos] if isinstance(eos, int) else [int(e) for e in eos or []]  # any of them ends a text
        self.eos_id = self.eos_ids[0] if self.eos_ids else None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)
