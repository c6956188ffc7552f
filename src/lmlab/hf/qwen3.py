"""Qwen3 and Qwen3-MoE, both ways: the Llama layout with an RMSNorm on each query and key head before
rotary (``qk_norm="head"``).

Windows, as transformers applies them (its masks, for every attention implementation): Qwen3 slides the
layers ``layer_types`` names, or without it those from ``max_window_layers`` on, as Qwen2 does; Qwen3-MoE
slides every layer when ``use_sliding_window`` is set, and ignores ``max_window_layers`` and ``layer_types``,
so a Qwen3-MoE config.json whose keys say some layers keep full attention is refused.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..config import AttentionConfig, ModelConfig, MoEConfig
from .dense import (
    LLAMA_DEFAULTS,
    LLAMA_IGNORE,
    LLAMA_LAYOUT,
    WINDOWS,
    every_layer_window,
    every_layer_window_refusal,
    llama_glu,
    llama_glu_to_hf,
    llama_layout_config,
    llama_layout_refusal,
    llama_layout_to_hf,
    llama_weights,
    llama_weights_to_hf,
    qk_norm_to_hf,
    qk_norm_weights,
    qwen_attention,
    qwen_attention_to_hf,
)
from .moe import (
    ALL_EXPERTS,
    all_experts_refusal,
    every_and_first_dense,
    moe_refusal,
    moe_to_hf,
    moe_weights,
    qwen2_moe_layers,
)
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


def qwen3_moe_attention(hf: Mapping[str, Any]) -> AttentionConfig:
    """Qwen3-MoE's windows as transformers computes them: every layer slides when ``use_sliding_window``. A
    nonzero ``max_window_layers``, or ``layer_types`` with full layers, mean (in Qwen2 and Qwen3) full attention
    in some layers, which transformers' Qwen3MoE ignores: refused rather than guessed."""
    if not hf["use_sliding_window"]:
        return AttentionConfig()
    n = hf["num_hidden_layers"]
    if hf.get("max_window_layers") not in (None, 0):
        raise key_refused(hf, "max_window_layers", f"transformers' Qwen3MoE ignores it and slides all {n} layers, "
                          "where Qwen2 and Qwen3 keep the layers below it full; remove it to load that")
    if "full_attention" in (hf.get("layer_types") or ()):
        raise key_refused(hf, "layer_types", "transformers' Qwen3MoE ignores it and slides every layer; remove it "
                          "to load that")
    return every_layer_window(hf["sliding_window"])


def qwen3_attention_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """config.json keys of Qwen3's attention: head_dim always (Qwen3's default is 128, not d_model / n_heads),
    and the windows (Qwen3-MoE has no ``layer_types``: its window, if any, is in every layer)."""
    keys = {"head_dim": cfg.head_dim, "attention_bias": False, **qwen_attention_to_hf(cfg)}
    return keys if cfg.moe is None else {k: v for k, v in keys.items() if k != "layer_types"}


# ============================================================== Qwen3
# transformers' Qwen3Config defaults (5.x), for keys an older config.json leaves out.
QWEN3_DEFAULTS: dict[str, Any] = dict(
    LLAMA_DEFAULTS, vocab_size=151936, intermediate_size=22016, num_key_value_heads=32, head_dim=128,
    max_position_embeddings=32768, rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=4096,
    max_window_layers=28, layer_types=None,
)


def qwen3_config(hf: Mapping[str, Any]) -> ModelConfig:
    """Qwen3: Llama without biases, plus an RMSNorm over each query and key head before rotary."""
    hf = with_defaults(hf, QWEN3_DEFAULTS)
    refuse_attention_bias(hf)
    return llama_layout_config(hf, qk_norm="head").replace(attention=qwen_attention(hf))


def qwen3_weights(cfg: ModelConfig, t: HFTensors) -> dict[str, torch.Tensor | None]:
    if cfg.qk_norm != "head":  # keeps detect_model_type from taking Llama checkpoints for Qwen3
        raise ValueError("a Qwen3 checkpoint needs a config with qk_norm='head'")
    return {**llama_weights(cfg, t), **qk_norm_weights(cfg, t)}


def qwen3_refusal(cfg: ModelConfig) -> str | None:
    return refusal(cfg, {
        "bias": (False, "Qwen3 has no biases outside attention"), "qkv_bias": (False, "Qwen3 has no q, k, v biases"),
    }) or llama_layout_refusal(cfg, "Qwen3", qk_norm="head")


def qwen3_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {**llama_layout_to_hf(cfg), **qwen3_attention_to_hf(cfg)}


def qwen3_weights_to_hf(cfg: ModelConfig, sd: Tensors) -> dict[str, torch.Tensor]:
    return {**llama_weights_to_hf(cfg, sd), **qk_norm_to_hf(cfg, sd)}


register("qwen3", Family(qwen3_config, qwen3_weights, LLAMA_IGNORE, Export(
    "Qwen3ForCausalLM", moe=False, refuse=qwen3_refusal, config=qwen3_to_hf, weights=qwen3_weights_to_hf,
    name="Qwen3", computes={**LLAMA_LAYOUT, **WINDOWS, "qk_norm": ("head",)},
)))


