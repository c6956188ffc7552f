"""Mixture of experts: parity with Hugging Face blocks, fast path == reference, balancing, capacity,
statistics, configuration errors, and the whole model with every MoE preset."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import lmlab
from lmlab import ModelConfig, MoEConfig, Transformer
from lmlab.config import MOE_PRESETS
from lmlab.feedforward import GLU, MLP, feedforward_args
from lmlab.gradient_pool import GradientPool
from lmlab.grouped_mm import grouped_mm, grouped_mm_kernel_ok, grouped_mm_split, probe_grouped_mm
from lmlab.init import Init
from lmlab.moe import (
    MoE,
    Routing,
    device_balance_loss,
    expert_balance_loss,
    load_balance_loss,
    moe_args,
    z_loss,
)

D = 32  # d_model of the block-level tests


def make_moe(moe: dict, *, ffn="glu", activation="silu", bias=False, d_ff=48, seed=0) -> MoE:
    cfg = ModelConfig(d_model=D, n_heads=4, d_ff=d_ff, ffn=ffn, activation=activation, bias=bias, moe=MoEConfig(**moe))
    layer = MoE(moe_args(cfg))
    layer.init_params(Init(torch.Generator().manual_seed(seed), std=0.3, out_std=0.3))
    if bias:  # non-zero biases so that they are tested
        with torch.no_grad():
            for name, p in layer.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(hash(name) % 1000))
    return layer


def tokens(B=2, S=12, seed=1) -> torch.Tensor:
    return torch.randn(B, S, D, generator=torch.Generator().manual_seed(seed))


# ============================================================== configuration
@pytest.mark.parametrize(
    "moe, field",
    [
        (dict(n_experts=4, top_k=5), "moe.top_k"),
        (dict(n_experts=6, top_k=2, n_groups=4), "moe.n_groups"),
        (dict(n_experts=8, top_k=2, n_groups=4, topk_groups=5), "moe.topk_groups"),
        (dict(n_experts=8, top_k=4, n_groups=4, topk_groups=1), "moe.topk_groups"),
        (dict(n_experts=4, top_k=1, n_groups=4, topk_groups=2, group_score="top2"), "moe.group_score"),
        (dict(n_experts=8, top_k=1, second_expert="random"), "moe.second_expert"),
        (dict(n_experts=8, top_k=2, device_balance_coef=0.01), "moe.device_balance_coef"),
        (dict(n_experts=8, top_k=2, shared_gate="sigmoid"), "moe.shared_gate"),
        (dict(n_experts=8, top_k=2, z_loss_coef=-1.0), "moe.z_loss_coef"),
        (dict(n_experts=8, top_k=2, capacity_factor=0.0), "moe.capacity_factor"),
        (dict(n_experts=0), "moe.n_experts"),
        (dict(scoring="sigmod"), "scoring"),
    ],
)
def test_bad_config_names_the_field(moe, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        MoEConfig(**moe)


@pytest.mark.parametrize(
    "moe, field",
    [
        (dict(d_expert=30, granularity=4), "moe.d_expert"),
        (dict(granularity=5), "d_ff"),  # d_ff = 4 * 64 = 256 for mlp
        (dict(first_dense=2), "moe.first_dense"),
    ],
)
def test_bad_config_against_the_model(moe, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        ModelConfig(d_model=64, n_layers=2, ffn="mlp", moe=moe)


def test_config_round_trip_override_and_suggestion():
    cfg = ModelConfig.from_preset("mixtral", n_layers=2)
    assert cfg.moe == MoEConfig(n_experts=8, top_k=2, normalize_top_k=True, expert_balance_coef=0.01)
    cfg2 = cfg.override({"moe.top_k": 4, "moe.granularity": 2})
    assert (cfg2.moe.top_k, cfg2.moe.routed_experts, cfg2.moe.active_experts) == (4, 16, 8)
    assert ModelConfig.from_json(cfg2.to_json()) == cfg2
    assert ModelConfig.from_dict(cfg2.to_dict()).moe == cfg2.moe
    with pytest.raises(ValueError, match="did you mean 'top_k'"):
        cfg.override({"moe.topk": 4})
    assert ModelConfig().override({"moe.n_experts": 4}).moe.n_experts == 4  # enables MoE with defaults
    assert [cfg.is_moe_layer(i) for i in range(2)] == [True, True]
    v3 = ModelConfig.from_preset("deepseek-v3")
    assert [v3.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    sw = ModelConfig.from_preset("switch")
    assert [sw.is_moe_layer(i) for i in range(4)] == [True, False, True, False]


# ============================================================== parity with Hugging Face blocks
def copy_experts(layer: MoE, hf_experts, router_weight) -> None:
    with torch.no_grad():
        layer.router.weight.copy_(router_weight)
        layer.experts.gate_up.copy_(hf_experts.gate_up_proj)
        layer.experts.down.copy_(hf_experts.down_proj)


def copy_shared(layer: MoE, hf_mlp) -> None:
    with torch.no_grad():
        layer.shared.gate_up[0].copy_(torch.cat([hf_mlp.gate_proj.weight, hf_mlp.up_proj.weight]))
        layer.shared.down[0].copy_(hf_mlp.down_proj.weight)


def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def check_parity(layer: MoE, hf_block, x: torch.Tensor) -> None:
    with torch.no_grad():
        want = hf_block(x.clone())
        for impl in ("reference", "fast"):
            layer.set_impl(impl)
            torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


def test_parity_mixtral_block():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    hf_cfg = MixtralConfig(
        hidden_size=D, intermediate_size=48, num_local_experts=6, num_experts_per_tok=2, experts_implementation="eager"
    )
    hf = MixtralSparseMoeBlock(hf_cfg).eval()
    randomize(hf)
    layer = make_moe(dict(n_experts=6, top_k=2, normalize_top_k=True)).eval()
    copy_experts(layer, hf.experts, hf.gate.weight)
    check_parity(layer, hf, tokens())


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_parity_qwen2_moe_block(norm_topk_prob):
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    hf_cfg = Qwen2MoeConfig(
        hidden_size=D, moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=norm_topk_prob, experts_implementation="eager",
    )
    hf = Qwen2MoeSparseMoeBlock(hf_cfg).eval()
    randomize(hf, seed=1)
    layer = make_moe(
        dict(n_experts=8, top_k=3, d_expert=16, n_shared=2, shared_gate="sigmoid", normalize_top_k=norm_topk_prob)
    ).eval()
    copy_experts(layer, hf.experts, hf.gate.weight)
    copy_shared(layer, hf.shared_expert)
    with torch.no_grad():
        layer.shared.output_gate.copy_(hf.shared_expert_gate.weight)
    check_parity(layer, hf, tokens())


def test_parity_deepseek_v3_block():
    """Sigmoid scoring, correction bias, group-limited top-k (top-2 group score), normalization,
    routed scaling and shared experts."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    hf_cfg = DeepseekV3Config(
        hidden_size=D, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
        topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        experts_implementation="eager",
    )
    hf = DeepseekV3MoE(hf_cfg).eval()
    randomize(hf, seed=2)
    with torch.no_grad():  # a bias large enough to change choices
        hf.gate.e_score_correction_bias.copy_(torch.randn(16, generator=torch.Generator().manual_seed(3)) * 0.3)
    layer = make_moe(
        dict(
            n_experts=16, top_k=4, d_expert=16, n_shared=2, scoring="sigmoid", normalize_top_k=True, routed_scale=2.5,
            n_groups=4, topk_groups=2, group_score="top2",
        )
    ).eval()
    copy_experts(layer, hf.experts, hf.gate.weight)
    copy_shared(layer, hf.shared_experts)
    with torch.no_grad():
        layer.router.score_bias.copy_(hf.gate.e_score_correction_bias)
    x = tokens(S=20)
    check_parity(layer, hf, x)
    # the bias and the group limit both matter here: without them the choices differ
    with torch.no_grad():
        chosen = layer.router(x.view(-1, D)).expert_TK
        layer.router.score_bias.zero_()
        assert not torch.equal(chosen.sort(1).values, layer.router(x.view(-1, D)).expert_TK.sort(1).values)


