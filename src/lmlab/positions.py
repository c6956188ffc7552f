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

    Queries sit at positions offset .. offset+T-1; keys (cached plus new) at 0 .. offset+T-1.
    """

    offset: int
    T: int
    mask: torch.Tensor | None  # (T, S) bool, True = may attend; None when the shapes say it (see below)
    state: Any = None  # scheme-specific: rotary (cos, sin), relative index, ALiBi bias

    @property
    def S(self) -> int:
        return self.offset + self.T

    @property
    def is_causal(self) -> bool:
        """No cache offset: the plain lower-triangular mask, which fused kernels apply themselves."""
        return self.offset == 0 and self.T > 1

    def visible(self, device: torch.device) -> torch.Tensor | None:
        """The (T, S) mask of keys each query may see; None when it sees all of them (one query,
        the decoding step), so no masking is needed at all."""
        if self.mask is not None:
            return self.mask
        return torch.ones(self.T, self.S, dtype=torch.bool, device=device).tril() if self.is_causal else None


def causal_mask(offset: int, T: int, device: torch.device) -> torch.Tensor:
    q = torch.arange(offset, offset + T, device=device)
    k = torch.arange(offset + T, device=device)
    return k[None, :] <= q[:, None]  # (T, S)


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
    """Per-forward rotary tables for the T new positions, each (T, hd)."""

    cos: torch.Tensor  # [cos p·θ, cos p·θ]: both members of a pair share the angle
    sin: torch.Tensor  # [sin p·θ, sin p·θ]
    sin_half: torch.Tensor  # [-sin p·θ, sin p·θ]: the half layout's signs, folded in once per forward


class RotaryTerm(AttentionTerm):
    def __init__(self, layout: str):
        super().__init__()
        self.rotate_one = rotate_half if layout == "half" else rotate_interleaved
        self.half_rotation = layout == "half"

    def rotate(self, qk, ctx):
        # queries and keys in one call; the tables are fp32, a bf16 model stays bf16
        return self.rotate_one(qk, ctx.state).to(qk.dtype)


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

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.scale = cfg.head_dim**-0.5
        self.rel_k = nn.Parameter(torch.zeros(cfg.relative_clip + 1, cfg.head_dim))
        self.rel_v = nn.Parameter(torch.zeros(cfg.relative_clip + 1, cfg.head_dim))

    def init_params(self, init: Init) -> None:
        """a^K and a^V ~ N(0, std), as the other embeddings."""
        init.normal(self.rel_k, init.std)
        init.normal(self.rel_v, init.std)

    def score_bias(self, q, ctx):
        index = ctx.state  # (T, S) long in [0, k]
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
class PositionScheme(nn.Module):
    """Base: no positional information at all (causal masking alone)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg

    def context(self, offset: int, T: int, device: torch.device) -> Context:
        # a mask only where the shapes do not imply it: several queries after a cache offset
        mask = causal_mask(offset, T, device) if offset > 0 and T > 1 else None
        return Context(offset, T, mask, self.state(offset, T, device))

    def state(self, offset: int, T: int, device: torch.device) -> Any:
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
        pos = torch.arange(ctx.offset, ctx.S, device=x.device)
        return x + sinusoid_table(pos, x.shape[-1]).to(x.dtype)


class Learned(PositionScheme):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.table = nn.Embedding(cfg.max_seq_len, cfg.d_model)

    def embed(self, x, ctx):
        if ctx.S > self.cfg.max_seq_len:
            raise ValueError(
                f"positions='learned' has a table of max_seq_len={self.cfg.max_seq_len} positions and cannot "
                f"encode position {ctx.S - 1}; use a sequence of at most {self.cfg.max_seq_len} tokens or a "
                "scheme that extrapolates (sinusoidal, relative, alibi, rope)"
            )
        return x + self.table.weight[ctx.offset : ctx.S]


class Relative(PositionScheme):
    def state(self, offset, T, device):
        q = torch.arange(offset, offset + T, device=device)
        k = torch.arange(offset + T, device=device)
        return (q[:, None] - k[None, :]).clamp(0, self.cfg.relative_clip)  # (T, S)

    def attention_term(self):
        return RelativeTerm(self.cfg)


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
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.register_buffer("slopes", alibi_slopes(cfg.n_heads), persistent=False)

    def state(self, offset, T, device):
        q = torch.arange(offset, offset + T, device=device)
        k = torch.arange(offset + T, device=device)
        distance = (k[None, :] - q[:, None]).clamp(max=0).float()  # (T, S), <= 0 for visible keys
        return (self.slopes.to(device)[:, None, None] * distance)[None]  # (1, H, T, S)

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
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        inv_freq, factor = rope_frequencies(cfg.rope, cfg.head_dim, cfg.max_seq_len, cfg.max_seq_len)
        # Not a buffer: model.to(bfloat16) would round the frequencies (cos off by ~1.5 at position
        # 4096). Kept in fp32, one copy per device.
        self.inv_freq = inv_freq
        self.attention_factor = factor
        self._tables: dict[torch.device, RotaryState] = {}

    def tables(self, inv_freq: torch.Tensor, positions: torch.Tensor) -> RotaryState:
        angle = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]  # (T, d/2): p * theta_i
        cos, sin = angle.cos() * self.attention_factor, angle.sin() * self.attention_factor
        return RotaryState(torch.cat((cos, cos), -1), torch.cat((sin, sin), -1), torch.cat((-sin, sin), -1))

    def state(self, offset, T, device):
        # tables are computed once per device and grown by doubling, then sliced per forward
        table = self._tables.get(device)
        if table is None or table.cos.shape[0] < offset + T:
            n = max(offset + T, 2 * (0 if table is None else table.cos.shape[0]), self.cfg.max_seq_len)
            table = self._tables[device] = self.tables(self.inv_freq, torch.arange(n, device=device))
        return RotaryState(*(t[offset : offset + T] for t in table))

    def attention_term(self):
        return RotaryTerm(self.cfg.rope.layout)


class DynamicRotary(Rotary):
    """Dynamic NTK: the base grows with the current length. Keys already in a KV cache keep the
    angles they were rotated with, exactly as in Hugging Face's implementation.

    One difference: Hugging Face keeps the frequencies of the longest sequence seen so far and
    reuses them for a later, shorter sequence that is still longer than ``max_seq_len``; here
    the frequencies depend only on the current length, so a forward never depends on history."""

    def state(self, offset, T, device):
        inv_freq = rope_frequencies(self.cfg.rope, self.cfg.head_dim, self.cfg.max_seq_len, offset + T)[0]
        return self.tables(inv_freq, torch.arange(offset, offset + T, device=device))


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
        return DynamicRotary(cfg)
    return SCHEMES[cfg.positions](cfg)
