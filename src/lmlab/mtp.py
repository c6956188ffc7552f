"""Multi-token prediction (DeepSeek-V3, Liu et al. 2024, arXiv:2412.19437, sec. 2.2): D sequential
modules after the main model; module k predicts the token k + 1 places ahead, keeping the causal
chain of predictions (unlike parallel heads, Gloeckle et al. 2024).

    h^0_i  = the main model's final hidden state at position i (after its final norm)
    module k = 1 .. D, at every position i:
        x_i    = eh_proj([enorm(Emb(t_{i+k})) ; hnorm(h^{k-1}_i)])       (2d -> d)
        h^k_i  = block(x)_i                                              one causal Transformer block
        p^k_i  = softmax(head(norm(h^k_i)))                              predicts t_{i+k+1}
    L_MTP  = loss_weight / D * sum_k CE(p^k, t_{i+k+1})                  eq. 24-25

``Emb`` and ``head`` are the main model's (shared, as in the paper). The concatenation puts the
embedding first: eq. 21 writes [h; emb], but DeepSeek's released ``eh_proj`` weights are read
with the embedding first (vLLM's and SGLang's DeepSeek MTP layers). The token embedding is the
main model's, times its ``embed_scale``; absolute position embeddings are not added again (h^{k-1}
carries them), and the block uses the main model's position scheme at the same positions.

Weight names, and where DeepSeek-V3's checkpoint keeps them (L = num_hidden_layers; the MTP module
k = 0 .. D-1 is its layer L + k; ``transformers``' main model ignores these layers and its ``MtpModel``
reads them; ``lmlab.hf`` maps them both ways):

===============================  ==============================================================
lmlab                            DeepSeek-V3 checkpoint
===============================  ==============================================================
``mtp.layers.{k}.enorm``         ``model.layers.{L+k}.enorm``
``mtp.layers.{k}.hnorm``         ``model.layers.{L+k}.hnorm``
``mtp.layers.{k}.eh_proj``       ``model.layers.{L+k}.eh_proj``
``mtp.layers.{k}.block.*``       ``model.layers.{L+k}.*`` (attention, MLP/MoE, its two norms),
                                 named as for ``blocks.{i}`` and ``model.layers.{i}``
``mtp.layers.{k}.norm``          ``model.layers.{L+k}.shared_head.norm``
``head`` (shared)                ``model.layers.{L+k}.shared_head.head`` (a copy of ``lm_head``)
``embed`` (shared)               ``model.layers.{L+k}.embed_tokens`` (a copy of ``embed_tokens``)
===============================  ==============================================================

:func:`checkpoint_prefixes` gives the same table as data, for a loader.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .config import ModelConfig
from .loss import IGNORE_INDEX
from .norm import build_norm
from .positions import Context
from .residual import build_streams

Embed = Callable[[torch.Tensor], torch.Tensor]  # token ids (B, T) -> scaled embeddings (B, T, C)
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (hidden, head weight, targets) -> CE


def checkpoint_prefixes(n_layers: int, depth: int) -> dict[str, str]:
    """lmlab name prefix -> DeepSeek-V3 checkpoint prefix for every MTP module (the module docstring's
    table); a block's own weights below ``mtp.layers.{k}.block`` map as the main blocks' do."""
    out = {}
    for k in range(depth):
        src, dst = f"mtp.layers.{k}", f"model.layers.{n_layers + k}"
        out.update({f"{src}.{name}": f"{dst}.{name}" for name in ("enorm", "hnorm", "eh_proj")})
        out.update({f"{src}.norm": f"{dst}.shared_head.norm", f"{src}.block": dst})
    return out


def shift_left(t: torch.Tensor, k: int, fill: int = IGNORE_INDEX) -> torch.Tensor:
    """t (B, T) moved k places to the left, the last k places ``fill``: shift_left(t, k)[:, i] = t[:, i + k]."""
    if k == 0:
        return t
    return torch.cat([t[:, k:], t.new_full((t.shape[0], min(k, t.shape[1])), fill)], dim=1)[:, : t.shape[1]]


class MTPModule(nn.Module):
    """One depth: h^k = block(eh_proj([enorm(emb) ; hnorm(h^{k-1})])); ``norm`` is applied before the head.
    Under hyper-connections (``residual``) the block's input is widened to its streams and collapsed after it by
    the module's own ``streams``, as the main model's are; nothing at all under ``plain``. (DeepSeek-V4's own MTP
    layer is not checked against this: transformers' deepseek_v4 does not load its MTP weights.)"""

    def __init__(self, cfg: ModelConfig, block: nn.Module):
        super().__init__()
        self.enorm, self.hnorm = build_norm(cfg), build_norm(cfg)
        self.eh_proj = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False)
        self.block = block
        # as the main model: a block that ends with a norm (post-norm) needs none before the head
        self.norm = build_norm(cfg) if block.final_norm else nn.Identity()
        self.streams = build_streams(cfg)

    def forward(self, h_prev: torch.Tensor, emb: torch.Tensor, ctx: Context, cache=None) -> torch.Tensor:
        """h_prev (B, T, C) = h^{k-1}, emb (B, T, C) = Emb(t_{i+k}) -> h^k (B, T, C), before ``norm``."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h_prev)], dim=-1))  # (B, T, 2C) -> (B, T, C)
        return self.streams.collapse(self.block(self.streams.widen(x), ctx, cache))


class MultiTokenPrediction(nn.Module):
    """The D modules and their loss. ``make_block(layer)`` builds the Transformer block of layer
    ``n_layers + k`` as the main model builds its own (mixture-of-experts where the config makes that
    layer one, as DeepSeek-V3's MTP layer is)."""

    def __init__(self, cfg: ModelConfig, make_block: Callable[[int], nn.Module]):
        super().__init__()
        self.depth, self.loss_weight = cfg.mtp.depth, cfg.mtp.loss_weight
        self.layers = nn.ModuleList(MTPModule(cfg, make_block(cfg.n_layers + k)) for k in range(self.depth))
        self.moe_layers = [m.block.ffn for m in self.layers if hasattr(m.block.ffn, "aux_loss")]

    def hidden_states(self, h0: torch.Tensor, next_tokens: torch.Tensor, ctx: Context,
                      embed: Embed) -> list[torch.Tensor]:
        """Every depth's normed hidden states [norm_k(h^k)] (D of (B, T, C)), the head's inputs, from the main
        model's h0 (B, T, C) and ``next_tokens`` (B, T), the token after each position (t_{i+1}; IGNORE_INDEX
        where unknown: embedded as id 0, and every prediction from it is meaningless)."""
        out, h = [], h0
        for k, module in enumerate(self.layers):
            h = module(h, embed(shift_left(next_tokens, k).clamp(min=0)), ctx)
            out.append(module.norm(h))
        return out

    def losses(self, h0: torch.Tensor, targets: torch.Tensor, ctx: Context, embed: Embed, head_weight: torch.Tensor,
               loss_fn: LossFn) -> dict[str, torch.Tensor]:
        """{"mtp": loss_weight * mean over depths of CE(p^k, t_{i+k+1})}, plus each MTP MoE layer's own
        auxiliary losses, by name. ``targets`` (B, T) are the main model's: targets[:, i] = t_{i+1}.
        Depth k's targets are ``shift_left(targets, k)``; a position whose input token t_{i+k} (at any
        depth up to k) is ignored is ignored too."""
        per_depth, ignored = [], torch.zeros_like(targets, dtype=torch.bool)
        for k, h in enumerate(self.hidden_states(h0, targets, ctx, embed), start=1):
            ignored = ignored | (shift_left(targets, k - 1) == IGNORE_INDEX)
            per_depth.append(loss_fn(h, head_weight, shift_left(targets, k).masked_fill(ignored, IGNORE_INDEX)))
        out = {"mtp": self.loss_weight * torch.stack(per_depth).mean()}
        for moe in self.moe_layers:
            for name, value in moe.aux_losses.items():
                out[name] = out.get(name, 0.0) + value
        return out


class NoMTP(nn.Module):
    """No multi-token prediction (``mtp=None``): no modules, no losses."""

    depth = 0
    moe_layers: list[nn.Module] = []
    layers: list[nn.Module] = []

    def losses(self, h0, targets, ctx, embed, head_weight, loss_fn) -> dict[str, torch.Tensor]:
        return {}


def build_mtp(cfg: ModelConfig, make_block: Callable[[int], nn.Module]) -> nn.Module:
    """:class:`MultiTokenPrediction` for ``cfg.mtp``, or :class:`NoMTP` when it is None."""
    return NoMTP() if cfg.mtp is None else MultiTokenPrediction(cfg, make_block)
