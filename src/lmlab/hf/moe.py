"""Hugging Face mixture-of-experts checkpoints: Mixtral, Qwen2-MoE, GLM-4-MoE, and DeepSeek-V3's MoE layers.

Registers three ``model_type`` families in :data:`lmlab.hf.FAMILIES`, on the Llama layout of
``dense.py`` with their own per-layer feed-forward part, all both ways. DeepSeek-V3's MoE layers
are mapped here (:func:`deepseek_v3_moe`) and its checkpoints, with multi-head latent attention, in
``deepseek.py``; lmlab's DeepSeek-V3-style layers with standard grouped-query attention (sigmoid
affinities, correction bias, group-limited top-k, routed scaling, shared experts, first layers
dense) leave as GLM-4-MoE, which computes the same router and experts. Expert weights are read in either
published layout, and written in the first, which every transformers version reads:

- per expert, as on the Hub and as ``save_pretrained`` writes them
  (Mixtral ``block_sparse_moe.experts.{j}.w1/w3/w2``, Qwen2-MoE and DeepSeek
  ``mlp.experts.{j}.gate_proj/up_proj/down_proj``);
- stacked, as transformers >= 5 holds them in memory (``mlp.experts.gate_up_proj`` (E, 2F, D),
  ``mlp.experts.down_proj`` (E, D, F)), which is lmlab's layout too.

Balancing coefficients are training choices, not part of a checkpoint: loaded models take lmlab's
default (the expert balance loss at 0.01, for training further; ``cfg.override({"moe.expert_balance_coef":
0})`` turns it off), and
exported configs leave ``router_aux_loss_coef`` at the transformers default with
``output_router_logits`` false. transformers' balance loss pools the router statistics of all
layers before multiplying them, which no lmlab coefficient reproduces, so neither is mapped.
Mixtral's ``router_jitter_noise`` (a training-time input noise lmlab lacks) is refused unless 0.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from ..config import AttentionConfig, ModelConfig, MoEConfig, RopeConfig
from .dense import (
    LLAMA_DEFAULTS,
    LLAMA_IGNORE,
    LLAMA_LAYOUT,
    WINDOWS,
    every_layer_window,
    every_layer_window_refusal,
    half_to_interleaved,
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
    rope_from_hf,
    with_defaults,
)


# ============================================================== shared pieces
def stacked_experts(t: HFTensors, prefix: str, n: int, gate: str, up: str, down: str) -> tuple:
    """(gate_up (E, 2F, D), down (E, D, F)) under ``prefix`` ("...mlp.experts."), stacked or per expert."""
    if f"{prefix}gate_up_proj" in t.tensors:
        return t.take(f"{prefix}gate_up_proj"), t.take(f"{prefix}down_proj")
    gate_up = [t.cat([f"{prefix}{j}.{gate}.weight", f"{prefix}{j}.{up}.weight"]) for j in range(n)]
    downs = [t.take(f"{prefix}{j}.{down}.weight") for j in range(n)]
    if any(w is None for w in gate_up + downs):
        return None, None
    return torch.stack(gate_up), torch.stack(downs)


def moe_weights(
    cfg: ModelConfig, t: HFTensors, hf: str, ours: str, *, names: tuple[str, str, str], shared: str | None = None,
    shared_gate: str | None = None, score_bias: str | None = None, router: str = "gate",
) -> dict[str, torch.Tensor | None]:
    """One MoE layer under HF prefix ``hf`` ("model.layers.3.mlp.") -> lmlab ``ours`` ("blocks.3.ffn."); ``router``:
    the router's module (HunYuan's is ``gate.wg``)."""
    if cfg.moe is None:  # e.g. detect_model_type trying this family on a dense config
        raise ValueError("a mixture-of-experts checkpoint needs a config with moe set")
    E = cfg.moe.routed_experts
    gate_up, down = stacked_experts(t, f"{hf}experts.", E, *names)
    sd = {
        f"{ours}router.weight": t.take(f"{hf}{router}.weight"),
        f"{ours}router.score_bias": t.take(f"{hf}{score_bias}") if score_bias else torch.zeros(E),
        f"{ours}experts.gate_up": gate_up,
        f"{ours}experts.down": down,
    }
    if shared is not None:
        glu = llama_glu(cfg.replace(bias=False), t, f"{hf}{shared}.", f"{ours}shared.")
        sd[f"{ours}shared.gate_up"] = _unsqueezed(glu[f"{ours}shared.gate_up.weight"])
        sd[f"{ours}shared.down"] = _unsqueezed(glu[f"{ours}shared.down.weight"])
    if shared_gate is not None:
        sd[f"{ours}shared.output_gate"] = t.take(f"{hf}{shared_gate}.weight")
    return sd


def _unsqueezed(w: torch.Tensor | None) -> torch.Tensor | None:
    return None if w is None else w.unsqueeze(0)  # one fused shared FFN, stored like a stack of 1


def _prefix_in_use(t: HFTensors, layer_prefix: str, options: tuple[str, ...]) -> str:
    """The first of ``options`` ("block_sparse_moe.", "mlp.") that this layer's tensors use."""
    return next((o for o in options if t.has_prefix(f"{layer_prefix}{o}")), options[-1])


