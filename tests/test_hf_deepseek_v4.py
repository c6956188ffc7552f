"""DeepSeek-V4 both ways: tiny random transformers checkpoints (every attention kind, hash and top-k layers, mHC)
loaded with ``lmlab.from_hf`` (logits in fp32 against transformers'), lmlab models written with ``to_hf`` and read
back by transformers, a checkpoint through lmlab and back unchanged, the decode cache and left-padded batches (each
row against transformers' row alone: transformers pools a padded row's pads into its entries), greedy generation,
and every refusal by its message."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import decoded_logits
from safetensors.torch import load_file, save_file
from test_export import lm, load_hf, randomized_hf, relative_difference
from test_hf import assert_parity

import lmlab
from lmlab import to_hf
from lmlab.errors import CorruptFile
from lmlab.hf import config_from_hf, read_safetensors

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

V = 97
T = 40
BODY = dict(
    vocab_size=V, hidden_size=32, moe_intermediate_size=8, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=1, head_dim=16, q_lora_rank=12, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    hc_mult=2, sliding_window=6, o_groups=2, o_lora_rank=8, index_n_heads=8, index_head_dim=8, index_topk=3,
    partial_rotary_factor=0.5, max_position_embeddings=64, num_nextn_predict_layers=0, bos_token_id=None,
    eos_token_id=None, compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
# every attention kind and both routers, the compressed layers YaRN-scaled; V4's default schedule (two HCA layers,
# then CSA and HCA alternating), sigmoid scores, a tied head and four streams; indexers that keep every entry
HF_CASES = {
    "every_kind_yarn": dict(
        BODY, layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                           "compressed_sparse_attention"], mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        rope_parameters=YARN),
    "default_schedule_sigmoid_tied": dict(BODY, scoring_func="sigmoid", tie_word_embeddings=True, hc_mult=4,
                                          swiglu_limit=0.7, routed_scaling_factor=2.5),
    "indexer_keeps_all": dict(BODY, num_hidden_layers=2, layer_types=["compressed_sparse_attention"] * 2,
                              mlp_layer_types=["hash_moe", "moe"], index_topk=64, sliding_window=16),
}
MEASURED: dict[str, float] = {}  # largest |logit difference| per case, printed by the last test


def tokens(length: int = T, seed: int = 0, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(seed))


def hf_model(case: str):
    from transformers import DeepseekV4Config

    torch.manual_seed(0)
    model = randomized_hf(AutoModelForCausalLM.from_config(DeepseekV4Config(**HF_CASES[case])))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a real token-to-expert table: transformers initializes it to zeros (expert 0 K times)
        for name, buffer in model.named_buffers():
            if name.endswith("tid2eid"):
                buffer.copy_(torch.randint(0, 4, buffer.shape, generator=g))
    return model


def logits(model, idx, **kwargs):
    with torch.no_grad():
        return model(idx, **kwargs).logits


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each case's transformers model and its save_pretrained directory, made once."""
    made = {}
    for case in HF_CASES:
        path = tmp_path_factory.mktemp(case)
        model = hf_model(case)
        model.save_pretrained(path)
        made[case] = (model, path)
    return made


@pytest.mark.parametrize("case", HF_CASES)
def test_from_hf_gives_transformers_logits(saved, case):
    hf, path = saved[case]
    ours = lmlab.from_hf(path)
    cfg = ours.config
    assert cfg.attention_variant == "compressed" and cfg.residual == "mhc" and cfg.moe.hash_layers >= 0
    idx = tokens()
    a, b = logits(ours, idx), logits(hf, idx)
    MEASURED[f"from_hf {case}"] = float((a - b).abs().max())
    assert_parity(a, b)


@pytest.mark.parametrize("case", HF_CASES)
def test_checkpoint_through_lmlab_comes_back_identical(saved, tmp_path, case):
    original, path = saved[case]
    done = to_hf(lmlab.from_hf(path), tmp_path / "exported")
    assert done.model_type == "deepseek_v4"
    a, b = load_file(path / "model.safetensors"), read_safetensors(done.path)
    assert sorted(a) == sorted(b) and any(name.endswith("tid2eid") for name in a)
    assert not [name for name in a if a[name].dtype != b[name].dtype or not torch.equal(a[name], b[name])]
    before, after = (json.loads((p / "config.json").read_text()) for p in (path, done.path))
    assert config_from_hf(after) == config_from_hf(before)
    hf_before, hf_after = (AutoConfig.from_pretrained(p).to_dict() for p in (path, done.path))
    differ = {k for k in hf_before.keys() | hf_after.keys() if hf_before.get(k) != hf_after.get(k)} - {"_name_or_path"}
    assert not differ, {k: (hf_before.get(k), hf_after.get(k)) for k in differ}
    idx = tokens()
    assert torch.equal(logits(load_hf(done.path), idx), logits(original, idx))


