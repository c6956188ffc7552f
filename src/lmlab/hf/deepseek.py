"""Hugging Face DeepSeek-V2 and DeepSeek-V3 checkpoints, both ways: multi-head latent attention
(``lmlab.mla``) with DeepSeek's mixture-of-experts layers.

Registers ``deepseek_v2`` and ``deepseek_v3`` in :data:`lmlab.hf.FAMILIES`. The two share their
tensor names; they differ in the router and in the rotary layout:

- DeepSeek-V2 (arXiv:2405.04434): softmax affinities, top-k over all experts (``greedy``) or
  within the ``topk_group`` best of ``n_group`` groups, a group scored by its best expert
  (``group_limited_greedy``), weights not renormalized, times ``routed_scaling_factor``; the rotary
  dimensions turn as interleaved pairs (transformers multiplies complex numbers);
- DeepSeek-V3 (arXiv:2412.19437): sigmoid affinities plus the selection-only correction bias,
  group-limited with a group scored by its best two, renormalized, times ``routed_scaling_factor``
  (``lmlab.hf.moe.deepseek_v3_moe``); interleaved pairs where ``rope_interleave`` (the default),
  else the half layout.

Both: the first ``first_k_dense_replace`` layers dense, ``n_shared_experts`` shared experts of
``moe_intermediate_size`` each, pre-norm RMSNorm, SwiGLU, no biases (``attention_bias`` and V2's
``mlp_bias`` are refused). Every head has its own keys, so ``num_key_value_heads`` must equal
``num_attention_heads``.

Multi-token prediction: DeepSeek-V3 checkpoints on the Hub hold ``num_nextn_predict_layers`` extra
layers after the last decoder layer (``model.layers.{n_layers}.*``, the table in ``lmlab.mtp``), which
transformers' main model ignores (its ``MtpModel`` reads them for ``generate(use_mtp=True)``).
``from_hf`` loads them into lmlab's MTP modules where present (:func:`deepseek_v3_with_mtp` sets
``mtp.depth``), and ``to_hf`` writes them for a model with ``mtp``: one module (:func:`mtp_refusal`),
with the copies of the embedding and head the Hub checkpoints hold. A config without ``mtp`` sets
them aside (:func:`mtp_tensors`), so the main model loads alone.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

import torch

from ..config import MLAConfig, ModelConfig, MoEConfig, MTPConfig
from ..mtp import checkpoint_prefixes
from .dense import half_to_interleaved, llama_glu, llama_glu_to_hf
from .moe import DEEPSEEK_ROUTING, DEEPSEEK_V3_DEFAULTS, deepseek_v3_moe, glm4_moe_groups, moe_to_hf, moe_weights
from .registry import (
    ACTIVATION_NAMES,
    ANY,
    ROTARY,
    Export,
    Family,
    HFTensors,
    Tensors,
    activation_from_hf,
    key_refused,
    model_config,
    refusal,
    register,
    rope_from_hf,
    rope_refusal,
    rope_to_hf,
    tied_head,
    with_defaults,
)

# transformers' DeepseekV2Config defaults (5.x), for keys an older config.json leaves out.
DEEPSEEK_V2_DEFAULTS: dict[str, Any] = dict(
    vocab_size=102400, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048, initializer_range=0.02,
    rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, mlp_bias=False, first_k_dense_replace=0,
    kv_lora_rank=512, q_lora_rank=1536, n_group=None, n_routed_experts=64, n_shared_experts=2, qk_nope_head_dim=128,
    qk_rope_head_dim=64, routed_scaling_factor=1.0, topk_group=None, topk_method="greedy", norm_topk_prob=False,
    v_head_dim=128, num_experts_per_tok=None, moe_intermediate_size=1407,
)
# ... and DeepseekV3Config's, the MoE ones included.
DEEPSEEK_V3_FULL_DEFAULTS: dict[str, Any] = dict(
    DEEPSEEK_V3_DEFAULTS, vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
    num_attention_heads=128, num_key_value_heads=128, hidden_act="silu", max_position_embeddings=4096,
    initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
    qk_nope_head_dim=128, v_head_dim=128, rope_interleave=True,
)


# ============================================================== config.json -> ModelConfig
def mla_from_hf(hf: Mapping[str, Any]) -> MLAConfig:
    return MLAConfig(
        q_lora_rank=hf["q_lora_rank"] or None, kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
    )


def deepseek_layout_config(hf: Mapping[str, Any], *, moe: MoEConfig | None, layout: str) -> ModelConfig:
    """What DeepSeek-V2 and V3 map alike: sizes, MLA, pre-norm RMSNorm, rotary, SwiGLU, no biases."""
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise key_refused(hf, key, "lmlab maps DeepSeek checkpoints without biases, as DeepSeek released them")
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    if kv_heads not in (None, heads):
        raise key_refused(hf, "num_key_value_heads", f"MLA gives every head its own keys; use {heads} "
                      "(num_attention_heads), as DeepSeek's checkpoints do")
    if moe is not None and hf["first_k_dense_replace"] >= hf["num_hidden_layers"]:
        moe = None  # every layer is dense
    rope = rope_from_hf(hf).replace(layout=layout)
    return model_config(
        hf, vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=heads, d_ff=hf["intermediate_size"], max_seq_len=hf["max_position_embeddings"],
        norm="rmsnorm", norm_position="pre", positions="rope", ffn="glu",
        activation=activation_from_hf(hf["hidden_act"], "hidden_act"), rope=rope, bias=False,
        tie_embeddings=bool(hf["tie_word_embeddings"]), norm_eps=hf["rms_norm_eps"],
        init_std=hf["initializer_range"], moe=moe, mla=mla_from_hf(hf),
    )


def deepseek_v2_moe(hf: Mapping[str, Any]) -> MoEConfig:
    """The MoE part of a DeepSeek-V2 config.json, as transformers' DeepseekV2 routes: softmax over all
    experts, the top-k taken over all (``greedy``) or within the best groups (``group_limited_greedy``,
    sec. 2.2.2), never renormalized, times routed_scaling_factor."""
    if hf.get("scoring_func", "softmax") != "softmax":
        raise key_refused(hf, "scoring_func", "DeepSeek-V2 scores experts with a softmax; lmlab maps only that")
    method = hf["topk_method"]
    if method not in ("greedy", "group_limited_greedy"):
        raise key_refused(hf, "topk_method", "transformers' DeepseekV2 routes with 'greedy' or 'group_limited_greedy'")
    if hf["norm_topk_prob"]:
        raise key_refused(hf, "norm_topk_prob", "transformers' DeepseekV2 never renormalizes the chosen weights "
                      "(DeepSeek's own code does), so the two disagree; only false maps")
    if hf.get("moe_layer_freq", 1) != 1:
        raise key_refused(hf, "moe_layer_freq", "transformers' DeepseekV2 makes every layer after the dense ones MoE")
    if not hf["num_experts_per_tok"]:
        raise key_refused(hf, "num_experts_per_tok", "a DeepSeek-V2 MoE layer needs the number of experts per token")
    groups = (hf["n_group"] or 1) if method == "group_limited_greedy" else 1
    return MoEConfig(
        n_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"], d_expert=hf["moe_intermediate_size"],
        n_shared=hf["n_shared_experts"] or 0, scoring="softmax", normalize_top_k=False,
        routed_scale=hf["routed_scaling_factor"], n_groups=groups,
        topk_groups=(hf["topk_group"] or groups) if groups > 1 else None, group_score="max",
        first_dense=hf["first_k_dense_replace"],
    )


def deepseek_v2_config(hf: Mapping[str, Any]) -> ModelConfig:
    """DeepSeek-V2 (and V2-Lite, whose queries are not compressed: q_lora_rank null)."""
    hf = with_defaults(hf, DEEPSEEK_V2_DEFAULTS)
    return deepseek_layout_config(hf, moe=deepseek_v2_moe(hf), layout="interleaved")


def deepseek_v3_config(hf: Mapping[str, Any]) -> ModelConfig:
    """DeepSeek-V3 (and R1): V2's attention with V3's router."""
    hf = with_defaults(hf, DEEPSEEK_V3_FULL_DEFAULTS)
    layout = "interleaved" if hf["rope_interleave"] else "half"
    return deepseek_layout_config(hf, moe=deepseek_v3_moe(hf), layout=layout)


# ============================================================== tensors -> state dict
def mla_weights(cfg: ModelConfig, t: HFTensors, hf: str, ours: str) -> dict[str, torch.Tensor | None]:
    """One MLA layer under ``hf`` ("model.layers.3.self_attn.") -> lmlab's ``ours`` ("blocks.3.attn.")."""
    names = {"kv_down": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "kv_up": "kv_b_proj", "out": "o_proj"}
    if cfg.mla.q_lora_rank is None:
        names["q"] = "q_proj"
    else:
        names.update({"q.down": "q_a_proj", "q.norm": "q_a_layernorm", "q.up": "q_b_proj"})
    return {f"{ours}{mine}.weight": t.take(f"{hf}{theirs}.weight") for mine, theirs in names.items()}


