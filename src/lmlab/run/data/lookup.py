"""Planted key-value lookups (``train.lookup``): a retrieval task written into windows of text.

    lookups = draw_lookups(cfg, B, W, generator, ids)   # which rows, where, which keys and values
    window = lookups.write(window)                      # (B, W): the pairs, then the query
    lookups.value_positions(), lookups.answer()         # where the asked value stands, and what it is

A window that carries one reads, with pairs = 3 and value_length = 2 (k: a key id, v: a value id)::

    ... text ... k1 v v k2 v v k3 v v ... text ... k2 v v ... text ...
                     ^ the asked pair         ^ the query: k2's value again, ``distance`` after k2

Training draws the distance and where the pairs start (``draw_lookups``); the measurement
(``experiments/retrieval.py``) fixes the distance and ends the query at the window's last token
(``lookups_ending_at``). Both write through :meth:`Lookups.write`, so the value the probe scores is
where the planting put it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..config import LookupConfig


@dataclasses.dataclass(frozen=True)
class Lookups:
    """Lookups planted in ``rows`` of a (B, W) window; R = len(rows), n pairs, Q queries (back to back,
    each asking another pair until all n are asked, then again), v ids per value, P = 1 + v."""

    rows: torch.Tensor  # (R,) int64: the windows that carry them
    start: torch.Tensor  # (R,) int64: where the first pair's key stands; the pairs fill [start, start + n P)
    query: torch.Tensor  # (R, Q) int64: where each query's key stands; its value fills (query, query + P)
    asked: torch.Tensor  # (R, Q) int64: which pair (0 .. n-1) each query asks for; each n in a row distinct
    keys: torch.Tensor  # (R, n) int64: each pair's key id
    values: torch.Tensor  # (R, n, v) int64: each pair's value ids

    @property
    def pair_length(self) -> int:
        return 1 + self.values.shape[-1]

    @property
    def distance(self) -> torch.Tensor:
        """(R, Q): from the asked pair's key to the query's key."""
        return self.query - (self.start[:, None] + self.asked * self.pair_length)

    def answer(self) -> torch.Tensor:
        """(R, Q, v): the asked pairs' values, what the queries' values must be."""
        return self.values[torch.arange(len(self.rows))[:, None], self.asked]

    def value_positions(self) -> torch.Tensor:
        """(R, Q, v): the window positions of the queries' value ids (each predicted from the one before)."""
        return self.query[..., None] + 1 + torch.arange(self.values.shape[-1])

    def write(self, window: torch.Tensor) -> torch.Tensor:
        """A copy of ``window`` (B, W) with the pairs and the queries written into ``rows``."""
        (R, n), P = self.keys.shape, self.pair_length
        pairs = torch.cat([self.keys[..., None], self.values], -1)  # (R, n, P): key, then value
        out = window.clone()
        r = self.rows[:, None]  # (R, 1)
        out[r, self.start[:, None] + torch.arange(n * P)] = pairs.reshape(R, n * P)  # (R, nP)
        where = (self.query[..., None] + torch.arange(P)).flatten(1)  # (R, QP)
        out[r, where] = pairs[torch.arange(R)[:, None], self.asked].flatten(1)  # (R, QP)
        return out


