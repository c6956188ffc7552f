"""Gemma 3 (text) both ways: tiny random ``Gemma3ForCausalLM`` checkpoints built here load with ``from_hf`` with
the same logits and come back identical through ``to_hf``; lmlab models (the gemma3 preset among them) export
as gemma3_text with the same logits in transformers; every Gemma choice is shown to matter; what does not map
is refused by its config.json key."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_comes_back_identical, decoded_logits
from test_export import assert_exports_and_reads_back, lm, load_hf
from test_hf import V, assert_left_padded_parity, assert_parity, logits, randomize_, saved, tokens

import lmlab
from lmlab import ModelConfig, Transformer
from lmlab.hf import config_from_hf, to_hf

transformers = pytest.importorskip("transformers")
from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402

W, T = 5, 20  # the window; 20 tokens cross it four times
GEMMA = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=24, max_position_embeddings=32, sliding_window=W,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)
LOCAL_GLOBAL = ["sliding_attention", "full_attention", "sliding_attention"]
# name -> (Gemma3TextConfig arguments, what the loaded config must say)
HF_CASES = {
    # query_pre_attn_scalar stays at its default 256, head_dim is 24; the global layers' rotary scaled
    "local_global_scaled": (dict(GEMMA, layer_types=LOCAL_GLOBAL, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}),
        {"attention.scale_dim": 256, "attention.pattern": ("local", "global"), "rope.local_base": 100.0,
         "rope.scaling": "linear", "norm_gain": "offset", "embed_scale": "sqrt_d", "tie_embeddings": True}),
    "global_untied_scalar": (dict(GEMMA, layer_types=["full_attention"] * 3, query_pre_attn_scalar=24,
                                  tie_word_embeddings=False, hidden_activation="gelu"),
                             {"attention.scale_dim": None, "attention.window": None, "rope.local_base": None,
                              "activation": "gelu", "tie_embeddings": False}),
}
# what the parity rests on: each change of the loaded config alone changes the logits
ABLATIONS = {
    "local_global_scaled": [{"attention.scale_dim": None}, {"rope.local_base": None},
                            {"attention.window": None, "attention.pattern": ["global"], "rope.local_base": None},
                            {"embed_scale": "none"}, {"norm_gain": "plain"}],
    "global_untied_scalar": [{"attention.scale_dim": 256}],
}


def field(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def hf_model(case: str) -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    return randomize_(Gemma3ForCausalLM(Gemma3TextConfig(**HF_CASES[case][0])))


@pytest.mark.parametrize("case", HF_CASES)
def test_checkpoint_matches_transformers_both_ways(tmp_path, case):
    hf = hf_model(case)
    ours = lmlab.from_hf(saved(hf, tmp_path / "hf"))
    expected = HF_CASES[case][1]
    assert {k: field(ours.config, k) for k in expected} == expected
    idx = tokens(T)
    ref = logits(hf, idx)
    assert_parity(logits(ours, idx), ref)
    for change in ABLATIONS[case]:
        without = Transformer(ours.config.override(change)).eval()  # norm_gain plain: w read as the gain itself
        without.load_state_dict(ours.state_dict())
        assert not torch.allclose(logits(without, idx), ref, atol=1e-2), change
    done = to_hf(ours, tmp_path / "out")  # the first family that fits
    assert done.model_type == "gemma3_text"
    assert_comes_back_identical(tmp_path / "hf", done.path)
    back = load_hf(done.path)
    assert type(back) is Gemma3ForCausalLM
    assert torch.equal(logits(back, idx), ref)


def test_cached_decoding_of_a_loaded_checkpoint_equals_transformers_full_forward(tmp_path):
    hf = hf_model("local_global_scaled")
    ours = lmlab.from_hf(saved(hf, tmp_path))
    idx = tokens(T, seed=1)
    assert_parity(decoded_logits(ours, idx, prefill=7), logits(hf, idx))


def test_the_older_config_form_reads_as_the_newer():
    """rope_theta, rope_local_base_freq, rope_scaling (global layers only) and sliding_window_pattern, as the
    Gemma 3 checkpoints on the Hub write them, give the config that rope_parameters and layer_types give."""
    new = Gemma3TextConfig(**{**GEMMA, "num_hidden_layers": 4, "query_pre_attn_scalar": 24}, layer_types=[
        "sliding_attention", "full_attention"] * 2, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}).to_dict()
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
               sliding_window_pattern=2)
    assert config_from_hf(old) == config_from_hf(new)
    cfg = config_from_hf(old)
    assert (cfg.rope.base, cfg.rope.scaling, cfg.rope.factor, cfg.rope.local_base) == (1e6, "linear", 8.0, 1e4)


# name -> lmlab fields (on test_export's tiny base); each exports as gemma3_text
LMLAB_CASES = {
    "preset": ("gemma3", {"n_layers": 6, "head_dim": 16, "attention.window": W}),  # plain gains: w = g - 1
    "offset_scale_dim_yarn": (None, {
        "norm": "rmsnorm", "norm_position": "sandwich", "qk_norm": "head", "embed_scale": "sqrt_d",
        "norm_gain": "offset", "n_kv_heads": 2, "head_dim": 16, "attention.scale_dim": 20, "attention.window": W,
        "attention.pattern": ["local", "global"], "rope.local_base": 100.0, "rope.scaling": "yarn",
        "rope.factor": 4.0, "rope.original_max_seq_len": 8, "activation": "gelu_tanh"}),
    "interleaved_untied_all_global": (None, {
        "norm_position": "sandwich", "qk_norm": "head", "embed_scale": "sqrt_d", "rope.layout": "interleaved",
        "n_kv_heads": 1}),
}


@pytest.mark.parametrize("case", LMLAB_CASES)
def test_lmlab_model_exports_as_gemma3_with_the_same_logits(tmp_path, case):
    preset, fields = LMLAB_CASES[case]
    model = lm(preset, **fields)
    back = assert_exports_and_reads_back(model, tmp_path / "out", "gemma3_text", tokens(model.config.max_seq_len + 8))
    assert back.config.norm_gain == "offset"  # read back with Gemma's gain parametrization, whatever the model's


def test_embedding_scale_is_rounded_to_the_weights_dtype_as_gemma_rounds_it():
    """In bf16 sqrt(48) = 6.93 becomes 6.9375; lmlab's scaled embeddings equal Gemma's bit for bit, and the
    unrounded scale would not."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    model = Transformer(ModelConfig(vocab_size=V, d_model=48, n_layers=1, n_heads=4, embed_scale="sqrt_d"))
    model.to(torch.bfloat16)
    theirs = Gemma3TextScaledWordEmbedding(V, 48, None, embed_scale=48**0.5).to(torch.bfloat16)
    theirs.weight.data.copy_(model.embed.weight)
    idx = tokens(16)
    ours = model.embed_tokens(idx)
    assert torch.equal(ours, theirs(idx))
    assert not torch.equal(model.embed(idx) * math.sqrt(48), ours)


