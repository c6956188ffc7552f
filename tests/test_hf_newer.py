"""The newer families of transformers 5.25 both ways, on tiny random configs built here: each checkpoint loads with
``from_hf`` with transformers' logits (full, left-padded, decoded through lmlab's cache) and greedy tokens, comes
back through ``to_hf`` bit for bit with the same config; lmlab models export as each family with the same logits in
transformers; what a family cannot hold is refused by name. The largest logit differences measured are printed by
the last test (run with -s)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_comes_back_identical, decoded_logits
from test_export import lm as lmlab_model
from test_export import load_hf, randomized_hf, relative_difference
from test_hf import assert_parity

import lmlab
from lmlab.hf import config_from_hf, to_hf

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

V = 97
T = 24
# DeepSeek-V3's attention and router at tiny widths (the MLA families)
MLA_BODY = dict(
    vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=8, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
    max_position_embeddings=32, n_group=4, topk_group=2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 1e4,
        "mscale": 0.707, "mscale_all_dim": 1.0}
# 16 indexer heads: a key's score is exactly 0 only where every head's ReLU is (2^-16), so no tie between zeros
# decides a selection, which would make it depend on rounding (with 4 heads a query's sixth and seventh keys tie)
INDEXER = dict(index_topk=6, index_head_dim=16, index_n_heads=16)
# name -> (transformers config class, its arguments, {lmlab config field (dotted): the value it must load as})
HF_CASES = {
    "deepseek_v32": ("DeepseekV32Config", dict(MLA_BODY, first_k_dense_replace=1, **INDEXER),
                     {"attention_variant": "dsa", "dsa.topk": 6, "rope.layout": "interleaved", "moe.first_dense": 1}),
    "deepseek_v32_yarn_two_dense": ("DeepseekV32Config", dict(
        MLA_BODY, mlp_layer_types=["dense", "dense", "sparse"], first_k_dense_replace=2, rope_parameters=YARN,
        **INDEXER),
        {"attention_variant": "dsa", "rope.scaling": "yarn", "moe.first_dense": 2}),
}
# the Llama layout at tiny widths (the dense families), four layers so that a window pattern repeats
LLAMA_BODY = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
W = 5  # a window; 24 tokens cross it several times
HF_CASES.update({
    "olmo3": ("Olmo3Config", dict(LLAMA_BODY, sliding_window=W), {
        "norm_position": "reordered", "qk_norm": "full", "attention.window": W, "rope.base": 5e5,
        "attention.pattern": ("local", "local", "local", "global")}),
    # the full layers scaled (YaRN), the sliding ones at their own base
    "olmo3_yarn_local_base": ("Olmo3Config", dict(LLAMA_BODY, sliding_window=W, rope_parameters={
        "full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                           "rope_theta": 1e4},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
        layer_types=["sliding_attention", "full_attention"] * 2), {
        "rope.scaling": "yarn", "rope.base": 1e4, "rope.local_base": 100.0, "attention.pattern": ("local", "global")}),
    # full layers without rotary (NoPE) every second layer, between rotating sliding ones
    "exaone4": ("Exaone4Config", dict(LLAMA_BODY, sliding_window=W, sliding_window_pattern=2), {
        "norm_position": "reordered", "qk_norm": "head", "rope.nope_every": 2,
        "attention.pattern": ("local", "global")}),
    "exaone4_no_window": ("Exaone4Config", dict(LLAMA_BODY, sliding_window=None, layer_types=["full_attention"] * 4,
                                                head_dim=12, tie_word_embeddings=True), {
        "rope.nope_every": 0, "attention.window": None, "head_dim": 12, "tie_embeddings": True}),
})
MOE_BODY = dict(LLAMA_BODY, num_hidden_layers=3)
HF_CASES.update({
    "glm4_moe_lite": ("Glm4MoeLiteConfig", dict(MLA_BODY), {"attention_variant": "mla", "moe.first_dense": 1,
                                                          "moe.routed_scale": 1.8, "rope.layout": "interleaved"}),
    # half-layout rotary, uncompressed queries, every layer a mixture, YaRN
    "glm4_moe_lite_half_rope": ("Glm4MoeLiteConfig", dict(
        MLA_BODY, rope_interleave=False, q_lora_rank=None, mlp_layer_types=["sparse"] * 3, rope_parameters=YARN),
        {"rope.layout": "half", "moe.first_dense": 0, "rope.scaling": "yarn"}),
    "seed_oss": ("SeedOssConfig", dict(LLAMA_BODY, head_dim=12), {
        "qkv_bias": True, "bias": False, "head_dim": 12, "dropout": 0.0}),
    "seed_oss_out_biases": ("SeedOssConfig", dict(LLAMA_BODY, head_dim=8, attention_bias=False,
                                                  attention_out_bias=True, mlp_bias=True), {
        "qkv_bias": False, "bias": True}),
    "minimax_m2": ("MiniMaxM2Config", dict(MOE_BODY, intermediate_size=16, head_dim=16, num_local_experts=4,
                                           num_experts_per_tok=2, rotary_dim=8), {
        "qk_norm": "full", "rope.partial": 0.5, "moe.scoring": "sigmoid", "rope.base": 5e6}),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(MOE_BODY, moe_intermediate_size=16, moe_num_experts=4, moe_k=2,
                                                moe_num_shared_experts=2), {
        "rope.layout": "interleaved", "moe.n_shared": 2, "moe.first_dense": 1, "tie_embeddings": True}),
    "ernie4_5_moe_every_other": ("Ernie4_5_MoeConfig", dict(
        MOE_BODY, moe_intermediate_size=16, moe_num_experts=4, moe_k=2, moe_num_shared_experts=0,
        moe_layer_start_index=1, moe_layer_interval=2, num_hidden_layers=4, tie_word_embeddings=False), {
        "moe.every": 2, "moe.first_dense": 1, "moe.n_shared": 0}),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", dict(MOE_BODY, intermediate_size=16, head_dim=8, num_experts=4,
                                                   moe_topk=2), {
        "qk_norm": "head", "qk_norm_position": "after_rope", "moe.n_shared": 1, "moe.normalize_top_k": True}),
})
TRAINING_ONLY = {case: {"attention_dropout", "residual_dropout"} for case in ("seed_oss", "seed_oss_out_biases")}
MEASURED: dict[str, float] = {}  # the largest |logit difference| per check and family, printed by the last test


def field(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def tokens(length: int = T, seed: int = 0, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model, idx):
    with torch.no_grad():
        return model(idx).logits


def hf_model(case: str):
    config_class, kwargs, _ = HF_CASES[case]
    torch.manual_seed(0)
    return randomized_hf(AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**kwargs)))


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """case -> (transformers' model, its checkpoint directory, lmlab's model from it), each built once."""
    cache: dict = {}

    def get(case: str):
        if case not in cache:
            path = tmp_path_factory.mktemp(case)
            hf = hf_model(case)
            hf.save_pretrained(path)
            cache[case] = hf, path, lmlab.from_hf(path)
        return cache[case]

    return get


def measured(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    MEASURED[name] = max(MEASURED.get(name, 0.0), float((ours - ref).abs().max()))


@pytest.mark.parametrize("case", HF_CASES)
def test_from_hf_gives_transformers_logits(loaded, case):
    hf, _, ours = loaded(case)
    expected = HF_CASES[case][2]
    assert {k: field(ours.config, k) for k in expected} == expected
    idx = tokens()
    a, b = logits(ours, idx), logits(hf, idx)
    measured(f"from_hf {case}", a, b)
    assert_parity(a, b)


@pytest.mark.parametrize("case", HF_CASES)
def test_checkpoint_through_lmlab_comes_back_identical(loaded, tmp_path, case):
    hf, path, ours = loaded(case)
    done = to_hf(ours, tmp_path / "out", architecture=hf.config.model_type)
    assert_comes_back_identical(path, done.path)
    before, after = (AutoConfig.from_pretrained(p).to_dict() for p in (path, done.path))
    differ = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)} - {"_name_or_path"}
    # Seed-OSS's dropouts (0.1 by default) act in training only; a loaded model has none, and writes lmlab's 0
    assert not differ - TRAINING_ONLY.get(case, set()), {k: (before.get(k), after.get(k)) for k in differ}
    idx = tokens()
    assert torch.equal(logits(load_hf(done.path), idx), logits(hf, idx))


@pytest.mark.parametrize("case", HF_CASES)
def test_left_padded_batch_matches_transformers(loaded, case):
    """The first row left-padded by 6: its real tokens' logits agree, transformers given the positions its generate
    gives (real tokens counted from 0). Rotary alone is blind to the shift; HunYuan's norm after rotary is not."""
    hf, _, ours = loaded(case)
    idx, mask = tokens(seed=2), torch.ones(2, T, dtype=torch.long)
    mask[0, :6] = 0
    with torch.no_grad():
        ref = hf(idx, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        got = ours(idx, attention_mask=mask).logits
    measured(f"from_hf {case}, left-padded", got[mask.bool()], ref[mask.bool()])
    assert_parity(got[mask.bool()], ref[mask.bool()])


@pytest.mark.parametrize("case", HF_CASES)
def test_cached_decoding_equals_transformers_full_logits(loaded, case):
    hf, _, ours = loaded(case)
    idx = tokens(seed=3)
    a, b = decoded_logits(ours, idx, prefill=9), logits(hf, idx)
    measured(f"from_hf {case}, decoded", a, b)
    assert_parity(a, b)


@pytest.mark.parametrize("case", HF_CASES)
def test_padded_batch_greedy_equals_transformers_generate(loaded, case):
    from lmlab.generate import generate, left_pad

    hf, _, ours = loaded(case)
    prompts = [[5, 9, 3, 17, 2, 40, 8, 61, 12], [11, 4, 30], [33]]
    idx, mask = left_pad(prompts)
    ref = hf.generate(idx, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)[:, idx.shape[1]:]
    mine = torch.stack(list(generate(ours, prompts, 8, temperature=0)), dim=1)
    assert torch.equal(mine, ref)


# ================================================================== lmlab -> transformers
MLA = dict(q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12)
SIGMOID_MOE = dict(n_experts=4, top_k=2, d_expert=16, n_shared=1, first_dense=1, scoring="sigmoid",
                   normalize_top_k=True, n_groups=2, topk_groups=1, group_score="top2", routed_scale=2.5)
DSA = dict(indexer_heads=16, indexer_head_dim=8, topk=5)
# name -> (preset or None, lmlab fields, the family chosen)
SOFTMAX_MOE = dict(n_experts=4, top_k=2, d_expert=16, normalize_top_k=True)
# name -> (preset or None, lmlab fields, the architecture asked for (None: the first that fits), the one chosen)
LMLAB_CASES = {
    "dsa_moe_half_rope": (None, dict(mla=MLA, dsa=DSA, n_layers=3, moe=SIGMOID_MOE), None, "deepseek_v32"),
    "dsa_dense_interleaved_yarn": (None, {
        "mla": MLA, "dsa": DSA | dict(indexer_head_dim=4, topk=3), "rope.layout": "interleaved",
        "rope.scaling": "yarn", "rope.factor": 4.0, "rope.original_max_seq_len": 8, "rope.mscale": 0.707,
        "rope.mscale_all_dim": 1.0}, None, "deepseek_v32"),
    "glm4_moe_lite_v3_preset": ("deepseek-v3", dict(n_layers=3, moe=SIGMOID_MOE), "glm4_moe_lite", "glm4_moe_lite"),
    "glm4_moe_lite_half_rope_no_q_lora": (None, dict(mla=MLA | dict(q_lora_rank=None), n_layers=3, moe=SIGMOID_MOE),
                                          "glm4_moe_lite", "glm4_moe_lite"),
    "olmo3_windows": ("olmo2", {"n_kv_heads": 2, "attention.window": 4, "attention.pattern": ["local", "global"]},
                      None, "olmo3"),
    "olmo3_local_base_interleaved": ("olmo2", {
        "attention.window": 4, "attention.pattern": ["local", "local", "global"], "n_layers": 3, "rope.base": 1e4,
        "rope.local_base": 100.0, "rope.scaling": "linear", "rope.factor": 2.0, "rope.layout": "interleaved"},
        None, "olmo3"),
    "exaone4_nope": (None, {"norm_position": "reordered", "qk_norm": "head", "n_layers": 3, "n_kv_heads": 2,
                            "attention.window": 4, "attention.pattern": ["local", "local", "global"],
                            "rope.nope_every": 3}, None, "exaone4"),
    "exaone4_no_window": (None, {"norm_position": "reordered", "qk_norm": "head", "head_dim": 12,
                                 "tie_embeddings": True}, None, "exaone4"),
    "seed_oss_out_and_mlp_biases": (None, dict(bias=True, qkv_bias=False, n_kv_heads=2, head_dim=12), None,
                                    "seed_oss"),
    "seed_oss_as_qwen2_asked": (None, dict(qkv_bias=True, n_kv_heads=2), "seed_oss", "seed_oss"),
    "minimax_m2_partial_interleaved": (None, {
        "qk_norm": "full", "n_kv_heads": 2, "head_dim": 16, "rope.partial": 0.5, "rope.layout": "interleaved",
        "moe": dict(n_experts=4, top_k=2, d_expert=16, scoring="sigmoid", normalize_top_k=True)}, None,
        "minimax_m2"),
    "ernie45_moe_shared_interleaved": (None, {
        "n_layers": 3, "n_kv_heads": 2, "rope.layout": "interleaved", "tie_embeddings": True,
        "moe": SOFTMAX_MOE | dict(n_shared=2, first_dense=1, bias_update_rate=1e-3)}, None, "ernie4_5_moe"),
    "ernie45_moe_half_rope_every_other": (None, {
        "n_layers": 4, "moe": SOFTMAX_MOE | dict(n_shared=1, every=2, first_dense=1, bias_update_rate=1e-3)},
        "ernie4_5_moe",
        "ernie4_5_moe"),
    "hunyuan_moe_interleaved": (None, {
        "qk_norm": "head", "qk_norm_position": "after_rope", "n_kv_heads": 2, "rope.layout": "interleaved",
        "moe": dict(n_experts=4, top_k=2, n_shared=1, normalize_top_k=True)}, None, "hunyuan_v1_moe"),
}


@pytest.mark.parametrize("case", LMLAB_CASES)
def test_exported_model_gives_the_same_logits_in_transformers(tmp_path, case):
    preset, fields, asked, family = LMLAB_CASES[case]
    model = lmlab_model(preset, **fields)
    if model.config.moe is not None and model.config.moe.bias_update_rate > 0:  # a trained selection bias
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)  # the same biases whichever tests ran before
            for layer in model.moe_layers:
                layer.router.score_bias.copy_(torch.randn(layer.router.score_bias.shape, generator=g) * 0.3)
    done = to_hf(model, tmp_path / "out", architecture=asked)
    assert done.model_type == family
    hf = load_hf(done.path)
    assert type(hf).__name__ == lmlab.hf.FAMILIES[family].export.architecture
    idx = tokens(model.config.max_seq_len + 8)
    ours, ref = logits(model, idx), logits(hf, idx)
    assert ref.std() > 0.5
    measured(f"to_hf {family}", ours, ref)
    assert relative_difference(ours, ref)[1] <= 1e-4
    back = lmlab.from_hf(done.path)  # as the family holds it (a half-layout model comes back interleaved)
    assert relative_difference(logits(back, idx), ours)[1] <= 1e-5


