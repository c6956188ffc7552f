"""gpt-oss both ways: tiny random ``GptOssForCausalLM`` checkpoints built here load with ``from_hf`` with the same
logits and come back identical through ``to_hf``; lmlab models (the gpt-oss preset among them) export as gpt_oss
with the same logits in transformers; each gpt-oss choice (router bias, clamped gated unit, sinks, windows,
YaRN) is shown to matter; what does not map is refused by its config.json key."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_comes_back_identical, decoded_logits
from test_export import assert_exports_and_reads_back, lm, load_hf
from test_hf import V, assert_left_padded_parity, assert_parity, logits, randomize_, saved, tokens

import lmlab
from lmlab import Transformer, feedforward
from lmlab.hf import config_from_hf, to_hf
from lmlab.hf.gpt_oss import gate_up_from_hf, gate_up_to_hf

transformers = pytest.importorskip("transformers")
from transformers import GptOssConfig, GptOssForCausalLM  # noqa: E402

W, T = 5, 20  # the window; 20 tokens cross it four times
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 16, "rope_theta": 150000.0}
GPT_OSS = dict(vocab_size=V, hidden_size=32, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=W,
               max_position_embeddings=64, rope_parameters=YARN, bos_token_id=None, eos_token_id=None,
               pad_token_id=None)
# name -> (GptOssConfig arguments, factor on the experts' gate/up weights, what the loaded config must say)
HF_CASES = {
    "alternating_yarn": (GPT_OSS, 1.0, {"attention.pattern": ("local", "global"), "attention.window": W,
                                        "attention.sinks": "learned", "rope.scaling": "yarn", "rope.truncate": False,
                                        "glu_variant": "clamped", "activation": "quick_gelu", "bias": True,
                                        "moe.router_bias": True, "moe.normalize_top_k": True}),
    "clamps_active_all_global_tied": (dict(GPT_OSS, layer_types=["full_attention"] * 3, tie_word_embeddings=True,
                                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), 6.0,
                                      {"attention.window": None, "rope.scaling": "none", "tie_embeddings": True}),
}
# what the parity rests on: each change of the loaded config alone changes the logits
ABLATIONS = {
    "alternating_yarn": [{"glu_variant": "plain"}, {"activation": "silu"}, {"moe.router_bias": False},
                         {"attention.sinks": "none"}, {"attention.window": None, "attention.pattern": ["global"]},
                         {"rope.scaling": "none"}],
    "clamps_active_all_global_tied": [{"glu_variant": "plain"}],
}


def field(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def hf_model(case: str) -> GptOssForCausalLM:
    kwargs, gate_up_scale, _ = HF_CASES[case]
    torch.manual_seed(0)
    model = randomize_(GptOssForCausalLM(GptOssConfig(**kwargs)))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(gate_up_scale)
    return model


def same_weights(model: Transformer, config) -> Transformer:
    """``model``'s weights in a model of ``config`` (those its change left without a place are dropped)."""
    other = Transformer(config).eval()
    keys = other.state_dict().keys()
    other.load_state_dict({k: v for k, v in model.state_dict().items() if k in keys}, strict=False)
    return other


@pytest.mark.parametrize("case", HF_CASES)
def test_checkpoint_matches_transformers_both_ways(tmp_path, case):
    hf = hf_model(case)
    ours = lmlab.from_hf(saved(hf, tmp_path / "hf"))
    expected = HF_CASES[case][2]
    assert {k: field(ours.config, k) for k in expected} == expected
    idx = tokens(T)
    ref = logits(hf, idx)
    assert_parity(logits(ours, idx), ref)
    for change in ABLATIONS[case]:
        assert not torch.allclose(logits(same_weights(ours, ours.config.override(change)), idx), ref, atol=1e-2), change
    for layer in ours.moe_layers:  # the reference loop over experts computes what the grouped path computed
        layer.set_impl("reference")
    assert_parity(logits(ours, idx), ref)
    done = to_hf(ours, tmp_path / "out")  # the first family that fits
    assert done.model_type == "gpt_oss"
    assert_comes_back_identical(tmp_path / "hf", done.path)
    back = load_hf(done.path)
    assert type(back) is GptOssForCausalLM
    assert torch.equal(logits(back, idx), ref)


