"""Qwen3, Qwen3-MoE, OLMo 2, OLMoE (and GLM-4-MoE's use_qk_norm) both ways: tiny random transformers
checkpoints loaded with ``from_hf`` give the same logits and come back identical through ``to_hf``; lmlab models with
``qk_norm`` (and OLMo 2's reordered norms) export as these families with the same logits; and what
does not map is refused by name."""

from __future__ import annotations

import json
import re

import pytest
import torch
from test_export import lm, load_hf, randomized_hf, relative_difference
from torch.testing import assert_close

import lmlab
from lmlab import Transformer
from lmlab.hf import config_from_hf, detect_model_type, read_safetensors, state_dict_from_hf, to_hf

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

V = 97
LLAMA = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
MOE_LAYOUT = dict(LLAMA, hidden_size=32, intermediate_size=48, num_hidden_layers=3)
MOE = dict(n_experts=4, top_k=2, d_expert=16)

# name -> (transformers config class name, its arguments, what the loaded lmlab config must say)
HF_CASES = {
    "qwen3": ("Qwen3Config", dict(LLAMA, head_dim=24, tie_word_embeddings=True), dict(qk_norm="head", head_dim=24)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(MOE_LAYOUT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                         decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True),
                  dict(qk_norm="head", moe=dict(first_dense=1, normalize_top_k=True, n_shared=0))),
    "qwen3_moe_every_other": ("Qwen3MoeConfig", dict(MOE_LAYOUT, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=16, decoder_sparse_step=2),
                              dict(qk_norm="head", moe=dict(every=2, first_dense=1))),
    "olmo2": ("Olmo2Config", dict(LLAMA), dict(qk_norm="full", norm_position="reordered")),
    "olmo2_tied_mha": ("Olmo2Config", dict(LLAMA, num_key_value_heads=4, tie_word_embeddings=True),
                       dict(qk_norm="full", norm_position="reordered", n_kv_heads=4)),
    "olmoe": ("OlmoeConfig", dict(MOE_LAYOUT, num_experts=4, num_experts_per_tok=2),
              dict(qk_norm="full", norm_position="pre", moe=dict(n_experts=4, normalize_top_k=False))),
    "glm4_moe_qk_norm": ("Glm4MoeConfig", dict(
        MOE_LAYOUT, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, use_qk_norm=True,
        partial_rotary_factor=1.0, num_nextn_predict_layers=0), dict(qk_norm="head", moe=dict(scoring="sigmoid"))),
    # GLM-4.5's own rotary: the first half of each head (Glm4MoeConfig's default partial_rotary_factor 0.5)
    "glm4_moe_partial_rotary": ("Glm4MoeConfig", dict(
        MOE_LAYOUT, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
        n_group=4, topk_group=2, first_k_dense_replace=1, use_qk_norm=True, num_nextn_predict_layers=0),
        dict(qk_norm="head", rope=dict(partial=0.5))),
    "glm4_moe_partial_rotary_yarn": ("Glm4MoeConfig", dict(
        MOE_LAYOUT, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
        first_k_dense_replace=1, num_nextn_predict_layers=0, partial_rotary_factor=0.25, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 1e4,
            "partial_rotary_factor": 0.25}),
        dict(qk_norm="none", rope=dict(partial=0.25, scaling="yarn"))),
}


def _logits(model, idx):
    with torch.no_grad():
        return model(idx).logits


def _tokens(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (2, length), generator=torch.Generator().manual_seed(seed))


def _hf_model(case: str):
    config_class, kwargs, _ = HF_CASES[case]
    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(0)
    return randomized_hf(AutoModelForCausalLM.from_config(config)), config


def _says(cfg, expected: dict) -> None:
    for field, value in expected.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                assert getattr(getattr(cfg, field), sub) == v, (field, sub)
        else:
            assert getattr(cfg, field) == value, field