# ================================================================== DeepSeek-V3.2: the selection decides
def test_the_indexers_selection_changes_the_logits(loaded):
    """With every key kept (topk past the context), or the indexer's scores replaced by others, the loaded model's
    logits leave transformers': the parity above is of sparse attention, not of MLA."""
    hf, _, ours = loaded("deepseek_v32")
    idx = tokens()
    ref = logits(hf, idx)
    dense = lmlab.Transformer(ours.config.override({"dsa.topk": 64})).eval()
    dense.load_state_dict(ours.state_dict())
    assert not torch.allclose(logits(dense, idx), ref, atol=1e-2)
    other = lmlab.Transformer(ours.config).eval()
    other.load_state_dict(ours.state_dict())
    with torch.no_grad():
        for block in other.blocks:
            block.attn.indexer.weights.weight.neg_()
    assert not torch.allclose(logits(other, idx), ref, atol=1e-2)


def test_mlp_layer_types_decides_the_dense_layers():
    """transformers builds the layers mlp_layer_types names (first_k_dense_replace only fills it in when unset)."""
    hf = transformers.DeepseekV32Config(**MLA_BODY, **INDEXER, first_k_dense_replace=3).to_dict()
    assert config_from_hf({**hf, "mlp_layer_types": ["dense", "sparse", "sparse"]}).moe.first_dense == 1
    assert config_from_hf({**hf, "mlp_layer_types": None}).moe is None  # three dense layers of three


