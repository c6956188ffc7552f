"""Dense Hugging Face families: Llama, Mistral, Qwen2, Seed-OSS and GPT-2, in both directions, plus the
Llama layout that the mixture-of-experts families of ``moe.py`` build on (:func:`llama_layout_config`,
:func:`llama_weights` with a pluggable per-layer feed-forward part, and their inverses
:func:`llama_layout_to_hf`, :func:`llama_weights_to_hf`, :func:`llama_layout_refusal`), the q/k norm
tensors of the families that have them (:func:`qk_norm_weights`, :func:`qk_norm_to_hf`), and
conversions between the two rotary layouts of q/k projection rows."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from ..config import AttentionConfig, ModelConfig
from .registry import (
    ACTIVATION_NAMES,
    ANY,
    ROTARY,
    Export,
    Family,
    HFTensors,
    Tensors,
    activation_from_hf,
    attention_from_hf,
    key_refused,
    layer_types_to_hf,
    model_config,
    refusal,
    register,
    rope_from_hf,
    rope_refusal,
    rope_to_hf,
    tied_head,
    with_defaults,
)

# ============================================================== Llama (and Mistral)
# transformers' LlamaConfig / MistralConfig defaults, for keys an older config.json leaves out.
LLAMA_DEFAULTS: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=None, head_dim=None, hidden_act="silu", max_position_embeddings=2048,
    initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
)
MISTRAL_DEFAULTS: dict[str, Any] = dict(
    LLAMA_DEFAULTS, intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=4096 * 32,
    sliding_window=4096,
)


def llama_config(hf: Mapping[str, Any], defaults: Mapping[str, Any] = LLAMA_DEFAULTS) -> ModelConfig:
    """Llama: pre-norm RMSNorm, rotary (half layout), SwiGLU, grouped-query attention."""
    hf = with_defaults(hf, defaults)
    attention_bias, mlp_bias = bool(hf["attention_bias"]), bool(hf["mlp_bias"])
    if attention_bias != mlp_bias:
        raise ValueError(
            f"config.json has attention_bias={attention_bias} and mlp_bias={mlp_bias}; lmlab has one `bias` "
            "switch for all linear layers, so it loads Llama checkpoints only when the two are equal"
        )
    return llama_layout_config(hf, bias=attention_bias)


def llama_layout_config(hf: Mapping[str, Any], *, default_theta: float = 10000.0, partial: bool = False,
                        **fields: Any) -> ModelConfig:
    """The fields every Llama-layout family (Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE) maps the
    same way: sizes, pre-norm RMSNorm, rotary (``partial``: see :func:`rope_from_hf`), SwiGLU. ``fields`` add
    or override (bias, moe, ...)."""
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or (hf["hidden_size"] // heads if isinstance(heads, int) and heads > 0 else None)
    return model_config(hf, **{
        **dict(
            vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
            n_heads=heads, n_kv_heads=hf["num_key_value_heads"] or heads,
            head_dim=head_dim, d_ff=hf["intermediate_size"],
            max_seq_len=hf["max_position_embeddings"],
            norm="rmsnorm", norm_position="pre", positions="rope", ffn="glu",
            activation=activation_from_hf(hf["hidden_act"], "hidden_act"),
            rope=rope_from_hf(hf, default_theta=default_theta, partial=partial), bias=False,
            tie_embeddings=bool(hf["tie_word_embeddings"]),
            norm_eps=hf["rms_norm_eps"], init_std=hf["initializer_range"],
        ),
        **fields,
    })


def every_layer_window(window: int | None) -> AttentionConfig:
    """A sliding window of ``window`` tokens in every layer (None: full attention), as Mistral, Mixtral
    and Qwen3-MoE apply config.json's ``sliding_window``."""
    return AttentionConfig() if window is None else AttentionConfig(window=window, pattern=("local",))


def every_layer_window_refusal(cfg: ModelConfig, name: str) -> str | None:
    """The inverse's limit: ``name`` slides every layer or none."""
    if len(set(cfg.attention.pattern)) > 1:
        return f"attention.pattern={list(cfg.attention.pattern)} ({name}'s sliding window applies to every layer)"
    return None