def deepseek_layer(cfg: ModelConfig, t: HFTensors, layer: int, hf: str, ours: str) -> dict[str, torch.Tensor | None]:
    """Decoder layer ``layer`` under ``hf`` ("model.layers.3.") -> lmlab's block under ``ours`` ("blocks.3.")."""
    sd = {f"{ours}norm1.weight": t.take(f"{hf}input_layernorm.weight"),
          f"{ours}norm2.weight": t.take(f"{hf}post_attention_layernorm.weight")}
    sd.update(mla_weights(cfg, t, f"{hf}self_attn.", f"{ours}attn."))
    if not cfg.is_moe_layer(layer):
        return sd | llama_glu(cfg, t, f"{hf}mlp.", f"{ours}ffn.")
    return sd | moe_weights(
        cfg, t, f"{hf}mlp.", f"{ours}ffn.", names=("gate_proj", "up_proj", "down_proj"),
        shared="shared_experts" if cfg.moe.n_shared else None,
        score_bias="gate.e_score_correction_bias" if cfg.moe.scoring == "sigmoid" else None,
    )


def mtp_tensors(cfg: ModelConfig, t: HFTensors) -> dict[str, torch.Tensor]:
    """The multi-token-prediction layers a DeepSeek-V3 checkpoint may hold after its last decoder layer
    (``model.layers.{n_layers + k}.*``) that ``cfg`` has no MTP module for: set aside, so they are neither
    weights of the main model nor reported as unexpected (transformers' main model ignores them too)."""
    aside = {}
    for name in t.tensors:
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        if layer and int(layer.group(1)) >= cfg.n_layers + (cfg.mtp.depth if cfg.mtp else 0):
            t.taken.add(name)
            aside[name] = t.tensors[name]
    return aside