# ============================================================== equivalences
@pytest.mark.parametrize("ffn, activation", [("glu", "silu"), ("mlp", "gelu")])
@pytest.mark.parametrize("routing", [dict(), dict(scoring="sigmoid", normalize_top_k=True)])
@pytest.mark.parametrize("bias", [False, True])
def test_identical_experts_with_all_chosen_equal_the_dense_ffn(ffn, activation, routing, bias):
    layer = make_moe(dict(n_experts=4, top_k=4, **routing), ffn=ffn, activation=activation, bias=bias)
    cfg = ModelConfig(d_model=D, n_heads=4, d_ff=48, ffn=ffn, activation=activation, bias=bias)
    dense = {"glu": GLU, "mlp": MLP}[ffn](feedforward_args(cfg))
    ex = layer.experts
    with torch.no_grad():
        for e in range(4):
            ex.w_in_EID[e].copy_(ex.w_in_EID[0])
            ex.down[e].copy_(ex.down[0])
            if bias:
                ex.in_bias[e].copy_(ex.in_bias[0])
                ex.down_bias[e].copy_(ex.down_bias[0])
        (dense.gate_up if ffn == "glu" else dense.up).weight.copy_(ex.w_in_EID[0])
        dense.down.weight.copy_(ex.down[0])
        if bias:
            (dense.gate_up if ffn == "glu" else dense.up).bias.copy_(ex.in_bias[0])
            dense.down.bias.copy_(ex.down_bias[0])
        x = tokens()
        for impl in ("reference", "fast"):
            layer.set_impl(impl)
            torch.testing.assert_close(layer(x), dense(x), rtol=1e-5, atol=1e-5)