def moe_to_hf(
    cfg: ModelConfig, sd: Tensors, ours: str, hf: str, *, names: tuple[str, str, str], arch: str,
    shared: str | None = None, shared_gate: str | None = None, score_bias: str | None = None, router: str = "gate",
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`moe_weights`: one MoE layer, one tensor per expert (the Hub layout).
    A non-zero selection bias where ``arch`` has none (``score_bias`` None) is refused."""
    gate, up, down = names
    out = {f"{hf}{router}.weight": sd[f"{ours}router.weight"]}
    bias = sd[f"{ours}router.score_bias"]
    if score_bias is not None:
        out[f"{hf}{score_bias}"] = bias
    elif bool(bias.any()):
        raise ValueError(
            f"{ours}router.score_bias is not zero (moe.bias_update_rate={cfg.moe.bias_update_rate} trained it): "
            f"{arch}'s router has no selection bias, so it cannot compute this model exactly"
        )
    for j, (gate_up_j, down_j) in enumerate(zip(sd[f"{ours}experts.gate_up"], sd[f"{ours}experts.down"])):
        g, u = gate_up_j.chunk(2)
        out.update({f"{hf}experts.{j}.{gate}.weight": g, f"{hf}experts.{j}.{up}.weight": u,
                    f"{hf}experts.{j}.{down}.weight": down_j})
    if shared is not None:  # one fused FFN, stored like a stack of 1
        fused = {f"{ours}shared.{part}.weight": sd[f"{ours}shared.{part}"][0] for part in ("gate_up", "down")}
        out.update(llama_glu_to_hf(cfg.replace(bias=False), fused, f"{ours}shared.", f"{hf}{shared}."))
    if shared_gate is not None:
        out[f"{hf}{shared_gate}.weight"] = sd[f"{ours}shared.output_gate"]
    return out


def moe_refusal(cfg: ModelConfig, name: str, needs: Mapping[str, tuple[Any, str]], **layout: Any) -> str | None:
    """What a Llama-layout MoE architecture ``name`` cannot compute: biases (no transformers MoE
    has expert biases), the layout (``layout``: its norm placement and query/key norm, as
    :func:`llama_layout_refusal` takes them), then the family's own router and layer ``needs``."""
    return (
        refusal(cfg, {"bias": (False, f"{name} has no biases outside attention")})
        or llama_layout_refusal(cfg, name, **layout)
        or refusal(cfg, needs)
    )


# what every mixture-of-experts architecture computes: the experts' number, width and segmentation, and the top-k
MOE_SIZES: Mapping[str, Any] = dict.fromkeys(("moe.n_experts", "moe.top_k", "moe.granularity", "moe.d_expert"), ANY)
# ... and one whose router ranks all experts at once: its groups, which (group-limited routing refused by
# all_experts_refusal) act only in the device balance loss
ALL_EXPERTS: Mapping[str, Any] = {**MOE_SIZES, "moe.n_groups": ANY, "moe.topk_groups": ANY,
                                  "moe.group_score": ("max", "top2")}
# DeepSeek-V3's router and shared experts, as GLM-4-MoE and DeepSeek hold them (their refusals check the rest)
DEEPSEEK_ROUTING: Mapping[str, Any] = {
    **MOE_SIZES, **dict.fromkeys(("moe.n_shared", "moe.shared_d_ff", "moe.routed_scale", "moe.first_dense",
                                  "moe.n_groups", "moe.topk_groups"), ANY), "moe.group_score": ("max", "top2"),
}


def all_experts_refusal(cfg: ModelConfig, name: str) -> str | None:
    """Group-limited routing, for an architecture ``name`` whose router ranks all experts at once."""
    moe = cfg.moe
    if moe.group_limited:
        return f"moe.topk_groups={moe.topk_groups} of moe.n_groups={moe.n_groups} ({name} routes among all experts)"
    return None


def _shared_total(cfg: ModelConfig) -> int:
    return cfg.moe.n_shared * cfg.moe.shared_width(cfg.d_ff)


# ============================================================== Mixtral
# transformers' MixtralConfig defaults (5.x), for keys an older config.json leaves out.
MIXTRAL_DEFAULTS: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=None, hidden_act="silu", max_position_embeddings=4096 * 32,
    initializer_range=0.02, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
    num_experts_per_tok=2, num_local_experts=8, router_jitter_noise=0.0,
)


def mixtral_config(hf: Mapping[str, Any]) -> ModelConfig:
    """Mixtral (Jiang et al. 2024): Mistral with every FFN a top-2 mixture of SwiGLU experts,
    softmax over all experts then renormalized over the two chosen."""
    hf = with_defaults(hf, MIXTRAL_DEFAULTS)
    if hf["router_jitter_noise"]:
        raise key_refused(hf, "router_jitter_noise", "lmlab's router has no multiplicative input jitter; use 0.0")
    return llama_layout_config(
        hf, default_theta=1e6,
        moe=MoEConfig(n_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"], normalize_top_k=True),
    ).replace(attention=every_layer_window(hf["sliding_window"]))  # transformers' Mixtral slides every layer


def mixtral_ffn(cfg: ModelConfig, t: HFTensors, hf: str, ours: str) -> dict[str, torch.Tensor | None]:
    layer = hf.removesuffix("mlp.")
    hf = layer + _prefix_in_use(t, layer, ("block_sparse_moe.", "mlp."))  # Hub files / transformers 5 memory
    return moe_weights(cfg, t, hf, ours, names=("w1", "w3", "w2"))


def mixtral_weights(cfg: ModelConfig, t: HFTensors) -> dict[str, torch.Tensor | None]:
    return llama_weights(cfg, t, ffn=mixtral_ffn)


def mixtral_refusal(cfg: ModelConfig) -> str | None:
    return moe_refusal(cfg, "Mixtral", {
        "qkv_bias": (False, "Mixtral has no biases"),
        "moe.scoring": ("softmax", "Mixtral's router is a softmax"),
        "moe.normalize_top_k": (True, "Mixtral renormalizes the chosen weights"),
        "moe.routed_scale": (1.0, "Mixtral does not scale the routed output"),
        "moe.n_shared": (0, "Mixtral has no shared experts"),
        "moe.every": (1, "every Mixtral layer is a mixture"),
        "moe.first_dense": (0, "every Mixtral layer is a mixture"),
    }) or all_experts_refusal(cfg, "Mixtral") or every_layer_window_refusal(cfg, "Mixtral")


def mixtral_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """Mixtral's intermediate_size is the expert width: every layer is a mixture, so lmlab's d_ff
    (the dense width) has no use there."""
    moe = cfg.moe
    return {
        **llama_layout_to_hf(cfg), "intermediate_size": moe.expert_width(cfg.d_ff),
        "num_local_experts": moe.routed_experts, "num_experts_per_tok": moe.active_experts,
        "router_jitter_noise": 0.0, "sliding_window": cfg.attention.window, "output_router_logits": False,
    }


def mixtral_ffn_to_hf(cfg: ModelConfig, sd: Tensors, ours: str, hf: str) -> dict[str, torch.Tensor]:
    hf = hf.removesuffix("mlp.") + "block_sparse_moe."
    return moe_to_hf(cfg, sd, ours, hf, names=("w1", "w3", "w2"), arch="Mixtral")


def mixtral_weights_to_hf(cfg: ModelConfig, sd: Tensors) -> dict[str, torch.Tensor]:
    return llama_weights_to_hf(cfg, sd, ffn=mixtral_ffn_to_hf)


register("mixtral", Family(mixtral_config, mixtral_weights, LLAMA_IGNORE, Export(
    "MixtralForCausalLM", moe=True, refuse=mixtral_refusal, config=mixtral_to_hf, weights=mixtral_weights_to_hf,
    name="Mixtral", computes={**LLAMA_LAYOUT, **WINDOWS, **ALL_EXPERTS, "moe.normalize_top_k": (True,)},
)))


# ============================================================== Qwen2-MoE
# transformers' Qwen2MoeConfig defaults (5.x).
QWEN2_MOE_DEFAULTS: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
    num_key_value_heads=16, hidden_act="silu", max_position_embeddings=32768, initializer_range=0.02,
    rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False, sliding_window=4096, max_window_layers=28,
    layer_types=None, decoder_sparse_step=1, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
    num_experts_per_tok=4, num_experts=60, norm_topk_prob=False, mlp_only_layers=None, qkv_bias=True,
)


