"""Decoding for real prompts: padded batches against each row alone and against transformers'
``generate``; the fixed-shape, compiled decoders against the eager reference, token for token."""

from __future__ import annotations

import pytest
import torch

import lmlab
from lmlab.attention import StaticKVCache
from lmlab.generate import generate, left_pad

V = 64
PROMPTS = [[5, 9, 3, 17, 2, 40, 8], [11, 4, 30], [7, 7, 21, 50, 1], [33]]  # lengths 7, 3, 5, 1


def model_for(**overrides) -> lmlab.Transformer:
    base = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=32)
    preset = overrides.pop("preset", None)
    nested = {k: overrides.pop(k) for k in list(overrides) if "." in k}
    cfg = (
        lmlab.ModelConfig.from_preset(preset, **{**base, **overrides})
        if preset
        else lmlab.ModelConfig(**{**base, **overrides})
    )
    return lmlab.Transformer(cfg.override(nested) if nested else cfg).eval()


def run(model, prompts, n, **kw) -> torch.Tensor:
    return torch.stack(list(generate(model, prompts, n, **kw)), dim=1)  # (B, n)


VARIANTS = {  # every position scheme, pre and post norm, GQA, MoE, MLA
    "llama (rope, GQA)": dict(preset="llama", n_kv_heads=2),
    "gpt2 (learned, tied)": dict(preset="gpt2"),
    "vaswani2017 (post, sinusoidal)": dict(preset="vaswani2017"),
    "alibi": dict(positions="alibi"),
    "relative": dict(positions="relative", relative_clip=4),
    "none": dict(positions="none"),
    "rope dynamic": {"rope.scaling": "dynamic", "rope.factor": 2.0, "max_seq_len": 8},
    "moe": dict(preset="llama", **{"moe.n_experts": 4, "moe.top_k": 2}),
    "mla (latent cache)": {"mla.kv_lora_rank": 16, "mla.qk_nope_head_dim": 8, "mla.qk_rope_head_dim": 4},
    "qwen3 (qk_norm head)": dict(preset="qwen3", n_kv_heads=2),
    "olmo2 (reordered, qk_norm full)": dict(preset="olmo2", n_kv_heads=2),
    "sandwich + headwise gate": dict(norm_position="sandwich", attn_gate="headwise", n_kv_heads=2),
}


# ============================================================== padding
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("decoder", ["eager", "static"])
def test_each_row_of_a_padded_batch_continues_as_it_would_alone(variant, decoder):
    model = model_for(**dict(VARIANTS[variant]))
    together = run(model, PROMPTS, 10, temperature=0, decoder=decoder)
    for b, p in enumerate(PROMPTS):
        alone = run(model, [p], 10, temperature=0, decoder="eager")
        assert torch.equal(together[b], alone[0]), (b, together[b], alone[0])


@pytest.mark.parametrize("variant", ["llama (rope, GQA)", "gpt2 (learned, tied)", "alibi", "relative"])
def test_padded_forward_equals_each_row_alone(variant):
    model = model_for(**dict(VARIANTS[variant]))
    idx, mask = left_pad(PROMPTS)
    with torch.no_grad():
        logits = model(idx, attention_mask=mask).logits  # (B, T, V)
        assert torch.isfinite(logits).all()  # pad rows see themselves: no all-masked softmax
        for b, p in enumerate(PROMPTS):
            alone = model(torch.tensor([p])).logits[0]
            torch.testing.assert_close(logits[b, -len(p):], alone, rtol=1e-5, atol=1e-5)


def test_padding_changes_nothing_for_an_unpadded_mask():
    model = model_for(preset="llama")
    idx = torch.tensor([PROMPTS[0], PROMPTS[0][::-1]])
    plain = run(model, idx, 8, temperature=0)
    masked = run(model, idx, 8, temperature=0, attention_mask=torch.ones_like(idx))
    assert torch.equal(plain, masked)