def test_granularity_keeps_total_and_active_parameters():
    base = ModelConfig(d_model=64, n_layers=2, n_heads=4, moe=dict(n_experts=4, top_k=1))
    fine = base.override({"moe.granularity": 4})
    pb, pf = Transformer(base).num_params(), Transformer(fine).num_params()
    router_extra = 2 * (16 - 4) * 64  # more centroids are the only difference
    assert pf["total"] - pb["total"] == router_extra
    assert pf["active"] - pb["active"] == router_extra
    assert Transformer(fine).blocks[0].ffn.experts.down.shape == (16, 64, base.d_ff // 4)


FAST_VS_REFERENCE = {
    "dropless": dict(n_experts=6, top_k=2, expert_balance_coef=0.01, z_loss_coef=1e-3),
    "mlp_bias": dict(n_experts=5, top_k=2),
    "mlp": dict(n_experts=5, top_k=2),
    "odd_rows": dict(n_experts=4, top_k=1),  # 7 rows: hidden-first (F, 7) rows are not 16-byte aligned
    "fine_grained": dict(n_experts=4, top_k=2, granularity=4, d_expert=96),  # 16 experts of width 24, top-8
    "empty_experts": dict(n_experts=16, top_k=1),  # 6 tokens cannot fill 16 experts
    "capacity": dict(n_experts=4, top_k=2, capacity_factor=0.5),
    "gshard_random": dict(n_experts=4, top_k=2, second_expert="random", normalize_top_k=True, capacity_factor=1.0),
    "grouped_shared": dict(
        n_experts=8, top_k=2, granularity=2, d_expert=32, n_shared=1, shared_gate="sigmoid", scoring="sigmoid",
        normalize_top_k=True, routed_scale=2.0, n_groups=4, topk_groups=2, group_score="top2",
    ),
}


# the fast path's variants on the CPU: moe.RoutedExperts with the hidden activations (F, A) or rows
# first, and the portable path (dispatch, grouped matmuls, combine) that CUDA and torch.compile run
# (experts with biases or gpt-oss's clamped GLU always take the portable path: Experts.fused is False)
FAST_PATHS = {
    "fused_hidden_first": dict(hidden_first=True),
    "fused_rows_first": dict(hidden_first=False),
    "portable": dict(fused=False),
    # every weight gradient into a reused buffer of the pool, as 32 MiB ones are (gradient_pool.py)
    "fused_pooled": dict(hidden_first=True, grad_pool=GradientPool(min_bytes=0)),
}


def run_layer(layer: MoE, x: torch.Tensor, impl: str, **path) -> tuple:
    """Output, input gradient, parameter gradients, stats and aux loss of one forward and backward."""
    layer.set_impl(impl)
    for key, value in path.items():
        setattr(layer.experts, key, value)
    layer.zero_grad()
    xi = x.clone().requires_grad_()
    torch.manual_seed(0)  # the same random second-expert draws for every path
    y = layer(xi)
    ((y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum() + layer.aux_loss).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return y.detach(), xi.grad, grads, layer.stats, layer.aux_loss.detach()


@pytest.mark.parametrize("path", FAST_PATHS)
@pytest.mark.parametrize("name", FAST_VS_REFERENCE)
def test_fast_path_equals_reference_in_outputs_and_gradients(name, path):
    kw = {"mlp_bias": dict(ffn="mlp", activation="gelu", bias=True), "mlp": dict(ffn="mlp", activation="quick_gelu")}
    layer = make_moe(FAST_VS_REFERENCE[name], **kw.get(name, {})).train()
    x = tokens(B=1, S=6) if name == "empty_experts" else tokens(B=1, S=7) if name == "odd_rows" else tokens()
    y_r, gx_r, g_r, s_r, aux_r = run_layer(layer, x, "reference")
    y_f, gx_f, g_f, s_f, aux_f = run_layer(layer, x, "fast", **FAST_PATHS[path])
    torch.testing.assert_close(y_f, y_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx_f, gx_r, rtol=1e-5, atol=1e-5)
    assert g_f.keys() == g_r.keys() and "router.weight" in g_r
    for n in g_r:
        torch.testing.assert_close(g_f[n], g_r[n], rtol=1e-5, atol=1e-5, msg=n)
    assert s_f == s_r
    torch.testing.assert_close(aux_f, aux_r)
    if name == "empty_experts":
        assert s_r["tokens_per_expert"].count(0) >= 10
        idle = [e for e, n in enumerate(s_r["tokens_per_expert"]) if n == 0]
        assert g_f["experts.down"][idle].abs().max() == 0
    if name in ("capacity", "gshard_random"):
        assert s_r["dropped"] > 0



def autograd_nodes(t: torch.Tensor) -> set[str]:
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(n for n, _ in node.next_functions)
    return {type(n).__name__ for n in seen}


def test_cpu_fast_path_is_one_autograd_function_and_the_portable_path_is_not_taken():
    layer = make_moe(dict(n_experts=4, top_k=2, granularity=4, d_expert=96)).train()  # 16 experts of width 24
    assert layer.experts.fused and layer.experts.hidden_first  # 24 units: a scalar remainder on every row
    nodes = autograd_nodes(layer(tokens()))
    assert "RoutedExpertsBackward" in nodes and not any("GroupedMm" in n or "Dispatch" in n for n in nodes), nodes
    assert not make_moe(dict(n_experts=4, top_k=2), d_ff=64).experts.hidden_first  # 64 units: rows first
    assert not make_moe(dict(n_experts=4, top_k=2), ffn="mlp", bias=True).experts.fused  # biases: portable


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_cpu_path_in_a_model_dtype_other_than_fp32_equals_the_portable_path(dtype):
    """A bf16 or fp64 layer without autocast: the router's fp32 gate weights meet the experts' dtype (the CPU
    path once multiplied bf16 hidden units by them and handed fp32 to a bf16 matmul)."""
    layer = make_moe(dict(n_experts=4, top_k=2, granularity=4, d_expert=96)).to(dtype).train()
    x = tokens().to(dtype)
    fused = run_layer(layer, x, "fast", fused=True)
    portable = run_layer(layer, x, "fast", fused=False)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-10, atol=1e-10)
    for a, b in zip(fused[:2], portable[:2]):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, **tol)
    for n in portable[2]:
        assert fused[2][n].dtype == dtype, n
        torch.testing.assert_close(fused[2][n], portable[2][n], **tol, msg=n)


