"""Normalization layers: LayerNorm (Ba et al. 2016) and RMSNorm (Zhang & Sennrich 2019), whose gain is stored
as itself or, as Gemma stores it, as its offset from 1 (``ModelConfig.norm_gain``)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """g * x / rms(x), normalized in fp32 (as Llama does) and cast back before the gain: the reference."""
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


def _normalize(x32: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / rms(x), 1 / rms(x)) over the last axis of an fp32 tensor, as Llama and ``F.rms_norm``
    compute it (mean of squares, then rsqrt), so results match theirs to the last bit or two."""
    rstd = x32.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return x32 * rstd, rstd


class RMSNormFunction(torch.autograd.Function):
    """The fast path of :func:`rms_norm_reference`: the same forward, with the backward written out.

    Autograd differentiates ``F.rms_norm`` through its decomposition (pow, mean, rsqrt, mul, div:
    about a dozen passes and allocations over (N, D) on CPU, where no fused backward kernel exists).
    With n = x / rms(x): dg = sum(dy * n) and dx = (dn - n * mean(dn * n)) / rms(x), dn = dy * g,
    in six passes and two allocations."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        n, rstd = _normalize(x.float(), eps)
        ctx.save_for_backward(n, rstd, weight)
        ctx.x_dtype = x.dtype
        return weight * n.to(x.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        n, rstd, weight = ctx.saved_tensors
        g_weight = None
        if ctx.needs_input_grad[1]:
            g_weight = (g * n.to(ctx.x_dtype)).flatten(0, -2).sum(0).to(weight.dtype)
        gn = (g * weight).float()  # (..., D)
        D = n.shape[-1]
        dot = torch.bmm(gn.reshape(-1, 1, D), n.reshape(-1, D, 1)).view(rstd.shape) / D  # mean(dn * n), one pass
        return gn.addcmul_(n, dot, value=-1).mul_(rstd).to(ctx.x_dtype), g_weight, None


def rms_normalize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """g * x / rms(x) in fp32, cast back to x's dtype before the gain; equal to :func:`rms_norm_reference`.
    Under ``torch.compile`` the reference: the compiler fuses its ops and their backward itself.
    Without grad (generation, evaluation) the reference, in one call where it is fp32: ``apply``'s
    bookkeeping costs more than the ops at a decoding step's (B, 1, D) (74 against 22 us at D 256)."""
    if torch.compiler.is_compiling():
        return rms_norm_reference(x, weight, eps)
    if not torch.is_grad_enabled():
        if x.dtype == weight.dtype == torch.float32:  # the reference's ops in one call: x * rstd * g
            return F.rms_norm(x, weight.shape, weight, eps)
        return rms_norm_reference(x, weight, eps)
    return RMSNormFunction.apply(x, weight, eps)


class RMSNorm(nn.Module):
    """x / rms(x) * g, computed in fp32 (as Llama does) and cast back."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_normalize(x, self.weight, self.eps)


class OffsetRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), with w stored and initialized at 0 (Gemma; ``norm_gain="offset"``): RMSNorm with
    gain 1 + w. As Gemma computes it, the gain multiplies in fp32, before the cast back to x's dtype (RMSNorm
    casts first); the same numbers in fp32."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _ = _normalize(x.float(), self.eps)
        return (n * (1.0 + self.weight.float())).to(x.dtype)

    def init_params(self, init) -> None:
        """w = 0: the gain starts at 1, as RMSNorm's."""
        init.zeros(self.weight)


RMS_NORMS = {"plain": RMSNorm, "offset": OffsetRMSNorm}  # ModelConfig.norm_gain -> the class


@dataclasses.dataclass(frozen=True)
class NormArgs:
    """A normalization's own config, resolved from the model's by :func:`norm_args`."""

    kind: str  # "layernorm" | "rmsnorm" (ModelConfig.norm)
    gain: str  # RMSNorm's gain: "plain" or "offset" (ModelConfig.norm_gain)
    eps: float
    bias: bool  # LayerNorm's shift (ModelConfig.bias)


def norm_args(cfg: ModelConfig) -> NormArgs:
    """What the model's norms are built from, and nothing else of the model config."""
    return NormArgs(kind=cfg.norm, gain=cfg.norm_gain, eps=cfg.norm_eps, bias=cfg.bias)


def layer_norm(args: NormArgs, d: int) -> nn.Module:
    return nn.LayerNorm(d, eps=args.eps, bias=args.bias)


def rms_norm(args: NormArgs, d: int) -> nn.Module:
    """An RMSNorm over ``d`` values with the eps and gain parametrization of ``args``."""
    return RMS_NORMS[args.gain](d, args.eps)


NORMS = {"layernorm": layer_norm, "rmsnorm": rms_norm}


def build_norm(cfg: ModelConfig) -> nn.Module:
    """The model's normalization over d_model (the blocks', the final one, the MTP modules')."""
    args = norm_args(cfg)
    return NORMS[args.kind](args, cfg.d_model)
