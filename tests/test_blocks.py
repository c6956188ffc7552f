"""Blocks and the stack against their formulas: attention paths, norm placement, residual scaling,
initialization, heads and losses, parameter/FLOP accounting, dtypes and the KV cache's guards."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_config, tokens
from torch import nn
from torch.testing import assert_close

import lmlab.attention
from lmlab import IGNORE_INDEX, ModelConfig, SequenceClassifier, Transformer
from lmlab.attention import expand_kv
from lmlab.init import Init, init_module
from lmlab.model import deepnorm_alpha, deepnorm_beta


# ================================================================ attention paths
@pytest.mark.parametrize("gqa", ["enable_gqa", "expand_kv"])
@pytest.mark.parametrize("offset", [0, 5], ids=["no-cache", "cache-offset"])
@pytest.mark.parametrize("kv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("positions", ["none", "sinusoidal", "learned", "alibi", "rope"])
def test_sdpa_equals_explicit(positions, kv, offset, gqa, monkeypatch):
    if gqa == "expand_kv":  # torch 2.4 has no enable_gqa: keys and values are copied per query head
        monkeypatch.setattr(lmlab.attention, "SDPA_GQA", False)
    elif not lmlab.attention.SDPA_GQA:
        pytest.skip("scaled_dot_product_attention(enable_gqa=...) needs torch >= 2.5")
    model = Transformer(tiny_config(positions=positions, n_kv_heads=kv, init_std=0.1)).eval()
    assert model.blocks[0].attn.impl == "sdpa"  # the fast path is the default wherever it applies
    idx = tokens(2, 10)

    def run(impl):
        model.set_attention_impl(impl)
        with torch.no_grad():
            if offset == 0:
                return model(idx).logits
            cache = model.new_cache(2, 10)
            model(idx[:, :offset], cache=cache)
            return model(idx[:, offset:], cache=cache).logits

    fast, reference = run("sdpa"), run("explicit")
    assert all(b.attn.impl == "explicit" for b in model.blocks)
    assert_close(fast, reference, rtol=1e-5, atol=1e-5)


def test_relative_refuses_sdpa_and_unknown_impl_is_a_clear_error():
    model = Transformer(tiny_config(positions="relative"))
    assert model.blocks[0].attn.impl == "explicit"
    with pytest.raises(ValueError, match="impl='sdpa' cannot compute RelativeTerm.*use impl='explicit'"):
        model.set_attention_impl("sdpa")
    with pytest.raises(ValueError, match=r"impl='flash' is not a valid choice; choose one of \['sdpa', 'explicit'\]"):
        model.set_attention_impl("flash")


def _reference_attention(attn, x, positions, clip=None, slopes=None):
    """softmax(q k^T / sqrt(d) + position terms) (v + value terms), one head and one pair (i, j) at a time."""
    H, KV, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    T = x.shape[1]
    qkv = x[0] @ attn.qkv.weight.T  # (T, (H + 2 KV) hd)
    q, k, v = qkv.split([H * hd, KV * hd, KV * hd], dim=-1)
    heads = []
    for h in range(H):
        g = h // (H // KV)  # the key/value head this query head reads
        qh, kh, vh = q[:, h * hd : (h + 1) * hd], k[:, g * hd : (g + 1) * hd], v[:, g * hd : (g + 1) * hd]
        out = torch.zeros(T, hd)
        for i in range(T):
            e = []
            for j in range(i + 1):
                key = kh[j] + (attn.term.rel_k[min(i - j, clip)] if positions == "relative" else 0)
                bias = -slopes[h] * (i - j) if positions == "alibi" else 0.0
                e.append(qh[i] @ key / math.sqrt(hd) + bias)
            a = torch.stack(e).softmax(0)
            for j in range(i + 1):
                out[i] += a[j] * (vh[j] + (attn.term.rel_v[min(i - j, clip)] if positions == "relative" else 0))
        heads.append(out)
    return torch.cat(heads, dim=-1) @ attn.out.weight.T  # (T, C)


@pytest.mark.parametrize("positions", ["none", "alibi", "relative"])
def test_attention_equals_its_formula(positions):
    cfg = tiny_config(positions=positions, n_kv_heads=2, relative_clip=2, init_std=0.2)
    model = Transformer(cfg)
    attn, T = model.blocks[0].attn, 6
    x = torch.randn(1, T, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y = attn(x, model.positions.context(0, T, x.device))[0]
        slopes = [2.0 ** (-2 * (h + 1)) for h in range(4)]  # 2^(-8(h+1)/H), H = 4
        assert_close(y, _reference_attention(attn, x, positions, clip=2, slopes=slopes), rtol=1e-5, atol=1e-5)


def test_expand_kv_maps_query_head_to_kv_head_h_over_group():
    x = torch.arange(2 * 3 * 5 * 4, dtype=torch.float32).view(2, 3, 5, 4)  # (B, KV=3, S, hd)
    out = expand_kv(x, 6)
    for h in range(6):
        assert torch.equal(out[:, h], x[:, h // 2])
    assert expand_kv(x, 3) is x


def _duplicate_kv_heads(gqa: Transformer, mha: Transformer) -> None:
    """Copy gqa's weights into mha, giving each query head its own copy of the shared k/v head."""
    H, KV, hd = gqa.config.n_heads, gqa.config.n_kv_heads, gqa.config.head_dim
    state = gqa.state_dict()
    for name, w in list(state.items()):
        if name.endswith("attn.qkv.weight"):
            q, k, v = w.split([H * hd, KV * hd, KV * hd], dim=0)
            def dup(t):
                return t.view(KV, hd, -1).repeat_interleave(H // KV, dim=0).reshape(H * hd, -1)

            state[name] = torch.cat([q, dup(k), dup(v)], dim=0)
    mha.load_state_dict(state)


@pytest.mark.parametrize("kv", [2, 1], ids=["gqa", "mqa"])
def test_grouped_query_equals_mha_with_shared_heads(kv):
    gqa = Transformer(tiny_config(n_kv_heads=kv, init_std=0.1)).eval()
    mha = Transformer(tiny_config(n_kv_heads=4)).eval()
    _duplicate_kv_heads(gqa, mha)
    idx = tokens(2, 9)
    with torch.no_grad():
        expected = mha(idx).logits
        assert_close(gqa(idx).logits, expected, rtol=1e-5, atol=1e-5)
        cache = gqa.new_cache(2, 9)
        assert cache.k.shape == (2, 2, kv, 9, 8)  # the cache holds only the shared heads
        steps = [gqa(idx[:, :4], cache=cache).logits] + [
            gqa(idx[:, t : t + 1], cache=cache).logits for t in range(4, 9)
        ]
    assert_close(torch.cat(steps, 1), expected, rtol=1e-5, atol=1e-5)


def test_n_kv_heads_equal_to_n_heads_is_mha():
    assert tiny_config(n_kv_heads=4) == tiny_config()
    model = Transformer(tiny_config(n_kv_heads=4))
    assert model.blocks[0].attn.qkv.weight.shape == (3 * 32, 32)


# ================================================================ norm placement
def _norm(kind: str, x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """LayerNorm / RMSNorm from their definitions, with the module's gain (and shift)."""
    if kind == "layernorm":
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        y = (x - mean) / torch.sqrt(var + 1e-5) * module.weight
        return y + module.bias if module.bias is not None else y
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * module.weight


class Known(nn.Module):
    """A fixed nonlinear map standing in for attention or the feed-forward: tanh(x A)."""

    def __init__(self, seed: int):
        super().__init__()
        self.A = torch.randn(32, 32, generator=torch.Generator().manual_seed(seed)) / math.sqrt(32)

    def forward(self, x, *context):
        return torch.tanh(x @ self.A)


PLACEMENTS = {
    "pre": dict(norm_position="pre"),
    "post": dict(norm_position="post"),
    "deepnorm": dict(norm_position="post", residual_scaling="deepnorm"),
    "sandwich": dict(norm_position="sandwich"),
    "reordered": dict(norm_position="reordered"),
}


@pytest.mark.parametrize("ffn", ["glu", "mlp"])
def test_deepnorm_init_of_a_mixture_of_experts_scales_each_expert_but_not_router_gate_or_biases(ffn):
    L, d = 2, 64
    cfg = tiny_config(d_model=d, n_layers=L, n_heads=4, norm_position="post", residual_scaling="deepnorm", bias=True,
                      ffn=ffn, moe={"n_experts": 8, "top_k": 2, "n_shared": 1, "shared_gate": "sigmoid"})
    moe, beta = Transformer(cfg).blocks[0].ffn, (8 * L) ** -0.25
    F_ = moe.experts.down.shape[-1]
    w_in, halves = ("gate_up", 2) if ffn == "glu" else ("up", 1)
    for name in (f"experts.{w_in}", f"shared.{w_in}"):
        for expert in dict(moe.named_parameters())[name]:
            for w in expert.chunk(halves, dim=0):  # GLU: gate and up, each its own matrix
                _std_close(w, beta * math.sqrt(2.0 / (F_ + d)))
    for expert in list(moe.experts.down) + list(moe.shared.down):
        _std_close(expert, beta * math.sqrt(2.0 / (F_ + d)))
    _std_close(moe.router.weight, cfg.init_std)  # centroids keep N(0, init_std)
    _std_close(moe.shared.output_gate, cfg.init_std, rel=0.5)  # one row of 64: a loose check
    assert all(p.abs().sum() == 0 for n, p in moe.named_parameters() if n.endswith("bias"))


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_block_output_matches_its_placement_formula(placement, norm):
    cfg = tiny_config(norm=norm, bias=True, n_layers=3, **PLACEMENTS[placement])
    model = Transformer(cfg)
    block = model.blocks[1]
    block.attn, block.ffn = Known(1), Known(2)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if "norm" in name:  # norm1, norm2 (and the sandwich's post_norm1, post_norm2)
                p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(2, 5, 32, generator=g)
    out = block(x, model.positions.context(0, 5, x.device))
    f, h, n1, n2 = (
        block.attn,
        block.ffn,
        (lambda t: _norm(norm, t, block.norm1)),
        (lambda t: _norm(norm, t, block.norm2)),
    )
    if placement == "pre":  # x + f(norm(x))
        mid = x + f(n1(x))
        expected = mid + h(n2(mid))
    elif placement == "sandwich":  # x + norm'(f(norm(x)))
        p1, p2 = (lambda t: _norm(norm, t, block.post_norm1)), (lambda t: _norm(norm, t, block.post_norm2))
        mid = x + p1(f(n1(x)))
        expected = mid + p2(h(n2(mid)))
    elif placement == "reordered":  # x + norm(f(x))
        mid = x + n1(f(x))
        expected = mid + n2(h(mid))
    else:  # norm(α x + f(x)), α = 1 or DeepNorm's (2L)^(1/4)
        a = (2 * 3) ** 0.25 if placement == "deepnorm" else 1.0
        mid = n1(a * x + f(x))
        expected = n2(a * mid + h(mid))
    assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("placement", ["pre", "post", "sandwich", "reordered"])
def test_only_post_norm_has_no_final_norm(placement):
    model = Transformer(tiny_config(norm_position=placement, norm="layernorm")).eval()
    seen = {}
    model.blocks[-1].register_forward_hook(lambda m, args, out: seen.update(last=out))
    idx = tokens(1, 6)
    with torch.no_grad():
        h = model.hidden(idx)
        logits = model(idx).logits
    if placement != "post":  # the residual stream is never normalized as a whole
        assert isinstance(model.final_norm, nn.LayerNorm)
        assert_close(h, _norm("layernorm", seen["last"], model.final_norm), rtol=1e-5, atol=1e-5)
    else:
        assert isinstance(model.final_norm, nn.Identity) and not any(
            "final_norm" in n for n, _ in model.named_parameters()
        )
        assert torch.equal(h, seen["last"])  # the block already ends with a norm
    assert_close(logits, h @ model.head.weight.T)


def test_deepnorm_constants():
    assert deepnorm_alpha(6) == pytest.approx(12**0.25)  # decoder-only: α = (2L)^(1/4)
    assert deepnorm_beta(6) == pytest.approx(48**-0.25)  # β = (8L)^(-1/4) (Wang et al. 2022, Table 1)


# ================================================================ initialization
def _std_close(w: torch.Tensor, expected: float, rel: float = 0.05) -> None:
    assert abs(w.float().std().item() / expected - 1) < rel, (w.std().item(), expected)
    # 4 standard errors: dozens of matrices are checked, and at 3 one in 370 would fail by chance
    assert abs(w.float().mean().item()) < 4 * expected / math.sqrt(w.numel()) + 1e-9


@pytest.mark.parametrize("scaling", ["none", "gpt2"])
def test_gpt2_scaled_init_of_residual_outputs(scaling):
    L, std = 4, 0.02
    model = Transformer(
        tiny_config(d_model=256, n_layers=L, ffn="mlp", bias=True, residual_scaling=scaling, init_std=std)
    )
    out_std = std / math.sqrt(2 * L) if scaling == "gpt2" else std
    for block in model.blocks:
        _std_close(block.attn.out.weight, out_std)  # 256 x 256
        _std_close(block.ffn.down.weight, out_std)  # 256 x 1024
        _std_close(block.attn.qkv.weight, std)
        _std_close(block.ffn.up.weight, std)
        assert not block.attn.qkv.bias.any() and not block.ffn.down.bias.any()
    _std_close(model.embed.weight, std, rel=0.1)
    _std_close(model.head.weight, std, rel=0.1)


@pytest.mark.parametrize("ffn", ["mlp", "glu"])
def test_deepnorm_init_is_beta_scaled_xavier(ffn):
    L, d = 4, 128
    model = Transformer(tiny_config(d_model=d, n_layers=L, n_heads=4, n_kv_heads=2, ffn=ffn, norm_position="post",
                                    norm="layernorm", residual_scaling="deepnorm"))
    beta, dff = (8 * L) ** -0.25, model.config.d_ff

    def xavier(fan_out, fan_in, gain):
        return gain * math.sqrt(2.0 / (fan_in + fan_out))

    for block in model.blocks:
        q, k, v = block.attn.qkv.weight.split([128, 64, 64], dim=0)
        _std_close(q, xavier(128, d, 1.0))
        _std_close(k, xavier(64, d, 1.0))
        _std_close(v, xavier(64, d, beta))
        _std_close(block.attn.out.weight, xavier(d, 128, beta))
        _std_close(block.ffn.down.weight, xavier(d, dff, beta))
        if ffn == "mlp":
            _std_close(block.ffn.up.weight, xavier(dff, d, beta))
        else:  # gate and up are two matrices stored as one
            for w in block.ffn.gate_up.weight.chunk(2, dim=0):
                _std_close(w, xavier(dff, d, beta))


def test_relative_tables_are_drawn_like_embeddings():
    model = Transformer(tiny_config(positions="relative", d_model=256, n_heads=4, relative_clip=16, init_std=0.05))
    for block in model.blocks:  # (k + 1) x head_dim = 17 x 64 each
        _std_close(block.attn.term.rel_k, 0.05, rel=0.1)
        _std_close(block.attn.term.rel_v, 0.05, rel=0.1)


def test_init_refuses_parameters_that_no_rule_covers():
    class Gain(nn.Module):  # a parameter of its own, neither a torch layer with a default nor a hook
        def __init__(self):
            super().__init__()
            self.g = nn.Parameter(torch.empty(4))

    init = Init(torch.Generator().manual_seed(0), std=0.02, out_std=0.02)
    with pytest.raises(TypeError, match="Gain holds parameters but has no init_params"):
        init_module(nn.Sequential(nn.Linear(4, 4), Gain()), init)
    Gain.init_params = lambda self, init: init.normal(self.g, 1.0)  # a hook makes it initializable
    module = nn.Sequential(nn.Linear(4, 4), Gain())
    init_module(module, init)
    assert module[1].g.abs().sum() > 0


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_norms_start_as_identity_gains(norm):
    model = Transformer(tiny_config(norm=norm, bias=True))
    norms = [m for n, m in model.named_modules() if "norm" in n.split(".")[-1] and hasattr(m, "weight")]  # no qk_norm
    assert len(norms) == 2 * 2 + 1
    for m in norms:
        assert torch.equal(m.weight, torch.ones(32))
        if getattr(m, "bias", None) is not None:
            assert torch.equal(m.bias, torch.zeros(32))


def test_tied_embeddings_share_storage():
    model = Transformer(tiny_config(tie_embeddings=True))
    assert model.head.weight is model.embed.weight
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    seq = tokens(2, 9)
    model(seq[:, :-1], targets=seq[:, 1:]).loss.backward()
    opt.step()
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    untied = Transformer(tiny_config(tie_embeddings=False))
    assert model.num_params()["total"] + 64 * 32 == untied.num_params()["total"]


INIT_CASES = {
    "dense": dict(),
    "relative": dict(positions="relative"),
    "deepnorm-moe": dict(norm_position="post", residual_scaling="deepnorm", bias=True,
                         moe={"n_experts": 4, "top_k": 2, "n_shared": 1, "shared_gate": "sigmoid"}),
    **{preset: dict(preset=preset) for preset in ("switch", "gshard", "mixtral", "deepseekmoe", "deepseek-v3")},
}


def _init_case_config(case: str) -> ModelConfig:
    fields = dict(INIT_CASES[case])
    preset = fields.pop("preset", None)
    if preset is None:
        return tiny_config(**fields)
    return ModelConfig.from_preset(preset, d_model=32, n_heads=4, n_layers=2, vocab_size=64, max_seq_len=32)


@pytest.mark.parametrize("case", INIT_CASES)
def test_init_ignores_default_device_and_dtype(case):
    cfg = _init_case_config(case)
    reference = Transformer(cfg).state_dict()
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)  # the draws must not change with it
        doubled = Transformer(cfg).float().state_dict()
    finally:
        torch.set_default_dtype(previous)
    assert reference.keys() == doubled.keys()
    assert all(torch.equal(reference[n], doubled[n]) for n in reference), [
        n for n in reference if not torch.equal(reference[n], doubled[n])]
    with torch.device("meta"):  # build without allocating, e.g. to count parameters of a big config
        meta = Transformer(cfg)
    assert meta.embed.weight.is_meta and meta.num_params() == Transformer(cfg).num_params()


# ================================================================ heads and losses
def test_loss_is_mean_next_token_cross_entropy():
    model = Transformer(tiny_config(init_std=0.1))
    seq = tokens(2, 11)
    idx, targets = seq[:, :-1], seq[:, 1:]  # predict token t + 1 from tokens <= t
    out = model(idx, targets=targets)
    logp = out.logits.log_softmax(-1)
    manual = -logp.gather(-1, targets[..., None]).mean()
    assert_close(out.ce_loss, manual)
    assert_close(out.ce_loss, F.cross_entropy(out.logits.reshape(-1, 64), targets.reshape(-1)))
    assert_close(out.loss, out.ce_loss, rtol=0, atol=0)
    assert out.aux_loss.item() == 0.0 and out.aux_losses == {}
    plain = model(idx)
    assert plain.loss is None and plain.ce_loss is None
    assert torch.equal(plain.logits, out.logits)


def test_ignored_targets_are_left_out_of_the_mean():
    model = Transformer(tiny_config(init_std=0.1))
    seq = tokens(2, 11, seed=4)
    idx, targets = seq[:, :-1], seq[:, 1:].clone()
    targets[0, :4] = IGNORE_INDEX
    targets[1, 7] = -100
    out = model(idx, targets=targets)
    logp = out.logits.log_softmax(-1)
    keep = targets != -100
    picked = logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0]  # (B, T)
    assert_close(out.ce_loss, -picked[keep].sum() / keep.sum())
    assert keep.sum() == 20 - 5