def mtp_depth_in(hf: Mapping[str, Any], n_layers: int, names: Iterable[str]) -> int:
    """How many MTP layers a DeepSeek-V3 checkpoint holds (``model.layers.{n_layers + k}.eh_proj``, k = 0, 1, ..)."""
    names = set(names)
    depth = 0
    while f"model.layers.{n_layers + depth}.eh_proj.weight" in names:
        depth += 1
    return depth


def deepseek_v3_with_mtp(cfg: ModelConfig, hf: Mapping[str, Any], names: Iterable[str]) -> ModelConfig:
    """``cfg`` with ``mtp`` set where the checkpoint holds its MTP layers (config.json's
    ``num_nextn_predict_layers`` says how many were trained; a checkpoint saved by transformers holds none,
    and then the model has none, as in transformers)."""
    depth = mtp_depth_in(hf, cfg.n_layers, names)
    if depth == 0:
        return cfg
    said = hf.get("num_nextn_predict_layers", 1)
    if depth != said:
        raise key_refused(hf, "num_nextn_predict_layers", f"the checkpoint holds {depth} MTP layers "
                          f"(model.layers.{cfg.n_layers}..{cfg.n_layers + depth - 1}); make the two agree")
    why = mtp_refusal(cfg.replace(mtp=MTPConfig(depth=depth)))
    if why is not None:
        raise ValueError(f"config.json (model_type {hf.get('model_type')!r}) with MTP layers maps to {why}; load "
                         "the main model alone with lmlab.hf.state_dict_from_hf and a config without mtp")
    return cfg.replace(mtp=MTPConfig(depth=depth))


