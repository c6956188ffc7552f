"""The decoder-only Transformer: blocks, the stack, heads, initialization and accounting.

    tokens ─ embed ─(+ absolute positions)─ widen ─ [block] × L ─ collapse ─ final norm (not post) ─ head ─ logits
                                                                              └─ MTP modules × D (mtp.py; loss, drafts)

Every choice is made here at construction from the config, through the registries of
``norm.py``, ``positions.py``, ``feedforward.py``, ``residual.py`` and this file's ``BLOCKS`` and
``ATTENTIONS``; forward passes contain no config branching. Under ``residual='plain'`` widen and collapse
are nothing and each (+) below is x + f(x); under ``hyper`` and ``mhc`` the stream is n vectors per token
and (+) is their connection (``residual.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .attention import Attention, KVCache, StaticKVCache
from .attention_variants import variant_of
from .compressed_attention import CompressedAttention
from .config import ModelConfig
from .feedforward import FFNS, feedforward_args
from .init import Init, init_module
from .loss import LOSSES
from .mla import LatentAttention
from .moe import HashRouter, MoE, UnbalancedExperts, balancing_line, moe_args
from .mtp import build_mtp
from .mup import build_readout, rescale_init
from .norm import build_norm
from .positions import (
    AttentionTerm,
    Context,
    PositionScheme,
    build_local_positions,
    build_positions,
    causal_context,
    padded_context,
    windowed,
)
from .residual import build_connection, build_streams
from .schema import check_choice
from .sparse_attention import SparseLatentAttention


# ============================================================== blocks
def build_dropout(cfg: ModelConfig) -> nn.Module:
    """Dropout at ``cfg.dropout``; at 0 nothing at all (``nn.Dropout(0)`` still dispatches an op per call)."""
    return nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, term: AttentionTerm):
        super().__init__()
        self.attn = build_attention(cfg, layer, term)
        self.ffn = build_ffn(cfg, layer)
        self.norm1, self.norm2 = build_norm(cfg), build_norm(cfg)
        self.drop = build_dropout(cfg)


class ResidualBlock(Block):
    """A block whose two sublayers join the stream through ``cfg.residual``'s connection (``residual.py``):
    ``connection(x, f)`` is x + f(x) under plain, the n streams' mix around f under hyper and mhc."""

    def __init__(self, cfg: ModelConfig, layer: int, term: AttentionTerm):
        super().__init__(cfg, layer, term)
        self.attn_residual, self.ffn_residual = build_connection(cfg, 2 * layer), build_connection(cfg, 2 * layer + 1)


class PreNormBlock(ResidualBlock):
    """x ─┬─ norm ─ attn ─(+)─┬─ norm ─ ffn ─(+)─▶      residual stream never normalized
          └──────────────────┘└──────────────────┘"""

    final_norm = True  # the stream is never normalized, so the model normalizes it once before the head

    def forward(self, x: torch.Tensor, ctx: Context, cache: KVCache | None = None) -> torch.Tensor:
        x = self.attn_residual(x, lambda h: self.drop(self.attn(self.norm1(h), ctx, cache)))
        x = self.ffn_residual(x, lambda h: self.drop(self.ffn(self.norm2(h))))
        return x


class PostNormBlock(Block):
    """x ─┬─ attn ─(+)─ norm ─┬─ ffn ─(+)─ norm ─▶      the sum is normalized (Vaswani et al. 2017)
          └─────(·α)─┘         └────(·α)─┘

    α = 1, or DeepNorm's (2L)^(1/4) for decoder-only models (Wang et al. 2022, Table 1). One stream only: the
    config refuses hyper-connections here (the norm would act on the mixed streams, which no paper defines)."""

    final_norm = False  # every block already ends with a norm

    def __init__(self, cfg: ModelConfig, layer: int, term: AttentionTerm):
        super().__init__(cfg, layer, term)
        self.alpha = deepnorm_alpha(cfg.n_layers) if cfg.residual_scaling == "deepnorm" else 1.0

    def forward(self, x: torch.Tensor, ctx: Context, cache: KVCache | None = None) -> torch.Tensor:
        x = self.norm1(self.alpha * x + self.drop(self.attn(x, ctx, cache)))
        x = self.norm2(self.alpha * x + self.drop(self.ffn(x)))
        return x