def test_targets_of_any_integer_dtype_and_mismatched_shapes():
    model = Transformer(tiny_config())
    seq = tokens(2, 9)
    expected = model(seq[:, :-1], targets=seq[:, 1:]).loss
    narrow = seq.to(torch.int32)  # token shards are commonly stored as int32 / uint16
    assert_close(model(narrow[:, :-1], targets=narrow[:, 1:]).loss, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"targets has shape \(2, 4\) but idx has \(2, 8\)"):
        model(seq[:, :-1], targets=seq[:, 1:5])


def test_classifier_pools_the_last_non_pad_token():
    pad = 0
    clf = SequenceClassifier(tiny_config(init_std=0.1), n_classes=3, pad_token_id=pad).eval()
    body = tokens(2, 8, seed=5).clamp(min=1)  # no pads inside the text
    idx = body.clone()
    idx[0, 5:] = pad  # row 0: 5 tokens then 3 pads; row 1: 8 tokens
    labels = torch.tensor([2, 0])
    with torch.no_grad():
        logits, loss = clf(idx, labels)
        h = clf.body.hidden(idx)
        assert_close(logits[0], clf.score(h[0, 4]))
        assert_close(logits[1], clf.score(h[1, 7]))
        assert_close(loss, F.cross_entropy(logits, labels))
        more_pads = torch.cat([idx[:1], torch.full((1, 6), pad)], dim=1)  # pads after the last token change nothing
        assert_close(clf(more_pads)[0][0], logits[0], rtol=1e-5, atol=1e-6)
        assert_close(clf(idx[:1, :5])[0][0], logits[0], rtol=1e-5, atol=1e-6)  # ... nor does having none
        other = idx.clone()
        other[0, 3] = (other[0, 3] % 63) + 1  # a real token does
        assert not torch.allclose(clf(other)[0][0], logits[0])
    assert loss is not None and clf(idx)[1] is None
    with pytest.raises(ValueError, match="n_classes=1"):
        SequenceClassifier(tiny_config(), n_classes=1, pad_token_id=0)


