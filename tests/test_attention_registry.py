"""The attention registry (``attention.variant``): a variant is one class, one line in each registry and one config
value. A toy variant registered here, from the test alone, builds, trains, decodes with its cache and is refused by
export by name; docs/design.md's "Add a variant" walk-through names files that hold what it says they hold;
configs written before the field (a top-level ``mla`` section) mean what they meant, with the same identity."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from lmlab import model as model_module
from lmlab.attention import Attention
from lmlab.attention_variants import ATTENTION_VARIANTS, StandardVariant, variant_of
from lmlab.config import MLAConfig, ModelConfig
from lmlab.hf import to_hf
from lmlab.memory import kv_cache_bytes, parameter_count, parameter_floor
from lmlab.model import ATTENTIONS, Transformer

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=32)
MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)


class ToyAttention(Attention):
    """Scores -|q - k|^2 scale / 2 in place of q·k scale: a distance kernel, which the fused kernel does not
    compute (so the explicit path does). Standard attention's parameters, cache and facts otherwise."""

    fused = False

    def scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return -0.5 * (q[..., :, None, :] - k[..., None, :, :]).pow(2).sum(-1) * self.scale  # (B, H, T, S)


@pytest.fixture
def toy(monkeypatch):
    """The toy variant, registered for one test: its facts are standard attention's."""
    monkeypatch.setitem(ATTENTION_VARIANTS, "toy", StandardVariant())
    monkeypatch.setitem(model_module.ATTENTIONS, "toy", ToyAttention)
    return ModelConfig(**TINY, n_kv_heads=2, attention=dict(variant="toy"))  # grouped-query, as standard


def test_a_variant_registered_from_a_test_builds_and_computes_its_own_scores(toy):
    model = Transformer(toy)
    assert all(type(b.attn) is ToyAttention and b.attn.impl == "explicit" for b in model.blocks)
    assert toy.attention_variant == "toy" and toy.attention.variant == "toy"
    assert ModelConfig.from_yaml(toy.to_yaml()) == toy and toy.identity_dict()["attention"] == {"variant": "toy"}
    standard = Transformer(ModelConfig(**TINY, n_kv_heads=2))
    standard.load_state_dict(model.state_dict())  # the same parameters: only the score differs
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(model(idx).logits, standard(idx).logits, atol=1e-4)
    with pytest.raises(ValueError, match="cannot compute ToyAttention's scores"):
        model.set_attention_impl("sdpa")


