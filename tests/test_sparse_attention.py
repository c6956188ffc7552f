"""DeepSeek Sparse Attention (``attention.variant='dsa'``, ``lmlab.sparse_attention``): the indexer's scores against
their closed form, the selection against a hand-picked one, every path (masked reference, fused, absorbed, gathered)
equal, the cache equal to the full forward, the indexer learning from its own loss and nothing else, and the
config's facts (cache bytes per token, which variant a config means, what it refuses)."""

from __future__ import annotations

import copy

import pytest
import torch

from lmlab import ModelConfig, Transformer
from lmlab.attention_variants import variant_of
from lmlab.memory import kv_cache_bytes, parameter_count
from lmlab.sparse_attention import Selection

TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=32)
MLA = dict(q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
DSA = dict(indexer_heads=16, indexer_head_dim=8, topk=5)


def dsa_model(seed: int = 0, **changes) -> Transformer:
    cfg = ModelConfig(**TINY, mla=MLA, dsa=DSA, init_std=0.2).override(changes)
    torch.manual_seed(seed)
    return Transformer(cfg.replace(init_seed=seed)).eval()


def tokens(length: int = 20, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(seed))


def capture_scores(model: Transformer, idx: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's index scores (B, T, S) in a forward over ``idx``."""
    scores = []
    hooks = [b.attn.indexer.register_forward_hook(lambda m, a, out: scores.append(out)) for b in model.blocks]
    with torch.no_grad():
        model(idx)
    for h in hooks:
        h.remove()
    return scores


def test_a_config_with_both_sections_means_dsa_with_the_same_identity():
    cfg = ModelConfig(**TINY, mla=MLA, dsa=DSA)
    assert cfg.attention_variant == "dsa" and cfg.attention.variant is None
    named = ModelConfig(**TINY, mla=MLA, attention=dict(variant="dsa"))  # the indexer with its defaults
    assert named.dsa is not None and named == ModelConfig(**TINY, mla=MLA, dsa={})
    assert ModelConfig.from_yaml(cfg.to_yaml()) == cfg
    assert "dsa" not in ModelConfig(**TINY, mla=MLA).identity_dict()  # MLA models keep their run identities


@pytest.mark.parametrize("changes, message", [
    ({"mla.q_lora_rank": None}, "attention.variant='dsa' reads MLA's query latent, and mla.q_lora_rank is null"),
    ({"dsa.indexer_head_dim": 2}, "dsa.indexer_head_dim=2 is narrower than the mla.qk_rope_head_dim=4"),
    ({"dsa.topk": 0}, "dsa.topk"),
    ({"dsa.indexer_loss_coef": -1.0}, "dsa.indexer_loss_coef=-1.0 must be a number >= 0"),
    ({"mtp.depth": 1}, "mtp with attention.variant='dsa' is not implemented"),
    ({"attention.variant": "mla"}, "dsa holds the parameters of attention.variant='dsa', and this model's variant is "
                                   "'mla'"),
])
def test_what_dsa_cannot_compute_is_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig(**TINY, mla=MLA, dsa=DSA).override(changes)


def test_the_index_scores_are_their_closed_form():
    """I_{t,s} = sum_j w_{t,j} ReLU(q_{t,j} · k_s / sqrt(d)) / sqrt(H), -inf past t: computed here head by head."""
    model = dsa_model()
    idx = tokens(12)
    attn = model.blocks[0].attn
    with torch.no_grad():
        x = model.blocks[0].norm1(model.embed(idx))
        ctx = model.context(idx)
        q_latent = attn.q.norm(attn.q.down(x))
        got = attn.indexer(x, q_latent, attn.indexer.keys(x, ctx), ctx)
        ix = attn.indexer
        keys = ix.keys(x, ctx)[:, 0]  # (B, S, d)
        q = ix.rotate(ix.q(q_latent).view(2, 12, ix.heads, ix.head_dim).transpose(1, 2), ctx)  # (B, H, T, d)
        w = ix.weights(x)  # (B, T, H)
        want = torch.zeros(2, 12, 12)
        for j in range(ix.heads):
            want += w[:, :, j, None] * torch.relu(q[:, j] @ keys.transpose(1, 2) / ix.head_dim**0.5)
        want = (want / ix.heads**0.5).masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_selection_is_the_top_k_visible_keys():
    scores = torch.tensor([[[0.5, float("-inf"), float("-inf")], [0.1, 0.9, float("-inf")], [0.3, -0.2, 0.7]]])[None]
    sel = Selection.top(scores[0], 2)
    assert sel.mask[0, 0].tolist() == [[True, False, False], [True, True, False], [True, False, True]]
    assert sel.ok[0].tolist() == [[True, False], [True, True], [True, True]]  # query 0 sees one key of its two


@pytest.mark.parametrize("impl", ["explicit", "absorbed", "gathered"])
def test_every_path_equals_the_fused_one(impl):
    model = dsa_model()
    idx = tokens()
    with torch.no_grad():
        ref = model(idx).logits
        model.set_attention_impl(impl)
        torch.testing.assert_close(model(idx).logits, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa", "explicit", "gathered"])
def test_cached_decoding_equals_the_full_forward_padded_or_not(impl):
    from helpers import decoded_logits

    model = dsa_model()
    idx = tokens(16)
    full = model(idx).logits.detach()
    model.set_attention_impl(impl)
    torch.testing.assert_close(decoded_logits(model, idx, prefill=6), full, rtol=1e-5, atol=1e-5)
    mask = torch.ones_like(idx)
    mask[0, :4] = 0  # the first row left-padded: its real tokens' logits are those of the row alone
    with torch.no_grad():
        padded = model(idx, attention_mask=mask).logits[0, 4:]
        alone = model(idx[:1, 4:]).logits[0]
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-5)


def test_the_selection_decides_the_output():
    """Keeping every key (topk past the context) is plain MLA; with topk 5 the logits differ from it, and in the
    first 5 positions (every key kept either way) they agree."""
    model = dsa_model()
    dense = Transformer(model.config.override({"dsa.topk": 64})).eval()
    dense.load_state_dict(model.state_dict())
    idx = tokens()
    with torch.no_grad():
        sparse_logits, dense_logits = model(idx).logits, dense(idx).logits
    torch.testing.assert_close(sparse_logits[:, :5], dense_logits[:, :5], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(sparse_logits[:, 5:], dense_logits[:, 5:], atol=1e-2)


def test_the_indexer_learns_from_its_loss_and_nothing_else():
    """In training the loss holds the indexer's KL term; every parameter gets a gradient; the language-modeling loss
    alone gives the indexer none (its inputs are detached), and the KL term gives the rest of the model none."""
    model = dsa_model().train()
    idx = tokens()
    out = model(idx, targets=idx.roll(-1, 1))
    assert set(out.aux_losses) == {"indexer"} and out.aux_losses["indexer"] > 0
    torch.testing.assert_close(out.loss, out.ce_loss + out.aux_losses["indexer"])
    out.loss.backward(retain_graph=True)
    assert not [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    model.zero_grad()
    out.ce_loss.backward(retain_graph=True)
    assert all(p.grad is None or not p.grad.any() for n, p in model.named_parameters() if ".indexer." in n)
    model.zero_grad()
    out.aux_losses["indexer"].backward()
    assert all(p.grad is None or not p.grad.any() for n, p in model.named_parameters() if ".indexer." not in n)
    assert model.eval()(idx).aux_losses == {}


def test_training_lowers_the_indexer_loss():
    model = dsa_model().train()
    indexer = [p for n, p in model.named_parameters() if ".indexer." in n]
    optimizer = torch.optim.Adam(indexer, lr=3e-2)
    idx = tokens(24)
    first = None
    for _ in range(30):
        loss = model(idx, targets=idx).aux_losses["indexer"]
        first = float(loss.detach()) if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert float(loss.detach()) < 0.5 * first


def test_a_deep_copy_attends_with_its_own_weights():
    model = dsa_model()
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    idx = tokens()
    assert not torch.allclose(twin(idx).logits, model(idx).logits)


def test_the_cache_holds_the_latent_the_rotary_key_and_the_indexer_key():
    cfg = dsa_model().config
    assert variant_of(cfg).cache_widths(cfg) == (1, 16, 4 + 8)
    assert kv_cache_bytes(cfg, 3, 7) == cfg.n_layers * 3 * 7 * (16 + 4 + 8) * 4
    model = Transformer(cfg)
    cache = model.new_cache(batch_size=3, max_len=7)
    assert kv_cache_bytes(cfg, 3, 7) == (cache.k.numel() + cache.v.numel()) * 4
    assert parameter_count(cfg) == model.num_params()["total"]


def test_v32s_published_dimensions_cache_more_than_mla_and_far_less_than_gqa():
    """Per token and layer at DeepSeek-V3.2's sizes: MLA's 512 + 64 values and the indexer's 128 key, against
    128 heads of 128 keys and values."""
    v32 = ModelConfig(vocab_size=256, d_model=7168, n_layers=1, n_heads=128, max_seq_len=4096,
                      mla=dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                               v_head_dim=128), dsa=dict(indexer_heads=64, indexer_head_dim=128, topk=2048))
    mla = v32.replace(dsa=None)
    assert kv_cache_bytes(v32, 1, 1, 2) == (512 + 64 + 128) * 2 and kv_cache_bytes(mla, 1, 1, 2) == (512 + 64) * 2
    mha = ModelConfig(vocab_size=256, d_model=7168, n_layers=1, n_heads=128, head_dim=128, max_seq_len=4096)
    assert kv_cache_bytes(mha, 1, 1, 2) == 2 * 128 * 128 * 2
