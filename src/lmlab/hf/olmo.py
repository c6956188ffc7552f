"""OLMo 2, OLMoE, OLMo 3 and EXAONE 4, both ways: an RMSNorm over the whole query and the whole key projection
before rotary (``qk_norm="full"``). OLMo 2 also moves each block's norms onto the sublayer outputs,
x + norm(f(x)) (``norm_position="reordered"``, OLMo 2 sec. 3.1); OLMoE keeps pre-norm and makes every
feed-forward a softmax-routed mixture of experts. OLMo 3 is OLMo 2 with sliding-window layers (three of four by
default), which may rotate with their own unscaled base. EXAONE 4.0 keeps OLMo 2's block with per-head q/k norms
(``qk_norm="head"``) and, with a window, full-attention layers without rotary between rotating sliding ones.

OLMoE's ``clip_qkv`` (q, k, v clamped to a range) is refused unless null: lmlab has no clamp.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..config import ModelConfig, MoEConfig, RopeConfig
from .dense import (
    LLAMA_DEFAULTS,
    LLAMA_IGNORE,
    LLAMA_LAYOUT,
    WINDOWS,
    llama_layout_config,
    llama_layout_refusal,
    llama_layout_to_hf,
    llama_weights,
    llama_weights_to_hf,
    qk_norm_to_hf,
    qk_norm_weights,
)
from .moe import ALL_EXPERTS, all_experts_refusal, moe_refusal, moe_to_hf, moe_weights
from .registry import (
    ANY,
    Export,
    Family,
    HFTensors,
    Tensors,
    attention_from_hf,
    key_refused,
    layer_types_to_hf,
    refusal,
    refuse_attention_bias,
    register,
    rope_from_hf,
    with_defaults,
)
from .smollm3 import nope_every_from_hf

# ============================================================== OLMo 2
# transformers' Olmo2Config defaults (5.x), for keys an older config.json leaves out.
OLMO2_DEFAULTS: dict[str, Any] = dict(
    LLAMA_DEFAULTS, vocab_size=50304, max_position_embeddings=2048, rms_norm_eps=1e-5,
)


def olmo2_config(hf: Mapping[str, Any]) -> ModelConfig:
    """OLMo 2 (arXiv:2501.00656): Llama without biases, the norms on each sublayer's output
    (x + norm(f(x))), and an RMSNorm over the whole q and k projections before rotary."""
    hf = with_defaults(hf, OLMO2_DEFAULTS)
    refuse_attention_bias(hf)
    return llama_layout_config(hf, norm_position="reordered", qk_norm="full")


# OLMo 2's layers have no input norms: post_attention_layernorm and post_feedforward_layernorm are the
# reordered block's norm1 and norm2
OLMO2_NORMS = {"post_attention_layernorm": "norm1", "post_feedforward_layernorm": "norm2"}


def olmo2_weights(cfg: ModelConfig, t: HFTensors) -> dict[str, torch.Tensor | None]:
    if cfg.norm_position != "reordered" or cfg.qk_norm != "full":
        raise ValueError("an OLMo 2 checkpoint needs a config with norm_position='reordered' and qk_norm='full'")
    return {**llama_weights(cfg, t, norms=OLMO2_NORMS), **qk_norm_weights(cfg, t)}


def olmo2_refusal(cfg: ModelConfig, name: str = "OLMo 2") -> str | None:
    """What OLMo 2's block (and OLMo 3's, ``name``) cannot compute."""
    return refusal(cfg, {
        "bias": (False, f"{name} has no biases"), "qkv_bias": (False, f"{name} has no biases"),
    }) or llama_layout_refusal(cfg, name, norm_position="reordered", qk_norm="full")


def olmo2_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {**llama_layout_to_hf(cfg), "attention_bias": False}


def olmo2_weights_to_hf(cfg: ModelConfig, sd: Tensors) -> dict[str, torch.Tensor]:
    return {**llama_weights_to_hf(cfg, sd, norms=OLMO2_NORMS), **qk_norm_to_hf(cfg, sd)}


register("olmo2", Family(olmo2_config, olmo2_weights, LLAMA_IGNORE, Export(
    "Olmo2ForCausalLM", moe=False, refuse=olmo2_refusal, config=olmo2_to_hf, weights=olmo2_weights_to_hf,
    name="OLMo 2", computes={**LLAMA_LAYOUT, "norm_position": ("reordered",), "qk_norm": ("full",)},
)))


# ============================================================== OLMoE
# transformers' OlmoeConfig defaults (5.x).
OLMOE_DEFAULTS: dict[str, Any] = dict(
    LLAMA_DEFAULTS, vocab_size=50304, hidden_size=2048, intermediate_size=2048, num_hidden_layers=16,
    num_attention_heads=16, max_position_embeddings=4096, rms_norm_eps=1e-5, clip_qkv=None,
    num_experts_per_tok=8, num_experts=64, norm_topk_prob=False,
)


def olmoe_config(hf: Mapping[str, Any]) -> ModelConfig:
    """OLMoE (arXiv:2409.02060): pre-norm, OLMo 2's whole-projection q/k norm, and every feed-forward a
    mixture of SwiGLU experts of width intermediate_size, softmax-routed, no shared expert."""
    hf = with_defaults(hf, OLMOE_DEFAULTS)
    refuse_attention_bias(hf)
    if hf["clip_qkv"] is not None:
        raise key_refused(hf, "clip_qkv", "lmlab does not clamp queries, keys and values; only clip_qkv null loads")
    heads = hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
        raise key_refused(hf, "head_dim", "OLMoE's q/k norms span hidden_size, so its heads must be hidden_size / "
                      "num_attention_heads wide")
    moe = MoEConfig(n_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
                    normalize_top_k=bool(hf["norm_topk_prob"]))
    return llama_layout_config(hf, qk_norm="full", moe=moe)


def olmoe_ffn(cfg: ModelConfig, t: HFTensors, hf: str, ours: str) -> dict[str, torch.Tensor | None]:
    return moe_weights(cfg, t, hf, ours, names=("gate_proj", "up_proj", "down_proj"))


def olmoe_weights(cfg: ModelConfig, t: HFTensors) -> dict[str, torch.Tensor | None]:
    if cfg.moe is None or cfg.qk_norm != "full":
        raise ValueError("an OLMoE checkpoint needs a config with moe set and qk_norm='full'")
    return {**llama_weights(cfg, t, ffn=olmoe_ffn), **qk_norm_weights(cfg, t)}


def olmoe_refusal(cfg: ModelConfig) -> str | None:
    if cfg.head_dim * cfg.n_heads != cfg.d_model:
        return (f"head_dim={cfg.head_dim} (OLMoE's q/k norms span hidden_size, so its n_heads={cfg.n_heads} heads "
                f"must be d_model / n_heads = {cfg.d_model / cfg.n_heads:g} wide)")
    return moe_refusal(cfg, "OLMoE", {
        "qkv_bias": (False, "OLMoE has no biases"),
        "moe.scoring": ("softmax", "OLMoE's router is a softmax"),
        "moe.routed_scale": (1.0, "OLMoE does not scale the routed output"),
        "moe.n_shared": (0, "OLMoE has no shared experts"),
        "moe.every": (1, "every OLMoE layer is a mixture"),
        "moe.first_dense": (0, "every OLMoE layer is a mixture"),
    }, qk_norm="full") or all_experts_refusal(cfg, "OLMoE")


def olmoe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """OLMoE's intermediate_size is the expert width: every layer is a mixture."""
    moe = cfg.moe
    return {
        **llama_layout_to_hf(cfg), "intermediate_size": moe.expert_width(cfg.d_ff), "attention_bias": False,
        "clip_qkv": None, "num_experts": moe.routed_experts, "num_experts_per_tok": moe.active_experts,
        "norm_topk_prob": moe.normalize_top_k, "output_router_logits": False,
    }