class SandwichNormBlock(ResidualBlock):
    """x ─┬─ norm ─ attn ─ norm ─(+)─┬─ norm ─ ffn ─ norm ─(+)─▶      each branch normalized in and out
          └─────────────────────────┘└────────────────────────┘      (Gemma 2/3; Ding et al. 2021's CogView)"""

    final_norm = True

    def __init__(self, cfg: ModelConfig, layer: int, term: AttentionTerm):
        super().__init__(cfg, layer, term)
        self.post_norm1, self.post_norm2 = build_norm(cfg), build_norm(cfg)

    def forward(self, x: torch.Tensor, ctx: Context, cache: KVCache | None = None) -> torch.Tensor:
        x = self.attn_residual(x, lambda h: self.drop(self.post_norm1(self.attn(self.norm1(h), ctx, cache))))
        x = self.ffn_residual(x, lambda h: self.drop(self.post_norm2(self.ffn(self.norm2(h)))))
        return x


class ReorderedNormBlock(ResidualBlock):
    """x ─┬─ attn ─ norm ─(+)─┬─ ffn ─ norm ─(+)─▶      the branch's output normalized, its input not
          └──────────────────┘└─────────────────┘      (OLMo 2, arXiv:2501.00656 sec. 3.1; Swin v2)"""

    final_norm = True

    def forward(self, x: torch.Tensor, ctx: Context, cache: KVCache | None = None) -> torch.Tensor:
        x = self.attn_residual(x, lambda h: self.drop(self.norm1(self.attn(h, ctx, cache))))
        x = self.ffn_residual(x, lambda h: self.drop(self.norm2(self.ffn(h))))
        return x


BLOCKS = {"pre": PreNormBlock, "post": PostNormBlock, "sandwich": SandwichNormBlock, "reordered": ReorderedNormBlock}
# attention.variant -> the module that computes it, built from the config its variant makes (module_config); the
# variant's facts (widths, cache layout, accounting, what it supports) are attention_variants.ATTENTION_VARIANTS'
ATTENTIONS = {"standard": Attention, "mla": LatentAttention, "dsa": SparseLatentAttention,
              "compressed": CompressedAttention}


class LayerContexts:
    """The context each layer attends with, made from the model's once per forward. Global layers
    take it as it is; local layers (``attention.pattern``) see only their window of it
    (:func:`~lmlab.positions.windowed`) and, with ``rope.local_base``, rotate with their own tables.
    NoPE layers (``rope.nope_every``) share their kind's context; their attention term ignores it."""

    def __init__(self, cfg: ModelConfig, positions: PositionScheme):
        self.kinds = [cfg.attention.kind(i) for i in range(cfg.n_layers)]
        self.window = cfg.attention.window
        self.local_positions = build_local_positions(cfg)  # None: the model's scheme, already in the context
        self.terms = [self.term(cfg, i, positions) for i in range(cfg.n_layers)]

    def term(self, cfg: ModelConfig, layer: int, positions: PositionScheme) -> AttentionTerm:
        """How positions enter layer ``layer``'s attention."""
        if not cfg.has_positions(layer):
            return AttentionTerm()
        local = self.kinds[layer] == "local" and self.local_positions is not None
        return (self.local_positions if local else positions).attention_term()

    def __call__(self, ctx: Context) -> list[Context]:
        """One context per layer from the model's ``ctx`` (which carries the model's scheme state)."""
        views = {"global": ctx}
        if self.window is not None:
            local = windowed(ctx, self.window)
            views["local"] = local if self.local_positions is None else self.local_positions.attach(local)
        return [views[kind] for kind in self.kinds]

    def reserve(self, n: int, device: torch.device) -> None:
        if self.local_positions is not None:
            self.local_positions.reserve(n, device)


