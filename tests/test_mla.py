"""Multi-head latent attention: the absorbed decoding path equals the expanded reference, the cache
holds the latent and the rotary key (and nothing else), and the config says what MLA cannot combine with."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_config, tokens
from torch.testing import assert_close

from lmlab import ModelConfig, Transformer
from lmlab.config import MLAConfig
from lmlab.generate import generate, left_pad
from lmlab.memory import kv_cache_bytes
from lmlab.mla import LatentAttention, softmax_scale

MLA = dict(kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
VARIANTS = {  # query compression or not, both rotary layouts, YaRN's temperature, post-norm
    "v2-lite": dict(mla=MLA),
    "q-lora-interleaved": {"mla": MLA | dict(q_lora_rank=16), "rope.layout": "interleaved"},
    "yarn-mscale": {"mla": MLA | dict(q_lora_rank=16), "max_seq_len": 8, "rope.scaling": "yarn", "rope.factor": 4.0,
                    "rope.mscale": 0.707, "rope.mscale_all_dim": 1.0},
    "post-norm": dict(mla=MLA, norm_position="post", norm="layernorm"),
}
T = 12
PROMPTS = [[5, 9, 3, 17, 2, 40, 8], [11, 4, 30], [7, 7, 21, 50, 1], [33]]


def mla_model(variant: str, impl: str = "sdpa") -> Transformer:
    model = Transformer(tiny_config(init_std=0.2, **VARIANTS[variant])).eval()  # 0.2: attention far from uniform
    model.set_attention_impl(impl)
    return model


def cached_logits(model: Transformer, idx: torch.Tensor, chunks, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of ``idx`` fed through one cache in ``chunks`` (a prefill, then token by token); ``mask``
    pads the prefill."""
    cache = model.new_cache(idx.shape[0], idx.shape[1])
    with torch.no_grad():
        parts = [model(idx[:, a:b], cache=cache, attention_mask=mask if a == 0 else None).logits for a, b in chunks]
    return torch.cat(parts, dim=1)


CHUNKS = [(0, 5), (5, 6), (6, 7), (7, 8), (8, T)]  # prefill, three single tokens, a multi-token chunk


