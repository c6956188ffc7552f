"""Causal multi-head self-attention with grouped-query / multi-query options and a KV cache.

Two implementations compute the same thing:
  - ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (fused, the fast path),
    used whenever the position scheme is at most an additive bias;
  - ``explicit``: softmax(q k^T / sqrt(d) + bias) v + value term, written out. It is the
    reference, and the only path for Shaw-style relative positions (they add a value term).
Tests check both give the same result wherever both apply.

Learned attention sinks (``attention.sinks``, gpt-oss) add exp(sink_h) to each softmax's
denominator. The reference appends the sink as one more score column and drops it after the
softmax; the fused kernel has no input for it, so its path appends a key of zeros whose score the
float mask sets to sink_h, with a value of zeros: the same denominator, nothing added to the output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention_variants import AttentionArgs, variant_of
from .config import ModelConfig
from .init import Init, init_module
from .norm import RMS_NORMS
from .positions import AttentionTerm, Context, causal_context, padded_context


class KVCache:
    """Preallocated keys and values for incremental decoding: (L, B, KV, max_len, hd) each. The
    attention variant says what a layer stores per token (``AttentionVariant.cache_widths``): under
    multi-head latent attention (``mla.py``) its compressed latent (L, B, 1, max_len, kv_lora_rank)
    in ``k`` and its shared rotary key (L, B, 1, max_len, qk_rope_head_dim) in ``v``.

    Keys are stored after rotation, so rotary angles are never recomputed; relative and ALiBi
    terms are recomputed from positions for all cached keys. ``length`` is the number of slots
    already filled; the model advances it after each forward. Each forward attends to the slots
    filled so far (the slices grow), the plain eager path; :class:`StaticKVCache` is the
    fixed-shape view of the same storage that a compiled or captured decoding step uses.

    Padding: a forward given an ``attention_mask`` (B, T), 1 for real tokens and 0 for pads (left
    padding, as for generation), makes the cache record which slots are real (``valid``) and each
    slot's position (``pos``), both (B, max_len); until then both are None and every filled slot
    is real and at the position of its index, the unpadded fast path.

    ``layers``: the layer indices it holds, default ``range(cfg.n_layers)``; the multi-token
    prediction modules (layers n_layers .. n_layers + D - 1) keep a cache of their own.
    """

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, *, device=None, dtype=torch.float32,
                 layers: range | None = None):
        layers = layers if layers is not None else range(cfg.n_layers)
        self.first_layer = layers.start
        heads, key_width, value_width = variant_of(cfg).cache_widths(cfg)
        self.k = torch.zeros(len(layers), batch_size, heads, max_len, key_width, device=device, dtype=dtype)
        self.v = torch.zeros(len(layers), batch_size, heads, max_len, value_width, device=device, dtype=dtype)
        self.layer_kv = [(self.k[i], self.v[i]) for i in range(len(layers))]  # (B, heads, max_len, width) views
        self.max_len = max_len
        self.length = 0
        self.valid: torch.Tensor | None = None  # (B, max_len) bool: the slot holds a real token
        self.pos: torch.Tensor | None = None  # (B, max_len) long: the position of each slot's token
        self.seen: torch.Tensor | None = None  # (B, 1) long: real tokens in each row so far
        self.pending: torch.Tensor | None = None  # (B, 1) long: real tokens in the forward under way

    def context(self, T: int, attention_mask: torch.Tensor | None = None) -> Context:
        """Positions and mask for T new tokens in slots ``length`` .. ``length + T - 1``, recording
        which of them are real (``attention_mask`` (B, T), None = all)."""
        start, end = self.length, self.length + T
        if attention_mask is None and self.valid is None:
            return causal_context(start, T, self.k.device)
        if self.valid is None:  # the first padded forward: every slot so far was real, at its index
            B, device = self.k.shape[1], self.k.device
            self.valid = torch.zeros(B, self.max_len, dtype=torch.bool, device=device)
            self.valid[:, :start] = True
            self.pos = torch.arange(self.max_len, device=device).repeat(B, 1)
            self.seen = torch.full((B, 1), start, device=device)
        real = torch.ones_like(self.valid[:, start:end]) if attention_mask is None else attention_mask.bool()
        count = real.long().cumsum(-1)  # (B, T) real tokens up to and including each
        q_pos = (self.seen + count - 1).clamp(min=0)  # pads before a row's first token: position 0
        self.valid[:, start:end] = real  # slots past ``length`` are only committed by ``advance``
        self.pos[:, start:end] = q_pos
        self.pending = count[:, -1:]
        return padded_context(q_pos, self.pos[:, :end], self.valid[:, :end])

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.length, self.length + k.shape[2]
        keys, values = self.layer_kv[layer - self.first_layer]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        return keys[:, :, :end], values[:, :, :end]  # (B, KV, S, hd)

    def advance(self, T: int) -> None:
        self.length += T
        if self.seen is not None:
            self.seen = self.seen + self.pending

    def rewind(self, length: int) -> None:
        """Forget the slots from ``length`` on (speculative decoding drops the rejected tokens);
        the next forward writes over them."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind a cache of length {self.length} to {length}; choose 0..{self.length}")
        if self.seen is not None:  # the real tokens among the dropped slots no longer count
            self.seen = self.seen - self.valid[:, length : self.length].sum(-1, keepdim=True)
        self.length = length

    def check_room(self, T: int, batch_size: int | None = None) -> None:
        if batch_size is not None and batch_size != self.k.shape[1]:
            raise ValueError(
                f"KV cache was made for batch_size={self.k.shape[1]} but the input has batch_size={batch_size}; "
                "create the cache with new_cache(batch_size, ...) matching the input"
            )
        if self.length + T > self.max_len:
            raise ValueError(
                f"KV cache holds max_len={self.max_len} positions; {self.length} are used and {T} more were "
                "given. Create the cache with a larger max_len"
            )