def qwen_attention(hf: Mapping[str, Any]) -> AttentionConfig:
    """Qwen2's and Qwen3's windows: with ``use_sliding_window``, the layers ``layer_types`` names, or (without
    it) those from ``max_window_layers`` on, as Qwen2Config and Qwen3Config derive them; else none."""
    n, window = hf["num_hidden_layers"], hf["sliding_window"] if hf["use_sliding_window"] else None
    types = hf["layer_types"]
    if types is None:
        first = hf["max_window_layers"]
        types = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(n)]
    return attention_from_hf(types, window, n)


def qwen_attention_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The inverse of :func:`qwen_attention`: every layer's type written out."""
    window = cfg.attention.window
    return {"use_sliding_window": window is not None, "sliding_window": window, "layer_types": layer_types_to_hf(cfg)}


def mistral_config(hf: Mapping[str, Any]) -> ModelConfig:
    """Mistral is Llama without biases, with a sliding window of ``sliding_window`` tokens in every
    layer (null: full attention)."""
    window = with_defaults(hf, MISTRAL_DEFAULTS)["sliding_window"]
    cfg = llama_config({**hf, "attention_bias": False, "mlp_bias": False}, MISTRAL_DEFAULTS)
    return cfg.replace(attention=every_layer_window(window))


def llama_attention(cfg: ModelConfig, t: HFTensors, hf: str, ours: str) -> dict[str, torch.Tensor | None]:
    """q/k/v/o projections under HF prefix ``hf`` ("model.layers.3.self_attn.") -> lmlab ``ours``
    ("blocks.3.attn."). HF Llama checkpoints already use the half rotary layout."""
    sd = {}
    for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
        sd[f"{ours}qkv.{kind}"] = t.cat([f"{hf}{p}_proj.{kind}" for p in "qkv"])
    for kind in ("weight", "bias") if cfg.bias else ("weight",):
        sd[f"{ours}out.{kind}"] = t.take(f"{hf}o_proj.{kind}")
    return sd


def llama_glu(cfg: ModelConfig, t: HFTensors, hf: str, ours: str) -> dict[str, torch.Tensor | None]:
    """gate/up/down under ``hf`` ("model.layers.3.mlp.") -> lmlab's fused [gate; up] under ``ours``."""
    sd = {}
    for kind in ("weight", "bias") if cfg.bias else ("weight",):
        sd[f"{ours}gate_up.{kind}"] = t.cat([f"{hf}gate_proj.{kind}", f"{hf}up_proj.{kind}"])
        sd[f"{ours}down.{kind}"] = t.take(f"{hf}down_proj.{kind}")
    return sd


FFNWeights = Callable[[ModelConfig, HFTensors, str, str], dict]


# each layer's norms: HF name -> lmlab name (Llama: pre-norm, an input norm before each sublayer)
LLAMA_NORMS = {"input_layernorm": "norm1", "post_attention_layernorm": "norm2"}


def llama_weights(cfg: ModelConfig, t: HFTensors, ffn: FFNWeights = llama_glu,
                  norms: Mapping[str, str] = LLAMA_NORMS) -> dict[str, torch.Tensor | None]:
    """Llama-layout checkpoints; ``ffn`` maps each layer's "mlp." part (mixture-of-experts
    families pass their own), ``norms`` each layer's norms (families that place them elsewhere pass theirs)."""
    sd = {"embed.weight": t.take("model.embed_tokens.weight")}
    for i in range(cfg.n_layers):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        sd.update({f"{ours}{mine}.weight": t.take(f"{hf}{theirs}.weight") for theirs, mine in norms.items()})
        sd.update(llama_attention(cfg, t, f"{hf}self_attn.", f"{ours}attn."))
        sd.update(ffn(cfg, t, f"{hf}mlp.", f"{ours}ffn."))
    sd["final_norm.weight"] = t.take("model.norm.weight")
    sd["head.weight"] = tied_head(cfg, t, "lm_head.weight", sd["embed.weight"])
    return sd


LLAMA_IGNORE = (r"\.rotary_emb\.inv_freq$",)  # a buffer that checkpoints before transformers 4.31 saved


