"""Generating from a language model with its KV cache: one prompt or a padded batch, as token
ids or as text, with EOS ids and stop strings.

    for tok in generate(model, prompt_ids, 100, temperature=0.8, top_k=50, seed=0):
        ...                                        # tok: (B,) new ids, one step at a time
    for piece in sample_text(model, tokenizer, "Once upon", 100, stop=["\\n\\n"]):
        print(piece, end="", flush=True)           # complete characters only
    done = complete(model, tokenizer, ["Hello", "Once upon a time"], 50, temperature=0)
    done[1].text, done[1].finish                   # the continuation; "eos", "stop" or "length"

Prompts of different lengths go in one batch, left-padded, with an attention mask: pads are
never attended to and positions count real tokens only, so each row continues exactly as it
would alone (and as Hugging Face's ``generate`` does on the same padded batch).

Decoders (``decoder=``): ``eager``, the reference loop, read it first; ``static``, one fixed-shape
step; ``compiled`` and ``graph``, that step compiled or captured as a CUDA graph; ``speculative``,
drafted by the multi-token prediction modules; ``auto`` (the default) picks ``graph`` on CUDA where
it can, else ``eager``. Each is tested to give the same tokens as ``eager``; ``decoders.py`` says
what each does and when it pays off, and how ``sync_every`` works.

Positions beyond ``max_seq_len``: schemes that compute positions (rope, alibi, relative,
sinusoidal, none) simply continue, as in length-extrapolation studies. ``learned`` has a table of
``max_seq_len`` rows and no row beyond it, so ``generate`` refuses up front, before any token, a
prompt plus ``max_new_tokens`` longer than the table (it does not crop the context).

Where things are: this file holds the entry points and the loop that drives a decoder;
``request.py`` checks the arguments and builds the :class:`~lmlab.decoders.Request`;
``decoders.py`` holds the decoders; ``text_stream.py`` turns tokens into text (stop strings,
streaming, whole characters).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

# What lmlab.generate has always offered stays importable from here; each lives in the module named.
from .decoders import (  # noqa: F401
    COMPILED,
    DECODERS,
    STATIC_LEN_MULTIPLE,
    GraphRunner,
    Request,
    StepState,
    auto_decoder,
    capture_cuda_graph,
    check_graphable,
    check_speculative,
    compiled_step,
    context_limit,
    decode_compiled,
    decode_eager,
    decode_fixed,
    decode_graph,
    decode_speculative,
    decode_static,
    decode_step,
    is_eos,
    static_length,
    warm_on_side_stream,
)
from .request import PROMPT_USAGE, SYNC_EVERY_CUDA, left_pad, make_request  # noqa: F401
from .sampling import make_sampler, top_k_filter, top_p_filter  # noqa: F401
from .text_stream import Completion, TextRow, encode_prompt, eos_ids, feed_rows, stream_row  # noqa: F401

__all__ = [
    "Completion", "DECODERS", "complete", "context_limit", "decode_step", "eos_ids", "generate", "left_pad",
    "generate_chunks", "make_sampler", "sample_text", "top_k_filter", "top_p_filter",
]


def generate(
    model,
    prompt_ids: list[int] | list[list[int]] | torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    eos_id: int | Sequence[int] | None = None,
    attention_mask: torch.Tensor | None = None,
    decoder: str = "auto",
    sync_every: int | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the (B,) ids of each new token, ``max_new_tokens`` times or until every row has
    produced one of ``eos_id`` (an id or a list of ids, as generation_config.json allows; a
    finished row repeats the first).

    ``prompt_ids``: one prompt (a list of ints), several (a list of lists, left-padded here), or
    a (B, T) tensor with an optional ``attention_mask`` (1 = real, 0 = pad; left padding).
    ``temperature=0`` is greedy. ``seed`` makes sampling reproducible (a generator on the model's
    device); None draws from torch's global generator. ``decoder`` and ``sync_every``: see
    :mod:`lmlab.decoders`. Arguments are checked here, before the first token: each bad one raises a
    one-line ValueError.
    """
    chunks = generate_chunks(model, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                             seed=seed, eos_id=eos_id, attention_mask=attention_mask, decoder=decoder,
                             sync_every=sync_every)
    return (row for chunk in chunks for row in chunk)


def generate_chunks(model, prompt_ids, max_new_tokens: int, *, temperature: float = 1.0, top_k=None, top_p=None,
                    seed=None, eos_id=None, attention_mask=None, decoder: str = "auto",
                    sync_every=None) -> Iterator[torch.Tensor]:
    """:func:`generate`, yielding the tokens as the host receives them: (c, B) for c consecutive
    steps after each look at the device. Validates now, not at the first ``next``."""
    request, decoder = make_request(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, eos_id,
                                    attention_mask, decoder, sync_every)
    if max_new_tokens == 0:
        return iter(())
    return _eval_mode(model, DECODERS[decoder](request))


def _eval_mode(model, chunks: Iterator[torch.Tensor]) -> Iterator[torch.Tensor]:
    was_training = model.training
    model.eval()
    try:
        yield from chunks
    finally:
        model.train(was_training)


# ============================================================== text
def sample_text(model, tokenizer, prompt: str, max_new_tokens: int, *, stop: Sequence[str] = (),
                **kwargs) -> Iterator[str]:
    """Stream the text that follows ``prompt`` (not the prompt itself), in complete characters,
    ending before the first of ``stop`` (strings), at an EOS id or after ``max_new_tokens``.
    ``kwargs`` go to :func:`generate`; ``eos_id`` defaults to the tokenizer's (:func:`eos_ids`)."""
    kwargs.setdefault("eos_id", eos_ids(tokenizer))
    ids = encode_prompt(tokenizer, prompt)
    chunks = generate_chunks(model, ids, max_new_tokens, **kwargs)  # validates now, not at the first next()
    return stream_row(chunks, TextRow(tokenizer, ids, stop), kwargs["eos_id"])


def complete(
    model, tokenizer, prompts: Sequence[str], max_new_tokens: int, *, stop: Sequence[str] = (), **kwargs
) -> list[Completion]:
    """The continuations of several prompts, generated together as one left-padded batch. Each
    row finishes on its own (EOS id, stop string or length); the batch stops when all have.
    ``kwargs`` go to :func:`generate`; ``eos_id`` defaults to the tokenizer's (:func:`eos_ids`)."""
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings")
    kwargs.setdefault("eos_id", eos_ids(tokenizer))
    ids = [encode_prompt(tokenizer, p) for p in prompts]
    rows = [TextRow(tokenizer, i, stop) for i in ids]
    eos = kwargs["eos_id"]
    chunks = generate_chunks(model, ids, max_new_tokens, **kwargs)
    for _ in feed_rows(chunks, rows, [eos] if isinstance(eos, int) else eos):
        pass
    for row in rows:
        row.close("length")
    return [Completion(row.text, row.finish) for row in rows]
