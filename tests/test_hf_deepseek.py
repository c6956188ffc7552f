"""DeepSeek-V2 and DeepSeek-V3 both ways: tiny random transformers checkpoints loaded with ``lmlab.from_hf``
(logits in fp32 against transformers'), lmlab MLA models written with ``to_hf`` and read back by
transformers, a checkpoint through lmlab and back unchanged, and every refusal by its message."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_export import lm, load_hf, randomized_hf, relative_difference
from test_hf import assert_parity

import lmlab
from lmlab import to_hf
from lmlab.hf import config_from_hf, hf_tensors, read_safetensors
from lmlab.mtp import shift_left

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


MTP_MODEL = ("deepseek-v3", {"n_layers": 3, "moe": SIGMOID_MOE, "mtp.depth": 1})


def mtp_logits(model, idx):
    """lmlab's depth-1 MTP logits (B, T-1, V): at position i, from h_i and token i+1, predicting token i+2."""
    with torch.no_grad():
        h0, ctx = model.hidden_and_context(idx)
        h1 = model.mtp.hidden_states(h0, shift_left(idx, 1), ctx, model.embed_tokens)[0]
        return model.head(h1)[:, :-1]


def transformers_mtp(path):
    """transformers' main model and its MtpModel (generate(use_mtp=True)'s draft) from checkpoint ``path``.
    DeepseekV3's class finds MTP weights by its ``model.layers.61`` pattern; pointed at this checkpoint's
    MTP layer, MtpModel.from_pretrained raises for any weight it misses."""
    from transformers.modeling_layers import MtpModel

    hf, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    n = hf.config.num_hidden_layers
    assert not info["missing_keys"] and all(k.startswith(f"model.layers.{n}.") for k in info["unexpected_keys"])
    hf._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n}\..*"]
    return hf.eval(), MtpModel.from_pretrained(hf).eval()


def transformers_mtp_logits(hf, mtp, idx):
    """MtpModel's depth-1 logits at every position (its forward keeps only the last): the main model's last hidden
    states at 0..T-2 with tokens 1..T-1, at their own positions (rotary is relative: the shift changes nothing)."""
    with torch.no_grad():
        h = hf.model(idx).last_hidden_state[:, :-1]
        position_ids = torch.arange(1, idx.shape[1])[None].expand(idx.shape[0], -1)
        return mtp._project_to_logits(mtp.forward_layer(0, h, position_ids, None, input_ids=idx[:, 1:]))


