"""The residual connection: how a sublayer's output joins the stream, and how wide the stream is
(``ModelConfig.residual``, ``ModelConfig.residual_streams``).

    plain   x ← x + f(x)                                  one stream of d_model values (He et al. 2016)
    hyper   H ← A_rᵀ H + Bᵀ f(A_mᵀ H)                      n streams; A_m, A_r, B learned, static + dynamic
                                                          (Zhu et al. 2024, arXiv:2409.19606, sec. 2)
    mhc     H ← Cᵀ H + post ⊗ f(preᵀ H)                    n streams; C doubly stochastic (Sinkhorn-Knopp)
                                                          (Xie et al. 2025, arXiv:2512.24880; DeepSeek-V4 sec. 2.2)

H (B, T, n, C) holds n copies of the token's vector; a sublayer f (with its norms: the block's norm position
decides those) reads one vector collapsed from them and its output is spread back over them. The model widens
the embedding to n copies before the first block and collapses the streams before the final norm
(:class:`Streams`); under ``plain`` both are nothing at all, and the connection is ``x + f(x)``.

Two things are chosen per ``residual``, in :data:`RESIDUALS`: the connection around each sublayer of a block,
built with the sublayer's index k (2 per layer: attention 2l, feed-forward 2l + 1), and the model's
:class:`Streams`. Blocks call a connection as ``x = connection(x, f)``; their forward never asks which.

Weights that make the mixing coefficients are computed in fp32 with autocast off (as routers are), and the
streams are mixed in their own dtype, fp32 under autocast: a bf16 matmul would round the residual stream at
every sublayer. Each connection has a readable reference beside it (:func:`hyper_reference`,
:func:`mhc_reference`: the papers' equations stream by stream), tested equal.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .init import Init, init_module
from .norm import build_norm

Branch = Callable[[torch.Tensor], torch.Tensor]  # a sublayer with its norms and dropout: (B, T, C) -> (B, T, C)


# ============================================================== plain
class PlainResidual(nn.Module):
    """x + f(x): the residual connection of every model before hyper-connections."""

    def forward(self, x: torch.Tensor, branch: Branch) -> torch.Tensor:
        return x + branch(x)

    def mixing_flops(self) -> float:
        return 0.0


class OneStream(nn.Module):
    """The stream of ``plain``: one vector per token, never widened or collapsed."""

    def widen(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def collapse(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def mixing_flops(self) -> float:
        return 0.0


def copies(x: torch.Tensor, n: int) -> torch.Tensor:
    """x (B, T, C) as n identical streams (B, T, n, C): H^0 = (h^0 ... h^0)ᵀ (Zhu et al. 2024, sec. 2.1)."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1]).contiguous()


