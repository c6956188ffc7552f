"""SmolLM3 both ways: the Llama layout with NoPE layers (``no_rope_layers``: every n-th layer
without rotary positions, ``rope.nope_every``) and, optionally, sliding windows on chosen layers."""

from __future__ import annotations

from typing import Any, Mapping

from ..config import ModelConfig
from .dense import (
    LLAMA_DEFAULTS,
    LLAMA_IGNORE,
    LLAMA_LAYOUT,
    WINDOWS,
    llama_config,
    llama_layout_refusal,
    llama_layout_to_hf,
    llama_weights,
    llama_weights_to_hf,
    qwen_attention_to_hf,
)
from .registry import ANY, Export, Family, attention_from_hf, register, with_defaults

# transformers' SmolLM3Config defaults (5.x), for keys an older config.json leaves out
SMOLLM3_DEFAULTS: dict[str, Any] = dict(
    LLAMA_DEFAULTS, vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
    num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=32768, tie_word_embeddings=True,
    use_sliding_window=False, sliding_window=None, no_rope_layers=None, no_rope_layer_interval=4, layer_types=None,
    rope_theta=2000000.0,
)


def nope_every_from_hf(uses_rope: list[Any]) -> int:
    """``rope.nope_every`` for config.json's ``no_rope_layers`` (1 = the layer rotates, 0 = NoPE)."""
    n = len(uses_rope)
    for every in range(1, n + 1):
        if [int((i + 1) % every != 0) for i in range(n)] == [int(bool(u)) for u in uses_rope]:
            return every
    if all(uses_rope):
        return 0
    raise ValueError(
        f"config.json has no_rope_layers={list(uses_rope)}: lmlab's NoPE layers are every n-th layer "
        "(rope.nope_every), and this list is not such a pattern"
    )


def smollm3_config(hf: Mapping[str, Any]) -> ModelConfig:
    hf = with_defaults(hf, SMOLLM3_DEFAULTS)
    n = hf["num_hidden_layers"]
    uses_rope = hf["no_rope_layers"]
    if uses_rope is None:  # as SmolLM3Config.__post_init__ derives it
        uses_rope = [int((i + 1) % hf["no_rope_layer_interval"] != 0) for i in range(n)]
    window = hf["sliding_window"] if hf["use_sliding_window"] else None
    types = hf["layer_types"]
    if types is None:  # sliding where the layer has no rotary positions, as SmolLM3Config derives it
        types = ["sliding_attention" if window is not None and not r else "full_attention" for r in uses_rope]
    cfg = llama_config(hf, SMOLLM3_DEFAULTS)
    return cfg.replace(attention=attention_from_hf(types, window, n)).override(
        {"rope.nope_every": nope_every_from_hf(uses_rope)}
    )


def smollm3_refusal(cfg: ModelConfig) -> str | None:
    if cfg.bias != cfg.qkv_bias:
        return f"qkv_bias={cfg.qkv_bias} with bias={cfg.bias} (SmolLM3's attention_bias covers q, k, v and the output)"
    return llama_layout_refusal(cfg, "SmolLM3")


def smollm3_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **llama_layout_to_hf(cfg), "attention_bias": cfg.bias, "mlp_bias": cfg.bias,
        "no_rope_layers": [int(cfg.has_positions(i)) for i in range(cfg.n_layers)],
        "no_rope_layer_interval": cfg.rope.nope_every or SMOLLM3_DEFAULTS["no_rope_layer_interval"],
        **qwen_attention_to_hf(cfg),
    }


register("smollm3", Family(smollm3_config, llama_weights, LLAMA_IGNORE, Export(
    "SmolLM3ForCausalLM", moe=False, refuse=smollm3_refusal, config=smollm3_to_hf, weights=llama_weights_to_hf,
    name="SmolLM3", computes={**LLAMA_LAYOUT, **WINDOWS, "bias": (False, True), "rope.nope_every": ANY},
)))
