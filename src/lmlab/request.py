"""A generation request, checked: the arguments of :func:`lmlab.generate.generate` turned into the
:class:`~lmlab.decoders.Request` a decoder receives. Every bad argument raises a one-line ValueError
naming it, before the first token: prompts (a list, a list of lists left-padded here, or a tensor
with its attention mask), sampling settings, EOS ids, the decoder's own limits, and whether the
KV cache fits on the device.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Sequence

import torch

from .decoders import DECODERS, Request, auto_decoder, check_graphable, check_speculative, context_limit
from .memory import check_generation_fits
from .sampling import Noise, make_picker, make_probabilities, noise_width

SYNC_EVERY_CUDA = 16
# How far past max_seq_len a scheme that extrapolates (rotary, ALiBi, relative) may be asked to generate: the
# positions experiment measures up to 16x the trained length; beyond it the output is unmeasured, and the
# prefill's attention, quadratic in the prompt, runs for minutes (a 120,000-token prompt at max_seq_len 256)
EXTRAPOLATION_LIMIT = 16


# ============================================================== prompts
def left_pad(rows: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths as (B, T) ids and a (B, T) attention mask, pads on the left
    (where generation needs them: every row's last token is real)."""
    T = max(len(r) for r in rows)
    idx = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        if len(r):
            idx[b, T - len(r):] = torch.as_tensor(list(r), dtype=torch.long)
            mask[b, T - len(r):] = 1
    return idx, mask


PROMPT_USAGE = "prompt_ids must be a list of ints, a list of such lists, or a (B, T) integer tensor"


def _as_tensor(prompt_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T) ids and the mask as given; a list of lists is left-padded here."""
    if isinstance(prompt_ids, torch.Tensor):
        return prompt_ids, attention_mask
    rows = list(prompt_ids)
    if rows and attention_mask is None and all(isinstance(r, (list, tuple, torch.Tensor)) for r in rows):
        empty = [len(r) for r in rows].index(0) if any(len(r) == 0 for r in rows) else None
        if empty is not None:
            raise ValueError(f"prompt {empty} is empty; give at least one token (e.g. a newline) to start from")
        try:
            return left_pad([[int(i) for i in r] for r in rows])
        except (TypeError, ValueError):
            raise ValueError(PROMPT_USAGE) from None
    try:
        return torch.tensor(rows, dtype=torch.long), attention_mask
    except (TypeError, ValueError):
        raise ValueError(PROMPT_USAGE) from None


def _as_batch(prompt_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Checked (B, T) ids with pads set to 0, and the (B, T) mask, None when nothing is padded."""
    idx, attention_mask = _as_tensor(prompt_ids, attention_mask)
    if idx.dim() == 1:
        idx = idx[None]
    if idx.dim() != 2 or idx.dtype.is_floating_point or idx.dtype == torch.bool:
        raise ValueError(f"{PROMPT_USAGE}, got shape {tuple(idx.shape)} {idx.dtype}")
    if idx.shape[0] == 0 or idx.shape[1] == 0:
        raise ValueError("prompt_ids is empty; give at least one token (e.g. a newline) to start from")
    if attention_mask is None:
        return idx.long(), None
    mask = torch.as_tensor(attention_mask)
    if mask.shape != idx.shape or not ((mask == 0) | (mask == 1)).all():
        raise ValueError(
            f"attention_mask must be 0/1 with the prompt's shape {tuple(idx.shape)}, got {tuple(mask.shape)}"
        )
    mask = mask.long().to(idx.device)
    if (mask[:, 1:] < mask[:, :-1]).any() or not mask[:, -1].all():
        raise ValueError("attention_mask must pad on the left (0s, then 1s, in every row) so that each row ends "
                         "with a real token; use generate.left_pad to build the batch")
    return idx.long().masked_fill(mask == 0, 0), None if mask.all() else mask


