"""Self-speculative decoding with the multi-token prediction modules as the draft (DeepSeek-V3
sec. 5.4.3; Leviathan et al. 2023, arXiv:2211.17192, and Chen et al. 2023, arXiv:2302.01318, for
the verify-and-accept scheme), greedy or sampling.

Each round, after the last committed token x_{n-1} (the main model's hidden state h^0 for slot
n-2 in hand):

    draft    MTP module k (k = 1 .. D) at slot n-2 reads h^{k-1} and Emb(x_{n-2+k}) and proposes
             d_k for x_{n-1+k} (its argmax, or a draw from its distribution q_k); x_{n-1+k} is the
             draft d_{k-1} when k > 1
    verify   one forward of the main model over [x_{n-1}, d_1, ..., d_D] gives its distributions
             p_0 .. p_D, p_j for slot n + j
    accept   the longest prefix of accepted drafts: a of them; commit a + 1 tokens, the accepted
             drafts and one token of the main model's own (:class:`Greedy`, :class:`Sampling`)

Greedy (temperature 0): d_k is accepted while it equals argmax p_{k-1}, and the last token is
argmax p_a. Every committed token is the main model's own argmax given the committed tokens
before it, so the output equals plain greedy decoding (``generate(..., decoder="eager",
temperature=0)``), up to floating-point ties between two logits (a verify forward over D + 1
tokens rounds a little differently from D + 1 one-token forwards).

Sampling (:func:`accept_drafts`): d_k ~ q_k is accepted with probability min(1, p_{k-1}(d_k) /
q_k(d_k)); the first rejected draft is replaced by a draw from norm(max(0, p - q)), and when all
D are accepted, a token is drawn from p_D. Each committed token is then distributed exactly as
plain sampling's, p and q being the distributions after temperature, top-k and top-p
(``sampling.make_probabilities``). The random draws differ from plain sampling's, so a seed gives
other tokens than ``decoder="eager"`` with the same seed, from the same distribution.

Caches: the main blocks' (slots 0 .. n-2, committed tokens only) and the MTP blocks' own (one
layer per module). A slot of the MTP cache is exact once every module read committed tokens
there (slots up to n-1-D); the slots after it read drafts and are computed again next round.

A padded batch advances in lockstep: a round commits a + 1 tokens to every row, where a is the
least number accepted by a row still generating. A row that accepted more commits its accepted
draft at slot n + a (its greedy token, or a draw from p_a: the acceptance rule's output at that
slot, whatever the other rows did); only the speed-up shrinks.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import torch

Probabilities = Callable[[torch.Tensor], torch.Tensor]  # logits (..., V) -> the sampled distribution (..., V)


@dataclasses.dataclass
class SpeculationStats:
    """Counts over a generation, for the acceptance rate and tokens per verifying forward."""

    rounds: int = 0  # verifying forwards of the main model
    drafted: int = 0  # draft tokens proposed to rows still generating
    accepted: int = 0  # of those, the ones the acceptance rule confirmed (before a row's first miss)
    advanced: int = 0  # tokens the batch advanced by in those rounds (a + 1 per round)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.drafted, 1)

    @property
    def tokens_per_round(self) -> float:
        return self.advanced / max(self.rounds, 1)


# ============================================================== the acceptance rules
def accept_drafts(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling's rule (Leviathan et al. 2023, alg. 1; Chen et al. 2023, alg. 2).

    p (B, D+1, V): the main model's distributions for slots n .. n+D; q (B, D, V): the drafts' own, from which
    ``drafts`` (B, D) were drawn. Returns (tokens (B, D+1), accepted (B,)): draft k+1 is accepted with
    probability min(1, p_k(d) / q_k(d)), ``accepted`` counts the drafts before the first rejection, and
    tokens[:, j] is the draft for j < accepted, then at j = accepted a draw from norm(max(0, p_j - q_j)) (from
    p_D when every draft was accepted). tokens[:, :accepted + 1] are then distributed as plain sampling's."""
    B, D = drafts.shape
    u = torch.rand(B, D, device=p.device, generator=generator)
    p_d, q_d = (x[:, :D].gather(-1, drafts[..., None]).squeeze(-1) for x in (p, q))  # (B, D)
    accepted = (u * q_d < p_d).long().cumprod(-1).sum(-1)  # (B,): u < p/q, without dividing
    residual = torch.cat([(p[:, :D] - q).clamp(min=0), p[:, D:]], dim=1)  # (B, D+1, V); slot D: p_D itself
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p)  # p = q exactly: never rejected
    redraw = torch.multinomial(residual.flatten(0, 1), 1, generator=generator).view(B, D + 1)
    tokens = torch.cat([drafts, redraw[:, D:]], dim=1)  # (B, D+1)
    at = torch.arange(D + 1, device=p.device)
    return torch.where(at == accepted[:, None], redraw, tokens), accepted


