"""Query/key norms and the attention output gate, each against its closed form; the normalized heads
path against the reference; and the config's named choices."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config
from torch.testing import assert_close

from lmlab import ModelConfig, Transformer


def _randomize_norms_(attn) -> None:
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in attn.qk_norm.parameters():
            p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("kv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("positions", ["rope", "rope-interleaved", "alibi"])
@pytest.mark.parametrize("qk_norm", ["head", "full"])
def test_normalized_heads_equal_the_reference_in_values_and_gradients(qk_norm, positions, kv):
    extra = {"rope.layout": "interleaved"} if positions == "rope-interleaved" else {}
    cfg = tiny_config(positions=positions.split("-")[0], n_kv_heads=kv, qk_norm=qk_norm, **extra)
    model = Transformer(cfg)
    attn = model.blocks[0].attn
    assert attn.heads == attn.heads_normalized  # chosen at construction: the fused rotary Function cannot normalize
    _randomize_norms_(attn)
    B, T, H, hd = 2, 9, cfg.n_heads, cfg.head_dim
    ctx = model.positions.context(0, T, torch.device("cpu"))
    qkv = torch.randn(B, T, H + 2 * kv, hd, generator=torch.Generator().manual_seed(3))

    def run(heads):
        x = qkv.clone().requires_grad_()
        outs = heads(x, ctx)
        probes = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)) for i, o in enumerate(outs)]
        sum((o * p).sum() for o, p in zip(outs, probes)).backward()
        grads = [x.grad] + [p.grad.clone() for p in attn.qk_norm.parameters()]
        attn.zero_grad(set_to_none=True)
        return [o.detach() for o in outs], grads

    (fast, g_fast), (ref, g_ref) = run(attn.heads), run(attn.heads_reference)
    for a, b in zip(fast + g_fast, ref + g_ref):
        assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_without_qk_norm_rotary_heads_keep_the_fused_path():
    attn = Transformer(tiny_config(positions="rope")).blocks[0].attn
    assert attn.heads == attn.heads_rotary and not list(attn.qk_norm.parameters())


@pytest.mark.parametrize("qk_norm", ["head", "full"])
def test_qk_norm_is_rms_norm_over_each_head_or_over_the_whole_projection(qk_norm):
    """head (Qwen3): q_h g / rms(q_h) per head, one g (hd,) for all heads; full (OLMo 2): q g / rms(q) over all
    H*hd values, g (H*hd,). Without positions the heads come out exactly normalized, unrotated."""
    cfg = tiny_config(positions="none", n_kv_heads=2, qk_norm=qk_norm, norm_eps=1e-6)
    attn = Transformer(cfg).blocks[0].attn
    _randomize_norms_(attn)
    H, KV, hd, T = 4, 2, cfg.head_dim, 5
    qkv = torch.randn(1, T, H + 2 * KV, hd, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        q, k, v = attn.heads(qkv, None)  # (1, heads, T, hd)

    def rms(x, dims):
        return x.pow(2).mean(dims, keepdim=True).add(1e-6).sqrt()

    norms = attn.qk_norm
    for got, raw, gain in ((q, qkv[:, :, :H], norms.q_norm.weight), (k, qkv[:, :, H:H + KV], norms.k_norm.weight)):
        if qk_norm == "head":
            assert gain.shape == (hd,)
            expected = raw / rms(raw, (-1,)) * gain
        else:
            assert gain.shape == (raw.shape[2] * hd,)
            expected = raw / rms(raw, (-2, -1)) * gain.view(raw.shape[2], hd)
        assert_close(got, expected.transpose(1, 2), rtol=1e-5, atol=1e-6)
    assert torch.equal(v, qkv[:, :, H + KV:].transpose(1, 2))


@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
def test_output_gate_scales_each_element_or_head_by_a_sigmoid_of_the_block_input(gate):
    """out((softmax(q k^T / sqrt(d)) v) * sigmoid(x W_g + b)): per element (W_g: d_model -> H*hd) or per head
    (W_g: d_model -> H), before the output projection (Qiu et al. 2025, eq. 5)."""
    cfg = tiny_config(positions="rope", n_kv_heads=2, attn_gate=gate, bias=True, init_std=0.2)
    model = Transformer(cfg)
    attn, B, T, H, hd = model.blocks[0].attn, 2, 6, cfg.n_heads, cfg.head_dim
    proj = attn.gate.proj
    assert proj.weight.shape == (H * hd if gate == "elementwise" else H, cfg.d_model) and proj.bias is not None
    with torch.no_grad():
        proj.bias.normal_(generator=torch.Generator().manual_seed(2))
    x = torch.randn(B, T, cfg.d_model, generator=torch.Generator().manual_seed(0))
    ctx = model.positions.attach(model.positions.context(0, T, x.device))
    with torch.no_grad():
        y = attn(x, ctx)
        q, k, v = attn.heads_reference(attn.qkv(x).view(B, T, H + 4, hd), ctx)
        core = attn.attend_explicit(q, k, v, ctx).transpose(1, 2)  # (B, T, H, hd)
        g = torch.sigmoid(x @ proj.weight.T + proj.bias).view(B, T, H, -1)
        expected = attn.out((core * g).reshape(B, T, H * hd))
    assert_close(y, expected, rtol=1e-5, atol=1e-6)


def test_new_parameters_start_at_identity_gains_and_drawn_gates():
    model = Transformer(tiny_config(qk_norm="full", attn_gate="elementwise", norm_position="sandwich"))
    block = model.blocks[0]
    for p in (*block.attn.qk_norm.parameters(), block.post_norm1.weight, block.post_norm2.weight):
        assert torch.equal(p, torch.ones_like(p))
    w = block.attn.gate.proj.weight
    assert 0.015 < w.std().item() < 0.025  # N(0, init_std = 0.02), 1024 draws
    xavier = Transformer(tiny_config(attn_gate="elementwise", init="xavier")).blocks[0].attn.gate.proj.weight
    assert 0.15 < xavier.std().item() < 0.2  # an attention matrix: Xavier-normal, sqrt(2 / (32 + 32)) = 0.177


@pytest.mark.parametrize("placement", ["pre", "sandwich", "reordered"])
def test_deepnorm_needs_post_norm(placement):
    with pytest.raises(ValueError, match="residual_scaling='deepnorm' needs norm_position='post'"):
        ModelConfig(norm_position=placement, residual_scaling="deepnorm")


def test_qk_norm_head_with_the_elementwise_gate_computes_qwen3_next_attention():
    """Qwen3-Next's full-attention layer (q_proj writes [q_h; gate_h] per head, zero-centred q/k norm gains
    1 + w, output * sigmoid(gate)) is qk_norm='head' + attn_gate='elementwise': its weights map row by row."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention

    H, KV, hd, D, T = 4, 2, 8, 32, 7
    config = transformers.Qwen3NextConfig(hidden_size=D, num_attention_heads=H, num_key_value_heads=KV, head_dim=hd,
                                          rms_norm_eps=1e-6, attention_bias=False)
    config._attn_implementation = "eager"
    theirs = Qwen3NextAttention(config, layer_idx=3).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    model = Transformer(tiny_config(n_kv_heads=KV, qk_norm="head", attn_gate="elementwise", norm_eps=1e-6))
    ours = model.blocks[0].attn
    q, gate = theirs.q_proj.weight.view(H, 2, hd, D).unbind(1)  # per head: [q_h; gate_h]
    with torch.no_grad():
        ours.qkv.weight.copy_(torch.cat([q.reshape(H * hd, D), theirs.k_proj.weight, theirs.v_proj.weight]))
        ours.gate.proj.weight.copy_(gate.reshape(H * hd, D))
        ours.qk_norm.q_norm.weight.copy_(1 + theirs.q_norm.weight)
        ours.qk_norm.k_norm.weight.copy_(1 + theirs.k_norm.weight)
        ours.out.weight.copy_(theirs.o_proj.weight)
    x = torch.randn(1, T, D, generator=g)
    angles = torch.arange(T)[:, None] * 10000.0 ** (-torch.arange(0, hd, 2) / hd)  # (T, hd/2)
    cos, sin = torch.cat([angles, angles], -1).cos()[None], torch.cat([angles, angles], -1).sin()[None]
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
    ctx = model.positions.attach(model.positions.context(0, T, x.device))
    with torch.no_grad():
        assert_close(ours(x, ctx), theirs(x, (cos, sin), causal)[0], rtol=1e-5, atol=1e-6)
