"""Initialization machinery: one seeded drawing helper, and the walk that applies it.

Every draw goes through :class:`Init`, on the CPU in fp32, so weights are a pure function of
(config, init_seed) whatever the default dtype and device. :func:`init_module` walks a module
tree: a module with an ``init_params(init)`` hook initializes its whole subtree itself; torch's
own layers get the defaults (Linear and Embedding weights ~ N(0, std), biases 0, norm gains 1
and shifts 0). Which std each weight gets, and why, is decided by the hooks and documented in
``model.init_weights``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from .norm import RMSNorm

Gain = float | None  # a DeepNorm gain: 1, β, or None where DeepNorm is off


@dataclasses.dataclass
class Init:
    """How to draw: one generator, consumed in module order, and the scales the hooks use."""

    generator: torch.Generator
    std: float  # most weights ~ N(0, std)
    out_std: float  # projections that write into the residual stream (gpt2 scaling shrinks them)
    beta: float | None = None  # DeepNorm's β: matrices are Xavier-normal instead, with gain 1 or β
    rule: str = "normal"  # ModelConfig.init: "xavier" makes every matrix Xavier-normal (gain 1 unless DeepNorm)
    embed_std: float | None = None  # token/position embeddings ~ N(0, embed_std); None = std

    def draw(self, shape: torch.Size) -> torch.Tensor:
        """Standard normal samples drawn on the CPU in fp32, whatever the default device and dtype,
        so the same seed gives the same weights everywhere (and a CPU generator works inside
        ``with torch.device("cuda")``)."""
        return torch.randn(shape, generator=self.generator, device="cpu", dtype=torch.float32)

    @torch.no_grad()
    def normal(self, p: torch.Tensor, std: float) -> None:
        if p.is_meta:  # a model on the meta device has shapes only (from_hf, parameter counting): nothing to draw
            return
        p.copy_(self.draw(p.shape) * std)

    def xavier(self, w: torch.Tensor, gain: float) -> None:
        """Xavier-normal (Glorot & Bengio 2010) for a matrix in nn.Linear's (out, in) layout."""
        fan_out, fan_in = w.shape
        self.normal(w, gain * math.sqrt(2.0 / (fan_in + fan_out)))

    def weight(
        self, w: torch.Tensor, std: float, deepnorm_gain: Gain | tuple[Gain, ...], rows: tuple[int, ...] | None = None
    ) -> None:
        """A weight of one or more matrices in nn.Linear's (out, in) layout: N(0, std), in one draw.

        Under DeepNorm each matrix is Xavier-normal on its own (Wang et al. 2022, Algorithm 1): each
        expert of a stack (n, out, in), and each block of ``rows`` of a fused weight ([q; k; v],
        [gate; up]), with ``deepnorm_gain`` (1 or β), or one gain per block. With ``rule="xavier"``
        and no DeepNorm, the same per-matrix Xavier-normal with gain 1."""
        if self.beta is None and self.rule == "normal":
            self.normal(w, std)
            return
        rows = rows or (w.shape[-2],)
        if self.beta is None:
            deepnorm_gain = 1.0
        gains = deepnorm_gain if isinstance(deepnorm_gain, tuple) else (deepnorm_gain,) * len(rows)
        for matrix in w.unbind(0) if w.ndim == 3 else (w,):
            for block, gain in zip(matrix.split(rows, dim=0), gains):
                self.xavier(block, gain)

    @staticmethod
    @torch.no_grad()
    def zeros(*tensors: torch.Tensor | None) -> None:
        """Zero each tensor given (biases, buffers); None, an absent bias, is skipped."""
        for t in tensors:
            if t is not None:
                t.zero_()


@torch.no_grad()
def init_module(module: nn.Module, init: Init) -> None:
    """Initialize ``module`` and everything under it, parents before children, in registration order."""
    if hasattr(module, "init_params"):
        module.init_params(init)  # the module owns its subtree
        return
    if isinstance(module, nn.Linear):
        if init.rule == "xavier":
            init.xavier(module.weight, 1.0)
        else:
            init.normal(module.weight, init.std)
        init.zeros(module.bias)
    elif isinstance(module, nn.Embedding):
        init.normal(module.weight, init.std if init.embed_std is None else init.embed_std)
    elif isinstance(module, (nn.LayerNorm, RMSNorm)):
        module.weight.fill_(1.0)
        init.zeros(getattr(module, "bias", None))
    elif any(True for _ in module.parameters(recurse=False)):
        raise TypeError(
            f"{type(module).__name__} holds parameters but has no init_params(init) hook and no default "
            "initialization; give it an init_params hook"
        )
    for child in module.children():
        init_module(child, init)