class Greedy:
    """Temperature 0: drafts are the modules' argmax, accepted while they equal the main model's."""

    def pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, None]:
        return logits.argmax(-1), None  # (B,), no distribution to remember

    def verify(self, logits: torch.Tensor, drafts: torch.Tensor,
               q: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits (B, D+1, V) -> (the greedy tokens g_0 .. g_D (B, D+1), drafts before the first miss (B,))."""
        g = logits.argmax(-1)
        return g, (g[:, : drafts.shape[1]] == drafts).long().cumprod(-1).sum(-1)


class Sampling:
    """Temperature > 0: drafts drawn from the modules' distributions, kept or redrawn by :func:`accept_drafts`.
    ``probs`` maps logits to the distribution plain sampling draws from (temperature, top-k, top-p)."""

    def __init__(self, probs: Probabilities, generator: torch.Generator | None):
        self.probs, self.generator = probs, generator

    def pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.probs(logits)  # (B, V)
        return torch.multinomial(q, 1, generator=self.generator).squeeze(-1), q

    def verify(self, logits: torch.Tensor, drafts: torch.Tensor,
               q: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return accept_drafts(self.probs(logits), q, drafts, self.generator)


Rule = Greedy | Sampling


# ============================================================== one generation's state
class Speculator:
    """The state of one speculative generation: both caches, the tokens by slot (committed, then
    the current drafts) and the main model's hidden states by slot (the first module's input)."""

    def __init__(self, model, idx: torch.Tensor, mask: torch.Tensor | None, n: int, cache_dtype: torch.dtype,
                 rule: Rule | None = None):
        B, T = idx.shape
        self.model, self.D, self.rule = model, model.mtp.depth, rule or Greedy()
        self.q: torch.Tensor | None = None  # (B, D, V) the drafts' distributions (sampling only)
        room = T + n + 2 * self.D + 2  # every slot a round can write, drafts included
        self.cache = model.new_cache(B, room, dtype=cache_dtype)
        self.mtp_cache = model.new_cache(B, room, dtype=cache_dtype, mtp=True)
        self.seq = torch.zeros(B, room + self.D, dtype=torch.long, device=idx.device)  # (B, S) ids by slot
        self.seq[:, :T] = idx
        self.real = None if mask is None else torch.ones_like(self.seq, dtype=torch.long)  # (B, S) 1 = not a pad
        if self.real is not None:
            self.real[:, :T] = mask
        self.H: torch.Tensor | None = None  # (B, room, C) main hidden states by slot, made at the prefill
        self.room, self.n = room, T  # n: committed slots

    def prefill(self) -> torch.Tensor:
        """The prompt through the main model; returns its next token (B,) (greedy, or drawn) and commits it."""
        model, T = self.model, self.n
        h = model.hidden(self.seq[:, :T], self.cache, None if self.real is None else self.real[:, :T])  # (B, T, C)
        self.H = h.new_zeros(h.shape[0], self.room, h.shape[2])
        self.H[:, :T] = h
        first = self.rule.pick(model.logits_of(h[:, -1]))[0]  # (B,)
        self.seq[:, T] = first
        self.n = T + 1
        return first

    def draft(self) -> None:
        """The MTP modules over the slots from their cache's exact end to n-2; writes drafts d_1 .. d_D
        into slots n .. n+D-1 of ``seq``."""
        model, c = self.model, self.mtp_cache
        # the last pass fed slots .. L-1 (L = its n - 1); every module read committed tokens up to slot L-D
        c.rewind(max(c.length + 1 - self.D, 0))
        s, e = c.length, self.n - 1  # feed slots s .. e-1 (e-1 = n-2, the last slot the main model read)
        ctx = model.context(self.seq[:, s:e], c, None if self.real is None else self.real[:, s:e])
        h = self.H[:, s:e]  # (B, e-s, C)
        qs = []
        for k, module in enumerate(model.mtp.layers):  # module k+1 reads x_{i+k+1} at slot i
            h = module(h, model.embed_tokens(self.seq[:, s + k + 1 : e + k + 1]), ctx, c)
            # d_{k+1}, for slot n + k
            self.seq[:, e + k + 1], q = self.rule.pick(model.logits_of(module.norm(h[:, -1])))
            qs.append(q)
        self.q = None if qs[0] is None else torch.stack(qs, dim=1)  # (B, D, V)
        c.advance(e - s)

    def verify(self, generating: torch.Tensor, stats: SpeculationStats | None = None) -> torch.Tensor:
        """One main forward over [x_{n-1}, d_1 .. d_D]; commits and returns the tokens for slots n .. n+a
        (B, a + 1), where a is the least number of drafts accepted by a row in ``generating`` (B,) bool (all rows
        if none is)."""
        n, D = self.n, self.D
        h = self.model.hidden(self.seq[:, n - 1 : n + D], self.cache)  # (B, D+1, C)
        # g[:, j]: the token for slot n + j, valid up to each row's accepted count
        g, accepted = self.rule.verify(self.model.logits_of(h), self.seq[:, n : n + D], self.q)  # (B, D+1), (B,)
        rows = generating if bool(generating.any()) else torch.ones_like(generating)
        a = int(accepted[rows].min())
        self.seq[:, n : n + a + 1] = g[:, : a + 1]
        self.H[:, n - 1 : n + a] = h[:, : a + 1]
        self.cache.rewind(n + a)  # the main cache keeps slots n-1 .. n-1+a, read from committed tokens
        self.n = n + a + 1
        if stats is not None:
            stats.rounds += 1
            stats.drafted += D * int(rows.sum())
            stats.accepted += int(accepted[rows].sum())
            stats.advanced += a + 1
        return g[:, : a + 1]


@torch.no_grad()
def draft_reference(model, seq: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The drafts (B, D) after committed tokens ``seq`` (B, n), recomputed from scratch without caches: the
    readable reference for :meth:`Speculator.draft` (tests check they agree at every round). ``mask`` (B, n):
    1 = real token, 0 = left pad."""
    n = seq.shape[1]
    h, ctx = model.hidden_and_context(seq[:, : n - 1], None, None if mask is None else mask[:, : n - 1])
    ext, drafts = seq, []
    for k, module in enumerate(model.mtp.layers):  # module k+1 at slot i reads x_{i+k+1}
        h = module(h, model.embed_tokens(ext[:, k + 1 : n + k]), ctx)  # (B, n-1, C)
        drafts.append(model.logits_of(module.norm(h[:, -1])).argmax(-1))
        ext = torch.cat([ext, drafts[-1][:, None]], dim=1)  # x_{n+k} is the draft just made
    return torch.stack(drafts, dim=1)