def qwen2_moe_config(hf: Mapping[str, Any]) -> ModelConfig:
    """Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): fine-grained softmax-routed experts plus one shared
    expert whose output is gated per token by sigmoid(x·g)."""
    hf = with_defaults(hf, QWEN2_MOE_DEFAULTS)
    attention = qwen2_moe_attention(hf)
    if not hf["num_experts"]:
        raise key_refused(
            hf, "num_experts", "without experts this is a dense Llama-layout model; load it as model_type 'llama'"
        )
    moe = _qwen2_moe_experts(hf, hf["num_hidden_layers"])
    # biases on q, k, v only
    return llama_layout_config(hf, qkv_bias=bool(hf["qkv_bias"]), moe=moe).replace(attention=attention)


def qwen2_moe_attention(hf: Mapping[str, Any]) -> AttentionConfig:
    """Qwen2-MoE's windows as transformers applies them: the layers ``layer_types`` names, or (without it, and only
    with ``use_sliding_window``) every other layer from the first, below ``max_window_layers``, as Qwen2MoeConfig
    derives them (Qwen2's own rule slides the layers from max_window_layers on instead)."""
    types, slide = hf["layer_types"], bool(hf["use_sliding_window"])
    if types is None:
        types = ["sliding_attention" if slide and i % 2 == 0 and i < hf["max_window_layers"] else "full_attention"
                 for i in range(hf["num_hidden_layers"])]
    if not slide and "sliding_attention" in types:  # Qwen2MoeConfig sets sliding_window 0: those layers see no key
        raise key_refused(hf, "use_sliding_window", "layer_types has sliding_attention layers, which transformers "
                          "gives a window of 0 tokens without it; set use_sliding_window true (or those layers full)")
    return qwen_attention({**hf, "layer_types": types})


def _qwen2_moe_experts(hf: Mapping[str, Any], n_layers: int) -> MoEConfig:
    d_shared = hf["shared_expert_intermediate_size"]
    if not d_shared or d_shared <= 0:
        raise key_refused(
            hf,
            "shared_expert_intermediate_size",
            "lmlab maps Qwen2-MoE's gated shared expert only with a positive width",
        )
    # layer l is sparse iff l not in mlp_only_layers and (l + 1) % decoder_sparse_step == 0
    step, dense_only = hf["decoder_sparse_step"], set(hf["mlp_only_layers"] or ())
    sparse = [i not in dense_only and (i + 1) % step == 0 for i in range(n_layers)]
    layout = every_and_first_dense(sparse)
    if layout is None:
        raise key_refused(
            hf, "mlp_only_layers",
            f"with decoder_sparse_step={step} the MoE layers are {[i for i, s in enumerate(sparse) if s]}; lmlab "
            "expresses only 'every n-th layer after the first k'",
        )
    every, first_dense = layout
    return MoEConfig(  # one gated shared expert of its own width, as the checkpoint holds it
        n_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"], d_expert=hf["moe_intermediate_size"],
        n_shared=1, shared_d_ff=d_shared, shared_gate="sigmoid", normalize_top_k=bool(hf["norm_topk_prob"]),
        every=every, first_dense=first_dense,
    )


def every_and_first_dense(sparse: list[bool]) -> tuple[int, int] | None:
    """(moe.every, moe.first_dense) that make exactly the layers marked in ``sparse`` MoE, or None if no pair does."""
    L = len(sparse)
    for first in range(L):
        for every in range(1, L + 1):
            if [i >= first and (i - first) % every == 0 for i in range(L)] == sparse:
                return every, first
    return None


def qwen2_moe_ffn(cfg: ModelConfig, t: HFTensors, hf: str, ours: str) -> dict[str, torch.Tensor | None]:
    layer = int(ours.split(".")[1])
    if not cfg.is_moe_layer(layer):
        return llama_glu(cfg, t, hf, ours)
    return moe_weights(
        cfg, t, hf, ours, names=("gate_proj", "up_proj", "down_proj"), shared="shared_expert",
        shared_gate="shared_expert_gate",
    )


def qwen2_moe_weights(cfg: ModelConfig, t: HFTensors) -> dict[str, torch.Tensor | None]:
    if cfg.moe is None:  # a dense config is Llama's layout; refusing keeps detect_model_type unambiguous
        raise ValueError("a Qwen2-MoE checkpoint needs a config with moe set")
    return llama_weights(cfg, t, ffn=qwen2_moe_ffn)


def qwen2_moe_refusal(cfg: ModelConfig) -> str | None:
    if cfg.moe.n_shared == 0:
        return "moe.n_shared=0 (Qwen2-MoE always has a gated shared expert)"
    return moe_refusal(cfg, "Qwen2-MoE", {
        "moe.scoring": ("softmax", "Qwen2-MoE's router is a softmax"),
        "moe.routed_scale": (1.0, "Qwen2-MoE does not scale the routed output"),
        "moe.shared_gate": ("sigmoid", "Qwen2-MoE gates its shared expert by sigmoid(x·g)"),
    }) or all_experts_refusal(cfg, "Qwen2-MoE")


def qwen2_moe_layers(cfg: ModelConfig) -> tuple[int, list[int]]:
    """(decoder_sparse_step, mlp_only_layers) that make exactly lmlab's MoE layers sparse: the step
    is ``moe.every`` where its layers cover them, else 1, and the other layers are listed dense."""
    L = cfg.n_layers
    sparse = [cfg.is_moe_layer(i) for i in range(L)]
    for step in dict.fromkeys((cfg.moe.every, 1)):
        stepped = [(i + 1) % step == 0 for i in range(L)]
        if all(t or not s for s, t in zip(sparse, stepped)):
            return step, [i for i in range(L) if stepped[i] and not sparse[i]]
    raise AssertionError("step 1 covers every layer")


def qwen2_moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    step, dense = qwen2_moe_layers(cfg)
    return {
        **llama_layout_to_hf(cfg), "qkv_bias": cfg.qkv_bias, "num_experts": moe.routed_experts,
        "num_experts_per_tok": moe.active_experts, "moe_intermediate_size": moe.expert_width(cfg.d_ff),
        "shared_expert_intermediate_size": _shared_total(cfg), "norm_topk_prob": moe.normalize_top_k,
        "decoder_sparse_step": step, "mlp_only_layers": dense, **qwen_attention_to_hf(cfg),
        "output_router_logits": False,
    }