def test_grouped_matmul_forms_equal_a_matmul_per_group():
    """The three forms of grouped_matmul, with contiguous and transposed operands and an empty group,
    against each group's matmul written out."""
    from lmlab.grouped_mm import grouped_matmul, grouped_matmul_split

    g = torch.Generator().manual_seed(7)
    x_AD, g_AI = torch.randn(20, 8, generator=g), torch.randn(20, 12, generator=g)
    w_EID = torch.randn(3, 12, 8, generator=g)
    offs = torch.tensor([6, 6, 20], dtype=torch.int32)
    groups = [slice(0, 6), slice(6, 6), slice(6, 20)]
    want_up_AI = torch.cat([x_AD[r] @ w_EID[e].T for e, r in enumerate(groups)])
    want_gx_AD = torch.cat([g_AI[r] @ w_EID[e] for e, r in enumerate(groups)])
    want_gw_EID = torch.stack([g_AI[r].T @ x_AD[r] for r in groups])
    for fn in (grouped_matmul, grouped_matmul_split):
        for x in (x_AD, x_AD.T.contiguous().T):
            torch.testing.assert_close(fn(x, w_EID.transpose(1, 2), offs), want_up_AI)  # 2D x 3D
            torch.testing.assert_close(fn(w_EID, x.T, offs), want_up_AI.T)  # 3D x 2D: (I, A)
            torch.testing.assert_close(fn(g_AI.T.contiguous(), x, offs), want_gw_EID)  # 2D x 2D
            torch.testing.assert_close(fn(g_AI.T, x, offs), want_gw_EID)
        torch.testing.assert_close(fn(g_AI.T.contiguous().T, w_EID, offs), want_gx_AD)
        assert fn(w_EID, x_AD.T[:, :0], offs.clamp(max=0)).shape == (12, 0)  # no rows at all
    out = torch.full((3, 12, 8), float("nan"))  # the empty group's zeros are written too
    assert grouped_matmul_split(g_AI.T, x_AD, offs, out=out) is out
    torch.testing.assert_close(out, want_gw_EID)
    with pytest.raises(ValueError, match="2D x 2D"):
        grouped_matmul_split(x_AD, w_EID.transpose(1, 2), offs, out=out)


def test_gradient_pool_gives_a_buffer_again_only_when_no_tensor_holds_it():
    pool = GradientPool(min_bytes=64, buffers=2)
    w = torch.zeros(4, 8)  # 128 bytes
    assert GradientPool().take(w) is None and pool.take(torch.zeros(4, 2)) is None  # small: malloc reuses those
    assert pool.take(w.to("meta")) is None
    first = pool.take(w)
    assert first.shape == w.shape and first.dtype == w.dtype and first.is_contiguous()
    address = first.data_ptr()
    second = pool.take(w)
    assert second.data_ptr() != address  # the first is held
    assert pool.take(w) is None  # both held: the caller allocates as usual
    row = first[1]  # a view keeps the storage, and so the buffer, in use
    del first
    assert pool.take(w) is None
    del row
    again = pool.take(w)
    assert again.data_ptr() == address
    assert pool.take(w.to(torch.bfloat16)).dtype == torch.bfloat16  # its own buffers, in bytes
    assert copy.deepcopy(pool).arrays == {}


def test_pooled_weight_gradients_are_adopted_reused_and_never_overwrite_a_kept_one():
    """Over steps of the CPU path with every weight gradient pooled: each step's gradients equal the portable
    path's; autograd adopts the pooled buffer as ``.grad`` and the next step reuses it; gradients accumulated
    over two backward passes are right (the second is written into the other buffer and added); a gradient
    someone kept is not overwritten."""
    layer = make_moe(dict(n_experts=4, top_k=2, granularity=4, d_expert=96)).train()
    twin = copy.deepcopy(layer)
    layer.experts.grad_pool = GradientPool(min_bytes=0)
    twin.experts.fused = False
    w = layer.experts.gate_up

    def step(model, seed, zero=True):
        if zero:
            model.zero_grad(set_to_none=True)
        y = model(tokens(seed=seed))
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        return {n: p.grad for n, p in model.named_parameters()}

    addresses = set()
    for seed in (1, 2, 3):
        got, want = step(layer, seed), step(twin, seed)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)
        addresses.add(w.grad.data_ptr())
        del got  # else it holds this step's gradients through the next step, and the pool gives the other buffer
    assert len(addresses) == 1  # adopted as .grad, and the same buffer every step
    got, want = step(layer, 4, zero=False), step(twin, 4, zero=False)  # accumulate onto step 3's
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)
    kept = w.grad
    before = kept.clone()
    step(layer, 5)
    assert w.grad.data_ptr() != kept.data_ptr() and torch.equal(kept, before)


@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_experts_given_no_rows_return_none_and_zero_gradients(impl):
    """An expert-parallel rank whose experts no token chose receives zero rows and must still
    compute (nothing) for the backward's collectives: the fast path's sum per token once failed
    with "cannot reshape tensor of 0 elements into shape [-1, 0]"."""
    from lmlab.moe import IMPLS, Assignment, Plan, sum_per_token

    no_rows = Plan(torch.zeros(0, dtype=torch.long), torch.zeros(0), torch.zeros(4, dtype=torch.int32),
                   torch.zeros(0, dtype=torch.long), padded=False)
    assert sum_per_token(torch.zeros(0, D), no_rows, 0).shape == (0, D)
    experts = make_moe({"n_experts": 4, "top_k": 2}).experts
    empty = torch.zeros(0, dtype=torch.long)
    a = Assignment(empty, empty, torch.zeros(0), torch.zeros(0, dtype=torch.bool), torch.zeros(4, dtype=torch.long),
                   torch.tensor(0))
    x = torch.zeros(0, D, requires_grad=True)
    y = getattr(experts, IMPLS[impl])(x, a, x.new_zeros(0, D))
    assert y.shape == (0, D)
    (y.sum() + sum(p.sum() for p in experts.parameters()) * 0).backward()
    assert x.grad.shape == (0, D) and all(torch.equal(p.grad, torch.zeros_like(p)) for p in experts.parameters())

