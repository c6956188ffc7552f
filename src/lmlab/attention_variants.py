"""Attention variants by name (``ModelConfig.attention.variant``): what each one is, computed from the model
config without torch, so that a config validates and sizes itself before anything is built.

    attention.variant ─┬─▶ ATTENTION_VARIANTS[name]   here: the variant's facts, read by config, memory, model
                       │     (its module's own config, q/k/v and cache widths, rotary width, what it
                       │      supports, parameter floor, score FLOPs)
                       └─▶ model.ATTENTIONS[name]      the nn.Module that computes it, built from that config

``attention.variant`` left unset is the variant the config's sections imply: ``mla`` where ``ModelConfig.mla``
is set (configs written before the field existed), else ``standard``. A variant named that its sections already
imply is stored unset, so one model has one config and one run identity.

Adding a variant is a class here (or an instance of an existing one, where the facts are standard attention's),
its module, and one line in each registry: docs/design.md, "Add a variant", walks through differential attention.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .schema import Config, added, check_size, suggest

# config.py imports this module, so it cannot import ModelConfig: the name says what every ``cfg`` here is
ModelConfig = Any


# ============================================================== multi-head latent attention's section
_MLA = "multi-head latent attention: DeepSeek-V2/V3"


@dataclasses.dataclass(kw_only=True, frozen=True)
class MLAConfig(Config):
    """Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434 sec. 2.1; DeepSeek-V3 the same);
    ``ModelConfig.mla``, the section of the ``mla`` variant.

    Keys and values of every head are up-projected from one compressed latent c_t = W_DKV x_t of
    ``kv_lora_rank`` values per token (eq. 9-11), so the decode cache holds that latent, not keys and
    values. Rotary positions cannot act on keys made from a cached latent (the rotation would sit
    between W_UK and the query), so each head's query and key get ``qk_rope_head_dim`` extra
    "decoupled" dimensions that rotate, the key's shared by all heads and computed from x_t directly
    (eq. 14-19). Queries are compressed the same way through ``q_lora_rank`` (eq. 12-13; None =
    a full-rank query projection, as DeepSeek-V2-Lite). Each latent is RMS-normalized before its
    up-projection, as the released models do.
    """

    # every field is new with ModelConfig.mla (added after the first hashed runs), so each is declared with ``added``
    q_lora_rank: int | None = added(None, since=_MLA)  # d_c' of the query latent; None: one (d_model, H * qk) W_Q
    kv_lora_rank: int = added(128, since=_MLA)  # d_c: the cached latent per token; 4 d_h as V2/V3's 512 (sec. 2.1.4)
    qk_nope_head_dim: int = added(32, since=_MLA)  # d_h: the part of each head's query and key that is not rotated
    qk_rope_head_dim: int = added(16, since=_MLA)  # d_h^R: the decoupled rotary part (V2/V3: d_h / 2)
    v_head_dim: int = added(32, since=_MLA)  # each head's value width

    @property
    def qk_head_dim(self) -> int:
        """The width of each head's query and key: the unrotated part and the rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def validate(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            check_size(f"mla.{name}", getattr(self, name))
        if self.q_lora_rank is not None:
            check_size("mla.q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"mla.qk_rope_head_dim={self.qk_rope_head_dim} must be even: rotary turns pairs of dimensions; "
                f"choose {self.qk_rope_head_dim + 1}"
            )


_DSA = "DeepSeek sparse attention: DeepSeek-V3.2"


@dataclasses.dataclass(kw_only=True, frozen=True)
class DSAConfig(Config):
    """DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2-Exp, sec. 2.1); ``ModelConfig.dsa``, the section
    of the ``dsa`` variant, which is multi-head latent attention (its section ``mla``) whose queries each attend to
    the ``topk`` keys the indexer scores highest (``sparse_attention.py``).

    The indexer has ``indexer_heads`` heads of ``indexer_head_dim``: queries from MLA's query latent, one key per
    token, and a weight per head; a key's score is the heads' weighted sum of ReLU(q·k) (eq. 1). V3.2 uses 64 heads
    of 128 and keeps 2048 keys; the defaults are that at laptop scale. The indexer learns from its own KL loss to
    the main attention (sec. 2.1.1), weighted by ``indexer_loss_coef``; its inputs are detached, so that weight sets
    only how fast the indexer learns."""

    # every field is new with ModelConfig.dsa (added after the first hashed runs), so each is declared with ``added``
    indexer_heads: int = added(4, since=_DSA)  # H^I (V3.2: 64)
    indexer_head_dim: int = added(32, since=_DSA)  # d^I (V3.2: 128); its first qk_rope_head_dim dimensions rotate
    topk: int = added(64, since=_DSA)  # k: the keys each query attends to (V3.2: 2048)
    indexer_loss_coef: float = added(1.0, since=_DSA)  # the indexer's KL loss (training only)

    def validate(self) -> None:
        for name in ("indexer_heads", "indexer_head_dim", "topk"):
            check_size(f"dsa.{name}", getattr(self, name))
        if not (math.isfinite(self.indexer_loss_coef) and self.indexer_loss_coef >= 0):
            raise ValueError(f"dsa.indexer_loss_coef={self.indexer_loss_coef} must be a number >= 0 (0: the indexer "
                             "does not learn)")


