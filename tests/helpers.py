"""What several test files share: a word corpus, the tiny CLI model and the fast run settings.

Import with ``from helpers import ...`` (pytest puts tests/ on sys.path). conftest.py keeps the
fixtures; this module keeps the plain data and builders, so no test file copies them.
"""

from __future__ import annotations

from pathlib import Path

import torch

import lmlab

# the model-layer tiny config: d_model 32, 2 layers, 4 heads, vocab 64, context 32
TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=32)


def decoded_logits(model, idx: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits (B, T, V) of ``idx`` (B, T) decoded through a KV cache: a prefill of ``prefill`` tokens, then
    one token per forward; equal to the full forward's where the cache is right."""
    cache = model.new_cache(idx.shape[0], idx.shape[1])
    with torch.no_grad():
        parts = [model(idx[:, :prefill], cache=cache).logits]
        parts += [model(idx[:, t : t + 1], cache=cache).logits for t in range(prefill, idx.shape[1])]
    return torch.cat(parts, dim=1)


def assert_comes_back_identical(original: Path, exported: Path) -> None:
    """A Hugging Face checkpoint directory read by lmlab and written back (``exported``) holds the same tensors,
    bit for bit, and a config.json that maps to the same lmlab config."""
    import json

    from lmlab.hf import config_from_hf, read_safetensors

    a, b = read_safetensors(original), read_safetensors(exported)
    assert sorted(a) == sorted(b)
    assert not [n for n in a if not torch.equal(a[n], b[n])]
    before, after = (json.loads((p / "config.json").read_text()) for p in (original, exported))
    assert config_from_hf(after) == config_from_hf(before)


def tiny_config(**overrides) -> lmlab.ModelConfig:
    """d_model 32, 2 layers, 4 heads, vocab 64, context 32; any field (dotted keys too) overridable."""
    nested = {k: v for k, v in overrides.items() if "." in k}
    flat = {k: v for k, v in overrides.items() if "." not in k}
    cfg = lmlab.ModelConfig(**{**TINY, **flat})
    return cfg.override(nested) if nested else cfg


def tokens(batch: int, length: int, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    """Reproducible random token ids (batch, length)."""
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_mtp_cache_equals_full(model, T: int, seed: int = 6) -> None:
    """The MTP blocks' own cache (speculative decoding's drafts), fed in chunks (5, 1, the rest), gives every
    depth's states of the full forward over a sequence of T + 1 tokens."""
    from torch.testing import assert_close

    x = tokens(2, T + 1, seed=seed)
    with torch.no_grad():
        h, ctx = model.hidden_and_context(x[:, :-1])
        full = model.mtp.hidden_states(h, x[:, 1:], ctx, model.embed_tokens)
        cache, parts = model.new_cache(2, T, mtp=True), [[] for _ in model.mtp.layers]
        padded = torch.cat([x, x.new_zeros(2, model.mtp.depth)], dim=1)  # the full forward embeds id 0 past the end
        for a, b in [(0, 5), (5, 6), (6, T)]:
            ctx, hk = model.context(x[:, a:b], cache), h[:, a:b]
            for k, module in enumerate(model.mtp.layers):
                hk = module(hk, model.embed_tokens(padded[:, a + k + 1 : b + k + 1]), ctx, cache)
                parts[k].append(module.norm(hk))
            cache.advance(b - a)
    for k, want in enumerate(full):
        assert_close(torch.cat(parts[k], dim=1), want, rtol=1e-4, atol=1e-5)


WORDS = "the a model learns to predict next token from context attention layer norm residual stream".split()

# the tiny model as command-line overrides: d_model 32, 2 layers, 4 heads (2 kv), context 32
TINY_ARGS = ["--model.d_model", "32", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
             "--model.max_seq_len", "32"]

# the same tiny model as ModelConfig fields, on the byte vocabulary
TINY_MODEL = dict(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)

# a tiny run's sections as dotted fields: 8 steps, evaluation and a checkpoint every 4
FAST_RUN = {"train.steps": 8, "train.batch_size": 4, "optim.warmup_steps": 2, "optim.lr": 3e-3, "eval.every": 4,
            "eval.batches": 2, "checkpoint.every": 4, "log.every": 1, "log.tensorboard": False,
            "log.sample_tokens": 0, "train.device": "cpu"}


def fast_args(sample_tokens: int = 0, quiet: bool = True) -> list[str]:
    """Command-line settings for a fast CPU run: small batches, a log record every step, no TensorBoard."""
    args = ["--train.batch_size", "4", "--eval.batches", "2", "--optim.warmup_steps", "2", "--log.every", "1",
            "--log.tensorboard", "false", "--log.sample_tokens", str(sample_tokens), "--train.device", "cpu"]
    return args + (["--quiet"] if quiet else [])


def corpus(path: Path, n_words: int = 6000) -> Path:
    """A reproducible text file of ``n_words`` words drawn from WORDS (seed 0)."""
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, len(WORDS), (n_words,), generator=g).tolist()
    path.write_text(" ".join(WORDS[i] for i in idx) + "\n")
    return path


def overriding(args: list[str], *extra: str) -> list[str]:
    """``args`` then ``extra``, leaving out the ``--SECTION.FIELD VALUE`` pairs of ``args`` that ``extra``
    gives again: the command line refuses a field given twice."""
    given = {str(a).split("=")[0] for a in extra if str(a).startswith("--")}
    kept, i = [], 0
    while i < len(args):
        pair = str(args[i]).startswith("--") and "." in str(args[i]) and "=" not in str(args[i])
        if str(args[i]).split("=")[0] not in given:
            kept += args[i:i + 1 + pair]
        i += 1 + pair
    return [*kept, *extra]
