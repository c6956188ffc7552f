"""DeepSeek Sparse Attention (DSA; DeepSeek-V3.2, DeepSeek-AI 2025, "DeepSeek-V3.2-Exp: Boosting Long-Context
Efficiency with DeepSeek Sparse Attention", sec. 2.1): multi-head latent attention (``mla.py``) in which each query
attends only to the ``topk`` keys a small "lightning indexer" ranks highest.

    x ─┬─ W_DQ ─ norm ─▶ c_q ─┬─ W_UQ ─▶ MLA's queries                         (the query latent, shared)
       │                      └─ W_Q^I ─▶ q^I_{t,j}   H^I indexer heads of d^I, rotary on the first d^R (half layout)
       ├─ W_K^I ─ LayerNorm ─▶ k^I_s                  one indexer key per token, cached beside MLA's latent
       └─ W_w ─▶ w_{t,j}                              a weight per indexer head
    I_{t,s} = sum_j w_{t,j} ReLU(q^I_{t,j} · k^I_s / sqrt(d^I)) / sqrt(H^I)           (eq. 1, scaled as released)
    S_t = the topk keys s <= t of largest I_{t,s};  u_t = MLA(h_t, {c_s : s in S_t})   (eq. 2)

The selection is not differentiable. The indexer learns from its own loss (sec. 2.1.1, sparse training stage):
D_KL(p_{t,S_t} || softmax(I_{t,S_t})), where p is the main attention's probabilities summed over its heads and
L1-normalized over S_t; its inputs are detached, so that loss trains the indexer only and the language-modeling
loss the rest. Here it is averaged over queries and returned as the auxiliary loss ``indexer`` (times
``dsa.indexer_loss_coef``), which the model adds to its loss in training.

Two ways to attend to the selected keys, tested equal:
  - masked (the reference): MLA's own paths (expanded, fused, absorbed) over every key, the unselected masked out;
  - gathered (the cached decoding step): the absorbed path over the topk selected latents alone, gathered per
    query, so a decoding step reads topk cached latents, not all of them (what makes DSA's decoding cheap).

The decode cache holds per token MLA's latent and rotary key and the indexer key (``SparseVariant.cache_widths``).
Checkpoints follow ``transformers``' DeepseekV32 (``hf/deepseek_v32.py`` maps the names); like it, the indexer
scores in fp32 without DeepSeek's Hadamard rotation and FP8 scoring, which change rounding only.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from .attention import KVCache, StaticKVCache
from .attention_variants import SparseAttentionArgs
from .init import Init
from .mla import LatentAttention, LowRankProjection, softmax_probs
from .positions import AttentionTerm, Context, rotate_half

INDEXER_NORM_EPS = 1e-6  # the indexer key's LayerNorm, as DeepSeek's released code builds it


class Indexer(nn.Module):
    """The lightning indexer: index scores I (B, T, S) of T queries over S keys (eq. 1), in fp32."""

    def __init__(self, args: SparseAttentionArgs):
        super().__init__()
        dsa, m = args.dsa, args.latent.mla
        self.heads, self.head_dim, self.rotary = dsa.indexer_heads, dsa.indexer_head_dim, m.qk_rope_head_dim
        self.q = nn.Linear(m.q_lora_rank, self.heads * self.head_dim, bias=False)  # from MLA's query latent
        self.k = nn.Linear(args.latent.d_model, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEXER_NORM_EPS)
        self.weights = nn.Linear(args.latent.d_model, self.heads, bias=False)

    def init_params(self, init: Init) -> None:
        for linear in (self.q, self.k, self.weights):
            init.weight(linear.weight, init.std, deepnorm_gain=1.0)
        self.k_norm.weight.fill_(1.0)
        self.k_norm.bias.zero_()

    def rotate(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        """Rotary on the first qk_rope_head_dim dimensions of each head, pairs (j, j + d^R/2) whatever MLA's layout,
        with MLA's tables (the released indexer rotates that way)."""
        r = self.rotary
        return torch.cat((rotate_half(x[..., :r], ctx.state).to(x.dtype), x[..., r:]), dim=-1)

    def keys(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        """The indexer key of each token (B, 1, T, d^I), rotated: what the cache keeps."""
        return self.rotate(self.k_norm(self.k(x))[:, None], ctx)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, keys: torch.Tensor, ctx: Context) -> torch.Tensor:
        """Index scores (B, T, S) of the queries of ``x`` (B, T, C) and ``q_latent`` (B, T, q_lora_rank) over ``keys``
        (B, 1, S, d^I); -inf where ``ctx`` hides the key. Laid out as transformers' DeepseekV32Indexer computes them
        (a (B, T, H^I, S) product, then the heads' weighted sum as one), so that both round alike."""
        B, T, _ = x.shape
        q = self.rotate(self.q(q_latent).view(B, T, self.heads, self.head_dim).transpose(1, 2), ctx)  # (B, H^I, T, d^I)
        relu = F.relu(q.transpose(1, 2).float() @ keys.float().transpose(-2, -1) * self.head_dim**-0.5)  # (B,T,H^I,S)
        w = self.weights(x).float() * self.heads**-0.5  # (B, T, H^I)
        scores = (w[:, :, None] @ relu)[:, :, 0]  # (B, T, S): the indexer heads' weighted sum
        visible = ctx.visible()
        return scores if visible is None else scores.masked_fill(~visible[:, 0], float("-inf"))