def qwen2_moe_ffn_to_hf(cfg: ModelConfig, sd: Tensors, ours: str, hf: str) -> dict[str, torch.Tensor]:
    if not cfg.is_moe_layer(int(ours.split(".")[1])):
        return llama_glu_to_hf(cfg, sd, ours, hf)
    return moe_to_hf(
        cfg, sd, ours, hf, names=("gate_proj", "up_proj", "down_proj"), arch="Qwen2-MoE", shared="shared_expert",
        shared_gate="shared_expert_gate",
    )


def qwen2_moe_weights_to_hf(cfg: ModelConfig, sd: Tensors) -> dict[str, torch.Tensor]:
    return llama_weights_to_hf(cfg, sd, ffn=qwen2_moe_ffn_to_hf)


register("qwen2_moe", Family(qwen2_moe_config, qwen2_moe_weights, LLAMA_IGNORE, Export(
    "Qwen2MoeForCausalLM", moe=True, refuse=qwen2_moe_refusal, config=qwen2_moe_to_hf, weights=qwen2_moe_weights_to_hf,
    name="Qwen2-MoE", computes={
        **LLAMA_LAYOUT, **WINDOWS, **ALL_EXPERTS, "qkv_bias": ANY, "moe.shared_gate": ("sigmoid",),
        **dict.fromkeys(("moe.n_shared", "moe.shared_d_ff", "moe.normalize_top_k", "moe.every", "moe.first_dense"),
                        ANY),
    },
)))


# ============================================================== DeepSeek-V3
# transformers' DeepseekV3Config defaults (5.x) that concern the MoE layers (the rest: deepseek.py).
DEEPSEEK_V3_DEFAULTS: dict[str, Any] = dict(
    n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048,
    routed_scaling_factor=2.5, n_group=8, topk_group=4, norm_topk_prob=True, first_k_dense_replace=3,
    kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
)


def deepseek_v3_moe(hf: Mapping[str, Any]) -> MoEConfig:
    """The MoE part of a DeepSeek-V3 config.json: sigmoid affinities plus the correction bias for
    selection, group-limited top-k with a group's score its best two (``noaux_tc``), normalized
    weights times routed_scaling_factor, shared experts, the first k layers dense."""
    hf = with_defaults(hf, DEEPSEEK_V3_DEFAULTS)
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise key_refused(hf, "scoring_func", "DeepSeek-V3 routing scores with sigmoid; lmlab maps only that")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise key_refused(hf, "topk_method", "only DeepSeek-V3's 'noaux_tc' group-limited selection is mapped")
    if hf.get("moe_layer_freq", 1) != 1:
        raise key_refused(hf, "moe_layer_freq", "transformers' DeepSeek-V3 makes every layer after the dense ones MoE")
    groups = hf["n_group"] or 1
    return MoEConfig(
        n_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"], d_expert=hf["moe_intermediate_size"],
        n_shared=hf["n_shared_experts"] or 0, scoring="sigmoid", normalize_top_k=bool(hf["norm_topk_prob"]),
        routed_scale=hf["routed_scaling_factor"], n_groups=groups, topk_groups=hf["topk_group"] or groups,
        group_score="top2", first_dense=hf["first_k_dense_replace"],
    )


def deepseek_v3_moe_weights(cfg: ModelConfig, t: HFTensors, hf: str, ours: str) -> dict[str, torch.Tensor | None]:
    """One DeepSeek-V3 MoE layer under HF prefix ``hf`` ("model.layers.3.mlp.")."""
    return moe_weights(
        cfg, t, hf, ours, names=("gate_proj", "up_proj", "down_proj"), shared="shared_experts",
        score_bias="gate.e_score_correction_bias",
    )


# ============================================================== GLM-4-MoE
# transformers' Glm4MoeConfig defaults (5.x); partial_rotary_factor 0.5 is set in its __post_init__.
GLM4_MOE_DEFAULTS: dict[str, Any] = dict(
    vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46, num_attention_heads=96,
    num_key_value_heads=8, head_dim=None, hidden_act="silu", max_position_embeddings=131072, initializer_range=0.02,
    rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, moe_intermediate_size=1408,
    num_experts_per_tok=8, n_shared_experts=1, n_routed_experts=128, routed_scaling_factor=1.0, n_group=1,
    topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=False, partial_rotary_factor=0.5,
)


def glm4_moe_config(hf: Mapping[str, Any]) -> ModelConfig:
    """GLM-4-MoE (GLM-4.5): DeepSeek-V3's router and experts (sigmoid affinities plus correction bias,
    group-limited top-k with a group's score its best two, routed scaling, shared experts, the first
    k layers dense) with grouped-query attention (biases on q, k, v with attention_bias) and, with
    use_qk_norm, Qwen3's per-head q/k norms (qk_norm="head"). Rotary turns the first partial_rotary_factor of
    each head's dimensions (GLM-4.5: half), pairs (j, j + r/2) within them, as lmlab's rope.partial does."""
    hf = with_defaults(hf, GLM4_MOE_DEFAULTS)
    groups = hf["n_group"] or 1
    moe = MoEConfig(
        n_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"], d_expert=hf["moe_intermediate_size"],
        n_shared=hf["n_shared_experts"] or 0, scoring="sigmoid", normalize_top_k=bool(hf["norm_topk_prob"]),
        routed_scale=hf["routed_scaling_factor"], n_groups=groups, topk_groups=hf["topk_group"] or groups,
        group_score="top2", first_dense=hf["first_k_dense_replace"],
    )
    return llama_layout_config(hf, qkv_bias=bool(hf["attention_bias"]), moe=moe, partial=True,
                               qk_norm="head" if hf["use_qk_norm"] else "none")


GLM4_MOE_NAMES = ("gate_proj", "up_proj", "down_proj")


def glm4_moe_ffn(cfg: ModelConfig, t: HFTensors, hf: str, ours: str) -> dict[str, torch.Tensor | None]:
    if not cfg.is_moe_layer(int(ours.split(".")[1])):
        return llama_glu(cfg, t, hf, ours)
    if cfg.moe.n_shared == 0:  # transformers still builds (and saves) a shared FFN of width 0
        for name in GLM4_MOE_NAMES:
            t.take_optional(f"{hf}shared_experts.{name}.weight")
    return moe_weights(
        cfg, t, hf, ours, names=GLM4_MOE_NAMES, shared="shared_experts" if cfg.moe.n_shared else None,
        score_bias="gate.e_score_correction_bias",
    )