def unweighted_rms_norm(x32: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last axis, no gain: what mHC normalizes the flattened streams with before projecting."""
    return x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)


def no_autocast(x: torch.Tensor) -> torch.autocast:
    return torch.autocast(device_type=x.device.type, enabled=False)


# ============================================================== hyper-connections (Zhu et al. 2024)
class HyperConnection(nn.Module):
    """Dynamic hyper-connections (DHC, Zhu et al. 2024, sec. 2.2, with tanh) around sublayer k.

        H̄    = norm(H)                                   per stream, the model's norm kind (the paper's LayerNorm)
        A    = s_α tanh(H̄ W_αᵀ) + [A_m | A_r]            (B, T, n, 1 + n): static plus input-dependent
        B    = s_β tanh(H̄ W_βᵀ) + B_static               (B, T, n)
        [h_in | H_r] = Aᵀ H                              width connection: the branch input and n residual streams
        H'   = B ⊗ f(h_in) + H_r                         depth connection

    Initialized as the paper's sec. 2.3: A_m = e_{k mod n}, A_r = I, B = 1, W_α = W_β = 0, s_α = s_β = 0.01, so
    at init every stream carries x + f(x) and the model computes what ``plain`` computes (a test checks it).
    W_α, W_β are stored as nn.Linear stores a weight, (out, in); the static [A_m | A_r] flat, (n (1 + n),): it is a
    gain, not a matrix to decay towards 0 (the optimizer decays parameters of two or more dimensions only)."""

    def __init__(self, cfg: ModelConfig, sublayer: int):
        super().__init__()
        n, C = cfg.n_streams, cfg.d_model
        self.n, self.sublayer = n, sublayer
        self.norm = build_norm(cfg)
        self.static_alpha = nn.Parameter(torch.empty(n * (1 + n)))  # [A_m | A_r] (n, 1 + n), column 0 the branch input
        self.static_beta = nn.Parameter(torch.empty(n))  # B
        self.alpha_fn = nn.Parameter(torch.empty(1 + n, C))  # W_α = [W_m | W_r]ᵀ
        self.beta_fn = nn.Parameter(torch.empty(1, C))  # W_βᵀ
        self.scale = nn.Parameter(torch.empty(2))  # (s_α, s_β)

    @torch.no_grad()
    def init_params(self, init: Init) -> None:
        init_module(self.norm, init)
        static = self.static_alpha.view(self.n, 1 + self.n)
        static.zero_()
        static[self.sublayer % self.n, 0] = 1.0  # A_m = e_{k mod n}
        static[:, 1:] = torch.eye(self.n)  # A_r = I
        self.static_beta.fill_(1.0)
        init.zeros(self.alpha_fn, self.beta_fn)
        self.scale.fill_(0.01)  # Zhu et al. 2024, App. J, Algorithm 2

    def coefficients(self, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(A (B, T, n, 1 + n), B (B, T, n)) in fp32 for the streams H (B, T, n, C)."""
        with no_autocast(H):
            normed = self.norm(H).float()
            s, static = self.scale.float(), self.static_alpha.float().view(self.n, 1 + self.n)
            alpha = s[0] * torch.tanh(F.linear(normed, self.alpha_fn.float())) + static
            beta = s[1] * torch.tanh(F.linear(normed, self.beta_fn.float())).squeeze(-1) + self.static_beta.float()
        return alpha, beta

    def forward(self, H: torch.Tensor, branch: Branch) -> torch.Tensor:
        alpha, beta = self.coefficients(H)
        with no_autocast(H):
            mixed = alpha.to(H.dtype).transpose(-1, -2) @ H  # (B, T, 1 + n, C)
        out = branch(mixed[..., 0, :])  # (B, T, C)
        with no_autocast(H):
            return torch.addcmul(mixed[..., 1:, :], beta.to(H.dtype).unsqueeze(-1), out.unsqueeze(-2))

    def mixing_flops(self) -> float:
        """Training FLOPs per token beyond 6 x its parameters: the width and depth connections' products
        (n (1 + n) C + n C multiply-adds) and W_α, W_β applied to n streams where 6N counts them once."""
        n, C = self.n, self.alpha_fn.shape[-1]
        return 6.0 * C * (n * (n + 1) + n + (n - 1) * (n + 2))


