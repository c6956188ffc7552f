"""Position-wise feed-forward networks: the two-layer MLP (Vaswani et al. 2017; GPT) and the
gated linear unit (Shazeer 2020, https://arxiv.org/abs/2002.05202; SwiGLU = glu + silu)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .init import Init

QUICK_GELU_A = 1.702  # the sigmoid approximation of GELU, x sigmoid(1.702 x) (Hendrycks & Gimpel 2016, sec. 2)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x * QUICK_GELU_A)  # gpt-oss's order: gate * sigmoid(gate * alpha)


ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(
        F.gelu, approximate="tanh"
    ),  # GPT-2's "gelu_new"; a partial pickles, a lambda does not
    "silu": F.silu,
    "relu": F.relu,
    "quick_gelu": quick_gelu,
}

def quick_gelu_grad(g: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """g * d/dx [x sigmoid(a x)] = g s + a sigmoid'(a x) g x, s = sigmoid(a x), written into ``out`` (which may
    be g): the ops autograd runs for :func:`quick_gelu`, in its order, so the bits are autograd's."""
    s = torch.sigmoid(x * QUICK_GELU_A)
    through_sigmoid = torch.ops.aten.sigmoid_backward(g * x, s) * QUICK_GELU_A
    return torch.add(g * s, through_sigmoid, out=out)


_aten = torch.ops.aten
# grad_in = grad_out * act'(x), written into ``out`` (which may be grad_out itself): the backward
# half of each activation, as autograd would call it
ACTIVATION_GRADS = {
    "gelu": lambda g, x, out: _aten.gelu_backward(g, x, approximate="none", grad_input=out),
    "gelu_tanh": lambda g, x, out: _aten.gelu_backward(g, x, approximate="tanh", grad_input=out),
    "silu": lambda g, x, out: _aten.silu_backward(g, x, grad_input=out),
    "relu": lambda g, x, out: _aten.threshold_backward(g, x, 0, grad_input=out),
    "quick_gelu": quick_gelu_grad,
}