# ================================================================ accounting
ACCOUNTING = {
    # llama-like: rmsnorm, rope, SwiGLU (d_ff 128), GQA 4/2, no bias, untied head
    "llama": (dict(n_kv_heads=2),
              dict(block=32 * (4 + 2 + 2) * 8 + 32 * 32 + 32 * 2 * 128 + 128 * 32 + 2 * 32,
                   embedding=64 * 32, positions=0, head=64 * 32, final_norm=32)),
    # gpt2-like: layernorm with bias, learned positions (32 x 32), GELU MLP (d_ff 128), tied head
    "gpt2": (dict(norm="layernorm", positions="learned", ffn="mlp", activation="gelu", bias=True, tie_embeddings=True),
             dict(block=(32 * 96 + 96) + (32 * 32 + 32) + (32 * 128 + 128) + (128 * 32 + 32) + 2 * (32 + 32),
                  embedding=64 * 32, positions=32 * 32, head=0, final_norm=64)),
    # post-norm relative: per-layer rel_k/rel_v tables (k + 1 = 5 rows of head_dim 8) are position embeddings
    "relative-post": (dict(positions="relative", relative_clip=4, norm_position="post", ffn="mlp"),
                      dict(block=32 * 96 + 32 * 32 + 32 * 128 + 128 * 32 + 2 * 32,
                           embedding=64 * 32, positions=2 * 2 * 5 * 8, head=64 * 32, final_norm=0)),
}