def test_grouped_mm_kernel_and_fallback_agree():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 8, generator=g, requires_grad=True)
    w = torch.randn(4, 12, 8, generator=g, requires_grad=True)
    offs = torch.tensor([3, 3, 3, 10], dtype=torch.int32)  # two empty groups
    want = torch.cat([x[:3] @ w[0].T, x[3:] @ w[3].T])
    gx_want, gw_want = torch.autograd.grad((want * want).sum(), (x, w))
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 9):
        assert grouped_mm_kernel_ok(x, w)  # torch's CPU kernel exists from 2.9: the fast path uses it
    for fn in (grouped_mm, grouped_mm_split):
        y = fn(x, w, offs)
        torch.testing.assert_close(y, want)
        gx, gw = torch.autograd.grad((y * y).sum(), (x, w))
        torch.testing.assert_close(gx, gx_want)
        torch.testing.assert_close(gw, gw_want)
    assert not grouped_mm_kernel_ok(
        x[:, :6].contiguous(), w[:, :, :6].contiguous()
    )  # 24-byte strides: the kernel refuses
    with torch.inference_mode():  # a first call during generation must not record "no kernel" for good
        assert probe_grouped_mm.__wrapped__("cpu", torch.float32) == probe_grouped_mm("cpu", torch.float32)


# ============================================================== balancing
def test_balance_losses_under_uniform_routing():
    E = 8
    coefs = dict(load_balance_coef=0.1, z_loss_coef=0.01, expert_balance_coef=0.2, device_balance_coef=0.3)
    layer = make_moe(dict(n_experts=E, top_k=2, n_groups=4, **coefs))
    with torch.no_grad():
        layer.router.weight.zero_()  # every token: probabilities 1/E
        layer(tokens())
    losses = {k: float(v) for k, v in layer.aux_losses.items()}
    assert losses == pytest.approx(
        {"load_balance": 0.1, "z_loss": 0.01 * math.log(E) ** 2, "expert_balance": 0.2, "device_balance": 0.3}
    )
    assert float(layer.aux_loss) == pytest.approx(sum(losses.values()))
    stats = layer.stats
    assert stats["router_entropy"] == pytest.approx(math.log(E))


def test_balance_losses_closed_form_on_a_skewed_routing():
    # 4 tokens, 4 experts in 2 devices; probs and choices written out by hand
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 4)
    expert = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 3]])
    chosen = torch.bincount(expert.flatten(), minlength=4)  # [3, 3, 1, 1]
    r = Routing(probs.log(), probs, expert, torch.ones(4, 2), torch.ones(4, 2, dtype=torch.bool), chosen)
    # Switch: first choices f = [3/4, 1/4, 0, 0]; E * sum f P = 4 * (0.3 + 0.075)
    assert float(load_balance_loss(r)) == pytest.approx(4 * (0.75 * 0.4 + 0.25 * 0.3))
    # DeepSeekMoE expert level: f = E/(K T) count = [1.5, 1.5, .5, .5]
    assert float(expert_balance_loss(r)) == pytest.approx(1.5 * 0.4 + 1.5 * 0.3 + 0.5 * 0.2 + 0.5 * 0.1)
    # device level: f' = [1.5, .5], P' = [.7, .3]
    assert float(device_balance_loss(r, n_groups=2)) == pytest.approx(1.5 * 0.7 + 0.5 * 0.3)
    assert float(z_loss(r)) == pytest.approx(0.0, abs=1e-6)  # log-probabilities: logsumexp = 0


def test_bias_updates_lower_the_load_imbalance():
    layer = make_moe(dict(n_experts=8, top_k=2, scoring="sigmoid", normalize_top_k=True, bias_update_rate=0.01)).train()
    v = torch.randn(D, generator=torch.Generator().manual_seed(5))
    x = tokens(B=4, S=32) + v  # every token shares a direction v ...
    with torch.no_grad():
        layer.router.weight[0] += v / v.norm()  # ... that experts 0 and 1 are drawn to
        layer.router.weight[1] += 0.5 * v / v.norm()
        layer(x)
        before = layer.stats
        for _ in range(60):
            layer(x)
            layer.update_bias()
        layer(x)
    after = layer.stats
    assert before["max_load"] > 3.5 and after["max_load"] < 1.3
    assert after["cv_load"] < 0.5 * before["cv_load"]
    bias = layer.router.score_bias
    assert bias[0] < bias[1] < 0 < bias[2]  # the busiest expert is pushed down the most
    assert float(layer.load.sum()) == 2 * 128  # the last forward was accumulated; update_bias clears it
    layer.update_bias()
    assert float(layer.load.sum()) == 0


def test_bias_update_is_a_no_op_when_disabled():
    layer = make_moe(dict(n_experts=4, top_k=1)).train()
    with torch.no_grad():
        layer(tokens())
    layer.update_bias()
    assert layer.router.score_bias.abs().max() == 0


def test_transformer_updates_router_biases():
    cfg = ModelConfig.from_preset("deepseek-v3", d_model=64, n_heads=4, n_layers=2, vocab_size=64)
    model = Transformer(cfg).train()
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(idx)
    model.update_router_biases()
    bias = model.blocks[1].ffn.router.score_bias
    assert bias.abs().max() == pytest.approx(1e-3)


