"""Gemma 3 (text), both ways: ``Gemma3ForCausalLM``, config.json's ``model_type`` "gemma3_text".

The Llama layout with Gemma's refinements, each an lmlab choice (Gemma Team 2025, arXiv:2503.19786, sec. 2):

- sandwich norms, an RMSNorm before and after each sublayer (``norm_position="sandwich"``):
  input_layernorm, post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm are
  norm1, post_norm1, norm2, post_norm2;
- every RMSNorm stores its gain as 1 + w, w initialized at 0 (``norm_gain="offset"``); lmlab models with
  plain gains export with w = g - 1;
- an RMSNorm per query and key head before rotary (``qk_norm="head"``);
- embeddings times sqrt(hidden_size), rounded to the weights' dtype (``embed_scale="sqrt_d"``);
- scores scaled by 1/sqrt(query_pre_attn_scalar) (``attention.scale_dim``, None where it is head_dim);
- sliding-window layers between global ones (``layer_types``, or the older ``sliding_window_pattern``)
  rotating with their own base (``rope_parameters["sliding_attention"]`` / ``rope_local_base_freq``:
  ``rope.local_base``) while the global layers' rotary may be scaled (``rope_scaling`` applies to them only).

Refused: logit soft-capping (Gemma 2's; null in every Gemma 3 config), bidirectional attention, attention
biases, and sliding layers whose rotary is scaled differently from the global layers'. The multimodal
``gemma3`` model_type (text_config inside) is not read: load its language model as gemma3_text.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from ..config import ModelConfig
from .dense import (
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
from .registry import (
    ANY,
    Export,
    Family,
    HFTensors,
    Tensors,
    activation_from_hf,
    attention_from_hf,
    key_refused,
    layer_types_to_hf,
    refusal,
    refuse_attention_bias,
    register,
    rope_from_hf,
    with_defaults,
)

# transformers' Gemma3TextConfig defaults (5.x), for keys an older config.json leaves out
GEMMA3_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
    initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
    query_pre_attn_scalar=256, sliding_window=4096, layer_types=None, sliding_window_pattern=6,
    final_logit_softcapping=None, attn_logit_softcapping=None, use_bidirectional_attention=False,
)
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0  # Gemma3TextConfig.default_theta
# each layer's four norms: HF name -> lmlab name (the sandwich block's)
GEMMA3_NORMS = {"input_layernorm": "norm1", "post_attention_layernorm": "post_norm1",
                "pre_feedforward_layernorm": "norm2", "post_feedforward_layernorm": "post_norm2"}


def gemma3_rope_parameters(hf: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(full_attention, sliding_attention) rotary parameters, as ``Gemma3TextConfig.convert_rope_params_to_dict``
    makes them from either published form: ``rope_parameters`` per layer type (transformers >= 5), or
    ``rope_theta``, ``rope_local_base_freq`` and ``rope_scaling`` (which applies to the global layers only)."""
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, Mapping) or not all(isinstance(v, Mapping) for v in params.values()):
        raise key_refused(hf, "rope_parameters", "Gemma 3 gives one dict per layer type, under 'full_attention' "
                          "and 'sliding_attention'")
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    if hf.get("rope_scaling"):
        full.update(hf["rope_scaling"])
    full.setdefault("rope_theta", hf.get("rope_theta") or GLOBAL_THETA)
    sliding = dict(params.get("sliding_attention") or {"rope_type": "default"})
    sliding.setdefault("rope_theta", hf.get("rope_local_base_freq") or LOCAL_THETA)
    return full, sliding