def shared_copy(t: HFTensors, name: str, main: torch.Tensor | None, main_name: str) -> None:
    """Take ``name``, a DeepSeek MTP layer's copy of the main ``main_name``, refusing one that differs: lmlab's MTP
    modules share the main embedding and head (DeepSeek-V3 sec. 2.2), as transformers' MtpModel does."""
    copy = t.take(name)
    if copy is None or main is None or copy.is_meta or main.is_meta:
        return
    if copy.shape != main.shape or not torch.equal(copy, main):
        raise ValueError(f"{name} differs from {main_name}: lmlab's MTP modules share the main model's embedding "
                         "and head; load the main model alone with a config without mtp")


def mtp_weights(cfg: ModelConfig, t: HFTensors, embed: torch.Tensor | None,
                head: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    """The MTP layers ``model.layers.{n_layers + k}.*`` -> ``mtp.layers.{k}.*`` (``lmlab.mtp.checkpoint_prefixes``)."""
    sd: dict[str, torch.Tensor | None] = {}
    for ours, hf in checkpoint_prefixes(cfg.n_layers, cfg.mtp.depth if cfg.mtp else 0).items():
        if ours.endswith(".block"):
            sd.update(deepseek_layer(cfg, t, int(hf.split(".")[-1]), f"{hf}.", f"{ours}."))
            shared_copy(t, f"{hf}.embed_tokens.weight", embed, "model.embed_tokens.weight")
            shared_copy(t, f"{hf}.shared_head.head.weight", head, "lm_head.weight")
        else:
            sd[f"{ours}.weight"] = t.take(f"{hf}.weight")
    return sd


def deepseek_weights(cfg: ModelConfig, t: HFTensors) -> dict[str, torch.Tensor | None]:
    """DeepSeek-V2 and V3 checkpoints (one mapping: their names agree; V3's routers add a correction bias),
    with V3's MTP layers where ``cfg.mtp`` is set."""
    if cfg.attention_variant != "mla":  # e.g. detect_model_type trying this family on a config without MLA
        raise ValueError(f"a DeepSeek checkpoint needs attention.variant='mla' (multi-head latent attention), "
                         f"not {cfg.attention_variant!r}")
    mtp_tensors(cfg, t)
    sd = {"embed.weight": t.take("model.embed_tokens.weight")}
    for i in range(cfg.n_layers):
        sd.update(deepseek_layer(cfg, t, i, f"model.layers.{i}.", f"blocks.{i}."))
    sd["final_norm.weight"] = t.take("model.norm.weight")
    sd["head.weight"] = tied_head(cfg, t, "lm_head.weight", sd["embed.weight"])
    return sd | mtp_weights(cfg, t, sd["embed.weight"], sd["head.weight"])


# ============================================================== lmlab -> DeepSeek
def deepseek_refusal(cfg: ModelConfig, name: str, needs: Mapping[str, tuple[Any, str]]) -> str | None:
    """What DeepSeek architecture ``name`` cannot compute: no MLA, biases, the layout, the router ``needs``."""
    if cfg.mla is None:
        return f"mla=None ({name} uses multi-head latent attention)"
    why = refusal(cfg, {
        "bias": (False, f"{name} has no biases"), "qkv_bias": (False, f"{name} has no biases"),
        "norm": ("rmsnorm", f"{name} normalizes with RMSNorm"), "ffn": ("glu", f"{name}'s feed-forward is SwiGLU"),
        "norm_position": ("pre", f"{name} normalizes each sublayer's input"),
    }) or rope_refusal(cfg)
    if why is None and cfg.moe is not None:
        why = refusal(cfg, {"moe.every": (1, f"every {name} layer after the first dense ones is a mixture"),
                            "moe.shared_gate": ("none", f"{name}'s shared experts are not gated"), **needs})
        width = cfg.moe.expert_width(cfg.d_ff)
        if why is None and cfg.moe.n_shared * cfg.moe.shared_width(cfg.d_ff) % width:
            why = (f"moe.shared_d_ff={cfg.moe.shared_d_ff} ({name}'s shared experts are whole experts of "
                   f"moe_intermediate_size={width})")
    return why


def deepseek_v2_refusal(cfg: ModelConfig) -> str | None:
    why = deepseek_refusal(cfg, "DeepSeek-V2", {
        "moe.scoring": ("softmax", "DeepSeek-V2 scores experts with a softmax"),
        "moe.normalize_top_k": (False, "transformers' DeepseekV2 does not renormalize the chosen weights"),
    })
    moe = cfg.moe
    if why is None and moe is not None and moe.group_limited and moe.group_score != "max":
        why = f"moe.group_score={moe.group_score!r} (DeepSeek-V2 scores a group by its best expert)"
    return why


def mtp_refusal(cfg: ModelConfig) -> str | None:
    """What of ``cfg.mtp`` DeepSeek-V3's MTP layers cannot hold: they are mixture-of-experts layers, and one deep."""
    if cfg.mtp is None:
        return None
    if cfg.moe is None:
        return (f"mtp.depth={cfg.mtp.depth} with moe=None (DeepSeek-V3's MTP layer is a mixture-of-experts layer, "
                "as transformers' MtpModel builds it, and lmlab's MTP block of a dense model is dense)")
    if cfg.mtp.depth != 1:
        return (f"mtp.depth={cfg.mtp.depth} (DeepSeek-V3 trains one MTP module; past the first, transformers' "
                "MtpModel feeds the next module the normed state and DeepSeek's paper, vLLM and lmlab the block's "
                "output, so only mtp.depth 1 has one meaning)")
    return None


def deepseek_v3_refusal(cfg: ModelConfig) -> str | None:
    why = deepseek_refusal(cfg, "DeepSeek-V3", {
        "moe.scoring": ("sigmoid", "DeepSeek-V3 scores experts with a sigmoid"),
    }) or mtp_refusal(cfg)
    moe = cfg.moe
    if why is None and moe is not None and moe.group_limited and moe.group_score != "top2":
        why = f"moe.group_score={moe.group_score!r} (DeepSeek-V3 scores a group by its best two experts)"
    if why is None and moe is not None and not moe.group_limited and moe.routed_experts < 2:
        why = f"moe.n_experts={moe.n_experts} (DeepSeek-V3's router needs at least two experts)"
    return why


def deepseek_layout_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """config.json keys DeepSeek-V2 and V3 write alike. A dense model is one whose every layer is among
    the first_k_dense_replace dense ones."""
    m, moe = cfg.mla, cfg.moe
    keys = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_heads,
        hidden_act=ACTIVATION_NAMES[cfg.activation], max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False, attention_dropout=0.0, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
        first_k_dense_replace=cfg.n_layers if moe is None else moe.first_dense, output_router_logits=False,
        **rope_to_hf(cfg),
    )
    if moe is not None:
        width = moe.expert_width(cfg.d_ff)
        keys.update(n_routed_experts=moe.routed_experts, num_experts_per_tok=moe.active_experts,
                    moe_intermediate_size=width, n_shared_experts=moe.n_shared * moe.shared_width(cfg.d_ff) // width,
                    routed_scaling_factor=moe.routed_scale, norm_topk_prob=moe.normalize_top_k)
    return keys