class StaticKVCache:
    """A prefilled :class:`KVCache` continued with fixed shapes, for a decoding step that is
    compiled or captured as a CUDA graph (as Hugging Face's StaticCache; gpt-fast does the same).
    One token per row per forward; every forward attends over all ``max_len`` slots, with
    unfilled slots masked out, and writes its keys at a slot held in a device tensor. No Python
    number changes between steps, so one graph serves them all.

    Each layer's keys and values are a tensor of their own, (B, KV, max_len, hd), copied once
    from the prefilled cache: a compiled step then writes one slot of its input in place, where
    a write into a view of one stacked tensor is compiled as a copy of the whole cache.
    """

    def __init__(self, cache: KVCache):
        B, device, n = cache.k.shape[1], cache.k.device, cache.max_len
        self.k, self.v, self.max_len = [k.clone() for k in cache.k], [v.clone() for v in cache.v], n
        filled = torch.arange(n, device=device) < cache.length
        self.valid = filled.repeat(B, 1) if cache.valid is None else cache.valid.clone()  # (B, max_len)
        self.pos = torch.arange(n, device=device).repeat(B, 1) if cache.pos is None else cache.pos.clone()
        seen = torch.full((B, 1), cache.length, device=device)
        self.next_pos = seen if cache.seen is None else cache.seen.clone()  # (B, 1) position of the next token
        self.slot = torch.full((1,), cache.length, device=device)  # (1,) the slot written next

    def context(self, T: int, attention_mask: torch.Tensor | None = None) -> Context:
        self.valid.index_fill_(1, self.slot, True)
        self.pos.index_copy_(1, self.slot, self.next_pos)
        return Context(self.next_pos, self.pos, self.valid[:, None, None, :])  # (B, 1), (B, S), (B, 1, 1, S)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.k[layer], self.v[layer]  # (B, KV, max_len, hd)
        keys.index_copy_(2, self.slot, k.to(keys.dtype))
        values.index_copy_(2, self.slot, v.to(values.dtype))
        return keys, values

    def advance(self, T: int) -> None:
        self.slot += T
        self.next_pos += T

    def check_room(self, T: int, batch_size: int | None = None) -> None:
        """Nothing to check without reading the slot back from the device: the decoding loop
        sizes the cache for its steps."""
        if T != 1:
            raise ValueError(f"a StaticKVCache decodes one token per row per forward, got {T}; prefill with a KVCache")


