"""DeepSeek-V3.2 and GLM-4-MoE-Lite, both ways: DeepSeek-V3's multi-head latent attention and router under newer
names (``deepseek.py`` holds V2's and V3's mapping, reused here).

- ``deepseek_v32`` (DeepSeek-V3.2-Exp): V3 with DeepSeek Sparse Attention (``lmlab.sparse_attention``, the ``dsa``
  variant): each MLA layer's lightning indexer (``self_attn.indexer.{wq_b, wk, k_norm, weights_proj}``) picks the
  ``index_topk`` keys each query attends to. Its MLA always rotates interleaved pairs (transformers' DeepseekV32 has
  no ``rope_interleave``), its indexer the half layout; queries always go through ``q_lora_rank``. Which layers are
  dense is ``mlp_layer_types`` (derived from ``first_k_dense_replace`` when unset).
- ``glm4_moe_lite`` (GLM-4.7-Flash): DeepSeek-V3's attention (``rope_interleave``, as V3) and GLM-4-MoE's router,
  which is V3's; ``mlp_layer_types`` (default: the first layer dense) says which layers are mixtures; rotary on
  all of MLA's qk_rope_head_dim dimensions (a ``partial_rotary_factor`` is refused). lmlab's latent-attention
  models export as DeepSeek-V2 or V3 first; as GLM-4-MoE-Lite when asked (``architecture="glm4_moe_lite"``).

Both: dense layers first, then a mixture in every layer (``mlp_layer_types`` of another shape is refused); the
multi-token-prediction layers V3.2 checkpoints hold after the last layer are set aside, as transformers' model
sets them aside (lmlab's dsa variant has no MTP).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..config import DSAConfig, ModelConfig
from .deepseek import (
    DEEPSEEK,
    DEEPSEEK_IGNORE,
    DEEPSEEK_V3_FULL_DEFAULTS,
    deepseek_layer,
    deepseek_layer_to_hf,
    deepseek_layout_config,
    deepseek_v3_refusal,
    deepseek_v3_to_hf,
    mtp_tensors,
)
from .moe import deepseek_v3_moe
from .registry import ANY, Export, Family, HFTensors, Tensors, key_refused, register, tied_head, with_defaults


# ============================================================== which layers are mixtures
def first_dense_from_hf(hf: Mapping[str, Any]) -> int:
    """The number of dense layers ``mlp_layer_types`` puts first (None: ``first_k_dense_replace``); a dense layer
    after a mixture is refused (lmlab's mixtures run from their first layer to the last)."""
    n, types = hf["num_hidden_layers"], hf.get("mlp_layer_types")
    if types is None:
        return min(hf["first_k_dense_replace"], n)
    if not isinstance(types, list) or len(types) != n or any(t not in ("dense", "sparse") for t in types):
        raise key_refused(hf, "mlp_layer_types", f"it must list 'dense' or 'sparse' for each of the {n} layers")
    k = types.count("dense")
    if types != ["dense"] * k + ["sparse"] * (n - k):
        raise key_refused(hf, "mlp_layer_types", "lmlab's mixture-of-experts layers run from the first sparse layer "
                          "to the last, so every dense layer must come before them")
    return k


def mlp_layer_types_to_hf(cfg: ModelConfig) -> list[str]:
    return ["sparse" if cfg.is_moe_layer(i) else "dense" for i in range(cfg.n_layers)]


def mla_family_config(hf: Mapping[str, Any], layout: str) -> ModelConfig:
    """DeepSeek-V3's attention and router with the dense layers ``mlp_layer_types`` says."""
    hf = {**hf, "first_k_dense_replace": first_dense_from_hf(hf)}
    return deepseek_layout_config(hf, moe=deepseek_v3_moe(hf), layout=layout)


def mla_family_weights(cfg: ModelConfig, t: HFTensors, layer_extra=None) -> dict[str, torch.Tensor | None]:
    """DeepSeek-V3's tensor names, each layer with ``layer_extra(t, hf, ours)``'s tensors too (V3.2's indexer)."""
    mtp_tensors(cfg, t)  # MTP layers past the last: set aside, as transformers' main model does
    sd = {"embed.weight": t.take("model.embed_tokens.weight")}
    for i in range(cfg.n_layers):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        sd.update(deepseek_layer(cfg, t, i, hf, ours))
        if layer_extra is not None:
            sd.update(layer_extra(t, f"{hf}self_attn.", f"{ours}attn."))
    sd["final_norm.weight"] = t.take("model.norm.weight")
    sd["head.weight"] = tied_head(cfg, t, "lm_head.weight", sd["embed.weight"])
    return sd


def mla_family_weights_to_hf(cfg: ModelConfig, sd: Tensors, layer_extra=None, *,
                             interleaved: bool = True) -> dict[str, torch.Tensor]:
    """The inverse of :func:`mla_family_weights`; MLA's rotary rows permuted into the interleaved layout where the
    family turns only that (``interleaved``) and the model holds the half layout."""
    out = {"model.embed_tokens.weight": sd["embed.weight"]}
    for i in range(cfg.n_layers):
        ours, hf = f"blocks.{i}.", f"model.layers.{i}."
        out.update(deepseek_layer_to_hf(cfg, sd, i, ours, hf, interleaved=interleaved))
        if layer_extra is not None:
            out.update(layer_extra(sd, f"{ours}attn.", f"{hf}self_attn."))
    out["model.norm.weight"] = sd["final_norm.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["head.weight"]
    return out


def mla_family_to_hf(cfg: ModelConfig, drop: tuple[str, ...]) -> dict[str, Any]:
    """DeepSeek-V3's config.json keys but those the family's config has not (``drop``), with ``mlp_layer_types``."""
    keys = {k: v for k, v in deepseek_v3_to_hf(cfg).items() if k not in drop}
    return {**keys, "mlp_layer_types": mlp_layer_types_to_hf(cfg)}


# ============================================================== DeepSeek-V3.2
# transformers' DeepseekV32Config defaults (5.x), for keys an older config.json leaves out
DEEPSEEK_V32_DEFAULTS: dict[str, Any] = dict(
    {k: v for k, v in DEEPSEEK_V3_FULL_DEFAULTS.items() if k != "rope_interleave"}, max_position_embeddings=163840,
    index_topk=2048, index_head_dim=128, index_n_heads=64, mlp_layer_types=None,
)
# the indexer's tensors: lmlab name under attn. -> transformers' under self_attn.
INDEXER = {"indexer.q.weight": "indexer.wq_b.weight", "indexer.k.weight": "indexer.wk.weight",
           "indexer.k_norm.weight": "indexer.k_norm.weight", "indexer.k_norm.bias": "indexer.k_norm.bias",
           "indexer.weights.weight": "indexer.weights_proj.weight"}


def deepseek_v32_config(hf: Mapping[str, Any]) -> ModelConfig:
    """DeepSeek-V3.2: V3 with the lightning indexer's sparse attention in every layer."""
    hf = with_defaults(hf, DEEPSEEK_V32_DEFAULTS)
    if not hf["q_lora_rank"]:
        raise key_refused(hf, "q_lora_rank", "DeepSeek-V3.2's indexer reads the query latent; transformers' "
                          "DeepseekV32 always compresses queries")
    types = hf.get("layer_types")
    if types is not None and set(types) != {"indexed_attention"}:
        raise key_refused(hf, "layer_types", "every DeepSeek-V3.2 layer is 'indexed_attention' (sparse)")
    cfg = mla_family_config(hf, layout="interleaved")
    try:
        return cfg.replace(dsa=DSAConfig(indexer_heads=hf["index_n_heads"], indexer_head_dim=hf["index_head_dim"],
                                         topk=hf["index_topk"]))
    except (ValueError, TypeError) as e:
        raise ValueError(f"config.json (model_type {hf.get('model_type')!r}) maps to an invalid lmlab config: {e}"
                         ) from None


def indexer_weights(t: HFTensors, hf: str, ours: str) -> dict[str, torch.Tensor | None]:
    return {f"{ours}{mine}": t.take(f"{hf}{theirs}") for mine, theirs in INDEXER.items()}


def indexer_to_hf(sd: Tensors, ours: str, hf: str) -> dict[str, torch.Tensor]:
    return {f"{hf}{theirs}": sd[f"{ours}{mine}"] for mine, theirs in INDEXER.items()}


def deepseek_v32_weights(cfg: ModelConfig, t: HFTensors) -> dict[str, torch.Tensor | None]:
    if cfg.attention_variant != "dsa":  # keeps detect_model_type from taking V3 checkpoints for V3.2
        raise ValueError("a DeepSeek-V3.2 checkpoint needs a config with attention.variant='dsa'")
    return mla_family_weights(cfg, t, indexer_weights)


def deepseek_v32_refusal(cfg: ModelConfig) -> str | None:
    if cfg.attention_variant != "dsa":
        return (f"attention.variant={cfg.attention_variant!r} (DeepSeek-V3.2's layers all attend through the lightning "
                "indexer: attention.variant='dsa')")
    return deepseek_v3_refusal(cfg)


def deepseek_v32_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """V3's keys, V3.2's indexer sizes, ``layer_types`` (every layer indexed) and ``head_dim`` (DeepseekV32Config
    sets it to qk_rope_head_dim, the rotary tables' width)."""
    dsa = cfg.dsa
    return {**mla_family_to_hf(cfg, drop=("rope_interleave", "num_nextn_predict_layers")),
            "index_n_heads": dsa.indexer_heads,
            "index_head_dim": dsa.indexer_head_dim, "index_topk": dsa.topk, "head_dim": cfg.mla.qk_rope_head_dim,
            "layer_types": ["indexed_attention"] * cfg.n_layers}


def deepseek_v32_weights_to_hf(cfg: ModelConfig, sd: Tensors) -> dict[str, torch.Tensor]:
    return mla_family_weights_to_hf(cfg, sd, indexer_to_hf)


register("deepseek_v32", Family(deepseek_v32_config, deepseek_v32_weights, DEEPSEEK_IGNORE, Export(
    "DeepseekV32ForCausalLM", moe=None, refuse=deepseek_v32_refusal, config=deepseek_v32_to_hf,
    weights=deepseek_v32_weights_to_hf, name="DeepSeek-V3.2",
    computes={**DEEPSEEK, "moe.scoring": ("sigmoid",), "moe.normalize_top_k": ANY, "dsa": ANY},
)))


# ============================================================== GLM-4-MoE-Lite
# transformers' Glm4MoeLiteConfig defaults (5.x)
GLM4_MOE_LITE_DEFAULTS: dict[str, Any] = dict(
    DEEPSEEK_V3_FULL_DEFAULTS, vocab_size=154880, hidden_size=2048, intermediate_size=10240,
    moe_intermediate_size=1536, num_hidden_layers=47, num_attention_heads=20, num_key_value_heads=20,
    n_routed_experts=64, routed_scaling_factor=1.8, q_lora_rank=768, v_head_dim=256, qk_nope_head_dim=192, n_group=1,
    topk_group=1, num_experts_per_tok=4, max_position_embeddings=202752, rms_norm_eps=1e-5, mlp_layer_types=None,
    first_k_dense_replace=1,  # Glm4MoeLiteConfig makes the first layer dense where mlp_layer_types is unset
)


def glm4_moe_lite_config(hf: Mapping[str, Any]) -> ModelConfig:
    """GLM-4-MoE-Lite: DeepSeek-V3's attention and router. Its rotary tables are qk_rope_head_dim (its
    ``head_dim``) times ``partial_rotary_factor`` wide, so a factor other than 1 is refused: MLA turns all
    qk_rope_head_dim dimensions."""
    hf = with_defaults(hf, GLM4_MOE_LITE_DEFAULTS)
    params = hf.get("rope_parameters") or {}
    fraction = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if fraction not in (None, 1, 1.0):
        raise key_refused(hf, "partial_rotary_factor", "MLA turns every one of its qk_rope_head_dim rotary dimensions")
    return mla_family_config(hf, layout="interleaved" if hf["rope_interleave"] else "half")


def glm4_moe_lite_weights(cfg: ModelConfig, t: HFTensors) -> dict[str, torch.Tensor | None]:
    if cfg.attention_variant != "mla":
        raise ValueError(f"a GLM-4-MoE-Lite checkpoint needs attention.variant='mla', not {cfg.attention_variant!r}")
    return mla_family_weights(cfg, t)


def glm4_moe_lite_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """DeepSeek-V3's keys with ``rope_interleave`` and ``mlp_layer_types``."""
    return {**mla_family_to_hf(cfg, drop=("num_nextn_predict_layers", "first_k_dense_replace")),
            "rope_interleave": cfg.rope.layout == "interleaved"}


def glm4_moe_lite_weights_to_hf(cfg: ModelConfig, sd: Tensors) -> dict[str, torch.Tensor]:
    """As stored: GLM-4-MoE-Lite turns either layout (``rope_interleave``)."""
    return mla_family_weights_to_hf(cfg, sd, interleaved=cfg.rope.layout == "interleaved")


register("glm4_moe_lite", Family(glm4_moe_lite_config, glm4_moe_lite_weights, DEEPSEEK_IGNORE, Export(
    "Glm4MoeLiteForCausalLM", moe=None, refuse=deepseek_v3_refusal, config=glm4_moe_lite_to_hf,
    weights=glm4_moe_lite_weights_to_hf, name="GLM-4-MoE-Lite",
    computes={**DEEPSEEK, "moe.scoring": ("sigmoid",), "moe.normalize_top_k": ANY},
)))