# an lmlab model of every kind: d 32, 4 heads of 16 over one key/value head, hash then top-k layers, 2 streams
V4_FIELDS = {
    "n_layers": 4, "n_kv_heads": 1, "head_dim": 16, "d_ff": 16, "norm_eps": 1e-6, "rope.layout": "interleaved",
    "attention.sinks": "learned", "glu_variant": "limited", "glu_limit": 3.0, "residual": "mhc",
    "residual_streams.n": 2, "compressed": dict(q_lora_rank=12, rope_head_dim=8, window=6, hca_rate=8, index_heads=8,
                                                index_head_dim=8, index_topk=3, o_groups=2, o_lora_rank=8,
                                                layers=["sliding", "csa", "hca", "csa"], yarn_factor=4.0,
                                                yarn_original_max_seq_len=8),
    "moe": dict(n_experts=4, top_k=2, n_shared=1, scoring="sqrtsoftplus", normalize_top_k=True, routed_scale=1.5,
                hash_layers=2),
}


def v4_lm(**changes):
    kept = {k: v for k, v in V4_FIELDS.items() if k.split(".")[0] not in changes}  # a section changed whole
    model = lm(None, **{**kept, **changes})
    g = torch.Generator().manual_seed(2)
    for layer in model.moe_layers:  # a table that is not the init's, and selection biases
        if hasattr(layer.router, "table"):
            layer.router.table.copy_(torch.randint(0, 4, layer.router.table.shape, generator=g))
        else:
            layer.router.score_bias.copy_(torch.randn(4, generator=g) * 0.3)
    return model


LMLAB_CASES = {
    "every_kind": {},
    "sigmoid_tied_hca_only": {"moe.scoring": "sigmoid", "moe.hash_layers": 0, "tie_embeddings": True,
                              "compressed.layers": ["hca"], "compressed.yarn_factor": 1.0,
                              "compressed.yarn_original_max_seq_len": None, "residual_streams.n": 4},
}


@pytest.mark.parametrize("case", LMLAB_CASES)
def test_exported_model_gives_the_same_logits_in_transformers(tmp_path, case):
    model = v4_lm(**LMLAB_CASES[case])
    done = to_hf(model, tmp_path / "out")
    assert done.model_type == "deepseek_v4"
    hf = load_hf(done.path)
    idx = tokens(model.config.max_seq_len)
    ours, ref = logits(model, idx), logits(hf, idx)
    assert ref.std() > 0.5
    MEASURED[f"to_hf {case}"] = float((ours - ref).abs().max())
    assert relative_difference(ours, ref)[1] <= 1e-4
    back = lmlab.from_hf(done.path)
    assert back.config == model.config
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))


def test_kv_cache_decoding_equals_transformers_full_logits(saved):
    hf, path = saved["every_kind_yarn"]
    ours = lmlab.from_hf(path)
    idx = tokens()
    assert_parity(decoded_logits(ours, idx, prefill=13), logits(hf, idx))


def test_a_left_padded_batch_gives_each_row_what_transformers_gives_it_alone(saved):
    hf, path = saved["every_kind_yarn"]
    ours = lmlab.from_hf(path)
    idx = tokens(batch=3)
    mask = torch.ones_like(idx)
    mask[0, :6], mask[1, :17] = 0, 0
    got = logits(ours, idx, attention_mask=mask)
    for row, pads in enumerate((6, 17, 0)):
        assert_parity(got[row, pads:], logits(hf, idx[row : row + 1, pads:])[0])


@pytest.mark.parametrize("case", ["every_kind_yarn", "default_schedule_sigmoid_tied"])
def test_padded_batch_greedy_equals_transformers_generate_on_each_prompt(saved, case):
    from lmlab.generate import generate

    hf, path = saved[case]
    ours = lmlab.from_hf(path)
    prompts = [[5, 9, 3, 17, 2, 40, 8, 11, 60, 3, 3, 70, 1], [11, 4, 30], [33, 2, 2, 9, 15]]
    mine = torch.stack(list(generate(ours, prompts, 12, temperature=0)), dim=1)
    for row, prompt in enumerate(prompts):
        idx = torch.tensor([prompt])
        ref = hf.generate(idx, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(prompt):]
        assert torch.equal(mine[row], ref), row


def test_defaults_match_transformers_config_class():
    """A config.json that leaves keys out means DeepseekV4Config's defaults (V4-Flash's dimensions); ours agree."""
    from transformers import DeepseekV4Config

    assert config_from_hf({"model_type": "deepseek_v4"}) == config_from_hf(DeepseekV4Config().to_dict())
    legacy = {"model_type": "deepseek_v4", "num_hidden_layers": 4, "compress_ratios": [0, 4, 128, 4],
              "num_hash_layers": 1}
    modern = DeepseekV4Config(num_hidden_layers=4, compress_ratios=[0, 4, 128, 4], num_hash_layers=1).to_dict()
    assert config_from_hf(legacy) == config_from_hf(modern)
    assert config_from_hf(legacy).compressed.layers == ("sliding", "csa", "hca", "csa")