def gemma3_config(hf: Mapping[str, Any]) -> ModelConfig:
    hf = with_defaults(hf, GEMMA3_DEFAULTS)
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf[key] is not None:
            raise key_refused(hf, key, "lmlab has no logit soft-capping (Gemma 2's; Gemma 3 sets it null)")
    if hf["use_bidirectional_attention"]:
        raise key_refused(hf, "use_bidirectional_attention", "lmlab's language models are causal")
    refuse_attention_bias(hf)
    n = hf["num_hidden_layers"]
    types = hf["layer_types"] or [  # as Gemma3TextConfig.__post_init__ derives them
        "sliding_attention" if (i + 1) % hf["sliding_window_pattern"] else "full_attention" for i in range(n)
    ]
    full, sliding = gemma3_rope_parameters(hf)
    flat = {**hf, "rope_scaling": None, "rope_parameters": full, "hidden_act": hf["hidden_activation"]}
    rope, local = (rope_from_hf({**flat, "rope_parameters": p}) for p in (full, sliding))
    if "full_attention" not in types:  # every layer slides: the sliding layers' rotary is the model's
        rope = local
    elif "sliding_attention" in types and local != rope:
        if local.scaling != "none":
            raise key_refused(hf, "rope_parameters", "lmlab's local layers rotate as the global ones or, with "
                              "rope.local_base, unscaled; give sliding_attention rope_type 'default'")
        rope = rope.replace(local_base=local.base)
    activation_from_hf(hf["hidden_activation"], "hidden_activation")  # names the right key if it is refused
    attention = attention_from_hf(types, hf["sliding_window"], n)
    scale_dim = hf["query_pre_attn_scalar"]
    head_dim = hf["head_dim"] or hf["hidden_size"] // hf["num_attention_heads"]
    scale_dim = None if scale_dim == head_dim else int(scale_dim)
    return llama_layout_config(
        flat, rope=rope, attention=attention.replace(scale_dim=scale_dim), norm_position="sandwich",
        qk_norm="head", norm_gain="offset", embed_scale="sqrt_d",
    )


def gemma3_weights(cfg: ModelConfig, t: HFTensors) -> dict[str, torch.Tensor | None]:
    if cfg.norm_position != "sandwich" or cfg.qk_norm != "head":
        raise ValueError("a Gemma 3 checkpoint needs a config with norm_position='sandwich' and qk_norm='head'")
    sd = {**llama_weights(cfg, t, norms=GEMMA3_NORMS), **qk_norm_weights(cfg, t)}
    if cfg.norm_gain == "plain":  # g = 1 + w: exactly the gain Gemma computes in fp32
        sd = {k: v + 1.0 if v is not None and re.search(r"norm\d?\.weight$", k) else v for k, v in sd.items()}
    return sd


def gemma3_refusal(cfg: ModelConfig) -> str | None:
    if cfg.d_model % cfg.n_heads:
        return f"n_heads={cfg.n_heads} (Gemma3TextConfig needs hidden_size={cfg.d_model} divisible by it)"
    return refusal(cfg, {
        "bias": (False, "Gemma 3 has no biases"), "qkv_bias": (False, "Gemma 3 has no biases"),
        "embed_scale": ("sqrt_d", "Gemma 3 multiplies its embeddings by sqrt(hidden_size)"),
    }) or llama_layout_refusal(cfg, "Gemma 3", norm_position="sandwich", qk_norm="head")


def gemma3_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """config.json of Gemma3ForCausalLM; the rotary parameters in both forms: per layer type, and the older
    rope_theta, rope_local_base_freq and rope_scaling (global layers)."""
    rope, local_base = cfg.rope, cfg.rope.local_base
    keys = llama_layout_to_hf(cfg)
    full = keys["rope_parameters"]
    sliding = full if local_base is None else {"rope_type": "default", "rope_theta": local_base}
    return {
        **keys, "hidden_activation": keys.pop("hidden_act"), "head_dim": cfg.head_dim,
        "query_pre_attn_scalar": cfg.attention.scale_dim or cfg.head_dim, "attention_bias": False,
        # transformers builds the sliding mask even where no layer uses it, so a window is always written
        "sliding_window": cfg.attention.window or GEMMA3_DEFAULTS["sliding_window"],
        "layer_types": layer_types_to_hf(cfg),
        "rope_parameters": {"full_attention": full, "sliding_attention": sliding},
        "rope_local_base_freq": local_base if local_base is not None else rope.base,
        "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False,
    }


def gemma3_weights_to_hf(cfg: ModelConfig, sd: Tensors) -> dict[str, torch.Tensor]:
    out = {**llama_weights_to_hf(cfg, sd, norms=GEMMA3_NORMS), **qk_norm_to_hf(cfg, sd)}
    if cfg.norm_gain == "plain":  # Gemma stores w, its gain is 1 + w
        out = {k: v - 1.0 if k.endswith("norm.weight") else v for k, v in out.items()}
    return out


register("gemma3_text", Family(gemma3_config, gemma3_weights, LLAMA_IGNORE, Export(
    "Gemma3ForCausalLM", moe=False, refuse=gemma3_refusal, config=gemma3_to_hf, weights=gemma3_weights_to_hf,
    name="Gemma 3", computes={
        **LLAMA_LAYOUT, **WINDOWS, "norm_position": ("sandwich",), "qk_norm": ("head",), "embed_scale": ("sqrt_d",),
        "norm_gain": ("plain", "offset"), "attention.scale_dim": ANY, "rope.local_base": ANY,
    },
)))