def deepseek_v2_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    moe, keys = cfg.moe, {**deepseek_layout_to_hf(cfg), "mlp_bias": False}
    if moe is not None and moe.group_limited:
        keys.update(topk_method="group_limited_greedy", n_group=moe.n_groups, topk_group=moe.topk_groups)
    elif moe is not None:
        keys.update(topk_method="greedy", n_group=None, topk_group=None)
    return keys


def deepseek_v3_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """V3's router always ranks groups by their best two: without group limits, groups that keep every
    expert (as ``moe.glm4_moe_groups``). ``num_nextn_predict_layers``: the MTP layers written (0 without mtp)."""
    keys = {**deepseek_layout_to_hf(cfg), "rope_interleave": cfg.rope.layout == "interleaved",
            "num_nextn_predict_layers": cfg.mtp.depth if cfg.mtp else 0}
    if cfg.moe is not None:
        n_group, topk_group = glm4_moe_groups(cfg.moe)
        keys.update(n_group=n_group, topk_group=topk_group)
    return keys


def rope_rows_to(convert, w: torch.Tensor, n_heads: int, n_rows: int, r: int) -> torch.Tensor:
    """``w`` with the last ``r`` of every ``n_rows`` rows per head (the rotary rows) converted between layouts."""
    w = w.reshape(n_heads, n_rows, *w.shape[1:]).clone()
    w[:, n_rows - r:] = convert(w[:, n_rows - r:].reshape(n_heads * r, *w.shape[2:]), n_heads).view_as(
        w[:, n_rows - r:])
    return w.reshape(n_heads * n_rows, *w.shape[2:])


