"""Export over the whole grid of design choices: every choice of every field with named choices (a ``Literal``,
a tuple of them, or a bool), in the model config and each config nested in it (rope, attention, moe, mla, mtp
where the base has them), over the llama, qwen3, gpt2 and deepseek-v3 presets. Each tiny random model is
either refused by ``to_hf``, in one line, writing nothing, or exported and read back by ``transformers`` and by
``lmlab.from_hf`` with its own logits. A choice that makes the config invalid (ValueError at construction) is
not a model, and counts as neither.

The grid is read from the config classes, so a choice added to any of these fields joins it by itself: it
fails here until it is refused or some architecture computes it exactly."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Iterator

import pytest
import torch
from test_export import load_hf, logits, randomized, relative_difference

import lmlab
from lmlab import ModelConfig, Transformer
from lmlab.hf import to_hf
from lmlab.schema import Config

V = 64  # vocabulary
TINY = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, init_std=0.2)
# preset -> its tiny form; deepseek-v3 keeps its routing (sigmoid, groups, a shared expert, the first layer dense)
# and its latent attention, at small widths
BASES: dict[str, dict[str, Any]] = {
    "llama": dict(TINY, n_kv_heads=2),
    "qwen3": dict(TINY, n_kv_heads=2),
    "gpt2": dict(TINY),
    "deepseek-v3": dict(TINY, **{
        "mla.q_lora_rank": 16, "mla.kv_lora_rank": 16, "mla.qk_nope_head_dim": 8, "mla.qk_rope_head_dim": 4,
        "mla.v_head_dim": 8, "moe.n_experts": 8, "moe.top_k": 2, "moe.n_groups": 4, "moe.topk_groups": 2,
        "moe.d_expert": 16,
    }),
}
# (field, choice) -> the other fields that make the choice a model worth comparing: a rotary scaling with a
# factor that changes the angles, a local layer with a window shorter than the context, DeepNorm with the
# post-norm it needs, the clamped unit and the offset gain with what they are forms of
COMPANIONS: dict[tuple[str, Any], dict[str, Any]] = {
    **{("rope.scaling", s): {"rope.factor": 4.0} for s in ("linear", "ntk", "dynamic", "yarn", "llama3")},
    ("attention.pattern", ("local",)): {"attention.window": 4},
    ("residual_scaling", "deepnorm"): {"norm_position": "post"},
    ("glu_variant", "clamped"): {"ffn": "glu"},
    ("norm_gain", "offset"): {"norm": "rmsnorm"},
}


def base_config(preset: str) -> ModelConfig:
    fields = BASES[preset]
    flat = {k: v for k, v in fields.items() if "." not in k}
    return ModelConfig.from_preset(preset, **flat).override({k: v for k, v in fields.items() if "." in k})


def choices_of(hint: Any) -> tuple | None:
    """The choices of a field with named choices: a Literal's values, both truth values, or for a tuple of
    Literals (``attention.pattern``) each value alone; None for any other field."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]  # Optional[X] -> X
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    if hint is bool:
        return (False, True)
    if typing.get_origin(hint) is tuple and typing.get_origin(typing.get_args(hint)[0]) is typing.Literal:
        return tuple((c,) for c in typing.get_args(typing.get_args(hint)[0]))
    return None


def choice_fields(cfg: Config, prefix: str = "") -> Iterator[tuple[str, tuple]]:
    """(dotted field, its choices) for every field of ``cfg`` with named choices, nested configs that are set
    included."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value, path = getattr(cfg, f.name), prefix + f.name
        if isinstance(value, Config):
            yield from choice_fields(value, f"{path}.")
        elif (choices := choices_of(hints[f.name])) is not None:
            yield path, choices


def value_at(cfg: Config, path: str) -> Any:
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def grid() -> Iterator[Any]:
    for preset in BASES:
        base = base_config(preset)
        yield pytest.param(preset, {}, id=f"{preset}-as-is")
        for path, choices in choice_fields(base):
            for choice in choices:
                if choice != value_at(base, path):
                    shown = ",".join(choice) if isinstance(choice, tuple) else choice
                    yield pytest.param(preset, {path: choice, **COMPANIONS.get((path, choice), {})},
                                       id=f"{preset}-{path}={shown}")


def context(cfg: ModelConfig) -> int:
    # past max_seq_len where rotary allows it: dynamic scaling acts only there, the others extrapolate
    return cfg.max_seq_len + 8 if cfg.positions == "rope" else cfg.max_seq_len


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # GLM-4-MoE's width-0 shared FFN
@pytest.mark.parametrize("preset, change", list(grid()))
def test_every_choice_is_refused_or_exported_exactly(tmp_path, preset, change):
    try:
        cfg = base_config(preset).override(change)
    except ValueError:
        pytest.skip("not constructible: the config refuses this combination")
    model = randomized(Transformer(cfg).eval())
    out = tmp_path / "out"
    try:
        done = to_hf(model, out)
    except ValueError as refused:
        assert str(refused).startswith("cannot export") and "\n" not in str(refused)
        assert not out.exists() and list(tmp_path.iterdir()) == []
        return
    idx = torch.randint(0, V, (2, context(cfg)), generator=torch.Generator().manual_seed(0))
    ours = logits(model, idx)
    hf = load_hf(done.path)
    assert type(hf).__name__ == lmlab.hf.FAMILIES[done.model_type].export.architecture
    theirs = logits(hf, idx)
    assert ours.std() > 0.1, "the logits are near constant; the comparison would prove little"
    assert relative_difference(theirs, ours)[1] <= 1e-4, f"exported as {done.model_type}, transformers differs"
    assert relative_difference(logits(lmlab.from_hf(done.path), idx), ours)[1] <= 1e-5, "read back, lmlab differs"