# ============================================================== what each module is built from
@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionArgs:
    """Standard attention's own config (``attention.Attention``), resolved from the model's by its variant."""

    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float  # the factor of every score q·k (ModelConfig.attention_scale)
    dropout: float  # on the attention probabilities
    qkv_bias: bool
    out_bias: bool
    qk_norm: str  # ModelConfig.qk_norm: none, head, full
    gate: str  # ModelConfig.attn_gate: none, elementwise, headwise
    sinks: str  # attention.sinks: none, learned
    norm_gain: str  # the q/k norms' RMSNorm gain (ModelConfig.norm_gain) ...
    norm_eps: float  # ... and epsilon


@dataclasses.dataclass(frozen=True, kw_only=True)
class LatentAttentionArgs:
    """Multi-head latent attention's own config (``mla.LatentAttention``): its section ``mla`` and the sizes
    around it."""

    d_model: int
    n_heads: int
    mla: MLAConfig
    scale: float  # softmax_scale: 1 / sqrt(qk_head_dim), with DeepSeek's YaRN temperature
    dropout: float
    qkv_bias: bool
    out_bias: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseAttentionArgs:
    """DeepSeek Sparse Attention's own config (``sparse_attention.SparseLatentAttention``): MLA's, and the indexer's
    section ``dsa``."""

    latent: LatentAttentionArgs
    dsa: DSAConfig


# ============================================================== the variants
class AttentionVariant:
    """The facts of one attention variant that the config, the memory estimate and the model's accounting need.
    Each method reads the resolved model config (sizes derived); the defaults here derive from the others."""

    # ModelConfig fields holding this variant's own parameters: the first one set implies the variant where
    # attention.variant is unset; each is filled with its defaults where the variant is chosen; any other
    # variant's section is refused
    sections: tuple[str, ...] = ()
    supports_mup = False  # lmlab.mup knows this variant's shapes

    def check(self, cfg: ModelConfig) -> None:
        """Raise ValueError naming the field of ``cfg`` this variant cannot compute with."""

    def module_config(self, cfg: ModelConfig) -> Any:
        """The config the variant's module (``model.ATTENTIONS``) is built from: its own, nothing else."""
        raise NotImplementedError

    def widths(self, cfg: ModelConfig) -> tuple[int, int]:
        """(query/key width, value width) of each head."""
        raise NotImplementedError

    def rotary_width(self, cfg: ModelConfig) -> int:
        """The dimensions of each query and key head that rotary may turn (before ``rope.partial``)."""
        raise NotImplementedError

    def cache_widths(self, cfg: ModelConfig) -> tuple[int, int, int]:
        """What the decode cache holds per token and layer (``attention.KVCache``), as (heads, key width,
        value width)."""
        raise NotImplementedError

    def parameter_floor(self, cfg: ModelConfig) -> int:
        """Fewer parameters than one layer of this attention has, by arithmetic alone (``memory.parameter_floor``)."""
        raise NotImplementedError

    def cache_values(self, cfg: ModelConfig) -> int:
        """Values the decode cache holds per token and layer (``memory.kv_cache_bytes``)."""
        heads, key_width, value_width = self.cache_widths(cfg)
        return heads * (key_width + value_width)

    def score_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        """Training FLOPs per token and layer of the scores and their mix of values over a context of ``seq_len``:
        6 H (d_qk + d_v) T, PaLM's 12 H d_head T with its two widths (``Transformer.flops_per_token``)."""
        d_qk, d_v = self.widths(cfg)
        return 6.0 * cfg.n_heads * (d_qk + d_v) * seq_len


