"""The residual axis (``residual.py``): plain, hyper-connections (Zhu et al. 2024) and DeepSeek-V4's mHC.

Parity with ``transformers``' ``DeepseekV4HyperConnection`` and ``DeepseekV4HyperHead`` on the same weights (and
with the ``hyper-connections`` package's ``HyperConnections`` where it is installed); each connection equal to its
stream-by-stream reference; Sinkhorn's matrices doubly stochastic; the config's refusals; and over presets and
norm positions: training, causality, cached decoding, generation, MTP, gradients, accounting, export refused.
``plain`` is every other test of the suite, unchanged.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from helpers import assert_mtp_cache_equals_full, decoded_logits, tiny_config, tokens
from torch.testing import assert_close

import lmlab
from lmlab import ModelConfig, Transformer
from lmlab.generate import generate
from lmlab.memory import activation_bytes, parameter_count
from lmlab.residual import (
    HyperConnection,
    HyperHead,
    ManifoldHyperConnection,
    hyper_reference,
    mhc_reference,
    sinkhorn,
)
from lmlab.run.optim import param_groups

T = 12
CHOICES = ["hyper", "mhc"]
PRESETS = ["llama", "qwen3", "gpt2"]
SMALL = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32)


def preset_config(preset: str, residual: str, **overrides) -> ModelConfig:
    sizes = dict(SMALL, n_kv_heads=SMALL["n_heads"]) if preset == "gpt2" else SMALL
    return ModelConfig.from_preset(preset, **sizes, residual=residual, **overrides)


def randomize(module: torch.nn.Module, std: float = 0.3, seed: int = 0) -> None:
    """Every parameter of ``module`` random, so no coefficient sits at its init's special value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if p.ndim == 1 and p.numel() <= 3 else 0.0))


def mhc_matrices(model: Transformer, idx: torch.Tensor) -> torch.Tensor:
    """Every mHC connection's comb matrices on ``idx``: (connections, B, T, n, n)."""
    found = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: found.append(mod.coefficients(args[0])[2]))
             for m in model.modules() if isinstance(m, ManifoldHyperConnection)]
    with torch.no_grad():
        model(idx)
    for h in hooks:
        h.remove()
    return torch.stack(found)


