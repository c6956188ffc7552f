"""Generation: the cached loop against full recomputation, sampling controls, argument checks,
and UTF-8-safe text streaming."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import lmlab
from lmlab.generate import Completion, complete, generate, sample_text
from lmlab.run.data.tokenizer import ByteTokenizer, CharTokenizer
from lmlab.sampling import candidates, make_sampler, top_k_filter, top_p_filter

V = 64


def model_for(**overrides) -> lmlab.Transformer:
    base = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=32)
    preset = overrides.pop("preset", None)
    nested = {k: overrides.pop(k) for k in list(overrides) if "." in k}
    cfg = (
        lmlab.ModelConfig.from_preset(preset, **{**base, **overrides})
        if preset
        else lmlab.ModelConfig(**{**base, **overrides})
    )
    cfg = cfg.override(nested) if nested else cfg
    return lmlab.Transformer(cfg).eval()


def prompt(batch: int = 2, length: int = 5, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(seed))


def run(model, idx, n, **kw) -> torch.Tensor:
    return torch.stack(list(generate(model, idx, n, **kw)), dim=1)  # (B, n)


@torch.no_grad()
def greedy_reference(model, idx: torch.Tensor, n: int) -> torch.Tensor:
    """No cache: the full sequence through the model again for every new token."""
    for _ in range(n):
        nxt = model(idx).logits[:, -1].argmax(-1)  # (B,)
        idx = torch.cat([idx, nxt[:, None]], dim=1)
    return idx[:, -n:]


VARIANTS = {
    "llama (rope, GQA, pre, rmsnorm, glu)": dict(preset="llama", n_kv_heads=2),
    "gpt2 (learned, tied)": dict(preset="gpt2"),
    "vaswani2017 (post, sinusoidal)": dict(preset="vaswani2017"),
    "alibi": dict(positions="alibi"),
    "relative": dict(positions="relative", relative_clip=4),
    "none": dict(positions="none"),
    "rope interleaved + yarn": dict(**{"rope.layout": "interleaved", "rope.scaling": "yarn", "rope.factor": 2.0}),
}


# ============================================================== correctness of the cached loop
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_with_cache_equals_full_recomputation_at_every_step(variant):
    model = model_for(**dict(VARIANTS[variant]))
    idx = prompt(batch=2, length=5)
    assert torch.equal(run(model, idx, 20, temperature=0), greedy_reference(model, idx, 20))


def test_single_token_prompt_and_list_prompt():
    model = model_for()
    ref = greedy_reference(model, torch.tensor([[7]]), 6)
    assert torch.equal(run(model, [7], 6, temperature=0), ref)
    assert torch.equal(run(model, torch.tensor([7]), 6, temperature=0), ref)


def test_rows_of_a_batch_are_independent():
    model = model_for(preset="llama")
    idx = prompt(batch=3, length=6)
    together = run(model, idx, 10, temperature=0)
    for b in range(3):
        assert torch.equal(run(model, idx[b : b + 1], 10, temperature=0), together[b : b + 1])


def test_generation_runs_past_max_seq_len_for_extrapolating_schemes():
    model = model_for(preset="llama", max_seq_len=16)
    idx = prompt(batch=1, length=4)
    assert torch.equal(run(model, idx, 20, temperature=0), greedy_reference(model, idx, 20))


def test_learned_positions_refuse_before_the_first_token():
    model = model_for(preset="gpt2", max_seq_len=16)
    idx = prompt(batch=1, length=4)
    assert run(model, idx, 12, temperature=0).shape == (1, 12)  # exactly fills the table
    with pytest.raises(ValueError, match=(
        r"prompt \(4 tokens\) \+ max_new_tokens \(13\) = 17 exceeds max_seq_len=16, the size of the learned "
        r"position table; shorten the prompt or ask for at most 12 new tokens"
    )):
        generate(model, idx, 13)


def test_eos_stops_finished_rows_and_the_run():
    model = model_for(preset="llama")
    idx = prompt(batch=2, length=5, seed=3)
    free = run(model, idx, 8, temperature=0)
    assert free[0, 0] != free[1, 0]
    eos = int(free[0, 0])
    out = run(model, idx, 8, temperature=0, eos_id=eos)
    row1_eos = (free[1] == eos).nonzero()
    steps = int(row1_eos[0]) + 1 if len(row1_eos) else 8
    assert out.shape == (2, steps)  # stops as soon as every row has produced eos
    assert (out[0] == eos).all() and torch.equal(out[1], free[1, :steps])
    single = run(model, idx[:1], 8, temperature=0, eos_id=eos)
    assert single.tolist() == [[eos]]


def test_training_mode_is_restored_and_dropout_is_off():
    model = model_for(preset="llama", dropout=0.5).train()
    idx = prompt(batch=1, length=4)
    out = run(model, idx, 6, temperature=0)
    assert model.training
    assert torch.equal(out, greedy_reference(model.eval(), idx, 6))


# ============================================================== sampling
def test_seed_reproducibility():
    model = model_for(preset="llama")
    idx = prompt(batch=4, length=3)
    a = run(model, idx, 24, temperature=1.0, top_k=20, top_p=0.95, seed=11)
    assert torch.equal(a, run(model, idx, 24, temperature=1.0, top_k=20, top_p=0.95, seed=11))
    assert not torch.equal(a, run(model, idx, 24, temperature=1.0, top_k=20, top_p=0.95, seed=12))
    torch.manual_seed(5)  # seed=None draws from torch's global generator
    b = run(model, idx, 24)
    torch.manual_seed(5)
    assert torch.equal(b, run(model, idx, 24))


def test_top_k_1_and_tiny_top_p_equal_greedy():
    model = model_for(preset="llama")
    idx = prompt(batch=3, length=4)
    greedy = run(model, idx, 16, temperature=0)
    assert torch.equal(run(model, idx, 16, temperature=1.5, top_k=1, seed=0), greedy)
    assert torch.equal(run(model, idx, 16, temperature=1.5, top_p=1e-6, seed=0), greedy)


def test_sampler_draws_from_the_softmax_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(20000, 4)
    ids = make_sampler(1.0, None, None, torch.Generator().manual_seed(0), 4)(logits)
    freq = torch.bincount(ids, minlength=4).float() / len(ids)
    assert torch.allclose(freq, logits[0].softmax(-1), atol=0.01)
    hot = make_sampler(2.0, None, None, torch.Generator().manual_seed(0), 4)(logits)  # temperature flattens
    assert torch.allclose(torch.bincount(hot, minlength=4).float() / len(hot), (logits[0] / 2).softmax(-1), atol=0.01)
    k2 = make_sampler(1.0, 2, None, torch.Generator().manual_seed(0), 4)(logits)
    assert torch.allclose(
        torch.bincount(k2, minlength=4).float() / len(k2), torch.tensor([0.7311, 0.2689, 0, 0]), atol=0.01
    )


def test_top_k_and_top_p_filters_closed_form():
    logits = torch.tensor([[0.5, 3.0, 1.0, 2.0]])
    inf = float("-inf")
    assert top_k_filter(logits, 2).tolist() == [[inf, 3.0, inf, 2.0]]
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
    kept = top_p_filter(probs.log(), 0.75).isfinite().tolist()  # 0.5 + 0.3 reaches 0.75; 0.15 is not needed
    assert kept == [[False, True, False, True]]
    assert top_p_filter(probs.log(), 0.85).isfinite().tolist() == [[True, True, False, True]]
    assert top_p_filter(probs.log(), 1e-9).isfinite().tolist() == [[False, True, False, False]]


@pytest.mark.parametrize("top_k, top_p", [(None, None), (5, None), (None, 0.6), (7, 0.5), (V, 0.999999), (V + 3, None)])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_fast_candidates_equal_the_reference_filters(temperature, top_k, top_p):
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0)) * 3
    reference = logits / temperature
    if top_k is not None:
        reference = top_k_filter(reference, min(top_k, V))
    if top_p is not None:
        reference = top_p_filter(reference, top_p)
    scaled, ids = candidates(temperature, top_k, top_p, V)(logits)
    probs = scaled.softmax(-1)
    full = torch.zeros(4, V).scatter(-1, ids, probs) if ids is not None else probs
    torch.testing.assert_close(full, reference.softmax(-1))


# ============================================================== argument checks: eager, one line
@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), r"temperature=-0.1 is not valid; it must be a finite number >= 0 \(0 = greedy\)"),
    (dict(temperature=math.nan), r"temperature=nan is not valid"),
    (dict(temperature=math.inf), r"temperature=inf is not valid"),
    (dict(temperature="hot"), r"temperature='hot' is not valid"),
    (dict(top_k=0), r"top_k=0 is not valid; it must be an integer >= 1, or None for no limit"),
    (dict(top_k=2.5), r"top_k=2.5 is not valid"),
    (dict(top_p=0.0), r"top_p=0.0 is not valid; it must be in \(0, 1\], or None for no limit"),
    (dict(top_p=1.5), r"top_p=1.5 is not valid"),
    (dict(seed="x"), r"seed='x' is not valid; it must be an integer, or None"),
    (dict(eos_id=V), rf"eos_id={V} is not valid; it must be a token id in \[0, {V}\), a list of them, or None"),
    (dict(eos_id=[1, V]), rf"eos_id=\[1, {V}\] is not valid"),
    (dict(eos_id="x"), r"eos_id='x' is not valid"),
    (dict(decoder="fast"),
     r"decoder='fast' is not valid; choose one of \['auto', 'eager', 'static', 'compiled', 'graph', 'speculative'\]"),
    (dict(decoder="graph"), r"decoder='graph' captures CUDA graphs and needs a CUDA device; the model is on cpu"),
    (dict(sync_every=0), r"sync_every=0 is not valid; it must be an integer >= 1"),
])
def test_bad_sampling_arguments_raise_at_call_time(kwargs, message):
    model = model_for()
    with pytest.raises(ValueError, match=message) as err:
        generate(model, [1, 2], 4, **kwargs)  # no iteration needed
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("ids, n, message", [
    ([1, 2], -1, r"max_new_tokens=-1 is not valid; it must be an integer >= 0"),
    ([], 4, r"prompt_ids is empty; give at least one token"),
    ([1, V], 4,
     rf"prompt_ids hold id {V}, outside the model's vocabulary \[0, {V}\); encode the prompt with the tokenizer"),
    ([-3, 1], 4, r"prompt_ids hold id -3, outside"),
    (torch.zeros(1, 2, 3, dtype=torch.long), 4,
     r"prompt_ids must be a list of ints, a list of such lists, or a \(B, T\) integer tensor, got shape \(1, 2, 3\)"),
    (torch.zeros(1, 2), 4, r"got shape \(1, 2\) torch.float32"),
    (["a"], 4, r"prompt_ids must be a list of ints"),
    ([[1, 2], []], 4, r"prompt 1 is empty; give at least one token"),
    ([[1, 2], [3, V]], 4, rf"prompt_ids hold id {V}, outside"),
])
def test_bad_prompts_raise_at_call_time(ids, n, message):
    with pytest.raises(ValueError, match=message):
        generate(model_for(), ids, n)


def test_zero_new_tokens_yields_nothing():
    assert list(generate(model_for(), [1, 2], 0)) == []


# ============================================================== text streaming
class ScriptedModel(nn.Module):
    """Emits a fixed id sequence greedily: hidden states are one-hot rows of the next id and the
    head is the identity. Lets tests choose exactly which bytes are generated."""

    def __init__(self, script: list[int] | list[list[int]], vocab: int = 256):
        super().__init__()
        self.config = lmlab.ModelConfig(vocab_size=vocab, d_model=vocab, n_heads=1, n_layers=1)
        self.head = nn.Linear(vocab, vocab, bias=False)
        nn.init.eye_(self.head.weight)
        self.scripts = script if script and isinstance(script[0], list) else None  # one per row
        self.script, self.step = script, 0

    def new_cache(self, batch, max_len, dtype=None):
        return None

    def logits_of(self, h):  # as Transformer.logits_of: the decoders read logits through it
        return self.head(h)

    def hidden(self, idx, cache=None, attention_mask=None):
        B, T = idx.shape
        h = torch.zeros(B, T, self.config.vocab_size)
        for b in range(B):
            script = self.scripts[b] if self.scripts else self.script
            h[b, -1, script[min(self.step, len(script) - 1)]] = 1.0
        self.step += 1
        return h


def stream(script: list[int], tokenizer=None, **kw) -> list[str]:
    return list(sample_text(ScriptedModel(script), tokenizer or ByteTokenizer(), "x", len(script), temperature=0, **kw))


def test_byte_stream_emits_only_complete_characters():
    text = "aé😀b日"
    pieces = stream(list(text.encode()))
    assert "".join(pieces) == text
    assert pieces == ["a", "é", "😀", "b", "日"]  # the 2-, 4- and 3-byte characters each arrive whole


def test_invalid_bytes_stream_as_replacement_exactly_like_decode():
    script = list(b"ok \xfe\xc3( \xe6\x97") + list("é".encode())  # stray byte, broken pair, truncated char
    tok = ByteTokenizer()
    pieces = stream(script)
    assert "".join(pieces) == tok.decode(script) == "ok \ufffd\ufffd( \ufffdé"
    trailing = stream(list(b"hi \xe6\x97"))  # unfinished at the end: flushed as one replacement
    assert "".join(trailing) == "hi \ufffd" and trailing[-1] == "\ufffd"


def test_stream_matches_decode_on_random_model_output():
    model = model_for(preset="llama", vocab_size=256, max_seq_len=128)
    tok = ByteTokenizer()
    text = "".join(sample_text(model, tok, "héllo", 80, seed=4))
    ids = [int(t[0]) for t in generate(model, tok.encode("héllo"), 80, seed=4)]
    assert text == tok.decode(ids)


def test_stream_stops_at_eos_and_starts_from_newline_on_empty_prompt():
    model = ScriptedModel(list(b"ab") + [0] + list(b"cd"))
    assert list(sample_text(model, ByteTokenizer(), "", 5, temperature=0, eos_id=0)) == ["a", "b"]


def test_tokenizer_with_only_decode_streams_the_same_text():
    class DecodeOnly:  # e.g. a wrapped third-party tokenizer
        def __init__(self):
            self.inner = ByteTokenizer()

        def encode(self, text):
            return self.inner.encode(text)

        def decode(self, ids):
            return self.inner.decode(ids)

    text = "aé😀b日"
    pieces = stream(list(text.encode()), DecodeOnly())
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)


def test_char_tokenizer_stream():
    tok = CharTokenizer("abcé\n")
    script = tok.encode("cabé") + [tok.unk_id]
    assert stream(script, tok) == ["c", "a", "b", "é", "\ufffd"]


class WordTokenizer:
    """Decodes like SentencePiece's Metaspace or WordPiece: words joined by spaces, with no space
    at the start of a text, and only ``decode`` (no byte table)."""

    words = ["<unk>", "x", "learns", "to", "read"]
    eos_id = None

    def encode(self, text: str) -> list[int]:
        return [self.words.index(w) for w in text.split()]

    def decode(self, ids) -> str:
        return " ".join(self.words[i] for i in ids)


def test_decode_only_tokenizers_keep_the_space_between_prompt_and_continuation():
    pieces = stream([2, 3, 4], tokenizer=WordTokenizer())
    assert pieces == [" learns", " to", " read"]  # decoding new ids alone gave "learnstoread"


# ============================================================== stop strings, several prompts
def test_stream_ends_before_a_stop_string_and_holds_back_what_may_begin_one():
    pieces = stream(list(b"ab<x<end>cd"), stop=["<end>"])
    assert "".join(pieces) == "ab<x"
    assert pieces[:2] == ["a", "b"] and "<" not in pieces[:3]  # "<" waits until "x" shows it is not "<end>"
    assert stream(list(b"one. two"), stop=["zz", ". "]) == ["o", "n", "e"]  # the earliest of several
    assert "".join(stream(list(b"ab<en"), stop=["<end>"])) == "ab<en"  # the held-back end is flushed at the end


def test_stop_string_split_across_tokens_of_a_decode_only_tokenizer():
    class Words(WordTokenizer):
        words = ["<unk>", "x", "the", "end", "more"]

    assert stream([2, 3, 4], tokenizer=Words(), stop=["the end"]) == [" "]  # the text is " the end more"
    assert stream([2, 3, 4], tokenizer=Words(), stop=[" end"]) == [" the"]


def test_complete_rows_finish_independently_and_the_batch_stops_when_all_have():
    scripts = [list(b"ab.cd"), list(b"abc") + [0] + list(b"zz"), list(b"abcdefgh"), list(b"abcd.")]
    model = ScriptedModel(scripts)
    done = complete(model, ByteTokenizer(), ["x", "xy", "xyz", "x"], 6, stop=["."], temperature=0, eos_id=[0, 255])
    assert done == [Completion("ab", "stop"), Completion("abc", "eos"), Completion("abcdef", "length"),
                    Completion("abcd", "stop")]
    model = ScriptedModel(scripts[:2] + scripts[3:])
    assert [c.finish for c in complete(model, ByteTokenizer(), ["x"] * 3, 50, stop=["."], temperature=0, eos_id=0)] == [
        "stop", "eos", "stop"]
    assert model.step == 5  # prefill + 4 steps: the fifth token finished the last row; 50 were allowed


def test_complete_equals_each_prompt_alone():
    model = model_for(preset="llama", vocab_size=256, max_seq_len=128)
    tok = ByteTokenizer()
    prompts = ["héllo", "a", "the quick brown"]
    free = complete(model, tok, prompts, 24, temperature=0)
    stop = [free[0].text[6:8]]  # row 0 stops early; the others may or may not meet it
    together = complete(model, tok, prompts, 24, temperature=0, stop=stop)
    for p, c, f in zip(prompts, together, free):
        alone = "".join(sample_text(model, tok, p, 24, temperature=0, stop=stop))
        assert c.text == alone and f.text.startswith(c.text)
    assert together[0].finish == "stop" and len(together[0].text) <= 6


def test_eos_ids_come_from_the_tokenizer():
    class TwoEnds(ByteTokenizer):
        eos_ids = [3, 4]

    model = ScriptedModel([list(b"ab") + [4], list(b"abc") + [3], list(b"z")])
    assert [c.finish for c in complete(model, TwoEnds(), ["x"] * 3, 5, temperature=0)] == ["eos", "eos", "length"]


# ============================================================== the default decoder
def test_auto_decoder_is_a_cuda_graph_for_dense_models_on_cuda_and_eager_otherwise(tiny):
    """What docs/training.md says ``auto`` picks; the choice reads only the device type and the model."""
    from lmlab.generate import auto_decoder

    dense, moe = lmlab.Transformer(tiny()), lmlab.Transformer(tiny(**{"moe.n_experts": 4, "moe.top_k": 2}))
    assert auto_decoder(dense, torch.device("cuda")) == "graph"
    assert auto_decoder(moe, torch.device("cuda")) == "eager"  # expert dispatch reads counts on the host
    assert auto_decoder(dense, torch.device("cpu")) == "eager" and auto_decoder(moe, torch.device("cpu")) == "eager"
    # compressed attention (DeepSeek-V4) decodes with its own cache, which a fixed-shape graph cannot hold
    v4 = lmlab.Transformer(lmlab.ModelConfig.from_preset("deepseek-v4", moe=None))
    assert not v4.slot_cache and dense.slot_cache and auto_decoder(v4, torch.device("cuda")) == "eager"
