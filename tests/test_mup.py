"""μP (``model.parametrization: mup``, lmlab.mup): the base shape is the standard model, roles and
multipliers by comparison with the base's shapes, the readout and attention scales, the optimizer's
per-group rates, a coordinate check across widths 64..512, and a cross-check with the ``mup`` package."""

from __future__ import annotations

import math
import signal

import pytest
import torch
import torch.nn.functional as F
from helpers import FAST_RUN, corpus, decoded_logits, tokens

import lmlab
from lmlab import mup
from lmlab.config import ModelConfig
from lmlab.model import Transformer
from lmlab.run.config import RunConfig
from lmlab.run.data.config import DataConfig
from lmlab.run.optim import param_groups
from lmlab.run.trainer import Trainer

# the proxy: d_model 64, 4 heads of 16; wider models override d_model (head_dim follows, n_heads stays)
PROXY = dict(vocab_size=128, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, max_seq_len=32)
VARIANTS = {
    "llama": ("llama", {}),
    "gpt2-tied": ("gpt2", {}),
    "mixtral": ("mixtral", {"d_model": 64, "moe.d_expert": 64}),
    "gated-headwise": ("llama", {"attn_gate": "headwise", "qk_norm": "head"}),
    "shared-gate-moe": ("llama", {"moe": {"n_experts": 4, "top_k": 2, "n_shared": 1, "shared_gate": "sigmoid",
                                          "d_expert": 96}}),
}


def proxy(name: str, **changes) -> ModelConfig:
    preset, extra = VARIANTS[name]
    nested = {k: v for k, v in extra.items() if "." in k}
    flat = {k: v for k, v in extra.items() if "." not in k}
    return ModelConfig.from_preset(preset, **{**PROXY, **flat, **changes}).override(nested)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_at_its_base_shape_mup_is_the_standard_model(name):
    """Every width ratio is 1 at the base: the same weights, logits, loss and optimizer groups."""
    std = proxy(name)
    mu = std.override({"parametrization": "mup"})
    assert mu.mup == lmlab.config.MupConfig(base_d_model=64, base_head_dim=std.head_dim)
    a, b = Transformer(std), Transformer(mu)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    x = tokens(2, 16, vocab=128)
    assert torch.equal(a(x).logits, b(x).logits) and torch.equal(a(x, x).loss, b(x, x).loss)
    strip = [{k: v for k, v in g.items() if k != "params"} for g in param_groups(a, 0.1)]
    assert strip == [{k: v for k, v in g.items() if k != "params"} for g in param_groups(b, 0.1)]
    assert mup.lr_multipliers(b) == {}


def test_standard_configs_keep_their_identity():
    """The new fields hold their defaults in every preset, so no run identity changes."""
    for name in lmlab.config.PRESETS:
        ident = ModelConfig.from_preset(name).identity_dict()
        assert "parametrization" not in ident and "mup" not in ident


def test_the_base_shape_stays_when_the_width_grows():
    cfg = proxy("llama", parametrization="mup").override({"d_model": 256})
    assert (cfg.d_model, cfg.head_dim, cfg.mup.base_d_model, cfg.mup.base_head_dim) == (256, 64, 64, 16)
    assert cfg.attention_scale == pytest.approx(4 / 64)  # sqrt(16) / 64: 1/head_dim, equal to 1/4 at the base
    base = mup.base_config(cfg)
    assert (base.d_model, base.head_dim, base.n_heads, base.n_kv_heads, base.d_ff) == (64, 16, 4, 2, 192)
    assert base.parametrization == "standard"


def test_fixed_head_dim_grows_the_head_count_of_the_base():
    cfg = proxy("llama", head_dim=16, parametrization="mup").override({"d_model": 128, "n_heads": 8, "n_kv_heads": 4})
    base = mup.base_config(cfg)
    assert (base.n_heads, base.n_kv_heads, base.head_dim) == (4, 2, 16)
    odd = proxy("llama", parametrization="mup", mup={"base_d_model": 64, "base_head_dim": 24}).override(
        {"d_model": 128})
    with pytest.raises(ValueError, match="whole numbers"):
        mup.base_config(odd)