V32_REFUSALS = [
    (dict(q_lora_rank=None), "q_lora_rank=None: DeepSeek-V3.2's indexer reads the query latent"),
    (dict(mlp_layer_types=["sparse", "dense", "sparse"]), "mlp_layer_types=['sparse', 'dense', 'sparse']: lmlab's"),
    (dict(index_head_dim=4), "dsa.indexer_head_dim=4 is narrower than the mla.qk_rope_head_dim=8"),
    (dict(layer_types=["full_attention"] * 3), "layer_types=['full_attention', 'full_attention', 'full_attention']"),
]


@pytest.mark.parametrize("changes, message", V32_REFUSALS)
def test_v32_configs_lmlab_cannot_express_are_refused(changes, message):
    hf = {**transformers.DeepseekV32Config(**MLA_BODY, **INDEXER).to_dict(), **changes}
    with pytest.raises(ValueError) as err:
        config_from_hf(hf)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("fields, asked, message", [
    (dict(mla=MLA, dsa=DSA), "deepseek_v3", "cannot export as 'deepseek_v3': dsa set (DeepSeek-V3 has no sparse "
     "attention (DeepSeek-V3.2's lightning indexer))"),
    (dict(mla=MLA), "deepseek_v32", "cannot export as 'deepseek_v32': attention.variant='mla' (DeepSeek-V3.2's layers "
     "all attend through the lightning indexer"),
    (dict(mla=MLA, dsa=DSA, bias=True), None, "deepseek_v32: bias=True (DeepSeek-V3 has no biases)"),
])
def test_models_deepseek_v32_cannot_hold_are_refused_by_name(tmp_path, fields, asked, message):
    with pytest.raises(ValueError) as err:
        to_hf(lmlab_model(**fields), tmp_path / "out", architecture=asked)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


