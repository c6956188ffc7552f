"""Hugging Face DeepSeek-V4 checkpoints, both ways: compressed attention (``lmlab.compressed_attention``), hash and
top-k routed mixture-of-experts layers with a clamped SwiGLU, and manifold-constrained hyper-connections
(``residual: mhc``).

Registers ``deepseek_v4`` in :data:`lmlab.hf.FAMILIES`. What transformers' ``DeepseekV4ForCausalLM`` computes maps
as these switches on the 2017 block:

- attention: ``attention.variant: compressed`` (the section ``compressed``): ``layer_types`` per layer (``sliding``,
  ``csa``, ``hca``), ``compress_rates``, ``sliding_window``, the indexer (``index_n_heads``, ``index_head_dim``,
  ``index_topk``), the grouped output projection (``o_groups``, ``o_lora_rank``), ``q_lora_rank``, one key/value
  head, the trailing ``partial_rotary_factor x head_dim`` dimensions rotating in interleaved pairs; the ``main``
  rotary set (sliding layers) is ``rope``, the ``compress`` set (``compress_rope_theta``, YaRN with attention factor
  1) the section's; a learned sink per head (``attention.sinks: learned``);
- routing: the first ``mlp_layer_types`` entries ``hash_moe`` are ``moe.hash_layers`` (their ``tid2eid`` table,
  int64, loaded and written as it is), the rest top-k by ``scoring_func`` (``sqrtsoftplus`` or ``sigmoid``) plus
  the selection bias, the chosen weights always normalized (transformers ignores ``norm_topk_prob``) and times
  ``routed_scaling_factor``; one shared expert of ``moe_intermediate_size``; every expert computes
  ``glu_variant: limited`` with ``glu_limit = swiglu_limit``;
- residual: ``residual: mhc`` with ``hc_mult`` streams, ``hc_sinkhorn_iters`` and ``hc_eps``; pre-norm RMSNorm.

Tensor names are those ``save_pretrained`` writes, DeepSeek's own (``attn.wq_a``, ``attn.wkv``, ``attn.attn_sink``,
``compressor.ape``, ``ffn.gate.tid2eid``, ``hc_attn_fn``, ``head.weight``, ...): transformers renames them to its
modules' names on load and back on save. ``num_nextn_predict_layers`` is not mapped (transformers builds no MTP
layer; ``mtp.*`` tensors are ignored as it ignores them); export writes 0.

A left-padded batch: transformers pools a padded row's pad tokens into its compressed entries (its windows are
aligned to slots); lmlab pools each row's own tokens, so every padded row computes what the row alone computes,
in lmlab and in transformers (tests compare each row with transformers' row alone).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..attention_variants import CompressedConfig
from ..config import AttentionConfig, ModelConfig, MoEConfig, RopeConfig, StreamsConfig
from .moe import MOE_SIZES
from .registry import (
    ACTIVATION_NAMES,
    ANY,
    Export,
    Family,
    HFTensors,
    Tensors,
    activation_from_hf,
    key_refused,
    model_config,
    refusal,
    register,
    shortest_period,
    tied_head,
    with_defaults,
)

# transformers' DeepseekV4Config defaults (5.25: V4-Flash's dimensions), for keys a config.json leaves out
DEEPSEEK_V4_DEFAULTS: dict[str, Any] = dict(
    vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43, num_attention_heads=64,
    num_key_value_heads=1, head_dim=512, q_lora_rank=1024, num_experts_per_tok=6, n_routed_experts=256,
    n_shared_experts=1, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, max_position_embeddings=1048576,
    rope_theta=10000.0, compress_rope_theta=160000.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    swiglu_limit=10.0, sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64, index_head_dim=128,
    index_topk=512, hidden_act="silu", initializer_range=0.02, rms_norm_eps=1e-6, tie_word_embeddings=False,
    attention_bias=False, mlp_bias=False, layer_types=None, mlp_layer_types=None, compress_rates=None,
    partial_rotary_factor=None, rope_parameters=None,
)
KINDS = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
LAYER_TYPES = {kind: name for name, kind in KINDS.items()}
LEGACY_RATIOS = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
SCORINGS = ("sqrtsoftplus", "sigmoid")  # transformers' routers score with ACT2FN[scoring_func]: no softmax there


# ============================================================== config.json -> ModelConfig
def layer_types_of(hf: Mapping[str, Any]) -> list[str]:
    """config.json's attention schedule, as transformers resolves it: ``layer_types``, else the legacy per-layer
    ``compress_ratios`` (0 / 4 / 128), else two HCA layers then CSA and HCA alternating."""
    n = hf["num_hidden_layers"]
    if hf.get("layer_types") is not None:
        types = list(hf["layer_types"])
    elif hf.get("compress_ratios") is not None:
        unknown = [r for r in hf["compress_ratios"] if r not in LEGACY_RATIOS]
        if unknown:
            raise key_refused(hf, "compress_ratios", f"{unknown[0]} is none of {sorted(LEGACY_RATIOS)}")
        types = [LEGACY_RATIOS[r] for r in hf["compress_ratios"]]
    else:
        types = ["heavily_compressed_attention"] * min(n, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))]
    types = types[:n]
    unknown = [t for t in types if t not in KINDS]
    if unknown or len(types) != n:
        raise key_refused(hf, "layer_types", f"one of {sorted(KINDS)} per layer (num_hidden_layers={n})")
    return types


def hash_layers_of(hf: Mapping[str, Any]) -> int:
    """How many first layers route by token id: ``mlp_layer_types`` (hash_moe, then moe), else ``num_hash_layers``."""
    n = hf["num_hidden_layers"]
    types = hf.get("mlp_layer_types")
    if types is None:
        return min(n, hf.get("num_hash_layers", 3))
    k = sum(t == "hash_moe" for t in types)
    if list(types[:n]) != ["hash_moe"] * k + ["moe"] * (n - k) or len(types) < n:
        raise key_refused(hf, "mlp_layer_types", "lmlab routes a first run of layers by token id (moe.hash_layers): "
                          "'hash_moe' layers, then 'moe' ones, one entry per layer")
    return k


def rotary_sets(hf: Mapping[str, Any], fraction: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """(main, compress) rotary parameters, nested as transformers saves them or flat as a new config gives them
    (the flat keys are the compress set's YaRN, the thetas the top-level ones)."""
    params = hf.get("rope_parameters") or {}
    if isinstance(params.get("main"), Mapping) and isinstance(params.get("compress"), Mapping):
        return dict(params["main"]), dict(params["compress"])
    main = {"rope_type": "default", "rope_theta": hf["rope_theta"], "partial_rotary_factor": fraction}
    compress = {**{k: v for k, v in params.items() if k not in ("main", "compress")},
                "rope_theta": hf["compress_rope_theta"], "partial_rotary_factor": fraction}
    compress.setdefault("rope_type", compress.pop("type", "default"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return main, compress


def section_rope(hf: Mapping[str, Any], compress: Mapping[str, Any]) -> dict[str, Any]:
    """The section's rotary fields for transformers' ``compress`` set: its theta, and YaRN where it is one."""
    kind = compress.get("rope_type", "default")
    fields: dict[str, Any] = {"rope_base": compress.get("rope_theta", hf["compress_rope_theta"])}
    if kind == "default":
        return fields
    if kind != "yarn":
        raise ValueError(f"config.json (model_type 'deepseek_v4') has a compress rotary of type {kind!r}; lmlab maps "
                         "'default' and 'yarn'")
    for key, ok in (("attention_factor", 1.0), ("mscale", None), ("mscale_all_dim", None), ("truncate", True)):
        if compress.get(key, ok) != ok:
            raise ValueError(f"config.json (model_type 'deepseek_v4') has rope_parameters.compress.{key}="
                             f"{compress.get(key)!r}; lmlab's compressed layers compute YaRN with attention factor 1 "
                             "and truncated bounds, as DeepSeek-V4 does")
    factor = compress.get("factor")
    original = compress.get("original_max_position_embeddings")
    if factor is None:
        factor = hf["max_position_embeddings"] / original
    return {**fields, "yarn_factor": float(factor), "yarn_original_max_seq_len": original,
            "yarn_beta_fast": float(compress.get("beta_fast") or 32.0),
            "yarn_beta_slow": float(compress.get("beta_slow") or 1.0)}


def deepseek_v4_config(hf: Mapping[str, Any]) -> ModelConfig:
    hf = with_defaults(hf, DEEPSEEK_V4_DEFAULTS)
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise key_refused(hf, key, "DeepSeek-V4 has no biases, and lmlab maps it without")
    for key, value, why in (("num_key_value_heads", 1, "DeepSeek-V4's attention has one key/value head"),
                            ("n_shared_experts", 1, "transformers builds one shared expert whatever it says")):
        if hf[key] != value:
            raise key_refused(hf, key, why)
    if hf["scoring_func"] not in SCORINGS:
        raise key_refused(hf, "scoring_func", f"transformers' DeepSeek-V4 routers score with one of {SCORINGS}")
    head_dim = hf["head_dim"]
    legacy_rope = hf.get("qk_rope_head_dim")
    fraction = hf["partial_rotary_factor"] or (legacy_rope / head_dim if legacy_rope else 64 / 512)
    main, compress = rotary_sets(hf, fraction)
    if main.get("rope_type", "default") != "default":
        raise ValueError("config.json (model_type 'deepseek_v4') scales its main rotary set; transformers rotates "
                         "sliding layers unscaled, and lmlab maps only that")
    for name, params in (("main", main), ("compress", compress)):
        if params.get("partial_rotary_factor", fraction) != fraction:
            raise key_refused(hf, "rope_parameters", f"its {name} set rotates another fraction than "
                              f"partial_rotary_factor={fraction}")
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128, **(hf["compress_rates"] or {})}
    rates["compressed_sparse_attention"] = hf.get("compress_rate_csa", rates["compressed_sparse_attention"])
    rates["heavily_compressed_attention"] = hf.get("compress_rate_hca", rates["heavily_compressed_attention"])
    kinds = shortest_period([KINDS[t] for t in layer_types_of(hf)])
    section = CompressedConfig(
        q_lora_rank=hf["q_lora_rank"], rope_head_dim=int(head_dim * fraction), window=hf["sliding_window"],
        layers=kinds, csa_rate=rates["compressed_sparse_attention"], hca_rate=rates["heavily_compressed_attention"],
        index_heads=hf["index_n_heads"], index_head_dim=hf["index_head_dim"], index_topk=hf["index_topk"],
        o_groups=hf["o_groups"], o_lora_rank=hf["o_lora_rank"], **section_rope(hf, compress))
    moe = MoEConfig(
        n_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"], n_shared=1, scoring=hf["scoring_func"],
        normalize_top_k=True, routed_scale=hf["routed_scaling_factor"], hash_layers=hash_layers_of(hf))
    return model_config(
        hf, vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"], n_kv_heads=1, head_dim=head_dim, d_ff=hf["moe_intermediate_size"],
        max_seq_len=hf["max_position_embeddings"], norm="rmsnorm", norm_position="pre", positions="rope", ffn="glu",
        activation=activation_from_hf(hf["hidden_act"], "hidden_act"), glu_variant="limited",
        glu_limit=hf["swiglu_limit"], rope=RopeConfig(base=main.get("rope_theta", hf["rope_theta"]),
                                                      layout="interleaved"),
        bias=False, tie_embeddings=bool(hf["tie_word_embeddings"]), norm_eps=hf["rms_norm_eps"],
        init_std=hf["initializer_range"], moe=moe, attention=AttentionConfig(sinks="learned"), compressed=section,
        residual="mhc", residual_streams=StreamsConfig(n=hf["hc_mult"], sinkhorn_iters=hf["hc_sinkhorn_iters"],
                                                       eps=hf["hc_eps"]),
    )


# ============================================================== tensor names, both ways
# lmlab's name under a block -> transformers' saved name under the layer, for every layer
LAYER = {"norm1.weight": "attn_norm.weight", "norm2.weight": "ffn_norm.weight",
         **{f"{ours}_residual.{p}": f"hc_{theirs}_{p}" for ours, theirs in (("attn", "attn"), ("ffn", "ffn"))
            for p in ("fn", "base", "scale")},
         "attn.q_down.weight": "attn.wq_a.weight", "attn.q_norm.weight": "attn.q_norm.weight",
         "attn.q_up.weight": "attn.wq_b.weight", "attn.kv.weight": "attn.wkv.weight",
         "attn.kv_norm.weight": "attn.norm.weight", "attn.out_down.weight": "attn.wo_a.weight",
         "attn.out_up.weight": "attn.wo_b.weight", "attn.sinks": "attn.attn_sink",
         "ffn.router.weight": "ffn.gate.weight"}
# ... a compressor's, under attn.compressor. or attn.indexer.compressor. on both sides
COMPRESSOR = {"kv.weight": "wkv.weight", "gate.weight": "wgate.weight", "position_bias": "ape",
              "norm.weight": "norm.weight"}
INDEXER = {"attn.indexer.q_up.weight": "attn.indexer.wq_b.weight",
           "attn.indexer.weights.weight": "attn.indexer.weights_proj.weight"}
TOP = {"embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
       **{f"streams.{p}": f"model.hc_head.hc_{p}" for p in ("fn", "base", "scale")}}


def layer_names(cfg: ModelConfig, layer: int) -> dict[str, str]:
    """lmlab name -> transformers' saved name of every tensor of block ``layer`` but its experts."""
    kind, ours, hf = cfg.compressed.kind(layer), f"blocks.{layer}.", f"model.layers.{layer}."
    names = {ours + a: hf + b for a, b in LAYER.items()}
    parts = {"sliding": (), "csa": ("attn.compressor.", "attn.indexer.compressor."), "hca": ("attn.compressor.",)}
    for prefix in parts[kind]:
        names.update({f"{ours}{prefix}{a}": f"{hf}{prefix}{b}" for a, b in COMPRESSOR.items()})
    if kind == "csa":
        names.update({ours + a: hf + b for a, b in INDEXER.items()})
    table = "ffn.router.table" if cfg.moe.hashes(layer) else "ffn.router.score_bias"
    names[ours + table] = hf + ("ffn.gate.tid2eid" if cfg.moe.hashes(layer) else "ffn.gate.bias")
    return names


def experts_from_hf(cfg: ModelConfig, t: HFTensors, layer: int) -> dict[str, torch.Tensor | None]:
    """Block ``layer``'s experts: each one's w1 (gate), w3 (up), w2 (down) stacked as [gate; up] and down; the shared
    expert as a stack of one."""
    ours, hf = f"blocks.{layer}.ffn.", f"model.layers.{layer}.ffn."
    gate_up = [t.cat([f"{hf}experts.{e}.w1.weight", f"{hf}experts.{e}.w3.weight"]) for e in range(cfg.moe.n_experts)]
    down = [t.take(f"{hf}experts.{e}.w2.weight") for e in range(cfg.moe.n_experts)]
    shared_gate_up = t.cat([f"{hf}shared_experts.w1.weight", f"{hf}shared_experts.w3.weight"])
    shared_down = t.take(f"{hf}shared_experts.w2.weight")
    stack = (lambda ws: None if any(w is None for w in ws) else torch.stack(ws))  # noqa: E731
    return {f"{ours}experts.gate_up": stack(gate_up), f"{ours}experts.down": stack(down),
            f"{ours}shared.gate_up": stack([shared_gate_up]), f"{ours}shared.down": stack([shared_down])}


def experts_to_hf(cfg: ModelConfig, sd: Tensors, layer: int) -> dict[str, torch.Tensor]:
    """The inverse of :func:`experts_from_hf`: one tensor per expert, as ``save_pretrained`` writes them."""
    ours, hf = f"blocks.{layer}.ffn.", f"model.layers.{layer}.ffn."
    out = {}
    for name, gate_up, down in ((f"{hf}experts.{e}.", sd[f"{ours}experts.gate_up"][e], sd[f"{ours}experts.down"][e])
                                for e in range(cfg.moe.n_experts)):
        gate, up = gate_up.chunk(2)
        out.update({f"{name}w1.weight": gate, f"{name}w3.weight": up, f"{name}w2.weight": down})
    gate, up = sd[f"{ours}shared.gate_up"][0].chunk(2)
    out.update({f"{hf}shared_experts.w1.weight": gate, f"{hf}shared_experts.w3.weight": up,
                f"{hf}shared_experts.w2.weight": sd[f"{ours}shared.down"][0]})
    return out


def check_table(cfg: ModelConfig, name: str, table: torch.Tensor | None) -> None:
    """A hash layer's token-to-expert table names real experts: an integer table of values in [0, n_experts)."""
    if table is None or table.is_meta:
        return
    if table.is_floating_point() or table.shape != (cfg.vocab_size, cfg.moe.top_k):
        raise ValueError(f"{name} must be an integer table of ({cfg.vocab_size}, {cfg.moe.top_k}) expert ids (vocab, "
                         f"num_experts_per_tok), not {table.dtype} {tuple(table.shape)}")
    if table.numel() and (int(table.min()) < 0 or int(table.max()) >= cfg.moe.n_experts):
        raise ValueError(f"{name} names experts outside [0, {cfg.moe.n_experts}) (n_routed_experts); the checkpoint "
                         "is damaged or belongs to another config")


def deepseek_v4_weights(cfg: ModelConfig, t: HFTensors) -> dict[str, torch.Tensor | None]:
    if cfg.attention_variant != "compressed" or cfg.moe is None or cfg.residual != "mhc":
        raise ValueError(f"a DeepSeek-V4 checkpoint needs attention.variant='compressed', moe and residual='mhc', not "
                         f"{cfg.attention_variant!r}, moe={'set' if cfg.moe else None}, {cfg.residual!r}")
    sd = {ours: t.take(theirs) for ours, theirs in TOP.items()}
    for layer in range(cfg.n_layers):
        for ours, theirs in layer_names(cfg, layer).items():
            sd[ours] = t.take(theirs)
            if ours.endswith("router.table"):
                check_table(cfg, theirs, sd[ours])
        sd.update(experts_from_hf(cfg, t, layer))
    sd["head.weight"] = tied_head(cfg, t, "head.weight", sd["embed.weight"])
    return sd


def deepseek_v4_weights_to_hf(cfg: ModelConfig, sd: Tensors) -> dict[str, torch.Tensor]:
    out = {theirs: sd[ours] for ours, theirs in TOP.items()}
    for layer in range(cfg.n_layers):
        out.update({theirs: sd[ours] for ours, theirs in layer_names(cfg, layer).items()})
        out.update(experts_to_hf(cfg, sd, layer))
    if not cfg.tie_embeddings:
        out["head.weight"] = sd["head.weight"]
    return out


# ============================================================== lmlab -> DeepSeek-V4
def deepseek_v4_refusal(cfg: ModelConfig) -> str | None:
    """What transformers' DeepSeek-V4 cannot compute of ``cfg`` where the values it computes are allowed one by one:
    its attention, residual, sinks, layout, clamped unit, and router are not choices there."""
    if cfg.attention_variant != "compressed":
        return f"attention.variant={cfg.attention_variant!r} (DeepSeek-V4's attention is compressed attention)"
    why = refusal(cfg, {
        "residual": ("mhc", "DeepSeek-V4's residual is manifold-constrained hyper-connections"),
        "attention.sinks": ("learned", "every DeepSeek-V4 head has a learned sink"),
        "rope.layout": ("interleaved", "DeepSeek-V4 rotates interleaved pairs"),
        "glu_variant": ("limited", "DeepSeek-V4's experts clamp gate and up by swiglu_limit"),
        "moe.normalize_top_k": (True, "transformers' DeepSeek-V4 normalizes the chosen weights"),
        "moe.n_shared": (1, "DeepSeek-V4 has one shared expert"),
        "moe.shared_d_ff": (None, "its shared expert is as wide as a routed one"),
        "moe.first_dense": (0, "every DeepSeek-V4 layer is a mixture"),
    })
    if why is None and cfg.moe.scoring not in SCORINGS:
        why = f"moe.scoring={cfg.moe.scoring!r} (transformers' DeepSeek-V4 scores with {' or '.join(SCORINGS)})"
    return why


def deepseek_v4_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    c, moe, n = cfg.compressed, cfg.moe, cfg.n_layers
    fraction = c.rope_head_dim / cfg.head_dim
    compress: dict[str, Any] = {"rope_type": "default", "rope_theta": c.rope_base, "partial_rotary_factor": fraction}
    if c.yarn_factor > 1:  # the ramp's bounds written where they are not transformers' defaults
        compress.update(rope_type="yarn", factor=c.yarn_factor, attention_factor=1.0,
                        original_max_position_embeddings=c.yarn_original_max_seq_len or cfg.max_seq_len,
                        **{k: v for k, v, default in (("beta_fast", c.yarn_beta_fast, 32.0),
                                                      ("beta_slow", c.yarn_beta_slow, 1.0)) if v != default})
    main = {"rope_type": "default", "rope_theta": cfg.rope.base, "partial_rotary_factor": fraction}
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=n, num_attention_heads=cfg.n_heads,
        num_key_value_heads=1, head_dim=cfg.head_dim, q_lora_rank=c.q_lora_rank,
        moe_intermediate_size=moe.expert_width(cfg.d_ff), n_routed_experts=moe.routed_experts,
        num_experts_per_tok=moe.active_experts, n_shared_experts=1, scoring_func=moe.scoring, norm_topk_prob=True,
        routed_scaling_factor=moe.routed_scale, swiglu_limit=cfg.glu_limit, hidden_act=ACTIVATION_NAMES[cfg.activation],
        mlp_layer_types=["hash_moe" if moe.hashes(i) else "moe" for i in range(n)],
        layer_types=[LAYER_TYPES[c.kind(i)] for i in range(n)],
        compress_rates={"compressed_sparse_attention": c.csa_rate, "heavily_compressed_attention": c.hca_rate},
        sliding_window=c.window, o_groups=c.o_groups, o_lora_rank=c.o_lora_rank, index_n_heads=c.index_heads,
        index_head_dim=c.index_head_dim, index_topk=c.index_topk, hc_mult=cfg.n_streams,
        hc_sinkhorn_iters=cfg.residual_streams.sinkhorn_iters, hc_eps=cfg.residual_streams.eps,
        max_position_embeddings=cfg.max_seq_len, rope_theta=cfg.rope.base, compress_rope_theta=c.rope_base,
        partial_rotary_factor=fraction, rope_parameters={"main": main, "compress": compress},
        rms_norm_eps=cfg.norm_eps, initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False, mlp_bias=False, attention_dropout=0.0, num_nextn_predict_layers=0,
        output_router_logits=False,
    )


DEEPSEEK_V4: Mapping[str, Any] = {
    **MOE_SIZES, "compressed": ANY, "attention.sinks": ("learned",), "residual": ("mhc",), "residual_streams": ANY,
    "rope.layout": ("interleaved",), "rope.base": ANY, "activation": tuple(ACTIVATION_NAMES),
    "glu_variant": ("limited",), "glu_limit": ANY, "moe.n_shared": (1,), "moe.scoring": SCORINGS,
    "moe.normalize_top_k": (True,), "moe.routed_scale": ANY, "moe.hash_layers": ANY,
}

register("deepseek_v4", Family(deepseek_v4_config, deepseek_v4_weights, (r"(^|\.)mtp\.",), Export(
    "DeepseekV4ForCausalLM", moe=True, refuse=deepseek_v4_refusal, config=deepseek_v4_to_hf,
    weights=deepseek_v4_weights_to_hf, name="DeepSeek-V4", computes=DEEPSEEK_V4,
), tables=(r"\.ffn\.gate\.tid2eid$",)))