# ============================================================== parity with references
def test_mhc_equals_transformers_deepseek_v4_hyper_connection_and_head_on_the_same_weights():
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4HyperHead

    C, n = 32, 4
    hf_cfg = DeepseekV4Config(hidden_size=C, hc_mult=n, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
                              num_hidden_layers=2, vocab_size=64)
    cfg = tiny_config(norm_eps=1e-6, residual="mhc")
    assert (cfg.residual_streams.n, cfg.residual_streams.sinkhorn_iters, cfg.residual_streams.eps) == (n, 20, 1e-6)
    theirs, their_head = DeepseekV4HyperConnection(hf_cfg), DeepseekV4HyperHead(hf_cfg)
    randomize(theirs, std=0.1, seed=1)
    randomize(their_head, std=0.1, seed=2)
    ours, our_head = ManifoldHyperConnection(cfg, 0), HyperHead(cfg)
    ours.load_state_dict(theirs.state_dict())  # the same names: fn, base, scale
    our_head.load_state_dict({"fn": their_head.hc_fn, "base": their_head.hc_base, "scale": their_head.hc_scale})

    H = torch.randn(2, 7, n, C, generator=torch.Generator().manual_seed(3), requires_grad=True)
    f = torch.nn.Linear(C, C)
    randomize(f, std=0.1, seed=4)  # seeded: the result must not depend on the tests run before
    post, comb, collapsed = theirs(H)
    # DeepseekV4DecoderLayer's use of them: H' = post ⊗ f(collapsed) + combᵀ H
    want = post.unsqueeze(-1) * f(collapsed).unsqueeze(-2) + comb.transpose(-1, -2) @ H
    got = ours(H, f)
    _, our_post, our_comb = ours.coefficients(H)
    assert (our_post - post).abs().max() <= 1e-6 and (our_comb - comb).abs().max() <= 1e-6
    assert (got - want).abs().max() <= 1e-5
    assert (our_head.collapse(H) - their_head(H)).abs().max() <= 1e-5
    # and the gradients, of the streams and of every weight
    (got.square().sum() + our_head.collapse(H).sum()).backward()
    ours_grads = [H.grad.clone(), ours.fn.grad, ours.scale.grad, our_head.fn.grad]
    H.grad = None
    (want.square().sum() + their_head(H).sum()).backward()
    for a, b in zip(ours_grads, [H.grad, theirs.fn.grad, theirs.scale.grad, their_head.hc_fn.grad]):
        assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_hyper_equals_the_hyper_connections_package_on_the_same_weights():
    """lucidrains' ``hyper-connections`` (Zhu et al. 2024's Algorithm 2) with its RMSNorm, (gamma + 1) x / rms(x),
    which is lmlab's RMSNorm with norm_gain 'offset' and no epsilon to speak of. Its streams are (B n, T, C)."""
    pkg = pytest.importorskip("hyper_connections")
    B, n, C, k = 2, 4, 32, 3
    cfg = tiny_config(norm="rmsnorm", norm_gain="offset", norm_eps=1e-12, residual="hyper")
    theirs = pkg.HyperConnections(n, dim=C, layer_index=k, tanh=True)
    randomize(theirs)
    ours = HyperConnection(cfg, k)
    with torch.no_grad():
        ours.norm.weight.copy_(theirs.norm.gamma)
        ours.static_alpha.copy_(theirs.static_alpha.flatten())
        ours.alpha_fn.copy_(theirs.dynamic_alpha_fn.T)
        ours.static_beta.copy_(theirs.static_beta)
        ours.beta_fn.copy_(theirs.dynamic_beta_fn[None])
        ours.scale.copy_(torch.stack([theirs.dynamic_alpha_scale, theirs.dynamic_beta_scale]))
    H = torch.randn(B, T, n, C, generator=torch.Generator().manual_seed(0))
    f = torch.nn.Linear(C, C)
    randomize(f, std=0.1, seed=4)  # seeded: the result must not depend on the tests run before
    branch_input, add_residual = theirs(H.transpose(1, 2).reshape(B * n, T, C))
    want = add_residual(f(branch_input)).reshape(B, n, T, C).transpose(1, 2)
    assert (ours(H, f) - want).abs().max() <= 1e-5


@pytest.mark.parametrize("residual", CHOICES)
def test_each_connection_equals_its_stream_by_stream_reference(residual):
    cfg = tiny_config(residual=residual)
    hc = {"hyper": HyperConnection, "mhc": ManifoldHyperConnection}[residual](cfg, 1)
    randomize(hc, std=0.1)
    reference = {"hyper": hyper_reference, "mhc": mhc_reference}[residual]
    H = torch.randn(2, 5, 4, 32, generator=torch.Generator().manual_seed(0))
    f = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh())
    assert_close(hc(H, f), reference(H, f, hc), rtol=1e-5, atol=1e-6)


def test_hyper_connections_at_init_compute_the_plain_residual():
    """Zhu et al.'s init (A_m = e_k, A_r = I, B = 1, dynamic weights 0) keeps every stream equal to x + f(x), and
    draws nothing: the model is the plain one, weight for weight, up to the final norm of n x instead of x."""
    plain_cfg = tiny_config(norm_eps=1e-12, init_std=0.1)
    hyper, plain = Transformer(plain_cfg.replace(residual="hyper")), Transformer(plain_cfg)
    shared = plain.state_dict()
    assert all(torch.equal(hyper.state_dict()[name], value) for name, value in shared.items())
    idx = tokens(2, T)
    with torch.no_grad():
        assert_close(hyper(idx).logits, plain(idx).logits, rtol=1e-5, atol=1e-5)