def mla_to_hf(cfg: ModelConfig, sd: Tensors, ours: str, hf: str, *, interleaved: bool) -> dict[str, torch.Tensor]:
    """The inverse of :func:`mla_weights`; a half-layout model leaving as an interleaved-only architecture
    (DeepSeek-V2) has its rotary rows permuted (q's last qk_rope_head_dim rows of each head, and the
    shared rotary key's rows of ``kv_down``)."""
    m = cfg.mla
    names = {"kv_down": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "kv_up": "kv_b_proj", "out": "o_proj"}
    if m.q_lora_rank is None:
        names["q"] = "q_proj"
    else:
        names.update({"q.down": "q_a_proj", "q.norm": "q_a_layernorm", "q.up": "q_b_proj"})
    out = {f"{hf}{theirs}.weight": sd[f"{ours}{mine}.weight"] for mine, theirs in names.items()}
    if interleaved and cfg.rope.layout == "half":
        q = f"{hf}q_proj.weight" if m.q_lora_rank is None else f"{hf}q_b_proj.weight"
        out[q] = rope_rows_to(half_to_interleaved, out[q], cfg.n_heads, m.qk_head_dim, m.qk_rope_head_dim)
        kv = f"{hf}kv_a_proj_with_mqa.weight"
        out[kv] = rope_rows_to(half_to_interleaved, out[kv], 1, m.kv_lora_rank + m.qk_rope_head_dim,
                               m.qk_rope_head_dim)
    return out


def deepseek_layer_to_hf(cfg: ModelConfig, sd: Tensors, layer: int, ours: str, hf: str, *,
                         interleaved: bool) -> dict[str, torch.Tensor]:
    """The inverse of :func:`deepseek_layer`, one tensor per expert (the Hub layout)."""
    out = {f"{hf}input_layernorm.weight": sd[f"{ours}norm1.weight"],
           f"{hf}post_attention_layernorm.weight": sd[f"{ours}norm2.weight"]}
    out.update(mla_to_hf(cfg, sd, f"{ours}attn.", f"{hf}self_attn.", interleaved=interleaved))
    if not cfg.is_moe_layer(layer):
        return out | llama_glu_to_hf(cfg, sd, f"{ours}ffn.", f"{hf}mlp.")
    sigmoid = cfg.moe.scoring == "sigmoid"
    return out | moe_to_hf(
        cfg, sd, f"{ours}ffn.", f"{hf}mlp.", names=("gate_proj", "up_proj", "down_proj"),
        arch="DeepSeek-V3" if sigmoid else "DeepSeek-V2", shared="shared_experts" if cfg.moe.n_shared else None,
        score_bias="gate.e_score_correction_bias" if sigmoid else None,
    )