def config_json(**changes) -> dict:
    from transformers import DeepseekV4Config

    return {**DeepseekV4Config(**HF_CASES["every_kind_yarn"]).to_dict(), **changes}


@pytest.mark.parametrize("changes, message", [
    (dict(attention_bias=True), "attention_bias=True: DeepSeek-V4 has no biases"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2: DeepSeek-V4's attention has one key/value head"),
    (dict(n_shared_experts=2), "n_shared_experts=2: transformers builds one shared expert"),
    (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    (dict(mlp_layer_types=["moe", "hash_moe", "moe", "moe"]), "mlp_layer_types=['moe', 'hash_moe', 'moe', 'moe']: "
                                                             "lmlab routes a first run of layers by token id"),
    (dict(layer_types=["full_attention"] * 4), "layer_types=['full_attention'"),
])
def test_configs_lmlab_cannot_express_are_refused(changes, message):
    with pytest.raises(ValueError) as err:
        config_from_hf(config_json(**changes))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_table_that_is_not_integer_ids_of_real_experts_is_refused(saved, tmp_path):
    _, path = saved["every_kind_yarn"]
    config = (path / "config.json").read_text()
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.ffn.gate.tid2eid"
    for table, error, message in ((tensors[name].float(), CorruptFile, "is stored as torch.float32; it is a table"),
                                  (tensors[name] + 4, ValueError, "names experts outside [0, 4)")):
        (tmp_path / "config.json").write_text(config)
        save_file({**tensors, name: table}, tmp_path / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(error) as err:
            lmlab.from_hf(tmp_path)
        assert message in str(err.value)


@pytest.mark.parametrize("changes, message", [
    ({"residual": "plain", "residual_streams": None}, "residual='plain' (DeepSeek-V4's residual is manifold-"),
    ({"attention.sinks": "none"}, "attention.sinks='none' (every DeepSeek-V4 head has a learned sink)"),
    ({"rope.layout": "half"}, "rope.layout='half' (DeepSeek-V4 rotates interleaved pairs)"),
    ({"glu_variant": "plain", "glu_limit": 10.0}, "glu_variant='plain' (DeepSeek-V4's experts clamp"),
    ({"moe.normalize_top_k": False}, "moe.normalize_top_k=False (transformers' DeepSeek-V4 normalizes"),
    ({"moe.scoring": "softmax"}, "moe.scoring='softmax' (transformers' DeepSeek-V4 scores with sqrtsoftplus or "),
])
def test_models_without_an_exact_architecture_are_refused_by_name(tmp_path, changes, message):
    with pytest.raises(ValueError) as err:
        to_hf(v4_lm(**changes), tmp_path / "out")
    assert message in str(err.value) and "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_the_preset_trains_generates_with_its_cache_and_exports(tmp_path):
    """The deepseek-v4 preset at a tiny width: two optimizer steps, greedy decoding from its cache equal to the full
    forward's argmax, and transformers reading the trained model back with its logits."""
    from lmlab import ModelConfig, Transformer
    from lmlab.generate import generate

    cfg = ModelConfig.from_preset("deepseek-v4", vocab_size=V, d_model=64, n_heads=4, head_dim=16, max_seq_len=48,
                                  **{"compressed.q_lora_rank": 32, "compressed.o_lora_rank": 32,
                                     "compressed.rope_head_dim": 8, "compressed.index_head_dim": 8,
                                     "compressed.window": 8, "compressed.hca_rate": 8, "compressed.index_topk": 4,
                                     "moe.n_experts": 8, "moe.top_k": 2, "d_ff": 32})
    model = Transformer(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = tokens(48, seed=3)
    for _ in range(2):
        loss = model(idx, targets=idx.roll(-1, 1)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        model.update_router_biases()
    model.eval()
    prompt = idx[:1, :20]
    out = torch.stack(list(generate(model, prompt, 10, temperature=0)), dim=1)
    whole = torch.cat([prompt, out], dim=1)
    assert torch.equal(logits(model, whole)[0, 19:-1].argmax(-1), out[0])  # each token the full forward's greedy
    done = to_hf(model, tmp_path / "out")
    assert done.model_type == "deepseek_v4"
    ours, ref = logits(model, idx), logits(load_hf(done.path), idx)
    MEASURED["to_hf deepseek-v4 preset (trained 2 steps)"] = float((ours - ref).abs().max())
    assert relative_difference(ours, ref)[1] <= 1e-4


def test_zz_report_largest_logit_differences(capsys):
    """Not a check: prints what the parity tests above measured (run the file with -s to see it)."""
    with capsys.disabled():
        for name, diff in sorted(MEASURED.items()):
            print(f"\n{name}: max |logit difference| {diff:.2e}", end="")
