"""DeepSeek-V4's attention (``attention.variant='compressed'``, ``lmlab.compressed_attention``): each layer kind
(sliding, CSA, HCA) equal to transformers' ``DeepseekV4Attention`` on the same weights, both paths (explicit, fused);
the batched compressor equal to its window-by-window reference; the decode cache equal to the full forward however
the tokens are chunked; a left-padded row equal to the row alone; the indexer learning from its own loss; the cache
holding what ``lmlab.memory`` says; and what the config refuses."""

from __future__ import annotations

import pytest
import torch
from helpers import tokens
from torch.testing import assert_close

from lmlab import ModelConfig, Transformer
from lmlab.attention_variants import CompressedAttentionArgs, CompressedConfig, variant_of
from lmlab.compressed_attention import (
    CompressedAttention,
    CompressedKVCache,
    Span,
    compress_reference,
    seen_entries,
)
from lmlab.config import RopeConfig
from lmlab.memory import kv_cache_bytes, parameter_count
from lmlab.positions import causal_context, padded_context

KINDS = ("sliding", "csa", "hca")
# one layer's section: a window of 6, CSA every 4 tokens, HCA every 8, YaRN on the compressed layers
SECTION = dict(q_lora_rank=12, rope_head_dim=8, window=6, csa_rate=4, hca_rate=8, index_heads=8, index_head_dim=8,
               o_groups=2, o_lora_rank=8, yarn_factor=4.0, yarn_original_max_seq_len=16)
# a model of every kind: d 32, 4 heads of 16 over one key/value head
MODEL = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=1, head_dim=16, max_seq_len=64,
             norm_eps=1e-6, rope={"layout": "interleaved"}, attention={"sinks": "learned"},
             compressed=dict(SECTION, layers=["sliding", "csa", "hca", "csa"], index_topk=3))


def layer(kind: str, topk: int = 3, seed: int = 1) -> CompressedAttention:
    section = CompressedConfig(**SECTION, layers=(kind,), index_topk=topk)
    args = CompressedAttentionArgs(d_model=32, n_heads=4, head_dim=16, section=section, scale=16**-0.5, dropout=0.0,
                                   sinks="learned", norm_eps=1e-6, rope=RopeConfig(layout="interleaved"),
                                   max_seq_len=64)
    attn = CompressedAttention(args, 0, None).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if "norm" in name else 0.0))
    return attn


def model(seed: int = 0, **changes) -> Transformer:
    cfg = ModelConfig(**MODEL, init_std=0.2).override(changes)
    return Transformer(cfg.replace(init_seed=seed)).eval()


def x_of(B: int = 2, T: int = 30, seed: int = 2) -> torch.Tensor:
    return torch.randn(B, T, 32, generator=torch.Generator().manual_seed(seed))


