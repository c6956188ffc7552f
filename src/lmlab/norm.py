"""Normalization layers: LayerNorm (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class RMSNorm(nn.Module):
    """x / rms(x) * g, computed in fp32 (as Llama does) and cast back."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def layer_norm(cfg: ModelConfig) -> nn.Module:
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def rms_norm(cfg: ModelConfig) -> nn.Module:
    return RMSNorm(cfg.d_model, cfg.norm_eps)


NORMS = {"layernorm": layer_norm, "rmsnorm": rms_norm}


def build_norm(cfg: ModelConfig) -> nn.Module:
    return NORMS[cfg.norm](cfg)