def test_a_padded_cache_records_positions_and_real_slots():
    model = model_for(preset="llama")
    idx, mask = left_pad([[1, 2, 3], [4]])
    cache = model.new_cache(2, 6)
    with torch.no_grad():
        model.hidden(idx, cache, mask)
        model.hidden(torch.tensor([[5], [6]]), cache)
    assert cache.length == 4
    assert cache.valid[:, :4].tolist() == [[True] * 4, [False, False, True, True]]
    assert cache.pos[0, :4].tolist() == [0, 1, 2, 3] and cache.pos[1, 2:4].tolist() == [0, 1]
    assert cache.seen.flatten().tolist() == [4, 2]
    static = StaticKVCache(cache)
    assert static.slot.tolist() == [4] and static.next_pos.flatten().tolist() == [4, 2]


@pytest.mark.parametrize("mask, message", [
    ([[1, 1, 0], [1, 1, 1]], r"attention_mask must pad on the left \(0s, then 1s, in every row\)"),
    ([[0, 0, 0], [1, 1, 1]], r"attention_mask must pad on the left"),
    ([[1, 1], [1, 1]], r"attention_mask must be 0/1 with the prompt's shape \(2, 3\), got \(2, 2\)"),
    ([[2, 1, 1], [1, 1, 1]], r"attention_mask must be 0/1"),
])
def test_bad_attention_masks_are_refused(mask, message):
    with pytest.raises(ValueError, match=message):
        generate(model_for(), torch.ones(2, 3, dtype=torch.long), 4, attention_mask=torch.tensor(mask))


# ============================================================== several EOS ids, rows finishing alone
@pytest.mark.parametrize("decoder", ["eager", "static"])
@pytest.mark.parametrize("sync_every", [1, 3, 64])
def test_rows_finish_on_any_eos_id_and_the_run_ends_when_all_have(decoder, sync_every):
    model = model_for(preset="llama")
    free = run(model, PROMPTS, 12, temperature=0, decoder="eager")
    eos = [int(free[0, 2]), int(free[1, 5])]
    out = run(model, PROMPTS, 12, temperature=0, eos_id=eos, decoder=decoder, sync_every=sync_every)
    first_eos = [next((t for t in range(12) if int(free[b, t]) in eos), 12) for b in range(len(PROMPTS))]
    assert out.shape == (len(PROMPTS), min(max(first_eos) + 1, 12))
    for b, t in enumerate(first_eos):
        assert torch.equal(out[b, : t + 1], free[b, : t + 1][: out.shape[1]])  # as without eos, up to it
        assert (out[b, t + 1:] == eos[0]).all()  # a finished row repeats the first eos id


# ============================================================== transformers on the same padded batch
def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights ~ N(0, 0.2): logits far apart, so greedy choices are not near-ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            gain = p.ndim == 1 and name.endswith("weight") and ("norm" in name or ".ln_" in name)
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if gain else 0.0))
    return model.eval()


def hf_model(family: str):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=V, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    llama = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, **llama))
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(
            transformers.GPT2Config(**common, n_embd=32, n_layer=2, n_head=4, n_positions=32)
        )
    if family == "qwen2_moe":
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, **llama, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=32, decoder_sparse_step=1))
    if family == "qwen3":  # eos 63: min_new_tokens makes transformers suppress eos, which this model's greedy 2 is
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**common, "eos_token_id": 63}, **llama,
                                                                      head_dim=8))
    if family == "olmo2":
        return transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**common, **llama))
    raise KeyError(family)


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2_moe", "qwen3", "olmo2"])
def test_padded_batch_greedy_equals_transformers_generate(tmp_path, family):
    torch.manual_seed(0)
    hf = randomize_(hf_model(family))
    hf.save_pretrained(tmp_path)
    ours = lmlab.from_hf(tmp_path).eval()
    idx, mask = left_pad(PROMPTS)
    n = 12
    with torch.no_grad():
        want = hf.generate(idx, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                           pad_token_id=0)[:, idx.shape[1]:]
    assert len(set(want.flatten().tolist())) > 8  # the model says different things: a real comparison
    for decoder in ("eager", "static"):
        assert torch.equal(run(ours, PROMPTS, n, temperature=0, decoder=decoder), want), decoder
    assert torch.equal(run(ours, idx, n, temperature=0, attention_mask=mask), want)  # the tensor form

    # several EOS ids (as generation_config.json may list): each row stops at its first
    eos = [int(want[0, 3]), int(want[2, 6])]
    with torch.no_grad():
        hf_eos = hf.generate(idx, attention_mask=mask, do_sample=False, max_new_tokens=n, eos_token_id=eos,
                             pad_token_id=0)[:, idx.shape[1]:]
    ours_eos = run(ours, PROMPTS, n, temperature=0, eos_id=eos, decoder="static", sync_every=4)
    assert ours_eos.shape == hf_eos.shape
    finished = torch.zeros(len(PROMPTS), dtype=torch.bool)
    for t in range(hf_eos.shape[1]):  # HF pads finished rows with pad_token_id, lmlab repeats eos[0]
        assert torch.equal(ours_eos[~finished, t], hf_eos[~finished, t]), t
        finished |= torch.isin(ours_eos[:, t], torch.tensor(eos))


