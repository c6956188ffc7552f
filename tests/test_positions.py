"""Position schemes against their closed forms, each computed independently here."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_config, tokens
from torch.testing import assert_close

from lmlab import Transformer
from lmlab.positions import RelativeTerm, alibi_slopes, build_positions, position_args

# ---------------------------------------------------------------- rotary
ROPE_CASES = {
    "none": {},
    "linear": {"rope.scaling": "linear", "rope.factor": 4.0},
    "ntk": {"rope.scaling": "ntk", "rope.factor": 4.0},
    "yarn": {"rope.scaling": "yarn", "rope.factor": 4.0, "rope.original_max_seq_len": 16},
    "llama3": {"rope.scaling": "llama3", "rope.factor": 8.0, "rope.original_max_seq_len": 16},
}


def _rotate_at_every_position(cfg, x: torch.Tensor) -> torch.Tensor:
    """x (H, hd) -> (H, P, hd): x rotated as it would be at each position 0 .. P-1."""
    scheme = build_positions(cfg)
    P = cfg.max_seq_len
    ctx = scheme.context(0, P, torch.device("cpu"))
    xs = x[:, None, :].expand(-1, P, -1)[None]  # (1, H, P, hd)
    return scheme.attention_term().rotate(xs, ctx)[0]


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("scaling", ROPE_CASES)
def test_rotary_scores_depend_only_on_offset(layout, scaling):
    cfg = tiny_config(positions="rope", head_dim=16, max_seq_len=48, **{"rope.layout": layout}, **ROPE_CASES[scaling])
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 16, generator=g, dtype=torch.float32)  # 3 heads of random queries and keys
    rq, rk = _rotate_at_every_position(cfg, q), _rotate_at_every_position(cfg, k)  # (H, P, hd)
    scores = rq @ rk.transpose(-2, -1)  # (H, P, P): score of query at m, key at n
    # (m, n) and (m + s, n + s) give the same score for every shift s: the matrix is Toeplitz
    for s in (1, 7, 20):
        assert_close(scores[:, s:, s:], scores[:, :-s, :-s], rtol=1e-4, atol=1e-4)
    # ... and it does depend on m - n
    by_offset = torch.stack([scores[:, 10, 10 - d] for d in range(8)], dim=-1)  # (H, 8)
    assert (by_offset.std(dim=-1) > 1e-2).all()


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rotary_rotates_each_pair_by_p_theta(layout):
    d, base = 8, 10000.0
    cfg = tiny_config(positions="rope", head_dim=d, max_seq_len=20, **{"rope.layout": layout})
    x = torch.randn(1, d, generator=torch.Generator().manual_seed(1))
    out = _rotate_at_every_position(cfg, x)[0]  # (P, d)
    pairs = (
        [(i, i + d // 2) for i in range(d // 2)] if layout == "half" else [(2 * i, 2 * i + 1) for i in range(d // 2)]
    )
    expected = torch.zeros_like(out)
    for p in range(cfg.max_seq_len):
        for i, (a, b) in enumerate(pairs):
            angle = p * base ** (-2 * i / d)
            c, s = math.cos(angle), math.sin(angle)
            expected[p, a] = x[0, a] * c - x[0, b] * s
            expected[p, b] = x[0, a] * s + x[0, b] * c
    assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_rotary_cached_keys_keep_their_angles():
    """Queries at offset o get the same rotation as row o of a full-length context."""
    cfg = tiny_config(positions="rope")
    scheme = build_positions(cfg)
    full = scheme.context(0, 10, torch.device("cpu")).state
    tail = scheme.context(6, 4, torch.device("cpu")).state
    assert_close(tail[0], full[0][..., 6:, :], rtol=0, atol=0)  # cos, (1, 1, T, hd)
    assert_close(tail[1], full[1][..., 6:, :], rtol=0, atol=0)  # sin


def test_rotary_angles_survive_casting_the_model_to_bf16():
    cfg = tiny_config(positions="rope", d_model=256, n_heads=4, max_seq_len=4096)
    reference = Transformer(cfg).positions.context(0, 4096, torch.device("cpu")).state
    cast = Transformer(cfg).to(torch.bfloat16).positions.context(0, 4096, torch.device("cpu")).state
    assert_close(cast[0].float(), reference[0].float(), rtol=0, atol=1e-2)


# ---------------------------------------------------------------- sinusoidal
@pytest.mark.parametrize("offset", [0, 5])
@pytest.mark.parametrize("d", [32, 6])
def test_sinusoidal_matches_the_closed_form(offset, d):
    cfg = tiny_config(positions="sinusoidal", d_model=d, n_heads=2)
    scheme = build_positions(cfg)
    T = 9
    pe = scheme.embed(torch.zeros(1, T, d), scheme.context(offset, T, torch.device("cpu")))[0]
    expected = torch.tensor([
        [math.sin(p / 10000 ** (i / d)) if i % 2 == 0 else math.cos(p / 10000 ** ((i - 1) / d)) for i in range(d)]
        for p in range(offset, offset + T)
    ])
    assert_close(pe, expected, rtol=1e-5, atol=1e-5)


def test_sinusoidal_is_added_to_the_scaled_token_embedding():
    cfg = tiny_config(positions="sinusoidal", embed_scale="sqrt_d", n_layers=1)
    model = Transformer(cfg)
    idx = tokens(1, 5)
    seen = {}
    model.blocks[0].register_forward_pre_hook(lambda m, args: seen.update(x=args[0]))
    model(idx)
    table = build_positions(cfg).embed(torch.zeros(1, 5, 32), build_positions(cfg).context(0, 5, torch.device("cpu")))
    assert_close(seen["x"], model.embed.weight[idx] * math.sqrt(32) + table)


# ---------------------------------------------------------------- relative (Shaw et al. 2018)
def _relative(k: int, T: int):
    cfg = tiny_config(positions="relative", relative_clip=k, head_dim=8)
    term = RelativeTerm(position_args(cfg))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        term.rel_k.copy_(torch.randn(term.rel_k.shape, generator=g))
        term.rel_v.copy_(torch.randn(term.rel_v.shape, generator=g))
    ctx = build_positions(cfg).context(0, T, torch.device("cpu"))
    return term, ctx


def test_relative_offsets_beyond_k_share_one_score_term():
    k, T = 3, 10
    term, ctx = _relative(k, T)
    q = torch.randn(1, 2, T, 8, generator=torch.Generator().manual_seed(1))
    bias = term.score_bias(q, ctx)  # (1, 2, T, T)
    for i in range(T):
        far = [bias[0, :, i, j] for j in range(i + 1) if i - j >= k]
        near = [bias[0, :, i, i - r] for r in range(min(k, i + 1))]
        for b in far:  # every offset >= k uses a^K_k
            assert_close(b, far[0], rtol=0, atol=0)
            assert_close(b, q[0, :, i] @ term.rel_k[k] / math.sqrt(8))
        for r, b in enumerate(near):  # offsets below k each have their own a^K_r
            assert_close(b, q[0, :, i] @ term.rel_k[r] / math.sqrt(8))
        distinct = torch.stack(near + far[:1], dim=-1)  # (H, n)
        assert (distinct[:, :, None] - distinct[:, None, :]).abs().add(torch.eye(distinct.shape[-1])).min() > 1e-6


def test_relative_offsets_beyond_k_share_one_value_term():
    k, T = 3, 10
    term, ctx = _relative(k, T)
    for i in range(T):
        for j in range(i + 1):
            probs = torch.zeros(1, 1, T, T)
            probs[0, 0, i, j] = 1.0  # query i attends only to key j
            out = term.value_term(probs, ctx)[0, 0, i]
            assert torch.equal(out, term.rel_v[min(i - j, k)].detach())
    assert torch.cdist(term.rel_v, term.rel_v).add(torch.eye(k + 1)).min() > 1e-3  # k + 1 distinct vectors


def test_relative_index_continues_under_a_cache_offset():
    cfg = tiny_config(positions="relative", relative_clip=3)
    scheme = build_positions(cfg)
    full = scheme.context(0, 8, torch.device("cpu")).state
    tail = scheme.context(5, 3, torch.device("cpu")).state  # 3 queries at 5..7 over 8 keys
    assert torch.equal(tail, full[..., 5:, :])  # (1, 1, T, S)
    assert tail[0, 0].tolist()[0] == [3, 3, 3, 2, 1, 0, 0, 0]  # clipped at k; future keys masked anyway


# ---------------------------------------------------------------- ALiBi (Press et al. 2022)
def test_alibi_slopes_are_the_published_values():
    assert alibi_slopes(8).tolist() == [1 / 2**i for i in range(1, 9)]
    # 12 heads: the 8-head slopes, then every other one of the 16-head slopes (Press et al.'s code)
    sixteen = [2 ** (-0.5 * i) for i in range(1, 17)]
    assert_close(alibi_slopes(12), torch.tensor([1 / 2**i for i in range(1, 9)] + sixteen[0::2][:4]))


@pytest.mark.parametrize("offset", [0, 4])
def test_alibi_bias_is_minus_slope_times_distance(offset):
    cfg = tiny_config(positions="alibi", n_heads=8, d_model=64)
    T = 5
    bias = build_positions(cfg).context(offset, T, torch.device("cpu")).state  # (1, H, T, S)
    assert bias.shape == (1, 8, T, offset + T)
    for h in range(8):
        m = 2.0 ** -(h + 1)
        for t in range(T):
            i = offset + t
            for j in range(i + 1):
                assert bias[0, h, t, j].item() == -m * (i - j)


# ---------------------------------------------------------------- learned
def test_learned_positions_past_the_table_are_a_clear_error():
    model = Transformer(tiny_config(positions="learned", max_seq_len=8))
    model(tokens(1, 8))  # exactly the table: fine
    with pytest.raises(ValueError,
                       match=r"positions='learned' has a table of max_seq_len=8 positions "
                             r"and cannot encode position 8"):
        model(tokens(1, 9))
    cache = model.new_cache(1, 16)
    model(tokens(1, 6), cache=cache)
    with pytest.raises(ValueError, match="cannot encode position 9"):
        model(tokens(1, 4), cache=cache)


def test_learned_positions_index_the_table_by_absolute_position():
    cfg = tiny_config(positions="learned")
    scheme = build_positions(cfg)
    out = scheme.embed(torch.zeros(1, 3, 32), scheme.context(4, 3, torch.device("cpu")))
    assert torch.equal(out[0], scheme.table.weight[4:7].detach())
