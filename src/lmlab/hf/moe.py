"""Hugging Face mixture-of-experts checkpoints: Mixtral, Qwen2-MoE, and DeepSeek-V3's MoE layers.

Registers three ``model_type`` families in :data:`lmlab.hf.FAMILIES`, on the Llama layout of
``dense.py`` with their own per-layer feed-forward part. Expert weights are read in either
published layout:

- per expert, as on the Hub and as ``save_pretrained`` writes them
  (Mixtral ``block_sparse_moe.experts.{j}.w1/w3/w2``, Qwen2-MoE and DeepSeek
  ``mlp.experts.{j}.gate_proj/up_proj/down_proj``);
- stacked, as transformers >= 5 holds them in memory (``mlp.experts.gate_up_proj`` (E, 2F, D),
  ``mlp.experts.down_proj`` (E, D, F)), which is lmlab's layout too.

Balancing coefficients are training choices, not part of a checkpoint: loaded models have them
at 0 (set them with ``cfg.override({"moe.expert_balance_coef": ...})`` to train further).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..config import ModelConfig, MoEConfig
from .dense import LLAMA_IGNORE, llama_glu, llama_layout_config, llama_weights
from .registry import Family, HFTensors, register, with_defaults


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
    shared_gate: str | None = None, score_bias: str | None = None,
) -> dict[str, torch.Tensor | None]:
    """One MoE layer under HF prefix ``hf`` ("model.layers.3.mlp.") -> lmlab ``ours`` ("blocks.3.ffn.")."""
    if cfg.moe is None:  # e.g. detect_model_type trying this family on a dense config
        raise ValueError("a mixture-of-experts checkpoint needs a config with moe set")
    E = cfg.moe.routed_experts
    gate_up, down = stacked_experts(t, f"{hf}experts.", E, *names)
    router = t.take(f"{hf}gate.weight")
    sd = {
        f"{ours}router.weight": router,
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


def _refuse(hf: Mapping[str, Any], key: str, why: str) -> ValueError:
    return ValueError(f"config.json (model_type {hf.get('model_type')!r}) has {key}={hf.get(key)!r}: {why}")


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
    if hf["sliding_window"] is not None:
        raise _refuse(hf, "sliding_window", "lmlab has no sliding-window attention; only sliding_window null loads")
    if hf["router_jitter_noise"]:
        raise _refuse(hf, "router_jitter_noise", "lmlab's router has no multiplicative input jitter; use 0.0")
    return llama_layout_config(
        hf, default_theta=1e6,
        moe=MoEConfig(n_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"], normalize_top_k=True),
    )


def mixtral_ffn(cfg: ModelConfig, t: HFTensors, hf: str, ours: str) -> dict[str, torch.Tensor | None]:
    layer = hf.removesuffix("mlp.")
    hf = layer + _prefix_in_use(t, layer, ("block_sparse_moe.", "mlp."))  # Hub files / transformers 5 memory
    return moe_weights(cfg, t, hf, ours, names=("w1", "w3", "w2"))


def mixtral_weights(cfg: ModelConfig, t: HFTensors) -> dict[str, torch.Tensor | None]:
    return llama_weights(cfg, t, ffn=mixtral_ffn)


register("mixtral", Family(mixtral_config, mixtral_weights, LLAMA_IGNORE))


# ============================================================== Qwen2-MoE
# transformers' Qwen2MoeConfig defaults (5.x).
QWEN2_MOE_DEFAULTS: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
    num_key_value_heads=16, hidden_act="silu", max_position_embeddings=32768, initializer_range=0.02,
    rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False, decoder_sparse_step=1,
    moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts_per_tok=4, num_experts=60,
    norm_topk_prob=False, mlp_only_layers=None, qkv_bias=True,
)


def qwen2_moe_config(hf: Mapping[str, Any]) -> ModelConfig:
    """Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): fine-grained softmax-routed experts plus one shared
    expert whose output is gated per token by sigmoid(x·g)."""
    hf = with_defaults(hf, QWEN2_MOE_DEFAULTS)
    if hf["use_sliding_window"]:
        raise _refuse(hf, "use_sliding_window", "lmlab has no sliding-window attention")
    if not hf["num_experts"]:
        raise _refuse(hf, "num_experts", "without experts this is a dense Llama-layout model; load it as model_type 'llama'")
    moe = _qwen2_moe_experts(hf, hf["num_hidden_layers"])
    return llama_layout_config(hf, qkv_bias=bool(hf["qkv_bias"]), moe=moe)  # biases on q, k, v only


def _qwen2_moe_experts(hf: Mapping[str, Any], n_layers: int) -> MoEConfig:
    d_shared = hf["shared_expert_intermediate_size"]
    if not d_shared or d_shared <= 0:
        raise _refuse(hf, "shared_expert_intermediate_size", "lmlab maps Qwen2-MoE's gated shared expert only with a positive width")
    # layer l is sparse iff l not in mlp_only_layers and (l + 1) % decoder_sparse_step == 0
    step, dense_only = hf["decoder_sparse_step"], set(hf["mlp_only_layers"] or ())
    sparse = [l not in dense_only and (l + 1) % step == 0 for l in range(n_layers)]
    layout = _every_and_first_dense(sparse)
    if layout is None:
        raise _refuse(
            hf, "mlp_only_layers",
            f"with decoder_sparse_step={step} the MoE layers are {[l for l, s in enumerate(sparse) if s]}; lmlab "
            "expresses only 'every n-th layer after the first k'",
        )
    every, first_dense = layout
    return MoEConfig(  # one gated shared expert of its own width, as the checkpoint holds it
        n_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"], d_expert=hf["moe_intermediate_size"],
        n_shared=1, shared_d_ff=d_shared, shared_gate="sigmoid", normalize_top_k=bool(hf["norm_topk_prob"]),
        every=every, first_dense=first_dense,
    )


def _every_and_first_dense(sparse: list[bool]) -> tuple[int, int] | None:
    L = len(sparse)
    for first in range(L):
        for every in range(1, L + 1):
            if [l >= first and (l - first) % every == 0 for l in range(L)] == sparse:
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


register("qwen2_moe", Family(qwen2_moe_config, qwen2_moe_weights, LLAMA_IGNORE))


# ============================================================== DeepSeek-V3
# transformers' DeepseekV3Config defaults (5.x) that concern the MoE layers.
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
        raise _refuse(hf, "scoring_func", "DeepSeek-V3 routing scores with sigmoid; lmlab maps only that")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise _refuse(hf, "topk_method", "only DeepSeek-V3's 'noaux_tc' group-limited selection is mapped")
    if hf.get("moe_layer_freq", 1) != 1:
        raise _refuse(hf, "moe_layer_freq", "transformers' DeepSeek-V3 makes every layer after the dense ones MoE")
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


def deepseek_v3_config(hf: Mapping[str, Any]) -> ModelConfig:
    raise _mla_error(with_defaults(hf, DEEPSEEK_V3_DEFAULTS))


def deepseek_v3_weights(cfg: ModelConfig, t: HFTensors) -> dict[str, torch.Tensor | None]:
    raise _mla_error({"model_type": "deepseek_v3", **DEEPSEEK_V3_DEFAULTS})


def _mla_error(hf: Mapping[str, Any]) -> ValueError:
    ranks = ", ".join(f"{k}={hf.get(k)}" for k in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim"))
    return ValueError(
        f"config.json (model_type {hf.get('model_type')!r}) uses multi-head latent attention ({ranks}), which "
        "lmlab's attention does not support (it has no low-rank compressed keys and values), so the checkpoint "
        "cannot be loaded; its MoE layers alone map with lmlab.hf.moe.deepseek_v3_moe and deepseek_v3_moe_weights"
    )


register("deepseek_v3", Family(deepseek_v3_config, deepseek_v3_weights))
