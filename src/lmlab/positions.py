"""Position schemes behind one interface.

The model asks its scheme for a :class:`Context` once per forward and hands the same object to
every block. Absolute schemes (sinusoidal, learned) add to the token embedding in ``embed``;
rotary, relative and ALiBi act inside attention through a per-layer :class:`AttentionTerm` that
the scheme builds at construction. The block's signature never changes between schemes.

=============  ======================================  ======================  ===========
scheme         where it acts                           paper                   attention
=============  ======================================  ======================  ===========
none           nowhere (causal mask only)              Haviv et al. 2022       SDPA
sinusoidal     added to embeddings, fixed              Vaswani et al. 2017     SDPA
learned        added to embeddings, a table            Radford et al. 2018     SDPA
relative       key and value terms, clipped at k       Shaw et al. 2018        explicit
alibi          additive score bias -m·(i-j)            Press et al. 2022       SDPA + bias
rope           rotates queries and keys                Su et al. 2021          SDPA
=============  ======================================  ======================  ===========
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import torch
from torch import nn

from .config import ModelConfig, RopeConfig
from .init import Init


@dataclasses.dataclass
class Context:
    """Everything attention needs to know about positions, computed once per forward.

    T new tokens (the queries) attend to S keys: the cached ones and themselves. Rows agree
    (leading dimension 1) unless the batch is padded. A token's position counts the real tokens
    before it in its row, so a left-padded row's first real token is at position 0, as in Hugging
    Face's ``position_ids = attention_mask.cumsum(-1) - 1``; pad tokens sit at position 0 and are
    never seen by real tokens. Builders: :func:`causal_context` (no padding) and
    :func:`padded_context`; the KV cache builds one for each forward it serves.
    """

    q_pos: torch.Tensor  # (B|1, T) long: position of each query
    k_pos: torch.Tensor  # (B|1, S) long: position of each key (pads: anything, they are masked)
    mask: torch.Tensor | None  # (B|1, 1, T, S) bool, True = may attend; None when is_causal or every key is visible
    is_causal: bool = False  # T == S and the plain lower-triangular mask, which fused kernels apply themselves
    state: Any = None  # scheme-specific: rotary tables, relative index, ALiBi bias

    @property
    def T(self) -> int:
        return self.q_pos.shape[1]

    @property
    def S(self) -> int:
        return self.k_pos.shape[1]

    def visible(self) -> torch.Tensor | None:
        """The (B|1, 1, T, S) mask of keys each query may see; None when it sees all of them (one
        query over an unpadded cache, the plain decoding step), so no masking is needed at all."""
        if self.mask is not None or not self.is_causal:
            return self.mask
        return torch.ones(self.T, self.S, dtype=torch.bool, device=self.q_pos.device).tril()[None, None]


def causal_mask(offset: int, T: int, device: torch.device) -> torch.Tensor:
    q = torch.arange(offset, offset + T, device=device)
    k = torch.arange(offset + T, device=device)
    return k[None, :] <= q[:, None]  # (T, S)


def causal_context(offset: int, T: int, device: torch.device) -> Context:
    """T queries at positions offset .. offset+T-1 over keys at 0 .. offset+T-1, every row alike.
    A mask only where the shapes do not imply it: several queries after a cache offset."""
    pos = torch.arange(offset + T, device=device)[None]  # (1, S)
    mask = causal_mask(offset, T, device)[None, None] if offset > 0 and T > 1 else None
    return Context(pos[:, offset:], pos, mask, is_causal=offset == 0 and T > 1)


def padded_context(q_pos: torch.Tensor, k_pos: torch.Tensor, key_valid: torch.Tensor) -> Context:
    """Queries in the last T of S slots, per-row positions, and ``key_valid`` (B, S) marking the
    slots that hold real tokens. A query sees the real keys at or before its slot, and itself:
    a pad query then still has one key, so its softmax stays finite (Hugging Face unmasks such
    rows for the same reason); nothing real ever attends to it."""
    T, S = q_pos.shape[1], k_pos.shape[1]
    slot = torch.arange(S, device=k_pos.device)
    causal = slot[None, :] <= slot[S - T :, None]  # (T, S)
    itself = slot[None, :] == slot[S - T :, None]
    mask = causal & (key_valid[:, None, :] | itself)  # (B, T, S)
    return Context(q_pos, k_pos, mask[:, None])


def windowed(ctx: Context, window: int) -> Context:
    """``ctx`` for a local layer: each query sees itself and the keys of the ``window - 1`` positions
    before it, of those it saw (transformers' sliding window: key j from query i when i - window < j).
    The same positions and scheme state; a new mask, so every path that reads the mask (the fused
    kernel, the reference, a cache's slots) honours the window. Where S <= window no key can be that
    far back (positions of real tokens differ by at most their slots'), and ``ctx`` is kept as it is."""
    if ctx.S <= window:
        return dataclasses.replace(ctx)
    near = (ctx.q_pos[:, :, None] - ctx.k_pos[:, None, :]) < window  # (B|1, T, S)
    visible = ctx.visible()
    mask = near[:, None] if visible is None else visible & near[:, None]  # (B|1, 1, T, S)
    return dataclasses.replace(ctx, mask=mask, is_causal=False)


# ============================================================== per-layer attention terms
class AttentionTerm(nn.Module):
    """How a position scheme enters attention. Default: it does not."""

    sdpa_ok = True  # can the fused kernel compute this scheme's attention?
    # does ``rotate`` apply ctx.state's half-layout tables (cos, sin_half), so that attention's fused
    # projection may apply them itself (see attention.QKVHeads)?
    half_rotation = False

    def rotate(self, qk: torch.Tensor, ctx: Context) -> torch.Tensor:
        """Queries and keys, stacked along the head axis (B, H + KV, T, hd), as attention scores them."""
        return qk

    def score_bias(self, q: torch.Tensor, ctx: Context) -> torch.Tensor | None:
        """Additive term for the (B|1, H, T, S) pre-softmax scores, already in score units."""
        return None

    def value_term(self, probs: torch.Tensor, ctx: Context) -> torch.Tensor | None:
        """Extra (B, H, T, hd) output from the attention probabilities (Shaw et al.'s a^V)."""
        return None


class RotaryState(NamedTuple):
    """Per-forward rotary tables for the T new positions, each (B|1, 1, T, hd): one row per
    batch row (positions differ in a padded batch), broadcast over heads; ``cos_tokens`` and
    ``sin_half_tokens`` are cos and sin_half as (B|1, T, 1, hd) views, the layout of the fused
    [q; k; v] projection (``attention.QKVHeads``), made once per forward rather than per layer."""

    cos: torch.Tensor  # [cos p·θ, cos p·θ]: both members of a pair share the angle
    sin: torch.Tensor  # [sin p·θ, sin p·θ]
    sin_half: torch.Tensor  # [-sin p·θ, sin p·θ]: the half layout's signs, folded in once per forward
    cos_tokens: torch.Tensor
    sin_half_tokens: torch.Tensor

    @classmethod
    def of(cls, rows: torch.Tensor) -> "RotaryState":
        """From (B|1, T, 3, hd) rows of [cos, sin, sin_half] (``Rotary.tables``)."""
        cos, sin, sin_half = rows[:, None].unbind(-2)
        return cls(cos, sin, sin_half, cos.transpose(1, 2), sin_half.transpose(1, 2))


class RotaryTerm(AttentionTerm):
    def __init__(self, layout: str):
        super().__init__()
        self.rotate_one = rotate_half if layout == "half" else rotate_interleaved
        self.half_rotation = layout == "half"

    def rotate(self, qk, ctx):
        # queries and keys in one call; the tables are fp32, a bf16 model stays bf16
        return self.rotate_one(qk, ctx.state).to(qk.dtype)


class PartialRotaryTerm(RotaryTerm):
    """Rotary on the first ``rotary_dim`` dimensions of each head, the rest passed through unrotated
    (GPT-NeoX's rotary_pct, Black et al. 2022, sec. 2.1.1; transformers' partial_rotary_factor). The
    tables are rotary_dim wide, so pairs are (j, j + rotary_dim/2) in the half layout."""

    def __init__(self, layout: str, rotary_dim: int):
        super().__init__(layout)
        self.rotary_dim = rotary_dim
        self.half_rotation = False  # QKVHeads rotates whole heads

    def rotate(self, qk, ctx):
        rotated, passed = qk[..., : self.rotary_dim], qk[..., self.rotary_dim :]
        return torch.cat((self.rotate_one(rotated, ctx.state).to(qk.dtype), passed), dim=-1)


def rotate_half(x: torch.Tensor, r: RotaryState) -> torch.Tensor:
    """Pairs (j, j + d/2), the Hugging Face / GPT-NeoX layout:
    [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin] = x * cos + roll(x, d/2) * [-sin, sin]."""
    return torch.addcmul(x * r.cos, x.roll(x.shape[-1] // 2, dims=-1), r.sin_half)


def rotate_interleaved(x: torch.Tensor, r: RotaryState) -> torch.Tensor:
    """Pairs (2j, 2j + 1), the paper's layout (first half of the tables used)."""
    d = x.shape[-1]
    c, s = r.cos[..., : d // 2], r.sin[..., : d // 2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


class AlibiTerm(AttentionTerm):
    def score_bias(self, q, ctx):
        return ctx.state  # (1, H, T, S), shared by every layer


class RelativeTerm(AttentionTerm):
    """Shaw et al. 2018 (https://arxiv.org/abs/1803.02155), causal: a learned key vector a^K_r and
    value vector a^V_r per clipped offset r = min(i - j, k), shared across heads, one pair of
    tables per layer. e_ij = q_i·(k_j + a^K_r) / sqrt(d); z_i = sum_j α_ij (v_j + a^V_r)."""

    sdpa_ok = False

    def __init__(self, args: PositionArgs):
        super().__init__()
        self.scale = args.attention_scale  # as the attention scores'
        self.rel_k = nn.Parameter(torch.zeros(args.relative_clip + 1, args.head_dim))
        self.rel_v = nn.Parameter(torch.zeros(args.relative_clip + 1, args.head_dim))

    def init_params(self, init: Init) -> None:
        """a^K and a^V ~ N(0, std), as the other embeddings."""
        init.normal(self.rel_k, init.std)
        init.normal(self.rel_v, init.std)

    def score_bias(self, q, ctx):
        index = ctx.state  # (B|1, 1, T, S) long in [0, k]
        qa = q @ self.rel_k.T  # (B, H, T, k+1)
        B, H, T, _ = qa.shape
        return qa.gather(-1, index.expand(B, H, T, -1)) * self.scale  # (B, H, T, S)

    def value_term(self, probs, ctx):
        index = ctx.state
        B, H, T, S = probs.shape
        buckets = probs.new_zeros(B, H, T, self.rel_v.shape[0])
        buckets.scatter_add_(-1, index.expand(B, H, T, S), probs)  # total weight per offset
        return buckets @ self.rel_v  # (B, H, T, hd)


# ============================================================== schemes
@dataclasses.dataclass(frozen=True)
class PositionArgs:
    """A position scheme's own config, resolved from the model's by :func:`position_args`."""

    d_model: int  # absolute schemes add a d_model vector to each embedding
    max_seq_len: int  # the learned table's size; rotary's original context unless rope says otherwise
    n_heads: int  # ALiBi: one slope per head
    head_dim: int  # relative tables' width
    relative_clip: int  # Shaw et al.: offsets beyond it share one vector
    attention_scale: float  # the relative term's scale, as the scores'
    rope: RopeConfig
    rotary_dim: int  # the rotated dimensions of each head (ModelConfig.rotary_dim)


def position_args(cfg: ModelConfig) -> PositionArgs:
    """What the position schemes of ``cfg`` are built from, and nothing else of the model config."""
    return PositionArgs(d_model=cfg.d_model, max_seq_len=cfg.max_seq_len, n_heads=cfg.n_heads, head_dim=cfg.head_dim,
                        relative_clip=cfg.relative_clip, attention_scale=cfg.attention_scale, rope=cfg.rope,
                        rotary_dim=cfg.rotary_dim)


class PositionScheme(nn.Module):
    """Base: no positional information at all (causal masking alone)."""

    def __init__(self, args: PositionArgs):
        super().__init__()
        self.args = args

    def context(self, offset: int, T: int, device: torch.device) -> Context:
        """The context of T unpadded queries after ``offset`` cached positions."""
        return self.attach(causal_context(offset, T, device))

    def reserve(self, n: int, device: torch.device) -> None:
        """Build now whatever tables positions below ``n`` need, so that a compiled or captured
        decoding step only reads them (growing a table inside one would change its inputs)."""

    def attach(self, ctx: Context) -> Context:
        """``ctx`` (positions and mask, from a cache or a builder) with this scheme's state added."""
        ctx.state = self.state(ctx)
        return ctx

    def state(self, ctx: Context) -> Any:
        return None

    def embed(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        return x

    def attention_term(self) -> AttentionTerm:
        return AttentionTerm()


class NoPositions(PositionScheme):
    pass


def sinusoid_table(positions: torch.Tensor, d: int) -> torch.Tensor:
    """PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(p / 10000^(2i/d)). Returns (T, d)."""
    inv = torch.exp(torch.arange(0, d, 2, dtype=torch.float32, device=positions.device) * (-math.log(10000.0) / d))
    angle = positions.float()[:, None] * inv[None, :]  # (T, d/2)
    pe = torch.zeros(len(positions), d, device=positions.device)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle[:, : d // 2])
    return pe


class Sinusoidal(PositionScheme):
    def embed(self, x, ctx):
        table = sinusoid_table(ctx.q_pos.flatten(), x.shape[-1])  # (B|1 * T, C)
        return x + table.view(*ctx.q_pos.shape, -1).to(x.dtype)


class Learned(PositionScheme):
    def __init__(self, args: PositionArgs):
        super().__init__(args)
        self.table = nn.Embedding(args.max_seq_len, args.d_model)

    def embed(self, x, ctx):
        # a position never exceeds its slot, so S slots bound every position without reading them
        if ctx.S > self.args.max_seq_len:
            raise ValueError(
                f"positions='learned' has a table of max_seq_len={self.args.max_seq_len} positions and cannot "
                f"encode position {ctx.S - 1}; use a sequence of at most {self.args.max_seq_len} tokens or a "
                "scheme that extrapolates (sinusoidal, relative, alibi, rope)"
            )
        return x + self.table.weight[ctx.q_pos]  # (B|1, T, C)


class Relative(PositionScheme):
    def state(self, ctx):
        distance = ctx.q_pos[:, :, None] - ctx.k_pos[:, None, :]  # (B|1, T, S)
        return distance.clamp(0, self.args.relative_clip)[:, None]  # (B|1, 1, T, S)

    def attention_term(self):
        return RelativeTerm(self.args)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Geometric slopes 2^(-8i/n); for n not a power of two, Press et al.'s interleaving."""

    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        return torch.tensor(power_of_2(n_heads))
    closest = 2 ** math.floor(math.log2(n_heads))
    extra = alibi_slopes(2 * closest)[0::2][: n_heads - closest]
    return torch.cat([torch.tensor(power_of_2(closest)), extra])


class Alibi(PositionScheme):
    def __init__(self, args: PositionArgs):
        super().__init__(args)
        self.register_buffer("slopes", alibi_slopes(args.n_heads), persistent=False)

    def state(self, ctx):
        distance = (ctx.k_pos[:, None, :] - ctx.q_pos[:, :, None]).clamp(max=0).float()  # (B|1, T, S), <= 0 seen
        return self.slopes.to(distance.device)[:, None, None] * distance[:, None]  # (B|1, H, T, S)

    def attention_term(self):
        return AlibiTerm()


def rope_frequencies(rope: RopeConfig, head_dim: int, max_seq_len: int, seq_len: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies theta_i (d/2,) and the attention temperature factor for ``rope``.

    ``seq_len`` (the current total length) only matters for ``dynamic``."""
    d, base, factor = head_dim, rope.base, rope.factor
    original = rope.original_max_seq_len or max_seq_len
    exponent = torch.arange(0, d, 2, dtype=torch.float32) / d  # 2i/d

    if rope.scaling == "ntk":
        base = base * factor ** (d / (d - 2))
    elif rope.scaling == "dynamic" and seq_len > original:
        # in float32, as transformers computes it during forward, so the angles agree bit for bit
        stretch = torch.tensor(factor * seq_len, dtype=torch.float32) / original - (factor - 1)
        base = base * stretch ** (d / (d - 2))
    inv_freq = 1.0 / base**exponent
    attention_factor = 1.0

    if rope.scaling == "linear":
        inv_freq = inv_freq / factor
    elif rope.scaling == "yarn":
        inv_freq, attention_factor = _yarn(rope, d, original)
    elif rope.scaling == "llama3":
        inv_freq = _llama3(rope, inv_freq, original)
    return inv_freq, attention_factor


def _yarn(rope: RopeConfig, d: int, original: int) -> tuple[torch.Tensor, float]:
    """YaRN "NTK-by-parts" (Peng et al. 2023, arXiv:2309.00071, sec. 3.2-3.4): dimensions whose
    wavelength fits more than ``beta_fast`` times in the original context keep their frequency,
    those that fit fewer than ``beta_slow`` times are interpolated by ``factor``, with a linear
    ramp between (eq. 18-20). Attention logits get temperature sqrt(1/t) = 0.1 ln(s) + 1 (eq. 22),
    applied as a factor on cos and sin; DeepSeek-V2 (arXiv:2405.04434, app. B) divides two such
    terms, m(mscale) / m(mscale_all_dim) with m(a) = 0.1 a ln(s) + 1. Written as in
    ``transformers.modeling_rope_utils._compute_yarn_parameters`` so the results agree bit for bit."""

    def correction_dim(n_rotations: float) -> float:  # the dimension that turns n_rotations times in `original`
        return (d * math.log(original / (n_rotations * 2 * math.pi))) / (2 * math.log(rope.base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 = extrapolate (keep the frequency), 0 = interpolate
    pos_freqs = rope.base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)  # 1 / theta_i
    inv = 1.0 / (rope.factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep

    def m(a: float) -> float:
        return 0.1 * a * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0

    if rope.attention_factor is not None:
        attention_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = m(rope.mscale) / m(rope.mscale_all_dim)
    else:
        attention_factor = m(1.0)
    return inv, attention_factor


def _llama3(rope: RopeConfig, inv_freq: torch.Tensor, original: int) -> torch.Tensor:
    """Llama 3.1: long wavelengths are interpolated by ``factor``, short ones kept, a smooth blend between."""
    low_wavelen = original / rope.low_freq_factor
    high_wavelen = original / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (original / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class Rotary(PositionScheme):
    def __init__(self, args: PositionArgs):
        super().__init__(args)
        with torch.device("cpu"):  # real values even for a model built on the meta device (from_hf)
            inv_freq, factor = rope_frequencies(args.rope, args.rotary_dim, args.max_seq_len, args.max_seq_len)
        # Not a buffer: model.to(bfloat16) would round the frequencies (cos off by ~1.5 at position
        # 4096). Kept in fp32, one copy per device.
        self.inv_freq = inv_freq
        self.attention_factor = factor
        self._tables: dict[torch.device, torch.Tensor] = {}

    def tables(self, inv_freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(..., 3, hd): [cos, sin, sin_half] of :class:`RotaryState` at each of ``positions`` (...)."""
        angle = positions.float()[..., None] * inv_freq.to(positions.device)  # (..., d/2): p * theta_i
        cos, sin = angle.cos() * self.attention_factor, angle.sin() * self.attention_factor
        return torch.stack((torch.cat((cos, cos), -1), torch.cat((sin, sin), -1), torch.cat((-sin, sin), -1)), -2)

    def table(self, n: int, device: torch.device) -> torch.Tensor:
        """(>= n, 3, hd) tables for positions 0 .. n-1 and beyond: computed once per device and
        grown by doubling, then indexed per forward."""
        table = self._tables.get(device)
        if table is None or table.shape[0] < n:
            n = max(n, 2 * (0 if table is None else table.shape[0]), self.args.max_seq_len)
            table = self._tables[device] = self.tables(self.inv_freq, torch.arange(n, device=device))
        return table

    def reserve(self, n, device):
        self.table(n, device)

    def state(self, ctx):
        rows = self.table(ctx.S, ctx.q_pos.device)[ctx.q_pos]  # (B|1, T, 3, hd); positions < S
        return RotaryState.of(rows)

    def attention_term(self):
        if self.args.rope.partial < 1.0:
            return PartialRotaryTerm(self.args.rope.layout, self.args.rotary_dim)
        return RotaryTerm(self.args.rope.layout)


class DynamicRotary(Rotary):
    """Dynamic NTK: the base grows with the current length, here each row's own (its last
    query's position + 1), computed on the device so a decoding step has no host value in it.
    Keys already in a KV cache keep the angles they were rotated with, exactly as in Hugging
    Face's implementation.

    One difference: Hugging Face keeps the frequencies of the longest sequence seen so far and
    reuses them for a later, shorter sequence that is still longer than ``max_seq_len``; here
    the frequencies depend only on the current length, so a forward never depends on history."""

    def state(self, ctx):
        rope, d = self.args.rope, self.args.rotary_dim
        original = rope.original_max_seq_len or self.args.max_seq_len
        seq_len = ctx.q_pos[:, -1:] + 1  # (B|1, 1)
        # as rope_frequencies computes it, in float32, elementwise
        stretch = (seq_len.float() * rope.factor) / original - (rope.factor - 1)
        base = torch.where(seq_len > original, rope.base * stretch ** (d / (d - 2)), rope.base)
        exponent = torch.arange(0, d, 2, dtype=torch.float32, device=seq_len.device) / d
        inv_freq = 1.0 / base[..., None] ** exponent  # (B|1, 1, d/2)
        return RotaryState.of(self.tables(inv_freq, ctx.q_pos))


SCHEMES: dict[str, type[PositionScheme]] = {
    "none": NoPositions,
    "sinusoidal": Sinusoidal,
    "learned": Learned,
    "relative": Relative,
    "alibi": Alibi,
    "rope": Rotary,
}


def build_positions(cfg: ModelConfig) -> PositionScheme:
    if cfg.positions == "rope" and cfg.rope.scaling == "dynamic":
        return DynamicRotary(position_args(cfg))
    return SCHEMES[cfg.positions](position_args(cfg))


def build_local_positions(cfg: ModelConfig) -> PositionScheme | None:
    """The scheme of local layers where it is their own: rotary with ``rope.local_base`` and no
    scaling (Gemma 3 rotates local layers with base 10k, global ones with a larger, scaled base).
    None: local layers share the model's scheme."""
    if cfg.rope.local_base is None:
        return None
    rope = RopeConfig(base=cfg.rope.local_base, layout=cfg.rope.layout, partial=cfg.rope.partial)
    return Rotary(dataclasses.replace(position_args(cfg), rope=rope))
