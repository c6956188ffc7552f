"""Parity with Hugging Face transformers: tiny random checkpoints written with ``save_pretrained``,
loaded with ``lmlab.from_hf``, logits compared in fp32; and every refusal, by its message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

import lmlab
from lmlab.hf import config_from_hf, half_to_interleaved, interleaved_to_half, state_dict_from_hf
from lmlab.positions import rope_frequencies

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

V = 97  # vocabulary
LLAMA = dict(
    vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=32, bos_token_id=1, eos_token_id=2,
)
GPT2 = dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=24, bos_token_id=0, eos_token_id=0)
T = 48  # longer than max_position_embeddings, so dynamic scaling is active and the others extrapolate


def tokens(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (2, length), generator=torch.Generator().manual_seed(seed))


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights ~ N(0, 0.2), norm gains ~ 1 + N(0, 0.2): attention far from uniform, so a wrong
    position, rotary layout or tensor mapping changes the logits; no norm gain is exactly 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            gain = p.ndim == 1 and name.endswith("weight") and ("norm" in name or ".ln_" in name)
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if gain else 0.0))
    return model.eval()


def logits(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx).logits


def assert_parity(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ref.std() > 0.5, "reference logits are near constant; the comparison would prove little"
    assert_close(ours, ref)  # fp32 defaults: rtol 1.3e-6, atol 1e-5


def assert_left_padded_parity(hf: torch.nn.Module, ours: torch.nn.Module, idx: torch.Tensor, pads: int = 6) -> None:
    """With the first row of ``idx`` left-padded by ``pads`` tokens, the real tokens' logits agree."""
    mask = torch.ones_like(idx)
    mask[0, :pads] = 0
    with torch.no_grad():
        ref, got = hf(idx, attention_mask=mask).logits, ours(idx, attention_mask=mask).logits
    assert_parity(got[mask.bool()], ref[mask.bool()])


def hf_llama(seed: int = 0, **changes) -> LlamaForCausalLM:
    return randomize_(LlamaForCausalLM(LlamaConfig(**{**LLAMA, **changes})), seed)


def hf_gpt2(**changes) -> GPT2LMHeadModel:
    return randomize_(GPT2LMHeadModel(GPT2Config(**{**GPT2, **changes})))


def saved(model, path: Path, **kwargs) -> Path:
    model.save_pretrained(path, **kwargs)
    return path


def edit_config(path: Path, edit) -> None:
    file = path / "config.json"
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data))