def test_exported_mtp_model_gives_the_same_main_and_mtp_logits_in_transformers(tmp_path):
    preset, fields = MTP_MODEL
    model = lm(preset, **fields)
    done = to_hf(model, tmp_path / "out")
    assert done.model_type == "deepseek_v3"
    assert json.loads((done.path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    hf, mtp = transformers_mtp(done.path)
    idx = tokens(model.config.max_seq_len + 8)
    for path, ours, ref in [("main", logits(model, idx), logits(hf, idx)),
                            ("mtp", mtp_logits(model, idx), transformers_mtp_logits(hf, mtp, idx))]:
        assert ref.std() > 0.5
        MEASURED[f"to_hf deepseek_v3 with MTP, {path} logits"] = float((ours - ref).abs().max())
        _, relative = relative_difference(ours, ref)
        assert relative <= 1e-4, path


def test_mtp_weights_round_trip_exactly(tmp_path):
    preset, fields = MTP_MODEL
    model = lm(preset, **fields)
    to_hf(model, tmp_path / "out")
    back = lmlab.from_hf(tmp_path / "out")
    assert back.config == model.config
    a, b = model.state_dict(), back.state_dict()
    assert sorted(a) == sorted(b) and any(k.startswith("mtp.") for k in a)
    assert not [k for k in a if not torch.equal(a[k], b[k])]
    idx = tokens()
    assert torch.equal(mtp_logits(back, idx), mtp_logits(model, idx))
    again = to_hf(back, tmp_path / "again")
    first, second = read_safetensors(tmp_path / "out"), read_safetensors(again.path)
    assert sorted(first) == sorted(second) and all(torch.equal(first[k], second[k]) for k in first)


def test_a_loaded_mtp_layer_drafts_for_speculative_decoding(tmp_path):
    """The MTP layer of a DeepSeek-V3 checkpoint, with its mixture-of-experts block, drafts: greedy speculation gives
    plain greedy's tokens on a padded batch, and sampling with a seed repeats itself."""
    from lmlab.generate import generate, left_pad

    preset, fields = MTP_MODEL
    to_hf(lm(preset, **fields), tmp_path / "out")
    model = lmlab.from_hf(tmp_path / "out")
    idx, mask = left_pad([[5, 9, 3, 17, 2], [11, 4], [33]])

    def run(decoder, **sampling):
        return torch.stack(list(generate(model, idx, 20, attention_mask=mask, decoder=decoder, **sampling)))

    assert torch.equal(run("speculative", temperature=0), run("eager", temperature=0))
    sampled = [run("speculative", temperature=0.8, top_k=10, seed=0) for _ in range(2)]
    assert torch.equal(*sampled)


def hub_like_checkpoint(path) -> None:
    """A DeepSeek-V3 checkpoint laid out as the Hub's: transformers' main weights (save_pretrained writes no MTP
    layer) plus one MTP layer ``model.layers.3.*`` holding copies of the embedding and head."""
    hf = hf_model("deepseek_v3")
    hf.config.num_nextn_predict_layers = 1
    hf.save_pretrained(path)
    main = lmlab.from_hf(path)
    with_mtp = lm(None, **{"mtp.depth": 1}, **{k: v for k, v in dataclasses.asdict(main.config).items()
                                                 if k not in ("mtp",)})
    with_mtp.load_state_dict(main.state_dict(), strict=False)
    tensors = load_file(path / "model.safetensors")
    extra = {k: v for k, v in hf_tensors(with_mtp).items() if k.startswith("model.layers.3.")}
    save_file({**tensors, **{k: v.contiguous() for k, v in extra.items()}}, path / "model.safetensors",
              metadata={"format": "pt"})


def test_mtp_layers_of_a_hub_checkpoint_load_and_leave_the_main_logits_as_transformers_computes_them(tmp_path):
    hub_like_checkpoint(tmp_path)
    ours = lmlab.from_hf(tmp_path)
    assert ours.config.mtp is not None and ours.config.mtp.depth == 1
    hf, mtp = transformers_mtp(tmp_path)
    idx = tokens()
    assert_parity(logits(ours, idx), logits(hf, idx))
    a, b = mtp_logits(ours, idx), transformers_mtp_logits(hf, mtp, idx)
    MEASURED["from_hf deepseek_v3 with MTP, mtp logits"] = float((a - b).abs().max())
    assert_parity(a, b)


def test_a_config_without_mtp_sets_the_mtp_layers_aside(tmp_path):
    """state_dict_from_hf with a config without mtp loads the main model alone, as transformers' main model does."""
    hub_like_checkpoint(tmp_path)
    from lmlab.hf import HFTensors, state_dict_from_hf
    from lmlab.hf.deepseek import mtp_tensors

    tensors = read_safetensors(tmp_path)
    cfg = config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert cfg.mtp is None  # config.json alone: the MTP layers are optional, the tensors decide
    sd = state_dict_from_hf(cfg, tensors, "deepseek_v3")
    assert not any(k.startswith("mtp.") for k in sd)
    t = HFTensors(tensors)
    extra = {k for k in tensors if k.startswith("model.layers.3.")}
    assert set(mtp_tensors(cfg, t)) == extra and t.taken == extra


@pytest.mark.parametrize("change, message", [
    ("num_nextn_predict_layers", "config.json (model_type 'deepseek_v3') has num_nextn_predict_layers=2: the "
                                 "checkpoint holds 1 MTP layers (model.layers.3..3); make the two agree"),
    ("embed_tokens", "model.layers.3.embed_tokens.weight differs from model.embed_tokens.weight: lmlab's MTP modules "
                     "share the main model's embedding and head"),
    ("missing", "missing tensors [model.layers.3.hnorm.weight]"),
])
def test_mtp_layers_lmlab_cannot_hold_are_refused(tmp_path, change, message):
    hub_like_checkpoint(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    if change == "num_nextn_predict_layers":
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 2}))
    elif change == "embed_tokens":
        tensors["model.layers.3.embed_tokens.weight"] = tensors["model.layers.3.embed_tokens.weight"] + 1
    else:
        del tensors["model.layers.3.hnorm.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        lmlab.from_hf(tmp_path)
    assert message in str(err.value) and "\n" not in str(err.value)


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
    ({"mla": MLA, "moe": SIGMOID_MOE, "mtp.depth": 2}, "deepseek_v3",
     "deepseek_v3 holds them but cannot compute this model: mtp.depth=2 (DeepSeek-V3 trains one MTP module"),
    ({"mla": MLA, "mtp.depth": 1}, "deepseek_v3", "mtp.depth=1 with moe=None (DeepSeek-V3's MTP layer is a mixture"),
    ({"mla": MLA, "moe": SIGMOID_MOE, "mtp.depth": 1}, "deepseek_v2",
     "cannot export as 'deepseek_v2': mtp.depth=1 (its checkpoints hold no multi-token prediction modules"),
    ({"mla": MLA, "moe": SIGMOID_MOE, "mtp.depth": 2}, None, "cannot export: mtp.depth=2: no transformers "
     "architecture holds multi-token prediction modules for this model (deepseek_v3 holds them but cannot compute "
     "this model: mtp.depth=2"),
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
