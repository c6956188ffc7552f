"""Sampling from a language model with its KV cache.

    for tok in generate(model, prompt_ids, 100, temperature=0.8, top_k=50, seed=0):
        ...                                        # tok: (B,) new ids, one step at a time
    for piece in sample_text(model, tokenizer, "Once upon", 100):
        print(piece, end="", flush=True)           # complete characters only

The loop: one cache for the whole run (``model.new_cache(B, T + max_new_tokens)``), the prompt
prefilled in one forward, the head applied to the last position only, then one token per
forward. Sampling runs on the model's device, with no host synchronization unless ``eos_id`` is
given; the sampler is assembled once from the arguments, not re-decided at every step.

Positions beyond ``max_seq_len``: schemes that compute positions (rope, alibi, relative,
sinusoidal, none) simply continue, as in length-extrapolation studies. ``learned`` has a table of
``max_seq_len`` rows and no row beyond it, so ``generate`` refuses up front, before any token, a
prompt plus ``max_new_tokens`` longer than the table (it does not crop the context).
"""

from __future__ import annotations

import codecs
import contextlib
import math
from typing import Callable, Iterator

import torch

Sampler = Callable[[torch.Tensor], torch.Tensor]  # logits (B, V) -> ids (B,)


# ============================================================== sampling
def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (ties with the k-th included), -inf elsewhere."""
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus sampling (Holtzman et al. 2020): keep the smallest set of most likely tokens whose
    probability reaches p; the most likely token is always kept."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
    sorted_logits = sorted_logits.masked_fill(before > p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def candidates(
    temperature: float, top_k: int | None, top_p: float | None, vocab_size: int
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]:
    """logits (B, V) -> (probs (B, K), ids (B, K) or None when K = V and ids are positions).

    The fast path of ``softmax(top_p_filter(top_k_filter(logits / temperature)))`` (Hugging
    Face's order): with top-k it works on the k best logits only, so the softmax and the draw
    touch k values instead of the whole vocabulary. Tests check it against the filters above."""
    k = top_k if top_k is not None and top_k < vocab_size else None
    p = top_p if top_p is not None and top_p < 1.0 else None

    def nucleus(sorted_logits: torch.Tensor) -> torch.Tensor:  # (B, K) sorted descending
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs
        return sorted_logits.masked_fill(before > p, float("-inf"))

    if k is not None:  # the k best, sorted descending: (B, k) values and ids
        select = lambda x: x.topk(k, dim=-1)  # noqa: E731
    elif p is not None:  # the whole vocabulary, sorted for the nucleus cut
        select = lambda x: x.sort(dim=-1, descending=True)  # noqa: E731
    else:  # the whole vocabulary as it is; position = id
        select = lambda x: (x, None)  # noqa: E731
    trim = nucleus if p is not None else (lambda x: x)

    def pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        values, ids = select(logits.float() / temperature)
        return trim(values).softmax(dim=-1), ids

    return pick


def make_sampler(
    temperature: float, top_k: int | None, top_p: float | None, generator: torch.Generator | None, vocab_size: int
) -> Sampler:
    """logits (B, V) -> ids (B,): greedy at temperature 0, else a draw from ``generator`` over the
    tokens that temperature, top-k and top-p leave."""
    if temperature == 0:
        return lambda logits: logits.argmax(dim=-1)
    pick = candidates(temperature, top_k, top_p, vocab_size)

    def sample(logits: torch.Tensor) -> torch.Tensor:
        probs, ids = pick(logits)  # (B, K), (B, K) | None
        # argmax p_i / E_i with E_i ~ Exp(1) draws i with probability p_i (the exponential race),
        # with no host synchronization, unlike torch.multinomial on some devices
        race = torch.empty_like(probs).exponential_(1.0, generator=generator)
        choice = (probs / race).argmax(dim=-1)  # (B,)
        return choice if ids is None else ids.gather(-1, choice[:, None]).squeeze(-1)

    return sample


# ============================================================== generation
def context_limit(model) -> int | None:
    """The most positions ``model`` can encode, or None if its position scheme extrapolates.
    Only a learned table has a hard end."""
    return model.config.max_seq_len if model.config.positions == "learned" else None


def _as_batch(prompt_ids, device: torch.device) -> torch.Tensor:
    if isinstance(prompt_ids, torch.Tensor):
        idx = prompt_ids
    else:
        try:
            idx = torch.tensor(list(prompt_ids), dtype=torch.long)
        except (TypeError, ValueError):
            raise ValueError("prompt_ids must be a list of ints or a (B, T) integer tensor") from None
    if idx.dim() == 1:
        idx = idx[None]
    if idx.dim() != 2 or idx.dtype.is_floating_point or idx.dtype == torch.bool:
        raise ValueError(f"prompt_ids must be a list of ints or a (B, T) integer tensor, got shape {tuple(idx.shape)} {idx.dtype}")
    if idx.shape[0] == 0 or idx.shape[1] == 0:
        raise ValueError("prompt_ids is empty; give at least one token (e.g. a newline) to start from")
    return idx.to(device=device, dtype=torch.long)


def _contexts(device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """Inference mode everywhere, plus bf16 autocast on CUDA. Entered around each step, never held
    across a ``yield``, so the caller's code between tokens runs in its own mode."""
    if device.type == "cuda":
        def both():
            stack = contextlib.ExitStack()
            stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
            return stack
        return both
    return torch.inference_mode


def generate(
    model,
    prompt_ids: list[int] | torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_id: int | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the (B,) ids of each new token, ``max_new_tokens`` times or until every row has
    produced ``eos_id`` (a finished row repeats ``eos_id``).

    ``temperature=0`` is greedy. ``seed`` makes sampling reproducible (a generator on the model's
    device); None draws from torch's global generator. Arguments are checked here, before the
    first token: each bad one raises a one-line ValueError.
    """
    vocab = model.config.vocab_size
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} is not valid; it must be an integer >= 0")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
        math.isfinite(temperature) and temperature >= 0
    ):
        raise ValueError(f"temperature={temperature!r} is not valid; it must be a finite number >= 0 (0 = greedy)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k={top_k!r} is not valid; it must be an integer >= 1, or None for no limit")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r} is not valid; it must be in (0, 1], or None for no limit")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed={seed!r} is not valid; it must be an integer, or None")
    if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(eos_id, int) or not 0 <= eos_id < vocab):
        raise ValueError(f"eos_id={eos_id!r} is not valid; it must be a token id in [0, {vocab}), or None")

    device = model.head.weight.device
    idx = _as_batch(prompt_ids, device)  # (B, T)
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(
            f"prompt_ids hold id {lo if lo < 0 else hi}, outside the model's vocabulary [0, {vocab}); "
            "encode the prompt with the tokenizer the model was trained with"
        )
    B, T = idx.shape
    limit = context_limit(model)
    if limit is not None and T + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) = {T + max_new_tokens} exceeds "
            f"max_seq_len={limit}, the size of the learned position table; shorten the prompt or ask "
            f"for at most {max(limit - T, 0)} new tokens"
        )
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    sampler = make_sampler(float(temperature), top_k, top_p, generator, vocab)
    if max_new_tokens == 0:
        return iter(())
    return _decode(model, idx, max_new_tokens, sampler, eos_id, _contexts(device))


def _decode(model, idx: torch.Tensor, n: int, sample: Sampler, eos_id: int | None, ctx) -> Iterator[torch.Tensor]:
    B, T = idx.shape
    was_training = model.training
    model.eval()
    try:
        with ctx():
            cache = model.new_cache(B, T + n)  # preallocated once for the whole run
            logits = model.head(model.hidden(idx, cache)[:, -1])  # prefill: (B, V) for the last position
            done = torch.zeros(B, dtype=torch.bool, device=idx.device)
        for step in range(n):
            with ctx():
                tok = sample(logits)  # (B,)
                if eos_id is not None:
                    tok = tok.masked_fill(done, eos_id)
                    done = done | (tok == eos_id)
            yield tok
            if step == n - 1 or (eos_id is not None and bool(done.all())):
                return
            with ctx():
                logits = model.head(model.hidden(tok[:, None], cache)[:, -1])  # (B, V)
    finally:
        model.train(was_training)


# ============================================================== text
def sample_text(model, tokenizer, prompt: str, max_new_tokens: int, **kwargs) -> Iterator[str]:
    """Stream the text that follows ``prompt`` (not the prompt itself), in complete characters.

    A byte-level token can end inside a multi-byte UTF-8 character; its bytes wait in an
    incremental decoder until the character is whole, so nothing is printed twice or replaced
    early. Invalid sequences become U+FFFD, exactly as ``tokenizer.decode`` would give them.
    An empty prompt starts from the tokenizer's ``bos_id``, or else from a newline.
    ``kwargs`` go to :func:`generate`; ``eos_id`` defaults to ``tokenizer.eos_id`` and stops the text.
    """
    ids = tokenizer.encode(prompt) if prompt else []
    if not ids:
        bos = getattr(tokenizer, "bos_id", None)
        ids = [bos] if bos is not None else tokenizer.encode("\n")
    kwargs.setdefault("eos_id", getattr(tokenizer, "eos_id", None))
    eos_id = kwargs["eos_id"]
    stream = generate(model, ids, max_new_tokens, **kwargs)  # validates now, not at the first next()
    if hasattr(tokenizer, "id_bytes"):
        return _stream_bytes(stream, tokenizer, eos_id)
    return _stream_text(stream, tokenizer, eos_id, prompt_ids=list(ids))


def _stream_bytes(stream: Iterator[torch.Tensor], tokenizer, eos_id: int | None) -> Iterator[str]:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for tok in stream:
        i = int(tok[0])
        if i == eos_id:
            break
        piece = decoder.decode(tokenizer.id_bytes(i))
        if piece:
            yield piece
    tail = decoder.decode(b"", final=True)  # an unfinished character at the end becomes U+FFFD
    if tail:
        yield tail


def _stream_text(
    stream: Iterator[torch.Tensor], tokenizer, eos_id: int | None, prompt_ids: list[int]
) -> Iterator[str]:
    """For tokenizers that only offer ``decode``: decode the prompt plus everything so far and
    emit what is new, holding back a trailing U+FFFD that may be half a character. Decoding with
    the prompt keeps the space that SentencePiece / WordPiece decoders drop at a text's start."""
    ids = list(prompt_ids)
    emitted = len(tokenizer.decode(ids))
    text = ""
    for tok in stream:
        i = int(tok[0])
        if i == eos_id:
            break
        ids.append(i)
        text = tokenizer.decode(ids)
        if not text.endswith("\ufffd") and len(text) > emitted:
            yield text[emitted:]
            emitted = len(text)
    if len(text) > emitted:
        yield text[emitted:]