# ---- query/key norm tensors (qk_norm), for every family that has them
def qk_norm_weights(cfg: ModelConfig, t: HFTensors, attn: str = "self_attn.") -> dict[str, torch.Tensor | None]:
    """Each layer's ``{attn}q_norm.weight`` and ``k_norm.weight`` -> ``blocks.{i}.attn.qk_norm.*``."""
    sd = {}
    for i in range(cfg.n_layers):
        for part in ("q_norm", "k_norm"):
            sd[f"blocks.{i}.attn.qk_norm.{part}.weight"] = t.take(f"model.layers.{i}.{attn}{part}.weight")
    return sd


def qk_norm_to_hf(cfg: ModelConfig, sd: Tensors, attn: str = "self_attn.") -> dict[str, torch.Tensor]:
    """The inverse of :func:`qk_norm_weights`. With interleaved rotary pairs the gains are permuted as the q/k
    rows are (``interleaved_to_half``): one head's worth for ``head``, every head for ``full``."""
    heads = {"q_norm": cfg.n_heads, "k_norm": cfg.n_kv_heads} if cfg.qk_norm == "full" else {"q_norm": 1, "k_norm": 1}
    out = {}
    for i in range(cfg.n_layers):
        for part, n in heads.items():
            w = sd[f"blocks.{i}.attn.qk_norm.{part}.weight"]
            out[f"model.layers.{i}.{attn}{part}.weight"] = rows_to_half(cfg, w, n)
    return out


# ---- the other direction: lmlab -> the Llama layout
# what every Llama-layout architecture computes (its Export.computes add their own): the rotary of any layout and
# scaling, and every activation config.json names
LLAMA_LAYOUT: Mapping[str, Any] = {**ROTARY, "activation": tuple(ACTIVATION_NAMES)}
WINDOWS: Mapping[str, Any] = {"attention.pattern": ("global", "local")}  # sliding-window layers, from layer_types


def llama_layout_refusal(cfg: ModelConfig, name: str, *, norm_position: str = "pre",
                         qk_norm: str = "none") -> str | None:
    """What a Llama-layout architecture ``name`` cannot compute: its norm placement (pre-norm unless
    given), its query/key norm (none unless given), RMSNorm, rotary, gated feed-forward. (Values of
    other fields it does not compute are refused by its ``Export.computes``.)"""
    placements = {"pre": "normalizes each sublayer's input", "reordered": "normalizes each sublayer's output"}
    qk_norms = {"none": "has no query/key norm", "head": "normalizes queries and keys per head",
                "full": "normalizes the whole query and key projections"}
    return refusal(cfg, {
        "norm_position": (norm_position, f"{name} {placements.get(norm_position, norm_position)}"),
        "qk_norm": (qk_norm, f"{name} {qk_norms[qk_norm]}"),
        "norm": ("rmsnorm", f"{name} normalizes with RMSNorm"),
        "positions": ("rope", f"{name} uses rotary positions"),
        "ffn": ("glu", f"{name}'s feed-forward is gated, W2 (act(Wg x) * W1 x)"),
    }) or rope_refusal(cfg)


def llama_layout_to_hf(cfg: ModelConfig, **extra_rope: Any) -> dict[str, Any]:
    """config.json keys every Llama-layout family writes the same way (inverse of
    :func:`llama_layout_config`). head_dim is left out where it is d_model / n_heads (Qwen2 reads
    a null head_dim as a size). Dropout only acts in training and these architectures have no
    residual dropout, so none is written."""
    keys = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        hidden_act=ACTIVATION_NAMES[cfg.activation], max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings,
        attention_dropout=0.0, **rope_to_hf(cfg, **extra_rope),
    )
    if cfg.head_dim * cfg.n_heads != cfg.d_model:
        keys["head_dim"] = cfg.head_dim
    return keys