def olmoe_ffn_to_hf(cfg: ModelConfig, sd: Tensors, ours: str, hf: str) -> dict[str, torch.Tensor]:
    return moe_to_hf(cfg, sd, ours, hf, names=("gate_proj", "up_proj", "down_proj"), arch="OLMoE")


def olmoe_weights_to_hf(cfg: ModelConfig, sd: Tensors) -> dict[str, torch.Tensor]:
    return {**llama_weights_to_hf(cfg, sd, ffn=olmoe_ffn_to_hf), **qk_norm_to_hf(cfg, sd)}


register("olmoe", Family(olmoe_config, olmoe_weights, LLAMA_IGNORE, Export(
    "OlmoeForCausalLM", moe=True, refuse=olmoe_refusal, config=olmoe_to_hf, weights=olmoe_weights_to_hf,
    name="OLMoE", computes={**LLAMA_LAYOUT, **ALL_EXPERTS, "qk_norm": ("full",), "moe.normalize_top_k": ANY},
)))


# ============================================================== OLMo 3
# transformers' Olmo3Config defaults (5.x): OLMo 2's, with sliding windows in three layers of four
OLMO3_DEFAULTS: dict[str, Any] = dict(OLMO2_DEFAULTS, sliding_window=4096, layer_types=None)
OLMO3_THETA = 500_000.0  # Olmo3Config.default_theta