def glm4_moe_weights(cfg: ModelConfig, t: HFTensors) -> dict[str, torch.Tensor | None]:
    if cfg.moe is None:
        raise ValueError("a GLM-4-MoE checkpoint needs a config with moe set")
    for name in t.tensors:  # multi-token-prediction layers after the last decoder layer: not part of the LM
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        if layer and int(layer.group(1)) >= cfg.n_layers:
            t.taken.add(name)
    norms = qk_norm_weights(cfg, t) if cfg.qk_norm == "head" else {}
    return {**llama_weights(cfg, t, ffn=glm4_moe_ffn), **norms}


def glm4_moe_refusal(cfg: ModelConfig) -> str | None:
    moe = cfg.moe
    width = moe.expert_width(cfg.d_ff)
    qk_norm = "none" if cfg.qk_norm == "none" else "head"  # use_qk_norm: per head, or none
    why = moe_refusal(cfg, "GLM-4-MoE", {
        "moe.scoring": ("sigmoid", "GLM-4-MoE scores experts with a sigmoid"),
        "moe.shared_gate": ("none", "GLM-4-MoE's shared experts are not gated"),
        "moe.every": (1, "every GLM-4-MoE layer after the first dense ones is a mixture"),
    }, qk_norm=qk_norm)
    if why is None and _shared_total(cfg) % width:
        why = (f"moe.shared_d_ff={moe.shared_d_ff} (GLM-4-MoE's shared experts are whole experts of "
               f"moe_intermediate_size={width})")
    if why is None and moe.group_limited and moe.group_score != "top2":
        why = f"moe.group_score={moe.group_score!r} (GLM-4-MoE scores a group by its best two experts)"
    if why is None and moe.routed_experts < 2:
        why = f"moe.n_experts={moe.n_experts} (GLM-4-MoE's router needs at least two experts)"
    return why


def glm4_moe_groups(moe: MoEConfig) -> tuple[int, int]:
    """(n_group, topk_group): lmlab's where the routing is group-limited; else groups that keep every
    expert (transformers always ranks groups by their best two, so each needs two experts)."""
    if moe.group_limited:
        return moe.n_groups, moe.topk_groups
    groups = moe.n_groups if moe.routed_experts // moe.n_groups >= 2 else 1
    return groups, groups


def glm4_moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    width = moe.expert_width(cfg.d_ff)
    n_group, topk_group = glm4_moe_groups(moe)
    return {
        **llama_layout_to_hf(cfg, partial_rotary_factor=cfg.rope.partial), "attention_bias": cfg.qkv_bias,
        "n_routed_experts": moe.routed_experts, "num_experts_per_tok": moe.active_experts,
        "moe_intermediate_size": width, "n_shared_experts": _shared_total(cfg) // width,
        "routed_scaling_factor": moe.routed_scale, "n_group": n_group, "topk_group": topk_group,
        "first_k_dense_replace": moe.first_dense, "norm_topk_prob": moe.normalize_top_k,
        "use_qk_norm": cfg.qk_norm == "head",
        "num_nextn_predict_layers": 0, "output_router_logits": False,
    }


def glm4_moe_ffn_to_hf(cfg: ModelConfig, sd: Tensors, ours: str, hf: str) -> dict[str, torch.Tensor]:
    if not cfg.is_moe_layer(int(ours.split(".")[1])):
        return llama_glu_to_hf(cfg, sd, ours, hf)
    out = moe_to_hf(
        cfg,
        sd,
        ours,
        hf,
        names=GLM4_MOE_NAMES,
        arch="GLM-4-MoE",
        shared="shared_experts" if cfg.moe.n_shared else None,
        score_bias="gate.e_score_correction_bias",
    )
    if not cfg.moe.n_shared:  # the width-0 shared FFN transformers builds
        D = cfg.d_model
        out.update({f"{hf}shared_experts.{n}.weight": torch.zeros((D, 0) if n == "down_proj" else (0, D))
                    for n in GLM4_MOE_NAMES})
    return out


def glm4_moe_weights_to_hf(cfg: ModelConfig, sd: Tensors) -> dict[str, torch.Tensor]:
    norms = qk_norm_to_hf(cfg, sd) if cfg.qk_norm == "head" else {}
    return {**llama_weights_to_hf(cfg, sd, ffn=glm4_moe_ffn_to_hf), **norms}


register("glm4_moe", Family(glm4_moe_config, glm4_moe_weights, LLAMA_IGNORE, Export(
    "Glm4MoeForCausalLM", moe=True, refuse=glm4_moe_refusal, config=glm4_moe_to_hf, weights=glm4_moe_weights_to_hf,
    name="GLM-4-MoE", computes={
        **LLAMA_LAYOUT, **DEEPSEEK_ROUTING, "qkv_bias": ANY, "qk_norm": ("none", "head"), "rope.partial": ANY,
        "moe.scoring": ("sigmoid",), "moe.normalize_top_k": ANY,
    },
)))


# ============================================================== MiniMax-M2
# transformers' MiniMaxM2Config defaults (5.x)
MINIMAX_M2_DEFAULTS: dict[str, Any] = dict(
    vocab_size=200064, hidden_size=3072, intermediate_size=1536, num_hidden_layers=62, num_attention_heads=48,
    num_key_value_heads=8, head_dim=128, hidden_act="silu", max_position_embeddings=196608, initializer_range=0.02,
    rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts_per_tok=8, num_local_experts=256,
    router_jitter_noise=0.0,
)
MINIMAX_M2_THETA = 5_000_000.0  # MiniMaxM2Config.default_theta
MINIMAX_M2_NAMES = ("w1", "w3", "w2")


def minimax_m2_config(hf: Mapping[str, Any]) -> ModelConfig:
    """MiniMax-M2: every layer a mixture of SwiGLU experts of width intermediate_size routed by sigmoid affinities
    plus a selection-only correction bias, the top-k weights renormalized (no shared expert, no groups); an RMSNorm
    over the whole q and k projections (``qk_norm="full"``, OLMo 2's); rotary on the first ``rotary_dim`` (or
    ``partial_rotary_factor``) of each head, as GLM-4-MoE turns it (``rope.partial``)."""
    hf = with_defaults(hf, MINIMAX_M2_DEFAULTS)
    if hf["router_jitter_noise"]:
        raise key_refused(hf, "router_jitter_noise", "lmlab's router has no multiplicative input jitter; use 0.0")
    rotary = hf.get("rotary_dim")  # the released checkpoints' form of partial_rotary_factor
    if rotary is not None and hf.get("partial_rotary_factor") is None:
        hf = {**hf, "partial_rotary_factor": rotary / hf["head_dim"]}
    moe = MoEConfig(n_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"], scoring="sigmoid",
                    normalize_top_k=True)
    return llama_layout_config(hf, default_theta=MINIMAX_M2_THETA, partial=True, qk_norm="full", moe=moe)