def llama_attention_to_hf(cfg: ModelConfig, sd: Tensors, ours: str, hf: str) -> dict[str, torch.Tensor]:
    """lmlab's fused [q; k; v] under ``ours`` ("blocks.3.attn.") -> q/k/v/o under ``hf``, with q and k
    rows in the half rotary layout that transformers rotates."""
    H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    out = {}
    for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
        q, k, v = sd[f"{ours}qkv.{kind}"].split([H * hd, KV * hd, KV * hd])
        out.update({f"{hf}q_proj.{kind}": rows_to_half(cfg, q, H), f"{hf}k_proj.{kind}": rows_to_half(cfg, k, KV),
                    f"{hf}v_proj.{kind}": v})
    for kind in ("weight", "bias") if cfg.bias else ("weight",):
        out[f"{hf}o_proj.{kind}"] = sd[f"{ours}out.{kind}"]
    return out


def llama_glu_to_hf(cfg: ModelConfig, sd: Tensors, ours: str, hf: str) -> dict[str, torch.Tensor]:
    """lmlab's fused [gate; up] under ``ours`` ("blocks.3.ffn.") -> gate/up/down under ``hf``."""
    out = {}
    for kind in ("weight", "bias") if cfg.bias else ("weight",):
        gate, up = sd[f"{ours}gate_up.{kind}"].chunk(2)
        out.update(
            {
                f"{hf}gate_proj.{kind}": gate,
                f"{hf}up_proj.{kind}": up,
                f"{hf}down_proj.{kind}": sd[f"{ours}down.{kind}"],
            }
        )
    return out


FFNToHF = Callable[[ModelConfig, Tensors, str, str], dict]