class StandardVariant(AttentionVariant):
    """Multi-head attention with grouped-query and multi-query options (Vaswani et al. 2017; ``attention.py``):
    n_heads queries and n_kv_heads keys and values of head_dim each."""

    supports_mup = True

    def check(self, cfg: ModelConfig) -> None:
        if cfg.positions == "rope" and cfg.head_dim % 2:
            raise ValueError(
                f"positions='rope' needs an even head_dim, got head_dim={cfg.head_dim} "
                f"(d_model={cfg.d_model}, n_heads={cfg.n_heads}); change n_heads or head_dim"
            )

    def module_config(self, cfg: ModelConfig) -> AttentionArgs:
        return AttentionArgs(
            d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
            scale=cfg.attention_scale, dropout=cfg.dropout, qkv_bias=cfg.qkv_bias, out_bias=cfg.bias,
            qk_norm=cfg.qk_norm, gate=cfg.attn_gate, sinks=cfg.attention.sinks, norm_gain=cfg.norm_gain,
            norm_eps=cfg.norm_eps,
        )

    def widths(self, cfg: ModelConfig) -> tuple[int, int]:
        return cfg.head_dim, cfg.head_dim

    def rotary_width(self, cfg: ModelConfig) -> int:
        return cfg.head_dim

    def cache_widths(self, cfg: ModelConfig) -> tuple[int, int, int]:
        return cfg.n_kv_heads, cfg.head_dim, cfg.head_dim

    def parameter_floor(self, cfg: ModelConfig) -> int:
        return 2 * cfg.d_model * cfg.n_heads * cfg.head_dim  # the query and output projections


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek-V2's YaRN temperature term m = 0.1 mscale ln(s) + 1 (app. B), 1 without extension."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def softmax_scale(cfg: ModelConfig) -> float:
    """MLA's score factor: 1 / sqrt(d_nope + d_rope), times m(mscale_all_dim)^2 under YaRN: DeepSeek's YaRN
    scales the rotary tables by m(mscale) / m(mscale_all_dim) (``positions._yarn``) and every score by
    m(mscale_all_dim)^2, as transformers' DeepseekV2/V3 attention does."""
    scale = cfg.mla.qk_head_dim**-0.5
    rope = cfg.rope
    if rope.scaling == "yarn" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


class LatentVariant(AttentionVariant):
    """Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434 sec. 2.1; ``mla.py``), its parameters in the
    section ``mla``: keys and values up-projected from one cached latent per token, with decoupled rotary
    dimensions."""

    sections = ("mla",)

    def check(self, cfg: ModelConfig) -> None:
        if cfg.positions != "rope":
            raise ValueError(
                f"mla needs positions='rope' (its decoupled query/key dimensions are rotary), not "
                f"positions={cfg.positions!r}; set positions='rope' or mla=None"
            )
        for name in ("qk_norm", "attn_gate"):
            if getattr(cfg, name) != "none":
                raise ValueError(
                    f"{name}={getattr(cfg, name)!r} is an option of standard attention, not of mla (whose latents "
                    f"have their own RMSNorms); set {name}='none' or mla=None"
                )
        if cfg.n_kv_heads != cfg.n_heads:
            raise ValueError(
                f"n_kv_heads={cfg.n_kv_heads} does not apply with mla: every head's keys and values come from one "
                "cached latent; leave n_kv_heads unset (= n_heads)"
            )
        a, rope = cfg.attention, cfg.rope
        if (a.window, tuple(a.pattern), a.sinks, a.scale_dim, rope.partial, rope.nope_every) != (
                None, ("global",), "none", None, 1.0, 0):
            raise ValueError(
                "mla with attention windows, sinks, rope.partial or rope.nope_every is not implemented; "
                "leave those at their defaults with mla set"
            )

    def module_config(self, cfg: ModelConfig) -> LatentAttentionArgs:
        return LatentAttentionArgs(d_model=cfg.d_model, n_heads=cfg.n_heads, mla=cfg.mla, scale=softmax_scale(cfg),
                                   dropout=cfg.dropout, qkv_bias=cfg.qkv_bias, out_bias=cfg.bias)

    def widths(self, cfg: ModelConfig) -> tuple[int, int]:
        return cfg.mla.qk_head_dim, cfg.mla.v_head_dim

    def rotary_width(self, cfg: ModelConfig) -> int:
        return cfg.mla.qk_rope_head_dim

    def cache_widths(self, cfg: ModelConfig) -> tuple[int, int, int]:
        # one compressed latent and the shared rotary key per token (DeepSeek-V2 sec. 2.1.2-2.1.3)
        return 1, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim

    def parameter_floor(self, cfg: ModelConfig) -> int:
        m = cfg.mla  # the output projection and the latent's up-projection to keys and values
        return cfg.n_heads * (m.v_head_dim * cfg.d_model + m.kv_lora_rank * (m.qk_nope_head_dim + m.v_head_dim))


