"""Position-wise feed-forward networks: the two-layer MLP (Vaswani et al. 2017; GPT) and the
gated linear unit (Shazeer 2020, https://arxiv.org/abs/2002.05202; SwiGLU = glu + silu)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .init import Init

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),  # GPT-2's "gelu_new"; a partial pickles, a lambda does not
    "silu": F.silu,
    "relu": F.relu,
}


class MLP(nn.Module):
    """down(act(up(x)))"""

    def __init__(self, cfg: ModelConfig, d_ff: int | None = None):
        super().__init__()
        d_ff = d_ff or cfg.d_ff
        self.up = nn.Linear(cfg.d_model, d_ff, bias=cfg.bias)
        self.down = nn.Linear(d_ff, cfg.d_model, bias=cfg.bias)
        self.act = ACTIVATIONS[cfg.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))

    def init_params(self, init: Init) -> None:
        """up ~ N(0, std); down, which writes into the residual stream, ~ N(0, out_std); biases 0.
        DeepNorm: Xavier-normal with gain β for both (Wang et al. 2022, Algorithm 1)."""
        init.weight(self.up.weight, init.std, deepnorm_gain=init.beta)
        init.weight(self.down.weight, init.out_std, deepnorm_gain=init.beta)
        init.zeros(self.up.bias, self.down.bias)


class GLU(nn.Module):
    """down(act(gate(x)) * up(x)); gate and up are one fused matmul, stored as [gate; up]."""

    def __init__(self, cfg: ModelConfig, d_ff: int | None = None):
        super().__init__()
        self.d_ff = d_ff or cfg.d_ff
        self.gate_up = nn.Linear(cfg.d_model, 2 * self.d_ff, bias=cfg.bias)
        self.down = nn.Linear(self.d_ff, cfg.d_model, bias=cfg.bias)
        self.act = ACTIVATIONS[cfg.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)

    def init_params(self, init: Init) -> None:
        """As :meth:`MLP.init_params`, with gate and up two matrices that happen to be stored as one."""
        init.weight(self.gate_up.weight, init.std, deepnorm_gain=init.beta, rows=(self.d_ff, self.d_ff))
        init.weight(self.down.weight, init.out_std, deepnorm_gain=init.beta)
        init.zeros(self.gate_up.bias, self.down.bias)


FFNS = {"mlp": MLP, "glu": GLU}