def test_router_bias_update_balances_on_the_all_reduced_load():
    """Under DDP the trainer passes an in-place sum over processes; the sign is taken of the
    global load, so a skew that exists only on another rank still moves the bias."""
    cfg = ModelConfig.from_preset("deepseek-v3", d_model=64, n_heads=4, n_layers=2, vocab_size=64)
    model = Transformer(cfg).train()
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0)))
    seen = []

    def other_rank_sends_everything_to_expert_0(load):
        seen.append(load.clone())
        load[0] += 1e6

    model.update_router_biases(other_rank_sends_everything_to_expert_0)
    bias = model.blocks[1].ffn.router.score_bias
    assert len(seen) == len(model.moe_layers) and all(s.sum() > 0 for s in seen)
    assert bias[0] == pytest.approx(-1e-3) and (bias[1:] == pytest.approx(1e-3))


# ============================================================== capacity and statistics
@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_capacity_drops_exactly_the_overflow_tokens(impl):
    E, T = 4, 8
    layer = make_moe(dict(n_experts=E, top_k=1, capacity_factor=1.0)).eval()  # C = ceil(8 * 1 / 4) = 2
    layer.set_impl(impl)
    with torch.no_grad():
        layer.router.score_bias[0] = 100.0  # everybody chooses expert 0
        x = tokens(B=1, S=T)
        y = layer(x)[0]
        w = layer.router(x[0]).weight_TK[:, 0]
        expert0 = layer.experts.one(x[0], 0) * w[:, None]
    torch.testing.assert_close(y[:2], expert0[:2])  # the first two in token order fit
    assert y[2:].abs().max() == 0  # the rest overflow: nothing added, the residual carries them
    s = layer.stats
    assert s["tokens_per_expert"] == [8, 0, 0, 0] and s["dropped"] == pytest.approx(6 / 8)
    assert s["max_load"] == pytest.approx(4.0) and s["cv_load"] == pytest.approx(math.sqrt(3))


def test_capacity_serves_first_choices_before_second_choices():
    E, T = 4, 4
    layer = make_moe(dict(n_experts=E, top_k=2, capacity_factor=1.0)).eval()  # C = ceil(4*2/4) = 2
    with torch.no_grad():
        layer.router.weight.zero_()
        # tokens 0-1 pick (1, 0); tokens 2-3 pick (0, 2): expert 0 gets two first choices (tokens 2, 3)
        # and two second choices (tokens 0, 1) -> the second choices overflow
        layer.router.score_bias.copy_(torch.tensor([0.0, 0.0, 0.0, -9.0]))
        x = tokens(B=1, S=T)
        r = layer.router(x[0])
        r.expert_TK = torch.tensor([[1, 0], [1, 0], [0, 2], [0, 2]])
        a = layer.assign_limited(r)
    keep = a.keep_A
    pairs = sorted(zip(a.token_A[keep].tolist(), a.expert_A[keep].tolist()))
    assert pairs == [(0, 1), (1, 1), (2, 0), (2, 2), (3, 0), (3, 2)]
    assert a.sent_E.tolist() == [4, 2, 2, 0] and int(a.kept) == 6
    assert a.weight_A[~keep].abs().max() == 0  # the overflowing second choices of tokens 0, 1 weigh nothing
    # fixed shapes: all K*T assignments stay, and the kept ones fill distinct slots expert * C + place
    assert a.token_A.shape == (8,) and a.capacity == 2
    slots = a.slot_A[keep].tolist()
    assert sorted(slots) == sorted({0 * 2 + 0, 0 * 2 + 1, 1 * 2 + 0, 1 * 2 + 1, 2 * 2 + 0, 2 * 2 + 1})
    assert (a.slot_A[~keep] == 4 * 2).all()


def test_gshard_second_expert_is_sent_with_probability_twice_its_share():
    layer = make_moe(dict(n_experts=2, top_k=2, second_expert="random", normalize_top_k=True)).train()
    x = torch.ones(1, 4000, D)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0] = math.log(9) / D  # probabilities (0.9, 0.1): g2 share 0.1
        torch.manual_seed(0)
        layer(x)
        assert layer.stats["tokens_per_expert"][0] == 4000
        assert layer.stats["tokens_per_expert"][1] / 4000 == pytest.approx(0.2, abs=0.03)
        layer.eval()
        layer(x)
        assert layer.stats["tokens_per_expert"] == [4000, 4000]


def test_router_logits_are_fp32_under_autocast():
    layer = make_moe(dict(n_experts=4, top_k=2, n_shared=1))
    x = tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = layer.router(x.view(-1, D))
        y = layer(x)
    assert r.logits_TE.dtype == torch.float32 and r.weight_TK.dtype == torch.float32
    want = layer(x)
    assert (
        y.dtype == torch.float32 and float((y - want).detach().norm() / want.detach().norm()) < 0.02
    )  # bf16 experts, fp32 routing


@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_gradients_reach_router_experts_and_shared_experts(impl):
    layer = make_moe(dict(n_experts=4, top_k=2, n_shared=1, shared_gate="sigmoid", expert_balance_coef=0.1)).train()
    layer.set_impl(impl)
    y = layer(tokens())
    (y.square().mean() + layer.aux_loss).backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().amax(dim=tuple(range(1, p.ndim))).min() > 0, name


