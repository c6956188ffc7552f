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
from typing import Any, Literal

from .schema import Config, added, check_positive, check_size, divisor_choices, suggest

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


# ============================================================== DeepSeek-V4's compressed attention's section
_V4 = "compressed attention: DeepSeek-V4"
CompressedKind = Literal["sliding", "csa", "hca"]


@dataclasses.dataclass(kw_only=True, frozen=True)
class CompressedConfig(Config):
    """DeepSeek-V4's attention (DeepSeek-AI 2026, "DeepSeek-V4", sec. 2.3; transformers' ``DeepseekV4Attention``);
    ``ModelConfig.compressed``, the section of the ``compressed`` variant (``compressed_attention.py``).

    One key/value head whose keys are its values (``n_kv_heads=1``); queries through a normalized rank-
    ``q_lora_rank`` latent and a weightless RMSNorm per head; rotary on each head's trailing ``rope_head_dim``
    dimensions, the output's turned back; a learned sink per head (``attention.sinks``); the heads' outputs
    projected in ``o_groups`` groups to ``o_lora_rank`` each, then to d_model. Every layer sees a sliding ``window``
    of raw keys and, by its kind in ``layers`` (repeated over the layers, as ``attention.pattern``):
      sliding  nothing more;
      csa      one compressed entry per ``csa_rate`` tokens, pooled over two overlapping windows by a learned gate
               and position bias, of which a lightning indexer (``index_heads`` x ``index_head_dim``) keeps the
               ``index_topk`` best per query (compressed sparse attention, sec. 2.3.1);
      hca      one entry per ``hca_rate`` tokens, non-overlapping, all kept (heavily compressed, sec. 2.3.2).
    Sliding layers rotate with the model's ``rope``; compressed layers, their compressors and the indexer with
    base ``rope_base`` and YaRN by ``yarn_factor`` (1: none), whose temperature V4 leaves out (transformers'
    ``compress`` rotary set). The defaults are V4's shape at laptop scale; V4-Flash's values are in comments."""

    # every field is new with ModelConfig.compressed (added after the first hashed runs), so each is declared with added
    q_lora_rank: int = added(64, since=_V4)  # the query latent (V4-Flash: 1024)
    rope_head_dim: int = added(16, since=_V4)  # the trailing dimensions of each head that rotate (V4: 64 of 512)
    window: int = added(64, since=_V4)  # raw keys each query sees, itself included (n_win; V4: 128)
    layers: tuple[CompressedKind, ...] = added(("hca", "csa"), since=_V4)  # each layer's kind, repeated
    csa_rate: int = added(4, since=_V4)  # m: tokens per CSA entry (V4: 4)
    hca_rate: int = added(32, since=_V4)  # m': tokens per HCA entry (V4: 128)
    index_heads: int = added(4, since=_V4)  # the indexer's query heads n_h^I (V4: 64)
    index_head_dim: int = added(32, since=_V4)  # ... their width c^I (V4: 128); the trailing rope_head_dim rotate
    index_topk: int = added(16, since=_V4)  # CSA entries each query keeps (V4: 512)
    # the indexer's KL loss to the attention over the entries it keeps (training only; its inputs are detached, as
    # DeepSeek-V3.2's lightning indexer learns, sec. 2.1.1): the selection itself passes no gradient
    index_loss_coef: float = added(1.0, since=_V4)
    o_groups: int = added(2, since=_V4)  # g: groups of heads in the output projection (V4-Flash: 8)
    o_lora_rank: int = added(64, since=_V4)  # d_g: each group's projection (V4: 1024)
    rope_base: float = added(160000.0, since=_V4)  # compressed layers' rotary base (compress_rope_theta)
    yarn_factor: float = added(1.0, since=_V4)  # compressed layers' YaRN factor, 1 = none (V4: 16)
    yarn_original_max_seq_len: int | None = added(None, since=_V4)  # YaRN's original context; None: max_seq_len
    yarn_beta_fast: float = added(32.0, since=_V4)  # YaRN's ramp (Peng et al. 2023, as rope.beta_fast)
    yarn_beta_slow: float = added(1.0, since=_V4)

    def validate(self) -> None:
        for name in ("q_lora_rank", "rope_head_dim", "window", "csa_rate", "hca_rate", "index_heads",
                     "index_head_dim", "index_topk", "o_groups", "o_lora_rank"):
            check_size(f"compressed.{name}", getattr(self, name))
        if self.rope_head_dim % 2:
            raise ValueError(f"compressed.rope_head_dim={self.rope_head_dim} must be even: rotary turns pairs of "
                             f"dimensions; choose {self.rope_head_dim + 1}")
        if not self.layers:
            raise ValueError("compressed.layers=[] is empty; give each layer's kind, e.g. ['hca', 'csa']")
        if self.index_head_dim < self.rope_head_dim:
            raise ValueError(f"compressed.index_head_dim={self.index_head_dim} is narrower than the "
                             f"compressed.rope_head_dim={self.rope_head_dim} dimensions it rotates; choose "
                             f"index_head_dim >= {self.rope_head_dim}")
        check_positive("compressed.rope_base", self.rope_base)
        check_positive("compressed.index_loss_coef", self.index_loss_coef, allow_zero=True)
        if self.yarn_factor < 1:
            raise ValueError(f"compressed.yarn_factor={self.yarn_factor} is not valid; use 1 (no scaling) or more")
        if self.yarn_original_max_seq_len is not None:
            check_size("compressed.yarn_original_max_seq_len", self.yarn_original_max_seq_len)
        if self.yarn_beta_fast <= self.yarn_beta_slow:
            raise ValueError(f"compressed.yarn_beta_fast={self.yarn_beta_fast} must be greater than "
                             f"compressed.yarn_beta_slow={self.yarn_beta_slow}")
        unused = [f"{name}={getattr(self, name)}" for name, default in (
            ("yarn_original_max_seq_len", None), ("yarn_beta_fast", 32.0), ("yarn_beta_slow", 1.0))
            if getattr(self, name) != default]
        if self.yarn_factor == 1 and unused:
            raise ValueError(f"compressed.{unused[0]} is a parameter of YaRN, and compressed.yarn_factor=1 scales "
                             "nothing; set yarn_factor > 1 or leave it at its default")

    def kind(self, layer: int) -> str:
        return self.layers[layer % len(self.layers)]

    def rate(self, kind: str) -> int:
        """Tokens per compressed entry of a layer of ``kind`` (0: a sliding layer has none)."""
        return {"sliding": 0, "csa": self.csa_rate, "hca": self.hca_rate}[kind]


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
    qk_norm_position: str  # ModelConfig.qk_norm_position: before_rope, after_rope
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompressedAttentionArgs:
    """DeepSeek-V4's attention's own config (``compressed_attention.CompressedAttention``): its section ``compressed``
    and the sizes, rotary and norms around it."""

    d_model: int
    n_heads: int
    head_dim: int
    section: CompressedConfig
    scale: float  # the factor of every score (ModelConfig.attention_scale: 1 / sqrt(head_dim))
    dropout: float
    sinks: str  # attention.sinks: none, learned
    norm_eps: float  # its RMSNorms' (V4: rms_norm_eps)
    rope: Any  # ModelConfig.rope (a RopeConfig): the sliding layers' rotary, and the layout of every rotation
    max_seq_len: int


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
        """Values the decode cache holds per token and layer."""
        heads, key_width, value_width = self.cache_widths(cfg)
        return heads * (key_width + value_width)

    def cache_values_for(self, cfg: ModelConfig, length: int) -> int:
        """Values the decode cache holds per row after ``length`` tokens, every layer (``memory.kv_cache_bytes``):
        ``cache_values`` per token and layer, where the cache grows with every token."""
        return cfg.n_layers * length * self.cache_values(cfg)

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
            qk_norm=cfg.qk_norm, qk_norm_position=cfg.qk_norm_position, gate=cfg.attn_gate, sinks=cfg.attention.sinks,
            norm_gain=cfg.norm_gain, norm_eps=cfg.norm_eps,
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


