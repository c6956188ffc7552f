"""Per-layer attention windows, learned sinks, partial rotary, NoPE layers and local rotary bases:
each against its closed form, the fused path against the reference, and the decode cache (eager,
padded, fixed-shape, compiled) against the full forward."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config, tokens
from test_decode import PROMPTS, run
from torch.testing import assert_close

from lmlab import ModelConfig, Transformer
from lmlab.generate import left_pad
from lmlab.positions import Rotary, causal_context, padded_context, position_args, windowed

T = 20  # several windows long

VARIANTS = {
    "local_global": {"attention.window": 4, "attention.pattern": ["local", "global"]},
    "all_local_gqa": {"attention.window": 3, "attention.pattern": ["local"], "n_kv_heads": 2},
    "sinks": {"attention.sinks": "learned", "n_kv_heads": 2},
    "window_sinks": {"attention.window": 4, "attention.pattern": ["local", "global"], "attention.sinks": "learned"},
    "alibi_window_sinks": {"positions": "alibi", "attention.window": 5, "attention.pattern": ["local"],
                           "attention.sinks": "learned"},
    "partial_rotary": {"rope.partial": 0.5, "n_kv_heads": 2},
    "nope_every_2": {"rope.nope_every": 2},
    "local_base": {"attention.window": 4, "attention.pattern": ["local", "global"], "rope.local_base": 100.0,
                   "rope.scaling": "linear", "rope.factor": 2.0},
}


def model(variant: str, **extra) -> Transformer:
    fields = {"n_layers": 2, "init_std": 0.2, "max_seq_len": 64, **VARIANTS[variant], **extra}
    return Transformer(tiny_config(**fields)).eval()


def logits(m: Transformer, idx: torch.Tensor, **kw) -> torch.Tensor:
    with torch.no_grad():
        return m(idx, **kw).logits


# ============================================================== closed forms
@pytest.mark.parametrize("impl", ["sdpa", "explicit"])
def test_a_local_layer_sees_itself_and_the_window_minus_one_tokens_before_it(impl):
    """One local layer of window W: logits at i depend on tokens i - W + 1 .. i and no others
    (transformers' sliding window: key j is seen from query i when i - W < j <= i)."""
    W = 4
    m = Transformer(tiny_config(n_layers=1, init_std=0.2, **{"attention.window": W, "attention.pattern": ["local"]}))
    m.eval().set_attention_impl(impl)
    idx = tokens(1, T)
    base = logits(m, idx)
    for j in (0, 5, 11):
        changed = idx.clone()
        changed[0, j] = (changed[0, j] + 1) % 64
        moved = (logits(m, changed) - base).abs().amax(-1)[0]  # (T,)
        reach = (torch.arange(T) >= j) & (torch.arange(T) < j + W)
        assert (moved[reach] > 1e-5).all() and (moved[~reach] == 0).all(), (j, moved)


def test_windowed_mask_equals_the_definition_for_padded_and_cached_contexts():
    W = 3
    valid = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    pos = (valid.long().cumsum(-1) - 1).clamp(min=0)
    ctx = padded_context(pos[:, 4:], pos, valid)  # 3 queries after 4 cached slots
    got = windowed(ctx, W).mask[:, 0]  # (B, T, S)
    slot = torch.arange(7)
    for b in range(2):
        for t, i in enumerate(range(4, 7)):
            want = (slot <= i) & (valid[b] | (slot == i)) & (pos[b, i] - pos[b] < W)
            assert torch.equal(got[b, t], want), (b, i)
    plain = causal_context(0, 7, torch.device("cpu"))
    assert windowed(plain, 7).is_causal and windowed(plain, 7).mask is None  # every key within reach: kept fused
    want = (slot[None, :] <= slot[:, None]) & (slot[:, None] - slot[None, :] < W)
    assert torch.equal(windowed(plain, W).mask[0, 0], want)


def test_sinks_take_their_share_of_every_softmax():
    """Query 0 sees only key 0: out = v0 * e^s / (e^s + e^sink) = v0 * sigmoid(s - sink), and a sink of
    -inf is plain attention (gpt-oss's eager attention, closed form)."""
    m = Transformer(tiny_config(n_layers=1, **{"attention.sinks": "learned"})).eval()
    attn = m.blocks[0].attn
    q, k, v = torch.randn(3, 1, 4, 5, 8).unbind(0)  # (B, H, T, hd)
    ctx = causal_context(0, 5, torch.device("cpu"))
    with torch.no_grad():
        attn.sinks.copy_(torch.tensor([-1.0, 0.0, 0.5, 2.0]))
        y = attn.attend_explicit(q, k, v, ctx)
        s0 = (q[:, :, 0] * k[:, :, 0]).sum(-1) * attn.scale  # (B, H)
        assert_close(y[:, :, 0], v[:, :, 0] * torch.sigmoid(s0 - attn.sinks)[..., None])
        plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert not torch.allclose(y, plain, atol=1e-3)
        attn.sinks.fill_(-1e4)
        assert_close(attn.attend_explicit(q, k, v, ctx), plain)


def test_partial_rotary_rotates_the_first_dims_as_a_rotary_of_that_width_and_passes_the_rest():
    cfg = tiny_config(n_heads=2, **{"rope.partial": 0.25})  # head_dim 16, 4 rotated
    assert cfg.rotary_dim == 4
    narrow = tiny_config(n_heads=8)  # head_dim 4: a whole-head rotary of the same width and base
    ctx = causal_context(0, 6, torch.device("cpu"))
    x = torch.randn(1, 3, 6, 16)
    wide_rope, narrow_rope = Rotary(position_args(cfg)), Rotary(position_args(narrow))
    got = wide_rope.attention_term().rotate(x, wide_rope.attach(ctx))
    want = narrow_rope.attention_term().rotate(x[..., :4], narrow_rope.attach(causal_context(0, 6, x.device)))
    assert_close(got[..., :4], want)
    assert torch.equal(got[..., 4:], x[..., 4:])


def test_nope_layers_have_no_positions_and_rotary_layers_keep_theirs():
    every = Transformer(tiny_config(init_std=0.3, **{"rope.nope_every": 1})).eval()
    none = Transformer(tiny_config(init_std=0.3, positions="none")).eval()
    none.load_state_dict(every.state_dict())
    idx = tokens(2, 12)
    assert_close(logits(every, idx), logits(none, idx))
    second = Transformer(tiny_config(n_layers=4, **{"rope.nope_every": 2})).eval()
    rotated = [type(b.attn.term).__name__ for b in second.blocks]
    assert rotated == ["RotaryTerm", "AttentionTerm", "RotaryTerm", "AttentionTerm"]
    assert second.blocks[0].attn.heads == second.blocks[0].attn.heads_rotary  # the fused path stays for rotary
    assert second.blocks[1].attn.heads == second.blocks[1].attn.heads_split


def test_local_layers_rotate_with_their_own_unscaled_base():
    """Every layer local with rope.local_base=b is the model whose rope has base b and no scaling."""
    window = {"attention.window": 5, "attention.pattern": ["local"], "init_std": 0.3}
    own = Transformer(tiny_config(**window, **{"rope.local_base": 100.0, "rope.scaling": "linear",
                                               "rope.factor": 4.0})).eval()
    plain = Transformer(tiny_config(**window, **{"rope.base": 100.0})).eval()
    plain.load_state_dict(own.state_dict())
    idx = tokens(2, T)
    assert_close(logits(own, idx), logits(plain, idx))
    global_base = Transformer(tiny_config(**window)).eval()
    global_base.load_state_dict(own.state_dict())
    assert not torch.allclose(logits(global_base, idx), logits(own, idx), atol=1e-3)


# ============================================================== fast path = reference
@pytest.mark.parametrize("variant", VARIANTS)
def test_sdpa_equals_the_explicit_reference(variant):
    m = model(variant)
    idx, mask = left_pad([list(range(3, 3 + T)), list(range(9, 9 + T - 7))])
    fast, fast_padded = logits(m, idx), logits(m, idx, attention_mask=mask)
    m.set_attention_impl("explicit")
    assert_close(fast, logits(m, idx), rtol=1e-5, atol=1e-5)
    assert_close(fast_padded, logits(m, idx, attention_mask=mask), rtol=1e-5, atol=1e-5)


# ============================================================== the decode cache
@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_then_token_by_token_equals_the_full_forward(variant):
    m = model(variant)
    idx = tokens(2, T, seed=1)
    full = logits(m, idx)
    cache = m.new_cache(2, T)
    chunks = [(0, 6), *((t, t + 1) for t in range(6, 14)), (14, T)]  # prefill, single tokens, a chunk
    with torch.no_grad():
        parts = [m(idx[:, a:b], cache=cache).logits for a, b in chunks]
    assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_padded_batch_rows_equal_each_row_alone(variant):
    m = model(variant)
    prompts = [p * 3 for p in PROMPTS]  # lengths 21, 9, 15, 3: past the windows
    idx, mask = left_pad(prompts)
    together = logits(m, idx, attention_mask=mask)
    for b, p in enumerate(prompts):
        assert_close(together[b, -len(p):], logits(m, torch.tensor([p]))[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_padded_generation_fixed_shape_decoder_equals_eager_and_each_row_alone(variant):
    """The static cache attends over every slot with a mask: the window must be in that mask."""
    m = model(variant)
    prompts = [p * 2 for p in PROMPTS]
    eager = run(m, prompts, 12, temperature=0, decoder="eager")
    assert torch.equal(run(m, prompts, 12, temperature=0, decoder="static"), eager)
    sampled = dict(temperature=0.9, top_k=10, seed=3)
    sampled_eager = run(m, prompts, 12, decoder="eager", **sampled)
    assert torch.equal(run(m, prompts, 12, decoder="static", **sampled), sampled_eager)
    for b, p in enumerate(prompts):
        assert torch.equal(run(m, [p], 12, temperature=0, decoder="eager")[0], eager[b]), b


def test_the_window_changes_what_generation_says():
    """The decode tests above test something: without the window the same weights decode otherwise."""
    m = model("all_local_gqa")
    full = Transformer(m.config.override({"attention.window": None, "attention.pattern": ["global"]})).eval()
    full.load_state_dict(m.state_dict())
    prompts = [p * 3 for p in PROMPTS]
    assert not torch.equal(run(m, prompts, 12, temperature=0), run(full, prompts, 12, temperature=0))


@pytest.mark.slow
def test_compiled_decoder_with_windows_and_sinks_equals_eager(monkeypatch):
    import torch._dynamo

    from lmlab import decoders as dec

    m = model("window_sinks", **{"rope.local_base": 100.0})
    kw = dict(temperature=0.9, top_k=10, seed=3)
    prompts = [p * 2 for p in PROMPTS]
    eager = run(m, prompts, 12, decoder="eager", **kw)
    torch._dynamo.reset()
    monkeypatch.setitem(dec.COMPILED, "step", torch.compile(dec.decode_step, dynamic=False, backend="aot_eager"))
    assert torch.equal(run(m, prompts, 12, decoder="compiled", **kw), eager)
    torch._dynamo.reset()


# ============================================================== validation
ERRORS = {
    "window without local layers": ({"attention.window": 8}, "attention.window=8 has no local layer to act on"),
    "local layers without window": ({"attention.pattern": ["local"]}, "has local layers but attention.window is unset"),
    "empty pattern": ({"attention.pattern": []}, "attention.pattern=[] is empty"),
    "bad kind": ({"attention.pattern": ["sliding"]}, "not a valid choice"),
    "partial out of range": ({"rope.partial": 1.5}, "rope.partial=1.5 is not valid"),
    "odd rotary width": ({"rope.partial": 0.4}, "rope.partial=0.4 rotates 3 of head_dim=8"),
    "partial without rope": ({"positions": "alibi", "rope.partial": 0.5}, "rope.partial=0.5 only applies"),
    "local base without local layers": ({"rope.local_base": 100.0}, "rope.local_base=100.0 is the base of local"),
    "sinks with relative": ({"positions": "relative", "attention.sinks": "learned"}, "positions='relative'"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_invalid_choices_are_refused_in_one_line_naming_the_field(case):
    fields, message = ERRORS[case]
    with pytest.raises(ValueError) as err:
        tiny_config(**fields)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_pattern_longer_than_the_model_is_cut_at_its_layers():
    cfg = tiny_config(**{"attention.window": 4, "attention.pattern": ["local", "local", "global"]})
    assert [cfg.attention.kind(i) for i in range(cfg.n_layers)] == ["local", "local"]


@pytest.mark.parametrize("preset", ["gemma3", "gpt-oss"])
def test_presets_decode_from_the_cache_as_the_full_forward(preset):
    m = Transformer(ModelConfig.from_preset(preset, d_model=64, vocab_size=64, max_seq_len=64, init_std=0.1)).eval()
    kinds = [m.config.attention.kind(i) for i in range(m.config.n_layers)]
    assert kinds == {"gemma3": ["local"] * 5 + ["global"], "gpt-oss": ["local", "global"] * 2}[preset]
    idx = tokens(2, 80)  # past the window (64) and the context
    full = logits(m, idx)
    cache = m.new_cache(2, 80)
    with torch.no_grad():
        parts = [m(idx[:, :70], cache=cache).logits] + [m(idx[:, t : t + 1], cache=cache).logits for t in range(70, 80)]
    assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-5)


def test_the_config_round_trips():
    cfg = tiny_config(**VARIANTS["local_base"], **{"attention.sinks": "learned", "rope.nope_every": 2})
    assert ModelConfig.from_yaml(cfg.to_yaml()) == cfg