def build_attention(cfg: ModelConfig, layer: int, term: AttentionTerm) -> nn.Module:
    """The attention sublayer of block ``layer``: the module of ``cfg``'s attention variant, given only its own
    config."""
    name = cfg.attention_variant
    if name not in ATTENTIONS:
        raise ValueError(f"attention.variant={name!r} is registered in attention_variants.ATTENTION_VARIANTS but has "
                         "no module in lmlab.model.ATTENTIONS; register the nn.Module that computes it there")
    return ATTENTIONS[name](variant_of(cfg).module_config(cfg), layer, term)


def build_ffn(cfg: ModelConfig, layer: int) -> nn.Module:
    """The feed-forward sublayer of block ``layer``: dense, or mixture-of-experts where configured."""
    return MoE(moe_args(cfg, layer)) if cfg.is_moe_layer(layer) else FFNS[cfg.ffn](feedforward_args(cfg))


def deepnorm_alpha(n_layers: int) -> float:
    return (2 * n_layers) ** 0.25


def deepnorm_beta(n_layers: int) -> float:
    return (8 * n_layers) ** -0.25


# ============================================================== outputs
@dataclasses.dataclass
class LMOutput:
    """What the model returns. ``logits`` (B, T, V) are made from ``hidden`` when first read: a
    training step that only reads the loss never holds them (the chunked loss does not need them),
    and code that reads them, with or without targets, gets the same values and gradients as
    ``model.head(hidden)``, under the autocast state of the forward."""

    hidden: torch.Tensor  # (B, T, C) final hidden states, after the final norm
    loss: torch.Tensor | None  # ce_loss + aux_loss; None without targets
    ce_loss: torch.Tensor | None  # mean next-token cross-entropy over non-ignored targets
    aux_loss: torch.Tensor  # sum of aux_losses (0 for a dense model without MTP)
    aux_losses: dict[str, torch.Tensor]  # each MoE auxiliary loss summed over layers, "mtp", "indexer"; weighted
    head: Callable[[torch.Tensor], torch.Tensor] = dataclasses.field(repr=False, compare=False)

    @functools.cached_property
    def logits(self) -> torch.Tensor:  # (B, T, V)
        return self.head(self.hidden)