def full(attn, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    if mask is None:
        return attn(x, causal_context(0, x.shape[1], x.device))
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return attn(x, padded_context(pos, pos, mask.bool()))


def chunked(attn, x: torch.Tensor, ends: list[int], mask: torch.Tensor | None = None) -> torch.Tensor:
    """One layer through its decode cache, the tokens fed in chunks ending at ``ends``; padding in the first."""
    cache = CompressedKVCache(None, x.shape[0], x.shape[1], layers=range(1))
    outs, start = [], 0
    for i, end in enumerate(ends):
        ctx = cache.context(end - start, None if mask is None or i else mask[:, start:end])
        outs.append(attn(x[:, start:end], ctx, cache))
        cache.advance(end - start)
        start = end
    return torch.cat(outs, dim=1)


# ============================================================== parity with transformers, layer by layer
transformers = pytest.importorskip("transformers")


def hf_layer(attn: CompressedAttention):
    """transformers' DeepseekV4Attention of ``attn``'s kind and weights, and its two rotary sets."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    types = {"sliding": "sliding_attention", "csa": "compressed_sparse_attention",
             "hca": "heavily_compressed_attention"}
    config = DeepseekV4Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        q_lora_rank=12, layer_types=[types[attn.kind]], mlp_layer_types=["moe"], sliding_window=6,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, o_groups=2,
        o_lora_rank=8, index_n_heads=8, index_head_dim=8, index_topk=attn.indexer.topk if attn.indexer else 3,
        partial_rotary_factor=0.5, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    config._attn_implementation = "eager"
    hf = v4.DeepseekV4Attention(config, 0).eval()
    names = {"q_a_proj": "q_down", "q_a_norm": "q_norm", "q_b_proj": "q_up", "kv_proj": "kv", "kv_norm": "kv_norm",
             "o_a_proj": "out_down", "o_b_proj": "out_up", "sinks": "sinks", "compressor.kv_proj": "compressor.kv",
             "compressor.gate_proj": "compressor.gate", "compressor.position_bias": "compressor.position_bias",
             "compressor.kv_norm": "compressor.norm", "compressor.indexer.q_b_proj": "indexer.q_up",
             "compressor.indexer.scorer.weights_proj": "indexer.weights",
             "compressor.indexer.kv_proj": "indexer.compressor.kv",
             "compressor.indexer.gate_proj": "indexer.compressor.gate",
             "compressor.indexer.position_bias": "indexer.compressor.position_bias",
             "compressor.indexer.kv_norm": "indexer.compressor.norm"}
    ours = attn.state_dict()
    theirs = {}
    for name in hf.state_dict():
        stem = name.removesuffix(".weight")
        mine = names[stem] + (".weight" if name.endswith(".weight") else "")
        theirs[name] = ours[mine]
    hf.load_state_dict(theirs)
    return hf, v4.DeepseekV4RotaryEmbedding(config), config


@pytest.mark.parametrize("T", [7, 30])
@pytest.mark.parametrize("kind", KINDS)
def test_each_layer_kind_equals_transformers_on_the_same_weights(kind, T):
    from transformers.masking_utils import create_sliding_window_causal_mask

    attn = layer(kind)
    hf, rotary, config = hf_layer(attn)
    x = x_of(T=T)
    pos = torch.arange(T)[None]
    mask = create_sliding_window_causal_mask(config=config, inputs_embeds=x, attention_mask=None, cache=None,
                                             position_ids=pos)
    angles = {name: rotary(x, pos, layer_type=name) for name in ("main", "compress")}
    with torch.no_grad():
        ref = hf(x, position_embeddings=angles, position_ids=pos, attention_mask=mask)[0]
        assert ref.std() > 0.5
        for impl in ("explicit", "sdpa"):
            attn.set_impl(impl)
            assert_close(full(attn, x), ref)


def test_the_batched_compressor_equals_its_window_by_window_reference():
    for kind in ("csa", "hca"):
        attn = layer(kind)
        x = x_of(T=30)
        span = Span(torch.zeros(2, dtype=torch.long), torch.full((2,), 30), torch.zeros(2, dtype=torch.long))
        with torch.no_grad():
            batched = attn.compressor(x, span, attn.rotary, "interleaved", None)
            reference = compress_reference(attn.compressor, x, attn.rotary, "interleaved")
        assert batched.shape[1] == reference.shape[1] == 30 // attn.compressor.rate
        assert_close(batched, reference, rtol=0, atol=1e-6)


def test_an_entry_of_equal_gates_is_the_normalized_mean_of_its_window():
    """HCA with zero gate weights and bias: each entry is rmsnorm(mean of its m tokens' C), rotated at w m."""
    attn = layer("hca")
    with torch.no_grad():
        attn.compressor.gate.weight.zero_()
        attn.compressor.position_bias.zero_()
        x = x_of(T=16)
        entries = compress_reference(attn.compressor, x, attn.rotary, "interleaved")
        c = attn.compressor.kv(x).view(2, 2, 8, 16).mean(2)  # (B, 2 windows, 16)
        normed = c / c.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * attn.compressor.norm.weight
        unrotated = entries[..., :8]  # the leading d - r dimensions do not turn
    assert_close(unrotated, normed[..., :8], rtol=1e-5, atol=1e-6)


def test_a_query_sees_an_entry_only_once_its_window_is_complete():
    ctx = causal_context(0, 9, torch.device("cpu"))
    seen = seen_entries(ctx, 4, 3)[0]  # (T, E)
    assert seen.long().sum(-1).tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2]


# ============================================================== the cache and padding
CHUNKS = [[5, *range(6, 41)], [1, 2, 3, 11, 12, 13, 26, 40], [17, 18, 35, 40]]


@pytest.mark.parametrize("kind", KINDS)
def test_the_decode_cache_equals_the_full_forward_however_the_tokens_are_chunked(kind):
    attn = layer(kind)
    x = x_of(B=3, T=40, seed=3)
    with torch.no_grad():
        want = full(attn, x)
        for ends in CHUNKS:
            assert_close(chunked(attn, x, ends), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_a_left_padded_row_computes_what_the_row_alone_computes(kind):
    """Each row pools its own tokens, windows aligned to its first real token, with or without the cache."""
    attn = layer(kind)
    x = x_of(B=3, T=40, seed=4)
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[0, :6], mask[1, :13] = 0, 0
    with torch.no_grad():
        alone = [full(attn, x[i : i + 1, p:])[0] for i, p in enumerate((6, 13, 0))]
        for got in (full(attn, x, mask), chunked(attn, x, [20, 21, 22, 33, 40], mask)):
            for i, p in enumerate((6, 13, 0)):
                assert_close(got[i, p:], alone[i], rtol=1e-5, atol=1e-5)


def test_a_model_of_every_kind_decodes_with_its_cache_equal_to_the_full_forward():
    from helpers import decoded_logits

    m = model()
    idx = tokens(2, 40, seed=5)
    with torch.no_grad():
        want = m(idx).logits
    assert_close(decoded_logits(m, idx, prefill=9), want, rtol=1e-5, atol=1e-5)
    m.set_attention_impl("explicit")
    with torch.no_grad():
        assert_close(m(idx).logits, want, rtol=1e-5, atol=1e-5)


def test_the_cache_holds_what_memory_reports():
    m = model()
    cfg = m.config
    cache = m.new_cache(2, 40)
    assert isinstance(cache, CompressedKVCache)
    with torch.no_grad():
        m(tokens(2, 40, seed=6), cache=cache)
    held = sum(t.numel() for s in cache.states.values()
               for t in (s.window, *(p for c in (s.compressor, s.indexer) if c for p in (c.ring, c.entries))))
    assert kv_cache_bytes(cfg, 2, 40) == held * 4
    # per token at length: CSA keeps (d + d^I) / m, HCA d / m' values a token; the window and rings are fixed
    c, d = cfg.compressed, cfg.head_dim
    grow = kv_cache_bytes(cfg, 1, 4000, 2) - kv_cache_bytes(cfg, 1, 2000, 2)
    assert grow == 2 * 2000 * (2 * (d + c.index_head_dim) // c.csa_rate + d // c.hca_rate)


def test_the_cache_refuses_padding_after_its_first_forward_and_rewinding():
    m = model()
    cache = m.new_cache(2, 20)
    with torch.no_grad():
        m(tokens(2, 5), cache=cache)
        with pytest.raises(ValueError, match="takes padding in its first forward only"):
            m(tokens(2, 3), cache=cache, attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]))
    with pytest.raises(ValueError, match="cannot be rewound"):
        cache.rewind(3)


def test_decoders_with_a_fixed_shape_cache_are_refused_by_name():
    from lmlab.generate import generate

    with pytest.raises(ValueError, match="compressed attention decodes with its own cache"):
        list(generate(model(), [[1, 2, 3]], 3, temperature=0, decoder="static"))


# ============================================================== training
def test_a_step_trains_every_parameter_and_the_indexer_from_its_own_loss_alone():
    m = model().train()
    idx = tokens(4, 40, seed=7)
    out = m(idx, targets=idx.roll(-1, 1))
    assert set(out.aux_losses) == {"indexer"} and out.aux_losses["indexer"] > 0
    out.ce_loss.backward(retain_graph=True)
    index_params = {n for n, _ in m.named_parameters() if ".indexer." in n}
    for name, p in m.named_parameters():  # the language-modeling loss never reaches the indexer
        assert (name in index_params) == (p.grad is None or not p.grad.any()), name
    m.zero_grad()
    out.aux_losses["indexer"].backward()
    assert all(p.grad is not None and p.grad.any() for n, p in m.named_parameters() if n in index_params)
    assert all(p.grad is None or not p.grad.any() for n, p in m.named_parameters() if n not in index_params)


def test_the_loss_falls_in_a_few_steps():
    m = model().train()
    idx = tokens(4, 32, seed=8)
    optimizer = torch.optim.AdamW(m.parameters(), lr=3e-3)
    losses = []
    for _ in range(4):
        loss = m(idx, targets=idx.roll(-1, 1)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


# ============================================================== the config
def test_the_section_implies_the_variant_and_round_trips():
    cfg = ModelConfig(**MODEL)
    assert cfg.attention_variant == "compressed" and cfg.attention.variant is None
    assert ModelConfig.from_yaml(cfg.to_yaml()) == cfg
    named = ModelConfig(**{**{k: v for k, v in MODEL.items() if k != "compressed"},
                           "attention": {"variant": "compressed", "sinks": "learned"}})
    assert named.compressed == CompressedConfig()  # the section with its defaults
    assert parameter_count(cfg) == Transformer(cfg).num_params()["total"] >= variant_of(cfg).parameter_floor(cfg)
    assert "compressed" not in ModelConfig(vocab_size=64).identity_dict()


@pytest.mark.parametrize("changes, message", [
    ({"n_kv_heads": 2}, "has one key/value head whose keys are its values; set n_kv_heads=1"),
    ({"compressed.rope_head_dim": 7}, "compressed.rope_head_dim=7 must be even"),
    ({"compressed.rope_head_dim": 32, "compressed.index_head_dim": 32},
     "compressed.rope_head_dim=32 exceeds head_dim=16"),
    ({"compressed.index_head_dim": 4}, "compressed.index_head_dim=4 is narrower than the compressed.rope_head_dim=8"),
    ({"compressed.o_groups": 3}, "compressed.o_groups=3 does not split the 4 heads"),
    ({"compressed.layers": ["csa", "global"]},
     "layers[1]='global' is not a valid choice; choose one of ['sliding', 'csa', 'hca']"),
    ({"qk_norm": "head"}, "qk_norm='head' is an option of standard attention"),
    ({"positions": "alibi"}, "rotates its queries and keys, not positions='alibi'"),
    ({"rope.partial": 0.5}, "do not apply to compressed attention"),
    ({"mtp.depth": 1}, "mtp with attention.variant='compressed' is not implemented"),
    ({"compressed.yarn_factor": 0.5}, "compressed.yarn_factor=0.5 is not valid"),
    ({"compressed.yarn_factor": 1.0}, "compressed.yarn_original_max_seq_len=16 is a parameter of YaRN, and "
                                      "compressed.yarn_factor=1 scales nothing"),
])
def test_what_the_variant_cannot_compute_is_refused_by_name(changes, message):
    with pytest.raises(ValueError) as err:
        ModelConfig(**MODEL).override(changes)
    assert message in str(err.value)
