"""DeepSeek-V4's routing in the MoE vocabulary: hash routing by a token-id table (``moe.hash_layers``), sqrt(softplus)
scores (``moe.scoring='sqrtsoftplus'``), the routed scale, and the clamped SwiGLU of its experts
(``glu_variant='limited'``): each against its closed form and transformers' DeepseekV4 blocks on the same weights;
the table a buffer that is drawn, saved and loaded; what the config refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import tokens
from torch.testing import assert_close

from lmlab import ModelConfig, Transformer
from lmlab.feedforward import limited_glu
from lmlab.moe import HashRouter, MoE, moe_args

V4_MOE = dict(n_experts=4, top_k=2, n_shared=1, d_expert=8, scoring="sqrtsoftplus", normalize_top_k=True,
              routed_scale=1.5, hash_layers=1)
MODEL = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, glu_variant="limited", glu_limit=0.5, moe=V4_MOE)


def v4_layer(layer: int, seed: int = 0) -> MoE:
    cfg = ModelConfig(**MODEL)
    moe = MoE(moe_args(cfg, layer))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        if isinstance(moe.router, HashRouter):
            moe.router.table.copy_(torch.randint(0, 4, moe.router.table.shape, generator=g))
        else:
            moe.router.score_bias.copy_(torch.randn(4, generator=g))
    return moe.eval()


def test_sqrtsoftplus_scores_and_the_routed_scale_in_closed_form():
    moe = v4_layer(1)
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(1))
    r = moe.router(x)
    scores = F.softplus(x @ moe.router.weight.T).sqrt()
    chosen = (scores + moe.router.score_bias).topk(2).indices  # the bias chooses, it does not weigh
    assert torch.equal(r.expert_TK.sort(-1).values, chosen.sort(-1).values)
    w = scores.gather(1, r.expert_TK)
    assert_close(r.weight_TK, 1.5 * w / w.sum(-1, keepdim=True))


def test_a_hash_router_sends_each_token_where_its_table_says_and_weighs_them_by_score():
    moe = v4_layer(0)
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([3, 3, 7, 0, 63, 7])
    moe.router.tokens = ids
    r = moe.router(x)
    assert torch.equal(r.expert_TK, moe.router.table[ids])
    w = F.softplus(x @ moe.router.weight.T).sqrt().gather(1, r.expert_TK)
    assert_close(r.weight_TK, 1.5 * w / w.sum(-1, keepdim=True))
    moe.router.tokens = None
    with pytest.raises(ValueError, match="routes by token id and was given none"):
        moe.router(x)


def test_the_clamped_swiglu_in_closed_form():
    z = torch.tensor([[-20.0, 0.3, 20.0, 5.0, -20.0, 20.0]])  # [gate | up], a limit of 10
    gate, up = torch.tensor([-20.0, 0.3, 10.0]), torch.tensor([5.0, -10.0, 10.0])
    assert_close(limited_glu(z, "silu")[0], F.silu(gate) * up)


def test_the_table_is_drawn_distinct_per_token_saved_and_loaded():
    cfg = ModelConfig(**MODEL)
    a, b = Transformer(cfg), Transformer(cfg)
    table = a.blocks[0].ffn.router.table
    assert table.dtype == torch.long and table.shape == (64, 2)
    assert all(len(set(row.tolist())) == 2 for row in table) and len({tuple(r.tolist()) for r in table}) > 1
    assert torch.equal(table, b.blocks[0].ffn.router.table)  # a pure function of the config's init_seed
    other = Transformer(cfg.replace(init_seed=1))
    other.load_state_dict(a.state_dict())
    assert torch.equal(other.blocks[0].ffn.router.table, table)
    assert "blocks.0.ffn.router.score_bias" not in a.state_dict()  # no selection bias: nothing is chosen by score
    assert a.blocks[0].ffn.bias_update_rate == 0 and isinstance(a.blocks[1].ffn.router, torch.nn.Module)


def test_the_model_hands_the_hash_layers_their_token_ids():
    m = Transformer(ModelConfig(**MODEL)).eval()
    idx = tokens(2, 9)
    with torch.no_grad():
        m(idx)
    assert m.moe_layers[0].stats["tokens_per_expert"] == torch.bincount(
        m.blocks[0].ffn.router.table[idx].flatten(), minlength=4).tolist()


# ============================================================== transformers' blocks on the same weights
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("layer", [0, 1], ids=["hash", "topk"])
def test_the_v4_moe_block_equals_transformers_on_the_same_weights(layer):
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    config = DeepseekV4Config(vocab_size=64, hidden_size=32, moe_intermediate_size=8, num_hidden_layers=2,
                              num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1, routed_scaling_factor=1.5,
                              mlp_layer_types=["hash_moe", "moe"], swiglu_limit=0.5)
    ours = v4_layer(layer)
    hf = DeepseekV4SparseMoeBlock(config, layer).eval()
    router = ours.router
    state = {"gate.weight": router.weight, "experts.gate_up_proj": ours.experts.gate_up,
             "experts.down_proj": ours.experts.down, "shared_experts.gate_proj.weight": ours.shared.gate_up[0, :8],
             "shared_experts.up_proj.weight": ours.shared.gate_up[0, 8:],
             "shared_experts.down_proj.weight": ours.shared.down[0]}
    state["gate.tid2eid" if layer == 0 else "gate.e_score_correction_bias"] = (
        router.table if layer == 0 else router.score_bias)
    hf.load_state_dict(state)
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(3))
    ids = tokens(2, 9)
    if layer == 0:
        router.tokens = ids
    with torch.no_grad():
        ref = hf(x, input_ids=ids)
        assert ref.std() > 0.5
        for impl in ("reference", "fast"):
            ours.set_impl(impl)
            assert_close(ours(x), ref)


# ============================================================== the config
@pytest.mark.parametrize("changes, message", [
    ({"moe.hash_layers": 3}, "moe.hash_layers=3 routes the first 3 layers by token id, and n_layers=2; choose "
                             "hash_layers <= 2"),
    ({"moe.first_dense": 1}, "moe.hash_layers=1 routes the first 1 layers by token id, and layer 0 is dense"),
    ({"glu_variant": "plain"}, "glu_limit=0.5 is the clamp of glu_variant='limited', not 'plain'"),
    ({"glu_limit": 0.0}, "glu_limit"),
])
def test_what_the_routing_cannot_mean_is_refused(changes, message):
    with pytest.raises(ValueError) as err:
        ModelConfig(**MODEL).override(changes)
    assert message in str(err.value)