class CompressedVariant(AttentionVariant):
    """DeepSeek-V4's attention (``compressed_attention.py``), its parameters in the section ``compressed``: one key/
    value head over a sliding window, plus compressed entries in CSA and HCA layers, a learned sink per head and a
    grouped output projection."""

    sections = ("compressed",)

    def check(self, cfg: ModelConfig) -> None:
        c = cfg.compressed
        if cfg.positions != "rope":
            raise ValueError(f"attention.variant='compressed' rotates its queries and keys, not positions="
                             f"{cfg.positions!r}; set positions='rope'")
        if cfg.n_kv_heads != 1:
            raise ValueError(f"attention.variant='compressed' has one key/value head whose keys are its values; set "
                             f"n_kv_heads=1 (it is {cfg.n_kv_heads})")
        for name in ("qk_norm", "attn_gate"):
            if getattr(cfg, name) != "none":
                raise ValueError(f"{name}={getattr(cfg, name)!r} is an option of standard attention, not of compressed "
                                 f"attention (whose queries have a norm of their own); set {name}='none'")
        if cfg.qkv_bias:
            raise ValueError("qkv_bias=True: compressed attention has no biases (as DeepSeek-V4); set qkv_bias=false")
        a, rope = cfg.attention, cfg.rope
        if (a.window, tuple(a.pattern), rope.partial, rope.nope_every, rope.local_base) != (
                None, ("global",), 1.0, 0, None) or rope.scaling == "dynamic":
            raise ValueError("attention.window/pattern, rope.partial, rope.nope_every, rope.local_base and "
                             "rope.scaling='dynamic' do not apply to compressed attention (its window is "
                             "compressed.window, its rotated width compressed.rope_head_dim); leave them at their "
                             "defaults")
        if c.rope_head_dim > cfg.head_dim:
            raise ValueError(f"compressed.rope_head_dim={c.rope_head_dim} exceeds head_dim={cfg.head_dim}; choose "
                             f"rope_head_dim <= {cfg.head_dim}")
        if cfg.n_heads * cfg.head_dim % c.o_groups or c.o_groups > cfg.n_heads:
            raise ValueError(f"compressed.o_groups={c.o_groups} does not split the {cfg.n_heads} heads into groups "
                             f"of equal width; choose o_groups in {divisor_choices(cfg.n_heads, c.o_groups)}")
        if cfg.mtp is not None:
            raise ValueError("mtp with attention.variant='compressed' is not implemented (DeepSeek-V4's MTP layers "
                             "are not in transformers either); set mtp=null")

    def module_config(self, cfg: ModelConfig) -> CompressedAttentionArgs:
        return CompressedAttentionArgs(
            d_model=cfg.d_model, n_heads=cfg.n_heads, head_dim=cfg.head_dim, section=cfg.compressed,
            scale=cfg.attention_scale, dropout=cfg.dropout, sinks=cfg.attention.sinks, norm_eps=cfg.norm_eps,
            rope=cfg.rope, max_seq_len=cfg.max_seq_len,
        )

    def widths(self, cfg: ModelConfig) -> tuple[int, int]:
        return cfg.head_dim, cfg.head_dim

    def rotary_width(self, cfg: ModelConfig) -> int:
        return cfg.compressed.rope_head_dim

    def cache_widths(self, cfg: ModelConfig) -> tuple[int, int, int]:
        return 1, cfg.head_dim, 0  # one head whose keys are its values (the window; entries: cache_values_for)

    def cache_values_for(self, cfg: ModelConfig, length: int) -> int:
        """What ``compressed_attention.CompressedKVCache`` holds per row after ``length`` tokens: in every layer the
        window's last window - 1 keys; in a compressed layer its compressor's (and CSA's indexer's) projections of
        the last 2m (CSA) or m (HCA) tokens, [kv; gate] of each series, and its entries, one per m tokens (room for
        length // m + 2)."""
        c, d = cfg.compressed, cfg.head_dim
        total = 0
        for layer in range(cfg.n_layers):
            kind = c.kind(layer)
            total += min(c.window - 1, length) * d
            parts = {"sliding": [], "csa": [(c.csa_rate, 2, d), (c.csa_rate, 2, c.index_head_dim)],
                     "hca": [(c.hca_rate, 1, d)]}[kind]
            for rate, series, width in parts:
                total += series * rate * 2 * series * width + (length // rate + 2) * width
        return total

    def parameter_floor(self, cfg: ModelConfig) -> int:
        c, heads = cfg.compressed, cfg.n_heads * cfg.head_dim  # the query up-projection and the grouped output one
        return heads * c.q_lora_rank + heads * c.o_lora_rank

    def score_flops(self, cfg: ModelConfig, seq_len: int) -> float:
        """Per token, averaged over the layers' kinds: the window's min(window, T) keys, plus CSA's min(topk, T / m)
        entries and its indexer's scores over all T / m, or HCA's T / m'."""
        c, d = cfg.compressed, cfg.head_dim
        total = 0.0
        for layer in range(cfg.n_layers):
            kind = c.kind(layer)
            keys = min(c.window, seq_len)
            if kind == "csa":
                entries = seq_len / c.csa_rate
                keys += min(c.index_topk, entries)
                total += 6.0 * c.index_heads * c.index_head_dim * entries
            elif kind == "hca":
                keys += seq_len / c.hca_rate
            total += 6.0 * cfg.n_heads * 2 * d * keys
        return total / cfg.n_layers


# attention.variant -> its facts; model.ATTENTIONS holds the module of each name
ATTENTION_VARIANTS: dict[str, AttentionVariant] = {"standard": StandardVariant(), "mla": LatentVariant(),
                                                   "dsa": SparseVariant(), "compressed": CompressedVariant()}


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
