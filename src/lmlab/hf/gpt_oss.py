"""gpt-oss both ways: ``GptOssForCausalLM``, config.json's ``model_type`` "gpt_oss" (OpenAI 2025, model card sec. 2).

The Llama layout, every layer a mixture of experts, with these lmlab choices:

- biases on q, k, v, the output projection and every expert (``bias=True``), and on the router's logits
  (``moe.router_bias``); softmax over the top-k logits, which is softmax over all then renormalized over the k
  (``moe.normalize_top_k``);
- experts computing the clamped gated unit (``glu_variant="clamped"``) with x sigmoid(1.702 x)
  (``activation="quick_gelu"``): (clamp(up, -7, 7) + 1) * g sigmoid(1.702 g), g = min(gate, 7). config.json's
  ``hidden_act`` is not read by transformers' experts, so it is not read here either;
- a learned sink per head in every softmax (``attention.sinks="learned"``) and sliding-window layers where
  ``layer_types`` puts them (alternating, by default);
- YaRN rotary (with gpt-oss's ``truncate: false``), as any rotary lmlab maps.

Expert tensors are stacked as transformers holds and saves them: ``experts.gate_up_proj`` (E, D, 2F) with gate
and up *interleaved* in its last axis (columns 0, 2, 4, ... gate; 1, 3, 5, ... up), ``gate_up_proj_bias`` (E, 2F)
the same way, ``down_proj`` (E, F, D); lmlab's are (E, 2F, D) = [gate; up] rows and (E, D, F). Quantized
(mxfp4) checkpoints, as OpenAI publishes them, are refused: dequantize them with transformers first.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..config import ModelConfig, MoEConfig
from ..feedforward import GLU_LIMIT, QUICK_GELU_A
from .dense import (
    LLAMA_IGNORE,
    LLAMA_LAYOUT,
    WINDOWS,
    llama_layout_config,
    llama_layout_refusal,
    llama_layout_to_hf,
    llama_weights,
    llama_weights_to_hf,
)
from .moe import ALL_EXPERTS, all_experts_refusal
from .registry import (
    Export,
    Family,
    HFTensors,
    Tensors,
    attention_from_hf,
    key_refused,
    layer_types_to_hf,
    refusal,
    register,
    with_defaults,
)

# transformers' GptOssConfig defaults (5.x), for keys an older config.json leaves out
GPT_OSS_DEFAULTS: dict[str, Any] = dict(
    num_hidden_layers=36, num_local_experts=128, vocab_size=201088, hidden_size=2880, intermediate_size=2880,
    head_dim=64, num_attention_heads=64, num_key_value_heads=8, sliding_window=128, tie_word_embeddings=False,
    initializer_range=0.02, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=150000.0,
    rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
    num_experts_per_tok=4, swiglu_alpha=1.702, swiglu_limit=7.0, layer_types=None, attention_bias=True,
)


def gpt_oss_config(hf: Mapping[str, Any]) -> ModelConfig:
    hf = with_defaults(hf, GPT_OSS_DEFAULTS)
    if hf.get("quantization_config"):
        raise key_refused(hf, "quantization_config", "lmlab reads unquantized weights; load the checkpoint with "
                          "transformers (dequantize=True) and save_pretrained it first")
    if not hf["attention_bias"]:
        raise key_refused(hf, "attention_bias", "gpt-oss's experts always have biases, and lmlab's one `bias` switch "
                          "covers attention and experts together")
    for key, value in (("swiglu_alpha", QUICK_GELU_A), ("swiglu_limit", GLU_LIMIT)):
        if hf[key] != value:
            raise key_refused(hf, key, f"lmlab's clamped gated unit uses gpt-oss's {value}")
    n = hf["num_hidden_layers"]
    types = hf["layer_types"] or [  # as GptOssConfig.__post_init__ derives them
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)
    ]
    attention = attention_from_hf(types, hf["sliding_window"], n).replace(sinks="learned")
    moe = MoEConfig(n_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"], normalize_top_k=True,
                    router_bias=True)
    return llama_layout_config(
        {**hf, "hidden_act": "quick_gelu"}, default_theta=GPT_OSS_DEFAULTS["rope_theta"], bias=True,
        attention=attention, moe=moe, glu_variant="clamped",
    )


# ---- stacked expert tensors: transformers' interleaved (E, D, 2F) <-> lmlab's [gate; up] rows (E, 2F, D)
def gate_up_from_hf(w: torch.Tensor | None) -> torch.Tensor | None:
    """(E, D, 2F) with gate and up interleaved in the last axis (or its bias, (E, 2F)) -> [gate; up] rows."""
    if w is None:
        return None
    halves = torch.cat([w[..., ::2], w[..., 1::2]], dim=-1)
    return halves.transpose(1, 2) if w.ndim == 3 else halves


def gate_up_to_hf(w: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`gate_up_from_hf`."""
    w = w.transpose(1, 2) if w.ndim == 3 else w  # (E, D, 2F) or (E, 2F)
    gate, up = w.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def gpt_oss_ffn(cfg: ModelConfig, t: HFTensors, hf: str, ours: str) -> dict[str, torch.Tensor | None]:
    """One layer's router and experts under ``hf`` ("model.layers.3.mlp.")."""
    if cfg.moe is None or not cfg.moe.router_bias:  # keeps detect_model_type from trying other MoE configs
        raise ValueError("a gpt-oss checkpoint needs a config with moe set and moe.router_bias")
    down = t.take(f"{hf}experts.down_proj")
    return {
        f"{ours}router.weight": t.take(f"{hf}router.weight"), f"{ours}router.bias": t.take(f"{hf}router.bias"),
        f"{ours}router.score_bias": torch.zeros(cfg.moe.routed_experts),
        f"{ours}experts.gate_up": gate_up_from_hf(t.take(f"{hf}experts.gate_up_proj")),
        f"{ours}experts.in_bias": gate_up_from_hf(t.take(f"{hf}experts.gate_up_proj_bias")),
        f"{ours}experts.down": None if down is None else down.transpose(1, 2),
        f"{ours}experts.down_bias": t.take(f"{hf}experts.down_proj_bias"),
    }


