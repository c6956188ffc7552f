"""The package surface: the names ``lmlab`` exports, where the moved ones live, and the typing marker."""

from __future__ import annotations

from importlib import resources

import lmlab
import lmlab.config
import lmlab.hf


def test_public_names_are_exported():
    assert set(lmlab.__all__) == {
        "IGNORE_INDEX", "KVCache", "LMOutput", "ModelConfig", "MoEConfig", "PRESETS", "RopeConfig",
        "SequenceClassifier", "Transformer", "__version__", "from_hf", "to_hf",
        "load_run", "read_metrics",  # a run read back (lmlab.run), loaded on first use
    }
    assert all(hasattr(lmlab, name) for name in lmlab.__all__)
    assert lmlab.MoEConfig is lmlab.config.MoEConfig  # the MoE config lives with the other configs
    assert set(lmlab.config.MOE_PRESETS) <= set(lmlab.PRESETS)


def test_hf_families_register_on_import():
    assert set(lmlab.hf.FAMILIES) == {
        "llama", "mistral", "qwen2", "gpt2", "mixtral", "qwen2_moe", "glm4_moe", "deepseek_v2", "deepseek_v3", "qwen3",
        "qwen3_moe", "olmo2", "olmoe", "smollm3", "gemma3_text", "gpt_oss", "deepseek_v4", "deepseek_v32",
        "glm4_moe_lite", "olmo3", "exaone4", "minimax_m2", "ernie4_5_moe", "seed_oss", "hunyuan_v1_moe",
    }
    writes = [name for name, family in lmlab.hf.FAMILIES.items() if family.export is not None]
    assert writes == [  # preference order
        "llama", "mistral", "qwen2", "seed_oss", "gpt2", "mixtral", "qwen2_moe", "glm4_moe", "minimax_m2",
        "ernie4_5_moe", "hunyuan_v1_moe", "deepseek_v2", "deepseek_v3", "deepseek_v4", "deepseek_v32", "glm4_moe_lite",
        "gemma3_text", "gpt_oss", "smollm3", "olmo2", "olmoe", "olmo3", "exaone4", "qwen3", "qwen3_moe",
    ]


def test_package_ships_its_typing_marker():
    assert resources.files("lmlab").joinpath("py.typed").is_file()  # PEP 561; pyproject lists it as package data
