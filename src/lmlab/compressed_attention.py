"""DeepSeek-V4's attention (DeepSeek-AI 2026, "DeepSeek-V4", sec. 2.3): the ``compressed`` variant.

    x ─┬─ W_DQ ─ norm ─ W_UQ ─ rmsnorm per head (no gain) ─ rotate the trailing r dims ─▶ q   (B, H, T, d)
       ├─ W_KV ─ norm ─ rotate the trailing r dims ──────────────────────────────────────▶ kv  one head: keys = values
       └─ compressor ─▶ one entry per m tokens ─┐  (csa: two overlapping windows; a lightning indexer keeps
                                                │   the top k entries per query.  hca: one window each, all kept)
    y = softmax([q·[kv in the window | entries] · scale, sink_h]) [kv | entries]       sink column dropped
    out = W_O2 (W_O1,g ( rotate_back(y) per group g of heads ))                        grouped low-rank output

The window holds the last ``window`` raw keys (the query itself included) in every layer; a layer's kind
(``CompressedConfig.layers``) adds nothing (``sliding``), CSA's entries or HCA's. Keys equal values, so each
value carries its key's rotation: the output's rotated slice is turned back by the query's angle, which leaves
each key's share a function of its distance to the query alone. Sliding layers rotate with the model's rope;
compressed layers, their compressors and the indexer with the section's (``rope_base``, YaRN by
``yarn_factor``), as transformers' ``main`` and ``compress`` rotary sets.

Positions are each row's real tokens (a left-padded row pools its own tokens, windows aligned to its first
real token): entry w of a row pools its positions [w m, (w + 1) m) (CSA: and [(w - 1) m, w m) through the
second series), rotated at position w m, and the query at position p sees the entries w < (p + 1) // m.
transformers pools a padded row's pads into its entries; each of its rows alone is what lmlab computes.

Two computations of the attention, tested equal: ``explicit`` (the reference: scores, sinks and softmax
written out) and ``sdpa`` (the fused kernel, the sinks as one more key of zeros whose score the float mask
sets). :func:`compress_reference` is the compressor written window by window, the batched one's reference.

The decode cache (:class:`CompressedKVCache`) holds what V4's does: per layer the window's last keys, the
compressors' last 2m (CSA) or m (HCA) token projections, and the entries; memory grows by one entry per m
tokens, not by every token's keys (``attention_variants.CompressedVariant.cache_values_for``).
Checkpoints follow transformers' DeepseekV4 (``hf/deepseek_v4.py`` maps the names).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .attention import KVCache
from .attention_variants import CompressedAttentionArgs
from .config import ModelConfig, RopeConfig
from .init import Init
from .norm import RMSNorm
from .positions import AttentionTerm, Context, rope_frequencies, windowed


# ============================================================== rotary on the trailing slice
class Angles(NamedTuple):
    """cos and sin of each rotated pair's angle, (..., N, r / 2) in fp32, for N positions."""

    cos: torch.Tensor
    sin: torch.Tensor

    def inverse(self) -> "Angles":
        return Angles(self.cos, -self.sin)


class RotaryAngles:
    """One rotary set's frequencies (``rope_frequencies``: any scaling but dynamic), at any positions: the
    queries', and the compressed entries' w m, which no per-forward table holds."""

    def __init__(self, rope: RopeConfig, width: int, max_seq_len: int):
        with torch.device("cpu"):  # real values even for a model built on the meta device (from_hf)
            self.inv_freq, self.factor = rope_frequencies(rope, width, max_seq_len, max_seq_len)

    def at(self, positions: torch.Tensor) -> Angles:
        """Angles at ``positions`` (...) -> (..., r / 2) each, as transformers computes them."""
        angle = positions[..., None].float() * self.inv_freq.to(positions.device)
        return Angles(angle.cos() * self.factor, angle.sin() * self.factor)