# ============================================================== the whole model
@pytest.mark.parametrize("preset", sorted(MOE_PRESETS))
def test_every_moe_preset_trains_with_its_aux_losses(preset):
    cfg = ModelConfig.from_preset(preset, d_model=64, n_heads=4, n_layers=2, vocab_size=64)
    model = Transformer(cfg).train()
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    out = model(idx, targets=idx)
    enabled = {k.removesuffix("_coef") for k, v in cfg.moe.to_dict().items() if k.endswith("_coef") and v > 0}
    assert set(out.aux_losses) == enabled and enabled
    assert float(out.aux_loss.detach()) > 0
    torch.testing.assert_close(out.loss, out.ce_loss + sum(out.aux_losses.values()))
    out.loss.backward()
    router = model.moe_layers[0].router.weight
    assert router.grad is not None and router.grad.abs().max() > 0
    counts = model.num_params()
    moe, width = cfg.moe, cfg.moe.expert_width(cfg.d_ff)
    per_expert = (3 if cfg.ffn == "glu" else 2) * 64 * width
    if cfg.bias:  # gpt-oss: each expert's input and output biases
        per_expert += (2 if cfg.ffn == "glu" else 1) * width + 64
    assert (
        counts["total"] - counts["active"] == cfg.n_moe_layers * (moe.routed_experts - moe.active_experts) * per_expert
    )
    stats = model.moe_stats()
    assert len(stats) == cfg.n_moe_layers
    assert sum(stats[0]["tokens_per_expert"]) == 32 * moe.active_experts or moe.second_expert == "random"


def test_model_loss_includes_aux_losses_and_weights_are_seeded():
    cfg = ModelConfig.from_preset("mixtral", d_model=64, n_heads=4, n_layers=2, vocab_size=64)
    cfg = cfg.override({"moe.z_loss_coef": 1.0})
    a, b = Transformer(cfg), Transformer(cfg)
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), n
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    out = a(idx, targets=idx)
    z = sum(float(m.aux_losses["z_loss"].detach()) for m in a.moe_layers)
    assert float(out.aux_losses["z_loss"].detach()) == pytest.approx(z) and z > 0
    assert float((out.loss - out.ce_loss).detach()) == pytest.approx(float(out.aux_loss.detach()))
    # down projections use the residual std: gpt2 scaling shrinks them, not the inputs
    g = Transformer(cfg.replace(residual_scaling="gpt2", init_std=0.05))
    ex = g.blocks[0].ffn.experts
    assert float(ex.gate_up.detach().std()) == pytest.approx(0.05, rel=0.05)
    assert float(ex.down.detach().std()) == pytest.approx(0.05 / math.sqrt(4), rel=0.05)


# ============================================================== Hugging Face checkpoints
def random_hf_model(model_cls, config, seed=0):
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize(model, seed)
    return model


def check_logits(hf_model, tmp_path) -> lmlab.Transformer:
    hf_model.save_pretrained(tmp_path)  # writes the Hub layout: one tensor per expert
    ours = lmlab.from_hf(tmp_path)
    idx = torch.randint(0, hf_model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx).logits, hf_model(idx).logits, rtol=1e-4, atol=1e-4)
    # transformers' in-memory layout (stacked experts) maps to the same weights
    from lmlab.hf import state_dict_from_hf

    sd = state_dict_from_hf(ours.config, hf_model.state_dict())
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(sd[name], value, msg=name)
    assert all(not layer.load.any() for layer in ours.moe_layers)  # the one buffer no checkpoint holds
    return ours


def test_from_hf_mixtral_logits_match(tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )
    ours = check_logits(random_hf_model(MixtralForCausalLM, cfg), tmp_path)
    assert ours.config.moe == MoEConfig(n_experts=4, top_k=2, normalize_top_k=True)


@pytest.mark.parametrize("qkv_bias", [True, False])  # true is what published Qwen1.5-MoE / Qwen2-MoE use
def test_from_hf_qwen2_moe_logits_match(tmp_path, qkv_bias):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, decoder_sparse_step=2, qkv_bias=qkv_bias,
    )
    ours = check_logits(random_hf_model(Qwen2MoeForCausalLM, cfg, seed=1), tmp_path)
    assert (ours.config.qkv_bias, ours.config.bias) == (qkv_bias, False)
    moe = ours.config.moe
    assert (moe.n_shared, moe.shared_d_ff, moe.shared_gate, moe.every, moe.first_dense) == (1, 32, "sigmoid", 2, 1)
    assert [ours.config.is_moe_layer(i) for i in range(3)] == [False, True, False]


