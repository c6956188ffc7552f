"""The model configuration: one field per design axis, validated on construction.

    cfg = ModelConfig.from_preset("llama", d_model=256, n_layers=4)
    cfg = cfg.override({"rope.scaling": "yarn", "rope.factor": 4.0})

A design axis is one field with a few named choices (``norm_position: "pre" | "post"``),
never a pile of booleans. Sub-components with several knobs (rotary scaling, mixture of
experts) have their own small config, nested here.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Literal

from .attention_variants import (
    ATTENTION_VARIANTS,
    CompressedConfig,
    DSAConfig,
    MLAConfig,
    check_sections,
    check_variant_name,
    implied_variant,
    variant_name,
    variant_of,
)
from .schema import (
    Config,
    added,
    check_positive,
    check_range,
    check_size,
    divisor_choices,
    suggest,
)

Norm = Literal["layernorm", "rmsnorm"]
NormGain = Literal["plain", "offset"]
NormPosition = Literal["pre", "post", "sandwich", "reordered"]
QKNorm = Literal["none", "head", "full"]
QKNormPosition = Literal["before_rope", "after_rope"]
AttnGate = Literal["none", "elementwise", "headwise"]
Positions = Literal["none", "sinusoidal", "learned", "relative", "alibi", "rope"]
FFN = Literal["mlp", "glu"]
Activation = Literal["gelu", "gelu_tanh", "silu", "relu", "quick_gelu"]
GLUVariant = Literal["plain", "clamped", "limited"]
ResidualScaling = Literal["none", "gpt2", "deepnorm"]
EmbedScale = Literal["none", "sqrt_d"]
RopeScaling = Literal["none", "linear", "ntk", "dynamic", "yarn", "llama3"]
RopeLayout = Literal["half", "interleaved"]
Scoring = Literal["softmax", "sigmoid", "sqrtsoftplus"]
GroupScore = Literal["max", "top2"]
SecondExpert = Literal["always", "random"]
SharedGate = Literal["none", "sigmoid"]
InitRule = Literal["normal", "xavier"]
LayerKind = Literal["global", "local"]
Sinks = Literal["none", "learned"]
Parametrization = Literal["standard", "mup"]
Residual = Literal["plain", "hyper", "mhc"]


@dataclasses.dataclass(kw_only=True, frozen=True)
class RopeConfig(Config):
    """Rotary positions (Su et al. 2021, https://arxiv.org/abs/2104.09864) and context extension.

    Pair i of each query/key head is rotated by angle p * theta_i, theta_i = base^(-2i/d).
    ``layout`` says which dimensions form a pair: ``half`` pairs (j, j + d/2) as in Hugging Face
    Llama/GPT-NeoX checkpoints; ``interleaved`` pairs (2j, 2j + 1) as in the paper and Meta's
    original Llama code.

    ``scaling`` extends a model trained on ``original_max_seq_len`` positions by ``factor``:
      - ``linear``: position interpolation, p -> p / factor (Chen et al. 2023, arXiv:2306.15595);
      - ``ntk``: NTK-aware base scaling, base -> base * factor^(d/(d-2)) (bloc97, 2023);
      - ``dynamic``: NTK scaling whose factor grows with the current length, as in
        Hugging Face's ``dynamic`` type; identity up to ``original_max_seq_len``;
      - ``yarn``: NTK-by-parts interpolation plus attention temperature
        sqrt(1/t) = 0.1 ln(factor) + 1 (Peng et al. 2023, arXiv:2309.00071, eq. 17-22);
        DeepSeek's ``mscale``/``mscale_all_dim`` variant divides two such temperatures;
      - ``llama3``: Llama 3.1's frequency-band interpolation.
    Each type's math follows ``transformers.modeling_rope_utils`` exactly; tests check it.
    """

    base: float = 10000.0
    layout: RopeLayout = "half"
    scaling: RopeScaling = "none"
    factor: float = 1.0
    original_max_seq_len: int | None = None  # context the model was trained at; None = max_seq_len
    beta_fast: float = 32.0  # YaRN: wavelengths with more rotations than this are not interpolated
    beta_slow: float = 1.0  # YaRN: ... fewer than this are fully interpolated
    attention_factor: float | None = None  # YaRN temperature override; None: 0.1 ln(factor) + 1
    mscale: float | None = None  # YaRN (DeepSeek): with mscale_all_dim, temperature = m(mscale) / m(mscale_all_dim)
    mscale_all_dim: float | None = None  # ... where m(a) = 0.1 a ln(factor) + 1
    truncate: bool = True  # YaRN: round the ramp's ends to whole dimensions (the paper's code; gpt-oss: false)
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    # ---- which dimensions and layers rotate
    # rotate the first int(partial * head_dim) dims of each head (GPT-NeoX rotary_pct, Phi)
    partial: float = added(1.0, since="partial rotary: GPT-NeoX, Phi")
    # n > 0: layers l with (l + 1) % n == 0 have no positions (NoPE; SmolLM3, Llama 4)
    nope_every: int = added(0, since="NoPE layers: SmolLM3")
    # local layers (ModelConfig.attention) rotate with this base, unscaled (Gemma 3); None = as the others
    local_base: float | None = added(None, since="local layers' rotary base: Gemma 3")

    def validate(self) -> None:
        check_positive("rope.base", self.base)
        if not 0.0 < self.partial <= 1.0:
            raise ValueError(f"rope.partial={self.partial} is not valid; it must be in (0, 1] (1 = every dimension)")
        check_size("rope.nope_every", self.nope_every, allow_zero=True)
        if self.local_base is not None:
            check_positive("rope.local_base", self.local_base)
        check_positive("rope.factor", self.factor)
        if self.scaling != "none" and self.factor < 1.0:
            raise ValueError(
                f"rope.factor={self.factor} is not valid for rope.scaling={self.scaling!r}; use factor >= 1"
            )
        if self.original_max_seq_len is not None:
            check_positive("rope.original_max_seq_len", self.original_max_seq_len)
        if self.beta_fast <= self.beta_slow:
            raise ValueError(f"rope.beta_fast={self.beta_fast} must be greater than rope.beta_slow={self.beta_slow}")
        check_positive("rope.low_freq_factor", self.low_freq_factor)
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"rope.high_freq_factor={self.high_freq_factor} "
                f"must be greater than rope.low_freq_factor={self.low_freq_factor}"
            )
        for name in ("attention_factor", "mscale", "mscale_all_dim"):
            value = getattr(self, name)
            if value is not None:
                check_positive(f"rope.{name}", value, allow_zero=name != "attention_factor")
                if self.scaling != "yarn":
                    raise ValueError(
                        f"rope.{name}={value} only applies to rope.scaling='yarn', not {self.scaling!r}; "
                        f"leave rope.{name} unset or use scaling='yarn'"
                    )


# The balance coefficient every MoE trains with unless it chooses otherwise: the presets' alpha 0.01
# (Switch sec. 2.2, DeepSeekMoE sec. 4.1). Without any balancing, experts die within a few steps.
DEFAULT_BALANCE = 0.01


@dataclasses.dataclass(kw_only=True, frozen=True)
class MoEConfig(Config):
    """A mixture-of-experts feed-forward; ``ModelConfig.moe``. Balancing is on by default: DeepSeekMoE's expert
    balance loss with the presets' ``DEFAULT_BALANCE`` (0.01), unless another balancing term is set (then it
    is 0). Training without balancing is explicit: ``expert_balance_coef=0`` and no other term.

    Fine-grained segmentation (DeepSeekMoE sec. 3.1) is one switch: ``granularity=m`` turns N experts
    of width d into m*N experts of width d/m with m*K active, at the same compute and parameters.
    """

    # ---- experts
    n_experts: int = 8  # routed experts, before segmentation
    top_k: int = 2  # routed experts per token, before segmentation
    granularity: int = 1  # m: m*n_experts experts of width d_expert/m, m*top_k of them active
    n_shared: int = 0  # shared experts (width d_expert/m each), fused into one FFN every token goes through
    shared_d_ff: int | None = None  # width of each shared expert; None = the routed width d_expert/m (DeepSeekMoE)
    d_expert: int | None = None  # expert hidden size before segmentation; None = the dense d_ff
    shared_gate: SharedGate = "none"  # sigmoid: shared output scaled by sigmoid(x·g), as in Qwen2-MoE
    # ---- which layers
    every: int = 1  # layer l is MoE if l >= first_dense and (l - first_dense) % every == 0
    first_dense: int = 0  # the first k layers stay dense (DeepSeekMoE 16B, DeepSeek-V3)
    # ---- router
    # sigmoid: independent affinities (DeepSeek-V3 sec. 2.1.2); sqrtsoftplus: sqrt(softplus(logit)) (DeepSeek-V4)
    scoring: Scoring = "softmax"
    normalize_top_k: bool = False  # rescale the K chosen weights to sum to 1 (GShard, Mixtral, V3)
    routed_scale: float = 1.0  # multiply the routed output (DeepSeek-V3's routed_scaling_factor, 2.5)
    n_groups: int = 1  # contiguous expert groups: devices of group-limited routing and the device loss
    topk_groups: int | None = None  # route within the best topk_groups groups (DeepSeek-V2 sec. 2.2.2); None = all
    group_score: GroupScore = "max"  # a group's score: its best expert (V2) or its best two summed (V3)
    second_expert: SecondExpert = "always"  # random: send the 2nd expert with prob. min(1, 2 g2) (GShard)
    capacity_factor: float | None = None  # None = dropless; else each expert takes ceil(cf*T*K/E) assignments
    # ---- balancing, each with its own coefficient (0 = off)
    load_balance_coef: float = 0.0  # Switch eq. 4 / GShard: E * sum_e f_e P_e over first choices
    z_loss_coef: float = 0.0  # ST-MoE eq. 5: mean logsumexp(logits)^2
    # DeepSeekMoE eq. 12-14: over all K choices. None: DEFAULT_BALANCE when no other balancing term is set, else 0
    expert_balance_coef: float | None = None
    device_balance_coef: float = 0.0  # DeepSeekMoE eq. 15-17, with n_groups devices
    bias_update_rate: float = 0.0  # gamma of DeepSeek-V3's loss-free balancing (V3 used 1e-3); 0 = off
    # a learned bias on the router logits, x·centroid + b: it shifts both the choice and the weights (gpt-oss)
    router_bias: bool = added(False, since="gpt-oss")
    # the first k layers route each token to the experts a fixed table names for its id, the centroids only
    # weighing them (DeepSeek-V4's hash MoE, sec. 2.1: its first 3 layers); the table is a buffer, drawn at init,
    # loaded and saved
    hash_layers: int = added(0, since="hash routing: DeepSeek-V4")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.expert_balance_coef is None:  # resolved, so that the saved config is explicit
            object.__setattr__(self, "expert_balance_coef", self._default_balance())

    def _default_balance(self) -> float:
        """What expert_balance_coef resolves to when left as None: on, unless another term balances the experts."""
        others = (self.load_balance_coef, self.device_balance_coef, self.bias_update_rate)
        return 0.0 if any(v > 0 for v in others) else DEFAULT_BALANCE

    def _editable_dict(self) -> dict[str, Any]:
        # a default balance keeps following the other terms: override({"bias_update_rate": 1e-3}) turns it off
        data = super()._editable_dict()
        if data["expert_balance_coef"] == self._default_balance():
            data["expert_balance_coef"] = None
        return data

    @property
    def balancing(self) -> list[str]:
        """The balancing terms that are on, as ``name=value`` (empty: the experts are not balanced)."""
        names = ("load_balance_coef", "expert_balance_coef", "device_balance_coef", "bias_update_rate")
        return [f"{n}={getattr(self, n):g}" for n in names if getattr(self, n) > 0]

    # ---- derived sizes
    @property
    def routed_experts(self) -> int:
        return self.n_experts * self.granularity

    @property
    def active_experts(self) -> int:
        return self.top_k * self.granularity

    def expert_width(self, d_ff: int) -> int:
        return (self.d_expert or d_ff) // self.granularity

    def shared_width(self, d_ff: int) -> int:
        """The width of each shared expert: ``shared_d_ff`` where a checkpoint gives its own (Qwen2-MoE's
        ``shared_expert_intermediate_size``), else the routed experts' width (DeepSeekMoE sec. 3.2)."""
        return self.shared_d_ff or self.expert_width(d_ff)

    @property
    def group_limited(self) -> bool:
        return self.topk_groups is not None and self.topk_groups < self.n_groups

    # ---- validation
    def validate(self) -> None:
        for name in ("n_experts", "top_k", "granularity", "every", "n_groups"):
            check_size(f"moe.{name}", getattr(self, name))
        for name in ("n_shared", "first_dense", "hash_layers"):
            check_size(f"moe.{name}", getattr(self, name), allow_zero=True)
        check_size("moe.n_experts*granularity", self.routed_experts)
        for name in ("load_balance_coef", "z_loss_coef", "expert_balance_coef", "device_balance_coef",
                     "bias_update_rate"):
            if getattr(self, name) is not None:  # expert_balance_coef: None until __post_init__ resolves it
                check_positive(f"moe.{name}", getattr(self, name), allow_zero=True)
        check_positive("moe.routed_scale", self.routed_scale)
        if self.d_expert is not None:
            check_size("moe.d_expert", self.d_expert)
        if self.shared_d_ff is not None:
            check_size("moe.shared_d_ff", self.shared_d_ff)
            if self.n_shared == 0:
                raise ValueError(
                    f"moe.shared_d_ff={self.shared_d_ff} sets the width of shared experts; set moe.n_shared >= 1"
                )
        if self.capacity_factor is not None:
            check_positive("moe.capacity_factor", self.capacity_factor)
        if self.top_k > self.n_experts:
            raise ValueError(
                f"moe.top_k={self.top_k} exceeds moe.n_experts={self.n_experts}; choose top_k in [1, {self.n_experts}]"
            )
        E, K, G = self.routed_experts, self.active_experts, self.n_groups
        if E % G:
            raise ValueError(
                f"moe.n_groups={G} does not divide the {E} routed experts (n_experts*granularity); "
                f"choose n_groups in {divisor_choices(E, G)}"
            )
        if self.topk_groups is not None:
            check_size("moe.topk_groups", self.topk_groups)
            if self.topk_groups > G:
                raise ValueError(
                    f"moe.topk_groups={self.topk_groups} exceeds moe.n_groups={G}; choose topk_groups in [1, {G}]"
                )
            if self.topk_groups * (E // G) < K:
                need = math.ceil(K / (E // G))
                raise ValueError(
                    f"moe.topk_groups={self.topk_groups} leaves {self.topk_groups * (E // G)} experts to choose "
                    f"{K} (top_k*granularity) from; choose topk_groups >= {need}"
                )
            if self.group_limited and self.group_score == "top2" and E // G < 2:
                raise ValueError(
                    f"moe.group_score='top2' needs at least 2 experts per group, but n_groups={G} leaves {E // G}; "
                    "use group_score='max' or fewer groups"
                )
        if self.second_expert == "random" and K != 2:
            raise ValueError(
                f"moe.second_expert='random' is GShard's top-2 rule and needs top_k*granularity=2, got {K}; "
                "set top_k=2 or second_expert='always'"
            )
        if self.device_balance_coef > 0 and G == 1:
            raise ValueError(
                f"moe.device_balance_coef={self.device_balance_coef} needs n_groups > 1 (the devices); "
                f"choose n_groups in {divisor_choices(E, 2, keep=lambda d: d > 1)}"
            )
        if self.shared_gate != "none" and self.n_shared == 0:
            raise ValueError(f"moe.shared_gate={self.shared_gate!r} needs shared experts; set moe.n_shared >= 1")

    def check_against(self, *, n_layers: int, d_ff: int) -> None:
        """Checks that need the model's sizes; ``ModelConfig`` calls this after resolving d_ff."""
        if self.first_dense >= n_layers:
            raise ValueError(
                f"moe.first_dense={self.first_dense} leaves no MoE layer among n_layers={n_layers}; "
                f"choose first_dense < {n_layers}"
            )
        dense = [i for i in range(min(self.hash_layers, n_layers)) if not self.applies_to(i)]
        if self.hash_layers > n_layers or dense:
            raise ValueError(
                f"moe.hash_layers={self.hash_layers} routes the first {self.hash_layers} layers by token id, and "
                + (f"layer {dense[0]} is dense (moe.first_dense, moe.every)" if dense else f"n_layers={n_layers}")
                + f"; choose hash_layers <= {min([n_layers, *dense])}"
            )
        width = self.d_expert or d_ff
        if width % self.granularity:
            name = "moe.d_expert" if self.d_expert else "d_ff (the expert width while moe.d_expert is unset)"
            raise ValueError(
                f"{name}={width} is not divisible by moe.granularity={self.granularity}; "
                f"choose granularity in {divisor_choices(width, self.granularity)} or set moe.d_expert"
            )

    def applies_to(self, layer: int) -> bool:
        return layer >= self.first_dense and (layer - self.first_dense) % self.every == 0

    def hashes(self, layer: int) -> bool:
        """Does MoE layer ``layer`` route by token id (``hash_layers``)?"""
        return layer < self.hash_layers


@dataclasses.dataclass(kw_only=True, frozen=True)
class AttentionConfig(Config):
    """Which keys each layer's queries see, and where the rest of their attention may go; ``ModelConfig.attention``.

    ``pattern`` names each layer's kind, repeated over the layers: a ``global`` layer sees every
    earlier token; a ``local`` layer sees itself and the ``window - 1`` tokens before it (a sliding
    window, Beltagy et al. 2020, arXiv:2004.05150), masked as transformers masks it: query i sees key
    j when i - window < j <= i. ("local",) is Mistral, ("local", "global") gpt-oss, five local and one
    global Gemma 3 (Gemma Team 2025, sec. 2.2). A pattern as long as the model names every layer; one
    longer is cut at n_layers (Gemma 3's 26 layers end within a repeat).

    ``sinks``: ``learned`` adds a learned logit per head to every softmax's denominator, a key that
    takes attention and gives nothing back, so a head may attend to nothing (gpt-oss; Xiao et al.
    2023, arXiv:2309.17453, found models make one of the first token).

    ``variant``: which attention computes the scores, a name of ``attention_variants.ATTENTION_VARIANTS``
    (``standard``, ``mla``, ``dsa``, ``compressed``); unset, the one the model config's sections imply (``mla`` where
    ``mla`` is set, ``dsa`` where ``dsa`` is, ``compressed`` where ``compressed`` is)."""

    # W tokens a local layer's query sees, itself included; None = no local layers
    window: int | None = added(None, since="sliding windows: Mistral, gpt-oss, Gemma 3")
    pattern: tuple[LayerKind, ...] = added(("global",), since="sliding windows")  # repeated over the layers
    sinks: Sinks = added("none", since="attention sinks: gpt-oss")
    # scores are q·k / sqrt(scale_dim); None = head_dim (Vaswani et al. 2017). Gemma 3's query_pre_attn_scalar
    scale_dim: int | None = added(None, since="Gemma 3's query_pre_attn_scalar")
    # a name of ATTENTION_VARIANTS; None (and a name the sections already imply): as ModelConfig's sections say
    variant: str | None = added(None, since="attention variants by name")

    def validate(self) -> None:
        if self.variant is not None:
            check_variant_name(self.variant)
        if self.scale_dim is not None:
            check_size("attention.scale_dim", self.scale_dim)
        if not self.pattern:
            raise ValueError("attention.pattern=[] is empty; give each layer's kind, e.g. ['local', 'global']")
        has_local = "local" in self.pattern
        if self.window is not None:
            check_size("attention.window", self.window)
            if not has_local:
                raise ValueError(
                    f"attention.window={self.window} has no local layer to act on with pattern={list(self.pattern)}; "
                    "put 'local' in attention.pattern or leave window unset"
                )
        elif has_local:
            raise ValueError(
                f"attention.pattern={list(self.pattern)} has local layers but attention.window is unset; "
                "set attention.window (e.g. 4096) or use pattern=['global']"
            )

    def kind(self, layer: int) -> str:
        return self.pattern[layer % len(self.pattern)]


@dataclasses.dataclass(kw_only=True, frozen=True)
class MTPConfig(Config):
    """Multi-token prediction (DeepSeek-V3, arXiv:2412.19437, sec. 2.2); ``ModelConfig.mtp``. ``depth`` sequential
    modules after the main model, module k predicting the token k + 1 places ahead through the shared embedding
    and output head (``mtp.py``). Their cross-entropies, averaged over the depths and times ``loss_weight``, are
    added to the training loss as the auxiliary loss ``mtp``. At inference the modules can draft ``depth`` tokens
    for self-speculative decoding (``generate(..., decoder="speculative")``)."""

    # ``added``: fields of a section that is off (None) by default, so no run hashed before them changes
    depth: int = added(1, since="multi-token prediction: DeepSeek-V3")  # D: DeepSeek-V3 trains with 1
    loss_weight: float = added(0.3, since="multi-token prediction")  # lambda: V3's first 10T tokens, then 0.1

    def validate(self) -> None:
        check_size("mtp.depth", self.depth)
        check_positive("mtp.loss_weight", self.loss_weight, allow_zero=True)


_MUP = "μP: widths compared at one learning rate"


@dataclasses.dataclass(kw_only=True, frozen=True)
class MupConfig(Config):
    """The base shape of the maximal-update parametrization (μP; Yang et al. 2021, "Tensor Programs V",
    arXiv:2203.03466, Table 3 and the ``mup`` package's MuReadout); ``ModelConfig.mup``, set with
    ``parametrization="mup"``. Every width multiplier is the model's size over the base's: a hidden
    matrix's init std and Adam learning rate scale with base fan-in / fan-in (to the 1/2 and the 1st
    power), the logits are multiplied by base_d_model / d_model, and the attention scores use
    sqrt(base_head_dim) / head_dim (1/head_dim, equal to 1/sqrt(head_dim) at the base). A model at its
    base shape computes exactly what ``standard`` computes, so a rate tuned on the base transfers.
    Left unset, each resolves to the config's own size: set them on the proxy model, then override
    ``d_model`` (and ``d_ff``, ``n_heads``, expert widths) to grow it (``lmlab.mup``)."""

    base_d_model: int | None = added(None, since=_MUP)  # the proxy model's d_model
    base_head_dim: int | None = added(None, since=_MUP)  # the proxy model's head_dim

    def validate(self) -> None:
        for name in ("base_d_model", "base_head_dim"):
            if getattr(self, name) is not None:
                check_size(f"mup.{name}", getattr(self, name))


_HC = "hyper-connections: Zhu et al. 2024, DeepSeek-V4's mHC"


@dataclasses.dataclass(kw_only=True, frozen=True)
class StreamsConfig(Config):
    """The n residual streams of ``residual='hyper'`` or ``'mhc'``; ``ModelConfig.residual_streams``, resolved with
    these defaults under either and None under ``plain`` (``residual.py``). ``sinkhorn_iters`` and ``eps`` are mHC's:
    the comb matrix is softmax(logits) + eps, then its columns normalized, then ``sinkhorn_iters - 1`` rounds of rows
    and columns, each normalizer + eps (DeepSeek-V4's ``hc_sinkhorn_iters``, ``hc_eps``); ``eps`` is also added to
    the pre weights."""

    # the expansion rate n: Zhu et al. 2024's main runs use 4 (DHC x4, arXiv:2409.19606); DeepSeek-V4's hc_mult is 4
    n: int = added(4, since=_HC)
    # Sinkhorn-Knopp iterations t_max: the mHC paper (Xie et al. 2025, arXiv:2512.24880) and DeepSeek-V4 use 20
    sinkhorn_iters: int = added(20, since=_HC)
    eps: float = added(1e-6, since=_HC)  # DeepSeek-V4's hc_eps: a floor on the pre weights and the Sinkhorn normalizers

    def validate(self) -> None:
        check_size("residual_streams.n", self.n)
        check_size("residual_streams.sinkhorn_iters", self.sinkhorn_iters)
        check_positive("residual_streams.eps", self.eps, allow_zero=True)


@dataclasses.dataclass(kw_only=True, frozen=True)
class ModelConfig(Config):
    """A decoder-only Transformer language model. Defaults are a small llama-like model."""

    # ---- sizes
    vocab_size: int = 256  # 256 = byte-level tokenizer, which needs no training
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None  # None = n_heads (MHA); 1 = multi-query; between = grouped-query
    head_dim: int | None = None  # None = d_model // n_heads
    d_ff: int | None = None  # None: 4*d_model for mlp, 8/3*d_model rounded up to 64 for glu (same params)
    max_seq_len: int = 256  # training context; size of the learned position table

    # ---- design axes
    norm: Norm = "rmsnorm"
    # how an RMSNorm stores its gain g: plain, g itself (initialized to 1); offset, w with g = 1 + w, initialized
    # to 0 (Gemma), so weight decay pulls the gain towards 1 rather than 0. Every RMSNorm of the blocks, the
    # final norm and the q/k norms
    norm_gain: NormGain = added("plain", since="Gemma's RMSNorm gain")
    # pre: x + f(norm(x)); post: norm(x + f(x)) (Vaswani et al. 2017); sandwich: x + norm(f(norm(x))) (Gemma 2/3);
    # reordered: x + norm(f(x)) (OLMo 2, arXiv:2501.00656 sec. 3.1)
    norm_position: NormPosition = "pre"
    positions: Positions = "rope"
    ffn: FFN = "glu"  # mlp: W2 act(W1 x); glu: W2 (act(Wg x) * W1 x) (Shazeer 2020)
    activation: Activation = "silu"  # glu + silu = SwiGLU; quick_gelu: x sigmoid(1.702 x) (Hendrycks & Gimpel 2016)
    # plain: act(gate) * up; clamped: act(min(gate, 7)) * (clamp(up, -7, 7) + 1), gpt-oss's experts (with quick_gelu)
    glu_variant: GLUVariant = added("plain", since="gpt-oss")
    # limited: act(min(gate, L)) * clamp(up, -L, L), L this (DeepSeek-V4's swiglu_limit, 10: experts and shared expert)
    glu_limit: float = added(10.0, since="DeepSeek-V4's clamped SwiGLU")
    residual_scaling: ResidualScaling = "none"  # gpt2: out-proj init / sqrt(2L); deepnorm: Wang et al. 2022
    embed_scale: EmbedScale = "none"  # sqrt_d: multiply embeddings by sqrt(d_model) (Vaswani et al. 2017, sec. 3.4)
    # RMSNorm on queries and keys before rotary: head = over each head's head_dim, one gain shared by the heads
    # (Qwen3, Gemma 3); full = over all of q (n_heads*head_dim) and of k (n_kv_heads*head_dim) (OLMo 2)
    qk_norm: QKNorm = added("none", since="QK-norm: Qwen3, OLMo 2, Gemma 3")
    # where the per-head q/k norm acts: before rotary (Qwen3, Gemma 3), or on the rotated queries and keys
    # (HunYuan-MoE); the whole-projection norm acts before heads exist, so only qk_norm='head' has a choice
    qk_norm_position: QKNormPosition = added("before_rope", since="q/k norms after rotary: HunYuan-MoE")
    # sigmoid gate on the attention output before its projection, from the block's attention input:
    # one per element or one per head (Qiu et al. 2025, arXiv:2505.06708; Qwen3-Next's is elementwise)
    attn_gate: AttnGate = added("none", since="gated attention: Qiu et al. 2025")

    # ---- component details
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    relative_clip: int = 16  # Shaw et al. 2018: offsets beyond k share one representation
    attention: AttentionConfig = added(since="windows and sinks", factory=AttentionConfig)  # windows per layer, sinks
    moe: MoEConfig | None = None  # None = dense feed-forward in every layer
    # the section of attention.variant 'mla', multi-head latent attention (DeepSeek-V2); set, it implies that variant
    mla: MLAConfig | None = added(None, since="multi-head latent attention: DeepSeek-V2/V3")
    # the indexer of attention.variant 'dsa', DeepSeek sparse attention (V3.2): MLA over the keys it selects; set
    # (with mla), it implies that variant
    dsa: DSAConfig | None = added(None, since="DeepSeek sparse attention: DeepSeek-V3.2")
    # the section of attention.variant 'compressed', DeepSeek-V4's attention (a window, plus CSA or HCA entries per
    # layer); set, it implies that variant
    compressed: CompressedConfig | None = added(None, since="compressed attention: DeepSeek-V4")

    # ---- details
    bias: bool = False  # biases in linear layers (GPT-2: true; Llama: false)
    qkv_bias: bool | None = None  # biases on the q/k/v projection; None = as `bias` (Qwen2: true with bias false)
    tie_embeddings: bool = False  # share the token embedding with the output head
    norm_eps: float = 1e-5
    dropout: float = 0.0
    init_std: float = 0.02
    init: InitRule = "normal"  # normal: N(0, init_std); xavier: Xavier-normal matrices (see model.init_weights)
    init_seed: int = 0  # weights are a pure function of (config, init_seed)
    mtp: MTPConfig | None = added(None, since="multi-token prediction: DeepSeek-V3")  # None = next-token only
    # standard: every width trains with the init and rate it is given; mup: the maximal-update
    # parametrization (``MupConfig``, ``lmlab.mup``), under which a rate tuned at ``mup``'s base shape
    # holds at every width
    parametrization: Parametrization = added("standard", since=_MUP)
    mup: MupConfig | None = added(None, since=_MUP)  # μP's base shape; resolved under mup, None under standard
    # how a sublayer's output joins the residual stream (residual.py): plain, x + f(x); hyper, n streams mixed by
    # learned input-dependent weights (Zhu et al. 2024, arXiv:2409.19606); mhc, n streams mixed by a doubly-stochastic
    # matrix from Sinkhorn-Knopp (manifold-constrained hyper-connections, Xie et al. 2025; DeepSeek-V4)
    residual: Residual = added("plain", since=_HC)
    residual_streams: StreamsConfig | None = added(None, since=_HC)  # n, Sinkhorn iterations; None under plain

    def __post_init__(self) -> None:
        super().__post_init__()
        self._resolve_variant()
        # resolve derived sizes so the saved config is explicit
        for name, value in self._derived_sizes().items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.parametrization == "mup":  # the base shape, explicit in the saved config; it stays when widths change
            base = self.mup or MupConfig()
            object.__setattr__(self, "mup", MupConfig(base_d_model=base.base_d_model or self.d_model,
                                                      base_head_dim=base.base_head_dim or self.head_dim))
        if self.residual != "plain" and self.residual_streams is None:  # explicit in the saved config
            object.__setattr__(self, "residual_streams", StreamsConfig())
        self._validate_resolved()

    def _resolve_variant(self) -> None:
        """A variant named in attention.variant gets its sections, each with its defaults where unset; a name the
        sections already imply is stored unset, as configs written before the field say it: one model, one config."""
        name = self.attention.variant
        if name is None:
            return
        hints = typing.get_type_hints(type(self))
        for section in ATTENTION_VARIANTS[name].sections:
            if getattr(self, section) is None:
                section_class = next(a for a in typing.get_args(hints[section]) if a is not type(None))
                object.__setattr__(self, section, section_class())
        if implied_variant(self) == name:
            object.__setattr__(self, "attention", dataclasses.replace(self.attention, variant=None))

    def _derived_sizes(self) -> dict[str, Any]:
        """What n_kv_heads, head_dim, d_ff and qkv_bias resolve to when left as None."""
        sizes = {
            "qkv_bias": self.bias,
            "n_kv_heads": self.n_heads,
            "d_ff": 4 * self.d_model if self.ffn == "mlp" else 64 * math.ceil(8 * self.d_model / 3 / 64),
        }
        if self.d_model % self.n_heads == 0:
            sizes["head_dim"] = self.d_model // self.n_heads
        return sizes

    def _editable_dict(self) -> dict[str, Any]:
        # A size equal to its derived value keeps following d_model / n_heads / ffn, so that
        # override({"d_model": 512}) rescales head_dim and d_ff instead of keeping stale ones.
        data = super()._editable_dict()
        for name, value in self._derived_sizes().items():
            if data[name] == value:
                data[name] = None
        if data["residual_streams"] == StreamsConfig()._editable_dict():  # resolved again: residual may change
            data["residual_streams"] = None
        return data

    def validate(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "relative_clip"):
            check_size(name, getattr(self, name))
        for name in ("n_kv_heads", "head_dim", "d_ff"):
            if getattr(self, name) is not None:
                check_size(name, getattr(self, name))
        check_positive("norm_eps", self.norm_eps)
        check_positive("init_std", self.init_std)
        check_range("dropout", self.dropout, 0.0, 0.999)
        if self.qk_norm_position != "before_rope" and (self.qk_norm != "head" or self.positions != "rope"):
            raise ValueError(
                f"qk_norm_position={self.qk_norm_position!r} places the per-head query/key norm after rotary; it needs "
                f"qk_norm='head' and positions='rope' (not qk_norm={self.qk_norm!r}, positions={self.positions!r}); "
                "set those or qk_norm_position='before_rope'"
            )
        if self.head_dim is None and self.d_model % self.n_heads:
            ok = divisor_choices(self.d_model, self.n_heads, keep=lambda d: d <= 64)
            raise ValueError(
                f"n_heads={self.n_heads} does not divide d_model={self.d_model}; "
                f"choose n_heads in {ok} or set head_dim explicitly"
            )
        kv = self.n_kv_heads if self.n_kv_heads is not None else self.n_heads
        if self.n_heads % kv:
            raise ValueError(
                f"n_kv_heads={kv} does not divide n_heads={self.n_heads}; "
                f"choose n_kv_heads in {divisor_choices(self.n_heads, kv)}"
            )
        if self.residual_scaling == "deepnorm" and self.norm_position != "post":
            raise ValueError(
                "residual_scaling='deepnorm' needs norm_position='post' (DeepNorm up-scales the residual "
                "before a post-norm); set norm_position='post' or choose residual_scaling in ['none', 'gpt2']"
            )
        if self.init == "xavier" and self.residual_scaling == "gpt2":
            raise ValueError(
                "init='xavier' and residual_scaling='gpt2' are two rules for the same weights; choose "
                "init='normal' for GPT-2's scaled init, or residual_scaling in ['none', 'deepnorm']"
            )
        if self.glu_variant != "plain" and self.ffn != "glu":
            raise ValueError(f"glu_variant={self.glu_variant!r} is a form of the gated feed-forward; set ffn='glu'")
        check_positive("glu_limit", self.glu_limit)
        if self.glu_limit != 10.0 and self.glu_variant != "limited":
            raise ValueError(f"glu_limit={self.glu_limit} is the clamp of glu_variant='limited', not "
                             f"{self.glu_variant!r}; set glu_variant='limited' or leave glu_limit at 10")
        if self.norm_gain != "plain" and self.norm != "rmsnorm":
            raise ValueError(
                f"norm_gain={self.norm_gain!r} is a parametrization of RMSNorm's gain; set norm='rmsnorm' or "
                "norm_gain='plain'"
            )
        self._validate_parametrization()
        self._validate_residual()
        if self.mtp is not None and self.mtp.depth >= self.max_seq_len:  # arithmetic: 1000 blocks are never built
            raise ValueError(
                f"mtp.depth={self.mtp.depth} is not valid with max_seq_len={self.max_seq_len}: module k predicts the "
                f"token k + 1 places ahead, so a depth of the sequence length or more leaves modules no target; "
                f"choose mtp.depth at most {self.max_seq_len - 1}"
            )
        if self.positions != "rope" and self.rope.scaling != "none":
            raise ValueError(
                f"rope.scaling={self.rope.scaling!r} only applies to positions='rope', not positions={self.positions!r}"
            )
        self._validate_layer_patterns()

    def _validate_layer_patterns(self) -> None:
        rope, attention = self.rope, self.attention
        for name, value, off in (("partial", rope.partial, 1.0), ("nope_every", rope.nope_every, 0),
                                 ("local_base", rope.local_base, None)):
            if value != off and self.positions != "rope":
                raise ValueError(f"rope.{name}={value} only applies to positions='rope', not {self.positions!r}")
        if rope.local_base is not None and "local" not in attention.pattern:
            raise ValueError(
                f"rope.local_base={rope.local_base} is the base of local layers, and attention.pattern has none; "
                "put 'local' in attention.pattern or leave rope.local_base unset"
            )
        if attention.sinks != "none" and self.positions == "relative":
            raise ValueError(
                f"attention.sinks={attention.sinks!r} is not implemented with positions='relative'; "
                "choose another position scheme or sinks='none'"
            )

    def _validate_residual(self) -> None:
        streams = self.residual_streams
        if self.residual == "plain":
            if streams is not None:
                raise ValueError("residual_streams sets the streams of residual='hyper' or 'mhc'; set residual to one "
                                 "of them or residual_streams=null")
            return
        if self.norm_position == "post":  # DeepNorm needs post-norm, so it is refused here too
            raise ValueError(
                f"residual={self.residual!r} is not defined with norm_position='post': hyper-connections replace the "
                "normalized sum (Zhu et al. 2024 write post-norm as a one-stream hyper-connection), and no paper "
                "normalizes their n streams after the mix; choose norm_position in ['pre', 'sandwich', 'reordered'] or "
                "residual='plain'"
            )
        if streams is not None and self.residual == "hyper":
            for name in ("sinkhorn_iters", "eps"):
                if getattr(streams, name) != getattr(StreamsConfig(), name):
                    raise ValueError(f"residual_streams.{name}={getattr(streams, name)} only applies to "
                                     "residual='mhc', not 'hyper'; leave it at its default or use residual='mhc'")

    def _validate_parametrization(self) -> None:
        if self.parametrization == "standard":
            if self.mup is not None:
                raise ValueError("mup sets the base shape of parametrization='mup'; set parametrization='mup' "
                                 "or mup=null")
            return
        clashes = (("init", self.init, self.init == "normal"),
                   ("residual_scaling", self.residual_scaling, self.residual_scaling != "deepnorm"),
                   ("attention.variant", self.attention_variant, variant_of(self).supports_mup),
                   ("attention.scale_dim", self.attention.scale_dim, self.attention.scale_dim is None))
        for name, value, ok in clashes:
            if not ok:
                raise ValueError(
                    f"parametrization='mup' with {name}={value!r} is not implemented: μP draws every matrix from "
                    "N(0, init_std) scaled by its fan-in, scales scores by 1/head_dim and knows standard attention's "
                    f"shapes only; use parametrization='standard' or leave {name} at its default"
                )

    def _validate_resolved(self) -> None:
        check_sections(self)
        variant_of(self).check(self)
        if self.positions == "rope" and (self.rotary_dim % 2 or self.rotary_dim == 0):
            raise ValueError(
                f"rope.partial={self.rope.partial} rotates {self.rotary_dim} of head_dim={self.head_dim} dimensions, "
                "which must be even and at least 2; choose a partial that gives an even count"
            )
        if self.moe is not None:
            self.moe.check_against(n_layers=self.n_layers, d_ff=self.d_ff)

    # ---- presets
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        """A documented starting point, with any field overridden (dotted keys via ``override``)."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}{suggest(name, PRESETS)}; choose one of {sorted(PRESETS)}")
        base = PRESETS[name]
        nested = {k: v for k, v in overrides.items() if "." in k}
        flat = {k: v for k, v in overrides.items() if "." not in k}
        data = {**base, **flat}
        unknown = [k for k in data if k not in cls.field_names()]
        if unknown:
            raise ValueError(f"unknown ModelConfig key {unknown[0]!r}{suggest(unknown[0], cls.field_names())}")
        cfg = cls.from_dict(data)
        return cfg.override(nested) if nested else cfg

    # ---- convenience
    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.applies_to(layer)

    @property
    def attention_variant(self) -> str:
        """The attention variant's name: ``attention.variant``, or the one the sections imply (``mla`` where
        ``mla`` is set, else ``standard``). Its facts: ``attention_variants.variant_of(cfg)``."""
        return variant_name(self)

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each query and key head that rotary turns: int(rope.partial * width), as
        transformers, of the width the variant rotates (head_dim; MLA's decoupled ``qk_rope_head_dim``)."""
        return int(variant_of(self).rotary_width(self) * self.rope.partial)

    @property
    def attention_widths(self) -> tuple[int, int]:
        """(query/key width, value width) of each head, as the variant says."""
        return variant_of(self).widths(self)

    @property
    def cache_widths(self) -> tuple[int, int, int]:
        """(heads, key width, value width) the decode cache holds per token and layer, as the variant says."""
        return variant_of(self).cache_widths(self)

    @property
    def attention_scale(self) -> float:
        """The factor of every attention score q·k: 1 / sqrt(attention.scale_dim or head_dim); under μP
        sqrt(base_head_dim) / head_dim, which falls as 1/head_dim (Tensor Programs V, sec. 4)."""
        if self.parametrization == "mup":
            return self.mup.base_head_dim**0.5 / self.head_dim
        return (self.attention.scale_dim or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """The window of layer ``layer``'s attention: ``attention.window`` for a local layer, None for a global one."""
        return self.attention.window if self.attention.kind(layer) == "local" else None

    @property
    def n_streams(self) -> int:
        """The residual stream's width in vectors of d_model: 1 under ``plain``, ``residual_streams.n`` otherwise."""
        return 1 if self.residual_streams is None else self.residual_streams.n

    def has_positions(self, layer: int) -> bool:
        """False for the NoPE layers of ``rope.nope_every``."""
        n = self.rope.nope_every
        return not (n and (layer + 1) % n == 0)


# Named starting points. Sizes are laptop-small; every field can be overridden.
PRESETS: dict[str, dict[str, Any]] = {
    # Vaswani et al. 2017 as a decoder-only LM: post-norm LayerNorm, fixed sinusoids,
    # a two-layer GELU feed-forward (the paper used ReLU; the design document specifies GELU).
    "vaswani2017": dict(
        norm="layernorm", norm_position="post", positions="sinusoidal", ffn="mlp", activation="gelu",
        bias=True, tie_embeddings=True, embed_scale="sqrt_d",
    ),
    # Radford et al. 2019: pre-norm LayerNorm, learned absolute positions, tanh-GELU, scaled init.
    "gpt2": dict(
        norm="layernorm", norm_position="pre", positions="learned", ffn="mlp", activation="gelu_tanh",
        bias=True, tie_embeddings=True, residual_scaling="gpt2",
    ),
    # Touvron et al. 2023: pre-norm RMSNorm, rotary, SwiGLU, grouped-query attention.
    "llama": dict(
        norm="rmsnorm", norm_position="pre", positions="rope", ffn="glu", activation="silu",
        n_heads=8, n_kv_heads=2, bias=False, tie_embeddings=False,
    ),
    # Qwen3 (Yang et al. 2025, arXiv:2505.09388): Llama's block with an RMSNorm on each query and key
    # head before rotary, no q/k/v biases, rotary base 1e6, tied embeddings as in the small Qwen3 models.
    "qwen3": dict(
        norm="rmsnorm", norm_position="pre", positions="rope", ffn="glu", activation="silu",
        n_heads=8, n_kv_heads=2, qk_norm="head", bias=False, tie_embeddings=True, norm_eps=1e-6,
        rope=dict(base=1e6),
    ),
    # OLMo 2 (OLMo et al. 2024, arXiv:2501.00656, sec. 3.1): reordered norms, x + norm(f(x)), and an
    # RMSNorm over the whole q and k projections, for training stability; multi-head attention,
    # rotary base 5e5, RMSNorm eps 1e-6.
    "olmo2": dict(
        norm="rmsnorm", norm_position="reordered", positions="rope", ffn="glu", activation="silu",
        n_heads=8, qk_norm="full", bias=False, tie_embeddings=False, norm_eps=1e-6, rope=dict(base=5e5),
    ),
    # Gemma 3 (Gemma Team 2025, arXiv:2503.19786, sec. 2.2), text only, laptop-small: five local layers of a
    # sliding window (1024 there, 64 here for a 256-token context) to one global layer, local layers rotating
    # with base 10k and global ones with 1e6; QK-norm per head and sandwich norms (Gemma 2's pre and post norms),
    # GeGLU, embeddings scaled by sqrt(d_model) and tied. Six layers, so that one of them is global. (Gemma's
    # RMSNorm stores its gain as 1 + w: another parametrization of the same function.)
    "gemma3": dict(
        d_model=256, n_layers=6, n_heads=4, n_kv_heads=1, head_dim=64,
        norm="rmsnorm", norm_position="sandwich", positions="rope", ffn="glu", activation="gelu_tanh",
        qk_norm="head", embed_scale="sqrt_d", bias=False, tie_embeddings=True, norm_eps=1e-6,
        rope=dict(base=1e6, local_base=1e4),
        attention=dict(window=64, pattern=["local"] * 5 + ["global"]),
    ),
}

# Model presets with a mixture-of-experts feed-forward: name -> ModelConfig fields (``moe`` as a dict).
# Laptop-small bodies (d_model 256, 4 layers, llama-style) so the MoE choices are the only difference.
_BODY = dict(d_model=256, n_layers=4, n_heads=8, norm="rmsnorm", norm_position="pre", positions="rope", bias=False)
MOE_PRESETS: dict[str, dict[str, Any]] = {
    # Switch Transformer (Fedus et al. 2022): top-1, ReLU experts in every other layer, capacity
    # factor 1.25 and load-balancing loss alpha = 0.01 (sec. 2.2).
    "switch": dict(
        _BODY, ffn="mlp", activation="relu",
        moe=dict(n_experts=8, top_k=1, every=2, capacity_factor=1.25, load_balance_coef=0.01),
    ),
    # GShard (Lepikhin et al. 2021, Algorithm 1): top-2 with normalized gates, the second expert sent
    # with probability min(1, 2 g2), capacity 2T/E (factor 1 of T*K/E), every other layer.
    "gshard": dict(
        _BODY, ffn="mlp", activation="relu",
        moe=dict(
            n_experts=8, top_k=2, every=2, normalize_top_k=True, second_expert="random",
            capacity_factor=1.0, load_balance_coef=0.01,
        ),
    ),
    # Mixtral (Jiang et al. 2024): 8 SwiGLU experts, top-2, softmax then renormalized over the two,
    # dropless. Mistral did not publish its balance coefficient; 0.01 is Switch's.
    "mixtral": dict(
        _BODY, n_kv_heads=2, ffn="glu", activation="silu",
        moe=dict(n_experts=8, top_k=2, normalize_top_k=True, expert_balance_coef=0.01),
    ),
    # DeepSeekMoE's validation setup (Dai et al. 2024, sec. 4.1): 1 shared + 63 routed experts, 7 routed
    # active, each a quarter of the dense FFN (d_expert = 704/4 for d_model 256), alpha1 = 0.01.
    "deepseekmoe": dict(
        _BODY, ffn="glu", activation="silu",
        moe=dict(n_experts=63, top_k=7, n_shared=1, d_expert=176, expert_balance_coef=0.01),
    ),
    # DeepSeek-V3 (sec. 2.1.2) scaled down: sigmoid affinities normalized over the chosen experts and
    # scaled by 2.5, 8 groups of which 4 are searched (group score = best two), loss-free balancing
    # with gamma = 1e-3 plus a tiny balance loss (V3 uses alpha = 1e-4 per sequence; here per batch),
    # one shared expert, the first layer dense. Multi-head latent attention (sec. 2.1.1) at V3's
    # proportions to a head of d_h = 32: latent d_c = 4 d_h = 128, decoupled rotary d_h / 2 = 16,
    # queries through a rank-128 latent (V3's 1536 = 12 d_h would exceed d_model here).
    "deepseek-v3": dict(
        _BODY, ffn="glu", activation="silu",
        mla=dict(q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32),
        moe=dict(
            n_experts=32, top_k=4, n_shared=1, d_expert=128, first_dense=1,
            scoring="sigmoid", normalize_top_k=True, routed_scale=2.5,
            n_groups=8, topk_groups=4, group_score="top2",
            bias_update_rate=1e-3, expert_balance_coef=1e-4,
        ),
    ),
    # gpt-oss (OpenAI 2025, model card sec. 2) scaled down: layers alternate a sliding window (128 tokens
    # there, 64 here) and full attention, every head has a learned attention sink, biases on the attention
    # and expert projections and on the router's logits, rotary base 150k, grouped-query attention; softmax
    # over the top-k experts' logits (= softmax, then renormalized over the k); experts computing the clamped
    # gated unit (clamp(up, -7, 7) + 1) * g sigmoid(1.702 g), g = min(gate, 7). gpt-oss-20b routes 4 of 32;
    # here 2 of 8. Its YaRN extension (32x from 4k) has no use at a 256-token context and is left out.
    "gpt-oss": dict(
        _BODY, n_kv_heads=2, ffn="glu", activation="quick_gelu", glu_variant="clamped", bias=True,
        rope=dict(base=150000.0), attention=dict(window=64, pattern=["local", "global"], sinks="learned"),
        moe=dict(n_experts=8, top_k=2, normalize_top_k=True, router_bias=True),
    ),
}
PRESETS.update(MOE_PRESETS)
# DeepSeek-V4 (DeepSeek-AI 2026) scaled down, every part of its block: compressed attention with one key/value head
# whose keys are its values, queries through a rank-128 latent, interleaved rotary on the trailing 16 of each head's
# 64 dimensions (V4: 64 of 512), a learned sink per head, the 8 heads' outputs projected in 2 groups of rank 128; a
# window of 64 raw keys in every layer, and V4's schedule (two HCA layers, then CSA and HCA alternating: here
# HCA, HCA, HCA, CSA) with an entry every 4 tokens in CSA (an indexer of 4 heads of 32 keeps 16; V4: 64 of 128 keep
# 512) and every 32 in HCA (V4: 128; 8 entries in a 256-token context); compressed layers rotate with base 160k
# (V4 adds YaRN x16, of no use at 256 tokens). Its MoE at the deepseek-v3 preset's size: 32 experts of width 128, 4
# active, one shared; the first layer routed by a token-id table (V4: 3 of 43), the rest by sqrt(softplus) scores
# with loss-free balancing, normalized and scaled by 1.5; SwiGLU clamped at 10. Manifold-constrained
# hyper-connections, 4 streams and 20 Sinkhorn iterations, as V4. Every layer is a mixture: d_ff is the experts' width.
PRESETS["deepseek-v4"] = dict(
    _BODY, n_kv_heads=1, head_dim=64, d_ff=128, ffn="glu", activation="silu", glu_variant="limited", norm_eps=1e-6,
    rope=dict(layout="interleaved"), attention=dict(sinks="learned"),
    compressed=dict(q_lora_rank=128, rope_head_dim=16, window=64, layers=["hca", "hca", "hca", "csa"], csa_rate=4,
                    hca_rate=32, index_heads=4, index_head_dim=32, index_topk=16, o_groups=2, o_lora_rank=128),
    moe=dict(n_experts=32, top_k=4, n_shared=1, scoring="sqrtsoftplus", normalize_top_k=True, routed_scale=1.5,
             hash_layers=1, bias_update_rate=1e-3, expert_balance_coef=1e-4),
    residual="mhc",
)
