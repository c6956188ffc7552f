"""Choosing the next token from logits: greedy, temperature, top-k, top-p, with the randomness
drawn ahead of time so that a decoding step holds none.

    pick = make_picker(temperature=0.8, top_k=50, top_p=None, vocab_size=V)
    noise = Noise(batch, noise_width(50, None, V), generator, device)
    ids = pick(logits, noise.row(step))                  # (B, V) logits -> (B,) ids

Sampling is the Gumbel-max trick: with G_i = -log E_i, E_i ~ Exp(1) drawn independently,
argmax_i (l_i / T + G_i) is i with probability softmax(l / T)_i (Gumbel 1954; as an
"exponential race", argmax p_i / E_i). No softmax is needed unless top-p must cut the
distribution. The draw is a deterministic function of the logits and a noise tensor, which is
what lets a compiled or CUDA-graph-captured step sample without a random generator inside it
and without any host synchronization (``torch.multinomial`` synchronizes on some devices).
:class:`Noise` draws a chunk of steps' noise at once from one generator; the eager loop and
every fast path read the same rows, so they pick the same tokens.

``top_k_filter`` and ``top_p_filter`` are the readable references (Hugging Face's order:
temperature, then top-k, then top-p); :func:`candidates` is the fast path, tested equal.
"""

from __future__ import annotations

from typing import Callable

import torch

Picker = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]  # (logits (B, V), gumbel (B, K)) -> ids (B,)
Sampler = Callable[[torch.Tensor], torch.Tensor]  # logits (B, V) -> ids (B,)

NOISE_ELEMENTS = 1 << 22  # at most this many noise values drawn at once (16 MiB in fp32)
NOISE_STEPS = 64  # and at most this many steps' worth


# ============================================================== the references
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


# ============================================================== the fast path
def effective_top_k(top_k: int | None, vocab_size: int) -> int | None:
    return top_k if top_k is not None and top_k < vocab_size else None


def candidates(
    temperature: float, top_k: int | None, top_p: float | None, vocab_size: int
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]:
    """logits (B, V) -> (scaled logits (B, K), -inf where filtered out; ids (B, K) or None when
    K = V and ids are positions).

    The fast path of ``top_p_filter(top_k_filter(logits / temperature))``: with top-k it works on
    the k best logits only, so the nucleus cut and the draw touch k values instead of the whole
    vocabulary. Tests check its softmax against the filters above."""
    k = effective_top_k(top_k, vocab_size)
    p = top_p if top_p is not None and top_p < 1.0 else None

    def nucleus(sorted_logits: torch.Tensor) -> torch.Tensor:  # (B, K) sorted descending
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs
        return sorted_logits.masked_fill(before > p, float("-inf"))

    # dividing by the temperature keeps the order, so top-k selects first and divides k values only
    if k is not None:  # the k best, sorted descending: (B, k) values and ids
        select = lambda x: x.topk(k, dim=-1)  # noqa: E731
    elif p is not None:  # the whole vocabulary, sorted for the nucleus cut
        select = lambda x: x.sort(dim=-1, descending=True)  # noqa: E731
    else:  # the whole vocabulary as it is; position = id
        select = lambda x: (x, None)  # noqa: E731
    trim = nucleus if p is not None else (lambda x: x)

    def pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        values, ids = select(logits)
        return trim(values.float() / temperature), ids

    return pick


def noise_width(top_k: int | None, top_p: float | None, vocab_size: int) -> int:
    """K: how many noise values one row of one step needs (the candidates' count)."""
    return effective_top_k(top_k, vocab_size) or vocab_size


def make_picker(temperature: float, top_k: int | None, top_p: float | None, vocab_size: int) -> Picker:
    """(logits (B, V), gumbel (B, K) Gumbel(0, 1) draws or None) -> ids (B,): greedy at
    temperature 0 (noise unused), else the Gumbel-max draw over the candidates."""
    if temperature == 0:
        return lambda logits, gumbel=None: logits.argmax(dim=-1)
    pick = candidates(temperature, top_k, top_p, vocab_size)

    def gumbel_max(logits: torch.Tensor, gumbel: torch.Tensor | None) -> torch.Tensor:
        scaled, ids = pick(logits)  # (B, K), (B, K) | None
        choice = (scaled + gumbel).argmax(dim=-1)  # (B,)
        return choice if ids is None else ids.gather(-1, choice[:, None]).squeeze(-1)

    return gumbel_max


def make_sampler(
    temperature: float, top_k: int | None, top_p: float | None, generator: torch.Generator | None, vocab_size: int
) -> Sampler:
    """logits (B, V) -> ids (B,) with fresh noise from ``generator`` at every call: the picker for
    one-off use (decoding loops use :class:`Noise`, so that every path reads the same draws)."""
    pick = make_picker(temperature, top_k, top_p, vocab_size)
    width = noise_width(top_k, top_p, vocab_size)

    def sample(logits: torch.Tensor) -> torch.Tensor:
        if temperature == 0:
            return pick(logits, None)
        return pick(logits, gumbel_(torch.empty(logits.shape[0], width, device=logits.device), generator))

    return sample


def make_probabilities(temperature: float, top_k: int | None, top_p: float | None,
                       vocab_size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """logits (..., V) -> the distribution (..., V), fp32, that the picker samples from at this temperature,
    top-k and top-p: softmax(top_p_filter(top_k_filter(logits / temperature))). Speculative sampling's
    acceptance rule needs it as numbers (``speculative.accept_drafts``)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: a distribution needs temperature > 0 (0 is greedy)")
    k = effective_top_k(top_k, vocab_size)
    p = top_p if top_p is not None and top_p < 1.0 else None

    def probabilities(logits: torch.Tensor) -> torch.Tensor:
        x = logits.float().reshape(-1, logits.shape[-1]) / temperature  # (N, V)
        x = top_k_filter(x, k) if k is not None else x
        x = top_p_filter(x, p) if p is not None else x
        return x.softmax(dim=-1).view(logits.shape)

    return probabilities


# ============================================================== the randomness, ahead of time
def gumbel_(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Fill ``x`` with Gumbel(0, 1) draws, -log E with E ~ Exp(1), in place. An exponential draw
    of exactly 0 (u = 0 in -log(1 - u)) becomes the smallest positive float, so every draw is
    finite: a filtered-out candidate's -inf logit stays -inf and is never chosen."""
    return x.exponential_(1.0, generator=generator).clamp_min_(torch.finfo(x.dtype).tiny).log_().neg_()


class Noise:
    """Gumbel(0, 1) draws for sampling: ``buf`` (C, B, K) holds C steps' worth, redrawn
    from ``generator`` (None: torch's global one) whenever step t with t % C == 0 begins.

    The decoding loop calls ``begin(t)`` on the host before step t; step t reads row t % C, on
    the host (``row``) or inside a captured step (``buf`` indexed with a device counter). The
    buffer stays at one address, so a CUDA graph can read it."""

    def __init__(self, batch: int, width: int, generator: torch.Generator | None, device: torch.device):
        self.chunk = max(1, min(NOISE_STEPS, NOISE_ELEMENTS // (batch * width)))
        self.buf = torch.empty(self.chunk, batch, width, device=device)  # (C, B, K)
        self.generator = generator

    def begin(self, t: int) -> None:
        if t % self.chunk == 0:
            gumbel_(self.buf, self.generator)

    def row(self, t: int) -> torch.Tensor:
        return self.buf[t % self.chunk]  # (B, K)
