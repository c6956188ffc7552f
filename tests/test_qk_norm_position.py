"""``qk_norm_position``: the per-head query/key RMSNorm before rotary (Qwen3, Gemma 3) or after it (HunYuan-MoE).
Rotary turns pairs of dimensions without changing a head's length, so the two orders differ only through the
norm's gain: equal where each rotary pair shares its gain (as at initialization), different otherwise; the
reference equals the fast path, decoding with the cache equals the full forward, and what has no order is refused."""

from __future__ import annotations

import pytest
import torch
from helpers import decoded_logits

from lmlab import ModelConfig, Transformer

TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, qk_norm="head",
            init_std=0.2)


def model(position: str, layout: str = "half") -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**TINY, qk_norm_position=position, rope=dict(layout=layout))).eval()


def pair_gains(m: Transformer, layout: str, shared: bool) -> None:
    """Random q/k norm gains; ``shared``: equal within each rotary pair (j, j + d/2) or (2j, 2j + 1)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for b in m.blocks:
            for norm in (b.attn.qk_norm.q_norm, b.attn.qk_norm.k_norm):
                d = norm.weight.numel()
                w = 1 + 0.5 * torch.randn(d if not shared else d // 2, generator=g)
                if shared:
                    w = w.repeat(2) if layout == "half" else w.repeat_interleave(2)
                norm.weight.copy_(w)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_the_order_matters_only_through_gains_that_differ_within_a_rotary_pair(layout):
    idx = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(0))
    after, before = model("after_rope", layout), model("before_rope", layout)
    for shared, equal in ((True, True), (False, False)):
        pair_gains(after, layout, shared)
        before.load_state_dict(after.state_dict())
        with torch.no_grad():
            a, b = after(idx).logits, before(idx).logits
        assert torch.allclose(a, b, atol=1e-4) == equal


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_the_reference_and_the_cache_equal_the_fast_path(layout):
    m = model("after_rope", layout)
    pair_gains(m, layout, shared=False)
    idx = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        fast = m(idx).logits
        torch.testing.assert_close(decoded_logits(m, idx, prefill=6), fast, rtol=1e-5, atol=1e-5)
        m.set_attention_impl("explicit")
        for block in m.blocks:
            block.attn.heads = block.attn.heads_reference
        torch.testing.assert_close(m(idx).logits, fast, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fields", [dict(qk_norm="full"), dict(qk_norm="none"), dict(positions="alibi")])
def test_a_norm_without_an_order_is_refused(fields):
    with pytest.raises(ValueError, match="qk_norm_position='after_rope' places the per-head query/key norm after "
                                         "rotary; it needs qk_norm='head' and positions='rope'"):
        ModelConfig(**{**TINY, **fields}, qk_norm_position="after_rope")


def test_the_default_keeps_old_run_identities():
    cfg = ModelConfig(**TINY)
    assert cfg.qk_norm_position == "before_rope" and "qk_norm_position" not in cfg.identity_dict()