@pytest.mark.parametrize("case", ACCOUNTING)
def test_parameter_counts_by_hand(case):
    fields, parts = ACCOUNTING[case]
    model = Transformer(tiny_config(**fields))
    counts = model.num_params()
    total = 2 * parts["block"] + parts["embedding"] + parts["positions"] + parts["head"] + parts["final_norm"]
    assert counts["total"] == total
    assert counts["total"] == sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())  # unique storage
    assert counts["non_embedding"] == total - parts["embedding"] - parts["positions"] - parts["head"]
    assert counts["active"] == counts["total"]  # dense


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("positions", ["relative", "learned", "rope"])
def test_non_embedding_is_total_less_embedding_parameters_and_an_untied_head(positions, tied):
    model = Transformer(tiny_config(positions=positions, tie_embeddings=tied))
    embedding = model.embedding_parameters()
    expected = [model.embed.weight]  # the head too, when tied: it is the same tensor
    if positions == "relative":
        expected += [p for b in model.blocks for p in (b.attn.term.rel_k, b.attn.term.rel_v)]
    if positions == "learned":
        expected.append(model.positions.table.weight)
    assert {id(p) for p in embedding} == {id(p) for p in expected} and len(embedding) == len(expected)
    counts = model.num_params()
    head = 0 if tied else model.head.weight.numel()
    assert counts["non_embedding"] == counts["total"] - sum(p.numel() for p in embedding) - head
    n = counts["active"] - sum(p.numel() for p in embedding) + model.head.weight.numel() * tied
    assert model.flops_per_token(16) == 6 * n + 12 * 2 * 4 * 8 * 16


