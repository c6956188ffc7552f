"""Export to Hugging Face ``transformers``: lmlab -> to_hf -> AutoModelForCausalLM gives the same
logits for every supported family; HF -> from_hf -> to_hf gives back the same tensors and config;
every variant without an exact architecture is refused by its message, writing nothing; the
directory appears whole or not at all; tokenizers and special tokens agree with lmlab's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import lmlab
from lmlab import ModelConfig, Transformer
from lmlab.config import DEFAULT_BALANCE
from lmlab.hf import config_from_hf, hf_config, hf_tensors, read_safetensors, to_hf

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

V = 97  # vocabulary
BASE = dict(vocab_size=V, d_model=48, n_layers=2, n_heads=4, max_seq_len=32, init_std=0.2)
MOE = dict(n_experts=4, top_k=2, d_expert=16)


def lm(preset: str | None = None, *, seed: int = 0, **fields) -> Transformer:
    """A tiny lmlab model with random weights: N(0, 0.2), norm gains 1 + N(0, 0.2), selection
    biases N(0, 0.3), so a wrong mapping, layout or routing changes the logits."""
    nested = {k: v for k, v in fields.items() if "." in k}
    flat = {**BASE, **{k: v for k, v in fields.items() if "." not in k}}
    cfg = ModelConfig.from_preset(preset, **flat) if preset else ModelConfig(**flat)
    return randomized(Transformer(cfg.override(nested) if nested else cfg).eval(), seed)


def randomized(model: Transformer, seed: int = 0) -> Transformer:
    """``model`` with the random weights of :func:`lm`, in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            gain = p.ndim == 1 and "norm" in name and name.endswith("weight")
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if gain else 0.0))
        if model.config.moe is not None and model.config.moe.scoring == "sigmoid":
            for layer in model.moe_layers:  # a trained correction bias: it changes which experts are chosen
                layer.router.score_bias.copy_(torch.randn(layer.router.score_bias.shape, generator=g) * 0.3)
    return model


def tokens(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (2, length), generator=torch.Generator().manual_seed(seed))


def logits(model, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx).logits


def load_hf(path: Path):
    """AutoModelForCausalLM.from_pretrained, requiring that every tensor was used and none missing."""
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info  # missing, unexpected, mismatched keys, errors
    return model.eval()


def assert_exports_and_reads_back(model: Transformer, out: Path, family: str, idx: torch.Tensor,
                                  min_std: float = 0.5) -> Transformer:
    """``model`` exports as ``family`` (the first that fits) to ``out``; transformers reads it back, as that
    family's class, with the model's logits on ``idx`` within 1e-4 of the largest, and ``lmlab.from_hf``
    within 1e-5. ``min_std``: logits spread less are too flat to prove much. Returns what from_hf read."""
    done = to_hf(model, out)
    assert done.model_type == family
    hf = load_hf(done.path)
    assert type(hf).__name__ == lmlab.hf.FAMILIES[family].export.architecture
    ref, theirs = logits(model, idx), logits(hf, idx)
    assert theirs.std() > min_std, "reference logits are near constant; the comparison would prove little"
    assert relative_difference(theirs, ref)[1] <= 1e-4
    back = lmlab.from_hf(done.path)
    assert relative_difference(logits(back, idx), ref)[1] <= 1e-5
    return back


