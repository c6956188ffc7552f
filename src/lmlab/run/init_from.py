"""Where a fine-tune starts (``train.init_from``): an lmlab run, one of its checkpoints, or a
Hugging Face checkpoint directory, with the model config and the tokenizer that come with it.

    src = init_source("runs/pretrained")          # its best checkpoint
    src.model, src.task, src.tokenizer()          # ModelConfig, "lm" | "classify", Tokenizer | None
    src.load_into(model)                          # a Transformer, or a SequenceClassifier's body

The run config's model section starts from ``src.model`` (``load_config``); weights that do not
fit the model a config asks for are a one-line ValueError naming the tensor and the config field.
lmlab weights are checked against the sha256 of each tensor recorded at save (``local.read_weights``,
as a resume checks them): a damaged file is a CorruptFile naming it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig
from ..hf import config_from_hf, read_config, read_safetensors, state_dict_from_hf
from .checkpoint import local as ckpt
from .data.config import DataConfig, run_data_dir
from .data.tokenizer import HF_FILE, Tokenizer, load_tokenizer, tokenizer_from_path
from .errors import CorruptFile, one_line

RUN_CONFIG = "config.yaml"  # a run directory's config (directory.CONFIG_FILE, which imports the run config)


@dataclasses.dataclass(frozen=True)
class InitSource:
    path: Path
    kind: str  # "run", "checkpoint" or "Hugging Face checkpoint"
    model: ModelConfig  # the config its weights were trained with
    task: str  # "lm" or "classify"
    weights: Path | None  # lmlab safetensors; None for a Hugging Face directory
    tokenizer_dir: Path | None  # prepared data (lmlab) or the Hugging Face directory; None when unknown

    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer its weights were trained with, or None when the source does not include one."""
        if self.tokenizer_dir is None:
            return None
        if self.weights is None:  # Hugging Face: tokenizer.json beside config.json (eos from config.json)
            return tokenizer_from_path(self.tokenizer_dir, checkpoint=True)
        return load_tokenizer(self.tokenizer_dir)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Its weights under lmlab's names (a classifier's under ``body.`` and ``score.``)."""
        if self.weights is not None:  # checked against the sha256 of each tensor recorded at save, as a resume is
            return ckpt.read_weights(self.weights)[0]
        hf = read_config(self.path)
        return state_dict_from_hf(self.model, read_safetensors(self.path), hf["model_type"],
                                  source=f"checkpoint {str(self.path)!r}")

    def load_into(self, model: nn.Module) -> None:
        """Copy its weights into ``model``: a Transformer, or a SequenceClassifier (from a language
        model, the body only; its score head keeps its fresh initialization)."""
        body = getattr(model, "body", None)
        if body is None and self.task == "classify":
            raise ValueError(f"train.init_from {str(self.path)!r} is a classifier; a language model cannot start from "
                             "it (use --task classify, or start from a language model)")
        state = self.state_dict()
        target = body if body is not None and self.task == "lm" else model
        config = getattr(target, "config", None) or getattr(body, "config", None)
        expected = target.state_dict()
        problems = [f"tensor {k!r} is missing from it" for k in expected if k not in state]
        problems += [f"it has tensor {k!r}, which the model does not" for k in state if k not in expected]
        problems += [f"tensor {k!r} has shape {tuple(state[k].shape)} there but {tuple(v.shape)} in the model"
                     for k, v in expected.items() if k in state and state[k].shape != v.shape]
        if problems:
            fields = config_differences(self.model, config) if config is not None else []
            hint = f"; {fields[0]}" if fields else ""
            raise ValueError(f"train.init_from {str(self.path)!r} does not match the model: {problems[0]}{hint}")
        target.load_state_dict(state)


def config_differences(theirs: ModelConfig, ours: ModelConfig) -> list[str]:
    """["model.n_layers is 2 in init_from but 3 here", ...] for every differing field."""
    def flat(d: dict[str, Any], prefix: str = "model.") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    a, b = flat(theirs.to_dict()), flat(ours.to_dict())
    return [
        f"{k} is {a.get(k)!r} in init_from but {b.get(k)!r} here"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]


def init_source(path: str | Path) -> InitSource:
    """Resolve ``train.init_from``: a run directory (its best checkpoint), a checkpoint directory
    (``checkpoints/step_N``) or a Hugging Face checkpoint directory (config.json + safetensors)."""
    p = Path(path).expanduser().resolve()
    if not p.exists():
        raise ValueError(f"train.init_from {str(path)!r} does not exist; give an lmlab run, one of its checkpoints, "
                         "or a Hugging Face checkpoint directory")
    if (p / RUN_CONFIG).is_file():
        return _from_run(p)
    if (p / "config.json").is_file():  # Hugging Face (its weights are model.safetensors too)
        tokenizer_dir = p if (p / HF_FILE).is_file() else None
        return InitSource(p, "Hugging Face checkpoint", config_from_hf(read_config(p)), "lm", None, tokenizer_dir)
    if (p / ckpt.WEIGHTS).is_file():
        return _from_checkpoint(p)
    raise ValueError(f"train.init_from {str(path)!r} is neither an lmlab run ({RUN_CONFIG}), a checkpoint "
                     f"({ckpt.WEIGHTS}) nor a Hugging Face checkpoint (config.json)")


def _run_section(run: Path) -> tuple[ModelConfig, str, Path]:
    import yaml

    try:
        data = yaml.safe_load((run / RUN_CONFIG).read_text())
        model = ModelConfig.from_dict(data["model"])
        data_cfg = DataConfig.from_dict(data.get("data") or {})
    except (yaml.YAMLError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{run / RUN_CONFIG} is not a valid run config ({' '.join(str(e).split())[:120]})") from None
    return model, data.get("task", "lm"), run_data_dir(run, data_cfg)


def _from_run(run: Path) -> InitSource:
    model, task, data_dir = _run_section(run)
    try:
        where = ckpt.resolve(run / "checkpoints", "best")
    except FileNotFoundError:
        raise ValueError(f"train.init_from {str(run)!r} has no checkpoint yet; train it first") from None
    ckpt.require_weights(where, run)
    return InitSource(run, "run", model, task, where / ckpt.WEIGHTS, data_dir if data_dir.is_dir() else None)


def _from_checkpoint(path: Path) -> InitSource:
    from safetensors import safe_open

    try:
        with safe_open(str(path / ckpt.WEIGHTS), framework="pt") as f:
            metadata = f.metadata() or {}
            task = "classify" if "score.weight" in f.keys() else "lm"
        model = ModelConfig.from_dict(json.loads(metadata["model_config"]))
    except KeyError:
        raise ValueError(f"{path / ckpt.WEIGHTS} records no model config; give the run directory instead") from None
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise CorruptFile(f"checkpoint weights {str(path / ckpt.WEIGHTS)!r} cannot be read ({one_line(e)[:160]}); "
                          "the file is damaged: give another checkpoint, or the run directory") from None
    run = path.parent.parent
    data_dir = _run_section(run)[2] if (run / RUN_CONFIG).is_file() else None
    return InitSource(path, "checkpoint", model, task, path / ckpt.WEIGHTS,
                      data_dir if data_dir is not None and data_dir.is_dir() else None)