# ============================================================== Qwen3-MoE
# transformers' Qwen3MoeConfig defaults (5.x).
QWEN3_MOE_DEFAULTS: dict[str, Any] = dict(
    LLAMA_DEFAULTS, vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
    num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
    use_sliding_window=False, sliding_window=4096, decoder_sparse_step=1, moe_intermediate_size=768,
    num_experts_per_tok=8, norm_topk_prob=False, mlp_only_layers=None,
)
QWEN3_MOE_EXPERTS = 128  # the default of num_experts, which transformers 5 writes as num_local_experts


def qwen3_moe_config(hf: Mapping[str, Any]) -> ModelConfig:
    """Qwen3-MoE: Qwen3's attention with softmax-routed experts (no shared expert) in the layers that
    ``decoder_sparse_step`` and ``mlp_only_layers`` make sparse; the rest keep a dense SwiGLU."""
    hf = with_defaults(hf, QWEN3_MOE_DEFAULTS)
    refuse_attention_bias(hf)
    key = "num_local_experts" if "num_local_experts" in hf else "num_experts"
    n_experts = hf.get(key, QWEN3_MOE_EXPERTS)
    if not n_experts:
        raise key_refused(hf, key, "without experts this is a dense model; load it as model_type 'qwen3'")
    L, step, dense_only = hf["num_hidden_layers"], hf["decoder_sparse_step"], set(hf["mlp_only_layers"] or ())
    sparse = [i not in dense_only and (i + 1) % step == 0 for i in range(L)]
    layout = every_and_first_dense(sparse)
    if layout is None:
        raise key_refused(hf, "mlp_only_layers", f"with decoder_sparse_step={step} the MoE layers are "
                      f"{[i for i, s in enumerate(sparse) if s]}; lmlab expresses only 'every n-th layer after "
                      "the first k'")
    moe = MoEConfig(
        n_experts=n_experts, top_k=hf["num_experts_per_tok"], d_expert=hf["moe_intermediate_size"],
        normalize_top_k=bool(hf["norm_topk_prob"]), every=layout[0], first_dense=layout[1],
    )
    return llama_layout_config(hf, qk_norm="head", moe=moe).replace(attention=qwen3_moe_attention(hf))


def qwen3_moe_ffn(cfg: ModelConfig, t: HFTensors, hf: str, ours: str) -> dict[str, torch.Tensor | None]:
    if not cfg.is_moe_layer(int(ours.split(".")[1])):
        return llama_glu(cfg, t, hf, ours)
    return moe_weights(cfg, t, hf, ours, names=("gate_proj", "up_proj", "down_proj"))


def qwen3_moe_weights(cfg: ModelConfig, t: HFTensors) -> dict[str, torch.Tensor | None]:
    if cfg.moe is None or cfg.qk_norm != "head":
        raise ValueError("a Qwen3-MoE checkpoint needs a config with moe set and qk_norm='head'")
    return {**llama_weights(cfg, t, ffn=qwen3_moe_ffn), **qk_norm_weights(cfg, t)}


def qwen3_moe_refusal(cfg: ModelConfig) -> str | None:
    return moe_refusal(cfg, "Qwen3-MoE", {
        "qkv_bias": (False, "Qwen3-MoE has no q, k, v biases"),
        "moe.scoring": ("softmax", "Qwen3-MoE's router is a softmax"),
        "moe.routed_scale": (1.0, "Qwen3-MoE does not scale the routed output"),
        "moe.n_shared": (0, "Qwen3-MoE has no shared experts"),
    }, qk_norm="head") or all_experts_refusal(cfg, "Qwen3-MoE") or every_layer_window_refusal(
        cfg, "Qwen3-MoE")


def qwen3_moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    step, dense = qwen2_moe_layers(cfg)
    return {
        **llama_layout_to_hf(cfg), **qwen3_attention_to_hf(cfg), "num_experts": moe.routed_experts,
        "num_experts_per_tok": moe.active_experts, "moe_intermediate_size": moe.expert_width(cfg.d_ff),
        "norm_topk_prob": moe.normalize_top_k, "decoder_sparse_step": step, "mlp_only_layers": dense,
        "output_router_logits": False,
    }


def qwen3_moe_ffn_to_hf(cfg: ModelConfig, sd: Tensors, ours: str, hf: str) -> dict[str, torch.Tensor]:
    if not cfg.is_moe_layer(int(ours.split(".")[1])):
        return llama_glu_to_hf(cfg, sd, ours, hf)
    return moe_to_hf(cfg, sd, ours, hf, names=("gate_proj", "up_proj", "down_proj"), arch="Qwen3-MoE")


def qwen3_moe_weights_to_hf(cfg: ModelConfig, sd: Tensors) -> dict[str, torch.Tensor]:
    return {**llama_weights_to_hf(cfg, sd, ffn=qwen3_moe_ffn_to_hf), **qk_norm_to_hf(cfg, sd)}


register("qwen3_moe", Family(qwen3_moe_config, qwen3_moe_weights, LLAMA_IGNORE, Export(
    "Qwen3MoeForCausalLM", moe=True, refuse=qwen3_moe_refusal, config=qwen3_moe_to_hf,
    weights=qwen3_moe_weights_to_hf, name="Qwen3-MoE", computes={
        **LLAMA_LAYOUT, **WINDOWS, **ALL_EXPERTS, "qk_norm": ("head",),
        **dict.fromkeys(("moe.normalize_top_k", "moe.every", "moe.first_dense"), ANY),
    },
)))