@pytest.mark.parametrize("case", ACCOUNTING)
def test_flops_per_token_by_hand(case):
    fields, parts = ACCOUNTING[case]
    model = Transformer(tiny_config(**fields))
    # N: every matmul weight a token passes through, the output head included even when tied;
    # attention adds 12 L H d_head T (PaLM, Chowdhery et al. 2022, app. B)
    n = 2 * parts["block"] + parts["final_norm"] + 64 * 32
    assert model.flops_per_token(16) == 6 * n + 12 * 2 * 4 * 8 * 16
    assert model.flops_per_token() == 6 * n + 12 * 2 * 4 * 8 * 32  # default T = max_seq_len


# ================================================================ dtypes and the cache's guards
BF16_CASES = [(p, "sdpa") for p in ["none", "sinusoidal", "learned", "alibi", "rope"]] + [
    (p, "explicit") for p in ["none", "relative", "alibi", "rope"]]


@pytest.mark.parametrize("positions,impl", BF16_CASES, ids=[f"{p}-{i}" for p, i in BF16_CASES])
def test_bf16_weights_and_bf16_autocast_run_close_to_fp32(positions, impl):
    cfg = tiny_config(positions=positions, n_kv_heads=2, init_std=0.1)
    model = Transformer(cfg).eval()
    model.set_attention_impl(impl)
    idx = tokens(2, 8)
    with torch.no_grad():
        reference = model(idx).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = model(idx, targets=idx)
            cache = model.new_cache(2, 8, dtype=torch.bfloat16)
            cached = torch.cat([model(idx[:, :5], cache=cache).logits, model(idx[:, 5:], cache=cache).logits], 1)
        half = Transformer(cfg).to(torch.bfloat16).eval()
        half.set_attention_impl(impl)
        pure = half(idx).logits
        cache = half.new_cache(2, 8)
        assert cache.k.dtype == torch.bfloat16
        pure_cached = torch.cat([half(idx[:, :5], cache=cache).logits, half(idx[:, 5:], cache=cache).logits], 1)
    assert auto.logits.dtype == torch.bfloat16 and auto.loss.dtype == torch.float32 and torch.isfinite(auto.loss)
    assert pure.dtype == torch.bfloat16
    for out in (auto.logits, cached, pure, pure_cached):
        assert_close(out.float(), reference, rtol=0.05, atol=0.05)


def test_cache_guards():
    model = Transformer(tiny_config())
    cache = model.new_cache(2, 6)
    model(tokens(2, 4), cache=cache)
    with pytest.raises(ValueError, match="KV cache holds max_len=6 positions; 4 are used and 3 more were given"):
        model(tokens(2, 3), cache=cache)
    with pytest.raises(ValueError, match="made for batch_size=2 but the input has batch_size=1"):
        model(tokens(1, 1), cache=cache)
    assert cache.length == 4  # a refused call leaves the cache as it was


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu", "relu"])
def test_whole_model_pickles(activation, tmp_path):
    """torch.save(model) and multiprocessing need every attribute picklable (no lambdas)."""
    model = Transformer(tiny_config(ffn="mlp", activation=activation, positions="alibi")).eval()
    torch.save(model, tmp_path / "model.pt")
    again = torch.load(tmp_path / "model.pt", weights_only=False)
    idx = tokens(1, 6)
    with torch.no_grad():
        assert torch.equal(again(idx).logits, model(idx).logits)
