"""Mixture-of-experts feed-forward (work in progress: the layer itself lands with issue 3)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from .schema import Config, check_choice, check_positive, divisors


@dataclasses.dataclass(kw_only=True, frozen=True)
class MoEConfig(Config):
    n_experts: int = 8  # routed experts before fine-grained segmentation
    top_k: int = 2  # active routed experts per token before segmentation
    granularity: int = 1  # DeepSeekMoE m: m*n_experts experts of width d_expert/m, m*top_k active
    n_shared: int = 0  # shared experts every token goes through (DeepSeekMoE)
    d_expert: int | None = None  # expert hidden size before segmentation; None = the dense d_ff
    every: int = 1  # layer l is MoE if l >= first_dense and (l - first_dense) % every == 0
    first_dense: int = 0  # the first k layers stay dense (DeepSeek-V3)

    def check_against(self, *, n_layers: int, d_ff: int) -> None:
        pass

    def applies_to(self, layer: int) -> bool:
        return layer >= self.first_dense and (layer - self.first_dense) % self.every == 0


# Model presets with a mixture-of-experts feed-forward: name -> ModelConfig fields (``moe`` as a dict).
MOE_PRESETS: dict[str, dict] = {}