# ============================================================== Sinkhorn
def test_mhc_mixing_matrices_are_doubly_stochastic_after_the_sinkhorn_iterations():
    """Every mHC connection's matrix, for every token of a model at init and after training: Sinkhorn ends on the
    columns, so they sum to 1 within 1e-5 always; the rows do where 20 iterations have converged (at init and for
    mild logits); a trained model's sharper matrices converge with more iterations, as Sinkhorn-Knopp does
    (a limit of DeepSeek-V4's 20, noted by mHC-lite, arXiv:2601.05732)."""
    model = Transformer(preset_config("llama", "mhc"))
    idx = tokens(4, 16)
    comb = mhc_matrices(model, idx)  # (4 connections, B, T, n, n)
    assert comb.shape == (4, 4, 16, 4, 4) and (comb > 0).all()
    assert (comb.sum(-1) - 1).abs().max() <= 1e-5 and (comb.sum(-2) - 1).abs().max() <= 1e-5
    mild = torch.randn(1000, 4, 4, generator=torch.Generator().manual_seed(0)) * 0.5
    m = sinkhorn(mild, 20, 1e-6)
    assert (m.sum(-1) - 1).abs().max() <= 1e-5 and (m.sum(-2) - 1).abs().max() <= 1e-5

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(15):
        opt.zero_grad()
        model(idx, targets=idx.roll(-1, 1)).loss.backward()
        opt.step()
    comb = mhc_matrices(model, idx)
    assert (comb.sum(-2) - 1).abs().max() <= 1e-5
    hc = next(m for m in model.modules() if isinstance(m, ManifoldHyperConnection))
    captured = []
    hook = hc.register_forward_pre_hook(lambda mod, args: captured.append(args[0]))
    with torch.no_grad():
        model(idx)
    hook.remove()
    x = torch.nn.functional.rms_norm(captured[0].flatten(-2).double(), (128,), eps=hc.norm_eps)
    comb_logits = (x @ hc.fn.double().T)[..., 8:].unflatten(-1, (4, 4))  # the rows after pre (4) and post (4)
    logits = comb_logits * hc.scale[2].double() + hc.base[8:].double().view(4, 4)
    converged = sinkhorn(logits, 1000, 1e-6)
    assert (converged.sum(-1) - 1).abs().max() <= 1e-5 and (converged.sum(-2) - 1).abs().max() <= 1e-5


# ============================================================== the config
def test_post_norm_and_deepnorm_are_refused_in_one_line_and_the_others_compose():
    for residual in CHOICES:
        for position in ("pre", "sandwich", "reordered"):
            assert tiny_config(norm_position=position, residual=residual).n_streams == 4
        with pytest.raises(ValueError, match=r"^residual='.*' is not defined with norm_position='post'") as e:
            tiny_config(norm_position="post", residual=residual)
        assert "\n" not in str(e.value)
        with pytest.raises(ValueError, match="norm_position='post'"):
            tiny_config(norm_position="post", residual_scaling="deepnorm", residual=residual)
        with pytest.raises(ValueError, match="norm_position='post'"):
            ModelConfig.from_preset("vaswani2017", residual=residual)
        assert ModelConfig.from_preset("vaswani2017", residual=residual, norm_position="pre").residual == residual


def test_streams_section_resolves_follows_the_choice_and_is_checked():
    cfg = tiny_config(residual="mhc")
    assert cfg.residual_streams == lmlab.config.StreamsConfig() and cfg.n_streams == 4
    assert tiny_config().residual_streams is None and tiny_config().n_streams == 1
    assert cfg.override({"residual": "plain"}).residual_streams is None  # a default section follows the choice
    assert cfg.override({"residual": "hyper"}).residual == "hyper"
    assert ModelConfig.from_yaml(cfg.to_yaml()) == cfg
    assert "residual" not in tiny_config().identity_dict()  # no plain run's identity changes
    assert cfg.override({"residual_streams.n": 2}).n_streams == 2
    with pytest.raises(ValueError, match="set residual to one of them or residual_streams=null"):
        tiny_config(residual_streams={"n": 2})
    with pytest.raises(ValueError, match="only applies to residual='mhc'"):
        tiny_config(residual="hyper", **{"residual_streams.sinkhorn_iters": 5})
    with pytest.raises(ValueError, match=r"residual_streams.n=0 is not valid"):
        tiny_config(residual="mhc", **{"residual_streams.n": 0})
    with pytest.raises(ValueError, match="is not a valid choice"):
        tiny_config(residual="highway")