def test_the_clamps_act_where_the_gate_and_up_projections_run_large(tmp_path, monkeypatch):
    """With the experts' gate/up weights scaled up, values pass the limit of 7: without the clamp the logits differ."""
    hf = hf_model("clamps_active_all_global_tied")
    ours = lmlab.from_hf(saved(hf, tmp_path))
    idx = tokens(T)
    ref = logits(hf, idx)
    monkeypatch.setattr(feedforward, "GLU_LIMIT", float("inf"))
    assert not torch.allclose(logits(ours, idx), ref, atol=1e-2)


def test_cached_decoding_of_a_loaded_checkpoint_equals_transformers_full_forward(tmp_path):
    hf = hf_model("alternating_yarn")
    ours = lmlab.from_hf(saved(hf, tmp_path))
    idx = tokens(T, seed=1)
    assert_parity(decoded_logits(ours, idx, prefill=7), logits(hf, idx))


def test_interleaved_gate_up_columns_map_to_gate_and_up_rows():
    E, D, F = 2, 3, 4
    hf = torch.arange(E * D * 2 * F, dtype=torch.float32).view(E, D, 2 * F)
    ours = gate_up_from_hf(hf)  # (E, 2F, D): [gate; up]
    assert torch.equal(ours[:, :F], hf[:, :, 0::2].transpose(1, 2))
    assert torch.equal(ours[:, F:], hf[:, :, 1::2].transpose(1, 2))
    assert torch.equal(gate_up_to_hf(ours), hf)
    bias = torch.arange(E * 2 * F, dtype=torch.float32).view(E, 2 * F)
    assert torch.equal(gate_up_to_hf(gate_up_from_hf(bias)), bias)
    assert torch.equal(gate_up_from_hf(bias)[:, :F], bias[:, 0::2])


LMLAB_CASES = {
    "preset": ("gpt-oss", {"n_kv_heads": 2, "attention.window": W}),
    "yarn_interleaved_untied_mha": ("gpt-oss", {
        "n_kv_heads": 4, "rope.layout": "interleaved", "rope.scaling": "yarn", "rope.factor": 4.0,
        "rope.original_max_seq_len": 8, "rope.truncate": False, "attention.window": W,
        "attention.pattern": ["global", "local", "local"], "n_layers": 3}),
    "tied_all_global": ("gpt-oss", {"tie_embeddings": True, "attention.window": None, "attention.pattern": ["global"],
                                    "moe": {"n_experts": 4, "top_k": 1, "normalize_top_k": True, "router_bias": True,
                                            "d_expert": 16}}),
}


@pytest.mark.parametrize("case", LMLAB_CASES)
def test_lmlab_model_exports_as_gpt_oss_with_the_same_logits(tmp_path, case):
    preset, fields = LMLAB_CASES[case]
    model = lm(preset, **fields)
    assert_exports_and_reads_back(model, tmp_path / "out", "gpt_oss", tokens(model.config.max_seq_len + 8))


HF_REFUSALS = {
    "quantized": ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config=.*dequantize"),
    "no_attention_bias": ({"attention_bias": False}, "attention_bias=False"),
    "alpha": ({"swiglu_alpha": 1.0}, "swiglu_alpha=1.0"),
    "limit": ({"swiglu_limit": 10.0}, "swiglu_limit=10.0"),
}


@pytest.mark.parametrize("case", HF_REFUSALS)
def test_what_does_not_map_is_refused_by_its_key(case):
    change, message = HF_REFUSALS[case]
    with pytest.raises(ValueError, match=message):
        config_from_hf({**GptOssConfig(**GPT_OSS).to_dict(), **change})


def test_export_refuses_what_gpt_oss_cannot_compute(tmp_path):
    for fields, message in [({"attention.sinks": "none"}, "attention.sinks='none'"),
                            ({"glu_variant": "plain"}, "glu_variant='plain'"),
                            ({"moe.router_bias": False}, "moe.router_bias=False"),
                            ({"moe.n_shared": 1}, "moe.n_shared=1")]:
        with pytest.raises(ValueError, match=message):
            to_hf(lm("gpt-oss", **fields), tmp_path / "out", architecture="gpt_oss")
    with pytest.raises(ValueError, match="glu_variant='clamped'"):  # and the other families refuse its experts
        to_hf(lm("mixtral", glu_variant="clamped"), tmp_path / "out")


def test_left_padded_batch_matches_transformers(tmp_path):
    """Pads take no attention and no sink share in either library: with left padding the real tokens' logits agree."""
    hf = hf_model("alternating_yarn")
    ours = lmlab.from_hf(saved(hf, tmp_path))
    assert_left_padded_parity(hf, ours, tokens(T, seed=2))