@pytest.mark.parametrize("case", HF_CASES)
def test_hf_checkpoint_loads_with_the_same_logits_and_comes_back_identical(tmp_path, case):
    original, config = _hf_model(case)
    original.save_pretrained(tmp_path / "original")
    ours = lmlab.from_hf(tmp_path / "original")
    _says(ours.config, HF_CASES[case][2])
    idx = _tokens(24)
    ref = _logits(original, idx)
    assert ref.std() > 0.5, "reference logits are near constant; the comparison would prove little"
    assert_close(_logits(ours, idx), ref)  # fp32 defaults: rtol 1.3e-6, atol 1e-5

    done = to_hf(ours, tmp_path / "exported", architecture=config.model_type)
    a, b = read_safetensors(tmp_path / "original"), read_safetensors(done.path)
    assert sorted(a) == sorted(b)
    assert not [n for n in a if not torch.equal(a[n], b[n])]
    before, after = (json.loads((p / "config.json").read_text()) for p in (tmp_path / "original", done.path))
    assert config_from_hf(after) == config_from_hf(before)
    assert torch.equal(_logits(load_hf(done.path), idx), ref)


@pytest.mark.parametrize("case", ["qwen3", "qwen3_moe", "olmo2", "olmoe"])
def test_state_dict_from_hf_tells_these_families_from_tensor_names(case):
    """Without a model_type, the q/k norm tensors (and OLMo 2's norm names) pick the one family that maps them."""
    original, config = _hf_model(case)
    cfg = config_from_hf(config.to_dict())
    sd = original.state_dict()
    assert detect_model_type(cfg, sd) == config.model_type
    ours = Transformer(cfg).eval()
    ours.load_state_dict(state_dict_from_hf(cfg, sd))
    idx = _tokens(16)
    assert_close(_logits(ours, idx), _logits(original, idx))


# name -> (lmlab fields, the architecture to_hf chooses by itself)
LMLAB_CASES = {
    "qwen3": (dict(qk_norm="head", n_kv_heads=2, head_dim=16, tie_embeddings=True), "qwen3"),
    "qwen3_interleaved": ({"qk_norm": "head", "n_kv_heads": 2, "rope.layout": "interleaved"}, "qwen3"),
    "qwen3_moe": (dict(qk_norm="head", n_layers=3, n_kv_heads=2, moe=MOE | dict(every=2, normalize_top_k=True)),
                  "qwen3_moe"),
    "olmo2": (dict(qk_norm="full", norm_position="reordered", n_kv_heads=2), "olmo2"),
    "olmo2_interleaved": ({"qk_norm": "full", "norm_position": "reordered", "n_kv_heads": 1,
                           "rope.layout": "interleaved", "rope.base": 5e5}, "olmo2"),
    "olmoe": (dict(qk_norm="full", n_kv_heads=2, moe=MOE), "olmoe"),
    "glm4_moe_qk_norm": (dict(qk_norm="head", n_kv_heads=2, moe=MOE | dict(scoring="sigmoid", n_groups=2,
                                                                           n_shared=1, first_dense=1)), "glm4_moe"),
    "glm4_moe_partial_rotary": ({"n_kv_heads": 2, "rope.partial": 0.5, "moe": MOE | dict(scoring="sigmoid")},
                                "glm4_moe"),
    # interleaved pairs within the rotated half: only those rows (and their q/k norm gains) are permuted
    "glm4_moe_partial_interleaved": ({"qk_norm": "head", "n_kv_heads": 2, "rope.partial": 0.5,
                                      "rope.layout": "interleaved", "moe": MOE | dict(scoring="sigmoid")}, "glm4_moe"),
}


@pytest.mark.parametrize("case", LMLAB_CASES)
def test_lmlab_model_exports_as_the_family_with_the_same_logits(tmp_path, case):
    fields, family = LMLAB_CASES[case]
    model = lm(**fields)
    done = to_hf(model, tmp_path / "out")
    assert done.model_type == family
    hf = load_hf(done.path)
    idx = _tokens(model.config.max_seq_len + 8)  # past the context: rotary extrapolates the same way
    ref = _logits(hf, idx)
    assert ref.std() > 0.5
    _, relative = relative_difference(_logits(model, idx), ref)
    assert relative <= 1e-4
    assert config_from_hf(json.loads((done.path / "config.json").read_text())).qk_norm == model.config.qk_norm