# ============================================================== models with streams
GRID = [(r, p, {}) for r in CHOICES for p in PRESETS] + [
    (r, "llama", {"norm_position": pos}) for r in CHOICES for pos in ("sandwich", "reordered")
] + [(r, "llama", {"mtp": {"depth": 2}}) for r in CHOICES]
IDS = [f"{r}-{p}-{'-'.join(map(str, f.values())) or 'preset'}" for r, p, f in GRID]


@functools.lru_cache(maxsize=None)
def _model(residual: str, preset: str, fields: str) -> Transformer:
    return Transformer(preset_config(preset, residual, init_std=0.1, **json.loads(fields))).eval()


def grid_model(residual: str, preset: str, fields: dict) -> Transformer:
    """The grid's model, built once (init_std 0.1: attention at 0.02 is near-uniform and causal effects tiny)."""
    return _model(residual, preset, json.dumps(fields, sort_keys=True))


@pytest.mark.parametrize(("residual", "preset", "fields"), GRID, ids=IDS)
def test_causal_and_cached_decoding_equals_the_full_forward(residual, preset, fields):
    model = grid_model(residual, preset, fields)
    idx = tokens(2, T)
    with torch.no_grad():
        full = model(idx).logits
        changed = idx.clone()
        changed[:, 6] = (changed[:, 6] + 1) % 64
        moved = model(changed).logits
    assert_close(moved[:, :6], full[:, :6], rtol=0, atol=1e-6)
    assert ((moved[:, 6:] - full[:, 6:]).abs().amax(-1) > 1e-5).all()
    assert_close(decoded_logits(model, idx, prefill=5), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("residual", "preset", "fields"), GRID, ids=IDS)
def test_trains_with_falling_loss_and_every_parameter_gets_a_gradient(residual, preset, fields):
    """Every parameter gets a gradient once the first step has moved hyper's dynamic weights off 0 (at init
    tanh(0) = 0, so its scales' gradient is exactly 0, as in Zhu et al.'s init)."""
    model = Transformer(preset_config(preset, residual, **fields))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = tokens(4, 17, seed=2)
    losses = []
    for _ in range(6):
        opt.zero_grad(set_to_none=True)
        loss = model(idx[:, :-1], targets=idx[:, 1:]).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"no gradient reaches {missing}"
    assert ("mtp" in model(idx[:, :-1], targets=idx[:, 1:]).aux_losses) == ("mtp" in fields)