def turn(x: torch.Tensor, a: Angles, layout: str) -> torch.Tensor:
    """``x`` (..., N, heads, d) with its trailing r = 2 a.cos.shape[-1] dims rotated by ``a`` (..., N, r / 2):
    pairs (2j, 2j + 1) (``interleaved``, DeepSeek-V4) or (j, j + r / 2) (``half``); the leading d - r pass."""
    r = 2 * a.cos.shape[-1]
    c, s = a.cos.unsqueeze(-2), a.sin.unsqueeze(-2)  # (..., N, 1, r / 2): one angle for every head
    rest, rot = x[..., :-r], x[..., -r:].float()
    if layout == "interleaved":
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
        rot = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((rest, rot.to(x.dtype)), dim=-1)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last axis, no gain (V4's per-head query norm), computed in fp32."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def compress_rope(args: CompressedAttentionArgs) -> RopeConfig:
    """The rotary of compressed layers: base ``rope_base``, YaRN where ``yarn_factor`` > 1 with attention factor 1
    (DeepSeek-V4 leaves YaRN's temperature out: transformers sets ``attention_factor`` 1 on its ``compress`` set)."""
    c = args.section
    if c.yarn_factor == 1:
        return RopeConfig(base=c.rope_base, layout=args.rope.layout)
    return RopeConfig(base=c.rope_base, layout=args.rope.layout, scaling="yarn", factor=c.yarn_factor,
                      original_max_seq_len=c.yarn_original_max_seq_len, beta_fast=c.yarn_beta_fast,
                      beta_slow=c.yarn_beta_slow, attention_factor=1.0)


# ============================================================== where each row's tokens sit
@dataclasses.dataclass
class Span:
    """The real tokens of a forward, per row (B,): the position of the first, how many there are, and how many
    pads precede them in the forward's T slots (left padding: pads, then real tokens)."""

    start: torch.Tensor
    count: torch.Tensor
    pad: torch.Tensor

    @classmethod
    def of(cls, ctx: Context, B: int, start: torch.Tensor | None) -> "Span":
        """From the forward's query positions; ``start`` None: the first forward (no cache), every row at 0."""
        last = ctx.q_pos[:, -1].expand(B)  # the last token of a forward is real: padding is on the left
        start = torch.zeros_like(last) if start is None else start
        count = last - start + 1
        return cls(start, count, ctx.T - count)


# ============================================================== the compressor
@dataclasses.dataclass
class CompressorState:
    """What a compressor keeps between forwards of one cache: the raw [kv; gate] projections of each row's last
    R positions, at slot position % R (B, R, 2, width x series), and its entries so far (B, capacity + 1, width),
    the last slot a sink for windows past the capacity."""

    ring: torch.Tensor
    entries: torch.Tensor


class Compressor(nn.Module):
    """One entry per ``rate`` tokens: C_w = norm(sum_j softmax_j(Z_j + B_j) C_j) over the window's tokens j, C = x W_KV
    and Z = x W_Z, B a learned bias per position in the window (V4 sec. 2.3.1-2.3.2, eq. 9-12 and 20-23), then
    rotated at position w m. ``overlap`` (CSA): two series per token, C = [C^a | C^b]; entry w pools C^a of window
    w - 1 and C^b of window w, 2m tokens at stride m (the first window's C^a slots weigh nothing)."""

    def __init__(self, d_model: int, width: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        series = 2 if overlap else 1
        self.width, self.rate, self.overlap, self.series = width, rate, overlap, series
        self.kv = nn.Linear(d_model, series * width, bias=False)  # [C^a | C^b] (CSA) or C
        self.gate = nn.Linear(d_model, series * width, bias=False)  # Z
        self.position_bias = nn.Parameter(torch.zeros(rate, series * width))  # B ("ape")
        self.norm = RMSNorm(width, eps)

    def init_params(self, init: Init) -> None:
        """Projections ~ N(0, std); the position bias 0 and the gain 1, as transformers initializes them."""
        init.normal(self.kv.weight, init.std)
        init.normal(self.gate.weight, init.std)
        init.zeros(self.position_bias)
        self.norm.weight.fill_(1.0)

    @property
    def lead(self) -> int:
        """Positions before a window that its entry reads: CSA's previous window."""
        return self.rate if self.overlap else 0

    def forward(self, x: torch.Tensor, span: Span, rotary: RotaryAngles, layout: str,
                state: CompressorState | None) -> torch.Tensor:
        """x (B, T, D) -> the entries (B, E, width) of windows 0 .. E - 1, the complete ones (a query sees no other);
        with ``state``, the entries of earlier forwards too, this forward's written into it."""
        m, B, T = self.rate, x.shape[0], x.shape[1]
        new = torch.stack((self.kv(x), self.gate(x)), dim=2)  # (B, T, 2, S C): [kv; gate] per token
        # each row's buffer starts at a window boundary: its first new position rounded down, less the lead
        base = torch.div(span.start, m, rounding_mode="floor") * m - self.lead  # (B,)
        ahead = self.lead + (m - 1 if state is not None else 0)  # most positions before the first new one
        L = math.ceil((ahead + T) / m) * m
        buffer, pos = self.gather(new, span, base, L, state)  # (B, L, 2, S C), (B, L) positions
        kv, gate = buffer.unbind(2)
        gate = gate.masked_fill((pos < 0)[..., None], float("-inf"))  # before the first token: weight 0
        entries = self.pool(kv.view(B, L // m, m, -1), gate.view(B, L // m, m, -1) + self.position_bias)
        first = torch.div(base, m, rounding_mode="floor") + (1 if self.overlap else 0)  # (B,) window of entry 0
        windows = first[:, None] + torch.arange(entries.shape[1], device=x.device)  # (B, W)
        entries = turn(entries[:, :, None], rotary.at(windows * m), layout)[:, :, 0]  # rotated at w m
        if state is None:  # every row's windows start at 0 (first = 0); the last, still open, no query sees
            return entries[:, : T // m]
        self.remember(state, buffer, span, base)
        slot = windows.clamp(min=0).masked_fill(windows >= state.entries.shape[1] - 1, state.entries.shape[1] - 1)
        state.entries.scatter_(1, slot[..., None].expand_as(entries), entries.to(state.entries.dtype))
        end = int(((span.start + span.count) // m).max())  # complete windows of the row furthest on
        return state.entries[:, :end]

    def gather(self, new: torch.Tensor, span: Span, base: torch.Tensor, L: int,
               state: CompressorState | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's projections at positions base .. base + L - 1 (B, L, 2, S C): earlier ones from the ring,
        this forward's real tokens, zeros past the last and before position 0; and those positions (B, L)."""
        B, T, device = new.shape[0], new.shape[1], new.device
        pos = base[:, None] + torch.arange(L, device=device)  # (B, L)
        R = 0 if state is None else state.ring.shape[1]
        zero = new.new_zeros(B, 1, *new.shape[2:])
        source = torch.cat([new] if state is None else [state.ring.to(new.dtype), new], dim=1)
        source = torch.cat([source, zero], dim=1)  # (B, R + T + 1, 2, S C): the last row is zeros
        offset = pos - span.start[:, None]  # (B, L): 0 at the first new token
        is_new = (offset >= 0) & (offset < span.count[:, None])
        index = torch.where(is_new, R + span.pad[:, None] + offset, R + T)
        if state is not None:
            earlier = (offset < 0) & (pos >= 0)
            index = torch.where(earlier, pos.remainder(max(R, 1)), index)
        picked = source.gather(1, index[..., None, None].expand(B, L, *new.shape[2:]))
        return picked, pos

    def pool(self, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Windows (B, W, m, S C) of projections and biased gates -> normalized entries (B, W', width): HCA one
        per window; CSA one per window after the first, from C^a of the window before and C^b of its own."""
        if self.overlap:
            C = self.width
            kv = torch.cat((kv[:, :-1, :, :C], kv[:, 1:, :, C:]), dim=2)  # (B, W - 1, 2m, C)
            gate = torch.cat((gate[:, :-1, :, :C], gate[:, 1:, :, C:]), dim=2)
        weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
        return self.norm((kv * weights).sum(dim=2))

    def remember(self, state: CompressorState, buffer: torch.Tensor, span: Span, base: torch.Tensor) -> None:
        """Keep each row's last R positions in the ring (slot = position % R): the next forward's earlier windows."""
        R, L = state.ring.shape[1], buffer.shape[1]
        end = (span.start + span.count)[:, None]  # (B, 1) first position after this forward
        slots = torch.arange(R, device=buffer.device)
        latest = end - 1 - (end - 1 - slots).remainder(R)  # (B, R) the last position of each slot
        take = (latest >= base[:, None]) & (latest >= 0)
        index = (latest - base[:, None]).clamp(0, L - 1)
        fresh = buffer.gather(1, index[..., None, None].expand(-1, -1, *buffer.shape[2:]))
        state.ring.copy_(torch.where(take[..., None, None], fresh.to(state.ring.dtype), state.ring))

    def new_state(self, B: int, max_len: int, device, dtype) -> CompressorState:
        R = (2 if self.overlap else 1) * self.rate
        ring = torch.zeros(B, R, 2, self.series * self.width, device=device, dtype=dtype)
        return CompressorState(ring, torch.zeros(B, max_len // self.rate + 2, self.width, device=device, dtype=dtype))


def compress_reference(comp: Compressor, x: torch.Tensor, rotary: RotaryAngles, layout: str) -> torch.Tensor:
    """:class:`Compressor` over one unpadded sequence from position 0, written window by window as the paper's
    equations: the reference the batched form is tested against. x (B, T, D) -> (B, T // m, width)."""
    m, C = comp.rate, comp.width
    kv, gate = comp.kv(x), comp.gate(x)
    out = []
    for w in range(x.shape[1] // m):
        here = slice(w * m, (w + 1) * m)
        if comp.overlap:
            z, c = gate[:, here, C:] + comp.position_bias[:, C:], kv[:, here, C:]  # C^b of window w
            if w > 0:
                before = slice((w - 1) * m, w * m)  # C^a of window w - 1
                z = torch.cat((gate[:, before, :C] + comp.position_bias[:, :C], z), dim=1)
                c = torch.cat((kv[:, before, :C], c), dim=1)
        else:
            z, c = gate[:, here] + comp.position_bias, kv[:, here]
        entry = comp.norm((c * z.float().softmax(dim=1).to(c.dtype)).sum(dim=1))  # (B, C)
        out.append(turn(entry[:, None, None], rotary.at(torch.tensor([w * m], device=x.device)), layout)[:, 0, 0])
    return torch.stack(out, dim=1) if out else x.new_zeros(x.shape[0], 0, C)


# ============================================================== the lightning indexer (CSA)
class Indexer(nn.Module):
    """Which CSA entries each query attends to (V4 sec. 2.3.1, eq. 13-17): its own compressor makes index keys
    K^I (B, E, c^I); queries q^I = W^IUQ c^Q (the attention's query latent), rotated; the score of entry s is
    I_s = sum_h w_h ReLU(q^I_h · K^I_s) / sqrt(c^I) with w = x W^w / sqrt(n_h^I); each query keeps its
    ``topk`` best entries among those it may see."""

    def __init__(self, d_model: int, q_lora_rank: int, heads: int, width: int, rate: int, topk: int, eps: float):
        super().__init__()
        self.heads, self.width, self.topk, self.rate = heads, width, topk, rate
        self.compressor = Compressor(d_model, width, rate, overlap=True, eps=eps)
        self.q_up = nn.Linear(q_lora_rank, heads * width, bias=False)
        self.weights = nn.Linear(d_model, heads, bias=False)

    def init_params(self, init: Init) -> None:
        self.compressor.init_params(init)
        init.normal(self.q_up.weight, init.std)
        init.normal(self.weights.weight, init.std)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, angles: Angles, ctx: Context, span: Span,
                rotary: RotaryAngles, layout: str, state: CompressorState | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(I (B, T, E) fp32, -inf where the query may not see the entry; the entries each query keeps (B, T, E)
        bool), E the attention's entries."""
        B, T, _ = x.shape
        keys = self.compressor(x, span, rotary, layout, state)  # (B, E, c)
        q = turn(self.q_up(q_latent).view(B, T, self.heads, self.width), angles, layout)  # (B, T, h, c)
        scores = torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))  # (B, T, h, E)
        scores = F.relu(scores) * self.width**-0.5
        w = self.weights(x).float() * self.heads**-0.5  # (B, T, h)
        index = (scores * w.unsqueeze(-1)).sum(dim=2)  # (B, T, E)
        seen = seen_entries(ctx, self.rate, keys.shape[1])  # (B|1, T, E)
        index = index.masked_fill(~seen, float("-inf"))
        top = index.detach().topk(min(self.topk, keys.shape[1]), dim=-1).indices  # (B, T, k)
        keep = torch.zeros_like(index, dtype=torch.bool).scatter_(-1, top, True)
        return index, keep & seen  # picks past the causal limit (fewer than k entries seen) are dropped


def indexer_loss(index: torch.Tensor, keep: torch.Tensor, q: torch.Tensor, entries: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """KL(p || softmax(I)) over the entries each query keeps, averaged over the queries that keep any (DeepSeek-V3.2
    sec. 2.1.1, as ``sparse_attention`` trains its indexer): p is the attention's probabilities over those entries,
    summed over the heads and L1-normalized, a fixed target. index, keep (B, T, E); q (B, H, T, d); entries
    (B, E, d)."""
    some = keep.any(-1)  # (B, T): early queries see no entry yet
    with torch.no_grad():
        scores = (q @ entries[:, None].transpose(-2, -1).to(q.dtype)) * scale  # (B, H, T, E)
        scores = scores.float().masked_fill(~keep[:, None], float("-inf")).masked_fill(~some[:, None, :, None], 0.0)
        target = scores.softmax(-1).sum(1)  # (B, T, E)
        target = target / target.sum(-1, keepdim=True)
    log_q = index.masked_fill(~keep, float("-inf")).masked_fill(~some[..., None], 0.0).log_softmax(-1)
    kl = (target * (target.clamp_min(torch.finfo(target.dtype).tiny).log() - log_q)).masked_fill(~keep, 0.0)
    return (kl.sum(-1) * some).sum() / some.sum().clamp_min(1)


def seen_entries(ctx: Context, rate: int, E: int) -> torch.Tensor:
    """(B|1, T, E): entry w may be seen by the query at position p when its window is complete, w < (p + 1) // m."""
    return torch.arange(E, device=ctx.q_pos.device) < torch.div(ctx.q_pos + 1, rate, rounding_mode="floor")[..., None]


# ============================================================== the decode cache
@dataclasses.dataclass
class LayerState:
    """One layer's share of a :class:`CompressedKVCache`."""

    window: torch.Tensor  # (B, 1, <= window - 1, d): the last raw keys
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None


class CompressedKVCache(KVCache):
    """The decode cache of the ``compressed`` variant: per layer the window's last ``window - 1`` keys and, for
    compressed layers, their compressors' (and the indexer's) recent projections and entries (:class:`LayerState`),
    made by each layer at its first forward. The slots' positions and padding are :class:`KVCache`'s bookkeeping
    (``valid``, ``pos``, ``seen``); no key is stored per slot. Padding is taken at the first forward only (a
    prompt's left padding), and a forward cannot be rewound: a compressed entry has no undo."""

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, *, device=None, dtype=torch.float32,
                 layers: range | None = None):
        layers = layers if layers is not None else range(cfg.n_layers)
        self.first_layer = layers.start
        # no per-slot keys: the slot bookkeeping reads only the batch size and device of these empty tensors
        self.k = self.v = torch.zeros(0, batch_size, 0, 0, 0, device=device, dtype=dtype)
        self.layer_kv = []
        self.max_len, self.length, self.dtype = max_len, 0, dtype
        self.valid = self.pos = self.seen = self.pending = None
        self.states: dict[int, LayerState] = {}

    def layer_state(self, layer: int, attn: CompressedAttention, x: torch.Tensor) -> LayerState:
        if layer not in self.states:
            B, device = x.shape[0], x.device
            made = [part.new_state(B, self.max_len, device, self.dtype) if part is not None else None
                    for part in (attn.compressor, attn.indexer and attn.indexer.compressor)]
            window = torch.zeros(B, 1, 0, attn.head_dim, device=device, dtype=self.dtype)
            self.states[layer] = LayerState(window, *made)
        return self.states[layer]

    def context(self, T: int, attention_mask: torch.Tensor | None = None) -> Context:
        if attention_mask is not None and self.length > 0 and not bool(attention_mask.bool().all()):
            raise ValueError("a compressed attention cache takes padding in its first forward only (a prompt's left "
                             "padding); pass attention_mask=None after it")
        return super().context(T, attention_mask)

    def first_position(self) -> torch.Tensor:
        """(B,) the position of each row's next real token: the real tokens it holds."""
        if self.seen is not None:
            return self.seen[:, 0]
        return torch.full((self.k.shape[1],), self.length, dtype=torch.long, device=self.k.device)

    def rewind(self, length: int) -> None:
        raise ValueError("a compressed attention cache cannot be rewound (its entries pool tokens that would be "
                         "dropped); decode without speculation")


# ============================================================== the attention
class GroupedProjection(nn.Module):
    """The heads' outputs in ``groups`` groups (B, T, g, H d / g), each projected on its own to ``rank`` values:
    one block of a block-diagonal matrix per group (V4 sec. 2.3.1, "grouped output projection"), stored as
    transformers' ``wo_a``, (g rank, H d / g)."""

    def __init__(self, width: int, rank: int, groups: int):
        super().__init__()
        self.groups, self.rank = groups, rank
        self.weight = nn.Parameter(torch.empty(groups * rank, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.view(self.groups, self.rank, -1)  # (g, rank, H d / g)
        return torch.einsum("btgi,gri->btgr", x, w).flatten(-2)  # (B, T, g rank)


class CompressedAttention(nn.Module):
    """The ``compressed`` attention variant (DeepSeek-V4), built from its own config (``CompressedAttentionArgs``).
    The interface of :class:`~lmlab.attention.Attention`: ``forward(x, ctx, cache)``, ``set_impl``, ``term``; its
    decode cache is a :class:`CompressedKVCache` (``cache_class``, which ``Transformer.new_cache`` makes)."""

    cache_class = CompressedKVCache

    def __init__(self, args: CompressedAttentionArgs, layer: int, term: AttentionTerm):
        super().__init__()
        c = args.section
        self.layer, self.kind = layer, c.kind(layer)
        self.n_heads, self.head_dim, self.window, self.scale = args.n_heads, args.head_dim, c.window, args.scale
        self.dropout, self.eps, self.layout = args.dropout, args.norm_eps, args.rope.layout
        H, hd, D = args.n_heads, args.head_dim, args.d_model
        self.q_down = nn.Linear(D, c.q_lora_rank, bias=False)  # W_DQ
        self.q_norm = RMSNorm(c.q_lora_rank, args.norm_eps)
        self.q_up = nn.Linear(c.q_lora_rank, H * hd, bias=False)  # W_UQ
        self.kv = nn.Linear(D, hd, bias=False)  # the one key/value head
        self.kv_norm = RMSNorm(hd, args.norm_eps)
        self.out_down = GroupedProjection(H * hd // c.o_groups, c.o_lora_rank, c.o_groups)
        self.out_up = nn.Linear(c.o_groups * c.o_lora_rank, D, bias=False)
        self.sinks = nn.Parameter(torch.zeros(H)) if args.sinks == "learned" else None
        rope = args.rope if self.kind == "sliding" else compress_rope(args)
        self.rotary = RotaryAngles(rope, c.rope_head_dim, args.max_seq_len)
        self.compressor = None if self.kind == "sliding" else Compressor(
            D, hd, c.csa_rate if self.kind == "csa" else c.hca_rate, overlap=self.kind == "csa", eps=args.norm_eps)
        self.indexer = None if self.kind != "csa" else Indexer(
            D, c.q_lora_rank, c.index_heads, c.index_head_dim, c.csa_rate, c.index_topk, args.norm_eps)
        self.term = term  # the model's position term: this variant rotates with its own angles (``rotary``)
        # after a forward in training, CSA's indexer's KL loss times its coefficient (the model adds it); else empty
        self.aux_losses: dict[str, torch.Tensor] = {}
        self.index_loss_coef = c.index_loss_coef
        self.set_impl("sdpa")

    def set_impl(self, impl: str) -> None:
        paths = {"sdpa": self.attend_sdpa, "explicit": self.attend_explicit}
        if impl not in paths:
            raise ValueError(f"attention impl={impl!r} is not a valid choice for compressed attention; choose one "
                             f"of {list(paths)}")
        self.attend, self.impl = paths[impl], impl

    def init_params(self, init: Init) -> None:
        """Matrices ~ N(0, std), the projection into the stream ~ N(0, out_std); gains 1; sinks and position
        biases 0, as transformers initializes DeepSeek-V4."""
        for linear in (self.q_down, self.q_up, self.kv, self.out_down):
            init.normal(linear.weight, init.std)
        init.normal(self.out_up.weight, init.out_std)
        for norm in (self.q_norm, self.kv_norm):
            norm.weight.fill_(1.0)
        init.zeros(self.sinks)
        for part in (self.compressor, self.indexer):
            if part is not None:
                part.init_params(init)

    def forward(self, x: torch.Tensor, ctx: Context, cache: "CompressedKVCache | None" = None) -> torch.Tensor:
        B, T, _ = x.shape
        H, hd = self.n_heads, self.head_dim
        if cache is not None and not isinstance(cache, CompressedKVCache):
            raise ValueError(f"compressed attention decodes with its own cache (model.new_cache), not a "
                             f"{type(cache).__name__}; use decoder='eager'")
        state = None if cache is None else cache.layer_state(self.layer, self, x)
        span = Span.of(ctx, B, None if cache is None else cache.first_position())
        angles = self.rotary.at(ctx.q_pos)  # (B|1, T, r / 2)
        q_latent = self.q_norm(self.q_down(x))  # (B, T, q_lora_rank)
        q = turn(unit_rms(self.q_up(q_latent).view(B, T, H, hd), self.eps), angles, self.layout)  # (B, T, H, d)
        kv = turn(self.kv_norm(self.kv(x))[:, :, None], angles, self.layout).transpose(1, 2)  # (B, 1, T, d)
        keys, near = self.window_keys(kv, ctx, state)  # (B, 1, S, d), (B|1, 1, T, S) or None
        if self.compressor is not None:
            entries = self.compressor(x, span, self.rotary, self.layout,
                                      None if state is None else state.compressor)  # (B, E, d)
            if self.indexer is not None:  # it learns from its own loss alone: detached inputs
                learn = self.training and torch.is_grad_enabled()
                with torch.set_grad_enabled(learn):
                    index, seen = self.indexer(x.detach(), q_latent.detach(), angles, ctx, span, self.rotary,
                                               self.layout, None if state is None else state.indexer)
                self.aux_losses = {"indexer": self.index_loss_coef * indexer_loss(
                    index, seen, q.transpose(1, 2).detach(), entries.detach(), self.scale)} if learn else {}
            else:
                seen = seen_entries(ctx, self.compressor.rate, entries.shape[1]).expand(B, -1, -1)
            near = torch.ones(1, 1, T, keys.shape[2], dtype=torch.bool, device=x.device) if near is None else near
            near = torch.cat((near.expand(B, -1, -1, -1), seen[:, None]), dim=-1)  # (B, 1, T, S + E)
            keys = torch.cat((keys, entries[:, None].to(keys.dtype)), dim=2)
        y = self.attend(q.transpose(1, 2), keys, near)  # (B, H, T, d)
        y = turn(y.transpose(1, 2), angles.inverse(), self.layout)  # (B, T, H, d): the values' rotation undone
        groups = self.out_down.groups
        return self.out_up(self.out_down(y.reshape(B, T, groups, H * hd // groups)))

    def window_keys(self, kv: torch.Tensor, ctx: Context,
                    state: "LayerState | None") -> tuple[torch.Tensor, torch.Tensor | None]:
        """The raw keys this forward's queries may reach (B, 1, S, d) and which of them each sees: every token of
        the forward, after the cache's last window - 1 (as transformers' sliding-window cache keeps them)."""
        if state is not None:
            kv = torch.cat((state.window.to(kv.dtype), kv), dim=2)
            state.window = kv[:, :, max(0, kv.shape[2] - (self.window - 1)):] if self.window > 1 else kv[:, :, :0]
            ctx = recent(ctx, kv.shape[2])
        return kv, windowed(ctx, self.window).visible()

    def scores(self, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return (q @ keys.transpose(-2, -1)) * self.scale  # (B, H, T, S): one key head for every query head

    def attend_explicit(self, q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
        """The reference: softmax over [q·k scale, sink_h] of the keys each query sees, the sink dropped; values
        are the keys."""
        scores = self.scores(q, keys)
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        if self.sinks is not None:
            B, H, T, _ = scores.shape
            sink = self.sinks.to(scores.dtype).view(1, H, 1, 1).expand(B, H, T, 1)
            probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = scores.softmax(dim=-1)
        probs = F.dropout(probs, self.dropout, self.training)
        return probs.to(keys.dtype) @ keys  # (B, H, T, d)

    def attend_sdpa(self, q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
        """The fused kernel: one key/value head read by every query head; the sink as one more key of zeros whose
        score the float mask sets to sink_h (equal to :meth:`attend_explicit`, tests check it)."""
        B, H, T, d = q.shape
        mask = visible
        if self.sinks is not None:
            S = keys.shape[2]
            bias = q.new_zeros(1, 1, T, S) if visible is None else q.new_zeros(visible.shape).masked_fill(
                ~visible, float("-inf"))
            sink = self.sinks.to(q.dtype).view(1, H, 1, 1).expand(bias.shape[0], H, T, 1)
            mask = torch.cat((bias.expand(-1, H, -1, -1), sink), dim=-1)  # (B|1, H, T, S + 1)
            keys = torch.cat((keys, keys.new_zeros(B, 1, 1, d)), dim=2)
        values = keys.expand(B, H, -1, d)
        return F.scaled_dot_product_attention(q, keys.expand(B, H, -1, d), values, attn_mask=mask,
                                              dropout_p=self.dropout if self.training else 0.0, scale=self.scale)


def recent(ctx: Context, n: int) -> Context:
    """``ctx`` over its last ``n`` keys only (the slots a compressed cache still holds)."""
    visible = ctx.visible()
    return dataclasses.replace(ctx, k_pos=ctx.k_pos[:, -n:], mask=None if visible is None else visible[..., -n:],
                               is_causal=False)
