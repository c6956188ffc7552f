"""Shared test helpers: tiny configs and models that run in milliseconds on a CPU."""

from __future__ import annotations

import pytest
import torch

import lmlab

# Tiny models are dominated by per-op overhead; extra intra-op threads only add contention.
torch.set_num_threads(1)

TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=32)


def tiny_config(**overrides) -> lmlab.ModelConfig:
    """d_model 32, 2 layers, 4 heads, vocab 64, context 32; any field (dotted keys too) overridable."""
    nested = {k: v for k, v in overrides.items() if "." in k}
    flat = {k: v for k, v in overrides.items() if "." not in k}
    cfg = lmlab.ModelConfig(**{**TINY, **flat})
    return cfg.override(nested) if nested else cfg


def tokens(batch: int, length: int, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    """Reproducible random token ids (batch, length)."""
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def tiny():
    return tiny_config


@pytest.fixture(autouse=True)
def work_in_a_temporary_directory(tmp_path_factory, monkeypatch):
    """Every test runs in an empty directory of its own: nothing reads or writes the checkout, so the
    README's main job (which leaves runs/default behind) and the test suite run in either order."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))