def finish_rows(tokens: torch.Tensor, done: torch.Tensor, eos: torch.Tensor | None,
                fill: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """tokens (B, c) as plain decoding hands them out: (c', B), finished rows repeating ``fill``, cut
    after the step at which every row has finished (then the bool is True); and the rows done after."""
    if eos is None:
        return tokens.T, done, False
    out = []
    for tok in tokens.T:  # (B,) one step
        tok = tok.masked_fill(done, fill)
        done = done | (tok[:, None] == eos).any(-1)
        out.append(tok)
        if bool(done.all()):
            return torch.stack(out), done, True
    return torch.stack(out), done, False


def speculate(model, idx: torch.Tensor, mask: torch.Tensor | None, n: int, *, eos: torch.Tensor | None = None,
              fill: int = 0, ctx: Callable = torch.inference_mode, cache_dtype: torch.dtype | None = None,
              stats: SpeculationStats | None = None, probs: Probabilities | None = None,
              generator: torch.Generator | None = None) -> Iterator[torch.Tensor]:
    """Tokens after ``idx`` (B, T) (left-padded where ``mask`` (B, T) has 0s), ``n`` of them or until every row
    has produced one of ``eos``, as chunks (c, B): the tokens each round commits. Greedy, or with ``probs``
    (logits -> the distribution to sample, ``sampling.make_probabilities``) speculative sampling, drawing from
    ``generator`` (None: torch's global one). ``stats`` (optional) counts drafts and acceptances.
    ``generate(..., decoder="speculative")`` calls this."""
    if model.mtp.depth == 0:
        raise ValueError("speculative decoding drafts with the multi-token prediction modules, and this model has "
                         "none (mtp=None); train with --model.mtp.depth 1, or choose another decoder")
    with ctx():
        rule = Greedy() if probs is None else Sampling(probs, generator)
        spec = Speculator(model, idx, mask, n, cache_dtype or model.head.weight.dtype, rule)
        pending = spec.prefill()[:, None]  # (B, 1)
        done = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
    produced = 0
    while True:
        with ctx():
            out, done, finished = finish_rows(pending[:, : n - produced], done, eos, fill)
        yield out
        produced += out.shape[0]
        if finished or produced >= n:
            return
        with ctx():
            spec.draft()
            pending = spec.verify(~done, stats)
