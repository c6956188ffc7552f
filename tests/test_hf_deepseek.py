"""DeepSeek-V2 and DeepSeek-V3 both ways: tiny random transformers checkpoints loaded with ``lmlab.from_hf``
(logits in fp32 against transformers'), lmlab MLA models written with ``to_hf`` and read back by
transformers, a checkpoint through lmlab and back unchanged, and every refusal by its message."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_export import lm, load_hf, randomized_hf, relative_difference
from test_hf import assert_parity

import lmlab
from lmlab import to_hf
from lmlab.hf import config_from_hf, read_safetensors

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

V = 97
T = 40  # past max_position_embeddings (32): YaRN's interpolated frequencies are in play
BODY = dict(
    vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=8, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    first_k_dense_replace=1, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
    max_position_embeddings=32, bos_token_id=None, eos_token_id=None,
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 1e4,
        "mscale": 0.707, "mscale_all_dim": 1.0}
# name -> (config class, its arguments): V2-Lite (no query compression), V2 (group-limited, scaled,
# YaRN with DeepSeek's mscale), V3 (interleaved rotary, the default) and V3 in the half layout
HF_CASES = {
    "deepseek_v2_lite": ("DeepseekV2Config", dict(BODY, q_lora_rank=None, n_shared_experts=2)),
    "deepseek_v2_group_limited_yarn": ("DeepseekV2Config", dict(
        BODY, q_lora_rank=12, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.0,
        rope_parameters=YARN)),
    # num_nextn_predict_layers 0: transformers builds no MTP layer whatever it says, and lmlab writes 0
    "deepseek_v3": ("DeepseekV3Config", dict(
        BODY, q_lora_rank=12, n_group=4, topk_group=2, num_nextn_predict_layers=0)),
    "deepseek_v3_half_rope_yarn": ("DeepseekV3Config", dict(
        BODY, q_lora_rank=12, n_group=4, topk_group=2, rope_interleave=False, rope_parameters=YARN,
        num_nextn_predict_layers=0)),
}
MEASURED: dict[str, float] = {}  # largest |logit difference| per case, printed by the last test


def tokens(length: int = T, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (2, length), generator=torch.Generator().manual_seed(seed))


def hf_model(case: str):
    config_class, kwargs = HF_CASES[case]
    torch.manual_seed(0)
    return randomized_hf(AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**kwargs)))


def logits(model, idx):
    with torch.no_grad():
        return model(idx).logits


@pytest.mark.parametrize("case", HF_CASES)
def test_from_hf_gives_transformers_logits(tmp_path, case):
    hf = hf_model(case)
    hf.save_pretrained(tmp_path)
    ours = lmlab.from_hf(tmp_path)
    assert ours.config.mla is not None and ours.config.moe is not None
    idx = tokens()
    a, b = logits(ours, idx), logits(hf, idx)
    MEASURED[f"from_hf {case}"] = float((a - b).abs().max())
    assert_parity(a, b)


@pytest.mark.parametrize("case", HF_CASES)
def test_checkpoint_through_lmlab_comes_back_identical(tmp_path, case):
    original = hf_model(case)
    original.save_pretrained(tmp_path / "original")
    done = to_hf(lmlab.from_hf(tmp_path / "original"), tmp_path / "exported", architecture=original.config.model_type)
    a, b = load_file(tmp_path / "original" / "model.safetensors"), read_safetensors(done.path)
    assert sorted(a) == sorted(b)
    assert not [name for name in a if not torch.equal(a[name], b[name])]
    before, after = (json.loads((p / "config.json").read_text()) for p in (tmp_path / "original", done.path))
    assert config_from_hf(after) == config_from_hf(before)
    hf_before, hf_after = (AutoConfig.from_pretrained(p).to_dict() for p in (tmp_path / "original", done.path))
    differ = {k for k in hf_before.keys() | hf_after.keys() if hf_before.get(k) != hf_after.get(k)} - {"_name_or_path"}
    assert not differ, {k: (hf_before.get(k), hf_after.get(k)) for k in differ}
    idx = tokens()
    assert torch.equal(logits(load_hf(done.path), idx), logits(original, idx))


MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12)
SOFTMAX_MOE = dict(n_experts=4, top_k=2, d_expert=16, n_shared=1, first_dense=1, routed_scale=1.5)
SIGMOID_MOE = dict(SOFTMAX_MOE, scoring="sigmoid", normalize_top_k=True, n_groups=2, topk_groups=1,
                   group_score="top2", routed_scale=2.5)
YARN_FIELDS = {"rope.scaling": "yarn", "rope.factor": 4.0, "rope.original_max_seq_len": 8, "rope.mscale": 0.707,
               "rope.mscale_all_dim": 1.0}
# name -> (preset or None, fields, the architecture asked for (None: the first that fits), the one chosen)
LMLAB_CASES = {
    "dense_half_rope": (None, dict(mla=MLA), None, "deepseek_v2"),  # V2 rotates interleaved: rows permuted
    "dense_as_v3_interleaved": (None, {"mla": MLA | dict(q_lora_rank=12), "rope.layout": "interleaved"},
                                "deepseek_v3", "deepseek_v3"),
    "v2_moe_group_limited_yarn": (None, dict(
        mla=MLA | dict(q_lora_rank=12), n_layers=3, moe=SOFTMAX_MOE | dict(n_groups=2, topk_groups=1),
        **YARN_FIELDS), None, "deepseek_v2"),
    "v3_preset": ("deepseek-v3", dict(n_layers=3, moe=SIGMOID_MOE), None, "deepseek_v3"),
    "v3_all_experts_interleaved_yarn": (None, {
        "mla": MLA, "n_layers": 3, "moe": SIGMOID_MOE | dict(topk_groups=None), "rope.layout": "interleaved",
        **YARN_FIELDS}, None, "deepseek_v3"),
}


@pytest.mark.parametrize("case", LMLAB_CASES)
def test_exported_mla_model_gives_the_same_logits_in_transformers(tmp_path, case):
    preset, fields, asked, chosen = LMLAB_CASES[case]
    model = lm(preset, **fields)
    done = to_hf(model, tmp_path / "out", architecture=asked)
    assert done.model_type == chosen
    hf = load_hf(tmp_path / "out")
    idx = tokens(model.config.max_seq_len + 8)
    ours, ref = logits(model, idx), logits(hf, idx)
    assert ref.std() > 0.5
    MEASURED[f"to_hf {case}"] = float((ours - ref).abs().max())
    _, relative = relative_difference(ours, ref)
    assert relative <= 1e-4


def test_mtp_layers_of_a_checkpoint_are_set_aside(tmp_path):
    """A DeepSeek-V3 checkpoint from the Hub holds its multi-token-prediction layer after the last
    decoder layer; the main model loads without it and computes the same logits."""
    hf = hf_model("deepseek_v3")
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    extra = {"model.layers.3.eh_proj.weight": torch.zeros(32, 64), "model.layers.3.enorm.weight": torch.ones(32)}
    save_file({**tensors, **extra}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    from lmlab.hf import HFTensors
    from lmlab.hf.deepseek import mtp_tensors

    ours = lmlab.from_hf(tmp_path)
    assert_parity(logits(ours, tokens()), logits(hf, tokens()))
    t = HFTensors({**tensors, **extra})
    assert sorted(mtp_tensors(ours.config, t)) == sorted(extra) and t.taken == set(extra)


def test_kv_cache_decoding_equals_transformers_full_logits(tmp_path):
    hf = hf_model("deepseek_v2_group_limited_yarn")
    hf.save_pretrained(tmp_path)
    ours = lmlab.from_hf(tmp_path)
    idx = tokens()
    cache = ours.new_cache(2, T)
    with torch.no_grad():
        parts = [ours(idx[:, :20], cache=cache).logits] + [ours(idx[:, t:t + 1], cache=cache).logits
                                                           for t in range(20, T)]
    assert_parity(torch.cat(parts, dim=1), logits(hf, idx))


def test_padded_batch_greedy_equals_transformers_generate(tmp_path):
    from lmlab.generate import generate, left_pad

    hf = hf_model("deepseek_v3")
    hf.save_pretrained(tmp_path)
    ours = lmlab.from_hf(tmp_path)
    prompts = [[5, 9, 3, 17, 2, 40, 8], [11, 4, 30], [33]]
    idx, mask = left_pad(prompts)
    ref = hf.generate(idx, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)[:, idx.shape[1]:]
    mine = torch.stack(list(generate(ours, prompts, 6, temperature=0)), dim=1)
    assert torch.equal(mine, ref)


def test_defaults_match_transformers_config_classes():
    """A config.json that leaves keys out means the transformers class defaults; ours agree."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    v2 = {"model_type": "deepseek_v2", "num_experts_per_tok": 6}  # transformers' default, None, routes nowhere
    assert config_from_hf(v2) == config_from_hf(DeepseekV2Config(num_experts_per_tok=6).to_dict())
    assert config_from_hf({"model_type": "deepseek_v3"}) == config_from_hf(DeepseekV3Config().to_dict())


