"""lmlab: build, train and compare Transformer language models, from 2017 to today.

The names below load on first use (PEP 562), so ``import lmlab`` (and ``lmlab --help``) does not
import torch; ``lmlab.Transformer`` or ``from lmlab import Transformer`` imports what it needs.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the real imports, for readers and type checkers; at run time __getattr__ makes them
    from .attention import KVCache
    from .config import PRESETS, ModelConfig, MoEConfig, RopeConfig
    from .loss import IGNORE_INDEX
    from .model import LMOutput, SequenceClassifier, Transformer

__version__ = "0.1.0"

__all__ = [
    "IGNORE_INDEX", "KVCache", "LMOutput", "ModelConfig", "MoEConfig", "PRESETS", "RopeConfig",
    "SequenceClassifier", "Transformer", "__version__", "from_hf", "load_run", "read_metrics", "to_hf",
]

EXPORTS = {"KVCache": "attention", "PRESETS": "config", "ModelConfig": "config", "MoEConfig": "config",
           "RopeConfig": "config", "IGNORE_INDEX": "loss", "LMOutput": "model", "SequenceClassifier": "model",
           "Transformer": "model",
           # reading a run back (lmlab.run.load, lmlab.run.metrics): the package's front door names them, loaded
           # on first use like the rest, so that the model layer imports nothing of the run layer
           "load_run": "run.load", "read_metrics": "run.metrics"}  # public name -> the module that defines it


def __getattr__(name: str) -> Any:
    """A public name from its module, or a submodule (``lmlab.attention``), imported on first use."""
    if name in EXPORTS:
        value = getattr(importlib.import_module(f".{EXPORTS[name]}", __name__), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def from_hf(path, **kwargs):
    """Load a Hugging Face checkpoint directory (config.json + safetensors) as an lmlab model."""
    from . import hf  # on first use: the checkpoint readers are not needed to build or train models

    return hf.from_hf(path, **kwargs)


def to_hf(model, out, tokenizer=None, **kwargs):
    """Write an lmlab model (and its tokenizer) as a Hugging Face checkpoint directory that
    ``transformers`` loads with the same logits; see :func:`lmlab.hf.to_hf`."""
    from . import hf

    return hf.to_hf(model, out, tokenizer, **kwargs)