# ================================================================== rotary scaling, both config forms
# name -> (rope_theta, rope parameters as a published config.json writes them; None = no scaling)
ROPE = {
    "none": (10000.0, None),
    "linear": (50000.0, {"rope_type": "linear", "factor": 2.0}),
    "dynamic": (10000.0, {"rope_type": "dynamic", "factor": 2.0}),
    "yarn": (10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
    "yarn_no_original": (10000.0, {"rope_type": "yarn", "factor": 4.0}),
    "yarn_deepseek": (10000.0, {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 16.0,
        "beta_slow": 2.0, "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False,
    }),
    "yarn_attention_factor": (10000.0, {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "attention_factor": 1.25,
    }),
    "llama3": (500000.0, {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    }),
}
FORMS = ["rope_parameters", "rope_scaling", "rope_scaling_legacy_type"]


def with_rope_form(data: dict, theta: float, params: dict | None, form: str) -> dict:
    """config.json with its rotary part written in one published form: transformers >= 4.57's
    ``rope_parameters``, or the older top-level ``rope_theta`` + ``rope_scaling`` (with key
    ``rope_type``, or the still older ``type``)."""
    data = {k: v for k, v in data.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    params = dict(params or {})
    if form == "rope_parameters":
        data["rope_parameters"] = {"rope_type": "default", **params, "rope_theta": theta}
    else:
        data["rope_theta"] = theta
        if form == "rope_scaling_legacy_type" and params:
            params["type"] = params.pop("rope_type")
        data["rope_scaling"] = params or None
    return data


def hf_rope_llama(case: str, seed: int = 0) -> LlamaForCausalLM:
    theta, params = ROPE[case]
    return hf_llama(seed, rope_theta=theta, rope_scaling=dict(params) if params else None)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", ROPE)
def test_llama_logits_match_transformers_for_each_rope_type(tmp_path, case, form):
    hf = hf_rope_llama(case)
    path = saved(hf, tmp_path)
    theta, params = ROPE[case]
    file = path / "config.json"
    file.write_text(json.dumps(with_rope_form(json.loads(file.read_text()), theta, params, form)))
    idx = tokens(T)
    ref = logits(hf, idx)
    assert_parity(logits(lmlab.from_hf(path), idx), ref)
    if params:  # the scaling is active in this test: without it the logits differ
        assert not torch.allclose(logits(hf_rope_llama("none"), idx), ref, atol=1e-3)


@pytest.mark.parametrize("case", ROPE)
def test_rope_config_forms_give_identical_configs(case):
    theta, params = ROPE[case]
    base = {"model_type": "llama", **LLAMA}
    configs = [config_from_hf(with_rope_form(base, theta, params, form)) for form in FORMS]
    assert configs[0] == configs[1] == configs[2]
    assert configs[0].rope.base == theta
    kind = (params or {}).get("rope_type", "default")
    assert configs[0].rope.scaling == ("none" if kind == "default" else kind)


@pytest.mark.parametrize("case", ROPE)
def test_rope_frequencies_equal_transformers_bit_for_bit(case):
    theta, params = ROPE[case]
    hf_cfg = LlamaConfig(**LLAMA, rope_theta=theta, rope_scaling=dict(params) if params else None)
    rotary = LlamaRotaryEmbedding(config=hf_cfg)
    rotary(torch.zeros(1), torch.arange(T)[None])  # dynamic types update their frequencies for the length
    ours = config_from_hf(hf_cfg.to_dict())
    inv_freq, attention_factor = rope_frequencies(ours.rope, ours.head_dim, ours.max_seq_len, T)
    assert torch.equal(inv_freq, rotary.inv_freq)
    assert attention_factor == rotary.attention_scaling


# ================================================================== architecture variants
LLAMA_VARIANTS = {
    "untied": {},
    "tied": {"tie_word_embeddings": True},
    "biases": {"attention_bias": True, "mlp_bias": True},
    "head_dim_not_d_over_h": {"head_dim": 32},
    "multi_query": {"num_key_value_heads": 1},
    "multi_head": {"num_key_value_heads": 4},
    "gelu_tanh": {"hidden_act": "gelu_pytorch_tanh"},
}


@pytest.mark.parametrize("variant", LLAMA_VARIANTS)
def test_llama_variants_match_transformers(tmp_path, variant):
    hf = hf_llama(**LLAMA_VARIANTS[variant])
    ours = lmlab.from_hf(saved(hf, tmp_path))
    assert ours.config.tie_embeddings == hf.config.tie_word_embeddings
    assert (ours.head.weight is ours.embed.weight) == hf.config.tie_word_embeddings
    idx = tokens(20)
    assert_parity(logits(ours, idx), logits(hf, idx))


def test_mistral_without_sliding_window_matches_transformers(tmp_path):
    cfg = {k: v for k, v in LLAMA.items()}
    hf = randomize_(MistralForCausalLM(MistralConfig(**cfg, sliding_window=None)))
    idx = tokens(20)
    assert_parity(logits(lmlab.from_hf(saved(hf, tmp_path)), idx), logits(hf, idx))


def test_qwen2_matches_transformers_with_q_k_v_only_biases(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hf = randomize_(Qwen2ForCausalLM(Qwen2Config(**LLAMA)))
    ours = lmlab.from_hf(saved(hf, tmp_path))
    assert (ours.config.qkv_bias, ours.config.bias) == (True, False)
    assert ours.blocks[0].attn.out.bias is None and ours.blocks[0].attn.qkv.bias.abs().sum() > 0
    idx = tokens(20)
    assert_parity(logits(ours, idx), logits(hf, idx))
    # sliding layers from max_window_layers on (tests/test_hf_windows.py checks their logits)
    windowed = config_from_hf({**Qwen2Config(**LLAMA).to_dict(), "use_sliding_window": True, "sliding_window": 8,
                               "max_window_layers": 1, "layer_types": None})
    assert (windowed.attention.window, windowed.attention.pattern) == (8, ("global", "local"))


GPT2_VARIANTS = {
    "tied": {},
    "untied": {"tie_word_embeddings": False},
    "n_inner_relu": {"n_inner": 48, "activation_function": "relu"},
    "gelu_exact_eps": {"activation_function": "gelu", "layer_norm_epsilon": 1e-3},
}


@pytest.mark.parametrize("variant", GPT2_VARIANTS)
def test_gpt2_variants_match_transformers(tmp_path, variant):
    hf = hf_gpt2(**GPT2_VARIANTS[variant])
    ours = lmlab.from_hf(saved(hf, tmp_path))
    assert ours.config.d_ff == (hf.config.n_inner or 4 * hf.config.n_embd)
    idx = tokens(GPT2["n_positions"])
    assert_parity(logits(ours, idx), logits(hf, idx))


def test_gpt2_legacy_checkpoint_names(tmp_path):
    """The original GPT-2 files: GPT2Model names without "transformer.", no lm_head (tied), and
    the causal-mask buffers older transformers saved, which are not weights."""
    hf = hf_gpt2()
    sd = {k.removeprefix("transformer."): v.clone() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    for i in range(GPT2["n_layer"]):
        sd[f"h.{i}.attn.bias"] = torch.ones(1, 1, 24, 24).tril()
        sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    hf.config.to_json_file(tmp_path / "config.json")
    save_file(sd, tmp_path / "model.safetensors")
    idx = tokens(GPT2["n_positions"])
    assert_parity(logits(lmlab.from_hf(tmp_path), idx), logits(hf, idx))


def test_defaults_match_transformers_config_classes():
    """A config.json that leaves keys out means the transformers class defaults; ours agree."""
    assert config_from_hf({"model_type": "llama"}) == config_from_hf(LlamaConfig().to_dict())
    assert config_from_hf({"model_type": "gpt2"}) == config_from_hf(GPT2Config().to_dict())
    from transformers import Qwen2Config

    assert config_from_hf({"model_type": "qwen2"}) == config_from_hf(Qwen2Config().to_dict())
    mistral = {"model_type": "mistral", "sliding_window": None}
    assert config_from_hf(mistral) == config_from_hf(MistralConfig(sliding_window=None).to_dict())


# ================================================================== cache, shards, reuse, dtype
@pytest.mark.parametrize("case", ["none", "yarn", "llama3"])
def test_kv_cache_incremental_logits_equal_transformers_full_logits(tmp_path, case):
    hf = hf_rope_llama(case)
    ours = lmlab.from_hf(saved(hf, tmp_path))
    idx = tokens(30)
    cache, chunks, start = ours.new_cache(2, 30), [], 0
    for size in (7, 1, 1, 5, 16):
        chunks.append(logits_with_cache(ours, idx[:, start : start + size], cache))
        start += size
    assert_parity(torch.cat(chunks, dim=1), logits(hf, idx))


def logits_with_cache(model, idx, cache):
    with torch.no_grad():
        return model(idx, cache=cache).logits


def test_sharded_checkpoint(tmp_path):
    hf = hf_llama()
    path = saved(hf, tmp_path, max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file() and not (path / "model.safetensors").exists()
    assert len(list(path.glob("model-*.safetensors"))) >= 3
    idx = tokens(20)
    assert_parity(logits(lmlab.from_hf(path), idx), logits(hf, idx))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_state_dict_from_hf_tells_the_family_from_tensor_names(family):
    hf = hf_llama(tie_word_embeddings=True) if family == "llama" else hf_gpt2()
    cfg = config_from_hf(hf.config.to_dict())
    ours = lmlab.Transformer(cfg).eval()
    ours.load_state_dict(state_dict_from_hf(cfg, hf.state_dict()))  # a tied lm_head.weight is listed too
    idx = tokens(20)
    assert_parity(logits(ours, idx), logits(hf, idx))


def test_state_dict_from_hf_reports_the_closest_family_when_none_matches():
    hf = hf_llama()
    cfg = config_from_hf(hf.config.to_dict())
    sd = dict(hf.state_dict())
    sd["model.layers.0.mlp.router.weight"] = sd.pop("model.layers.0.mlp.up_proj.weight")
    with pytest.raises(ValueError) as err:
        state_dict_from_hf(cfg, sd)
    assert "the closest, 'llama', finds missing tensors [model.layers.0.mlp.up_proj.weight]; " \
        "unexpected tensors [model.layers.0.mlp.router.weight]" in str(err.value)


def test_from_hf_builds_the_model_without_initializing_it(tmp_path, monkeypatch):
    """No random draw and no default init: the model is built on the meta device and every value
    comes from the checkpoint (ties, rotary frequencies and MoE load counters still right)."""
    import lmlab.init

    hf = hf_llama(tie_word_embeddings=True, rope_theta=50000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    path = saved(hf, tmp_path)
    draws = []
    monkeypatch.setattr(lmlab.init.Init, "draw", lambda self, shape: draws.append(shape) or torch.zeros(shape))
    ours = lmlab.from_hf(path)
    assert draws == []
    assert ours.head.weight is ours.embed.weight and ours.num_params()["total"] == sum(
        p.numel() for p in hf.parameters()
    )
    assert not any(t.is_meta for t in [*ours.parameters(), *ours.buffers(), ours.positions.inv_freq])
    idx = tokens(T)
    assert_parity(logits(ours, idx), logits(hf, idx))
    lmlab.Transformer(ours.config)
    assert draws  # the check above can fail: a plain construction draws


@pytest.mark.parametrize("dtype, expected", [(None, torch.float32), ("bfloat16", torch.bfloat16),
                                             ("auto", torch.float16)])
def test_dtype(tmp_path, dtype, expected):
    hf = hf_llama().to(torch.float16)
    ours = lmlab.from_hf(saved(hf, tmp_path), dtype=dtype)
    assert {p.dtype for p in ours.parameters()} == {expected}
    assert torch.equal(ours.embed.weight, hf.model.embed_tokens.weight.to(expected))


# ================================================================== refusals, by message
def _bad_config(**changes):
    return lambda d: d.update(changes)


def _drop_tensor(path: Path) -> None:
    sd = load_file(path / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, path / "model.safetensors")


def _extra_tensor(path: Path) -> None:
    sd = load_file(path / "model.safetensors")
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(sd, path / "model.safetensors")


def _only_pickle(path: Path) -> None:
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"never unpickled")


def _lost_shard(path: Path) -> None:
    (path / "model.safetensors").unlink()
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00002-of-00002.safetensors"}})
    )


def _shard_outside(path: Path) -> None:
    (path / "model.safetensors").rename(path.parent / "elsewhere.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../elsewhere.safetensors"}}))


def _head_differs_from_tied_embedding(path: Path) -> None:
    edit_config(path, _bad_config(tie_word_embeddings=True))  # the untied checkpoint keeps its own lm_head


CHECKPOINT_ERRORS = {
    "no_directory": (lambda p: p.rename(p.with_name("gone")), "does not exist"),
    "no_config": (lambda p: (p / "config.json").unlink(), "config.json' not found"),
    "config_not_json": (lambda p: (p / "config.json").write_text("{nope"), "is not valid JSON"),
    "no_model_type": (lambda p: edit_config(p, lambda d: d.pop("model_type")), "has no 'model_type'"),
    "unknown_model_type": (lambda p: edit_config(p, _bad_config(model_type="falcon")),
                           "model_type 'falcon' is not supported"),
    "only_pickle": (_only_pickle, "holds pytorch_model.bin, a pickle; lmlab never loads pickles"),
    "no_weights": (lambda p: (p / "model.safetensors").unlink(),
                   "has no model.safetensors or model.safetensors.index.json"),
    "missing_shard": (_lost_shard, "shard 'model-00002-of-00002.safetensors' listed in"),
    "shard_outside": (_shard_outside, "shard '../elsewhere.safetensors' listed in"),
    "missing_tensor": (_drop_tensor, "missing tensors [model.layers.1.mlp.up_proj.weight]"),
    "unexpected_tensor": (_extra_tensor, "unexpected tensors [model.layers.0.self_attn.q_norm.weight]"),
    "shape_mismatch": (lambda p: edit_config(p, _bad_config(intermediate_size=128)),
                       "blocks.0.ffn.gate_up.weight: (192, 64) in the checkpoint, (256, 64) from config.json"),
    "tied_head_differs": (_head_differs_from_tied_embedding, "lm_head.weight differs from the embedding"),
    "sliding_window_zero": (lambda p: edit_config(p, _bad_config(model_type="mistral", sliding_window=0)),
                            "attention.window=0 is not valid"),
}


@pytest.mark.parametrize("case", CHECKPOINT_ERRORS)
def test_from_hf_refuses_bad_checkpoints(tmp_path, case):
    path = saved(hf_llama(), tmp_path / "ckpt")
    breaker, message = CHECKPOINT_ERRORS[case]
    breaker(path)
    with pytest.raises(ValueError) as err:
        lmlab.from_hf(path)
    assert message in str(err.value)


def test_from_hf_refuses_a_file_path_and_a_bad_dtype(tmp_path):
    path = saved(hf_llama(), tmp_path)
    with pytest.raises(ValueError, match="is a file; pass the checkpoint directory"):
        lmlab.from_hf(path / "config.json")
    with pytest.raises(ValueError, match="dtype='int8' is not valid"):
        lmlab.from_hf(path, dtype="int8")


LLAMA_JSON = {"model_type": "llama", **LLAMA}
GPT2_JSON = {"model_type": "gpt2", **GPT2}
CONFIG_ERRORS = {
    "mixed_biases": (LLAMA_JSON, {"attention_bias": True}, "attention_bias=True and mlp_bias=False"),
    "unknown_layer_type": ({**LLAMA_JSON, "model_type": "qwen2"}, {"layer_types": ["full_attention", "chunked"]},
                           "layer_types entry 'chunked'"),
    "sliding_without_window": ({**LLAMA_JSON, "model_type": "qwen2"}, {
        "layer_types": ["full_attention", "sliding_attention"], "use_sliding_window": False},
        "sliding_attention layers and sliding_window null"),
    "partial_rotary": (LLAMA_JSON, {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    "partial_rotary_in_rope": (LLAMA_JSON, {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
                               "partial_rotary_factor=0.5"),
    "longrope": (LLAMA_JSON, {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
                 "rope type 'longrope', which lmlab does not support"),
    "unknown_rope": (LLAMA_JSON, {"rope_parameters": {"rope_type": "spiral"}}, "rope type 'spiral'"),
    "rope_without_factor": (LLAMA_JSON, {"rope_scaling": {"rope_type": "linear"}}, "rope type 'linear' needs 'factor'"),
    "per_layer_rope": (LLAMA_JSON, {"rope_parameters": {"full_attention": {"rope_type": "default"}}},
                       "per-layer-type rope parameters"),
    "activation": (LLAMA_JSON, {"hidden_act": "xielu"}, "hidden_act='xielu', which lmlab does not support"),
    "invalid_sizes": (LLAMA_JSON, {"num_key_value_heads": 3},
                      "maps to an invalid lmlab config: n_kv_heads=3 does not divide"),
    "inverse_layer_scaling": (GPT2_JSON, {"scale_attn_by_inverse_layer_idx": True},
                              "scale_attn_by_inverse_layer_idx=true"),
    "unscaled_attention": (GPT2_JSON, {"scale_attn_weights": False}, "scale_attn_weights=false"),
    "cross_attention": (GPT2_JSON, {"add_cross_attention": True}, "add_cross_attention=true"),
    "gpt2_activation": (GPT2_JSON, {"activation_function": "mish"}, "activation_function='mish'"),
}


@pytest.mark.parametrize("case", CONFIG_ERRORS)
def test_config_from_hf_refuses_what_lmlab_cannot_express(case):
    base, changes, message = CONFIG_ERRORS[case]
    with pytest.raises(ValueError) as err:
        config_from_hf({**base, **changes})
    assert message in str(err.value)


# ================================================================== rotary layouts
def test_interleaved_layout_equals_half_after_permuting_q_k_rows():
    """Pairs (2j, 2j+1) rotate exactly as pairs (j, j + d/2) once each head's q and k rows are
    permuted: this proves both layouts, and is the conversion Meta-format checkpoints need."""
    half_cfg = lmlab.ModelConfig.from_preset(
        "llama", vocab_size=V, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, init_std=0.2
    )
    inter_cfg = half_cfg.override({"rope.layout": "interleaved"})
    half, inter = lmlab.Transformer(half_cfg).eval(), lmlab.Transformer(inter_cfg).eval()
    H, KV, hd = half_cfg.n_heads, half_cfg.n_kv_heads, half_cfg.head_dim
    sd = half.state_dict()
    for i in range(half_cfg.n_layers):
        q, k, v = sd[f"blocks.{i}.attn.qkv.weight"].split([H * hd, KV * hd, KV * hd])
        sd[f"blocks.{i}.attn.qkv.weight"] = torch.cat([half_to_interleaved(q, H), half_to_interleaved(k, KV), v])
        assert torch.equal(interleaved_to_half(half_to_interleaved(q, H), H), q)
    idx = tokens(40)
    inter.load_state_dict(half.state_dict())
    assert not torch.allclose(logits(inter, idx), logits(half, idx), atol=1e-3)  # the layouts do differ
    inter.load_state_dict(sd)
    assert_parity(logits(inter, idx), logits(half, idx))


def test_interleaved_to_half_is_transformers_permute():
    """Per head, rows [a0 b0 a1 b1 ...] become [a0 a1 ... b0 b1 ...] (convert_llama_weights_to_hf.permute)."""
    w = torch.arange(2 * 8).float()[:, None]  # 2 heads of head_dim 8
    assert interleaved_to_half(w, 2).flatten().tolist() == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]