def test_the_toy_variant_trains_a_step(toy):
    model = Transformer(toy)
    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    targets = idx.roll(-1, dims=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(idx, targets=targets).loss
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    optimizer.step()
    assert model(idx, targets=targets).loss < loss


def test_the_toy_variant_decodes_with_its_cache_equal_to_the_full_forward(toy):
    model = Transformer(toy).eval()
    idx = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(batch_size=2, max_len=10)
    steps = [model(idx[:, :6], cache=cache).logits] + [model(idx[:, t : t + 1], cache=cache).logits
                                                        for t in range(6, 10)]
    torch.testing.assert_close(torch.cat(steps, dim=1), model(idx).logits, rtol=1e-5, atol=1e-5)


def test_export_refuses_the_toy_variant_by_name(toy, tmp_path):
    with pytest.raises(ValueError, match=r"^cannot export: attention.variant='toy' has no exact transformers"):
        to_hf(Transformer(toy), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_a_name_not_registered_is_refused_where_it_is_missing(monkeypatch):
    with pytest.raises(ValueError, match=r"attention.variant='toy' is not a registered variant; choose one of"):
        ModelConfig(**TINY, attention=dict(variant="toy"))
    with pytest.raises(ValueError, match=r"attention.variant='mlaa' is not a registered variant \(did you mean 'mla'"):
        ModelConfig(**TINY, attention=dict(variant="mlaa"))
    monkeypatch.setitem(ATTENTION_VARIANTS, "facts-only", StandardVariant())
    with pytest.raises(ValueError, match="has no module in lmlab.model.ATTENTIONS; register the nn.Module"):
        Transformer(ModelConfig(**TINY, attention=dict(variant="facts-only")))


def test_both_registries_name_the_same_variants():
    assert set(ATTENTION_VARIANTS) == set(ATTENTIONS) == {"standard", "mla", "dsa", "compressed"}


# ============================================================== old configs, one model one config
def test_a_top_level_mla_section_still_means_latent_attention_with_the_same_identity():
    old = ModelConfig.from_yaml("vocab_size: 64\nd_model: 32\nn_heads: 4\nmla:\n  kv_lora_rank: 16\n")
    assert old.attention_variant == "mla" and old.attention.variant is None
    assert "attention" not in old.identity_dict()  # as before the field existed: the run keeps its hash
    assert ModelConfig.from_yaml(old.to_yaml()) == old
    preset = ModelConfig.from_preset("deepseek-v3")
    assert preset.attention_variant == "mla" and "attention" not in preset.identity_dict()


def test_naming_the_variant_the_sections_imply_is_the_same_config():
    named = ModelConfig(**TINY, attention=dict(variant="mla"))  # the section is filled with its defaults
    assert named == ModelConfig(**TINY, mla=MLAConfig()) and named.attention.variant is None
    assert named.identity_dict() == ModelConfig(**TINY, mla=MLAConfig()).identity_dict()
    assert ModelConfig(**TINY, attention=dict(variant="standard")) == ModelConfig(**TINY)
    assert ModelConfig(**TINY, mla=MLA).override({"mla": None}).attention_variant == "standard"


def test_a_section_of_another_variant_is_refused():
    with pytest.raises(ValueError, match=r"mla holds the parameters of attention.variant='mla', and this model's "
                                         r"variant is 'standard'; set mla=null or attention.variant='mla'"):
        ModelConfig(**TINY, mla=MLA, attention=dict(variant="standard"))
    with pytest.raises(ValueError, match=r"parametrization='mup' with attention.variant='mla' is not implemented"):
        ModelConfig(**TINY, mla=MLA, parametrization="mup")


# ============================================================== the variant's facts are what the model holds
@pytest.mark.parametrize("fields", [dict(TINY, n_kv_heads=2), dict(TINY, mla=MLA)], ids=["standard", "mla"])
def test_the_variants_facts_are_the_cache_and_the_parameters_the_model_has(fields):
    cfg = ModelConfig(**fields)
    model = Transformer(cfg)
    cache = model.new_cache(batch_size=3, max_len=7)
    heads, key_width, value_width = variant_of(cfg).cache_widths(cfg)
    assert cache.k.shape == (cfg.n_layers, 3, heads, 7, key_width) and cache.v.shape[-1] == value_width
    assert kv_cache_bytes(cfg, 3, 7) == (cache.k.numel() + cache.v.numel()) * 4
    assert parameter_floor(cfg) <= parameter_count(cfg) == model.num_params()["total"]
    assert variant_of(cfg).widths(cfg) == cfg.attention_widths


def test_no_module_branches_on_the_mla_section():
    """The variant is chosen once, by the registries: the model files read the mla section only in mla.py and
    attention_variants.py (MLA's own facts)."""
    for name in ("config.py", "model.py", "memory.py", "attention.py", "positions.py"):
        text = (ROOT / "src" / "lmlab" / name).read_text()
        assert not re.search(r"\b(cfg|self)\.mla\b", text), f"{name} branches on the mla section"


# ============================================================== the walk-through
def walk_through() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Add a variant")[1].split("\n## ")[0]
    return re.findall(r"^\d+\. `([\w/.]+)` holds `([^`]+)`", section, flags=re.M)


def test_the_walk_through_names_files_that_hold_what_it_says():
    steps = walk_through()
    sources = [path for path, _ in steps if path.startswith("src/")]
    assert len(sources) == 3 and steps[-1][0] == f"tests/{Path(__file__).name}", steps
    for path, holds in steps:
        text = (ROOT / path).read_text()
        if holds.startswith("class "):
            assert re.search(rf"^{re.escape(holds)}", text, flags=re.M), f"{path} has no {holds}"
        else:  # a registry: defined there, and naming every variant
            assert re.search(rf"^{holds}(: [^=]+)? = ", text, flags=re.M), f"{path} does not define {holds}"
            assert all(f'"{name}"' in text for name in ATTENTION_VARIANTS), f"{path}'s {holds} misses a variant"
