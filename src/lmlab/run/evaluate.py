"""Validation loss, perplexity, bits per byte and loss by position.

Bits per byte divides the summed loss (in bits) by the UTF-8 bytes the evaluated target tokens
decode to (``TokenData.byte_lengths``, from data/token_bytes.py; special tokens count 0), so runs
with different tokenizers compare.

Loss by position is what length extrapolation is measured with: evaluate at a sequence length
longer than training (with any rope scaling override) and compare the mean loss at positions the
model has seen against those it has not.

These measure the objective a run trains on, on its own held-out split. Tasks the model was not
trained on (lm-evaluation-harness tasks, ``eval.tasks``) are run/eval_harness.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .data.token_bytes import bits_per_byte


@dataclasses.dataclass
class EvalResult:
    loss: float  # mean next-token cross-entropy (nats per token) over every evaluated position
    tokens: int  # predictions averaged
    sequences: int
    per_position: list[float]  # mean loss at each position 0 .. seq_len-1, over sequences
    bytes: int | None = None  # UTF-8 bytes the evaluated target tokens decode to; None: not counted
    bits_per_byte: float | None = None  # summed loss / ln 2 / bytes; None when bytes is None or 0

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
    autocast: Callable[[], Any] = contextlib.nullcontext, byte_lengths: np.ndarray | None = None,
    spread: bool = False,
) -> EvalResult:
    """Cross-entropy of ``model`` on ``data`` (a :class:`lmlab.data.TokenData`), read in order as
    non-overlapping windows of ``seq_len`` tokens, ``batch_size`` at a time, at most ``max_batches``
    (``spread``: that many batches' windows spread evenly over the whole split). ``byte_lengths``
    ((V,) UTF-8 bytes per token id, ``TokenData.byte_lengths``) adds the bytes the targets cover and
    bits per byte."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total = torch.zeros(seq_len, dtype=torch.float64, device=device)  # (T,) summed over sequences
    table = None if byte_lengths is None else torch.as_tensor(byte_lengths, dtype=torch.int64, device=device)  # (V,)
    n_bytes = torch.zeros((), dtype=torch.int64, device=device)
    sequences = 0
    try:
        for x, y in data.iter_eval(batch_size, seq_len, max_batches, spread=spread):
            x, y = x.to(device), y.to(device)  # (B, T)
            with autocast():
                logits = model(x).logits  # (B, T, V)
            nll = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="none")  # (B*T,)
            total += nll.view(y.shape).sum(0, dtype=torch.float64)
            if table is not None:
                n_bytes += table[y].sum()
            sequences += y.shape[0]
    finally:
        model.train(was_training)
    if sequences == 0:
        raise ValueError(f"no evaluation data: the split holds fewer than seq_len + 1 = {seq_len + 1} tokens")
    per_position = (total / sequences).tolist()
    covered = None if table is None else int(n_bytes)
    bpb = bits_per_byte(float(total.sum()), covered)
    return EvalResult(loss=sum(per_position) / seq_len, tokens=sequences * seq_len, sequences=sequences,
                      per_position=per_position, bytes=covered, bits_per_byte=bpb)