def alphabets(cfg: LookupConfig, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(key ids, value ids): ``cfg.keys`` of ``ids`` (the plantable ids, increasing) from the
    ``cfg.offset``-th on, and the next ``cfg.values``, disjoint, so a key never reads as a value."""
    o, k, v = cfg.offset, cfg.keys, cfg.values
    if o + k + v > len(ids):
        raise ValueError(f"train.lookup.offset + keys + values = {o + k + v} ids, but the vocabulary has "
                         f"{len(ids)} that may be planted; choose fewer")
    return ids[o : o + k], ids[o + k : o + k + v]


def _draw_contents(cfg: LookupConfig, B: int, Q: int, generator: torch.Generator,
                   ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(asked (B, Q), keys (B, n), values (B, n, v)): the pairs asked in rounds of n, each round a random
    order of all n, keys distinct within a row, values uniform."""
    key_ids, value_ids = alphabets(cfg, ids)
    rounds = -(-Q // cfg.pairs)
    asked = torch.rand(B, rounds, cfg.pairs, generator=generator).argsort(-1).flatten(1)[:, :Q]  # (B, Q)
    keys = key_ids[torch.rand(B, cfg.keys, generator=generator).argsort(1)[:, : cfg.pairs]]  # (B, n), distinct
    values = value_ids[torch.randint(cfg.values, (B, cfg.pairs, cfg.value_length), generator=generator)]
    return asked, keys, values


def draw_lookups(cfg: LookupConfig, B: int, W: int, generator: torch.Generator, ids: torch.Tensor) -> Lookups:
    """Training's lookups for a (B, W) window: about ``cfg.fraction`` of rows carry them; the first
    query's distance uniform over ``cfg.distances(W)``, then where the pairs start, uniform over what
    fits it (and the other queries after it). Six draws from ``generator``, each over all B rows
    whichever carry one, so the batch is decided by the generator's state alone (a resumed run plants
    the same)."""
    lo, hi = cfg.distances(W)
    P, n, Q = cfg.pair_length, cfg.pairs, cfg.queries
    if hi > W - (n + Q - 1) * P or lo > hi:
        raise ValueError(f"train.lookup does not fit a window of {W} tokens: {n} pairs and {Q} queries of {P} "
                         f"tokens, the first query {lo}-{hi} tokens after its pair (at most {W - (n + Q - 1) * P})")
    chosen = torch.rand(B, generator=generator) < cfg.fraction  # (B,)
    asked, keys, values = _draw_contents(cfg, B, Q, generator, ids)
    d = torch.randint(lo, hi + 1, (B,), generator=generator)  # (B,): first query's key - its pair's key
    first = asked[:, 0] * P + d  # (B,): the first query, from the pairs' start
    room = W - Q * P - first  # (B,) >= 0: the last start at which the queries still end inside the window
    start = (torch.rand(B, generator=generator, dtype=torch.float64) * (room + 1)).long()  # (B,) in [0, room]
    query = (start + first)[:, None] + torch.arange(Q) * P  # (B, Q): back to back
    rows = chosen.nonzero().squeeze(1)
    return Lookups(rows, start[rows], query[rows], asked[rows], keys[rows], values[rows])


def lookups_ending_at(cfg: LookupConfig, B: int, W: int, distance: torch.Tensor, generator: torch.Generator,
                      ids: torch.Tensor) -> Lookups:
    """The measurement's lookups: every row of a (B, W) window carries one query (whatever
    ``cfg.queries``), ending at the window's last token and ``distance`` (B,) after the asked pair's key
    (so the pairs may stand beyond a training length however long the window)."""
    P = cfg.pair_length
    if int(distance.max()) > W - cfg.pairs * P or int(distance.min()) < cfg.pairs * P:
        raise ValueError(f"distances {int(distance.min())}-{int(distance.max())} do not fit {cfg.pairs} pairs of "
                         f"{P} tokens and a query in a window of {W}; they must lie in "
                         f"[{cfg.pairs * P}, {W - cfg.pairs * P}]")
    asked, keys, values = _draw_contents(cfg, B, 1, generator, ids)
    query = torch.full((B, 1), W - P)
    return Lookups(torch.arange(B), query[:, 0] - distance - asked[:, 0] * P, query, asked, keys, values)


def plant_lookups(window: torch.Tensor, cfg: LookupConfig, generator: torch.Generator,
                  ids: torch.Tensor) -> torch.Tensor:
    """``window`` (B, W) with lookups planted as ``train.lookup`` says (:func:`draw_lookups`); applied to
    the whole (B, T+1) window, inputs and targets agree."""
    return draw_lookups(cfg, window.shape[0], window.shape[1], generator, ids).write(window)