@pytest.mark.parametrize("residual", CHOICES)
def test_explicit_attention_equals_sdpa_and_plain_loss_equals_chunked(residual):
    model = Transformer(preset_config("llama", residual, init_std=0.1))
    idx = tokens(2, T + 1, seed=4)
    with torch.no_grad():
        fast = model(idx[:, :-1], targets=idx[:, 1:])
        model.set_attention_impl("explicit")
        model.set_loss_impl("plain")
        explicit = model(idx[:, :-1], targets=idx[:, 1:])
    assert_close(explicit.logits, fast.logits, rtol=1e-5, atol=1e-5)
    assert_close(explicit.loss, fast.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("residual", CHOICES)
def test_generation_decoders_agree_and_mtp_drafts_with_its_own_streams(residual):
    model = grid_model(residual, "llama", {"mtp": {"depth": 2}})
    prompt = tokens(2, 5, seed=7)
    runs = {d: torch.stack(list(generate(model, prompt, 8, temperature=0, decoder=d)), dim=1)
            for d in ("eager", "static", "speculative")}
    assert torch.equal(runs["static"], runs["eager"]) and torch.equal(runs["speculative"], runs["eager"])
    assert_mtp_cache_equals_full(model, T)


@pytest.mark.parametrize("residual", CHOICES)
def test_the_streams_stay_fp32_under_bf16_autocast(residual):
    """The mixing is not rounded to bf16: coefficients and the streams' matmuls run with autocast off."""
    model = Transformer(preset_config("llama", residual))
    seen = []
    hook = model.blocks[1].register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(tokens(2, T), targets=tokens(2, T, seed=1))
    hook.remove()
    assert seen == [torch.float32] and torch.isfinite(out.loss)


@pytest.mark.parametrize("residual, message", [
    ("hyper", "cannot export: residual='hyper' has no exact transformers architecture"),
    # DeepSeek-V4 computes mHC (tests/test_hf_deepseek_v4.py); a Llama body with it has no architecture
    ("mhc", "llama: residual='mhc' (Llama computes only 'plain')"),
])
def test_export_refuses_in_one_line_and_writes_nothing(residual, message, tmp_path):
    from lmlab.hf import to_hf

    with pytest.raises(ValueError) as e:
        to_hf(Transformer(preset_config("llama", residual)), tmp_path / "out")
    assert message in str(e.value) and "\n" not in str(e.value) and not (tmp_path / "out").exists()


# ============================================================== accounting
def added_parameters(cfg: ModelConfig) -> int:
    """What ``cfg.residual`` adds to the plain model, in closed form (L layers, 2 connections each, the head)."""
    n, C, L = cfg.n_streams, cfg.d_model, cfg.n_layers
    if cfg.residual == "mhc":  # fn, base, scale per connection; the head's fn, base, scale
        return 2 * L * ((2 + n) * n * n * C + (2 + n) * n + 3) + n * n * C + n + 1
    norm = C * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    return 2 * L * (norm + n * (1 + n) + n + (1 + n) * C + C + 2)


def mixing_flops(cfg: ModelConfig) -> float:
    n, C, L = cfg.n_streams, cfg.d_model, cfg.n_layers
    if cfg.residual == "mhc":
        return 2 * L * 6 * C * (n * n + 2 * n) + 6 * n * C
    return 2 * L * 6 * C * (n * (n + 1) + n + (n - 1) * (n + 2))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("residual", CHOICES)
def test_parameters_flops_and_memory_count_the_streams(residual, preset):
    cfg = preset_config(preset, residual)
    plain_cfg = cfg.replace(residual="plain", residual_streams=None)
    model, plain = Transformer(cfg), Transformer(plain_cfg)
    counts, plain_counts = model.num_params(), plain.num_params()
    assert counts["total"] == sum(p.numel() for p in model.parameters()) == parameter_count(cfg)
    added = added_parameters(cfg)
    assert counts["total"] - plain_counts["total"] == added
    assert counts["non_embedding"] - plain_counts["non_embedding"] == added
    assert counts["active"] - plain_counts["active"] == added
    assert model.flops_per_token() - plain.flops_per_token() == pytest.approx(6 * added + mixing_flops(cfg))
    assert activation_bytes(cfg, 2, 16) > activation_bytes(plain_cfg, 2, 16)
    # AdamW decays the projections, never the gains, biases, scales or hyper's static connections (stored flat)
    decayed = {n for g in param_groups(model, 0.1) if g["weight_decay"] > 0 for n in g["names"]}
    ours = {n for n, _ in model.named_parameters() if "residual" in n or n.startswith("streams.")}
    assert {n for n in ours if n in decayed} == {n for n in ours if n.endswith("fn")}


def test_mup_treats_the_mixing_projections_as_readouts_and_its_base_shape_is_standard():
    """μP reads roles from shapes: mHC's fn grows in fan-in only (a router's role: init and lr x base/width)."""
    from lmlab.mup import lr_multipliers

    cfg = preset_config("llama", "mhc", parametrization="mup", **{"mup.base_d_model": 16, "mup.base_head_dim": 4})
    multipliers = lr_multipliers(Transformer(cfg))
    assert multipliers["blocks.0.attn_residual.fn"] == pytest.approx(0.5)
    assert multipliers["streams.fn"] == pytest.approx(0.5)
    at_base = preset_config("llama", "mhc", parametrization="mup")
    a, b = Transformer(at_base).state_dict(), Transformer(at_base.replace(parametrization="standard", mup=None))
    assert all(torch.equal(a[name], value) for name, value in b.state_dict().items())