# ============================================================== the gated unit
def glu_reference(z: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for z = [gate, up] (..., 2F) -> (..., F), written out: the reference."""
    gate, up = z.chunk(2, dim=-1)
    return ACTIVATIONS[activation](gate) * up


class GLUFunction(torch.autograd.Function):
    """The fast path of :func:`glu_reference`: the same forward, and a backward that writes the
    gradients of gate and up straight into the two halves of one (..., 2F) tensor. Autograd's
    backward makes them separately and joins them with a ``cat``, one more pass over (N, 2F) and
    one more allocation, which on CPU costs as much as the activation itself."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, activation: str) -> torch.Tensor:
        gate, up = z.chunk(2, dim=-1)
        act_gate = ACTIVATIONS[activation](gate)
        ctx.save_for_backward(z, act_gate)
        ctx.activation = activation
        return act_gate * up

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        z, act_gate = ctx.saved_tensors
        gate, up = z.chunk(2, dim=-1)
        gz = torch.empty_like(z)
        g_gate, g_up = gz.chunk(2, dim=-1)  # views: the results land in place
        torch.mul(g, up, out=g_gate)
        ACTIVATION_GRADS[ctx.activation](g_gate, gate, g_gate)
        torch.mul(g, act_gate, out=g_up)
        return gz, None


def glu(z: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for z = [gate, up] (..., 2F) -> (..., F); equal to :func:`glu_reference`.
    Under ``torch.compile`` the reference: the compiler fuses its ops and their backward itself; without
    grad too (generation, evaluation), where the Function's bookkeeping is all it would add."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return glu_reference(z, activation)
    return GLUFunction.apply(z, activation)


GLU_LIMIT = 7.0  # gpt-oss's swiglu_limit: the gate is clamped from above, up on both sides


def clamped_glu(z: torch.Tensor, activation: str) -> torch.Tensor:
    """act(min(gate, 7)) * (clamp(up, -7, 7) + 1) for z = [gate, up] (..., 2F) -> (..., F): gpt-oss's experts
    (OpenAI 2025, with activation quick_gelu). The clamps bound each unit's output; the +1 lets up = 0 pass the
    gate through. Written out, autograd differentiates it."""
    gate, up = z.chunk(2, dim=-1)
    gate, up = gate.clamp(max=GLU_LIMIT), up.clamp(min=-GLU_LIMIT, max=GLU_LIMIT)
    return (up + 1) * ACTIVATIONS[activation](gate)


SWIGLU_LIMIT = 10.0  # DeepSeek-V4's swiglu_limit: ModelConfig.glu_limit's default


def limited_glu(z: torch.Tensor, activation: str, limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    """act(min(gate, L)) * clamp(up, -L, L) for z = [gate, up] (..., 2F) -> (..., F): DeepSeek-V4's routed and shared
    experts (swiglu_limit L = 10; transformers' ``DeepseekV4Experts``), gpt-oss's clamps without its + 1. Written
    out, autograd differentiates it."""
    gate, up = z.chunk(2, dim=-1)
    return ACTIVATIONS[activation](gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


GLUS = {"plain": glu, "clamped": clamped_glu, "limited": limited_glu}  # ModelConfig.glu_variant -> the gated unit


def gated_unit(variant: str, limit: float) -> Callable[[torch.Tensor, str], torch.Tensor]:
    """The gated unit ``GLUS[variant]`` as (z, activation) -> (..., F), with ``limit`` (ModelConfig.glu_limit) bound
    where the unit takes one: ``limited``'s."""
    return functools.partial(limited_glu, limit=limit) if variant == "limited" else GLUS[variant]


# ============================================================== the dense feed-forwards (ModelConfig.ffn)
@dataclasses.dataclass(frozen=True, kw_only=True)
class FeedForwardArgs:
    """A dense feed-forward's own config, resolved from the model's by :func:`feedforward_args`."""

    d_model: int
    d_ff: int  # the hidden width
    bias: bool
    activation: str  # a name of ACTIVATIONS
    glu_variant: str  # a name of GLUS (the gated unit only)
    glu_limit: float = SWIGLU_LIMIT  # the clamp of glu_variant 'limited'


def feedforward_args(cfg: ModelConfig) -> FeedForwardArgs:
    """What the dense feed-forward of ``cfg`` is built from, and nothing else of the model config."""
    return FeedForwardArgs(d_model=cfg.d_model, d_ff=cfg.d_ff, bias=cfg.bias, activation=cfg.activation,
                           glu_variant=cfg.glu_variant, glu_limit=cfg.glu_limit)


class MLP(nn.Module):
    """down(act(up(x)))"""

    def __init__(self, args: FeedForwardArgs):
        super().__init__()
        self.up = nn.Linear(args.d_model, args.d_ff, bias=args.bias)
        self.down = nn.Linear(args.d_ff, args.d_model, bias=args.bias)
        self.act = ACTIVATIONS[args.activation]

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

    def __init__(self, args: FeedForwardArgs):
        super().__init__()
        self.d_ff = args.d_ff
        self.gate_up = nn.Linear(args.d_model, 2 * self.d_ff, bias=args.bias)
        self.down = nn.Linear(self.d_ff, args.d_model, bias=args.bias)
        self.activation = args.activation
        self.glu = gated_unit(args.glu_variant, args.glu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.glu(self.gate_up(x), self.activation))

    def init_params(self, init: Init) -> None:
        """As :meth:`MLP.init_params`, with gate and up two matrices that happen to be stored as one."""
        init.weight(self.gate_up.weight, init.std, deepnorm_gain=init.beta, rows=(self.d_ff, self.d_ff))
        init.weight(self.down.weight, init.out_std, deepnorm_gain=init.beta)
        init.zeros(self.gate_up.bias, self.down.bias)


FFNS = {"mlp": MLP, "glu": GLU}