# ============================================================== the other arguments
def _check(name: str, value, ok: bool, need: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is not valid; {need}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_arguments(vocab, max_new_tokens, temperature, top_k, top_p, seed, eos_id, decoder, sync_every) -> list[int]:
    """Each bad argument raises a one-line ValueError naming it; returns the EOS ids as a list."""
    _check(
        "max_new_tokens", max_new_tokens, _is_int(max_new_tokens) and max_new_tokens >= 0, "it must be an integer >= 0"
    )
    _check("temperature", temperature, isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
           and math.isfinite(temperature) and temperature >= 0, "it must be a finite number >= 0 (0 = greedy)")
    _check(
        "top_k",
        top_k,
        top_k is None or (_is_int(top_k) and top_k >= 1),
        "it must be an integer >= 1, or None for no limit",
    )
    _check(
        "top_p",
        top_p,
        top_p is None or (isinstance(top_p, (int, float)) and not isinstance(top_p, bool) and 0 < top_p <= 1),
        "it must be in (0, 1], or None for no limit",
    )
    _check("seed", seed, seed is None or _is_int(seed), "it must be an integer, or None")
    eos = (
        [eos_id]
        if eos_id is None or _is_int(eos_id)
        else list(eos_id)
        if isinstance(eos_id, (list, tuple))
        else [eos_id]
    )
    _check("eos_id", eos_id, all(e is None or (_is_int(e) and 0 <= e < vocab) for e in eos),
           f"it must be a token id in [0, {vocab}), a list of them, or None")
    _check("decoder", decoder, decoder in DECODERS or decoder == "auto", f"choose one of {['auto', *DECODERS]}")
    _check(
        "sync_every",
        sync_every,
        sync_every is None or (_is_int(sync_every) and sync_every >= 1),
        "it must be an integer >= 1",
    )
    return [e for e in eos if e is not None]


# ============================================================== the request
def _contexts(device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """Inference mode everywhere, plus bf16 autocast on CUDA. Entered around each chunk of steps,
    never held across a ``yield``, so the caller's code between tokens runs in its own mode.
    Autocast's cache of cast weights is off: a captured CUDA graph would keep reading copies
    that the cache frees on exit (PyTorch's CUDA-graph notes), and a step uses each weight once."""
    if device.type == "cuda":
        def both():
            stack = contextlib.ExitStack()
            stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False))
            return stack
        return both
    return torch.inference_mode

def make_request(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, eos_id, attention_mask,
                 decoder, sync_every) -> tuple[Request, str]:
    """The request and the decoder's name, every argument checked before the first token."""
    vocab = model.config.vocab_size
    eos = _check_arguments(vocab, max_new_tokens, temperature, top_k, top_p, seed, eos_id, decoder, sync_every)
    device = model.head.weight.device
    idx, mask = _as_batch(prompt_ids, attention_mask)
    idx = idx.to(device)
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"prompt_ids hold id {lo if lo < 0 else hi}, outside the model's vocabulary [0, {vocab}); "
                         "encode the prompt with the tokenizer the model was trained with")
    B, T = idx.shape
    limit = context_limit(model)
    if decoder == "speculative":
        check_speculative(model, T + max_new_tokens, limit)
    if limit is not None and T + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({T} tokens) + max_new_tokens ({max_new_tokens}) = {T + max_new_tokens} exceeds "
            f"max_seq_len={limit}, the size of the learned position table; shorten the prompt or ask "
            f"for at most {max(limit - T, 0)} new tokens")
    weights = model.head.weight.dtype
    cache_dtype = torch.bfloat16 if device.type == "cuda" and weights == torch.float32 else weights
    check_generation_fits(model.config, B, T + max_new_tokens, device, cache_dtype.itemsize)
    reach = EXTRAPOLATION_LIMIT * model.config.max_seq_len
    if limit is None and T + max_new_tokens > reach:
        raise ValueError(
            f"prompt ({T:,} tokens) + max_new_tokens ({max_new_tokens:,}) = {T + max_new_tokens:,} is more than "
            f"{EXTRAPOLATION_LIMIT} x max_seq_len={model.config.max_seq_len} ({reach:,}), the furthest past its "
            f"context lmlab generates; shorten the prompt (keep its last {max(reach - max_new_tokens, 0):,} tokens) "
            f"or ask for fewer new tokens")
    decoder = auto_decoder(model, device) if decoder == "auto" else decoder
    if decoder == "graph":
        check_graphable(model, device)
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    sampling = temperature != 0 and max_new_tokens > 0
    return Request(
        model, idx, None if mask is None else mask.to(device), max_new_tokens,
        make_picker(float(temperature), top_k, top_p, vocab),
        Noise(B, noise_width(top_k, top_p, vocab), generator, device) if sampling else None,
        torch.tensor(eos, device=device) if eos else None, eos[0] if eos else 0,
        sync_every or (SYNC_EVERY_CUDA if device.type == "cuda" else 1), _contexts(device),
        cache_dtype, make_probabilities(float(temperature), top_k, top_p, vocab) if sampling else None,
    ), decoder

