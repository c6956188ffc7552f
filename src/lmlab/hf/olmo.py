"""OLMo 2 and OLMoE, both ways: an RMSNorm over the whole query and the whole key projection before
rotary (``qk_norm="full"``). OLMo 2 also moves each block's norms onto the sublayer outputs,
x + norm(f(x)) (``norm_position="reordered"``, OLMo 2 sec. 3.1); OLMoE keeps pre-norm and makes every
feed-forward a softmax-routed mixture of experts.

OLMoE's ``clip_qkv`` (q, k, v clamped to a range) is refused unless null: lmlab has no clamp.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..config import ModelConfig, MoEConfig
from .dense import (
    LLAMA_DEFAULTS,
    LLAMA_IGNORE,
    LLAMA_LAYOUT,
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
    key_refused,
    refusal,
    refuse_attention_bias,
    register,
    with_defaults,
)

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


def olmo2_refusal(cfg: ModelConfig) -> str | None:
    return refusal(cfg, {
        "bias": (False, "OLMo 2 has no biases"), "qkv_bias": (False, "OLMo 2 has no biases"),
    }) or llama_layout_refusal(cfg, "OLMo 2", norm_position="reordered", qk_norm="full")


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