def llama_weights_to_hf(cfg: ModelConfig, sd: Tensors, ffn: FFNToHF = llama_glu_to_hf,
                        norms: Mapping[str, str] = LLAMA_NORMS) -> dict[str, torch.Tensor]:
    """The inverse of :func:`llama_weights`: HF names as ``save_pretrained`` writes them; a tied
    head is left out, as transformers leaves it out."""
    out = {"model.embed_tokens.weight": sd["embed.weight"]}
    for i in range(cfg.n_layers):
        ours, hf = f"blocks.{i}.", f"model.layers.{i}."
        out.update({f"{hf}{theirs}.weight": sd[f"{ours}{mine}.weight"] for theirs, mine in norms.items()})
        out.update(llama_attention_to_hf(cfg, sd, f"{ours}attn.", f"{hf}self_attn."))
        out.update(ffn(cfg, sd, f"{ours}ffn.", f"{hf}mlp."))
    out["model.norm.weight"] = sd["final_norm.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["head.weight"]
    return out


def llama_refusal(cfg: ModelConfig) -> str | None:
    if cfg.bias != cfg.qkv_bias:
        return (
            f"qkv_bias={cfg.qkv_bias} with bias={cfg.bias} (Llama's attention_bias puts biases on q, k, v and the "
            "output together, and mlp_bias on the feed-forward)"
        )
    return llama_layout_refusal(cfg, "Llama")


def llama_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {**llama_layout_to_hf(cfg), "attention_bias": cfg.bias, "mlp_bias": cfg.bias}


def mistral_refusal(cfg: ModelConfig) -> str | None:
    return every_layer_window_refusal(cfg, "Mistral") or refusal(cfg, {
        "bias": (False, "Mistral has no biases"), "qkv_bias": (False, "Mistral has no biases"),
    }) or llama_layout_refusal(cfg, "Mistral")


def mistral_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {**llama_layout_to_hf(cfg), "sliding_window": cfg.attention.window}


register("llama", Family(llama_config, llama_weights, LLAMA_IGNORE, Export(
    "LlamaForCausalLM", moe=False, refuse=llama_refusal, config=llama_to_hf, weights=llama_weights_to_hf,
    name="Llama", computes={**LLAMA_LAYOUT, "bias": (False, True)},
)))
register("mistral", Family(mistral_config, llama_weights, LLAMA_IGNORE, Export(
    "MistralForCausalLM", moe=False, refuse=mistral_refusal, config=mistral_to_hf, weights=llama_weights_to_hf,
    name="Mistral", computes={**LLAMA_LAYOUT, **WINDOWS},
)))

# transformers' Qwen2Config defaults (5.x), for keys an older config.json leaves out.
QWEN2_DEFAULTS: dict[str, Any] = dict(
    LLAMA_DEFAULTS, vocab_size=151936, hidden_size=4096, intermediate_size=22016, max_position_embeddings=32768,
    use_sliding_window=False, sliding_window=4096, max_window_layers=28, layer_types=None,
)


def qwen2_config(hf: Mapping[str, Any]) -> ModelConfig:
    """Qwen2 is Llama with biases on the q, k and v projections only (qkv_bias=True, bias=False).
    With ``use_sliding_window``, the layers from ``max_window_layers`` on slide (or as ``layer_types`` says)."""
    hf = with_defaults(hf, QWEN2_DEFAULTS)
    cfg = llama_config({**hf, "attention_bias": False, "mlp_bias": False}, QWEN2_DEFAULTS)
    return cfg.replace(qkv_bias=True, attention=qwen_attention(hf))


def qwen2_refusal(cfg: ModelConfig) -> str | None:
    return refusal(cfg, {
        "qkv_bias": (True, "Qwen2 has biases on q, k and v"), "bias": (False, "Qwen2 has biases on q, k and v only"),
    }) or llama_layout_refusal(cfg, "Qwen2")


def qwen2_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {**llama_layout_to_hf(cfg), **qwen_attention_to_hf(cfg)}


register("qwen2", Family(qwen2_config, llama_weights, LLAMA_IGNORE, Export(
    "Qwen2ForCausalLM", moe=False, refuse=qwen2_refusal, config=qwen2_to_hf, weights=llama_weights_to_hf,
    name="Qwen2", computes={**LLAMA_LAYOUT, **WINDOWS, "qkv_bias": (True,)},
)))


# ============================================================== Seed-OSS
# transformers' SeedOssConfig defaults (5.x); its dropouts act in training only, and lmlab's loaded models have none
SEED_OSS_DEFAULTS: dict[str, Any] = dict(
    LLAMA_DEFAULTS, vocab_size=155136, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=80,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=524288, attention_bias=True,
    attention_out_bias=False, mlp_bias=False,
)


def seed_oss_config(hf: Mapping[str, Any]) -> ModelConfig:
    """Seed-OSS: Llama with biases on q, k and v (``attention_bias``, lmlab's qkv_bias), and on the output projection
    (``attention_out_bias``) and the feed-forward (``mlp_bias``) together or on neither (lmlab's ``bias``)."""
    hf = with_defaults(hf, SEED_OSS_DEFAULTS)
    out_bias, mlp_bias = bool(hf["attention_out_bias"]), bool(hf["mlp_bias"])
    if out_bias != mlp_bias:
        raise key_refused(hf, "attention_out_bias", f"with mlp_bias={mlp_bias}: lmlab's one `bias` switch puts "
                          "biases on the output projection and the feed-forward together")
    return llama_layout_config(hf, qkv_bias=bool(hf["attention_bias"]), bias=mlp_bias)


def seed_oss_refusal(cfg: ModelConfig) -> str | None:
    return llama_layout_refusal(cfg, "Seed-OSS")


def seed_oss_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """head_dim always (Seed-OSS's default is 128, not d_model / n_heads); lmlab's dropout for both of Seed-OSS's
    (their defaults are 0.1), which act in training only."""
    return {**llama_layout_to_hf(cfg), "head_dim": cfg.head_dim, "attention_bias": cfg.qkv_bias,
            "attention_out_bias": cfg.bias, "mlp_bias": cfg.bias, "attention_dropout": cfg.dropout,
            "residual_dropout": cfg.dropout}


register("seed_oss", Family(seed_oss_config, llama_weights, LLAMA_IGNORE, Export(
    "SeedOssForCausalLM", moe=False, refuse=seed_oss_refusal, config=seed_oss_to_hf, weights=llama_weights_to_hf,
    name="Seed-OSS", computes={**LLAMA_LAYOUT, "bias": (False, True), "qkv_bias": (False, True)},
)))


# ============================================================== GPT-2
GPT2_DEFAULTS: dict[str, Any] = dict(
    vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
    activation_function="gelu_new", layer_norm_epsilon=1e-5, initializer_range=0.02, scale_attn_weights=True,
    scale_attn_by_inverse_layer_idx=False, add_cross_attention=False, tie_word_embeddings=True,
)


def gpt2_config(hf: Mapping[str, Any]) -> ModelConfig:
    """GPT-2: pre-norm LayerNorm, learned positions, tanh-GELU MLP, biases, tied head.
    ``reorder_and_upcast_attn`` only changes rounding, so it is accepted."""
    hf = with_defaults(hf, GPT2_DEFAULTS)
    refused = {
        "scale_attn_by_inverse_layer_idx": (True, "lmlab scales every layer's attention by 1/sqrt(head_dim) only"),
        "scale_attn_weights": (False, "lmlab always scales attention scores by 1/sqrt(head_dim)"),
        "add_cross_attention": (True, "lmlab models are decoder-only, without cross-attention"),
    }
    for key, (bad, why) in refused.items():
        if bool(hf[key]) == bad:
            raise ValueError(f"config.json has {key}={str(bad).lower()}, which lmlab does not support: {why}")
    d = hf["n_embd"]
    return model_config(
        hf,
        vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["n_layer"], n_heads=hf["n_head"],
        d_ff=hf["n_inner"] or 4 * d, max_seq_len=hf["n_positions"],
        norm="layernorm", norm_position="pre", positions="learned", ffn="mlp",
        activation=activation_from_hf(hf["activation_function"], "activation_function"),
        residual_scaling="gpt2", bias=True, tie_embeddings=bool(hf["tie_word_embeddings"]),
        norm_eps=hf["layer_norm_epsilon"], init_std=hf["initializer_range"],
    )


def _transposed(w: torch.Tensor | None) -> torch.Tensor | None:
    return None if w is None else w.t()  # GPT-2's Conv1D stores (in, out); nn.Linear wants (out, in)


def gpt2_weights(cfg: ModelConfig, t: HFTensors) -> dict[str, torch.Tensor | None]:
    """GPT-2 checkpoints: from GPT2LMHeadModel ("transformer." prefix) or GPT2Model (none)."""
    p = "transformer." if t.has_prefix("transformer.") else ""
    sd = {"embed.weight": t.take(f"{p}wte.weight"), "positions.table.weight": t.take(f"{p}wpe.weight")}
    linears = {"attn.c_attn": "attn.qkv", "attn.c_proj": "attn.out", "mlp.c_fc": "ffn.up", "mlp.c_proj": "ffn.down"}
    for i in range(cfg.n_layers):
        hf, ours = f"{p}h.{i}.", f"blocks.{i}."
        for theirs, mine in (("ln_1", "norm1"), ("ln_2", "norm2")):
            sd[f"{ours}{mine}.weight"] = t.take(f"{hf}{theirs}.weight")
            sd[f"{ours}{mine}.bias"] = t.take(f"{hf}{theirs}.bias")
        for theirs, mine in linears.items():  # c_attn's columns are [q | k | v], as our qkv rows
            sd[f"{ours}{mine}.weight"] = _transposed(t.take(f"{hf}{theirs}.weight"))
            sd[f"{ours}{mine}.bias"] = t.take(f"{hf}{theirs}.bias")
    sd["final_norm.weight"] = t.take(f"{p}ln_f.weight")
    sd["final_norm.bias"] = t.take(f"{p}ln_f.bias")
    sd["head.weight"] = tied_head(cfg, t, "lm_head.weight", sd["embed.weight"])
    return sd


def gpt2_refusal(cfg: ModelConfig) -> str | None:
    if cfg.n_kv_heads != cfg.n_heads or cfg.head_dim * cfg.n_heads != cfg.d_model:
        return (
            f"n_kv_heads={cfg.n_kv_heads}, head_dim={cfg.head_dim} (GPT-2 has n_heads={cfg.n_heads} heads of "
            f"d_model / n_heads for queries, keys and values alike)"
        )
    return refusal(cfg, {
        "norm_position": ("pre", "GPT-2 normalizes each sublayer's input"),
        "qk_norm": ("none", "GPT-2 has no query/key norm"),
        "norm": ("layernorm", "GPT-2 normalizes with LayerNorm"),
        "positions": ("learned", "GPT-2 learns absolute positions"),
        "ffn": ("mlp", "GPT-2's feed-forward is W2 act(W1 x)"),
        "bias": (True, "every GPT-2 linear layer and LayerNorm has a bias"),
        "qkv_bias": (True, "every GPT-2 linear layer has a bias"),
    })


def gpt2_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """GPT-2's config.json; its three dropouts are where lmlab's one dropout acts (embeddings,
    attention probabilities, each residual branch)."""
    return dict(
        vocab_size=cfg.vocab_size, n_embd=cfg.d_model, n_layer=cfg.n_layers, n_head=cfg.n_heads,
        n_inner=cfg.d_ff if cfg.d_ff != 4 * cfg.d_model else None,  # None: 4 d_model
        n_positions=cfg.max_seq_len,
        activation_function="gelu_new" if cfg.activation == "gelu_tanh" else ACTIVATION_NAMES[cfg.activation],
        layer_norm_epsilon=cfg.norm_eps, initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings,
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False, add_cross_attention=False,
    )


def gpt2_weights_to_hf(cfg: ModelConfig, sd: Tensors) -> dict[str, torch.Tensor]:
    """The inverse of :func:`gpt2_weights`, with GPT2LMHeadModel's names ("transformer." prefix)."""
    p = "transformer."
    out = {f"{p}wte.weight": sd["embed.weight"], f"{p}wpe.weight": sd["positions.table.weight"]}
    linears = {"attn.c_attn": "attn.qkv", "attn.c_proj": "attn.out", "mlp.c_fc": "ffn.up", "mlp.c_proj": "ffn.down"}
    for i in range(cfg.n_layers):
        hf, ours = f"{p}h.{i}.", f"blocks.{i}."
        for theirs, mine in (("ln_1", "norm1"), ("ln_2", "norm2"), *linears.items()):
            weight = sd[f"{ours}{mine}.weight"]
            out[f"{hf}{theirs}.weight"] = weight.t() if theirs in linears else weight  # Conv1D: (in, out)
            out[f"{hf}{theirs}.bias"] = sd[f"{ours}{mine}.bias"]
    out[f"{p}ln_f.weight"], out[f"{p}ln_f.bias"] = sd["final_norm.weight"], sd["final_norm.bias"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["head.weight"]
    return out


# causal-mask buffers that checkpoints written before transformers 4.x's non-persistent buffers hold
register("gpt2", Family(gpt2_config, gpt2_weights, (r"(^|\.)h\.\d+\.attn\.(masked_)?bias$",), Export(
    "GPT2LMHeadModel", moe=False, refuse=gpt2_refusal, config=gpt2_to_hf, weights=gpt2_weights_to_hf, name="GPT-2",
    computes={"norm": ("layernorm",), "positions": ("learned",), "ffn": ("mlp",), "activation": tuple(ACTIVATION_NAMES),
              "bias": (True,), "rope": ANY},  # rope: without rotary positions, its settings act nowhere
)))


# ============================================================== rotary layouts
def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q or k projection (weight or bias) from the interleaved rotary layout, pairs
    (2j, 2j+1) as in Meta's original Llama checkpoints, to the half layout, pairs (j, j + d/2),
    as in Hugging Face checkpoints and lmlab's default. Per head, rows [a0 b0 a1 b1 ...] become
    [a0 a1 ... b0 b1 ...]; this is ``permute`` in transformers' convert_llama_weights_to_hf.py."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rows_to_half(cfg: ModelConfig, w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of q or k (a weight, a bias or a per-head norm's gain; ``n_heads`` heads of them) in ``cfg``'s rotary
    layout -> the half layout transformers rotates: with interleaved pairs, the rotated rows of each head (its
    first ``cfg.rotary_dim``; all of them without partial rotary) permuted by :func:`interleaved_to_half`."""
    if cfg.rope.layout != "interleaved":
        return w
    width, r = w.shape[0] // n_heads, cfg.rotary_dim
    if r == width:
        return interleaved_to_half(w, n_heads)
    heads = w.reshape(n_heads, width, *w.shape[1:])  # (H, head_dim, ...)
    rotated = interleaved_to_half(heads[:, :r].reshape(n_heads * r, *w.shape[1:]), n_heads)
    return torch.cat([rotated.reshape(n_heads, r, *w.shape[1:]), heads[:, r:]], dim=1).reshape(w.shape)


def half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`interleaved_to_half`."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