# ================================================================== OLMo 3 and EXAONE 4: what parity rests on
@pytest.mark.parametrize("case, changes", [
    ("olmo3_yarn_local_base", [{"rope.local_base": None}, {"attention.window": None, "attention.pattern": ["global"],
                                                           "rope.local_base": None}]),
    ("exaone4", [{"rope.nope_every": 0}, {"qk_norm": "none"}]),
    ("hunyuan_v1_moe", [{"qk_norm_position": "before_rope"}]),
])
def test_each_choice_the_family_loads_changes_the_logits(loaded, case, changes):
    hf, _, ours = loaded(case)
    idx = tokens()
    ref = logits(hf, idx)
    for change in changes:
        other = lmlab.Transformer(ours.config.override(change)).eval()
        other.load_state_dict(ours.state_dict(), strict=change != {"qk_norm": "none"})
        assert not torch.allclose(logits(other, idx), ref, atol=1e-2), change


@pytest.mark.parametrize("config_class, changes, message", [
    ("Olmo3Config", dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                                          "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     "give sliding_attention rope_type 'default'"),
    ("Olmo3Config", dict(attention_bias=True), "attention_bias=True"),
    ("Olmo3Config", dict(sliding_window=None), "sliding_window null"),
    ("Exaone4Config", dict(layer_types=["sliding_attention", "full_attention", "full_attention", "sliding_attention"]),
     "NoPE layers are every n-th layer"),
    ("Exaone4Config", dict(sliding_window=None, layer_types=["sliding_attention", "full_attention"] * 2),
     "its sliding_attention layers need a sliding_window"),
])
def test_configs_the_dense_families_cannot_express_are_refused(config_class, changes, message):
    hf = {**getattr(transformers, config_class)(**dict(LLAMA_BODY, sliding_window=W)).to_dict(), **changes}
    with pytest.raises(ValueError) as err:
        config_from_hf(hf)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("fields, asked, message", [
    ({"norm_position": "reordered", "qk_norm": "head", "attention.window": 4, "attention.pattern": ["local", "global"]},
     "exaone4", "rope.nope_every=0 with attention.pattern=['local', 'global'] (EXAONE 4's layers without rotary are "
     "exactly its full-attention layers"),
    ({"norm_position": "reordered", "qk_norm": "full", "rope.nope_every": 2}, "olmo3",
     "rope.nope_every=2 (OLMo 3 has no NoPE layers)"),
    ({"norm_position": "pre", "qk_norm": "full", "attention.window": 4, "attention.pattern": ["local"]}, "olmo3",
     "norm_position='pre' (OLMo 3 normalizes each sublayer's output)"),
])
def test_models_the_dense_families_cannot_hold_are_refused_by_name(tmp_path, fields, asked, message):
    with pytest.raises(ValueError) as err:
        to_hf(lmlab_model(**fields), tmp_path / "out", architecture=asked)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


# ================================================================== the MoE families and Seed-OSS: what does not map
@pytest.mark.parametrize("case, changes, message", [
    ("minimax_m2", dict(router_jitter_noise=0.1), "router_jitter_noise=0.1: lmlab's router has no multiplicative"),
    ("ernie4_5_moe", dict(use_bias=True), "use_bias=True: lmlab's one `bias` switch cannot put biases"),
    ("ernie4_5_moe", dict(num_hidden_layers=4, moe_layer_start_index=0, moe_layer_end_index=2),
     "moe_layer_end_index=2: the MoE layers are [0, 1, 2]; lmlab expresses"),
    ("ernie4_5_moe", dict(moe_norm_min=0.5), "moe_norm_min=0.5"),
    ("seed_oss", dict(attention_out_bias=True), "attention_out_bias=True: with mlp_bias=False"),
    ("glm4_moe_lite", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor=None: MLA turns every one"),
    ("glm4_moe_lite", dict(mlp_layer_types=["sparse", "dense", "sparse"]), "mlp_layer_types=['sparse', 'dense',"),
    ("hunyuan_v1_moe", dict(num_experts=[4, 2, 4]), "num_experts=[4, 2, 4], which is not valid; it must be a whole"),
    ("hunyuan_v1_moe", dict(moe_topk=[2, 2, 2]), "moe_topk=[2, 2, 2]: lmlab's mixture-of-experts layers are alike"),
    ("hunyuan_v1_moe", dict(attention_bias=True), "attention_bias=True"),
])
def test_configs_the_newer_families_cannot_express_are_refused(case, changes, message):
    config_class, kwargs, _ = HF_CASES[case]
    hf = {**getattr(transformers, config_class)(**kwargs).to_dict(), **changes}
    with pytest.raises(ValueError) as err:
        config_from_hf(hf)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_ernie_moe_layers_read_as_transformers_builds_them():
    """moe_layer_start_index 0 with interval 2 makes the same layers mixtures as start 1 (layer i is one where
    i + 1 is a multiple of the interval), so both load as one lmlab config."""
    _, kwargs, _ = HF_CASES["ernie4_5_moe_every_other"]
    start0, start1 = (transformers.Ernie4_5_MoeConfig(**dict(kwargs, moe_layer_start_index=k)).to_dict()
                      for k in (0, 1))
    assert config_from_hf(start0) == config_from_hf(start1)
    assert config_from_hf(start0).moe.every == 2 and config_from_hf(start0).moe.first_dense == 1


@pytest.mark.parametrize("fields, asked, message", [
    ({"qk_norm": "head", "moe": dict(n_experts=4, top_k=2, scoring="sigmoid", normalize_top_k=True)}, "minimax_m2",
     "qk_norm='head' (MiniMax-M2 normalizes the whole query and key projections)"),
    ({"qk_norm": "full", "moe": dict(n_experts=4, top_k=2, scoring="sigmoid")}, "minimax_m2",
     "moe.normalize_top_k=False (MiniMax-M2 renormalizes the chosen weights)"),
    ({"n_layers": 3, "moe": SOFTMAX_MOE | dict(every=2)}, "ernie4_5_moe",
     "moe.first_dense=0 with moe.every=2 (ERNIE 4.5's mixtures are the layers i"),
    ({"moe": SOFTMAX_MOE | dict(n_shared=1, shared_gate="sigmoid")}, "ernie4_5_moe",
     "moe.shared_gate='sigmoid' (ERNIE 4.5's shared experts are not gated)"),
    ({"qk_norm": "head"}, "seed_oss", "qk_norm='head' (Seed-OSS has no query/key norm)"),
    ({"mla": MLA, "dsa": DSA}, "glm4_moe_lite", "dsa set (GLM-4-MoE-Lite has no sparse attention"),
    ({"qk_norm": "head", "moe": dict(n_experts=4, top_k=2, n_shared=1, normalize_top_k=True)}, "hunyuan_v1_moe",
     "qk_norm_position='before_rope' (HunYuan-MoE normalizes queries and keys after rotary)"),
    ({"qk_norm": "head", "qk_norm_position": "after_rope"}, "qwen3",
     "qk_norm_position='after_rope' (Qwen3 normalizes queries and keys before rotary)"),
])
def test_models_the_newer_families_cannot_hold_are_refused_by_name(tmp_path, fields, asked, message):
    with pytest.raises(ValueError) as err:
        to_hf(lmlab_model(**fields), tmp_path / "out", architecture=asked)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_hunyuans_alpha_rotary_is_static_ntk_both_ways(tmp_path):
    """HunYuan's "dynamic" rotary with an alpha is a fixed larger base, theta alpha^(d / (d - 2)): it loads as
    rope.scaling='ntk' with factor alpha, and leaves as that base (the alpha form's unused factor is not kept)."""
    config_class, kwargs, _ = HF_CASES["hunyuan_v1_moe"]
    rope = {"rope_type": "dynamic", "alpha": 50.0, "factor": 2.0, "rope_theta": 1e4}
    torch.manual_seed(0)
    hf = randomized_hf(AutoModelForCausalLM.from_config(transformers.HunYuanMoEV1Config(**kwargs,
                                                                                       rope_parameters=rope)))
    hf.save_pretrained(tmp_path / "hf")
    ours = lmlab.from_hf(tmp_path / "hf")
    assert (ours.config.rope.scaling, ours.config.rope.factor, ours.config.rope.base) == ("ntk", 50.0, 1e4)
    idx = tokens()
    ref = logits(hf, idx)
    measured("from_hf hunyuan_v1_moe (alpha rotary)", logits(ours, idx), ref)
    assert_parity(logits(ours, idx), ref)
    plain = lmlab.Transformer(ours.config.override({"rope.scaling": "none", "rope.factor": 1.0})).eval()
    plain.load_state_dict(ours.state_dict())
    assert not torch.allclose(logits(plain, idx), ref, atol=1e-2)
    done = to_hf(ours, tmp_path / "out")
    assert done.model_type == "hunyuan_v1_moe"
    assert_parity(logits(load_hf(done.path), idx), ref)


# ================================================================== the families lmlab does not do, by name
@pytest.mark.parametrize("model_type, why", [
    ("qwen3_next", "hybrid linear attention (Gated DeltaNet"), ("qwen3_5_text", "hybrid linear attention"),
    ("qwen3_5_moe", "leaves attention whose point is efficiency alone out of scope"),
    ("kimi_linear", "hybrid linear attention (Kimi Delta Attention"), ("apertus", "its xIELU activation learns"),
])
def test_families_lmlab_does_not_do_are_refused_with_the_reason(tmp_path, model_type, why):
    hf = AutoConfig.for_model(model_type).to_dict()
    with pytest.raises(ValueError) as err:
        config_from_hf(hf)
    assert str(err.value).startswith(f"model_type {model_type!r} is not supported by lmlab.from_hf: ")
    assert why in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError) as err:
        to_hf(lmlab_model(), tmp_path / "out", architecture=model_type)
    assert str(err.value).startswith(f"architecture={model_type!r} is not one lmlab writes (")
    assert why in str(err.value) and list(tmp_path.iterdir()) == []


def test_zz_report_largest_logit_differences(capsys):
    """Not a check: prints what the parity tests above measured (run the file with -s to see it)."""
    with capsys.disabled():
        for name, diff in sorted(MEASURED.items()):
            print(f"\n{name}: max |logit difference| {diff:.2e}", end="")