@pytest.mark.parametrize("variant", VARIANTS)
def test_absorbed_and_expanded_paths_equal_on_a_full_forward(variant):
    idx = tokens(2, T)
    with torch.no_grad():
        reference = mla_model(variant, "explicit")(idx).logits
        assert reference.std() > 0.5
        for impl in ("sdpa", "absorbed"):
            assert_close(mla_model(variant, impl)(idx).logits, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("impl", ["sdpa", "explicit", "absorbed"])
def test_cached_decoding_equals_the_full_forward(variant, impl):
    """sdpa: the default, absorbed from the cache; explicit: the expanded reference from the cache too."""
    full = mla_model(variant, "explicit")
    idx = tokens(2, T, seed=1)
    with torch.no_grad():
        reference = full(idx).logits
    assert_close(cached_logits(mla_model(variant, impl), idx, CHUNKS), reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", ["v2-lite", "q-lora-interleaved"])
def test_padded_prefill_then_steps_equal_each_row_alone_on_both_paths(variant):
    idx, mask = left_pad(PROMPTS)
    L = idx.shape[1]
    steps = torch.tensor([[3, 1, 4], [1, 5, 9], [2, 6, 5], [3, 5, 8]])
    full_idx = torch.cat([idx, steps], dim=1)
    chunks = [(0, L)] + [(L + i, L + i + 1) for i in range(3)]
    absorbed = cached_logits(mla_model(variant, "sdpa"), full_idx, chunks, mask)
    expanded = cached_logits(mla_model(variant, "explicit"), full_idx, chunks, mask)
    assert_close(absorbed, expanded, rtol=1e-4, atol=1e-5)
    model = mla_model(variant, "explicit")
    for b, p in enumerate(PROMPTS):  # each real row, alone and unpadded
        alone = torch.tensor([p + steps[b].tolist()])
        with torch.no_grad():
            ref = model(alone).logits[0]
        assert_close(absorbed[b, L - len(p):], ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("decoder", ["eager", "static"])
def test_generation_of_a_padded_batch_continues_each_row_as_alone(decoder):
    model = mla_model("q-lora-interleaved")
    run = lambda prompts, **kw: torch.stack(list(generate(model, prompts, 8, temperature=0, **kw)), dim=1)  # noqa: E731
    together = run(PROMPTS, decoder=decoder)
    for b, p in enumerate(PROMPTS):
        assert torch.equal(together[b], run([p], decoder="eager")[0])


def test_the_cache_holds_the_latent_and_the_rotary_key_only():
    model = mla_model("q-lora-interleaved")
    cache = model.new_cache(3, 10)
    assert cache.k.shape == (2, 3, 1, 10, 24) and cache.v.shape == (2, 3, 1, 10, 4)  # (L, B, 1, S, c), (..., r)
    assert cache.k.nbytes + cache.v.nbytes == kv_cache_bytes(model.config, 3, 10)
    idx = tokens(3, 6)
    with torch.no_grad():
        model.hidden(idx, cache)
    attn = model.blocks[1].attn
    x = model.blocks[1].norm1(model.blocks[0](model.embed(idx), model.positions.context(0, 6, idx.device)))
    latent = attn.kv_norm(attn.kv_down(x)[..., :24])
    assert_close(cache.k[1, :, 0, :6], latent)  # what the cache holds is the normalized latent c


def test_gqa_cache_bytes_are_keys_and_values():
    cfg = tiny_config(n_kv_heads=2)
    cache = Transformer(cfg).new_cache(3, 10)
    assert cache.k.nbytes + cache.v.nbytes == kv_cache_bytes(cfg, 3, 10) == 2 * 2 * 3 * 2 * 10 * 8 * 4


# the README's table of cache bytes per token (bf16), derived here and in the README's own code block
V2_LITE = dict(vocab_size=102400, d_model=2048, n_layers=27, n_heads=16, max_seq_len=4096)
V2_LITE_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def test_cache_bytes_per_token_mla_against_gqa():
    per_token = {
        "v2-lite mla": kv_cache_bytes(ModelConfig(**V2_LITE, mla=V2_LITE_MLA), 1, 1, 2),
        "v2-lite mha": kv_cache_bytes(ModelConfig(**V2_LITE, head_dim=128), 1, 1, 2),
        "v2-lite gqa 4": kv_cache_bytes(ModelConfig(**V2_LITE, head_dim=128, n_kv_heads=4), 1, 1, 2),
        "laptop mla": kv_cache_bytes(ModelConfig.from_preset("deepseek-v3"), 1, 1, 2),
        "laptop mha": kv_cache_bytes(ModelConfig.from_preset("deepseek-v3", mla=None), 1, 1, 2),
        "laptop gqa 2": kv_cache_bytes(ModelConfig.from_preset("llama"), 1, 1, 2),
    }
    assert per_token == {
        "v2-lite mla": 27 * 576 * 2, "v2-lite mha": 27 * 4096 * 2, "v2-lite gqa 4": 27 * 1024 * 2,
        "laptop mla": 4 * 144 * 2, "laptop mha": 4 * 512 * 2, "laptop gqa 2": 4 * 128 * 2,
    }
    # DeepSeek-V2 sec. 2.1.4: MLA's cache equals GQA's with 2.25 groups ((d_c + d_h/2) = 4.5 d_h = 2 * 2.25 d_h)
    assert per_token["v2-lite mla"] / per_token["v2-lite mha"] * 16 == 2.25


# ============================================================== pieces against their closed form
def test_absorbed_weights_are_the_rows_of_the_up_projection():
    attn = mla_model("v2-lite").blocks[0].attn
    w_uk, w_uv = attn.up_weights()
    rows = attn.kv_up.weight.view(4, 8 + 6, 24)  # per head: [k_nope rows; v rows]
    assert torch.equal(w_uk, rows[:, :8]) and torch.equal(w_uv, rows[:, 8:])


def test_softmax_scale_includes_yarns_mscale_squared_as_transformers():
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import yarn_apply_mscale

    cfg = mla_model("yarn-mscale").config
    expected = yarn_apply_mscale({"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0}, 12**-0.5)
    assert softmax_scale(cfg) == pytest.approx(expected) and softmax_scale(cfg) > 12**-0.5
    assert softmax_scale(mla_model("v2-lite").config) == 12**-0.5


def test_rotary_tables_have_the_decoupled_width():
    model = mla_model("v2-lite")
    ctx = model.positions.context(0, 5, torch.device("cpu"))
    assert ctx.state.cos.shape[-1] == 4 == model.config.rotary_dim


def test_block_chooses_latent_attention_at_construction():
    assert isinstance(mla_model("v2-lite").blocks[0].attn, LatentAttention)
    assert not isinstance(Transformer(tiny_config()).blocks[0].attn, LatentAttention)


def test_flops_count_the_mla_widths():
    cfg = tiny_config(mla=MLA)
    model = Transformer(cfg)
    n = model.num_params()["active"] - model.embed.weight.numel()
    assert model.flops_per_token(10) == 6.0 * n + 6.0 * 2 * 4 * (12 + 6) * 10


@pytest.mark.parametrize("fields, message", [
    (dict(positions="alibi"), r"mla needs positions='rope' \(its decoupled query/key dimensions are rotary\)"),
    (dict(n_kv_heads=2), "n_kv_heads=2 does not apply with mla"),
    (dict(qk_norm="head"), "qk_norm='head' is an option of standard attention, not of mla"),
    (dict(attn_gate="headwise"), "attn_gate='headwise' is an option of standard attention, not of mla"),
    (dict(mla=MLA | dict(qk_rope_head_dim=5)), r"mla.qk_rope_head_dim=5 must be even"),
    (dict(mla=MLA | dict(kv_lora_rank=0)), r"mla.kv_lora_rank=0"),
    (dict(mla=MLA | dict(q_lora_rank=0)), r"mla.q_lora_rank=0"),
])
def test_configs_mla_cannot_build_are_refused_by_field(fields, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**{"mla": MLA, **fields})


def test_mla_config_round_trips_and_overrides():
    cfg = tiny_config(mla=MLA)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.override({"mla.q_lora_rank": 8}).mla == MLAConfig(**MLA, q_lora_rank=8)
    assert tiny_config().override({"mla.kv_lora_rank": 16}).mla.kv_lora_rank == 16  # enables mla with defaults
    assert cfg.mla.qk_head_dim == 12 and cfg.attention_widths == (12, 6) and cfg.cache_widths == (1, 24, 4)
    assert math.isclose(cfg.override({"mla": None}).attention_widths[0], 8)
