"""ModelConfig.init: the N(0, init_std) default against Xavier-normal matrices (the norm experiment's init factor)."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab import Transformer
from helpers import tiny_config


def _std(w: torch.Tensor) -> float:
    return w.detach().float().std().item()


def _close(w: torch.Tensor, expected: float, rel: float = 0.06) -> None:
    assert abs(_std(w) / expected - 1) < rel, (_std(w), expected)


@pytest.mark.parametrize("ffn", ["mlp", "glu"])
def test_xavier_init_draws_every_matrix_xavier_normal_and_embeddings_at_d_to_the_minus_half(ffn):
    d, vocab = 128, 512
    model = Transformer(
        tiny_config(d_model=d, n_layers=2, n_heads=4, n_kv_heads=4, ffn=ffn, vocab_size=vocab, init="xavier")
    )
    dff = model.config.d_ff

    def xavier(fan_out, fan_in):
        return math.sqrt(2.0 / (fan_in + fan_out))

    for block in model.blocks:
        for w in block.attn.qkv.weight.split([d, d, d], dim=0):  # q, k, v: each its own matrix
            _close(w, xavier(d, d))
        _close(block.attn.out.weight, xavier(d, d))
        _close(block.ffn.down.weight, xavier(d, dff))
        ins = [block.ffn.up.weight] if ffn == "mlp" else list(block.ffn.gate_up.weight.chunk(2, dim=0))
        for w in ins:
            _close(w, xavier(dff, d))
    _close(model.head.weight, xavier(vocab, d))
    _close(model.embed.weight, d ** -0.5)
    # the default rule is unchanged: everything N(0, 0.02)
    normal = Transformer(tiny_config(d_model=d, n_layers=2, n_heads=4, n_kv_heads=4, ffn=ffn, vocab_size=vocab))
    for w in (normal.blocks[0].attn.out.weight, normal.blocks[0].ffn.down.weight, normal.head.weight,
              normal.embed.weight):
        _close(w, 0.02)


def test_xavier_init_is_a_pure_function_of_the_seed_and_keeps_deepnorm_gains():
    a = Transformer(tiny_config(init="xavier", init_seed=3))
    b = Transformer(tiny_config(init="xavier", init_seed=3))
    c = Transformer(tiny_config(init="xavier", init_seed=4))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.embed.weight, c.embed.weight)
    # with DeepNorm the matrices keep the beta gain; xavier adds the embedding/head rule
    L, d = 8, 128
    dn = Transformer(tiny_config(d_model=d, n_heads=4, n_kv_heads=4, n_layers=L, norm_position="post",
                                 residual_scaling="deepnorm", init="xavier", ffn="mlp"))
    beta = (8 * L) ** -0.25
    _close(dn.blocks[0].ffn.down.weight, beta * math.sqrt(2.0 / (d + dn.config.d_ff)))


def test_xavier_with_gpt2_scaling_is_refused_with_one_line():
    with pytest.raises(ValueError, match="init='xavier' and residual_scaling='gpt2'") as e:
        tiny_config(init="xavier", residual_scaling="gpt2")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="init"):
        tiny_config(init="kaiming")


def test_a_model_on_the_meta_device_counts_parameters_without_drawing_them():
    cfg = tiny_config(d_model=64, n_layers=3, n_heads=4, **{"moe": {"n_experts": 4, "top_k": 2}})
    real = Transformer(cfg)
    with torch.device("meta"):
        meta = Transformer(cfg)
    assert all(p.is_meta for p in meta.parameters())
    assert meta.num_params() == real.num_params() and meta.flops_per_token(16) == real.flops_per_token(16)
    assert torch.equal(Transformer(cfg).embed.weight, real.embed.weight)  # a real model's draws are unchanged