# ============================================================== fast decoders equal the reference
SAMPLING = {
    "greedy": dict(temperature=0),
    "top-k": dict(temperature=0.9, top_k=10, seed=3),
    "top-p": dict(temperature=1.1, top_p=0.8, seed=4),
    "top-k + top-p": dict(temperature=0.7, top_k=20, top_p=0.9, seed=5),
    "full vocabulary": dict(temperature=1.0, seed=6),
}


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("variant", ["llama (rope, GQA)", "gpt2 (learned, tied)", "alibi", "relative"])
def test_static_decoder_equals_eager_token_for_token(variant, sampling):
    model = model_for(**dict(VARIANTS[variant]))
    kw = SAMPLING[sampling]
    eager = run(model, PROMPTS, 16, decoder="eager", **kw)
    assert torch.equal(run(model, PROMPTS, 16, decoder="static", **kw), eager)
    assert torch.equal(run(model, PROMPTS, 16, decoder="static", sync_every=5, **kw), eager)


def test_sampling_noise_spans_several_chunks_identically():
    """A long run redraws the noise buffer many times; both paths must redraw at the same steps."""
    from lmlab import sampling

    model = model_for(preset="llama", max_seq_len=128)
    old = sampling.NOISE_STEPS
    sampling.NOISE_STEPS = 3
    try:
        kw = dict(temperature=1.0, top_k=8, seed=9)
        eager = run(model, PROMPTS, 20, decoder="eager", **kw)
        assert torch.equal(run(model, PROMPTS, 20, decoder="static", sync_every=7, **kw), eager)
    finally:
        sampling.NOISE_STEPS = old
    assert not torch.equal(eager, run(model, PROMPTS, 20, decoder="eager", temperature=1.0, top_k=8, seed=10))


def test_compiled_decoder_equals_eager_and_compiles_without_graph_breaks(monkeypatch):
    """decoder="compiled" through dynamo and AOT autograd (functionalized in-place writes to the
    cache, the counters and the outputs): the same tokens as the eager reference, sampled with
    padding and several EOS ids; one graph, no break, and a second request reuses it. Inductor's
    C++ code generation takes minutes on a 2-core machine, so the test swaps in the aot_eager
    backend; benchmarks/bench_generate.py prints the share of inductor's tokens equal to eager's."""
    import torch._dynamo

    from lmlab import decoders as dec

    model = model_for(preset="llama", n_kv_heads=2)
    kw = dict(temperature=0.9, top_k=10, seed=3, eos_id=[60, 61])
    eager = run(model, PROMPTS, 12, decoder="eager", **kw)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    monkeypatch.setitem(dec.COMPILED, "step", torch.compile(dec.decode_step, dynamic=False, backend="aot_eager"))
    assert torch.equal(run(model, PROMPTS, 12, decoder="compiled", **kw), eager)
    assert torch.equal(run(model, PROMPTS, 12, decoder="compiled", **kw), eager)  # same shapes: no recompile
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    greedy = run(model, PROMPTS, 12, decoder="eager", temperature=0)
    assert torch.equal(run(model, PROMPTS, 12, decoder="compiled", temperature=0), greedy)
    torch._dynamo.reset()


