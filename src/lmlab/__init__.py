"""lmlab: build, train and compare Transformer language models, from 2017 to today."""

from .attention import KVCache
from .config import PRESETS, ModelConfig, RopeConfig
from .model import IGNORE_INDEX, LMOutput, SequenceClassifier, Transformer
from .moe import MoEConfig

__version__ = "0.1.0"

__all__ = [
    "IGNORE_INDEX", "KVCache", "LMOutput", "ModelConfig", "MoEConfig", "PRESETS", "RopeConfig",
    "SequenceClassifier", "Transformer", "__version__", "from_hf",
]


def from_hf(path, **kwargs):
    """Load a Hugging Face checkpoint directory (config.json + safetensors) as an lmlab model."""
    from .hf import from_hf as _from_hf

    return _from_hf(path, **kwargs)