def gpt_oss_weights(cfg: ModelConfig, t: HFTensors) -> dict[str, torch.Tensor | None]:
    sd = llama_weights(cfg, t, ffn=gpt_oss_ffn)
    for i in range(cfg.n_layers):
        sd[f"blocks.{i}.attn.sinks"] = t.take(f"model.layers.{i}.self_attn.sinks")
    return sd


def gpt_oss_refusal(cfg: ModelConfig) -> str | None:
    return refusal(cfg, {
        "bias": (True, "gpt-oss has biases on attention and experts"),
        "qkv_bias": (True, "gpt-oss has biases on q, k and v"),
        "attention.sinks": ("learned", "every gpt-oss head has a learned sink"),
        "glu_variant": ("clamped", "gpt-oss's experts clamp gate and up"),
        "activation": ("quick_gelu", "gpt-oss's experts gate with x sigmoid(1.702 x)"),
        "moe.router_bias": (True, "gpt-oss's router has a bias"),
        "moe.scoring": ("softmax", "gpt-oss's router is a softmax over the chosen logits"),
        "moe.normalize_top_k": (True, "gpt-oss's weights are a softmax over the chosen experts"),
        "moe.routed_scale": (1.0, "gpt-oss does not scale the routed output"),
        "moe.n_shared": (0, "gpt-oss has no shared experts"),
        "moe.every": (1, "every gpt-oss layer is a mixture"),
        "moe.first_dense": (0, "every gpt-oss layer is a mixture"),
    }) or llama_layout_refusal(cfg, "gpt-oss") or all_experts_refusal(cfg, "gpt-oss")


def gpt_oss_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """GptOssConfig's keys; intermediate_size is the expert width (every layer is a mixture). hidden_act is
    written as the released configs write it: transformers' experts do not read it."""
    moe = cfg.moe
    return {
        **llama_layout_to_hf(cfg), "hidden_act": "silu", "head_dim": cfg.head_dim,
        "intermediate_size": moe.expert_width(cfg.d_ff), "num_local_experts": moe.routed_experts,
        "num_experts_per_tok": moe.active_experts, "attention_bias": True, "swiglu_alpha": QUICK_GELU_A,
        "swiglu_limit": GLU_LIMIT, "layer_types": layer_types_to_hf(cfg), "output_router_logits": False,
        # transformers builds the sliding mask even where no layer uses it, so a window is always written
        "sliding_window": cfg.attention.window or GPT_OSS_DEFAULTS["sliding_window"],
    }


def gpt_oss_ffn_to_hf(cfg: ModelConfig, sd: Tensors, ours: str, hf: str) -> dict[str, torch.Tensor]:
    if bool(sd[f"{ours}router.score_bias"].any()):
        raise ValueError(f"{ours}router.score_bias is not zero (moe.bias_update_rate={cfg.moe.bias_update_rate} "
                         "trained it): gpt-oss's router has no selection bias, so it cannot compute this model exactly")
    return {
        f"{hf}router.weight": sd[f"{ours}router.weight"], f"{hf}router.bias": sd[f"{ours}router.bias"],
        f"{hf}experts.gate_up_proj": gate_up_to_hf(sd[f"{ours}experts.gate_up"]),
        f"{hf}experts.gate_up_proj_bias": gate_up_to_hf(sd[f"{ours}experts.in_bias"]),
        f"{hf}experts.down_proj": sd[f"{ours}experts.down"].transpose(1, 2),
        f"{hf}experts.down_proj_bias": sd[f"{ours}experts.down_bias"],
    }


def gpt_oss_weights_to_hf(cfg: ModelConfig, sd: Tensors) -> dict[str, torch.Tensor]:
    out = llama_weights_to_hf(cfg, sd, ffn=gpt_oss_ffn_to_hf)
    for i in range(cfg.n_layers):
        out[f"model.layers.{i}.self_attn.sinks"] = sd[f"blocks.{i}.attn.sinks"]
    return out


register("gpt_oss", Family(gpt_oss_config, gpt_oss_weights, LLAMA_IGNORE, Export(
    "GptOssForCausalLM", moe=True, refuse=gpt_oss_refusal, config=gpt_oss_to_hf, weights=gpt_oss_weights_to_hf,
    name="gpt-oss", computes={
        **LLAMA_LAYOUT, **WINDOWS, **ALL_EXPERTS, "bias": (True,), "activation": ("quick_gelu",),
        "glu_variant": ("clamped",), "attention.sinks": ("learned",), "moe.router_bias": (True,),
        "moe.normalize_top_k": (True,),
    },
)))
