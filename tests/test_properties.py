"""Invariants over the whole variant grid:
norm placement × norm × positions × feed-forward × attention (MHA/GQA); query/key norm × output gate ×
positions; plus a few extra designs
(multi-head latent attention among them).

For every combination: causality, cached incremental decoding equals the full forward, every
parameter gets a gradient, and weights and outputs are a pure function of (config, init_seed).
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from helpers import assert_mtp_cache_equals_full, tiny_config, tokens
from torch.testing import assert_close

from lmlab import Transformer

T = 12  # sequence length; > relative_clip + 1 so every relative offset bucket is used
GRID_AXES = dict(
    norm_position=["pre", "post", "sandwich", "reordered"],
    norm=["layernorm", "rmsnorm"],
    positions=["none", "sinusoidal", "learned", "relative", "alibi", "rope"],
    ffn=[("mlp", "gelu"), ("glu", "silu")],
    attention=[("mha", 4), ("gqa", 2)],
)


def _grid() -> dict[str, dict]:
    cases = {}
    for pos, norm, scheme, (ffn, act), (attn, kv) in itertools.product(*GRID_AXES.values()):
        name = f"{pos}-{norm}-{scheme}-{ffn}-{attn}"
        cases[name] = dict(norm_position=pos, norm=norm, positions=scheme, ffn=ffn, activation=act, n_kv_heads=kv)
    return cases


EXTRAS = {  # designs the grid's axes do not reach
    "mqa": dict(n_kv_heads=1),
    "deepnorm": dict(norm_position="post", norm="layernorm", residual_scaling="deepnorm"),
    "gpt2-scaled-tied": dict(positions="learned", ffn="mlp", residual_scaling="gpt2", tie_embeddings=True),
    "sqrt_d-embed": dict(positions="sinusoidal", embed_scale="sqrt_d", tie_embeddings=True),
    "rope-interleaved": dict(positions="rope", **{"rope.layout": "interleaved"}),
    "explicit-attention": dict(positions="rope", n_kv_heads=2, _impl="explicit"),
    # per-layer windows (< T), learned sinks, partial rotary, NoPE layers, local rotary base; with every layer
    # local, two layers of window 6 still reach T - 1 = 11 tokens back, as the causality test asks
    "window-local-global": {"attention.window": 4, "attention.pattern": ["local", "global"]},
    "window-all-local-sinks-gqa": {"attention.window": 6, "attention.pattern": ["local"], "attention.sinks": "learned",
                                   "n_kv_heads": 2},
    "sinks-explicit": {"attention.sinks": "learned", "_impl": "explicit"},
    "sinks-alibi-post": {"attention.sinks": "learned", "positions": "alibi", "norm_position": "post"},
    "partial-rotary": {"rope.partial": 0.5},
    "nope-every-2": {"rope.nope_every": 2},
    "local-rope-base": {"attention.window": 4, "attention.pattern": ["local", "global"], "rope.local_base": 100.0},
    # multi-head latent attention: the default (expanded, absorbed from the cache), the reference everywhere,
    # absorbed everywhere; compressed queries; post-norm; interleaved rotary
    "mla": dict(positions="rope", mla=dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)),
    "mla-explicit": dict(positions="rope", mla=dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                                    v_head_dim=6), _impl="explicit"),
    "mla-absorbed-q-lora": dict(positions="rope", mla=dict(q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8,
                                                           qk_rope_head_dim=4, v_head_dim=6), _impl="absorbed"),
    "mla-sandwich": dict(positions="rope", norm_position="sandwich", mla=dict(kv_lora_rank=16, qk_nope_head_dim=8,
                                                                              qk_rope_head_dim=4, v_head_dim=6)),
    "mla-post-interleaved": {"positions": "rope", "norm_position": "post", "rope.layout": "interleaved",
                             "mla": dict(q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                         v_head_dim=6)},
    # Gemma 3: RMSNorm gains stored as 1 + w (q/k norms too), scores over sqrt(attention.scale_dim), scaled
    # embeddings, local/global layers with their own rotary base; scale_dim with relative positions' key term
    "gemma3-offset-gain-scale-dim": {"norm": "rmsnorm", "norm_gain": "offset", "norm_position": "sandwich",
                                     "qk_norm": "head", "embed_scale": "sqrt_d", "attention.scale_dim": 24,
                                     "attention.window": 4, "attention.pattern": ["local", "global"],
                                     "rope.local_base": 100.0, "activation": "gelu_tanh"},
    "offset-gain-qk-full-post": {"norm_gain": "offset", "qk_norm": "full", "norm_position": "post"},
    "scale-dim-relative-explicit": {"positions": "relative", "attention.scale_dim": 4, "_impl": "explicit"},
    # gpt-oss: experts with biases and the clamped gated unit (quick_gelu), a bias on the router logits, learned sinks
    # and windows; the clamped unit and quick_gelu in a dense GLU (quick_gelu through the fused GLU's backward)
    "gpt-oss-moe": {"ffn": "glu", "activation": "quick_gelu", "glu_variant": "clamped", "attention.sinks": "learned",
                    "attention.window": 6, "attention.pattern": ["local", "global"], "n_kv_heads": 2,
                    "moe": dict(n_experts=4, top_k=2, normalize_top_k=True, router_bias=True)},
    "clamped-glu-dense": {"ffn": "glu", "activation": "quick_gelu", "glu_variant": "clamped"},
    "quick-gelu-glu": {"ffn": "glu", "activation": "quick_gelu"},
    "router-bias-sigmoid": {"moe": dict(n_experts=4, top_k=2, scoring="sigmoid", normalize_top_k=True,
                                        router_bias=True)},
    # multi-token prediction (DeepSeek-V3): the gradient test's loss includes the MTP loss
    "mtp": {"mtp.depth": 2},
    "mtp-post-learned-relative": dict(norm_position="post", norm="layernorm", positions="relative", **{"mtp.depth": 1}),
    "mtp-alibi-tied": dict(positions="alibi", tie_embeddings=True, **{"mtp.depth": 3}),
}
# the attention refinements across position schemes with their own attention path (rotary fused or
# split, relative's explicit path with a value term, ALiBi's bias), grouped-query
QK_GATE_AXES = dict(
    qk_norm=["none", "head", "full"],
    attn_gate=["none", "elementwise", "headwise"],
    positions=["rope", "relative", "alibi"],
)


def _qk_gate_grid() -> dict[str, dict]:
    cases = {}
    for qk, gate, scheme in itertools.product(*QK_GATE_AXES.values()):
        if qk == gate == "none":  # the main grid's
            continue
        cases[f"qk_{qk}-gate_{gate}-{scheme}"] = dict(qk_norm=qk, attn_gate=gate, positions=scheme, n_kv_heads=2)
    return cases


EXTRAS.update({
    "qk_full-rope-interleaved": dict(qk_norm="full", positions="rope", n_kv_heads=2, **{"rope.layout": "interleaved"}),
    "qk_head-gate-sandwich-explicit": dict(qk_norm="head", attn_gate="elementwise", norm_position="sandwich",
                                           _impl="explicit"),
})
MTP_CASES = [name for name in EXTRAS if name.startswith("mtp")]
CASES = {**_grid(), **_qk_gate_grid(), **EXTRAS}


@functools.lru_cache(maxsize=None)
def _model(case: str) -> Transformer:
    fields = dict(CASES[case])
    impl = fields.pop("_impl", None)
    # init_std 0.1: attention at init is near-uniform with 0.02, making causal effects tiny
    model = Transformer(tiny_config(bias=True, relative_clip=4, init_std=0.1, **fields)).eval()
    if impl:
        model.set_attention_impl(impl)
    return model


def test_grid_is_complete():
    assert len(_grid()) == 4 * 2 * 6 * 2 * 2 == 192
    assert len(_qk_gate_grid()) == (3 * 3 - 1) * 3 == 24


@pytest.mark.parametrize("case", CASES)
def test_causal(case):
    model = _model(case)
    idx = tokens(2, T)
    with torch.no_grad():
        base = model(idx).logits
        for t in (0, 4, T - 2):  # change token t + 1
            changed = idx.clone()
            changed[:, t + 1] = (changed[:, t + 1] + 1) % 64
            out = model(changed).logits
            assert_close(out[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-6)
            moved = (out[:, t + 1 :] - base[:, t + 1 :]).abs().amax(dim=-1)  # (B, T - t - 1)
            assert (moved > 1e-5).all(), f"position after {t + 1} ignored the change: {moved}"


@pytest.mark.parametrize("case", CASES)
def test_cached_decoding_equals_full_forward(case):
    model = _model(case)
    idx = tokens(2, T, seed=1)
    with torch.no_grad():
        full = model(idx).logits
        cache = model.new_cache(2, T)
        chunks = [(0, 5), (5, 6), (6, 7), (7, 8), (8, T)]  # prefill, 3 single tokens, a multi-token chunk
        parts = [model(idx[:, a:b], cache=cache).logits for a, b in chunks]
    assert cache.length == T
    assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-5)
    # hidden() with a cache is the same stream: the last position's logits from a fresh cache
    with torch.no_grad():
        cache = model.new_cache(2, T)
        model.hidden(idx[:, :-1], cache)
        last = model.head(model.hidden(idx[:, -1:], cache))
    assert_close(last[:, 0], full[:, -1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_every_parameter_gets_a_gradient(case):
    model = _model(case)
    model.zero_grad(set_to_none=True)
    idx = tokens(2, T + 1, seed=2)
    model(idx[:, :-1], targets=idx[:, 1:]).loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    model.zero_grad(set_to_none=True)
    assert not missing, f"no gradient reaches {missing}"


@pytest.mark.parametrize("case", CASES)
def test_same_seed_same_model_other_seed_differs(case):
    cfg = _model(case).config
    torch.manual_seed(123)  # the global RNG must not matter
    a = Transformer(cfg).eval()
    torch.manual_seed(456)
    b = Transformer(cfg).eval()
    c = Transformer(cfg.replace(init_seed=1)).eval()
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() == sc.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    # norms start at 1/0 and biases (the experts' (E, F) ones too) at 0 whatever the seed
    random = [n for n, p in sa.items() if p.ndim == 2 and not n.endswith("bias")]
    assert random and all(not torch.equal(sa[n], sc[n]) for n in random)
    idx = tokens(2, T, seed=3)
    with torch.no_grad():
        la, lb, lc = a(idx).logits, b(idx).logits, c(idx).logits
    assert torch.equal(la, lb)
    assert not torch.allclose(la, lc)


def _mtp_hidden(model: Transformer, x: torch.Tensor) -> list[torch.Tensor]:
    """Every depth's hidden states for the sequence x (B, T + 1): inputs x[:, :-1], targets x[:, 1:]."""
    h, ctx = model.hidden_and_context(x[:, :-1])
    return model.mtp.hidden_states(h, x[:, 1:], ctx, model.embed_tokens)


@pytest.mark.parametrize("case", MTP_CASES)
def test_mtp_predictions_are_causal(case):
    """Depth k at position i predicts t_{i+k+1} from t_0 .. t_{i+k}: changing t_j moves no prediction of depth k
    before position j - k (it would see its own target or later), and moves the one at j - k."""
    model = _model(case)
    x = tokens(2, T + 1, seed=5)
    with torch.no_grad():
        base = _mtp_hidden(model, x)
        for j in (3, 7, T):
            changed = x.clone()
            changed[:, j] = (changed[:, j] + 1) % 64
            for k, (a, b) in enumerate(zip(base, _mtp_hidden(model, changed)), start=1):
                assert_close(b[:, : max(j - k, 0)], a[:, : max(j - k, 0)], rtol=0, atol=1e-6)
                if j - k < T:
                    assert (b[:, j - k] - a[:, j - k]).abs().amax() > 1e-5, (k, j)


@pytest.mark.parametrize("case", MTP_CASES)
def test_mtp_cached_equals_full(case):
    """The MTP blocks' own cache (speculative decoding's drafts), fed in chunks, gives the full forward's states."""
    model = _model(case)
    assert_mtp_cache_equals_full(model, T)
