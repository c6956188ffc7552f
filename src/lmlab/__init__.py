"""lmlab: build, train and compare Transformer language models, from 2017 to today."""

from .attention import KVCache
from .config import PRESETS, ModelConfig, MoEConfig, RopeConfig
from .loss import IGNORE_INDEX
from .model import LMOutput, SequenceClassifier, Transformer

__version__ = "0.1.0"

__all__ = [
    "IGNORE_INDEX", "KVCache", "LMOutput", "ModelConfig", "MoEConfig", "PRESETS", "RopeConfig",
    "SequenceClassifier", "Transformer", "__version__", "from_hf", "to_hf",
]


def from_hf(path, **kwargs):
    """Load a Hugging Face checkpoint directory (config.json + safetensors) as an lmlab model."""
    from . import hf  # on first use: the checkpoint readers are not needed to build or train models

    return hf.from_hf(path, **kwargs)


def to_hf(model, out, tokenizer=None, **kwargs):
    """Write an lmlab model (and its tokenizer) as a Hugging Face checkpoint directory that
    ``transformers`` loads with the same logits; see :func:`lmlab.hf.to_hf`."""
    from . import hf

    return hf.to_hf(model, out, tokenizer, **kwargs)