class SparseVariant(LatentVariant):
    """DeepSeek Sparse Attention (DeepSeek-V3.2-Exp sec. 2.1; ``sparse_attention.py``), its parameters in the sections
    ``dsa`` (the indexer) and ``mla``: latent attention over the ``dsa.topk`` keys a lightning indexer selects per
    query."""

    sections = ("dsa", "mla")

    def check(self, cfg: ModelConfig) -> None:
        super().check(cfg)
        m, dsa = cfg.mla, cfg.dsa
        if m.q_lora_rank is None:
            raise ValueError("attention.variant='dsa' reads MLA's query latent, and mla.q_lora_rank is null; set "
                             "mla.q_lora_rank (DeepSeek-V3.2: 1536)")
        if dsa.indexer_head_dim < m.qk_rope_head_dim:
            raise ValueError(f"dsa.indexer_head_dim={dsa.indexer_head_dim} is narrower than the "
                             f"mla.qk_rope_head_dim={m.qk_rope_head_dim} dimensions it rotates; choose "
                             f"indexer_head_dim >= {m.qk_rope_head_dim}")
        if cfg.mtp is not None:
            raise ValueError("mtp with attention.variant='dsa' is not implemented (the MTP blocks' indexers would not "
                             "learn); set mtp=null")

    def module_config(self, cfg: ModelConfig) -> SparseAttentionArgs:
        return SparseAttentionArgs(latent=super().module_config(cfg), dsa=cfg.dsa)

    def cache_widths(self, cfg: ModelConfig) -> tuple[int, int, int]:
        # MLA's latent, and beside its rotary key the indexer's key (sec. 2.1: the indexer scores every cached token)
        return 1, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim + cfg.dsa.indexer_head_dim

    def score_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        """MLA's over the min(topk, seq_len) selected keys, plus the indexer's scores over all seq_len keys, forward
        and backward (its loss trains it): 6 H^I d^I T."""
        dsa = cfg.dsa
        indexer = 6.0 * dsa.indexer_heads * dsa.indexer_head_dim * seq_len
        return super().score_flops(cfg, min(dsa.topk, seq_len)) + indexer


# attention.variant -> its facts; model.ATTENTIONS holds the module of each name
ATTENTION_VARIANTS: dict[str, AttentionVariant] = {"standard": StandardVariant(), "mla": LatentVariant(),
                                                   "dsa": SparseVariant()}


# ============================================================== which variant a config means
def check_variant_name(name: str) -> None:
    if name not in ATTENTION_VARIANTS:
        raise ValueError(f"attention.variant={name!r} is not a registered variant{suggest(name, ATTENTION_VARIANTS)}; "
                         f"choose one of {sorted(ATTENTION_VARIANTS)}")


def implied_variant(cfg: ModelConfig) -> str:
    """The variant ``cfg``'s sections imply: the one whose first section is set (``mla`` -> "mla", ``dsa`` -> "dsa"),
    else standard."""
    implied = [name for name, v in ATTENTION_VARIANTS.items() if v.sections and getattr(cfg, v.sections[0]) is not None]
    # a variant that holds another's section beside its own (dsa: dsa and mla) is the one meant where both are set
    implied = [name for name in implied if not any(
        ATTENTION_VARIANTS[name].sections[0] in ATTENTION_VARIANTS[other].sections[1:] for other in implied)]
    if len(implied) > 1:
        raise ValueError(f"the sections {[ATTENTION_VARIANTS[n].sections[0] for n in implied]} each imply a variant; "
                         f"set attention.variant to one of {implied}")
    return implied[0] if implied else "standard"


def variant_name(cfg: ModelConfig) -> str:
    """``attention.variant``, or where it is unset the variant the sections imply."""
    return cfg.attention.variant if cfg.attention.variant is not None else implied_variant(cfg)


def variant_of(cfg: ModelConfig) -> AttentionVariant:
    """The facts of ``cfg``'s attention variant."""
    return ATTENTION_VARIANTS[variant_name(cfg)]


def check_sections(cfg: ModelConfig) -> None:
    """Refuse a section of another variant than ``cfg``'s (``mla`` set with attention.variant='standard')."""
    name = variant_name(cfg)
    own = ATTENTION_VARIANTS[name].sections
    for other, variant in ATTENTION_VARIANTS.items():
        for section in variant.sections:
            if section not in own and getattr(cfg, section) is not None:
                raise ValueError(f"{section} holds the parameters of attention.variant={other!r}, and this model's "
                                 f"variant is {name!r}; set {section}=null or attention.variant={other!r}")