def minimax_m2_ffn(cfg: ModelConfig, t: HFTensors, hf: str, ours: str) -> dict[str, torch.Tensor | None]:
    layer = hf.removesuffix("mlp.")
    hf = layer + _prefix_in_use(t, layer, ("block_sparse_moe.", "mlp."))  # Hub files / transformers 5 memory
    return moe_weights(cfg, t, hf, ours, names=MINIMAX_M2_NAMES, score_bias="e_score_correction_bias")


def minimax_m2_weights(cfg: ModelConfig, t: HFTensors) -> dict[str, torch.Tensor | None]:
    if cfg.moe is None or cfg.qk_norm != "full":
        raise ValueError("a MiniMax-M2 checkpoint needs a config with moe set and qk_norm='full'")
    return {**llama_weights(cfg, t, ffn=minimax_m2_ffn), **qk_norm_weights(cfg, t)}


def minimax_m2_refusal(cfg: ModelConfig) -> str | None:
    return moe_refusal(cfg, "MiniMax-M2", {
        "qkv_bias": (False, "MiniMax-M2 has no biases"),
        "moe.scoring": ("sigmoid", "MiniMax-M2 scores experts with a sigmoid"),
        "moe.normalize_top_k": (True, "MiniMax-M2 renormalizes the chosen weights"),
        "moe.routed_scale": (1.0, "MiniMax-M2 does not scale the routed output"),
        "moe.n_shared": (0, "MiniMax-M2 has no shared experts"),
        "moe.every": (1, "every MiniMax-M2 layer is a mixture"),
        "moe.first_dense": (0, "every MiniMax-M2 layer is a mixture"),
    }, qk_norm="full") or all_experts_refusal(cfg, "MiniMax-M2")


def minimax_m2_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """head_dim always (its default is 128); intermediate_size is the expert width, every layer being a mixture; the
    rotated width both as partial_rotary_factor and as the released checkpoints' rotary_dim."""
    moe = cfg.moe
    return {
        **llama_layout_to_hf(cfg, partial_rotary_factor=cfg.rope.partial), "head_dim": cfg.head_dim,
        "rotary_dim": cfg.rotary_dim,
        "intermediate_size": moe.expert_width(cfg.d_ff), "num_local_experts": moe.routed_experts,
        "num_experts_per_tok": moe.active_experts, "router_jitter_noise": 0.0, "output_router_logits": False,
    }


def minimax_m2_ffn_to_hf(cfg: ModelConfig, sd: Tensors, ours: str, hf: str) -> dict[str, torch.Tensor]:
    hf = hf.removesuffix("mlp.") + "block_sparse_moe."
    return moe_to_hf(cfg, sd, ours, hf, names=MINIMAX_M2_NAMES, arch="MiniMax-M2", score_bias="e_score_correction_bias")


def minimax_m2_weights_to_hf(cfg: ModelConfig, sd: Tensors) -> dict[str, torch.Tensor]:
    return {**llama_weights_to_hf(cfg, sd, ffn=minimax_m2_ffn_to_hf), **qk_norm_to_hf(cfg, sd)}


register("minimax_m2", Family(minimax_m2_config, minimax_m2_weights, LLAMA_IGNORE, Export(
    "MiniMaxM2ForCausalLM", moe=True, refuse=minimax_m2_refusal, config=minimax_m2_to_hf,
    weights=minimax_m2_weights_to_hf, name="MiniMax-M2", computes={
        **LLAMA_LAYOUT, **ALL_EXPERTS, "qk_norm": ("full",), "rope.partial": ANY, "moe.scoring": ("sigmoid",),
        "moe.normalize_top_k": (True,)},
)))


# ============================================================== ERNIE 4.5 MoE
# transformers' Ernie4_5_MoeConfig defaults (5.x)
ERNIE45_MOE_DEFAULTS: dict[str, Any] = dict(
    vocab_size=103424, hidden_size=2560, intermediate_size=12288, num_hidden_layers=28, num_attention_heads=20,
    num_key_value_heads=4, head_dim=None, hidden_act="silu", max_position_embeddings=131072, initializer_range=0.02,
    rms_norm_eps=1e-5, tie_word_embeddings=True, use_bias=False, moe_intermediate_size=1536, moe_k=6,
    moe_num_experts=64, moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_end_index=-1,
    moe_layer_interval=1, moe_norm_min=1e-12,
)
ERNIE45_THETA = 500_000.0  # Ernie4_5_MoeConfig.default_theta
ERNIE45_NAMES = ("gate_proj", "up_proj", "down_proj")
# the selection bias (1, E) as the Hub files name it (transformers 5 holds it under gate.)
ERNIE45_BIAS = "moe_statics.e_score_correction_bias"
ERNIE45_MIN_NORM = 1e-6  # a moe_norm_min lmlab takes as 0: the top-k softmax weights never sum below it


def ernie45_moe_config(hf: Mapping[str, Any]) -> ModelConfig:
    """ERNIE 4.5 (MoE): the Llama layout with interleaved rotary pairs and a tied head by default; from
    ``moe_layer_start_index`` every ``moe_layer_interval``-th layer a mixture of SwiGLU experts, softmax-routed with a
    selection-only correction bias, the top-k weights renormalized, beside ``moe_num_shared_experts`` shared experts
    of the same width. Biases (``use_bias``) are refused: they would sit on attention and the dense feed-forwards but
    not on the experts, which lmlab's one ``bias`` switch cannot say."""
    hf = with_defaults(hf, {**ERNIE45_MOE_DEFAULTS, **{k: hf[a] for a, k in (
        ("num_experts", "moe_num_experts"), ("num_experts_per_tok", "moe_k")) if a in hf}})
    if hf["use_bias"]:
        raise key_refused(hf, "use_bias", "lmlab's one `bias` switch cannot put biases on attention and the dense "
                          "feed-forwards and none on the experts")
    if not 0 <= hf["moe_norm_min"] <= ERNIE45_MIN_NORM:
        raise key_refused(hf, "moe_norm_min", f"lmlab renormalizes the chosen weights by their sum alone; a floor "
                          f"above {ERNIE45_MIN_NORM} could act")
    n = hf["num_hidden_layers"]
    start, end, interval = hf["moe_layer_start_index"], hf["moe_layer_end_index"], hf["moe_layer_interval"]
    end = n - 1 if end == -1 else end  # as Ernie4_5_MoeConfig.__post_init__
    sparse = [(i + 1) % interval == 0 and start <= i <= end for i in range(n)]
    layout = every_and_first_dense(sparse)
    if layout is None:
        raise key_refused(hf, "moe_layer_end_index", f"the MoE layers are {[i for i, s in enumerate(sparse) if s]}; "
                          "lmlab expresses only 'every n-th layer after the first k' up to the last")
    moe = MoEConfig(n_experts=hf["moe_num_experts"], top_k=hf["moe_k"], d_expert=hf["moe_intermediate_size"],
                    n_shared=hf["moe_num_shared_experts"] or 0, normalize_top_k=True, every=layout[0],
                    first_dense=layout[1])
    cfg = llama_layout_config(hf, default_theta=ERNIE45_THETA, moe=moe)
    return cfg.override({"rope.layout": "interleaved"})


