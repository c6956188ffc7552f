"""Sliding-window families both ways: Mistral (every layer slides) and Qwen2 (layers from
max_window_layers slide), tiny random models built here, logits compared over a sequence several
windows long, and the decode cache of a loaded model against transformers' full forward."""

from __future__ import annotations

import pytest
import torch
from test_export import load_hf, relative_difference
from test_hf import LLAMA, assert_parity, logits, randomize_, saved, tokens

import lmlab
from lmlab.hf import to_hf

transformers = pytest.importorskip("transformers")
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

W = 5  # the window; sequences of 20 tokens cross it four times
T = 20

HF_MODELS = {
    "mistral": lambda: MistralForCausalLM(MistralConfig(**LLAMA, sliding_window=W)),
    "qwen2_upper_layers_slide": lambda: Qwen2ForCausalLM(Qwen2Config(
        **{**LLAMA, "num_hidden_layers": 3}, use_sliding_window=True, sliding_window=W, max_window_layers=1)),
    "qwen2_layer_types": lambda: Qwen2ForCausalLM(Qwen2Config(
        **{**LLAMA, "num_hidden_layers": 3}, use_sliding_window=True, sliding_window=W,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}
PATTERNS = {"mistral": ("local",), "qwen2_upper_layers_slide": ("global", "local", "local"),
            "qwen2_layer_types": ("local", "global")}  # the shortest pattern that repeats to the layers


@pytest.mark.parametrize("case", HF_MODELS)
def test_sliding_window_checkpoint_matches_transformers_both_ways(tmp_path, case):
    hf = randomize_(HF_MODELS[case]())
    ours = lmlab.from_hf(saved(hf, tmp_path / "hf"))
    assert ours.config.attention.window == W and ours.config.attention.pattern == PATTERNS[case]
    idx = tokens(T)
    ref = logits(hf, idx)
    assert_parity(logits(ours, idx), ref)
    # the window is what makes them agree: the same weights with full attention differ
    full = lmlab.Transformer(ours.config.replace(attention=lmlab.config.AttentionConfig())).eval()
    full.load_state_dict(ours.state_dict())
    assert not torch.allclose(logits(full, idx), ref, atol=1e-2)
    # and back: lmlab -> transformers gives the same logits again
    to_hf(ours, tmp_path / "out", architecture=case.split("_")[0])
    back = load_hf(tmp_path / "out")
    assert type(back) is type(hf)
    _, relative = relative_difference(logits(back, idx), ref)
    assert relative <= 1e-4


@pytest.mark.parametrize("case", ["mistral", "qwen2_layer_types"])
def test_cached_decoding_of_a_sliding_checkpoint_equals_transformers_full_forward(tmp_path, case):
    hf = randomize_(HF_MODELS[case]())
    ours = lmlab.from_hf(saved(hf, tmp_path))
    idx = tokens(T, seed=1)
    cache = ours.new_cache(2, T)
    with torch.no_grad():
        parts = [ours(idx[:, :7], cache=cache).logits] + [ours(idx[:, t : t + 1], cache=cache).logits
                                                         for t in range(7, T)]
    assert_parity(torch.cat(parts, dim=1), logits(hf, idx))


def test_left_padded_batch_matches_transformers(tmp_path):
    """transformers' sliding mask counts cache slots; lmlab's counts positions: with left padding
    they agree on every real token."""
    hf = randomize_(HF_MODELS["mistral"]())
    ours = lmlab.from_hf(saved(hf, tmp_path))
    idx = tokens(T, seed=2)
    mask = torch.ones_like(idx)
    mask[0, :6] = 0
    with torch.no_grad():
        ref = hf(idx, attention_mask=mask).logits
        got = ours(idx, attention_mask=mask).logits
    real = mask.bool()
    assert_parity(got[real], ref[real])