class SummedStreams(nn.Module):
    """The streams of ``hyper``: n copies of the embedding, summed after the last block (Zhu et al. 2024, sec. 2.1)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n = cfg.n_streams

    def widen(self, x: torch.Tensor) -> torch.Tensor:
        return copies(x, self.n)  # (B, T, n, C)

    def collapse(self, H: torch.Tensor) -> torch.Tensor:
        return H.sum(-2)  # (B, T, C)

    def mixing_flops(self) -> float:
        return 0.0  # additions only


def hyper_reference(H: torch.Tensor, branch: Branch, hc: HyperConnection) -> torch.Tensor:
    """:class:`HyperConnection`'s forward written out stream by stream, as Zhu et al. 2024's sec. 2 writes it:
    the reference its batched form is tested against."""
    n = hc.n
    streams = [H[..., j, :] for j in range(n)]  # n of (B, T, C)
    normed = [hc.norm(h).float() for h in streams]
    s_alpha, s_beta = hc.scale
    # alpha[j][i]: the weight of stream j in output i (i = 0: the branch input; i = 1 + k: residual stream k)
    static = hc.static_alpha.view(n, 1 + n)
    alpha = [[s_alpha * torch.tanh(normed[j] @ hc.alpha_fn[i].float()) + static[j, i] for i in range(1 + n)]
             for j in range(n)]
    beta = [s_beta * torch.tanh(normed[j] @ hc.beta_fn[0].float()) + hc.static_beta[j] for j in range(n)]
    h_in = sum(alpha[j][0].unsqueeze(-1) * streams[j] for j in range(n))
    out = branch(h_in)
    return torch.stack([beta[k].unsqueeze(-1) * out + sum(alpha[j][1 + k].unsqueeze(-1) * streams[j] for j in range(n))
                        for k in range(n)], dim=-2)


# ============================================================== manifold-constrained (DeepSeek-V4's mHC)
def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """A doubly-stochastic matrix (..., n, n) from logits by Sinkhorn-Knopp, as DeepSeek-V4 computes it: softmax
    over each row plus eps, the columns normalized, then ``iters - 1`` rounds of rows and columns, every
    normalizer plus eps. It ends on the columns: they sum to 1 up to eps, the rows as far as it has converged."""
    m = torch.softmax(logits, dim=-1) + eps
    m = m / (m.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(-1, keepdim=True) + eps)
        m = m / (m.sum(-2, keepdim=True) + eps)
    return m


class ManifoldHyperConnection(nn.Module):
    """Manifold-constrained hyper-connections around one sublayer (mHC: Xie et al. 2025, arXiv:2512.24880; as
    DeepSeek-V4 computes them, transformers' ``DeepseekV4HyperConnection``, weight for weight).

        x̃        = rmsnorm(flatten(H))                            (B, T, nC), no gain
        [p|q|c]  = x̃ fnᵀ                                          (B, T, n + n + n²)
        pre      = sigmoid(s_0 p + b_pre) + eps                   collapse weights (B, T, n)
        post     = 2 sigmoid(s_1 q + b_post)                      expand weights (B, T, n)
        C        = sinkhorn(s_2 c + b_comb)                       (B, T, n, n), rows and columns sum to 1
        H'       = Cᵀ H + post ⊗ f(preᵀ H)                        C[j, k]: stream j's weight in stream k

    Initialized as DeepSeek-V4 (transformers' ``_init_weights``): fn ~ N(0, init_std), base 0, scale 1."""

    def __init__(self, cfg: ModelConfig, sublayer: int):
        super().__init__()
        n, C, streams = cfg.n_streams, cfg.d_model, cfg.residual_streams
        self.n, self.iters, self.eps, self.norm_eps = n, streams.sinkhorn_iters, streams.eps, cfg.norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * C))  # rows: pre (n), post (n), comb (n x n, row-major)
        self.base = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))  # (s_pre, s_post, s_comb)

    @torch.no_grad()
    def init_params(self, init: Init) -> None:
        init.normal(self.fn, init.std)
        init.zeros(self.base)
        self.scale.fill_(1.0)

    def coefficients(self, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre (B, T, n), post (B, T, n), comb (B, T, n, n)) in fp32 for the streams H (B, T, n, C)."""
        n = self.n
        with no_autocast(H):
            mixes = F.linear(unweighted_rms_norm(H.flatten(-2).float(), self.norm_eps), self.fn.float())
            pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
            pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
            s = self.scale.float()
            pre = torch.sigmoid(pre_w * s[0] + pre_b) + self.eps
            post = 2 * torch.sigmoid(post_w * s[1] + post_b)
            comb = sinkhorn(comb_w.unflatten(-1, (n, n)) * s[2] + comb_b.view(n, n), self.iters, self.eps)
        return pre, post, comb

    def forward(self, H: torch.Tensor, branch: Branch) -> torch.Tensor:
        pre, post, comb = self.coefficients(H)
        with no_autocast(H):
            h = (pre.unsqueeze(-2) @ H.float()).squeeze(-2).to(H.dtype)  # (B, T, C): preᵀ H
        out = branch(h)  # (B, T, C)
        with no_autocast(H):
            mixed = comb.to(H.dtype).transpose(-1, -2) @ H  # (B, T, n, C): Cᵀ H
            return torch.addcmul(mixed, post.to(H.dtype).unsqueeze(-1), out.unsqueeze(-2))

    def mixing_flops(self) -> float:
        """Training FLOPs per token beyond 6 x its parameters: preᵀ H, Cᵀ H and post ⊗ f, (n + n² + n) C
        multiply-adds (the projection fn is a parameter matrix: 6N counts it)."""
        n, C = self.n, self.fn.shape[-1] // self.n
        return 6.0 * C * (n * n + 2 * n)


class HyperHead(nn.Module):
    """The streams of ``mhc``: n copies of the embedding, and after the last block a learned collapse with
    weights pre = sigmoid(s rmsnorm(flatten(H)) fnᵀ + base) + eps (DeepSeek-V4's ``DeepseekV4HyperHead``,
    before the final norm). Initialized as DeepSeek-V4: fn ~ N(0, init_std), base 0, scale 1."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n, C = cfg.n_streams, cfg.d_model
        self.n, self.eps, self.norm_eps = n, cfg.residual_streams.eps, cfg.norm_eps
        self.fn = nn.Parameter(torch.empty(n, n * C))
        self.base = nn.Parameter(torch.empty(n))
        self.scale = nn.Parameter(torch.empty(1))

    @torch.no_grad()
    def init_params(self, init: Init) -> None:
        init.normal(self.fn, init.std)
        init.zeros(self.base)
        self.scale.fill_(1.0)

    def widen(self, x: torch.Tensor) -> torch.Tensor:
        return copies(x, self.n)  # (B, T, n, C)

    def weights(self, H: torch.Tensor) -> torch.Tensor:
        """The collapse weights (B, T, n), fp32, of the streams H (B, T, n, C)."""
        with no_autocast(H):
            mixes = F.linear(unweighted_rms_norm(H.flatten(-2).float(), self.norm_eps), self.fn.float())
            return torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.eps

    def collapse(self, H: torch.Tensor) -> torch.Tensor:
        pre = self.weights(H)
        with no_autocast(H):
            return (pre.unsqueeze(-2) @ H.float()).squeeze(-2).to(H.dtype)  # (B, T, C)

    def mixing_flops(self) -> float:
        return 6.0 * self.n * (self.fn.shape[-1] // self.n)  # preᵀ H


def mhc_reference(H: torch.Tensor, branch: Branch, hc: ManifoldHyperConnection) -> torch.Tensor:
    """:class:`ManifoldHyperConnection`'s forward written out stream by stream: the reference its batched form is
    tested against. comb[j][k] is stream j's weight in output stream k."""
    n = hc.n
    x = H.flatten(-2).float()
    x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + hc.norm_eps)
    logits = x @ hc.fn.float().T  # (B, T, (2 + n) n)
    s, b = hc.scale.float(), hc.base.float()
    pre = [torch.sigmoid(logits[..., j] * s[0] + b[j]) + hc.eps for j in range(n)]
    post = [2 * torch.sigmoid(logits[..., n + j] * s[1] + b[n + j]) for j in range(n)]
    comb = sinkhorn(logits[..., 2 * n:].unflatten(-1, (n, n)) * s[2] + b[2 * n:].view(n, n), hc.iters, hc.eps)
    streams = [H[..., j, :] for j in range(n)]
    out = branch(sum(pre[j].unsqueeze(-1) * streams[j].float() for j in range(n)).to(H.dtype))
    return torch.stack([post[k].unsqueeze(-1) * out + sum(comb[..., j, k].unsqueeze(-1) * streams[j] for j in range(n))
                        for k in range(n)], dim=-2)


# ============================================================== the registry
@dataclasses.dataclass(frozen=True)
class ResidualChoice:
    """What one value of ``ModelConfig.residual`` builds: the connection around each sublayer, given the
    sublayer's index, and the model's streams (widened after the embedding, collapsed before the final norm)."""

    connection: Callable[[ModelConfig, int], nn.Module]
    streams: Callable[[ModelConfig], nn.Module]


RESIDUALS = {
    "plain": ResidualChoice(lambda cfg, sublayer: PlainResidual(), lambda cfg: OneStream()),
    "hyper": ResidualChoice(HyperConnection, SummedStreams),
    "mhc": ResidualChoice(ManifoldHyperConnection, HyperHead),
}


def build_connection(cfg: ModelConfig, sublayer: int) -> nn.Module:
    """The connection around sublayer ``sublayer`` (attention of layer l: 2l, its feed-forward: 2l + 1)."""
    return RESIDUALS[cfg.residual].connection(cfg, sublayer)


def build_streams(cfg: ModelConfig) -> nn.Module:
    """The model's (or an MTP module's) streams: ``widen`` (B, T, C) -> the stream, ``collapse`` back."""
    return RESIDUALS[cfg.residual].streams(cfg)