def relative_difference(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |ours - ref|, that divided by max |ref|)."""
    diff = float((ours - ref).abs().max())
    return diff, diff / float(ref.abs().max())


# ================================================================== lmlab -> transformers: same logits
# name -> (preset or None, fields, the architecture chosen)
LMLAB_CASES = {
    "llama_gqa": (None, dict(n_kv_heads=2), "llama"),
    "llama_odd_heads_head_dim": (None, dict(n_heads=3, n_kv_heads=1, head_dim=10), "llama"),
    "llama_five_heads": (None, dict(d_model=40, n_heads=5), "llama"),
    "llama_tied_biases": (None, dict(tie_embeddings=True, bias=True, n_kv_heads=2), "llama"),
    "llama_interleaved_rope": (None, {"n_kv_heads": 2, "rope.layout": "interleaved"}, "llama"),
    "llama_gelu_tanh": (None, dict(activation="gelu_tanh", d_ff=72), "llama"),
    "llama_relu": (None, dict(activation="relu"), "llama"),
    "rope_linear": (None, {"rope.base": 50000.0, "rope.scaling": "linear", "rope.factor": 2.0}, "llama"),
    "rope_ntk": (None, {"rope.scaling": "ntk", "rope.factor": 4.0}, "llama"),
    "rope_dynamic": (None, {"rope.scaling": "dynamic", "rope.factor": 2.0}, "llama"),
    "rope_yarn": (None, {"rope.scaling": "yarn", "rope.factor": 4.0, "rope.original_max_seq_len": 8}, "llama"),
    "rope_yarn_deepseek": (None, {
        "rope.scaling": "yarn", "rope.factor": 4.0, "rope.original_max_seq_len": 8, "rope.beta_fast": 16.0,
        "rope.beta_slow": 2.0, "rope.mscale": 0.707, "rope.mscale_all_dim": 1.0, "rope.truncate": False,
    }, "llama"),
    "rope_yarn_attention_factor": (None, {"rope.scaling": "yarn", "rope.factor": 4.0, "rope.attention_factor": 1.25},
                                   "llama"),
    "rope_llama3": (None, {
        "rope.base": 500000.0, "rope.scaling": "llama3", "rope.factor": 8.0, "rope.original_max_seq_len": 8,
    }, "llama"),
    "mistral": (None, dict(n_kv_heads=2, head_dim=16, **{"rope.scaling": "yarn", "rope.factor": 2.0}), "mistral"),
    "qwen2": (None, dict(qkv_bias=True, n_kv_heads=2, head_dim=16, tie_embeddings=True), "qwen2"),
    "gpt2_tied": ("gpt2", {}, "gpt2"),
    "gpt2_untied_relu": ("gpt2", dict(tie_embeddings=False, activation="relu", d_ff=72, n_heads=3), "gpt2"),
    "gpt2_gelu": ("gpt2", dict(activation="gelu", norm_eps=1e-3), "gpt2"),
    "mixtral": ("mixtral", dict(n_kv_heads=2, moe=MOE | dict(normalize_top_k=True)), "mixtral"),
    "mixtral_fine_grained": (
        "mixtral", dict(n_kv_heads=1, head_dim=16, moe=dict(n_experts=4, top_k=2, granularity=2, d_expert=32,
                                                             normalize_top_k=True)), "mixtral"),
    "qwen2_moe_shared_any_width": (None, dict(
        n_layers=3, qkv_bias=True, n_kv_heads=2,
        moe=MOE | dict(n_shared=1, shared_d_ff=24, shared_gate="sigmoid", every=2)), "qwen2_moe"),
    "qwen2_moe_whole_shared": (None, dict(
        n_layers=3, tie_embeddings=True, moe=MOE | dict(n_shared=2, shared_gate="sigmoid", normalize_top_k=True,
                                                        every=2, first_dense=1)), "qwen2_moe"),
    "glm4_moe_deepseek_v3": ("deepseek-v3", dict(n_layers=3, n_kv_heads=2, mla=None, moe=dict(
        n_experts=8, top_k=2, n_shared=1, d_expert=16, first_dense=1, scoring="sigmoid", normalize_top_k=True,
        routed_scale=2.5, n_groups=4, topk_groups=2, group_score="top2", bias_update_rate=1e-3)), "glm4_moe"),
    "glm4_moe_no_shared": (None, dict(
        qkv_bias=True, head_dim=16, tie_embeddings=True,
        moe=MOE | dict(scoring="sigmoid", n_groups=2, first_dense=1)), "glm4_moe"),
}


ASKED = {"mistral": "mistral"}  # cases that name their architecture (llama, first in order, also fits)


def lmlab_case(name: str) -> tuple[Transformer, str]:
    preset, fields, architecture = LMLAB_CASES[name]
    return lm(preset, **fields), architecture


def context_length(cfg: ModelConfig) -> int:
    # past max_seq_len where it can: dynamic scaling is then active and the other types extrapolate
    return cfg.max_seq_len + 8 if cfg.positions == "rope" else cfg.max_seq_len


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # GLM-4-MoE's width-0 shared FFN
@pytest.mark.parametrize("case", LMLAB_CASES)
def test_exported_model_gives_the_same_logits_in_transformers(tmp_path, case):
    model, architecture = lmlab_case(case)
    done = to_hf(model, tmp_path / "out", architecture=ASKED.get(case))
    assert done.model_type == architecture
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == architecture and config["eos_token_id"] is None
    hf = load_hf(tmp_path / "out")
    assert type(hf).__name__ == config["architectures"][0]
    idx = tokens(context_length(model.config))
    ours, ref = logits(model, idx), logits(hf, idx)
    assert ref.std() > 0.5, "reference logits are near constant; the comparison would prove little"
    _, relative = relative_difference(ours, ref)
    assert relative <= 1e-4


def test_the_scaling_and_layout_cases_would_fail_if_ignored(tmp_path):
    """The rope cases above test something: the same weights without the scaling, or without
    converting the interleaved layout, give different logits."""
    for case, without in [("rope_yarn", {"rope.scaling": "none"}), ("rope_ntk", {"rope.scaling": "none"}),
                          ("llama_interleaved_rope", {"rope.layout": "half"})]:
        model, _ = lmlab_case(case)
        plain = Transformer(model.config.override(without)).eval()
        plain.load_state_dict(model.state_dict())
        idx = tokens(context_length(model.config))
        assert not torch.allclose(logits(plain, idx), logits(model, idx), atol=1e-2), case


def test_every_lmlab_preset_exports_or_is_refused_by_name(tmp_path):
    """The presets: llama, gpt2, mixtral, deepseek-v3 (with MLA), qwen3, olmo2, gemma3, gpt-oss, deepseek-v4 export; the
    others name what has no equivalent."""
    refused = {
        "vaswani2017": "norm_position='post'", "switch": "moe.capacity_factor=1.25",
        "gshard": "moe.second_expert='random'", "deepseekmoe": "glm4_moe: moe.scoring='softmax'",
    }
    for preset in lmlab.PRESETS:
        model = Transformer(ModelConfig.from_preset(preset, **{**BASE, "n_layers": 2}))
        if preset in refused:
            with pytest.raises(ValueError, match=refused[preset].replace("(", r"\(").replace(".", r"\.")):
                to_hf(model, tmp_path / preset)
        else:
            assert to_hf(model, tmp_path / preset).model_type == {
                "llama": "llama", "gpt2": "gpt2", "mixtral": "mixtral", "deepseek-v3": "deepseek_v3", "qwen3": "qwen3",
                "olmo2": "olmo2", "gemma3": "gemma3_text", "gpt-oss": "gpt_oss", "deepseek-v4": "deepseek_v4"}[preset]


@pytest.mark.parametrize("preset, family", [("gemma3", "gemma3_text"), ("gpt-oss", "gpt_oss")])
def test_the_newer_family_presets_train_a_step_export_and_read_back(tmp_path, preset, family):
    """Each preset of issue 23's families, at a tiny size: one optimizer step, then the trained model exports as
    its family; transformers and lmlab.from_hf read it back with its logits."""
    cfg = ModelConfig.from_preset(preset, vocab_size=V, d_model=64, n_heads=4, head_dim=16, max_seq_len=32,
                                  **{"attention.window": 8})
    model = Transformer(cfg)
    idx = tokens(24)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = model(idx, targets=idx.roll(-1, 1)).loss
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and all(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert_exports_and_reads_back(model.eval(), tmp_path / "out", family, idx, min_std=0.05)  # N(0, 0.02) init


def test_a_preset_no_family_computes_is_refused_with_the_field_to_set(tmp_path):
    """deepseekmoe's ungated shared expert has no transformers family: the refusal names the one-field changes
    that give one (each checked), and the model with that change exports as that family."""
    model = Transformer(ModelConfig.from_preset("deepseekmoe", **{**BASE, "n_layers": 2}))
    with pytest.raises(ValueError) as refused:
        to_hf(model, tmp_path / "as-is")
    assert str(refused.value).endswith("; to export, train with --model.moe.shared_gate sigmoid for qwen2_moe or "
                                       "--model.moe.scoring sigmoid for glm4_moe or --model.moe.normalize_top_k true "
                                       "for ernie4_5_moe")
    assert not (tmp_path / "as-is").exists()
    for field, value, family in (("moe.shared_gate", "sigmoid", "qwen2_moe"), ("moe.scoring", "sigmoid", "glm4_moe"),
                                 ("moe.normalize_top_k", True, "ernie4_5_moe")):
        changed = Transformer(model.config.override({field: value}))
        assert to_hf(changed, tmp_path / family).model_type == family


def test_a_model_with_multi_token_prediction_is_refused_rather_than_exported_without_its_mtp_weights(tmp_path):
    model = Transformer(ModelConfig.from_preset("llama", **{**BASE, "n_layers": 2}).override({"mtp.depth": 1}))
    with pytest.raises(ValueError, match=r"^cannot export: mtp.depth=1: no transformers architecture holds"):
        to_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ================================================================== transformers -> lmlab -> transformers
def randomized_hf(model, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            gain = p.ndim == 1 and name.endswith("weight") and ("norm" in name or ".ln_" in name)
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if gain else 0.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    return model.eval()


LLAMA = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, bos_token_id=None, eos_token_id=None)
MOE_LAYOUT = dict(LLAMA, hidden_size=32, intermediate_size=48, num_hidden_layers=3)
# name -> (transformers config class name, its arguments)
HF_CASES = {
    "llama": ("LlamaConfig", dict(LLAMA, head_dim=32, tie_word_embeddings=True)),
    "llama_biases_yarn": ("LlamaConfig", dict(
        LLAMA, attention_bias=True, mlp_bias=True, num_attention_heads=3, num_key_value_heads=1, hidden_size=48,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                         "rope_theta": 1e4})),
    "llama_llama3": ("LlamaConfig", dict(LLAMA, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8, "rope_theta": 5e5})),
    "mistral": ("MistralConfig", dict(LLAMA, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(LLAMA, tie_word_embeddings=True)),
    "gpt2": ("GPT2Config", dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=24, bos_token_id=None,
                                eos_token_id=None)),
    "gpt2_untied": ("GPT2Config", dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=24, n_inner=40,
                                       activation_function="relu", tie_word_embeddings=False, bos_token_id=None,
                                       eos_token_id=None)),
    "mixtral": ("MixtralConfig", dict(MOE_LAYOUT, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        MOE_LAYOUT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        decoder_sparse_step=2, norm_topk_prob=True)),
    "qwen2_moe_mlp_only": ("Qwen2MoeConfig", dict(
        MOE_LAYOUT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32,
        mlp_only_layers=[0], qkv_bias=False)),
    "glm4_moe": ("Glm4MoeConfig", dict(
        MOE_LAYOUT, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, attention_bias=True,
        partial_rotary_factor=1.0, num_nextn_predict_layers=0)),
}
# what differs after a round trip: the path, and GPT-2's dropouts, which from_hf does not read (a
# loaded model trains without dropout unless told), so the export writes lmlab's 0
NOT_THE_MODEL = {"_name_or_path", "resid_pdrop", "embd_pdrop", "attn_pdrop"}


def hf_round_trip(tmp_path: Path, case: str):
    config_class, kwargs = HF_CASES[case]
    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(0)
    original = randomized_hf(AutoModelForCausalLM.from_config(config))
    original.save_pretrained(tmp_path / "original")
    ours = lmlab.from_hf(tmp_path / "original")
    done = to_hf(ours, tmp_path / "exported", architecture=config.model_type)
    return original, done


@pytest.mark.parametrize("case", HF_CASES)
def test_hf_checkpoint_through_lmlab_comes_back_identical(tmp_path, case):
    original, done = hf_round_trip(tmp_path, case)
    a, b = load_file(tmp_path / "original" / "model.safetensors"), read_safetensors(done.path)
    assert sorted(a) == sorted(b)
    unequal = [name for name in a if a[name].dtype != b[name].dtype or not torch.equal(a[name], b[name])]
    assert not unequal
    before, after = (json.loads((p / "config.json").read_text()) for p in (tmp_path / "original", done.path))
    assert config_from_hf(after) == config_from_hf(before)
    hf_before, hf_after = (AutoConfig.from_pretrained(p).to_dict() for p in (tmp_path / "original", done.path))
    differ = {k for k in hf_before.keys() | hf_after.keys() if hf_before.get(k) != hf_after.get(k)} - NOT_THE_MODEL
    assert not differ, {k: (hf_before.get(k), hf_after.get(k)) for k in differ}
    idx = tokens(24)
    assert torch.equal(logits(load_hf(done.path), idx), logits(original, idx))


def test_config_and_tensors_without_writing(tmp_path):
    """hf_config and hf_tensors: what to_hf writes, in memory (e.g. to build a transformers model)."""
    model, _ = lmlab_case("qwen2_moe_shared_any_width")
    done = to_hf(model, tmp_path / "out")
    written = read_safetensors(done.path)
    tensors = hf_tensors(model)
    assert sorted(tensors) == sorted(written) and all(torch.equal(tensors[k], written[k]) for k in written)
    assert hf_config(model.config) == json.loads((done.path / "config.json").read_text())
    config = transformers.Qwen2MoeConfig.from_dict(hf_config(model.config))
    assert (config.decoder_sparse_step, config.mlp_only_layers, config.shared_expert_intermediate_size) == (1, [1], 24)


def test_router_options_both_ways(tmp_path):
    """norm_topk_prob <-> moe.normalize_top_k (above); router_aux_loss_coef and output_router_logits
    only set transformers' training loss, which pools router statistics over all layers (no lmlab
    coefficient equals it): a checkpoint with them loads, balancing off, and exports with
    output_router_logits false; router_jitter_noise (training-time input noise) is refused unless 0."""
    from transformers import MixtralConfig

    config = MixtralConfig(**dict(MOE_LAYOUT, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
                                  output_router_logits=True))
    original = randomized_hf(AutoModelForCausalLM.from_config(config))
    original.save_pretrained(tmp_path / "original")
    ours = lmlab.from_hf(tmp_path / "original")
    moe = ours.config.moe
    # router_aux_loss_coef (0.02) is not mapped: a loaded MoE balances with lmlab's default, as any MoE does
    assert (moe.load_balance_coef, moe.expert_balance_coef, moe.z_loss_coef) == (0.0, DEFAULT_BALANCE, 0.0)
    written = json.loads((to_hf(ours, tmp_path / "out").path / "config.json").read_text())
    assert (written["output_router_logits"], written["router_jitter_noise"]) == (False, 0.0)
    assert "router_aux_loss_coef" not in written
    with pytest.raises(ValueError, match="router_jitter_noise=0.1"):
        config_from_hf({**config.to_dict(), "router_jitter_noise": 0.1})


# ================================================================== refusals: one line, nothing written
# name -> (preset, fields, architecture=, the message's telling part)
REFUSALS = {
    "post_norm": (None, dict(norm="layernorm", norm_position="post"), None,
                  "norm_position='post' has no exact transformers architecture"),
    "deepnorm": (None, dict(norm_position="post", residual_scaling="deepnorm"), None, "residual_scaling='deepnorm'"),
    "sinusoidal": (None, dict(positions="sinusoidal"), None, "positions='sinusoidal'"),
    "shaw_relative": (None, dict(positions="relative"), None, "positions='relative'"),
    "alibi": (None, dict(positions="alibi"), None, "positions='alibi'"),
    "no_positions": (None, dict(positions="none"), None, "positions='none'"),
    "embed_scale": (None, dict(embed_scale="sqrt_d"), None, "embed_scale='sqrt_d'"),
    "switch_capacity": (None, dict(moe=MOE | dict(capacity_factor=1.25)), None, "moe.capacity_factor=1.25"),
    "gshard_random_routing": (None, dict(moe=MOE | dict(second_expert="random", normalize_top_k=True)), None,
                              "moe.second_expert='random'"),
    "layernorm_with_rope": (None, dict(norm="layernorm"), None,
                            "llama: norm='layernorm' (Llama normalizes with RMSNorm)"),
    # (Seed-OSS computes it: tests/test_hf_newer.py)
    "output_bias_without_qkv_bias": (None, dict(bias=True, qkv_bias=False), "llama",
                                     "'llama': qkv_bias=False with bias=True"),
    "gpt2_grouped_query": ("gpt2", dict(n_kv_heads=2), None, "gpt2: n_kv_heads=2"),
    "dynamic_from_elsewhere": (None, {"rope.scaling": "dynamic", "rope.factor": 2.0, "rope.original_max_seq_len": 16},
                               None, "rope.original_max_seq_len=16 with rope.scaling='dynamic'"),
    "expert_biases": (None, dict(bias=True, moe=MOE | dict(normalize_top_k=True)), None, "mixtral: bias=True"),
    "mlp_experts": (None, dict(ffn="mlp", moe=MOE | dict(normalize_top_k=True)), None, "mixtral: ffn='mlp'"),
    "softmax_ungated_shared": (None, dict(moe=MOE | dict(n_shared=1)), None,
                               "qwen2_moe: moe.shared_gate='none' (Qwen2-MoE gates its shared expert"),
    "softmax_group_limited": (None, dict(moe=MOE | dict(normalize_top_k=True, n_groups=2, topk_groups=1)), None,
                              "mixtral: moe.topk_groups=1 of moe.n_groups=2 (Mixtral routes among all experts)"),
    "softmax_routed_scale": (None, dict(moe=MOE | dict(n_shared=1, shared_gate="sigmoid", routed_scale=2.0)), None,
                             "qwen2_moe: moe.routed_scale=2.0"),
    "sigmoid_shared_width": (None, dict(moe=MOE | dict(scoring="sigmoid", n_shared=1, shared_d_ff=24)), None,
                             "glm4_moe: moe.shared_d_ff=24"),
    "sigmoid_group_max": (None, dict(moe=MOE | dict(scoring="sigmoid", n_groups=2, topk_groups=1)), None,
                          "glm4_moe: moe.group_score='max'"),
    "sigmoid_every_other": (None, dict(moe=MOE | dict(scoring="sigmoid", every=2)), None, "glm4_moe: moe.every=2"),
    "sigmoid_gated_shared": (None, dict(moe=MOE | dict(scoring="sigmoid", n_shared=1, shared_gate="sigmoid")), None,
                             "glm4_moe: moe.shared_gate='sigmoid'"),
    "window_as_llama": (None, {"attention.window": 8, "attention.pattern": ["local"]}, "llama",
                        "cannot export as 'llama': attention.pattern=['local'] (Llama has no sliding-window layers)"),
    "mixed_windows_as_mistral": (None, {"attention.window": 8, "attention.pattern": ["local", "global"]}, "mistral",
                                 "attention.pattern=['local', 'global'] (Mistral's sliding window applies to every"),
    "partial_rotary": (None, {"rope.partial": 0.5}, None, "rope.partial=0.5 (Llama rotates every dimension"),
    "mistral_with_biases": (None, dict(bias=True), "mistral",
                            "cannot export as 'mistral': bias=True (Mistral has no biases)"),
    "dense_as_moe": (None, {}, "mixtral", "cannot export as 'mixtral': it is a mixture-of-experts architecture"),
    "moe_as_dense": (None, dict(moe=MOE), "llama", "cannot export as 'llama': it is a dense architecture"),
    "deepseek_v3_without_mla": (None, {}, "deepseek_v3",
                                "cannot export as 'deepseek_v3': mla=None (DeepSeek-V3 uses multi-head latent"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_variants_without_an_exact_architecture_are_refused_by_name(tmp_path, case):
    preset, fields, architecture, message = REFUSALS[case]
    model = lm(preset, **fields)
    with pytest.raises(ValueError) as err:
        to_hf(model, tmp_path / "out", architecture=architecture)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary directory left


def test_a_tensor_the_architecture_never_reads_is_refused_by_name(tmp_path, monkeypatch):
    """Export accounts for every tensor, the mirror of import's unexpected tensors: an architecture that declared
    the attention output gate without writing it (as the deny-list's missing rows once let llama export one, its
    logits off by 0.071) is refused naming the gate tensors it has no place for, and writes nothing."""
    import dataclasses

    family = lmlab.hf.FAMILIES["llama"]
    careless = dataclasses.replace(family.export, computes={**family.export.computes, "attn_gate": ("headwise",)})
    monkeypatch.setitem(lmlab.hf.FAMILIES, "llama", dataclasses.replace(family, export=careless))
    model = lm(attn_gate="headwise")
    gates = r"\[blocks\.0\.attn\.gate\.proj\.weight, blocks\.1\.attn\.gate\.proj\.weight\]"
    with pytest.raises(ValueError, match=rf"^cannot export as 'llama': it has no place for 2 tensors of this model, "
                                         rf"{gates}; exporting without them would change the model$"):
        to_hf(model, tmp_path / "out")
    with pytest.raises(ValueError, match="has no place for 2 tensors"):
        hf_tensors(model)
    assert list(tmp_path.iterdir()) == []


def test_a_head_untied_since_is_not_written_as_the_embedding(tmp_path):
    """The tied head is the one tensor export derives (from the embedding it shares); a config that says tied
    with a head that is a tensor of its own is refused naming it, not exported with the embedding as its head."""
    model = lm(tie_embeddings=True)
    to_hf(model, tmp_path / "tied")
    model.head.weight = torch.nn.Parameter(model.embed.weight.detach() + 0.1)
    with pytest.raises(ValueError, match=r"it has no place for 1 tensor of this model, \[head\.weight\]"):
        to_hf(model, tmp_path / "untied")
    assert not (tmp_path / "untied").exists()


def test_every_field_an_architecture_declares_is_a_field_with_those_choices():
    """Export.computes, EVERY_ARCHITECTURE and LACKS name real fields (dotted), with values of their type: a
    misspelt name would leave the field refused everywhere, a misspelt value that choice."""
    import dataclasses
    import typing

    from lmlab.hf.registry import ANY, EVERY_ARCHITECTURE, LACKS
    from lmlab.schema import Config

    def fields(cls, prefix=""):
        for f in dataclasses.fields(cls):
            hint = typing.get_type_hints(cls)[f.name]
            inner = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
            if isinstance(inner[0], type) and issubclass(inner[0], Config):
                yield prefix + f.name, None
                yield from fields(inner[0], f"{prefix}{f.name}.")
            else:
                yield prefix + f.name, hint

    hints = dict(fields(ModelConfig))
    declared = [("every architecture", EVERY_ARCHITECTURE), ("LACKS", dict.fromkeys(LACKS, ANY))]
    declared += [(name, f.export.computes) for name, f in lmlab.hf.FAMILIES.items() if f.export is not None]
    for owner, computes in declared:
        for path, values in computes.items():
            assert path in hints, f"{owner}: {path} is not a ModelConfig field"
            if values is ANY:
                continue
            hint = hints[path]
            if typing.get_origin(hint) is tuple:  # attention.pattern: each item one of the choices
                hint = typing.get_args(hint)[0]
            choices = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else (False, True)
            assert set(values) <= set(choices), f"{owner}: {path} has no choice {set(values) - set(choices)}"


def test_a_trained_selection_bias_without_a_place_is_refused(tmp_path):
    """Loss-free balancing trains a selection bias; a softmax architecture has none to hold it."""
    model = lm(moe=MOE | dict(normalize_top_k=True, bias_update_rate=1e-3))
    to_hf(model, tmp_path / "zero")  # an untouched (zero) bias is exact
    with torch.no_grad():
        model.moe_layers[1].router.score_bias[2] = 0.1
    with pytest.raises(ValueError,
                       match=r"blocks\.1\.ffn\.router\.score_bias is not zero \(moe\.bias_update_rate=0\.001"):
        to_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_bad_arguments(tmp_path):
    model = lm()
    with pytest.raises(ValueError, match="max_shard_size='lots' is not a size"):
        to_hf(model, tmp_path / "a", max_shard_size="lots")
    with pytest.raises(ValueError, match="dtype='int8' is not valid"):
        to_hf(model, tmp_path / "a", dtype="int8")
    with pytest.raises(ValueError, match="to_hf exports an lmlab Transformer"):
        to_hf(torch.nn.Linear(2, 2), tmp_path / "a")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        to_hf(model, tmp_path / "file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


# ================================================================== the directory: whole or not at all
def test_output_directory_rules(tmp_path):
    model, out = lm(), tmp_path / "out"
    out.mkdir()
    to_hf(model, out)  # an empty directory is fine
    files = sorted(p.name for p in out.iterdir())
    assert files == [".lmlab-export", "config.json", "generation_config.json", "model.safetensors"]  # the marker:
    # overwrite replaces only a directory that holds it (one an export wrote)
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(ValueError, match="exists and is not empty; pass --overwrite"):
        to_hf(model, out)
    assert (out / "mine.txt").read_text() == "keep me"
    other = lm(seed=1)
    to_hf(other, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == files  # replaced, not merged
    assert torch.equal(lmlab.from_hf(out).embed.weight, other.embed.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_failure_while_writing_leaves_nothing_behind(tmp_path, monkeypatch):
    import safetensors.torch

    model = lm()
    to_hf(model, tmp_path / "old")
    before = {p.name: p.read_bytes() for p in (tmp_path / "old").iterdir()}
    calls = []

    def disk_full(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        Path(path).write_bytes(b"partial")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        to_hf(model, tmp_path / "new", max_shard_size="30KB")
    with pytest.raises(OSError, match="No space left"):
        calls.clear()
        to_hf(lm(seed=1), tmp_path / "old", max_shard_size="30KB", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]  # no new directory, no temporary one
    assert {p.name: p.read_bytes() for p in (tmp_path / "old").iterdir()} == before


def test_sharded_export_loads_in_transformers_and_lmlab(tmp_path):
    model, _ = lmlab_case("mixtral")
    done = to_hf(model, tmp_path / "out", max_shard_size="40KB")
    index = json.loads((done.path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (done.path / "model.safetensors").exists()
    assert sorted([".lmlab-export", *done.files]) == sorted(p.name for p in done.path.iterdir())
    sizes = [sum(t.numel() * 4 for t in load_file(done.path / s).values()) for s in shards]
    assert sum(sizes) == index["metadata"]["total_size"] and max(sizes[:-1]) <= 40_000
    idx = tokens(20)
    _, relative = relative_difference(logits(model, idx), logits(load_hf(done.path), idx))
    assert relative <= 1e-4
    assert torch.equal(logits(lmlab.from_hf(done.path), idx), logits(model, idx))


def test_stored_dtype(tmp_path):
    model = lm()
    done = to_hf(model, tmp_path / "out", dtype="bfloat16")
    assert json.loads((done.path / "config.json").read_text())["dtype"] == "bfloat16"
    stored = read_safetensors(done.path)
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    assert torch.equal(stored["model.embed_tokens.weight"], model.embed.weight.to(torch.bfloat16))
    assert next(model.parameters()).dtype == torch.float32  # the model itself is untouched


# ================================================================== tokenizers and special tokens
TEXTS = ["héllo wörld\n\tspaces  end ", "日本語 🙂 mixed", " leading space", "a\r\nb", "unseen: ŧ ŋ ℵ"]


def tokenizer(kind: str):
    pytest.importorskip("tokenizers")
    from lmlab.run.data.tokenizer import train_tokenizer

    return train_tokenizer(kind, [t for t in TEXTS[:-1] for _ in range(10)], 300)


@pytest.mark.parametrize("kind", ["byte", "char", "bpe"])
def test_exported_tokenizer_encodes_and_decodes_as_lmlab(tmp_path, kind):
    tok = tokenizer(kind)
    model = lm(vocab_size=tok.vocab_size)
    to_hf(model, tmp_path / "out", tok)
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in TEXTS:
        ids = tok.encode(text)
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == ids, text
        assert hf_tok.decode(ids) == tok.decode(ids)
    assert hf_tok.model_max_length == model.config.max_seq_len or kind == "byte"
    # the end of document is a special token (byte: id 255, which no UTF-8 text uses, as <|endoftext|>)
    assert hf_tok.eos_token_id == tok.eod_id and hf_tok.bos_token_id is None
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == tok.eod_id


def test_an_exported_byte_tokenizer_pads_and_keeps_its_special_token_text_as_bytes(tmp_path):
    """`tokenizer(texts, padding=True)` works (it raised: no pad token), padding with the end of document, and a
    text holding "<|endoftext|>" or "ÿ" still encodes as its UTF-8 bytes, as lmlab's byte tokenizer does."""
    tok = tokenizer("byte")
    to_hf(lm(vocab_size=256), tmp_path / "out", tok)
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    batch = hf_tok(["hello", "a"], padding=True)
    assert batch["input_ids"] == [tok.encode("hello"), tok.encode("a") + [255] * 4]
    assert batch["attention_mask"] == [[1] * 5, [1] + [0] * 4] and hf_tok.pad_token_id == hf_tok.eos_token_id == 255
    for text in ("the end <|endoftext|> of it", "L'Haÿ-les-Roses"):
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
        assert hf_tok.decode(tok.encode(text)) == text
    assert hf_tok.decode(tok.encode("ab") + [255], skip_special_tokens=True) == "ab"