def test_the_q_k_norm_gains_are_used_in_both_directions(tmp_path):
    """Scaling one q/k norm gain changes the exported model's logits as it changes lmlab's: the gains are
    mapped to where transformers reads them, not dropped."""
    model = lm(qk_norm="full", norm_position="reordered", n_kv_heads=2)
    idx = _tokens(16)
    before = _logits(model, idx)
    with torch.no_grad():
        model.blocks[0].attn.qk_norm.k_norm.weight.mul_(3.0)
    after = _logits(model, idx)
    assert not torch.allclose(before, after, atol=1e-3)
    hf = load_hf(to_hf(model, tmp_path / "out").path)
    assert relative_difference(after, _logits(hf, idx))[1] <= 1e-4


# ================================================================== refusals
@pytest.mark.parametrize("model_type, changes, message", [
    ("qwen3", dict(layer_types=["sliding_attention", "full_attention"]), "sliding_attention layers and "
                                                                          "sliding_window null; set sliding_window"),
    ("qwen3", dict(attention_bias=True), "attention_bias=True"),
    ("qwen3_moe", dict(use_sliding_window=True, max_window_layers=1), "has max_window_layers=1: transformers' "
                                                                      "Qwen3MoE ignores it and slides all 2 layers"),
    ("qwen3_moe", dict(use_sliding_window=True, layer_types=["full_attention", "sliding_attention"]),
     "layer_types=['full_attention', 'sliding_attention']: transformers' Qwen3MoE ignores it and slides every layer"),
    ("qwen3_moe", dict(num_experts=0), "load it as model_type 'qwen3'"),
    ("qwen3_moe", dict(decoder_sparse_step=2, mlp_only_layers=[1]), "lmlab expresses only 'every n-th layer"),
    ("olmo2", dict(attention_bias=True), "attention_bias=True"),
    ("olmoe", dict(clip_qkv=8.0), "clip_qkv=8.0: lmlab does not clamp"),
    ("olmoe", dict(head_dim=8), "head_dim=8: OLMoE's q/k norms span hidden_size"),
])
def test_config_from_hf_refuses_what_lmlab_cannot_express(model_type, changes, message):
    base = dict(LLAMA, model_type=model_type, num_hidden_layers=2)
    with pytest.raises(ValueError, match=re.escape(message)):
        config_from_hf({**base, **changes})


@pytest.mark.parametrize("fields, message", [
    (dict(norm_position="sandwich"), "olmo2: norm_position='sandwich' (OLMo 2 normalizes each sublayer's output)"),
    # (EXAONE 4 computes per-head q/k norms with reordered norms, but not partial rotary)
    ({"qk_norm": "head", "norm_position": "reordered", "rope.partial": 0.5},
     "olmo2: qk_norm='head' (OLMo 2 normalizes the whole query"),
    (dict(qk_norm="full"), "olmo2: norm_position='pre' (OLMo 2 normalizes each sublayer's output)"),
    (dict(qk_norm="head", bias=True), "qwen3: bias=True (Qwen3 has no biases outside attention)"),
    (dict(attn_gate="elementwise"), "attn_gate='elementwise' has no exact transformers architecture"),
    (dict(attn_gate="headwise", qk_norm="head"), "attn_gate='headwise' has no exact transformers architecture"),
    (dict(qk_norm="full", d_model=48, n_heads=4, head_dim=8, moe=MOE), "olmoe: head_dim=8"),
    ({"rope.partial": 0.5}, "llama: rope.partial=0.5 (Llama rotates every dimension of each head)"),
])
def test_export_refuses_what_no_family_computes(tmp_path, fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        to_hf(lm(**fields), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_sandwich_and_reordered_are_refused_by_the_pre_norm_families(tmp_path):
    """Without a q/k norm only the pre-norm families are candidates, and each names the placement."""
    with pytest.raises(ValueError) as e:
        to_hf(Transformer(lm(norm_position="reordered").config), tmp_path / "out")
    message = str(e.value)
    for family in ("llama", "mistral"):
        assert f"{family}: norm_position='reordered'" in message
    assert "--model.qk_norm full for olmo2" in message  # the one-field change that makes it OLMo 2