def config_json(model_type: str, **changes) -> dict:
    config_class = {"deepseek_v2": "DeepseekV2Config", "deepseek_v3": "DeepseekV3Config"}[model_type]
    body = dict(BODY, q_lora_rank=12, n_group=4, topk_group=2)
    return {**getattr(transformers, config_class)(**body).to_dict(), **changes}


@pytest.mark.parametrize("model_type, changes, message", [
    ("deepseek_v2", dict(attention_bias=True), "attention_bias=True: lmlab maps DeepSeek checkpoints without biases"),
    ("deepseek_v2", dict(mlp_bias=True), "mlp_bias=True"),
    ("deepseek_v2", dict(norm_topk_prob=True), "norm_topk_prob=True: transformers' DeepseekV2 never renormalizes"),
    ("deepseek_v2", dict(topk_method="noaux_tc"), "topk_method='noaux_tc'"),
    ("deepseek_v2", dict(num_experts_per_tok=None), "num_experts_per_tok=None"),
    ("deepseek_v3", dict(num_key_value_heads=128), "num_key_value_heads=128: MLA gives every head its own keys"),
    ("deepseek_v3", dict(scoring_func="softmax"), "scoring_func='softmax'"),
])
def test_configs_lmlab_cannot_express_are_refused(model_type, changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_from_hf(config_json(model_type, **changes))


@pytest.mark.parametrize("fields, asked, message", [
    (dict(mla=MLA), "llama", "cannot export as 'llama': mla set (Llama has no multi-head latent attention"),
    (dict(mla=MLA, bias=True), "deepseek_v2", "cannot export as 'deepseek_v2': bias=True (DeepSeek-V2 has no biases)"),
    ({}, "deepseek_v3", "cannot export as 'deepseek_v3': mla=None (DeepSeek-V3 uses multi-head latent attention)"),
    (dict(mla=MLA, moe=SIGMOID_MOE), "deepseek_v2",
     "moe.scoring='sigmoid' (DeepSeek-V2 scores experts with a softmax)"),
    (dict(mla=MLA, moe=SOFTMAX_MOE | dict(normalize_top_k=True)), None,
     "deepseek_v2: moe.normalize_top_k=True (transformers' DeepseekV2 does not renormalize"),
    (dict(mla=MLA, moe=SIGMOID_MOE | dict(group_score="max")), "deepseek_v3", "moe.group_score='max'"),
])
def test_mla_models_without_an_exact_architecture_are_refused_by_name(tmp_path, fields, asked, message):
    with pytest.raises(ValueError) as err:
        to_hf(lm(**fields), tmp_path / "out", architecture=asked)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_zz_report_largest_logit_differences(capsys):
    """Not a check: prints what the parity tests above measured (run the file with -s to see it)."""
    with capsys.disabled():
        for name, diff in sorted(MEASURED.items()):
            print(f"\n{name}: max |logit difference| {diff:.2e}", end="")