@pytest.mark.parametrize("change, field", [({"init": "xavier"}, "init"),
                                           ({"norm_position": "post", "residual_scaling": "deepnorm"},
                                            "residual_scaling"),
                                           ({"attention": {"scale_dim": 32}}, "attention.scale_dim")])
def test_mup_refuses_what_it_does_not_define(change, field):
    with pytest.raises(ValueError, match=f"parametrization='mup' with {field}="):
        proxy("llama", parametrization="mup", **change)
    with pytest.raises(ValueError, match="mup sets the base shape"):
        proxy("llama", mup={"base_d_model": 32})


def test_roles_by_comparison_with_the_base():
    wide = Transformer(proxy("shared-gate-moe", parametrization="mup", attn_gate="headwise").override(
        {"d_model": 256, "moe.d_expert": 384}))
    roles = {n: (s.role, s.ratio) for n, s in mup.scalings(wide).items()}
    assert roles["embed.weight"] == ("input", 1.0) and roles["head.weight"] == ("head", 1.0)
    assert roles["blocks.0.attn.qkv.weight"] == ("hidden", 0.25)
    assert roles["blocks.0.attn.out.weight"] == ("hidden", 0.25)
    assert roles["blocks.0.norm1.weight"] == ("input", 1.0)
    experts = [n for n in roles if n.startswith("blocks.0.ffn.") and "router" not in n and "gate" not in n]
    assert experts and all(roles[n] == ("hidden", 0.25) for n in experts), experts
    assert roles["blocks.0.ffn.router.weight"] == ("output", 0.25)  # (E, d): fan-in grows, E does not
    assert roles["blocks.0.attn.gate.proj.weight"] == ("output", 0.25)  # (H, d): one gate per head
    assert roles["blocks.0.ffn.shared.output_gate"] == ("output", 0.25)  # (1, d)


def test_init_is_the_standard_draw_times_the_role_factor():
    cfg = proxy("mixtral").override({"d_model": 256, "moe.d_expert": 256})
    std, mu = Transformer(cfg), Transformer(cfg.override({"parametrization": "mup", "mup": {
        "base_d_model": 64, "base_head_dim": 16}}))
    scalings = mup.scalings(mu)
    mu_params = dict(mu.named_parameters())
    factors = set()
    for name, p in std.named_parameters():
        assert torch.allclose(mu_params[name], p * scalings[name].init, rtol=0, atol=1e-7), name
        factors.add(round(scalings[name].init, 4))
    assert factors == {1.0, 0.5, 0.25}  # inputs, hidden matrices (sqrt(64/256)), routers (64/256)