def ernie45_moe_ffn(cfg: ModelConfig, t: HFTensors, hf: str, ours: str) -> dict[str, torch.Tensor | None]:
    if not cfg.is_moe_layer(int(ours.split(".")[1])):
        return llama_glu(cfg, t, hf, ours)
    sd = moe_weights(cfg, t, hf, ours, names=ERNIE45_NAMES, shared="shared_experts" if cfg.moe.n_shared else None)
    bias = t.take(f"{hf}{ERNIE45_BIAS}" if f"{hf}{ERNIE45_BIAS}" in t.tensors else f"{hf}gate.{ERNIE45_BIAS}")
    sd[f"{ours}router.score_bias"] = None if bias is None else bias.reshape(-1)
    return sd


def ernie45_moe_weights(cfg: ModelConfig, t: HFTensors) -> dict[str, torch.Tensor | None]:
    if cfg.moe is None or cfg.rope.layout != "interleaved":
        raise ValueError("an ERNIE 4.5 MoE checkpoint needs a config with moe set and rope.layout='interleaved'")
    return llama_weights(cfg, t, ffn=ernie45_moe_ffn)


def ernie45_moe_refusal(cfg: ModelConfig) -> str | None:
    moe = cfg.moe
    why = moe_refusal(cfg, "ERNIE 4.5", {
        "qkv_bias": (False, "ERNIE 4.5 MoE has biases on every projection or none"),
        "moe.scoring": ("softmax", "ERNIE 4.5's router is a softmax"),
        "moe.normalize_top_k": (True, "ERNIE 4.5 renormalizes the chosen weights"),
        "moe.routed_scale": (1.0, "ERNIE 4.5 does not scale the routed output"),
        "moe.shared_gate": ("none", "ERNIE 4.5's shared experts are not gated"),
    }) or all_experts_refusal(cfg, "ERNIE 4.5")
    if why is None and (moe.first_dense + 1) % moe.every:
        why = (f"moe.first_dense={moe.first_dense} with moe.every={moe.every} (ERNIE 4.5's mixtures are the layers i "
               "from moe_layer_start_index with i + 1 a multiple of moe_layer_interval)")
    if why is None and _shared_total(cfg) % moe.expert_width(cfg.d_ff):
        why = (f"moe.shared_d_ff={moe.shared_d_ff} (ERNIE 4.5's shared experts are whole experts of "
               f"moe_intermediate_size={moe.expert_width(cfg.d_ff)})")
    return why


def ernie45_moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    width = moe.expert_width(cfg.d_ff)
    keys = {k: v for k, v in llama_layout_to_hf(cfg).items() if k != "attention_dropout"}  # a key it has not
    return {
        **keys, "use_bias": False, "moe_intermediate_size": width, "moe_k": moe.active_experts,
        "moe_num_experts": moe.routed_experts, "moe_num_shared_experts": _shared_total(cfg) // width,
        "moe_layer_start_index": moe.first_dense, "moe_layer_end_index": cfg.n_layers - 1,
        "moe_layer_interval": moe.every, "moe_norm_min": ERNIE45_MOE_DEFAULTS["moe_norm_min"],
        "output_router_logits": False,
    }


def ernie45_moe_ffn_to_hf(cfg: ModelConfig, sd: Tensors, ours: str, hf: str) -> dict[str, torch.Tensor]:
    if not cfg.is_moe_layer(int(ours.split(".")[1])):
        return llama_glu_to_hf(cfg, sd, ours, hf)
    out = moe_to_hf(cfg, sd, ours, hf, names=ERNIE45_NAMES, arch="ERNIE 4.5",
                    shared="shared_experts" if cfg.moe.n_shared else None, score_bias=ERNIE45_BIAS)
    out[f"{hf}{ERNIE45_BIAS}"] = out[f"{hf}{ERNIE45_BIAS}"].reshape(1, -1)
    return out


def ernie45_moe_weights_to_hf(cfg: ModelConfig, sd: Tensors) -> dict[str, torch.Tensor]:
    """ERNIE 4.5 turns interleaved pairs: q and k rows are written as an interleaved model holds them, and a
    half-layout model's are permuted into that layout."""
    out = llama_weights_to_hf(cfg.override({"rope.layout": "half"}), sd, ffn=ernie45_moe_ffn_to_hf)  # rows as held
    if cfg.rope.layout == "half":
        for i in range(cfg.n_layers):
            for part, heads in (("q_proj", cfg.n_heads), ("k_proj", cfg.n_kv_heads)):
                name = f"model.layers.{i}.self_attn.{part}.weight"
                out[name] = half_to_interleaved(out[name], heads)
    return out


# a checkpoint's multi-token-prediction weights (mtp_*), which transformers' Ernie4_5_Moe does not load either
register("ernie4_5_moe", Family(ernie45_moe_config, ernie45_moe_weights, (*LLAMA_IGNORE, r"(^|\.)mtp"), Export(
    "Ernie4_5_MoeForCausalLM", moe=True, refuse=ernie45_moe_refusal, config=ernie45_moe_to_hf,
    weights=ernie45_moe_weights_to_hf, name="ERNIE 4.5 MoE", computes={
        **LLAMA_LAYOUT, **ALL_EXPERTS, "moe.normalize_top_k": (True,),
        **dict.fromkeys(("moe.n_shared", "moe.shared_d_ff", "moe.every", "moe.first_dense"), ANY)},
)))