def olmo3_rope(hf: Mapping[str, Any], types: list[str]) -> RopeConfig:
    """The rotary of OLMo 3's layers, as ``Olmo3Config.convert_rope_params_to_dict`` makes it: ``rope_parameters``
    per layer type (transformers >= 5), or the older ``rope_theta`` and ``rope_scaling``, which scales the full
    layers only. transformers hands a top-level ``rope_theta`` to the full layers alone: the sliding layers rotate
    with their own rope_theta, else the default 500000. Sliding layers may rotate with another base
    (``rope.local_base``), unscaled."""
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, Mapping) or not all(isinstance(v, Mapping) for v in params.values()):
        raise key_refused(hf, "rope_parameters", "OLMo 3 gives one dict per layer type, under 'full_attention' "
                          "and 'sliding_attention'")
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    full.update(hf.get("rope_scaling") or {})
    full.setdefault("rope_theta", hf.get("rope_theta") or OLMO3_THETA)
    sliding = dict(params.get("sliding_attention") or {"rope_type": "default"})
    sliding.setdefault("rope_theta", OLMO3_THETA)
    flat = {**hf, "rope_scaling": None, "rope_theta": None}
    rope, local = (rope_from_hf({**flat, "rope_parameters": p}) for p in (full, sliding))
    if "full_attention" not in types:  # every layer slides: their rotary is the model's
        return local
    if "sliding_attention" not in types or local == rope:
        return rope
    if local.scaling != "none":
        raise key_refused(hf, "rope_parameters", "lmlab's local layers rotate as the full ones or, with "
                          "rope.local_base, unscaled; give sliding_attention rope_type 'default'")
    return rope.replace(local_base=local.base)