HF_REFUSALS = {
    "final_logit_softcapping": ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0: lmlab has no"),
    "attn_logit_softcapping": ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    "bidirectional": ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    "attention_bias": ({"attention_bias": True}, "attention_bias=True"),
    "scaled_sliding_rope": ({"layer_types": LOCAL_GLOBAL, "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
        "rope_parameters=.*give sliding_attention rope_type 'default'"),
}


@pytest.mark.parametrize("case", HF_REFUSALS)
def test_what_does_not_map_is_refused_by_its_key(case):
    change, message = HF_REFUSALS[case]
    hf = {**Gemma3TextConfig(**GEMMA).to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        config_from_hf(hf)


def test_export_refuses_what_gemma3_cannot_compute(tmp_path):
    base = {"norm_position": "sandwich", "qk_norm": "head", "embed_scale": "sqrt_d"}
    for fields, message in [({**base, "bias": True}, "bias=True"), ({**base, "qk_norm": "full"}, "qk_norm='full'"),
                            ({**base, "attention.sinks": "learned"}, "attention.sinks='learned'"),
                            ({"norm_gain": "offset"}, "norm_gain='offset'"),
                            ({"attention.scale_dim": 20}, "attention.scale_dim=20")]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            to_hf(lm(None, **fields), tmp_path / "out")


def test_left_padded_batch_matches_transformers(tmp_path):
    hf = hf_model("local_global_scaled")
    ours = lmlab.from_hf(saved(hf, tmp_path))
    assert_left_padded_parity(hf, ours, tokens(T, seed=2))