# ============================================================== HunYuan-MoE
# transformers' HunYuanMoEV1Config defaults (5.x)
HUNYUAN_MOE_DEFAULTS: dict[str, Any] = dict(
    LLAMA_DEFAULTS, vocab_size=290943, rms_norm_eps=1e-5, num_experts=1, moe_topk=1,
)
HUNYUAN_NAMES = ("gate_proj", "up_proj", "down_proj")
HUNYUAN_NORMS = {"q_norm": "query_layernorm", "k_norm": "key_layernorm"}  # lmlab's qk_norm -> its names


def hunyuan_moe_rope(hf: Mapping[str, Any]) -> RopeConfig:
    """HunYuan's rotary: as Llama's, or its "dynamic" type with an ``alpha``, which transformers computes as a fixed
    larger base, theta alpha^(d / (d - 2)): lmlab's static NTK scaling (``rope.scaling='ntk'``) with factor alpha."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if isinstance(params, Mapping) and params.get("alpha") and params.get("rope_type", params.get("type")) == "dynamic":
        base = params.get("rope_theta") or hf.get("rope_theta") or 10000.0
        return RopeConfig(base=base, scaling="ntk", factor=float(params["alpha"]))
    return rope_from_hf(hf)


def hunyuan_moe_config(hf: Mapping[str, Any]) -> ModelConfig:
    """HunYuan-MoE (Hunyuan-A13B): every layer a softmax-routed mixture of SwiGLU experts of width
    intermediate_size, the top-k weights renormalized, beside one ungated shared expert of the same width; an
    RMSNorm per query and key head applied after rotary (``qk_norm_position='after_rope'``), which makes the logits
    depend on absolute positions. A number of experts or top-k per layer (a list) is refused: lmlab's mixtures are
    alike."""
    hf = with_defaults(hf, HUNYUAN_MOE_DEFAULTS)
    refuse_attention_bias(hf)
    if isinstance(hf["moe_topk"], list):
        raise key_refused(hf, "moe_topk", "lmlab's mixture-of-experts layers are alike; give one number for all")
    moe = MoEConfig(n_experts=hf["num_experts"], top_k=hf["moe_topk"], n_shared=1, normalize_top_k=True)
    return llama_layout_config(hf, qk_norm="head", qk_norm_position="after_rope", moe=moe,
                               rope=hunyuan_moe_rope(hf))


def hunyuan_moe_ffn(cfg: ModelConfig, t: HFTensors, hf: str, ours: str) -> dict[str, torch.Tensor | None]:
    return moe_weights(cfg, t, hf, ours, names=HUNYUAN_NAMES, shared="shared_mlp", router="gate.wg")


def hunyuan_moe_weights(cfg: ModelConfig, t: HFTensors) -> dict[str, torch.Tensor | None]:
    if cfg.moe is None or cfg.qk_norm_position != "after_rope":
        raise ValueError("a HunYuan-MoE checkpoint needs a config with moe set and qk_norm_position='after_rope'")
    sd = llama_weights(cfg, t, ffn=hunyuan_moe_ffn)
    for i in range(cfg.n_layers):
        for ours, theirs in HUNYUAN_NORMS.items():
            sd[f"blocks.{i}.attn.qk_norm.{ours}.weight"] = t.take(f"model.layers.{i}.self_attn.{theirs}.weight")
    return sd


def hunyuan_moe_refusal(cfg: ModelConfig) -> str | None:
    moe = cfg.moe
    why = moe_refusal(cfg, "HunYuan-MoE", {
        "qkv_bias": (False, "HunYuan-MoE has no biases"),
        "qk_norm_position": ("after_rope", "HunYuan-MoE normalizes queries and keys after rotary"),
        "moe.scoring": ("softmax", "HunYuan-MoE's router is a softmax"),
        "moe.normalize_top_k": (True, "HunYuan-MoE renormalizes the chosen weights"),
        "moe.routed_scale": (1.0, "HunYuan-MoE does not scale the routed output"),
        "moe.n_shared": (1, "HunYuan-MoE has one shared expert"),
        "moe.shared_gate": ("none", "HunYuan-MoE's shared expert is not gated"),
        "moe.every": (1, "every HunYuan-MoE layer is a mixture"),
        "moe.first_dense": (0, "every HunYuan-MoE layer is a mixture"),
    }, qk_norm="head") or all_experts_refusal(cfg, "HunYuan-MoE")
    width = moe.expert_width(cfg.d_ff)
    if why is None and (moe.d_expert not in (None, cfg.d_ff) or moe.shared_width(cfg.d_ff) != width):
        why = (f"moe.d_expert={moe.d_expert} (HunYuan-MoE's experts and shared expert are all intermediate_size, "
               "the model's d_ff, wide)")
    return why


def hunyuan_moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """head_dim always; no attention biases; the experts' number and top-k as single numbers."""
    moe = cfg.moe
    return {**llama_layout_to_hf(cfg), "head_dim": cfg.head_dim, "attention_bias": False,
            "num_experts": moe.routed_experts, "moe_topk": moe.active_experts}


def hunyuan_moe_ffn_to_hf(cfg: ModelConfig, sd: Tensors, ours: str, hf: str) -> dict[str, torch.Tensor]:
    return moe_to_hf(cfg, sd, ours, hf, names=HUNYUAN_NAMES, arch="HunYuan-MoE", shared="shared_mlp",
                     router="gate.wg")


def hunyuan_moe_weights_to_hf(cfg: ModelConfig, sd: Tensors) -> dict[str, torch.Tensor]:
    out = llama_weights_to_hf(cfg, sd, ffn=hunyuan_moe_ffn_to_hf)
    norms = qk_norm_to_hf(cfg, sd)  # gains permuted as the q/k rows are, under interleaved rotary
    for i in range(cfg.n_layers):
        for ours, theirs in HUNYUAN_NORMS.items():
            out[f"model.layers.{i}.self_attn.{theirs}.weight"] = norms[f"model.layers.{i}.self_attn.{ours}.weight"]
    return out


register("hunyuan_v1_moe", Family(hunyuan_moe_config, hunyuan_moe_weights, LLAMA_IGNORE, Export(
    "HunYuanMoEV1ForCausalLM", moe=True, refuse=hunyuan_moe_refusal, config=hunyuan_moe_to_hf,
    weights=hunyuan_moe_weights_to_hf, name="HunYuan-MoE", computes={
        **LLAMA_LAYOUT, **ALL_EXPERTS, "rope.scaling": ("none", "ntk"), "qk_norm": ("head",),
        "qk_norm_position": ("after_rope",), "moe.n_shared": (1,), "moe.normalize_top_k": (True,)},
)))