def olmo3_config(hf: Mapping[str, Any]) -> ModelConfig:
    """OLMo 3: OLMo 2's block (reordered norms, whole-projection q/k norms) with sliding-window layers (by default
    three of every four), whose rotary may differ from the full layers' (those alone take ``rope_scaling``)."""
    hf = with_defaults(hf, OLMO3_DEFAULTS)
    n = hf["num_hidden_layers"]
    types = hf["layer_types"] or [  # as Olmo3Config.__post_init__ derives them
        "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]
    attention = attention_from_hf(types, hf["sliding_window"], n)
    return olmo2_config({**hf, "rope_scaling": None, "rope_parameters": None}).replace(
        rope=olmo3_rope(hf, types), attention=attention)


def olmo3_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """config.json of Olmo3ForCausalLM: every layer's type, and the rotary per layer type (the sliding layers' as the
    full ones', or unscaled at ``rope.local_base``)."""
    keys = olmo2_to_hf(cfg)
    full = keys["rope_parameters"]
    sliding = full if cfg.rope.local_base is None else {"rope_type": "default", "rope_theta": cfg.rope.local_base}
    return {**keys, "layer_types": layer_types_to_hf(cfg), "rope_parameters": {
        "full_attention": full, "sliding_attention": sliding},
        # transformers builds the sliding mask even where no layer uses it, so a window is always written
        "sliding_window": cfg.attention.window or OLMO3_DEFAULTS["sliding_window"]}


def olmo3_refusal(cfg: ModelConfig) -> str | None:
    return olmo2_refusal(cfg, "OLMo 3")


register("olmo3", Family(olmo3_config, olmo2_weights, LLAMA_IGNORE, Export(
    "Olmo3ForCausalLM", moe=False, refuse=olmo3_refusal, config=olmo3_to_hf, weights=olmo2_weights_to_hf,
    name="OLMo 3", computes={**LLAMA_LAYOUT, **WINDOWS, "norm_position": ("reordered",), "qk_norm": ("full",),
                             "rope.local_base": ANY},
)))


# ============================================================== EXAONE 4
# transformers' Exaone4Config defaults (5.x)
EXAONE4_DEFAULTS: dict[str, Any] = dict(
    LLAMA_DEFAULTS, vocab_size=102400, intermediate_size=16384, num_key_value_heads=32, rms_norm_eps=1e-5,
    sliding_window=4096, sliding_window_pattern=4, layer_types=None,
)


def exaone4_config(hf: Mapping[str, Any]) -> ModelConfig:
    """EXAONE 4.0: OLMo 2's reordered norms, an RMSNorm per query and key head before rotary, and with a
    ``sliding_window``, sliding-window layers that rotate between full-attention layers that do not (NoPE, every
    n-th layer: ``rope.nope_every``); without one, every layer full and rotating."""
    hf = with_defaults(hf, EXAONE4_DEFAULTS)
    n, window, pattern = hf["num_hidden_layers"], hf["sliding_window"], hf["sliding_window_pattern"]
    types = hf["layer_types"]
    if types is None:  # as Exaone4Config.__post_init__ derives them
        if window is None:
            types = ["full_attention"] * n
        elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        else:
            raise key_refused(hf, "sliding_window_pattern", "without layer_types lmlab reads the number n of "
                              "Exaone4Config (a full layer every n-th), from which transformers derives them")
    if window is None and "sliding_attention" in types:
        raise key_refused(hf, "layer_types", "its sliding_attention layers need a sliding_window")
    # a layer rotates where it slides, or everywhere without a window (Exaone4Attention)
    uses_rope = [int(window is None or t == "sliding_attention") for t in types]
    return llama_layout_config(hf, norm_position="reordered", qk_norm="head").replace(
        attention=attention_from_hf(types, window, n)).override({"rope.nope_every": nope_every_from_hf(uses_rope)})


def exaone4_weights(cfg: ModelConfig, t: HFTensors) -> dict[str, torch.Tensor | None]:
    if cfg.norm_position != "reordered" or cfg.qk_norm != "head":
        raise ValueError("an EXAONE 4 checkpoint needs a config with norm_position='reordered' and qk_norm='head'")
    return {**llama_weights(cfg, t, norms=OLMO2_NORMS), **qk_norm_weights(cfg, t)}


def exaone4_refusal(cfg: ModelConfig) -> str | None:
    """EXAONE 4 turns rotary off exactly in its full layers when it has a window (a sliding layer or NoPE layer)."""
    nope = [not cfg.has_positions(i) for i in range(cfg.n_layers)]
    full = [cfg.attention.kind(i) == "global" for i in range(cfg.n_layers)]
    if (any(nope) or not all(full)) and nope != full:
        return (f"rope.nope_every={cfg.rope.nope_every} with attention.pattern={list(cfg.attention.pattern)} "
                "(EXAONE 4's layers without rotary are exactly its full-attention layers, where it has sliding ones)")
    return refusal(cfg, {
        "bias": (False, "EXAONE 4 has no biases"), "qkv_bias": (False, "EXAONE 4 has no biases"),
    }) or llama_layout_refusal(cfg, "EXAONE 4", norm_position="reordered", qk_norm="head")


def exaone4_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A window whenever some layer slides or does not rotate (transformers reads NoPE from the window's presence)."""
    nope = any(not cfg.has_positions(i) for i in range(cfg.n_layers))
    window = cfg.attention.window or (EXAONE4_DEFAULTS["sliding_window"] if nope else None)
    return {**llama_layout_to_hf(cfg), "layer_types": layer_types_to_hf(cfg),
            "sliding_window": window, "sliding_window_pattern": cfg.rope.nope_every if window else 0}


def exaone4_weights_to_hf(cfg: ModelConfig, sd: Tensors) -> dict[str, torch.Tensor]:
    return {**llama_weights_to_hf(cfg, sd, norms=OLMO2_NORMS), **qk_norm_to_hf(cfg, sd)}


register("exaone4", Family(exaone4_config, exaone4_weights, LLAMA_IGNORE, Export(
    "Exaone4ForCausalLM", moe=False, refuse=exaone4_refusal, config=exaone4_to_hf, weights=exaone4_weights_to_hf,
    name="EXAONE 4", computes={**LLAMA_LAYOUT, **WINDOWS, "norm_position": ("reordered",), "qk_norm": ("head",),
                               "rope.nope_every": ANY},
)))