def test_readout_and_attention_scale():
    cfg = proxy("llama", parametrization="mup").override({"d_model": 256})
    model = Transformer(cfg).eval()
    x = tokens(2, 12, vocab=128)
    h = model.hidden(x)
    logits = model(x).logits
    torch.testing.assert_close(logits, F.linear(h, model.head.weight) * (64 / 256), rtol=1e-6, atol=1e-6)
    loss = F.cross_entropy(logits.flatten(0, 1), x.flatten())
    torch.testing.assert_close(model(x, x).ce_loss, loss, rtol=1e-5, atol=1e-6)
    model.set_loss_impl("plain")
    torch.testing.assert_close(model(x, x).ce_loss, loss, rtol=1e-5, atol=1e-6)
    model.set_attention_impl("explicit")  # the reference path uses the same 1/head_dim scale as SDPA
    torch.testing.assert_close(model(x).logits, logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(decoded_logits(model, x, 5), logits, rtol=1e-5, atol=1e-5)


def test_optimizer_groups_carry_the_rates_and_the_trainer_applies_them(tmp_path):
    corpus(tmp_path / "corpus.txt")
    model = proxy("llama", vocab_size=256, parametrization="mup").override({"d_model": 128})
    cfg = RunConfig(model=model, data=DataConfig(source=str(tmp_path / "corpus.txt"))).override(
        {**FAST_RUN, "train.steps": 4, "optim.weight_decay": 0.1, "optim.warmup_steps": 1})
    seen = []

    def record(trainer, rec):
        seen.append({round(g.get("lr_scale", 1.0), 4): g["lr"] for g in trainer.optimizer.param_groups})
        if rec["step"] == 2:
            trainer.request_stop(signal.SIGTERM)

    with Trainer(cfg, tmp_path / "run", quiet=True, callbacks=[record]) as t:
        t.fit()
        groups = t.optimizer.param_groups
    scaled = [g for g in groups if "lr_scale" in g]
    assert {g["lr_scale"] for g in scaled} == {0.5}  # 64 / 128 for every hidden matrix
    assert all(g["weight_decay"] == pytest.approx(0.2) for g in scaled)  # lr * wd is the base's
    assert all(rates[0.5] == pytest.approx(rates[1.0] * 0.5) for rates in seen) and len(seen) == 2
    with Trainer(cfg, tmp_path / "run", quiet=True, resume=True) as resumed:  # the factors survive a resume
        assert [g.get("lr_scale") for g in resumed.optimizer.param_groups] == [g.get("lr_scale") for g in groups]
        before = {k: v.clone() for k, v in resumed.model.state_dict().items()}
        resumed.fit()
        assert any(not torch.equal(before[k], v) for k, v in resumed.model.state_dict().items())


# ---------------------------------------------------------------- the coordinate check
WIDTHS = (64, 128, 256, 512)


def coordinates(parametrization: str, steps: int = 3, lr: float = 1e-2) -> dict[str, list[float]]:
    """The RMS of each block's output and of the logits after ``steps`` Adam steps on one fixed batch, per width
    (the ``mup`` package's coordinate check, Tensor Programs V sec. D.1), as {quantity: [RMS at each width]}."""
    data = tokens(4, 17, vocab=128, seed=1)
    found: dict[str, list[float]] = {}
    for width in WIDTHS:
        cfg = ModelConfig.from_preset("llama", **{**PROXY, "n_kv_heads": 4, "max_seq_len": 16},
                                      parametrization=parametrization).override({"d_model": width})
        model = Transformer(cfg)
        groups = [{"params": g["params"], "lr": lr * g.get("lr_scale", 1.0)} for g in param_groups(model, 0.0)]
        opt = torch.optim.Adam(groups)
        outputs = {}
        for i, block in enumerate(model.blocks):
            block.register_forward_hook(lambda m, args, out, i=i: outputs.__setitem__(f"block {i}", out.detach()))
        for _ in range(steps):
            opt.zero_grad()
            model(data[:, :-1], data[:, 1:]).loss.backward()
            opt.step()
        with torch.no_grad():
            outputs["logits"] = model(data[:, :-1]).logits
        for name, value in outputs.items():
            found.setdefault(name, []).append(value.pow(2).mean().sqrt().item())
    return found


def spread(values: list[float]) -> float:
    return max(values) / min(values)


def test_coordinate_check():
    """Under μP every layer's output and the logits keep their size from width 64 to 512 after a few steps at
    one rate (measured: at most 1.95x apart); under standard parametrization the same rate blows the hidden
    coordinates up with width (~150-340x from 64 to 512) and the logits grow (~3.5x)."""
    mu, std = coordinates("mup"), coordinates("standard")
    assert set(mu) == {"block 0", "block 1", "logits"}
    for name, values in mu.items():
        assert spread(values) < 2.5, (name, values)
    for name in ("block 0", "block 1"):
        assert std[name][-1] > 20 * std[name][0], (name, std[name])
    assert std["logits"][-1] > 2 * std["logits"][0] and spread(std["logits"]) > 2 * spread(mu["logits"])


def test_rates_match_the_mup_package():
    """mup 1.0.0's own shapes and MuAdamW give the hidden matrices the same rate and weight decay, and every other
    parameter the base rate, except the fan-in-grown outputs (routers, per-head and shared-expert gates): mup
    refuses those unless they are a MuReadout (its ``assert_hidden_size_inf``), and its refusal names exactly our
    ``output`` and ``head`` roles, which Table 3 (ours) gives 1/width. (mup's package metadata requires
    torchvision, which would pull another torch build: .ci/run installs it with --no-deps.)"""
    mup_package = pytest.importorskip("mup")
    wide_cfg = proxy("shared-gate-moe", parametrization="mup", attn_gate="headwise").override(
        {"d_model": 256, "moe.d_expert": 384})
    wide, base = Transformer(wide_cfg), Transformer(mup.base_config(wide_cfg))
    ours = mup.scalings(wide)
    mup_package.set_base_shapes(wide, base, rescale_params=False, do_assert=False)
    embeddings = {id(p) for p in wide.embedding_parameters()}
    readouts = {n for n, p in wide.named_parameters() if p.ndim == 2 and id(p) not in embeddings
                and p.infshape[1].isinf() and not p.infshape[0].isinf()}  # (fixed out, grown in)
    assert readouts == {n for n, s in ours.items() if s.role in ("output", "head")}
    opt = mup_package.MuAdamW([{"params": [p], "names": [n], "weight_decay": 0.1} for n, p in wide.named_parameters()],
                              lr=1.0)
    theirs = {g["names"][0]: (g["lr"], g["weight_decay"]) for g in opt.param_groups if g["params"]}
    for name, s in ours.items():
        lr, wd = theirs[name]
        if s.role == "output":
            assert lr == 1.0 and s.lr == pytest.approx(0.25), name
        else:
            assert lr == pytest.approx(s.lr) and wd == pytest.approx(0.1 / s.lr), name
    assert sum(s.role == "hidden" for s in ours.values()) > 5


def test_widest_ratio_is_exact():
    cfg = proxy("llama", parametrization="mup").override({"d_model": 512})
    down = mup.scalings(Transformer(cfg))["blocks.0.ffn.down.weight"]
    assert down.ratio == pytest.approx(192 / 1408) and math.isclose(down.lr, down.ratio)


# ---------------------------------------------------------------- the transfer experiment's endpoints
def test_the_best_rate_of_a_curve_is_the_parabola_vertex():
    from lmlab.experiments.mup import optimum

    parabola = [(2.0**x, (x + 6.3) ** 2 + 3.0) for x in range(-10, -3)]  # minimum at log2(rate) = -6.3
    assert optimum(parabola) == (pytest.approx(-6.3), False)
    assert optimum(parabola[4:]) == (-6.0, True)  # the lowest loss at the grid's lower end: flagged
    skewed = [(2.0**-8, 5.0), (2.0**-7, 4.0), (2.0**-6, 4.9)]
    x, edge = optimum(skewed)
    assert -7.0 < x < -6.5 and not edge  # leans toward the lower neighbour, clipped between the neighbours


def test_optimum_shift_counts_grid_steps_per_seed():
    from lmlab.experiments.mup import abs_optimum_shift, optimum_shift

    def rows(seed, width, best):
        return [{"seed": seed, "d_model": width, "lr_value": 2.0**x, "status": "ok",
                 "final_val_loss": (x - best) ** 2 + 3.0} for x in range(-10, -2)]

    arm = rows(0, 64, -5.0) + rows(0, 512, -8.0) + rows(0, 128, -6.0) + rows(1, 64, -5.0) + rows(1, 512, -4.5)
    assert optimum_shift(arm, 7.6) == {0: pytest.approx(-3.0), 1: pytest.approx(0.5)}
    assert abs_optimum_shift(arm, 7.6) == {0: pytest.approx(3.0), 1: pytest.approx(0.5)}
    diverged = [dict(r, status="diverged") if r["lr_value"] == 2.0**-8 else r for r in rows(2, 512, -8.0)]
    assert optimum_shift(rows(2, 64, -5.0) + diverged, 7.6)[2] != pytest.approx(-3.0)  # counted as ln vocab


@pytest.mark.parametrize("decoder", ["eager", "static"])
def test_generation_reads_the_readout(decoder):
    """Every decoder's logits pass through μP's readout multiplier (model.logits_of): each call of the head
    during generation follows a call of the readout, and greedy decoding equals the argmax of the full
    forward's logits. (A decoder calling the head directly would sample from logits 4x too large here.)"""
    from lmlab.generate import generate

    model = Transformer(proxy("llama", parametrization="mup").override({"d_model": 256})).eval()
    calls = {"head": 0, "readout": 0}
    for name in calls:
        getattr(model, name).register_forward_hook(lambda m, i, o, name=name: calls.__setitem__(name, calls[name] + 1))
    prompt = tokens(1, 5, vocab=128)
    out = torch.stack(list(generate(model, prompt, 6, temperature=0.0, decoder=decoder)), dim=1)  # (1, 6)
    assert calls["head"] >= 6 and calls["readout"] == calls["head"], calls
    seq = prompt
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq[:, 5:])
