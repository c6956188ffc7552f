"""Validation loss, perplexity and loss by position.

Loss by position is what length extrapolation is measured with: evaluate at a sequence length
longer than training (with any rope scaling override) and compare the mean loss at positions the
model has seen against those it has not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass
class EvalResult:
    loss: float  # mean next-token cross-entropy (nats per token) over every evaluated position
    tokens: int  # predictions averaged
    sequences: int
    per_position: list[float]  # mean loss at each position 0 .. seq_len-1, over sequences

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))

    def buckets(self, n: int = 8, boundary: int | None = None) -> list[dict[str, Any]]:
        """Mean loss over ``n`` equal ranges of positions; ``boundary`` (the training length) also
        splits the range it falls in, so no bucket mixes seen and unseen positions."""
        if n < 1:
            raise ValueError(f"buckets={n} is not valid; give 1 or more position ranges")
        T = len(self.per_position)
        edges = sorted(
            {round(i * T / n) for i in range(n + 1)} | ({boundary} if boundary and 0 < boundary < T else set())
        )
        return [
            {"start": a, "end": b, "loss": sum(self.per_position[a:b]) / (b - a)}
            for a, b in zip(edges[:-1], edges[1:]) if b > a
        ]


@torch.no_grad()
def evaluate(
    model: nn.Module, data, *, batch_size: int, seq_len: int, max_batches: int | None = None,
    autocast: Callable[[], Any] = contextlib.nullcontext, spread: bool = False,
) -> EvalResult:
    """Cross-entropy of ``model`` on ``data`` (a :class:`lmlab.data.TokenData`), read in order as
    non-overlapping windows of ``seq_len`` tokens, ``batch_size`` at a time, at most ``max_batches``
    (``spread``: that many batches' windows spread evenly over the whole split)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total = torch.zeros(seq_len, dtype=torch.float64, device=device)  # (T,) summed over sequences
    sequences = 0
    try:
        for x, y in data.iter_eval(batch_size, seq_len, max_batches, spread=spread):
            x, y = x.to(device), y.to(device)  # (B, T)
            with autocast():
                logits = model(x).logits  # (B, T, V)
            nll = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none")  # (B*T,)
            total += nll.view(y.shape).sum(0, dtype=torch.float64)
            sequences += y.shape[0]
    finally:
        model.train(was_training)
    if sequences == 0:
        raise ValueError(f"no evaluation data: the split holds fewer than seq_len + 1 = {seq_len + 1} tokens")
    per_position = (total / sequences).tolist()
    return EvalResult(loss=sum(per_position) / seq_len, tokens=sequences * seq_len, sequences=sequences,
                      per_position=per_position)
