"""ModelConfig: validation messages, serialization round trips, overrides and presets."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml
from helpers import TINY, tiny_config

from lmlab import ModelConfig, MoEConfig, Transformer

# ---------------------------------------------------------------- bad configurations
# (fields, text the message must contain: field=value and what would be valid)
BAD = {
    "n_heads-does-not-divide-d_model": (dict(d_model=30, n_heads=4),
                                        ["n_heads=4", "d_model=30", "choose n_heads in [1, 2, 3, 5, 6, 10, 15, 30]"]),
    "rope-odd-head_dim": (dict(d_model=36, n_heads=4, positions="rope"), ["positions='rope'", "head_dim=9", "even"]),
    "rope-odd-explicit-head_dim": (dict(head_dim=7, positions="rope"), ["head_dim=7"]),
    "n_kv_heads-does-not-divide-n_heads": (dict(n_heads=4, n_kv_heads=3), ["n_kv_heads=3", "n_heads=4", "[1, 2, 4]"]),
    "n_kv_heads-above-n_heads": (dict(n_heads=4, n_kv_heads=8), ["n_kv_heads=8", "[1, 2, 4]"]),
    "deepnorm-with-pre-norm": (dict(residual_scaling="deepnorm", norm_position="pre"),
                               ["residual_scaling='deepnorm'", "norm_position='post'"]),
    "rope-scaling-without-rope": (dict(positions="learned", rope={"scaling": "linear", "factor": 2.0}),
                                  ["rope.scaling='linear'", "positions='learned'"]),
    "dropout-negative": (dict(dropout=-0.1), ["dropout=-0.1", "[0.0, 0.999]"]),
    "dropout-one": (dict(dropout=1.0), ["dropout=1.0", "[0.0, 0.999]"]),
    "norm_eps-zero": (dict(norm_eps=0.0), ["norm_eps=0.0", "> 0"]),
    "init_std-negative": (dict(init_std=-0.02), ["init_std=-0.02", "> 0"]),
    "int-field-given-text": (dict(d_model="wide"), ["d_model='wide'", "integer"]),
    "int-field-given-fraction": (dict(n_layers=2.5), ["n_layers=2.5", "integer"]),
    "bool-field-given-text": (dict(bias="maybe"), ["bias='maybe'", "true or false"]),
    "required-field-given-none": (dict(d_model=None), ["d_model=None"]),
}
SIZES = [
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "max_seq_len",
    "relative_clip",
    "n_kv_heads",
    "head_dim",
    "d_ff",
]
for _name in SIZES:
    for _value in (0, -2):
        BAD[f"{_name}={_value}"] = ({_name: _value}, [f"{_name}={_value}", "> 0"])

CHOICES = {
    "norm": ["layernorm", "rmsnorm"],
    "norm_position": ["pre", "post", "sandwich", "reordered"],
    "qk_norm": ["none", "head", "full"],
    "attn_gate": ["none", "elementwise", "headwise"],
    "positions": ["none", "sinusoidal", "learned", "relative", "alibi", "rope"],
    "ffn": ["mlp", "glu"],
    "activation": ["gelu", "gelu_tanh", "silu", "relu", "quick_gelu"],
    "glu_variant": ["plain", "clamped", "limited"],
    "residual_scaling": ["none", "gpt2", "deepnorm"],
    "embed_scale": ["none", "sqrt_d"],
    "norm_gain": ["plain", "offset"],
}
for _name, _valid in CHOICES.items():
    BAD[f"unknown-{_name}"] = ({_name: "bogus"}, [f"{_name}='bogus'", str(_valid)])
BAD["clamped-glu-needs-glu"] = (dict(ffn="mlp", glu_variant="clamped"), ["glu_variant='clamped'", "ffn='glu'"])
BAD["offset-gain-needs-rmsnorm"] = (dict(norm="layernorm", norm_gain="offset"),
                                    ["norm_gain='offset'", "norm='rmsnorm'"])
BAD["scale-dim-positive"] = (dict(attention={"scale_dim": 0}), ["attention.scale_dim=0"])
BAD["unknown-choice-suggests"] = (dict(norm="rmsnrom"), ["norm='rmsnrom'", "did you mean 'rmsnorm'"])
BAD["unknown-nested-choice"] = (dict(rope={"layout": "zigzag"}), ["layout='zigzag'", "['half', 'interleaved']"])


@pytest.mark.parametrize("fields,expected", BAD.values(), ids=BAD.keys())
def test_bad_config_raises_naming_field_and_value(fields, expected):
    with pytest.raises(ValueError) as err:
        ModelConfig(**{**TINY, **fields})
    message = str(err.value)
    for text in expected:
        assert text in message, f"{text!r} not in {message!r}"
    assert "\n" not in message  # one line


LATE = {  # a bad value arriving through override or a saved dict, not the constructor
    "override-divisibility": (lambda: tiny_config().override({"d_model": 30}),
                              BAD["n_heads-does-not-divide-d_model"][1]),
    "override-kv": (lambda: tiny_config().override({"n_kv_heads": "3"}), BAD["n_kv_heads-does-not-divide-n_heads"][1]),
    "override-range": (lambda: tiny_config().override({"dropout": "1.0"}), BAD["dropout-one"][1]),
    "from_dict-choice": (lambda: ModelConfig.from_dict({**tiny_config().to_dict(), "norm": "bogus"}),
                         BAD["unknown-norm"][1]),
    "from_dict-nested": (lambda: ModelConfig.from_dict({**TINY, "rope": {"base": -1.0}}), ["rope.base=-1.0", "> 0"]),
}


@pytest.mark.parametrize("make,expected", LATE.values(), ids=LATE.keys())
def test_bad_value_through_override_and_from_dict(make, expected):
    with pytest.raises(ValueError) as err:
        make()
    assert all(text in str(err.value) for text in expected), str(err.value)


def test_valid_edge_values_are_accepted():
    cfg = ModelConfig(
        **{**TINY, "dropout": 0.0, "n_kv_heads": 1, "head_dim": 12, "positions": "alibi", "d_model": 30, "n_heads": 4}
    )
    assert (cfg.n_kv_heads, cfg.head_dim) == (1, 12)  # explicit head_dim lifts the divisibility rule


UNKNOWN_KEYS = {
    "from_dict": (lambda: ModelConfig.from_dict({**TINY, "d_modle": 32}), ["'d_modle'", "did you mean 'd_model'"]),
    "override": (lambda: tiny_config().override({"n_layer": 3}), ["'n_layer'", "did you mean 'n_layers'"]),
    "from_dict-nested": (lambda: ModelConfig.from_dict({**TINY, "rope": {"bsae": 1.0}}),
                         ["rope.bsae", "did you mean 'base'"]),
    "override-nested": (lambda: tiny_config().override({"rope.bsae": 1.0}), ["rope.bsae", "did you mean 'base'"]),
    "override-into-scalar": (lambda: tiny_config().override({"d_model.x": 1}), ["d_model.x", "not a nested config"]),
    "from_preset": (lambda: ModelConfig.from_preset("llama", n_head=2), ["'n_head'", "did you mean 'n_heads'"]),
    "from_json": (lambda: ModelConfig.from_json('{"vocab_sise": 10}'), ["'vocab_sise'", "did you mean 'vocab_size'"]),
    "from_yaml": (lambda: ModelConfig.from_yaml("norm_postion: post\n"),
                  ["'norm_postion'", "did you mean 'norm_position'"]),
}


@pytest.mark.parametrize("make,expected", UNKNOWN_KEYS.values(), ids=UNKNOWN_KEYS.keys())
def test_unknown_key_suggests_closest(make, expected):
    with pytest.raises(ValueError) as err:
        make()
    for text in expected:
        assert text in str(err.value), str(err.value)


def test_config_is_frozen_and_keyword_only():
    cfg = tiny_config()
    with pytest.raises(Exception):
        cfg.d_model = 64  # frozen
    with pytest.raises(TypeError):
        ModelConfig(64)  # keyword-only


# ---------------------------------------------------------------- serialization
def _rich_config() -> ModelConfig:
    return tiny_config(n_kv_heads=2, dropout=0.1, bias=True, **{
        "rope.scaling": "yarn", "rope.factor": 4.0, "rope.original_max_seq_len": 16, "rope.layout": "interleaved",
    })


@pytest.mark.parametrize("fmt", ["json", "yaml"])
def test_round_trip_through_text_and_file_is_equal(fmt, tmp_path):
    cfg = _rich_config()
    text = getattr(cfg, f"to_{fmt}")()
    parsed = json.loads(text) if fmt == "json" else yaml.safe_load(text)
    assert parsed["rope"]["scaling"] == "yarn" and parsed["rope"]["factor"] == 4.0  # nested, not flattened
    assert parsed["head_dim"] == 8 and parsed["d_ff"] == cfg.d_ff  # derived sizes are saved explicitly
    loaded = getattr(ModelConfig, f"from_{fmt}")(text)
    assert loaded == cfg and loaded.rope == cfg.rope
    path = tmp_path / f"model.{fmt}"
    getattr(cfg, f"to_{fmt}")(path)
    assert getattr(ModelConfig, f"from_{fmt}")(path) == cfg
    assert getattr(ModelConfig, f"from_{fmt}")(str(path)) == cfg


def test_dict_round_trip_and_builds_the_same_model():
    cfg = _rich_config()
    again = ModelConfig.from_dict(cfg.to_dict())
    assert again == cfg
    a, b = Transformer(cfg.replace(dropout=0.0)), Transformer(again.replace(dropout=0.0))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_missing_or_empty_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        ModelConfig.from_yaml(tmp_path / "nope.yaml")
    (tmp_path / "empty.json").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        ModelConfig.from_json(tmp_path / "empty.json")


# ---------------------------------------------------------------- overrides
def test_override_with_command_line_strings():
    cfg = tiny_config().override({
        "n_layers": "6", "bias": "true", "tie_embeddings": "False", "init_std": "1e-4",
        "rope.base": "5e5", "rope.layout": "interleaved", "n_kv_heads": "2", "dropout": "0.25",
    })
    assert cfg.n_layers == 6 and type(cfg.n_layers) is int
    assert cfg.bias is True and cfg.tie_embeddings is False
    assert cfg.init_std == 1e-4 and type(cfg.init_std) is float
    assert cfg.rope.base == 5e5 and cfg.rope.layout == "interleaved"
    assert cfg.n_kv_heads == 2 and cfg.dropout == 0.25


def test_override_returns_a_new_validated_copy():
    cfg = tiny_config()
    new = cfg.override({"n_layers": 3})
    assert (cfg.n_layers, new.n_layers) == (2, 3)
    assert new.replace(n_layers=2) == cfg
    with pytest.raises(ValueError, match="n_layers=0"):
        cfg.override({"n_layers": "0"})


def test_derived_sizes_follow_the_fields_they_derive_from():
    cfg = tiny_config()  # head_dim 8, d_ff 128, n_kv_heads 4 (all derived)
    wider = cfg.override({"d_model": 64})
    assert (wider.head_dim, wider.n_kv_heads) == (16, 4)
    assert wider.d_ff == 64 * -(-8 * 64 // (3 * 64)) == 192
    assert cfg.replace(n_heads=2).n_kv_heads == 2  # MHA stays MHA
    assert cfg.replace(ffn="mlp", d_model=48, n_heads=4).d_ff == 4 * 48
    explicit = tiny_config(head_dim=16, d_ff=100, n_kv_heads=2)
    kept = explicit.override({"d_model": 64})
    assert (kept.head_dim, kept.d_ff, kept.n_kv_heads) == (16, 100, 2)  # explicit choices are kept


# ---------------------------------------------------------------- presets
PRESET_AXES = {
    "vaswani2017": dict(norm_position="post", norm="layernorm", positions="sinusoidal", ffn="mlp", activation="gelu"),
    "gpt2": dict(norm_position="pre", norm="layernorm", positions="learned", ffn="mlp", residual_scaling="gpt2"),
    "llama": dict(norm_position="pre", norm="rmsnorm", positions="rope", ffn="glu", activation="silu"),
}


@pytest.mark.parametrize("name", PRESET_AXES)
def test_preset_has_documented_axes_and_accepts_overrides(name):
    cfg = ModelConfig.from_preset(name)
    for field, value in PRESET_AXES[name].items():
        assert getattr(cfg, field) == value, field
    if name == "gpt2":
        assert cfg.activation in ("gelu", "gelu_tanh")
    if name == "llama":
        assert 1 < cfg.n_kv_heads < cfg.n_heads  # grouped-query
    small = ModelConfig.from_preset(name, **TINY, n_kv_heads=2, **{"rope.base": 5e5})
    assert (small.d_model, small.n_layers, small.n_kv_heads, small.rope.base) == (32, 2, 2, 5e5)
    for field, value in PRESET_AXES[name].items():
        assert getattr(small, field) == value
    flipped = ModelConfig.from_preset(name, norm_position="pre" if name == "vaswani2017" else "post")
    assert flipped.norm_position != PRESET_AXES[name]["norm_position"]
    logits = Transformer(small)(torch.zeros(1, 4, dtype=torch.long)).logits
    assert torch.isfinite(logits).all()


def test_unknown_preset_suggests_closest():
    with pytest.raises(ValueError, match=re.escape("unknown preset 'lama' (did you mean 'llama'?)")) as err:
        ModelConfig.from_preset("lama")
    assert "gpt2" in str(err.value) and "vaswani2017" in str(err.value)


def test_sizes_derived_in_a_nested_model_config_follow_an_override_through_the_parent():
    from lmlab.run import RunConfig

    run = RunConfig().override({"model.d_model": 256, "model.n_heads": 4})
    assert (run.model.head_dim, run.model.d_ff) == (64, 704)
    assert run.model == run.model.override({})  # and an explicit size stays put
    pinned = RunConfig().override({"model.d_ff": 100}).override({"model.d_model": 256})
    assert pinned.model.d_ff == 100


def test_moe_balances_by_default_and_off_is_explicit():
    """Any MoE trains with the presets' balance loss (DEFAULT_BALANCE) unless another term balances it; no balancing
    at all is asked for with expert_balance_coef=0. The default follows the other terms through overrides."""
    from lmlab.config import DEFAULT_BALANCE

    on = MoEConfig(n_experts=4, top_k=2)
    assert on.expert_balance_coef == DEFAULT_BALANCE == 0.01 and on.balancing == ["expert_balance_coef=0.01"]
    for other in ("load_balance_coef", "device_balance_coef", "bias_update_rate"):
        moe = MoEConfig(n_experts=4, top_k=2, n_groups=2, **{other: 1e-3})
        assert moe.expert_balance_coef == 0.0 and moe.balancing == [f"{other}=0.001"]
    off = MoEConfig(n_experts=4, top_k=2, expert_balance_coef=0)
    assert off.expert_balance_coef == 0.0 and off.balancing == []
    assert off.override({"n_experts": 8}).balancing == []  # an explicit 0 stays 0
    assert on.override({"bias_update_rate": 1e-3}).expert_balance_coef == 0.0  # the default follows
    # turned on field by field, as --model.moe.* does
    model = ModelConfig(n_layers=2).override({"moe.n_experts": 4, "moe.bias_update_rate": 1e-3})
    assert model.moe.balancing == ["bias_update_rate=0.001"]
    assert MoEConfig.from_dict(on.to_dict()) == on and on.to_dict()["expert_balance_coef"] == 0.01  # saved explicit