# scaled_dot_product_attention(enable_gqa=...) exists from torch 2.5; on torch 2.4, the oldest supported,
# keys and values are copied per query head instead (tests run both paths)
SDPA_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def expand_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, KV, S, hd) -> (B, H, S, hd): query head h reads key/value head h // (H / KV)."""
    B, KV, S, hd = x.shape
    if KV == n_heads:
        return x
    return x[:, :, None].expand(B, KV, n_heads // KV, S, hd).reshape(B, n_heads, S, hd)


def rotate_half_into(x: torch.Tensor, cos: torch.Tensor, sin_half: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = x cos + roll(x, d/2) sin_half (``positions.rotate_half``), with no roll copy: each half of
    ``out`` takes the other half of x. Rotating by -θ (sin_half negated) undoes it, which is also
    its backward."""
    h = x.shape[-1] // 2
    torch.mul(x, cos, out=out)
    out[..., :h].addcmul_(x[..., h:], sin_half[..., :h])
    out[..., h:].addcmul_(x[..., :h], sin_half[..., h:])
    return out


def qkv_heads(qkv: torch.Tensor, cos: torch.Tensor, sin_half: torch.Tensor, H: int, KV: int):
    """:class:`QKVHeads`' forward, without autograd: [q; k; v] (B, T, H + 2KV, hd) -> rotated q
    (B, H, T, hd), rotated k and v (B, KV, T, hd)."""
    B, T, _, hd = qkv.shape
    dtype = qkv.dtype if cos.dtype == qkv.dtype else torch.promote_types(qkv.dtype, cos.dtype)
    work = torch.empty(B, T, H + KV, hd, dtype=dtype, device=qkv.device)
    qk = rotate_half_into(qkv[:, :, : H + KV], cos, sin_half, work)
    qk = qk if dtype == qkv.dtype else qk.to(qkv.dtype)
    return qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), qkv[:, :, H + KV :].transpose(1, 2)


class QKVHeads(torch.autograd.Function):
    """[q; k; v] (B, T, H + 2KV, hd), the fused projection's output, -> rotated q (B, H, T, hd),
    rotated k (B, KV, T, hd) and v (B, KV, T, hd), as views in the (B, T, heads, hd) layout that
    the fused attention kernels read without a copy.

    The backward writes each head's gradient straight into its rows of one (B, T, H + 2KV, hd)
    tensor, un-rotating q and k on the way. Autograd's backward of slice, rotate and split
    allocates the rotation's gradient parts, zero-fills a full gradient per slice, adds them and
    joins q and k with a ``cat``. Equal to :meth:`Attention.heads_reference` (tests check it).
    ``cos`` and ``sin_half`` are the rotary tables in the same layout, (B|1, T, 1, hd)."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin_half: torch.Tensor, n_heads: int, n_kv_heads: int):
        ctx.save_for_backward(cos, sin_half)
        ctx.shape, ctx.dtype, ctx.heads = qkv.shape, qkv.dtype, (n_heads, n_kv_heads)
        return qkv_heads(qkv, cos, sin_half, n_heads, n_kv_heads)

    @staticmethod
    def backward(ctx, g_q: torch.Tensor, g_k: torch.Tensor, g_v: torch.Tensor):
        cos, sin_half = ctx.saved_tensors
        H, KV = ctx.heads
        g = torch.empty(ctx.shape, dtype=ctx.dtype, device=g_q.device)  # (B, T, H + 2KV, hd)
        g_qk = g[:, :, : H + KV]
        work = g_qk if cos.dtype == ctx.dtype else torch.empty(g_qk.shape, dtype=cos.dtype, device=g.device)
        unsin = -sin_half
        rotate_half_into(g_q.transpose(1, 2), cos, unsin, work[:, :, :H])
        rotate_half_into(g_k.transpose(1, 2), cos, unsin, work[:, :, H:])
        if work is not g_qk:
            g_qk.copy_(work)
        g[:, :, H + KV :].copy_(g_v.transpose(1, 2))
        return g, None, None, None, None


# ============================================================== query/key norms (ModelConfig.qk_norm)
class NoQKNorm(nn.Module):
    """Queries and keys as projected."""

    normalizes = False

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


class HeadQKNorm(NoQKNorm):
    """RMSNorm over each head's head_dim, one gain for all query heads and one for all key heads,
    before rotary (Qwen3, Gemma 3; Dehghani et al. 2023 used LayerNorm) or after it (HunYuan-MoE)."""

    normalizes = True

    def __init__(self, args: AttentionArgs):
        super().__init__()
        norm = RMS_NORMS[args.norm_gain]
        self.q_norm, self.k_norm = norm(args.head_dim, args.norm_eps), norm(args.head_dim, args.norm_eps)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, T, H, hd), k (B, T, KV, hd), normalized over hd."""
        return self.q_norm(q), self.k_norm(k)


class FullQKNorm(NoQKNorm):
    """RMSNorm over the whole query projection (H*hd) and the whole key projection (KV*hd), before
    they are split into heads and rotated (OLMo 2, OLMoE)."""

    normalizes = True

    def __init__(self, args: AttentionArgs):
        super().__init__()
        norm = RMS_NORMS[args.norm_gain]
        self.q_norm = norm(args.n_heads * args.head_dim, args.norm_eps)
        self.k_norm = norm(args.n_kv_heads * args.head_dim, args.norm_eps)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, T, H, hd), k (B, T, KV, hd), each normalized over its last two axes together."""
        return self.q_norm(q.flatten(-2)).view(q.shape), self.k_norm(k.flatten(-2)).view(k.shape)


QK_NORMS = {"none": lambda args: NoQKNorm(), "head": HeadQKNorm, "full": FullQKNorm}


# ============================================================== output gates (ModelConfig.attn_gate)
class NoGate(nn.Module):
    """The attention output as computed."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y


class OutputGate(nn.Module):
    """y * sigmoid(x W_g): the attention output (B, T, H, hd), before the output projection, scaled by a
    gate computed from the block's attention input x (B, T, C), one per element (``per_head`` = hd) or one
    per head (``per_head`` = 1) (Qiu et al. 2025, arXiv:2505.06708, eq. 5; their best: elementwise, after
    SDPA). Qwen3-Next's gate is the elementwise one, its W_g rows interleaved with q_proj's per head."""

    def __init__(self, args: AttentionArgs, per_head: int):
        super().__init__()
        self.per_head = per_head
        self.proj = nn.Linear(args.d_model, args.n_heads * per_head, bias=args.qkv_bias)  # part of the query side

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        B, T, H, _ = y.shape
        gate = torch.sigmoid(self.proj(x)).view(B, T, H, self.per_head)  # (B, T, H, hd | 1)
        return y * gate.to(y.dtype)


GATES = {
    "none": lambda args: NoGate(),
    "elementwise": lambda args: OutputGate(args, args.head_dim),
    "headwise": lambda args: OutputGate(args, 1),
}


class Attention(nn.Module):
    """The ``standard`` attention variant: n_heads queries over n_kv_heads keys and values (multi-head,
    grouped-query, multi-query), built from its own config (``AttentionArgs``). A variant that changes
    only the score subclasses it and overrides :meth:`scores` (the explicit path then computes it)."""

    fused = True  # scaled_dot_product_attention computes these scores; False: only the explicit path does

    def __init__(self, args: AttentionArgs, layer: int, term: AttentionTerm):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.scale = args.scale  # 1 / sqrt(head_dim), or of attention.scale_dim, or μP's
        self.dropout = args.dropout
        qkv_dim = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.qkv = nn.Linear(args.d_model, qkv_dim, bias=args.qkv_bias)  # [q; k; v], one matmul
        self.out = nn.Linear(args.n_heads * args.head_dim, args.d_model, bias=args.out_bias)
        self.qk_norm = QK_NORMS[args.qk_norm](args)
        self.gate = GATES[args.gate](args)
        self.term = term  # the position scheme's part in attention
        # a learned logit per head that joins every softmax's denominator (gpt-oss); None = plain softmax
        self.sinks = nn.Parameter(torch.zeros(args.n_heads)) if args.sinks == "learned" else None
        self.softmax = softmax_plain if self.sinks is None else self.softmax_with_sinks
        self.set_impl("sdpa" if term.sdpa_ok and self.fused else "explicit")
        # rotary (half layout) heads come from one autograd Function, the rest from a split; normalized
        # queries and keys from a split, normalized, then rotated (or rotated, then normalized)
        self.norm_after_rotary = args.qk_norm_position == "after_rope"
        if self.qk_norm.normalizes:
            self.heads = self.heads_rotated_normalized if self.norm_after_rotary else self.heads_normalized
        else:
            self.heads = self.heads_rotary if term.half_rotation else self.heads_split

    def set_impl(self, impl: str) -> None:
        sdpa = self.attend_sdpa if self.sinks is None else self.attend_sdpa_sinks
        paths = {"sdpa": sdpa, "explicit": self.attend_explicit}
        if impl not in paths:
            raise ValueError(f"attention impl={impl!r} is not a valid choice; choose one of {list(paths)}")
        if impl == "sdpa" and not self.term.sdpa_ok:
            raise ValueError(
                f"attention impl='sdpa' cannot compute {type(self.term).__name__} (it adds a term to the "
                "attention output, which the fused kernel has no input for); use impl='explicit'"
            )
        if impl == "sdpa" and not self.fused:
            raise ValueError(f"attention impl='sdpa' cannot compute {type(self).__name__}'s scores (the fused kernel "
                             "computes q·k); use impl='explicit'")
        self.attend = paths[impl]
        self.impl = impl

    def init_params(self, init: Init) -> None:
        """q, k, v ~ N(0, std); the output projection, which writes into the residual stream,
        ~ N(0, out_std). DeepNorm: Xavier-normal with gain 1 for q and k and β for v and the output
        (Wang et al. 2022, Algorithm 1). Biases 0; the position term initializes its own tables."""
        H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qkv_rows = (H * hd, KV * hd, KV * hd)
        init.weight(self.qkv.weight, init.std, deepnorm_gain=(1.0, 1.0, init.beta), rows=qkv_rows)
        init.weight(self.out.weight, init.out_std, deepnorm_gain=init.beta)
        init.zeros(self.qkv.bias, self.out.bias)
        if self.sinks is not None:  # N(0, std), as transformers initializes gpt-oss's sinks
            init.normal(self.sinks, init.std)
        init_module(self.term, init)
        init_module(self.qk_norm, init)  # gains 1
        init_module(self.gate, init)  # W_g ~ N(0, std): every gate starts near sigmoid(0) = 1/2

    def forward(self, x: torch.Tensor, ctx: Context, cache: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.qkv(x).view(B, T, H + 2 * KV, hd)  # [q; k; v] heads of one matmul
        q, k, v = self.heads(qkv, ctx)  # (B, H, T, hd), (B, KV, T, hd), (B, KV, T, hd)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)  # (B, KV, S, hd)
        y = self.attend(q, k, v, ctx)  # (B, H, T, hd)
        y = self.gate(x, y.transpose(1, 2))  # (B, T, H, hd)
        return self.out(y.reshape(B, T, H * hd))

    # ---- [q; k; v] (B, T, H + 2KV, hd) -> (normalized,) rotated q, k and v, (B, heads, T, hd) each
    def heads_reference(self, qkv: torch.Tensor, ctx: Context):
        """The reference: slice, normalize queries and keys, rotate them in one call, split (with
        ``qk_norm_position='after_rope'``: rotate, then normalize)."""
        H, KV = self.n_heads, self.n_kv_heads
        if not self.norm_after_rotary:
            q, k = self.qk_norm(qkv[:, :, :H], qkv[:, :, H : H + KV])
            qkv = torch.cat([q, k, qkv[:, :, H + KV :]], dim=2)
        qkv = qkv.transpose(1, 2)  # (B, H + 2KV, T, hd)
        q, k = self.term.rotate(qkv[:, : H + KV], ctx).split([H, KV], dim=1)
        if self.norm_after_rotary:  # the per-head norm: over hd, whatever the layout
            q, k = self.qk_norm(q, k)
        return q, k, qkv[:, H + KV :]

    def heads_split(self, qkv: torch.Tensor, ctx: Context):
        """One split, whose backward is one ``cat`` (slices would each fill a zero (B, T, H + 2KV, hd)
        gradient and add them up); per-head rotations, so q and k rotate separately."""
        q, k, v = qkv.transpose(1, 2).split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=1)
        return self.term.rotate(q, ctx), self.term.rotate(k, ctx), v

    def heads_normalized(self, qkv: torch.Tensor, ctx: Context):
        """:meth:`heads_split` with ``qk_norm`` applied to queries and keys before they rotate."""
        q, k, v = qkv.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=2)  # (B, T, heads, hd)
        q, k = self.qk_norm(q, k)
        return self.term.rotate(q.transpose(1, 2), ctx), self.term.rotate(k.transpose(1, 2), ctx), v.transpose(1, 2)

    def heads_rotated_normalized(self, qkv: torch.Tensor, ctx: Context):
        """:meth:`heads_split`, then the per-head ``qk_norm`` on the rotated queries and keys (HunYuan-MoE)."""
        q, k, v = self.heads_split(qkv, ctx)  # (B, heads, T, hd)
        q, k = self.qk_norm(q, k)  # over hd: the head norm's result does not depend on the axes before it
        return q, k, v

    def heads_rotary(self, qkv: torch.Tensor, ctx: Context):
        """Half-layout rotary heads through :class:`QKVHeads`: no ``cat`` in the backward at all.
        Under ``torch.compile``, :meth:`heads_split`: the compiler fuses its backward itself. Without
        grad (generation, evaluation), its forward alone: ``apply``'s bookkeeping is a decoding step's
        largest overhead after the matmuls."""
        if torch.compiler.is_compiling():
            return self.heads_split(qkv, ctx)
        r = ctx.state  # its tables in the layout of qkv, (B|1, T, 1, hd)
        heads = QKVHeads.apply if torch.is_grad_enabled() else qkv_heads
        return heads(qkv, r.cos_tokens, r.sin_half_tokens, self.n_heads, self.n_kv_heads)

    def attend_sdpa(self, q, k, v, ctx: Context) -> torch.Tensor:
        """q (B, H, T, hd); k, v (B, KV, S, hd)."""
        bias = self.term.score_bias(q, ctx)
        mask, is_causal = ctx.mask, ctx.is_causal
        if bias is not None:  # a float mask: the bias on visible keys, -inf elsewhere
            visible = ctx.visible()
            mask = bias.to(q.dtype) if visible is None else bias.to(q.dtype).masked_fill(~visible, float("-inf"))
            is_causal = False
        B, H, T, hd = q.shape
        KV = k.shape[1]
        if T == 1 and KV < H and bias is None:
            # one query per head (a decoding step): the H / KV query heads that share a key/value head
            # are that head's queries, so the kernel reads each key once and solves KV problems, not H
            # (half the time of enable_gqa on a CPU at batch 8)
            y = F.scaled_dot_product_attention(q.reshape(B, KV, H // KV, hd), k, v, attn_mask=mask,
                                               dropout_p=self.dropout if self.training else 0.0, scale=self.scale)
            return y.view(B, H, 1, hd)
        if SDPA_GQA:  # the kernel reads each key/value head for its group of query heads, no copy
            gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        else:
            k, v, gqa = expand_kv(k, self.n_heads), expand_kv(v, self.n_heads), {}
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal,
            dropout_p=self.dropout if self.training else 0.0, scale=self.scale, **gqa,
        )

    def attend_explicit(self, q, k, v, ctx: Context) -> torch.Tensor:
        """The reference: softmax(q k^T / sqrt(d) + bias) v + value term, written out."""
        k, v = expand_kv(k, self.n_heads), expand_kv(v, self.n_heads)  # (B, H, S, hd)
        scores = self.scores(q, k)  # (B, H, T, S)
        bias = self.term.score_bias(q, ctx)
        if bias is not None:
            scores = scores + bias
        visible = ctx.visible()
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        probs = self.softmax(scores).to(v.dtype)  # an fp32 bias promotes scores
        probs = F.dropout(probs, self.dropout, self.training)
        y = probs @ v  # (B, H, T, hd)
        extra = self.term.value_term(probs, ctx)
        return y if extra is None else y + extra

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """q (B, H, T, hd), k (B, H, S, hd) -> scores (B, H, T, S): q·k times the scale."""
        return (q @ k.transpose(-2, -1)) * self.scale

    def softmax_with_sinks(self, scores: torch.Tensor) -> torch.Tensor:
        """softmax over [scores, sink_h] per row of (B, H, T, S) scores, the sink's column dropped: the
        rows sum to less than 1 by the share the sink took (gpt-oss's eager attention)."""
        B, H, T, _ = scores.shape
        sink = self.sinks.to(scores.dtype).view(1, H, 1, 1).expand(B, H, T, 1)
        return torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]

    def attend_sdpa_sinks(self, q, k, v, ctx: Context) -> torch.Tensor:
        """The fused kernel with sinks: one more key, of zeros, whose score the float mask sets to
        sink_h (q·0 + sink_h), and a value of zeros; equal to :meth:`attend_explicit` (tests check it)."""
        B, H, T, hd = q.shape
        KV, S = k.shape[1], k.shape[2]
        visible = ctx.visible()
        bias = self.term.score_bias(q, ctx)
        bias = q.new_zeros(1, 1, T, S) if bias is None else bias.to(q.dtype)  # (B|1, H|1, T, S)
        if visible is not None:
            bias = bias.masked_fill(~visible, float("-inf"))
        sink = self.sinks.to(q.dtype).view(1, H, 1, 1).expand(bias.shape[0], H, T, 1)
        mask = torch.cat((bias.expand(-1, H, -1, -1), sink), dim=-1)  # (B|1, H, T, S + 1)
        zero = k.new_zeros(B, KV, 1, hd)
        k, v = torch.cat((k, zero), dim=2), torch.cat((v, zero), dim=2)  # (B, KV, S + 1, hd)
        if not SDPA_GQA:
            k, v = expand_kv(k, H), expand_kv(v, H)
        gqa = {"enable_gqa": True} if k.shape[1] != H else {}
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, scale=self.scale, **gqa,
        )


def softmax_plain(scores: torch.Tensor) -> torch.Tensor:
    return scores.softmax(dim=-1)