@pytest.mark.parametrize("step, mlp_only", [(1, [0]), (2, []), (1, [0, 2]), (3, [])])
def test_from_hf_qwen2_moe_shared_expert_of_any_width_and_dense_layers(tmp_path, step, mlp_only):
    """shared_expert_intermediate_size 24 is no multiple of moe_intermediate_size 16 (refused before
    shared_d_ff); decoder_sparse_step and mlp_only_layers place the dense layers."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, decoder_sparse_step=step, mlp_only_layers=mlp_only, norm_topk_prob=True,
    )
    ours = check_logits(random_hf_model(Qwen2MoeForCausalLM, cfg, seed=2), tmp_path)
    sparse = [i not in mlp_only and (i + 1) % step == 0 for i in range(3)]
    assert [ours.config.is_moe_layer(i) for i in range(3)] == sparse
    moe = ours.config.moe
    assert (moe.n_shared, moe.shared_d_ff, moe.normalize_top_k) == (1, 24, True)
    layer = ours.moe_layers[0]
    assert tuple(layer.shared.gate_up.shape) == (1, 48, 32) and tuple(layer.experts.gate_up.shape) == (4, 32, 32)


@pytest.mark.parametrize("n_shared, shared_d_ff", [(0, None), (2, None), (1, 24), (3, 20)])
def test_parameter_and_flop_accounting_with_shared_experts_of_any_width(n_shared, shared_d_ff):
    """Closed form: every MoE layer holds a router (E x D), E experts of width F and n_shared shared
    experts of width shared_d_ff (F when None), each 3 D w parameters (SwiGLU); a token uses K experts."""
    V, D, F, E, K, L = 64, 32, 16, 6, 2, 3
    moe = MoEConfig(n_experts=E, top_k=K, d_expert=F, n_shared=n_shared, shared_d_ff=shared_d_ff, first_dense=1)
    cfg = ModelConfig(vocab_size=V, d_model=D, n_layers=L, n_heads=4, d_ff=40, moe=moe)
    model = Transformer(cfg)
    w = shared_d_ff or F
    attention = 4 * D * D + 2 * D  # q, k, v, out; two norms
    dense_layer, moe_layer = attention + 3 * D * 40, attention + E * D + E * 3 * D * F + n_shared * 3 * D * w
    total = 2 * V * D + D + dense_layer + 2 * moe_layer  # untied embedding and head, final norm
    counts = model.num_params()
    assert counts["total"] == total
    assert counts["active"] == total - 2 * (E - K) * 3 * D * F
    assert counts["non_embedding"] == total - 2 * V * D
    assert model.flops_per_token(16) == 6 * (counts["active"] - V * D) + 12 * L * 4 * 8 * 16
    assert model.moe_layers[0].shared(torch.zeros(1, D)).shape == (1, D)


def test_shared_d_ff_needs_shared_experts():
    with pytest.raises(ValueError, match="moe.shared_d_ff=24 sets the width of shared experts; set moe.n_shared >= 1"):
        MoEConfig(shared_d_ff=24)
    with pytest.raises(ValueError, match="moe.shared_d_ff=0 is not valid"):
        MoEConfig(n_shared=1, shared_d_ff=0)


def test_deepseek_v3_moe_layer_through_the_converter():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    from lmlab.hf import HFTensors
    from lmlab.hf.moe import deepseek_v3_moe, deepseek_v3_moe_weights

    hf_cfg = DeepseekV3Config(
        hidden_size=D, intermediate_size=64, moe_intermediate_size=8, n_routed_experts=16, num_experts_per_tok=3,
        n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
        experts_implementation="eager",
    )
    hf = DeepseekV3MoE(hf_cfg).eval()
    randomize(hf, seed=4)
    with torch.no_grad():
        hf.gate.e_score_correction_bias.normal_(0, 0.3, generator=torch.Generator().manual_seed(5))
    moe = deepseek_v3_moe(hf_cfg.to_dict())
    assert (moe.scoring, moe.group_score, moe.topk_groups, moe.routed_scale, moe.first_dense) == (
        "sigmoid", "top2", 2, 2.5, 1,
    )
    cfg = ModelConfig(d_model=D, n_heads=4, n_layers=2, d_ff=64, moe=moe)
    tensors = HFTensors({f"model.layers.1.mlp.{k}": v for k, v in hf.state_dict().items()})
    sd = deepseek_v3_moe_weights(cfg, tensors, "model.layers.1.mlp.", "")
    assert not tensors.missing and not tensors.unexpected
    layer = MoE(moe_args(cfg)).eval()
    layer.load_state_dict(sd)
    check_parity(layer, hf, tokens(S=16))


def test_deepseek_v3_checkpoint_loads_with_multi_head_latent_attention(tmp_path):
    """Whole DeepSeek-V3 checkpoints load (logit parity: tests/test_hf_deepseek.py); one whose
    num_key_value_heads (transformers' default 128) differs from its 4 heads is refused by that key."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        first_k_dense_replace=1,
    )
    DeepseekV3ForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_key_value_heads=128: MLA gives every head its own keys"):
        lmlab.from_hf(tmp_path)
    DeepseekV3ForCausalLM(cfg.__class__(**{**cfg.to_dict(), "num_key_value_heads": 4})).save_pretrained(tmp_path)
    loaded = lmlab.from_hf(tmp_path).config
    assert loaded.mla.kv_lora_rank == 16 and loaded.moe.group_score == "top2" and loaded.rope.layout == "interleaved"


@pytest.mark.parametrize(
    "model_type, changes, key",
    [
        # transformers gives sliding layers a window of 0 (no keys at all) unless use_sliding_window is set
        ("qwen2_moe", dict(layer_types=["sliding_attention", "full_attention", "full_attention"]),
         "use_sliding_window"),
        ("qwen2_moe", dict(mlp_only_layers=[2]), "mlp_only_layers"),  # MoE layers 0, 1: not a pattern
        ("qwen2_moe", dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size"),
        ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise"),
        ("mixtral", dict(num_experts_per_tok=5), "moe.top_k"),
        ("qwen2_moe", dict(num_experts=0), "num_experts"),
    ],
)
def test_hf_moe_configs_lmlab_cannot_express_are_refused(model_type, changes, key):
    from lmlab.hf import config_from_hf

    base = dict(
        model_type=model_type, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    base.update(
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32,
             qkv_bias=False)
        if model_type == "qwen2_moe" else dict(num_local_experts=4, num_experts_per_tok=2)
    )
    config_from_hf(base)  # the base itself loads
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        config_from_hf({**base, **changes})
