"""Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434 sec. 2.1; DeepSeek-V3 the same).

    x ─┬─ W_DQ ─ norm ─ W_UQ ─▶ q = [q_nope | q_rope]  per head (one W_Q when q_lora_rank is None)
       └─ W_DKV ──────────────▶ [c | k_rope]           per token: the latent c and one rotary key for all heads
                c ─ norm ─ W_UK ─▶ k_nope,  ─ W_UV ─▶ v  per head
    score = (q_nope · k_nope + rot(q_rope) · rot(k_rope)) / sqrt(d_nope + d_rope)

What a token leaves in the decode cache is what its keys and values are made from: the normalized
latent c (kv_lora_rank values) and the rotated k_rope (qk_rope_head_dim values), in place of
2 x n_heads x head_dim keys and values (``attention_variants.LatentVariant``, which holds the variant's
facts: its section ``MLAConfig``, widths, cache layout, score scale).

Two ways to compute the same attention, tested equal:
  - expanded (the reference; also the cheaper one in training and prefill, where every key is new):
    k_nope and v are up-projected from every latent, then ordinary attention over H heads;
  - absorbed (the decoding path, sec. 2.1.2: "W_UK can be absorbed into W_Q, and W_UV into W_O"):
    q_nope · (W_UK c) = (W_UK^T q_nope) · c, so each head's query is mapped into latent space once,
    attention runs over the cached latents themselves as one key/value head shared by all H query
    heads, and W_UV maps each head's mixed latent out afterwards. No cached token is up-projected.

Checkpoints follow ``transformers``' DeepseekV2/V3 attention (``hf/deepseek.py`` maps the names).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import KVCache, StaticKVCache
from .attention_variants import LatentAttentionArgs, softmax_scale, yarn_mscale  # noqa: F401  (lmlab.mla.softmax_scale too)
from .init import Init, init_module
from .norm import RMSNorm
from .positions import AttentionTerm, Context

# The latents' RMSNorms use 1e-6 whatever the model's norm_eps: DeepSeek's released code (and
# transformers' port) builds them with the RMSNorm default.
LATENT_NORM_EPS = 1e-6


class LowRankProjection(nn.Module):
    """x -> W_up norm(W_down x): a projection through a normalized rank-r bottleneck (W_DQ, W_UQ)."""

    def __init__(self, d_in: int, rank: int, d_out: int, bias: bool):
        super().__init__()
        self.down = nn.Linear(d_in, rank, bias=bias)
        self.norm = RMSNorm(rank, LATENT_NORM_EPS)
        self.up = nn.Linear(rank, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.norm(self.down(x)))


def softmax_probs(scores: torch.Tensor, ctx: Context, dropout: float, training: bool) -> torch.Tensor:
    """softmax over the keys each query may see, (B, H, T, S), with attention dropout."""
    visible = ctx.visible()
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    return F.dropout(scores.float().softmax(dim=-1).to(scores.dtype), dropout, training)


class LatentAttention(nn.Module):
    """Multi-head latent attention, the ``mla`` variant, built from its own config (``LatentAttentionArgs``).
    The interface of :class:`~lmlab.attention.Attention`: ``forward(x, ctx, cache)``, ``set_impl``, ``term``."""

    def __init__(self, args: LatentAttentionArgs, layer: int, term: AttentionTerm):
        super().__init__()
        m = args.mla
        self.layer, self.n_heads, self.dropout = layer, args.n_heads, args.dropout
        self.widths = (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank)
        H, D = args.n_heads, args.d_model
        if m.q_lora_rank is None:  # DeepSeek-V2-Lite: a full-rank query projection
            self.q = nn.Linear(D, H * m.qk_head_dim, bias=args.qkv_bias)
        else:
            self.q = LowRankProjection(D, m.q_lora_rank, H * m.qk_head_dim, args.qkv_bias)
        self.kv_down = nn.Linear(D, m.kv_lora_rank + m.qk_rope_head_dim, bias=args.qkv_bias)  # [W_DKV; W_KR]
        self.kv_norm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_up = nn.Linear(m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim), bias=False)  # [W_UK; W_UV]
        self.out = nn.Linear(H * m.v_head_dim, D, bias=args.out_bias)
        self.scale = args.scale  # softmax_scale: 1 / sqrt(n + r), with DeepSeek's YaRN temperature
        self.term = term  # the rotary term: turns q_rope and k_rope
        self.set_impl("sdpa")

    def set_impl(self, impl: str) -> None:
        """``sdpa`` (default): expanded through the fused kernel without a cache, absorbed with one;
        ``explicit``: the expanded reference, written out, everywhere; ``absorbed``: absorbed everywhere."""
        paths = {
            "sdpa": (self.attend_expanded_sdpa, self.attend_absorbed),
            "explicit": (self.attend_expanded, self.attend_expanded),
            "absorbed": (self.attend_absorbed, self.attend_absorbed),
        }
        if impl not in paths:
            raise ValueError(f"attention impl={impl!r} is not a valid choice for mla; choose one of {list(paths)}")
        self.attend, self.attend_cached = paths[impl]
        self.impl = impl

    def init_params(self, init: Init) -> None:
        """Matrices ~ N(0, std), the output projection ~ N(0, out_std); norm gains 1, biases 0. DeepNorm:
        Xavier-normal with gain β for W_UV and the output, 1 for the rest (Wang et al. 2022, Algorithm 1)."""
        n, _, v, _ = self.widths
        for module in self.q.modules():
            if isinstance(module, nn.Linear):
                init.weight(module.weight, init.std, deepnorm_gain=1.0)
                init.zeros(module.bias)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        init.weight(self.kv_down.weight, init.std, deepnorm_gain=1.0)
        init.weight(self.kv_up.weight, init.std, deepnorm_gain=(1.0, init.beta) * self.n_heads,
                    rows=(n, v) * self.n_heads)
        self.kv_norm.weight.fill_(1.0)
        init.weight(self.out.weight, init.out_std, deepnorm_gain=init.beta)
        init.zeros(self.kv_down.bias, self.out.bias)
        init_module(self.term, init)

    def forward(self, x: torch.Tensor, ctx: Context, cache: KVCache | StaticKVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        v = self.widths[2]
        q_nope, q_rope = self.queries(self.q(x), ctx)  # (B, H, T, n), (B, H, T, r)
        latent, k_rope = self.latents(x, ctx)  # (B, 1, T, c), (B, 1, T, r)
        attend = self.attend
        if cache is not None:
            latent, k_rope = cache.update(self.layer, latent, k_rope)  # (B, 1, S, c), (B, 1, S, r)
            attend = self.attend_cached
        y = attend(q_nope, q_rope, latent, k_rope, ctx)  # (B, H, T, v)
        return self.out(y.transpose(1, 2).reshape(B, T, self.n_heads * v))

    def queries(self, q: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
        """Each head's query (B, H, T, n), and its rotary part, rotated (B, H, T, r), from the query projection's
        output ``q`` (B, T, H (n + r))."""
        B, T, _ = q.shape
        n, r, _, _ = self.widths
        q_nope, q_rope = q.view(B, T, self.n_heads, n + r).transpose(1, 2).split([n, r], dim=-1)
        return q_nope, self.term.rotate(q_rope, ctx)

    def latents(self, x: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
        """What a token leaves in the cache: its normalized latent (B, 1, T, c), one "head" shared by all heads, and
        its rotary key, rotated (B, 1, T, r)."""
        _, r, _, c = self.widths
        latent, k_rope = self.kv_down(x).split([c, r], dim=-1)  # (B, T, c), (B, T, r)
        return self.kv_norm(latent)[:, None], self.term.rotate(k_rope[:, None], ctx)

    # ---- the expanded path: keys and values up-projected from every latent
    def expand(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents (B, 1, S, c) and rotary keys (B, 1, S, r) -> keys (B, H, S, n + r), values (B, H, S, v)."""
        n, r, v, _ = self.widths
        B, _, S, _ = latent.shape
        H = self.n_heads
        kv = self.kv_up(latent[:, 0].to(self.kv_up.weight.dtype)).view(B, S, H, n + v).transpose(1, 2)
        k_nope, values = kv.split([n, v], dim=-1)  # (B, H, S, n), (B, H, S, v)
        keys = torch.cat((k_nope, k_rope.to(k_nope.dtype).expand(B, H, S, r)), dim=-1)
        return keys, values

    def attend_expanded(self, q_nope, q_rope, latent, k_rope, ctx: Context) -> torch.Tensor:
        """The reference: softmax(q k^T * scale) v over the expanded keys and values, written out."""
        keys, values = self.expand(latent, k_rope)
        q = torch.cat((q_nope, q_rope), dim=-1)  # (B, H, T, n + r)
        probs = softmax_probs((q @ keys.transpose(-2, -1)) * self.scale, ctx, self.dropout, self.training)
        return probs.to(values.dtype) @ values  # (B, H, T, v)

    def attend_expanded_sdpa(self, q_nope, q_rope, latent, k_rope, ctx: Context) -> torch.Tensor:
        """The expanded path through ``scaled_dot_product_attention`` (keys n + r wide, values v)."""
        keys, values = self.expand(latent, k_rope)
        q = torch.cat((q_nope, q_rope), dim=-1)
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=ctx.mask, is_causal=ctx.is_causal,
            dropout_p=self.dropout if self.training else 0.0, scale=self.scale,
        )

    # ---- the absorbed path: attention over the latents themselves
    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK (H, n, c) and W_UV (H, v, c), the two halves of each head's rows of ``kv_up``."""
        n, _, v, c = self.widths
        w = self.kv_up.weight.view(self.n_heads, n + v, c)
        return w[:, :n], w[:, n:]

    def attend_absorbed(self, q_nope, q_rope, latent, k_rope, ctx: Context) -> torch.Tensor:
        """q_nope · W_UK c = (W_UK^T q_nope) · c: queries move into latent space, the H heads attend
        over the shared latents as one (B, H·T, S) product, and W_UV maps each head's result out."""
        B, H, T, _ = q_nope.shape
        w_uk, w_uv = self.up_weights()
        c_kv, k_r = latent[:, 0], k_rope[:, 0]  # (B, S, c), (B, S, r)
        q_latent = torch.einsum("bhtn,hnc->bhtc", q_nope, w_uk.to(q_nope.dtype))  # (B, H, T, c)
        scores = (q_latent.flatten(1, 2) @ c_kv.to(q_latent.dtype).transpose(1, 2)  # (B, H·T, S)
                  + q_rope.flatten(1, 2) @ k_r.to(q_rope.dtype).transpose(1, 2))
        probs = softmax_probs(scores.view(B, H, T, -1) * self.scale, ctx, self.dropout, self.training)
        mixed = probs.flatten(1, 2) @ c_kv.to(probs.dtype)  # (B, H·T, c): each head's weighted latent
        return torch.einsum("bhtc,hvc->bhtv", mixed.view(B, H, T, -1), w_uv.to(mixed.dtype))  # (B, H, T, v)