def under_autocast_of(x: torch.Tensor,
                      fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn`` that runs under the autocast state in force now on x's device, whenever it is called."""
    device = x.device.type
    enabled = torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device)

    def call(h: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            return fn(h)

    return call


# ============================================================== the model
class Transformer(nn.Module):
    """A decoder-only language model built from a :class:`ModelConfig`.

    ``forward(idx, targets=None, cache=None) -> LMOutput``. Weights are initialized from
    ``config.init_seed``, so the same config always gives the same model.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = cfg = config
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.embed_scale == "sqrt_d" else 1.0
        self.positions = build_positions(cfg)
        self.layer_contexts = LayerContexts(cfg, self.positions)
        self.drop = build_dropout(cfg)
        self.blocks = nn.ModuleList(
            BLOCKS[cfg.norm_position](cfg, i, term) for i, term in enumerate(self.layer_contexts.terms)
        )
        self.streams = build_streams(cfg)  # widens the embedding to the residual's streams, collapses them at the end
        # post-norm already ends every block with a norm; the others need one before the head
        self.final_norm = build_norm(cfg) if BLOCKS[cfg.norm_position].final_norm else nn.Identity()
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.readout = build_readout(cfg)  # μP's logit multiplier on the head's input; nothing under standard
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        # after the head, so that a model with MTP draws the same main weights as one without
        # MTP blocks are global layers with the model's position scheme (DeepSeek-V3 has no windows)
        self.mtp = build_mtp(cfg, lambda layer: BLOCKS[cfg.norm_position](cfg, layer, self.positions.attention_term()))
        self.moe_layers = [b.ffn for b in self.blocks if hasattr(b.ffn, "aux_loss")]
        # routers that route by token id (moe.hash_layers): each forward hands them its ids before the blocks run
        self.hash_routers = [m.router for m in self.moe_layers if isinstance(m.router, HashRouter)]
        # every sublayer with auxiliary losses of its own: the MoE layers, and attention with a learned selection (dsa)
        self.aux_layers = [b.attn for b in self.blocks if hasattr(b.attn, "aux_losses")] + self.moe_layers
        # experts with no balancing term: said once, when the model first trains (see warn_unbalanced)
        self.warn_unbalanced = cfg.moe is not None and not cfg.moe.balancing
        self.set_loss_impl("chunked")
        if not self.embed.weight.is_meta:  # built on the meta device (shapes only, for accounting): no values to draw
            init_weights(self, cfg)

    # ---- forward
    def hidden(
        self, idx: torch.Tensor, cache: KVCache | StaticKVCache | None = None,
        attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final hidden states (B, T, C) for token ids (B, T); advances ``cache`` if given.

        ``attention_mask`` (B, T): 1 for real tokens, 0 for padding (left padding for generation).
        Pads are never attended to, and positions count real tokens only. The cache remembers it,
        so later forwards need none. The hidden states at pad positions are meaningless."""
        return self.hidden_and_context(idx, cache, attention_mask)[0]

    def context(self, idx: torch.Tensor, cache: KVCache | StaticKVCache | None = None,
                attention_mask: torch.Tensor | None = None) -> Context:
        """The positions and mask of a forward over ``idx`` (B, T) (see :meth:`hidden`), with the
        position scheme's tables attached."""
        B, T = idx.shape
        if cache is not None:
            cache.check_room(T, B)
            ctx = cache.context(T, attention_mask)
        elif attention_mask is not None:
            real = attention_mask.bool()
            pos = (real.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)
            ctx = padded_context(pos, pos, real)
        else:
            ctx = causal_context(0, T, idx.device)
        return self.positions.attach(ctx)

    def hidden_and_context(self, idx: torch.Tensor, cache: KVCache | StaticKVCache | None = None,
                           attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, Context]:
        """:meth:`hidden`, and the context it ran with (the MTP modules run at the same positions)."""
        if self.warn_unbalanced and self.training and torch.is_grad_enabled():
            self.warn_unbalanced = False
            warn_caller(balancing_line(self.config.moe), UnbalancedExperts)
        ctx = self.context(idx, cache, attention_mask)
        for router in self.hash_routers:
            router.tokens = idx  # (B, T): what the hash-routed layers route by
        x = self.drop(self.positions.embed(self.embed_tokens(idx), ctx))  # (B, T, C)
        x = self.streams.widen(x)  # (B, T, n, C) under hyper and mhc; plain: x itself
        for block, layer_ctx in zip(self.blocks, self.layer_contexts(ctx)):
            x = block(x, layer_ctx, cache)
        if cache is not None:
            cache.advance(idx.shape[1])
        return self.final_norm(self.streams.collapse(x)), ctx

    def embed_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        """Token embeddings (B, T, C) of ids (B, T), scaled by ``embed_scale``; no positions. The scale is
        rounded to the embeddings' dtype first, as Gemma does (sqrt(2304) = 48 is exact, in bf16 sqrt(3072)
        becomes 55.5); in fp32 that is the scale itself."""
        e = self.embed(idx)  # (B, T, C)
        return e if self.embed_scale == 1.0 else e * torch.tensor(self.embed_scale, dtype=e.dtype)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> LMOutput:
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(
                f"targets has shape {tuple(targets.shape)} but idx has {tuple(idx.shape)}; targets[b, t] is "
                "the token that follows idx[b, t] (IGNORE_INDEX = -100 to skip it), so the shapes must match"
            )
        h, ctx = self.hidden_and_context(idx, cache, attention_mask)  # (B, T, C)
        named = [(n, v) for layer in self.aux_layers for n, v in layer.aux_losses.items()]
        if targets is not None:  # multi-token prediction ("mtp", and its MoE layers' own) trains with targets only
            named += self.mtp.losses(h, targets, ctx, self.embed_tokens, self.head.weight, self.head_loss).items()
        aux_losses: dict[str, torch.Tensor] = {}
        for name, value in named:
            aux_losses[name] = aux_losses.get(name, 0.0) + value
        aux_loss = sum(aux_losses.values(), torch.zeros((), device=h.device))
        ce = loss = None
        if targets is not None:
            ce = self.head_loss(h, self.head.weight, targets)  # the chunked path never makes (B, T, V) logits
            loss = ce + aux_loss
        return LMOutput(h, loss, ce, aux_loss, aux_losses, head=under_autocast_of(h, self.logits_of))

    def logits_of(self, h: torch.Tensor) -> torch.Tensor:
        """The head's logits (..., V) of final hidden states h (..., C): what ``LMOutput.logits``
        reads, possibly after the forward. Under FSDP (``fully_shard``) the root's parameters are
        sharded again once a backward ends; they are gathered for this call (a collective then:
        every process reads its logits)."""
        if getattr(self.head.weight, "placements", None) is None:  # a plain tensor: not sharded now
            return self.head(self.readout(h))
        self.unshard()
        try:
            return self.head(self.readout(h))
        finally:
            self.reshard()

    def head_loss(self, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of the head ``weight`` on hidden states h (..., C): ``loss_fn`` of the readout's input."""
        return self.loss_fn(self.readout(h), weight, targets)

    def set_loss_impl(self, impl: str) -> None:
        """Switch the loss between ``chunked`` (the default: never materializes the logits) and
        ``plain`` (logits, then cross-entropy: the reference). Same loss, same gradients."""
        check_choice("loss impl", impl, LOSSES)
        self.loss_fn = LOSSES[impl]
        self.loss_impl = impl

    def new_cache(self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None,
                  *, mtp: bool = False) -> KVCache:
        """An empty KV cache on the model's device, in the weights' dtype unless ``dtype`` is given
        (under bf16 autocast the weights stay fp32; pass ``dtype=torch.bfloat16`` to halve its memory).
        ``mtp``: the cache of the multi-token prediction modules' blocks instead of the main blocks'."""
        p, cfg = self.head.weight, self.config
        layers = range(cfg.n_layers, cfg.n_layers + self.mtp.depth) if mtp else range(cfg.n_layers)
        # a variant whose cache is not keys per slot names its own class (compressed attention's)
        cache = getattr(ATTENTIONS[cfg.attention_variant], "cache_class", KVCache)
        return cache(cfg, batch_size, max_len or cfg.max_seq_len, device=p.device, dtype=dtype or p.dtype,
                     layers=layers)

    @property
    def slot_cache(self) -> bool:
        """Whether decoding caches keys per position slot (KVCache), which the fixed-shape decoders (static,
        compiled, graph) need; False for a variant with its own cache (compressed attention's)."""
        return not hasattr(ATTENTIONS[self.config.attention_variant], "cache_class")

    def reserve_positions(self, n: int, device: torch.device) -> None:
        """Build now the position tables of positions below ``n`` (see ``PositionScheme.reserve``)."""
        self.positions.reserve(n, device)
        self.layer_contexts.reserve(n, device)

    def moe_stats(self) -> list[dict[str, float]]:
        """Load statistics of each MoE layer from the last forward, or from every forward of the last
        :meth:`summing_moe_stats` (empty for dense models)."""
        return [moe.stats for moe in self.moe_layers]

    @contextlib.contextmanager
    def summing_moe_stats(self) -> Iterator[None]:
        """Within it, :meth:`moe_stats` sums every forward (a training step's micro-batches), not only the last."""
        for moe in self.moe_layers:
            moe.sum_stats(True)
        try:
            yield
        finally:
            for moe in self.moe_layers:
                moe.sum_stats(False)

    @torch.no_grad()
    def update_router_biases(self, all_reduce: Callable[[torch.Tensor], object] | None = None) -> None:
        """Auxiliary-loss-free balancing (DeepSeek-V3): nudge each MoE layer's selection bias by the
        sign of its load error since the last call. The trainer calls this after every optimizer
        step, passing an in-place sum over processes under DDP. The MTP modules' MoE layers too."""
        for moe in self.moe_layers + self.mtp.moe_layers:
            moe.update_bias(all_reduce)

    def all_blocks(self) -> list[Block]:
        """The main blocks, then the MTP modules' blocks."""
        return [*self.blocks, *(m.block for m in self.mtp.layers)]

    def set_attention_impl(self, impl: str) -> None:
        """Switch every layer between the fused ``sdpa`` path and the ``explicit`` reference."""
        for block in self.all_blocks():
            block.attn.set_impl(impl)

    # ---- accounting
    def embedding_parameters(self) -> list[nn.Parameter]:
        """The parameters that represent tokens and positions rather than transform them: the token
        embedding (which is also the head when tied), a learned position table, and every layer's
        relative-position tables. Position representations are embeddings; Kaplan et al. (2020,
        sec. 2.1) leave all of them out of the non-embedding count N. The one answer to "what is an
        embedding": ``num_params``, ``flops_per_token`` and the optimizer's no-decay group use it."""
        relative = (p for block in self.all_blocks() for p in block.attn.term.parameters())
        return [self.embed.weight, *self.positions.parameters(), *relative]

    def num_params(self) -> dict[str, int]:
        """total: every distinct parameter. non_embedding: total less ``embedding_parameters()``
        and an untied output head (Kaplan et al. 2020). active: total less the routed experts a
        token does not use."""
        total = sum(p.numel() for p in self.parameters())
        embedding = sum(p.numel() for p in self.embedding_parameters())
        head = 0 if self.config.tie_embeddings else self.head.weight.numel()
        inactive = sum(moe.inactive_params() for moe in self.moe_layers + self.mtp.moe_layers)
        return {"total": total, "non_embedding": total - embedding - head, "active": total - inactive}

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token: 6 N + 12 L H d_head T (PaLM, Chowdhery et al. 2022, app. B),
        where N counts active matmul weights: the output head included, ``embedding_parameters()`` not.
        The attention variant counts its layers' scores (``score_flops``): with query/key and value widths
        that differ (MLA), 12 d_head is 6 (d_qk + d_v). D multi-token prediction modules add their blocks
        to L and use the head D more times. Hyper-connections add their streams' mixing (each residual module's
        ``mixing_flops``: the products of coefficients and streams, which 6N does not count)."""
        cfg, T, D = self.config, seq_len or self.config.max_seq_len, self.mtp.depth
        n = self.num_params()["active"] - sum(p.numel() for p in self.embedding_parameters())
        n += self.head.weight.numel() if cfg.tie_embeddings else 0  # tied head is still a matmul
        n += D * self.head.weight.numel()  # each MTP module reads the shared head once more
        mixing = sum(m.mixing_flops() for m in self.modules() if hasattr(m, "mixing_flops"))
        return 6.0 * n + (cfg.n_layers + D) * variant_of(cfg).score_flops(cfg, T) + mixing


def warn_caller(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` pointing at the line that called the model: the first frame outside this file and
    torch.nn (whose ``Module.__call__`` runs ``forward``), however deep the call."""
    import os
    import sys
    import warnings

    inside = (os.path.abspath(__file__), os.path.dirname(os.path.abspath(nn.__file__)))
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


class SequenceClassifier(nn.Module):
    """The Transformer body with a linear head on the hidden state of each row's last non-pad token."""

    def __init__(self, config: ModelConfig, n_classes: int, pad_token_id: int):
        super().__init__()
        if n_classes < 2:
            raise ValueError(f"n_classes={n_classes} is not valid; a classifier needs at least 2 classes")
        self.body = Transformer(config)
        self.pad_token_id = pad_token_id
        self.score = nn.Linear(config.d_model, n_classes, bias=False)
        head_init = Init(torch.Generator().manual_seed(config.init_seed + 1), config.init_std, config.init_std)
        init_module(self.score, head_init)  # its own stream, so the body is exactly Transformer(config)

    def embedding_parameters(self) -> list[nn.Parameter]:
        """The body's (``Transformer.embedding_parameters``): the optimizer does not decay them."""
        return self.body.embedding_parameters()

    def forward(self, idx: torch.Tensor,
                labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self.body.hidden(idx)  # (B, T, C)
        not_pad = (idx != self.pad_token_id).long()
        last = (torch.arange(idx.shape[1], device=idx.device) * not_pad).argmax(-1)  # last non-pad index
        logits = self.score(h[torch.arange(idx.shape[0], device=idx.device), last])  # (B, n_classes)
        loss = None
        if labels is not None:  # the auxiliary losses count here too, as in Transformer.forward
            aux = [v for layer in self.body.aux_layers for v in layer.aux_losses.values()]
            loss = F.cross_entropy(logits.float(), labels.long()) + sum(aux, torch.zeros((), device=logits.device))
        return logits, loss


# ============================================================== initialization
@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig) -> None:
    """All initialization, as a pure function of ``cfg.init_seed``: one generator, drawn in module order.

    - weights ~ N(0, init_std): linear layers, embeddings, relative-position tables, routers, the attention
      output gate's W_g (every gate starts near sigmoid(0) = 1/2); biases 0; norm gains 1 (the q/k norms'
      and the sandwich's output norms too), shifts 0;
    - ``gpt2``: projections that write into the residual stream (attention output, feed-forward and
      expert down projections) ~ N(0, init_std / sqrt(2L)) (Radford et al. 2019, sec. 2.3);
    - ``deepnorm``: attention and feed-forward matrices (each expert's too) are Xavier-normal, with
      gain β = (8L)^(-1/4) for the value, output and feed-forward projections and 1 for queries and
      keys (Wang et al. 2022, Table 1 and Algorithm 1); routers and gates keep N(0, init_std).
    - ``init="xavier"``: every matrix (attention, feed-forward, each expert, the output head) is
      Xavier-normal, std sqrt(2 / (fan_in + fan_out)) (Glorot & Bengio 2010), and embeddings
      ~ N(0, d_model^-1/2), as in the fairseq Transformer that Xiong et al. (2020) measured (the attention
      output gate's W_g is an attention matrix: Xavier too); routers, MoE shared-expert gates and relative
      tables keep N(0, init_std). At d_model 64 this is ~6x N(0, 0.02)'s scale,
      which decides whether post-norm's sublayers move the residual stream at all at init.
    - ``residual="hyper"``: the connections start as Zhu et al. 2024's sec. 2.3 (static A_m = e_{k mod n},
      A_r = I, B = 1, dynamic weights 0, scales 0.01: nothing drawn); ``"mhc"``: as DeepSeek-V4, fn ~ N(0,
      init_std), biases 0, scales 1, for each connection after its block's other weights, the model's head
      collapse after the last block's (``residual.py``).
    - ``parametrization="mup"``: the same draws, each matrix then scaled by its width ratio to the base shape
      (``lmlab.mup``: sqrt(base fan-in / fan-in) for hidden matrices, base fan-in / fan-in for routers and gates).
    Each module whose weights need more than the defaults says how in an ``init_params(init)`` hook
    (attention, feed-forward, relative tables, experts); :func:`lmlab.init.init_module` applies the
    hooks, and the defaults everywhere else.
    """
    out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers) if cfg.residual_scaling == "gpt2" else cfg.init_std
    beta = deepnorm_beta(cfg.n_layers) if cfg.residual_scaling == "deepnorm" else None
    embed_std = cfg.d_model ** -0.5 if cfg.init == "xavier" else None
    init_module(
        model, Init(torch.Generator().manual_seed(cfg.init_seed), cfg.init_std, out_std, beta, cfg.init, embed_std)
    )
    if cfg.parametrization == "mup":
        rescale_init(model)