def mtp_to_hf(cfg: ModelConfig, sd: Tensors, *, interleaved: bool) -> dict[str, torch.Tensor]:
    """The inverse of :func:`mtp_weights`: each MTP layer with its copies of the embedding and the head, as
    DeepSeek-V3's checkpoints hold them (transformers' MtpModel reads the shared ones from the main model)."""
    out = {}
    for ours, hf in checkpoint_prefixes(cfg.n_layers, cfg.mtp.depth if cfg.mtp else 0).items():
        if not ours.endswith(".block"):
            out[f"{hf}.weight"] = sd[f"{ours}.weight"]
            continue
        out.update(deepseek_layer_to_hf(cfg, sd, int(hf.split(".")[-1]), f"{ours}.", f"{hf}.",
                                        interleaved=interleaved))
        out[f"{hf}.embed_tokens.weight"] = sd["embed.weight"]
        out[f"{hf}.shared_head.head.weight"] = sd["head.weight"]
    return out


def deepseek_weights_to_hf(cfg: ModelConfig, sd: Tensors, *, interleaved: bool) -> dict[str, torch.Tensor]:
    """The inverse of :func:`deepseek_weights`, one tensor per expert (the Hub layout)."""
    out = {"model.embed_tokens.weight": sd["embed.weight"]}
    for i in range(cfg.n_layers):
        out.update(deepseek_layer_to_hf(cfg, sd, i, f"blocks.{i}.", f"model.layers.{i}.", interleaved=interleaved))
    out["model.norm.weight"] = sd["final_norm.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["head.weight"]
    return out | mtp_to_hf(cfg, sd, interleaved=interleaved)


def deepseek_v2_weights_to_hf(cfg: ModelConfig, sd: Tensors) -> dict[str, torch.Tensor]:
    return deepseek_weights_to_hf(cfg, sd, interleaved=True)


def deepseek_v3_weights_to_hf(cfg: ModelConfig, sd: Tensors) -> dict[str, torch.Tensor]:
    return deepseek_weights_to_hf(cfg, sd, interleaved=cfg.rope.layout == "interleaved")


DEEPSEEK_IGNORE = (r"\.rotary_emb\.inv_freq$",)
# what DeepSeek-V2 and V3 compute: latent attention of any size, rotary, any activation, DeepSeek's routing
DEEPSEEK: Mapping[str, Any] = {**ROTARY, "activation": tuple(ACTIVATION_NAMES), "mla": ANY, **DEEPSEEK_ROUTING}

register("deepseek_v2", Family(deepseek_v2_config, deepseek_weights, DEEPSEEK_IGNORE, Export(
    "DeepseekV2ForCausalLM", moe=None, refuse=deepseek_v2_refusal, config=deepseek_v2_to_hf,
    weights=deepseek_v2_weights_to_hf, name="DeepSeek-V2", computes={**DEEPSEEK, "moe.scoring": ("softmax",)},
)))
register("deepseek_v3", Family(deepseek_v3_config, deepseek_weights, DEEPSEEK_IGNORE, Export(
    "DeepseekV3ForCausalLM", moe=None, refuse=deepseek_v3_refusal, config=deepseek_v3_to_hf,
    weights=deepseek_v3_weights_to_hf, mtp=True, name="DeepSeek-V3",
    computes={**DEEPSEEK, "moe.scoring": ("sigmoid",), "moe.normalize_top_k": ANY, "mtp.depth": ANY},
), with_tensors=deepseek_v3_with_mtp))