def test_export_writes_the_trained_context_length(tmp_path, capsys):
    """A run trained at 16 tokens on a model whose preset allows 32 exports max_position_embeddings 16, so that
    evaluating the export says where the training length ends (it said 32)."""
    from helpers import corpus, fast_args

    from lmlab import cli

    args = ["train", "--run-dir", str(tmp_path / "run"), "--data.source", str(corpus(tmp_path / "c.txt")),
            "--model.d_model", "32", "--model.n_layers", "1", "--model.n_heads", "2", "--model.max_seq_len", "32",
            "--train.seq_len", "16", *fast_args(), "--train.steps", "2"]
    assert cli.main(args) == 0
    assert cli.main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["max_position_embeddings"] == 16
    capsys.readouterr()
    assert cli.main(["eval", str(tmp_path / "hf"), "--data", str(tmp_path / "run" / "data"), "--seq-len", "32",
                     "--max-batches", "1"]) == 0
    assert "trained at 16" in capsys.readouterr().out
    model = lm(**{"rope.scaling": "yarn", "rope.factor": 4.0})  # a scaling reads it: left as the model's
    to_hf(model, tmp_path / "yarn", trained_length=16)
    assert json.loads((tmp_path / "yarn" / "config.json").read_text())["max_position_embeddings"] == 32


