"""Per-layer attention families both ways: Mistral, Mixtral and Qwen3-MoE (every layer slides), Qwen2 and Qwen3
(layers from max_window_layers slide, or as layer_types says), Qwen2-MoE (every other layer below max_window_layers
slides, or as layer_types says), SmolLM3 (NoPE every n-th layer, sliding windows on
those); tiny random models built here, logits compared over a sequence several windows long, and the decode cache of a
loaded model against transformers' full forward."""

from __future__ import annotations

import pytest
import torch
from test_export import lm, load_hf, relative_difference
from test_hf import LLAMA, assert_left_padded_parity, logits, randomize_, saved, tokens

import lmlab
from lmlab.hf import to_hf

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)


def assert_parity(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Within 1e-5 of the largest logit: fp32 rounding (test_export allows 1e-4; NoPE layers' logits run large)."""
    assert ref.std() > 0.5, "reference logits are near constant; the comparison would prove little"
    _, relative = relative_difference(ours, ref)
    assert relative <= 1e-5, relative


W = 5  # the window; sequences of 20 tokens cross it four times
T = 20

HF_MODELS = {
    "mistral": lambda: MistralForCausalLM(MistralConfig(**LLAMA, sliding_window=W)),
    "qwen2_upper_layers_slide": lambda: Qwen2ForCausalLM(Qwen2Config(
        **{**LLAMA, "num_hidden_layers": 3}, use_sliding_window=True, sliding_window=W, max_window_layers=1)),
    "qwen2_layer_types": lambda: Qwen2ForCausalLM(Qwen2Config(
        **{**LLAMA, "num_hidden_layers": 3}, use_sliding_window=True, sliding_window=W,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}
THREE = {**LLAMA, "num_hidden_layers": 3}
EXPERTS = dict(num_experts_per_tok=2, tie_word_embeddings=False)
HF_MODELS.update({
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(**LLAMA, **EXPERTS, num_local_experts=4, sliding_window=W)),
    "qwen3_upper_layers_slide": lambda: Qwen3ForCausalLM(Qwen3Config(
        **THREE, head_dim=16, use_sliding_window=True, sliding_window=W, max_window_layers=1)),
    "qwen3_layer_types": lambda: Qwen3ForCausalLM(Qwen3Config(
        **THREE, head_dim=16, use_sliding_window=True, sliding_window=W,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **LLAMA, **EXPERTS, num_experts=4, moe_intermediate_size=16, use_sliding_window=True, sliding_window=W)),
})
QWEN2_MOE = dict(LLAMA, **EXPERTS, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                 use_sliding_window=True, sliding_window=W)
HF_MODELS.update({  # Qwen2MoeConfig's own rule: layers 0, 2, 4, ... below max_window_layers (here only layer 0)
    "qwen2_moe_even_layers_below_max": lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(
        **{**QWEN2_MOE, "num_hidden_layers": 4}, max_window_layers=2)),
    "qwen2_moe_layer_types": lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(
        **{**QWEN2_MOE, "num_hidden_layers": 3}, layer_types=["full_attention", "sliding_attention",
                                                             "sliding_attention"])),
})
SMOLLM3 = dict(LLAMA, num_hidden_layers=4, no_rope_layer_interval=2, pad_token_id=None)
HF_MODELS.update({
    "smollm3": lambda: SmolLM3ForCausalLM(SmolLM3Config(**SMOLLM3, tie_word_embeddings=False)),
    "smollm3_sliding_nope_layers": lambda: SmolLM3ForCausalLM(SmolLM3Config(
        **SMOLLM3, use_sliding_window=True, sliding_window=W, attention_bias=True, mlp_bias=True)),
})
NO_WINDOW = {"attention.window": None, "attention.pattern": ["global"]}
# case -> (what config.json maps to, a change of it that must change the logits: what the parity rests on)
EXPECTED = {
    "mistral": ({"attention.window": W, "attention.pattern": ("local",)}, NO_WINDOW),
    "qwen2_upper_layers_slide": ({"attention.window": W, "attention.pattern": ("global", "local", "local")},
                                 NO_WINDOW),
    "qwen2_layer_types": ({"attention.window": W, "attention.pattern": ("local", "global")},  # shortest repeat
                          NO_WINDOW),
    "mixtral": ({"attention.window": W, "attention.pattern": ("local",)}, NO_WINDOW),
    "qwen3_upper_layers_slide": ({"attention.window": W, "attention.pattern": ("global", "local", "local")},
                                 NO_WINDOW),
    "qwen3_layer_types": ({"attention.window": W, "attention.pattern": ("local", "global")}, NO_WINDOW),
    "qwen3_moe": ({"attention.window": W, "attention.pattern": ("local",)}, NO_WINDOW),
    "qwen2_moe_even_layers_below_max": ({"attention.window": W, "attention.pattern": ("local", "global", "global",
                                                                                      "global")}, NO_WINDOW),
    "qwen2_moe_layer_types": ({"attention.window": W, "attention.pattern": ("global", "local", "local")}, NO_WINDOW),
    "smollm3": ({"rope.nope_every": 2, "attention.window": None}, {"rope.nope_every": 0}),
    "smollm3_sliding_nope_layers": ({"rope.nope_every": 2, "attention.pattern": ("global", "local"), "bias": True},
                                    NO_WINDOW),
}


MEASURED: dict[str, float] = {}  # largest |logit difference| per case and direction, printed by the last test


def field(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("case", HF_MODELS)
def test_checkpoint_matches_transformers_both_ways(tmp_path, case):
    hf = randomize_(HF_MODELS[case]())
    ours = lmlab.from_hf(saved(hf, tmp_path / "hf"))
    mapped, ablation = EXPECTED[case]
    assert {k: field(ours.config, k) for k in mapped} == mapped
    idx = tokens(T)
    ref = logits(hf, idx)
    MEASURED[f"from_hf {case}"] = float((logits(ours, idx) - ref).abs().max())
    assert_parity(logits(ours, idx), ref)
    # the window or NoPE layers are what make them agree: the same weights without them differ
    without = lmlab.Transformer(ours.config.override(ablation)).eval()
    without.load_state_dict(ours.state_dict())
    assert not torch.allclose(logits(without, idx), ref, atol=1e-2)
    # and back: lmlab -> transformers gives the same logits again
    model_type = hf.config.model_type
    to_hf(ours, tmp_path / "out", architecture=model_type)  # and as the first family that fits:
    assert to_hf(ours, tmp_path / "auto").model_type == model_type
    back = load_hf(tmp_path / "out")
    assert type(back) is type(hf)
    _, relative = relative_difference(logits(back, idx), ref)
    assert relative <= 1e-4
    MEASURED[f"to_hf {case} (lmlab against the export in transformers)"] = float(
        (logits(back, idx) - logits(ours, idx)).abs().max())


@pytest.mark.parametrize("case", ["mistral", "qwen2_layer_types", "smollm3_sliding_nope_layers", "mixtral",
                                  "qwen3_layer_types", "qwen3_moe", "qwen2_moe_layer_types"])
def test_cached_decoding_of_a_sliding_checkpoint_equals_transformers_full_forward(tmp_path, case):
    hf = randomize_(HF_MODELS[case]())
    ours = lmlab.from_hf(saved(hf, tmp_path))
    idx = tokens(T, seed=1)
    cache = ours.new_cache(2, T)
    with torch.no_grad():
        parts = [ours(idx[:, :7], cache=cache).logits] + [ours(idx[:, t : t + 1], cache=cache).logits
                                                         for t in range(7, T)]
    assert_parity(torch.cat(parts, dim=1), logits(hf, idx))


def test_left_padded_batch_matches_transformers(tmp_path):
    """transformers' sliding mask counts cache slots; lmlab's counts positions: with left padding
    they agree on every real token."""
    hf = randomize_(HF_MODELS["mistral"]())
    ours = lmlab.from_hf(saved(hf, tmp_path))
    assert_left_padded_parity(hf, ours, tokens(T, seed=2))


WINDOWED = {"attention.window": W, "attention.pattern": ["local", "global"]}


@pytest.mark.parametrize("fields, architecture, message", [
    ({"moe": dict(n_experts=4, top_k=2, normalize_top_k=True), **WINDOWED}, "mixtral",
     "cannot export as 'mixtral': attention.pattern=['local', 'global'] (Mixtral's sliding window applies to every"),
    ({"moe": dict(n_experts=4, top_k=2), "qk_norm": "head", **WINDOWED}, "qwen3_moe",
     "cannot export as 'qwen3_moe': attention.pattern=['local', 'global'] (Qwen3-MoE's sliding window applies to"),
    ({"qk_norm": "head", **WINDOWED, "attention.sinks": "learned"}, "qwen3",
     "cannot export as 'qwen3': attention.sinks='learned' (Qwen3 has no attention sinks)"),
])
def test_windows_these_families_do_not_apply_are_refused(tmp_path, fields, architecture, message):
    with pytest.raises(ValueError) as err:
        to_hf(lm(**fields), tmp_path / "out", architecture=architecture)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_zz_report_largest_logit_differences(capsys):
    """Not a check: prints what the parity tests above measured (run the file with -s to see it)."""
    with capsys.disabled():
        for name, diff in sorted(MEASURED.items()):
            print(f"\n{name}: max |logit difference| {diff:.2e}", end="")
