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
from typing import Any, Literal

from .moe import MOE_PRESETS, MoEConfig
from .schema import Config, check_positive, check_range, divisors, suggest

Norm = Literal["layernorm", "rmsnorm"]
NormPosition = Literal["pre", "post"]
Positions = Literal["none", "sinusoidal", "learned", "relative", "alibi", "rope"]
FFN = Literal["mlp", "glu"]
Activation = Literal["gelu", "gelu_tanh", "silu", "relu"]
ResidualScaling = Literal["none", "gpt2", "deepnorm"]
EmbedScale = Literal["none", "sqrt_d"]
RopeScaling = Literal["none", "linear", "ntk", "dynamic", "yarn", "llama3"]
RopeLayout = Literal["half", "interleaved"]


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

    def validate(self) -> None:
        check_positive("rope.base", self.base)
        check_positive("rope.factor", self.factor)
        if self.scaling != "none" and self.factor < 1.0:
            raise ValueError(f"rope.factor={self.factor} is not valid for rope.scaling={self.scaling!r}; use factor >= 1")
        if self.original_max_seq_len is not None:
            check_positive("rope.original_max_seq_len", self.original_max_seq_len)
        if self.beta_fast <= self.beta_slow:
            raise ValueError(f"rope.beta_fast={self.beta_fast} must be greater than rope.beta_slow={self.beta_slow}")
        check_positive("rope.low_freq_factor", self.low_freq_factor)
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"rope.high_freq_factor={self.high_freq_factor} must be greater than rope.low_freq_factor={self.low_freq_factor}"
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
    norm_position: NormPosition = "pre"  # pre: x + f(norm(x)); post: norm(x + f(x)) (Vaswani et al. 2017)
    positions: Positions = "rope"
    ffn: FFN = "glu"  # mlp: W2 act(W1 x); glu: W2 (act(Wg x) * W1 x) (Shazeer 2020)
    activation: Activation = "silu"  # glu + silu = SwiGLU
    residual_scaling: ResidualScaling = "none"  # gpt2: out-proj init / sqrt(2L); deepnorm: Wang et al. 2022
    embed_scale: EmbedScale = "none"  # sqrt_d: multiply embeddings by sqrt(d_model) (Vaswani et al. 2017, sec. 3.4)

    # ---- component details
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    relative_clip: int = 16  # Shaw et al. 2018: offsets beyond k share one representation
    moe: MoEConfig | None = None  # None = dense feed-forward in every layer

    # ---- details
    bias: bool = False  # biases in linear layers (GPT-2: true; Llama: false)
    qkv_bias: bool | None = None  # biases on the q/k/v projection; None = as `bias` (Qwen2: true with bias false)
    tie_embeddings: bool = False  # share the token embedding with the output head
    norm_eps: float = 1e-5
    dropout: float = 0.0
    init_std: float = 0.02
    init_seed: int = 0  # weights are a pure function of (config, init_seed)

    def __post_init__(self) -> None:
        super().__post_init__()
        # resolve derived sizes so the saved config is explicit
        for name, value in self._derived_sizes().items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        self._validate_resolved()

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
        return data

    def validate(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "relative_clip"):
            check_positive(name, getattr(self, name))
        for name in ("n_kv_heads", "head_dim", "d_ff"):
            if getattr(self, name) is not None:
                check_positive(name, getattr(self, name))
        check_positive("norm_eps", self.norm_eps)
        check_positive("init_std", self.init_std)
        check_range("dropout", self.dropout, 0.0, 0.999)
        if self.head_dim is None and self.d_model % self.n_heads:
            ok = [d for d in divisors(self.d_model) if d <= 64]
            raise ValueError(
                f"n_heads={self.n_heads} does not divide d_model={self.d_model}; "
                f"choose n_heads in {ok} or set head_dim explicitly"
            )
        kv = self.n_kv_heads if self.n_kv_heads is not None else self.n_heads
        if self.n_heads % kv:
            raise ValueError(
                f"n_kv_heads={kv} does not divide n_heads={self.n_heads}; choose n_kv_heads in {divisors(self.n_heads)}"
            )
        if self.residual_scaling == "deepnorm" and self.norm_position != "post":
            raise ValueError(
                "residual_scaling='deepnorm' needs norm_position='post' (DeepNorm up-scales the residual "
                "before a post-norm); set norm_position='post' or choose residual_scaling in ['none', 'gpt2']"
            )
        if self.positions != "rope" and self.rope.scaling != "none":
            raise ValueError(
                f"rope.scaling={self.rope.scaling!r} only applies to positions='rope', not positions={self.positions!r}"
            )

    def _validate_resolved(self) -> None:
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(
                f"positions='rope' needs an even head_dim, got head_dim={self.head_dim} "
                f"(d_model={self.d_model}, n_heads={self.n_heads}); change n_heads or head_dim"
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
}
# Mixture-of-experts presets live beside the MoE layer (moe.py); they are model presets too.
PRESETS.update(MOE_PRESETS)