@dataclasses.dataclass
class Selection:
    """The keys each query attends to: ``index`` (B, T, k) into the S keys, of which ``ok`` (B, T, k) are visible
    (a query with fewer than k visible keys selects some hidden ones, never attended to), and the same as a mask
    ``mask`` (B, 1, T, S) of the visible selected keys."""

    index: torch.Tensor
    ok: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def top(cls, scores: torch.Tensor, topk: int) -> "Selection":
        """The ``topk`` keys of largest index score per query (every key where there are no more than that)."""
        values, index = scores.topk(min(topk, scores.shape[-1]), dim=-1)  # (B, T, k)
        ok = values > float("-inf")
        mask = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, index, ok)[:, None]  # (B, 1, T, S)
        return cls(index, ok, mask)

    def context(self, ctx: Context) -> Context:
        """``ctx`` with its mask narrowed to the selected keys: every MLA path then attends to those alone."""
        return dataclasses.replace(ctx, mask=self.mask, is_causal=False)


class SparseLatentAttention(LatentAttention):
    """DeepSeek Sparse Attention, the ``dsa`` variant: :class:`~lmlab.mla.LatentAttention` with a lightning indexer
    choosing each query's keys, built from its own config (``SparseAttentionArgs``). ``aux_losses`` after a forward
    in training: ``{"indexer": the indexer's KL loss times its coefficient}``; empty otherwise."""

    def __init__(self, args: SparseAttentionArgs, layer: int, term: AttentionTerm):
        super().__init__(args.latent, layer, term)
        if not isinstance(self.q, LowRankProjection):
            raise ValueError("the dsa variant reads MLA's query latent; set mla.q_lora_rank")
        self.indexer = Indexer(args)
        self.topk, self.loss_coef = args.dsa.topk, args.dsa.indexer_loss_coef
        self.aux_losses: dict[str, torch.Tensor] = {}

    def set_impl(self, impl: str) -> None:
        """MLA's choices over the selected keys (``sdpa``: masked through the fused kernel without a cache, gathered
        with one; ``explicit``: the masked reference everywhere; ``absorbed``: masked absorbed everywhere), and
        ``gathered``: gathered everywhere."""
        masked = {"sdpa": self.attend_expanded_sdpa, "explicit": self.attend_expanded, "absorbed": self.attend_absorbed}
        if impl not in (*masked, "gathered"):
            raise ValueError(f"attention impl={impl!r} is not a valid choice for dsa; choose one of "
                             f"{[*masked, 'gathered']}")
        # bound methods in partials, so that a deep copy of the model attends with its own weights
        self.attend = functools.partial(self.attend_masked, masked[impl]) if impl in masked else self.attend_gathered
        self.attend_cached = self.attend_gathered if impl == "sdpa" else self.attend
        self.impl = impl

    def attend_masked(self, path, q_nope, q_rope, latent, k_rope, ctx: Context, selection: Selection) -> torch.Tensor:
        """MLA's attention ``path`` (``mla.LatentAttention.attend_*``) over each query's selected keys: every other key
        masked out."""
        return path(q_nope, q_rope, latent, k_rope, selection.context(ctx))

    def init_params(self, init: Init) -> None:
        super().init_params(init)
        self.indexer.init_params(init)

    def forward(self, x: torch.Tensor, ctx: Context, cache: KVCache | StaticKVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        _, r, v, _ = self.widths
        q_latent = self.q.norm(self.q.down(x))  # (B, T, q_lora_rank): MLA's and the indexer's
        q_nope, q_rope = self.queries(self.q.up(q_latent), ctx)  # (B, H, T, n), (B, H, T, r)
        latent, k_rope = self.latents(x, ctx)  # (B, 1, T, c), (B, 1, T, r)
        grad = self.training and torch.is_grad_enabled()  # the indexer learns from its own loss alone: detached inputs
        index_keys = self.indexer.keys(x.detach() if grad else x, ctx)  # (B, 1, T, d^I)
        attend = self.attend
        if cache is not None:  # the indexer keys ride beside the rotary keys
            latent, both = cache.update(self.layer, latent, torch.cat((k_rope, index_keys), dim=-1))
            k_rope, index_keys = both.split([r, both.shape[-1] - r], dim=-1)
            attend = self.attend_cached
        with torch.set_grad_enabled(grad):
            scores = self.indexer(x.detach(), q_latent.detach(), index_keys, ctx)  # (B, T, S)
        selection = Selection.top(scores.detach(), self.topk)
        y = attend(q_nope, q_rope, latent, k_rope, ctx, selection)  # (B, H, T, v)
        self.aux_losses = {"indexer": self.loss_coef * self.indexer_loss(
            scores, selection, q_nope, q_rope, latent, k_rope, ctx)} if grad else {}
        return self.out(y.transpose(1, 2).reshape(B, T, self.n_heads * v))

    # ---- the gathered path: the selected latents alone
    def attend_gathered(self, q_nope, q_rope, latent, k_rope, ctx: Context, selection: Selection) -> torch.Tensor:
        """The absorbed path (``mla.LatentAttention.attend_absorbed``) over each query's k selected latents,
        gathered: (B, T, k, c) rather than (B, S, c), so the work per query is k whatever the context."""
        B, H, T, _ = q_nope.shape
        w_uk, w_uv = self.up_weights()
        rows = torch.arange(B, device=q_nope.device)[:, None, None]
        c_kv = latent[:, 0][rows, selection.index]  # (B, T, k, c)
        k_r = k_rope[:, 0][rows, selection.index]  # (B, T, k, r)
        q_latent = torch.einsum("bhtn,hnc->bthc", q_nope, w_uk.to(q_nope.dtype))  # (B, T, H, c)
        scores = (q_latent @ c_kv.to(q_latent.dtype).transpose(-2, -1)  # (B, T, H, k)
                  + q_rope.transpose(1, 2) @ k_r.to(q_rope.dtype).transpose(-2, -1)) * self.scale
        scores = scores.masked_fill(~selection.ok[:, :, None], float("-inf"))
        probs = F.dropout(scores.float().softmax(dim=-1).to(scores.dtype), self.dropout, self.training)
        mixed = probs @ c_kv.to(probs.dtype)  # (B, T, H, c)
        return torch.einsum("bthc,hvc->bhtv", mixed, w_uv.to(mixed.dtype))  # (B, H, T, v)

    # ---- the indexer's loss
    def indexer_loss(self, scores, selection: Selection, q_nope, q_rope, latent, k_rope, ctx: Context) -> torch.Tensor:
        """KL(p || softmax(I)) over each query's selected keys, averaged over the queries (sec. 2.1.1): p is the main
        attention's probabilities summed over its heads and L1-normalized, a fixed target (no gradient)."""
        with torch.no_grad():
            keys, _ = self.expand(latent, k_rope)
            q = torch.cat((q_nope, q_rope), dim=-1)
            probs = softmax_probs((q @ keys.transpose(-2, -1)) * self.scale, selection.context(ctx), 0.0, False)
            target = probs.float().sum(1)  # (B, T, S)
            target = target / target.sum(-1, keepdim=True)
        chosen = selection.mask[:, 0]  # (B, T, S)
        log_q = scores.masked_fill(~chosen, float("-inf")).log_softmax(-1)
        kl = target * (target.clamp_min(torch.finfo(target.dtype).tiny).log() - log_q)
        return kl.masked_fill(~chosen, 0.0).sum(-1).mean()