def test_eos_is_recorded_so_transformers_stops_where_lmlab_stops(tmp_path):
    """Greedy decoding in transformers and in lmlab gives the same tokens, and both stop at the
    tokenizer's end-of-text id, which config.json, generation_config.json and tokenizer_config.json
    all name; without one, neither stops early (Llama's class default eos_token_id=2 is not used)."""
    from lmlab.generate import generate

    tok = tokenizer("byte")
    model = lm(vocab_size=256, d_model=32)
    prompt = tok.encode("the ")
    tok.eod_id = None  # first without an end: neither side stops early
    to_hf(model, tmp_path / "plain", tok)

    def both(path: Path, eos: int | None) -> tuple[list[int], list[int]]:
        hf = load_hf(path)
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
        ours = [int(t) for t in generate(model, prompt, 12, temperature=0, eos_id=eos)]
        return ours, theirs

    ours, theirs = both(tmp_path / "plain", None)
    assert ours == theirs and len(ours) == 12
    k = next(i for i in range(3, 12) if ours[i] not in ours[:i])  # a token first produced at step k >= 3
    tok.eod_id = ours[k]
    to_hf(model, tmp_path / "eos", tok)
    config, generation, tokenizer_config = (
        json.loads((tmp_path / "eos" / name).read_text())
        for name in ("config.json", "generation_config.json", "tokenizer_config.json"))
    assert config["eos_token_id"] == generation["eos_token_id"] == ours[k]
    # the tokenizer's own eos (and pad) is the byte tokenizer's end of document, id 255; generation stops at the
    # id config.json and generation_config.json name
    assert tokenizer_config["eos_token"] == tokenizer_config["pad_token"] == "<|endoftext|>"
    stopped, theirs = both(tmp_path / "eos", ours[k])
    assert stopped[: k + 1] == theirs == ours[: k + 1]


def test_tokenizers_that_cannot_be_written_are_refused(tmp_path):
    model = lm(vocab_size=256)
    with pytest.raises(ValueError, match="the tokenizer has 300 ids but the model's vocab_size is 256"):
        to_hf(model, tmp_path / "out", tokenizer("bpe"))
    with pytest.raises(ValueError,
                       match=r"the tokenizer \(object\) cannot be written as a Hugging Face tokenizer\.json"):
        to_hf(model, tmp_path / "out", object())
    assert list(tmp_path.iterdir()) == []