def test_graph_runner_warms_up_then_captures_once_and_replays(monkeypatch):
    """The CUDA-graph sequence with CPU stand-ins: two real warm-up steps, one capture that runs
    nothing, then replays; the tokens equal the eager reference. (Real capture needs CUDA.)"""
    from lmlab import decoders as dec
    from lmlab import request

    events = []

    def capture(step):
        events.append("capture")
        return step  # a replay re-runs the recorded step on the same tensors

    def runner(step):
        return dec.GraphRunner(step, warm=lambda s: (events.append("warm"), s()), capture=capture)

    monkeypatch.setattr(
        dec,
        "decode_graph",
        lambda r: dec.decode_fixed(r, lambda m, s: runner(lambda: dec.decode_step(m, s)), r.idx.shape[1] + r.n),
    )
    monkeypatch.setitem(dec.DECODERS, "graph", dec.decode_graph)
    monkeypatch.setattr(request, "check_graphable", lambda model, device: None)  # where the request looks it up
    model = model_for(preset="llama")
    kw = dict(temperature=0.9, top_k=10, seed=3, eos_id=[60, 61])
    assert torch.equal(run(model, PROMPTS, 12, decoder="graph", **kw), run(model, PROMPTS, 12, decoder="eager", **kw))
    assert events == ["warm", "warm", "capture"]


# ============================================================== on a CUDA device (skipped without one)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@CUDA
@pytest.mark.parametrize("sampling", ["greedy", "top-k", "top-p"])
def test_cuda_graph_replays_the_static_step_exactly(sampling):
    model = model_for(preset="llama", n_kv_heads=2).cuda()
    kw = SAMPLING[sampling]
    static = run(model, PROMPTS, 24, decoder="static", eos_id=[60, 61], **kw)
    for sync_every in (1, 16):  # the same kernels, recorded once and replayed: bit for bit
        assert torch.equal(
            run(model, PROMPTS, 24, decoder="graph", eos_id=[60, 61], sync_every=sync_every, **kw), static
        )
    assert run(model, PROMPTS, 8, temperature=0).device.type == "cuda"  # auto = graph for a dense model


@CUDA
def test_cuda_compiled_step_agrees_with_the_static_step():
    """Inductor's fused bf16 kernels round differently from eager ones, so a near-tie may flip and
    the run continue differently from there; on a random model nearly every token agrees."""
    model = model_for(preset="llama", n_kv_heads=2).cuda()
    static = run(model, PROMPTS, 24, decoder="static", temperature=0)
    compiled = run(model, PROMPTS, 24, decoder="compiled", temperature=0)
    assert (compiled == static).float().mean() >= 0.9
    assert torch.equal(run(model, PROMPTS, 24, decoder="compiled", temperature=0), compiled)


@CUDA
def test_cuda_graph_refuses_mixture_of_experts():
    model = model_for(**dict(VARIANTS["moe"])).cuda()
    with pytest.raises(ValueError, match="decoder='graph' cannot capture a mixture-of-experts model"):
        generate(model, PROMPTS, 4, decoder="graph")
    assert torch.equal(run(model, PROMPTS, 6, temperature=0), run(model, PROMPTS, 6, temperature=0, decoder="eager"))


@pytest.mark.parametrize("kv", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("padded", [False, True])
def test_one_token_step_with_grouped_queries_equals_the_explicit_reference(kv, padded):
    """A decoding step's query heads are grouped onto their key/value head for the fused kernel."""
    model = model_for(preset="llama", n_kv_heads=kv)
    prompts = PROMPTS if padded else [p[:1] * 5 for p in PROMPTS]

    def steps(impl):
        model.set_attention_impl(impl)
        return run(model, prompts, 10, temperature=0, decoder="static"), run(model, prompts, 10, temperature=0)

    for fast, reference in zip(steps("sdpa"), steps("explicit")):
        assert torch.equal(fast, reference)
    idx, mask = left_pad(prompts)
    logits = {}
    for impl in ("sdpa", "explicit"):
        model.set_attention_impl(impl)
        cache = model.new_cache(4, 12)
        with torch.no_grad():
            model.hidden(idx, cache, mask if padded else None)
            logits[impl] = model(torch.tensor([[1], [2], [3], [4]]), cache=cache).logits
    torch.testing.assert_close(logits["sdpa"], logits["explicit"], rtol=1e-5, atol=1e-5)
