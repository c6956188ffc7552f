"""What a sweep measures about a run besides its training curve: the final loss over validation
windows spread over the whole split, the unigram loss a model must beat, and the run's label.

    unigram_loss("sweeps/x/data")                  # nats/token of predicting token frequencies only
    spread_eval(model, val, seq_len=64, windows=8)  # an EvalResult over 8 windows spread over val
    run_status(3.1, "", {"unigram": 3.0, "init": 5.5}, "init")   # ("no better than unigram", why)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ...run.data.batches import TokenData, spread_starts
from ...run.evaluate import evaluate

__all__ = ["SpreadSlice", "run_status", "spread_eval", "spread_starts", "unigram_loss"]

class SpreadSlice:
    """Evaluation windows spread over a split, in the shape ``evaluate`` reads (``iter_eval``)."""

    def __init__(self, data: TokenData, windows: int):
        self.data, self.windows = data, windows

    @property
    def byte_lengths(self) -> np.ndarray:
        """The split's bytes per token id (``TokenData.byte_lengths``), for bits per byte."""
        return self.data.byte_lengths

    def iter_eval(self, batch_size: int, seq_len: int, max_batches: int | None = None,
                  spread: bool = True) -> Iterator[tuple[Any, Any]]:
        import torch

        tokens = self.data.tokens
        starts = spread_starts(len(tokens), seq_len, self.windows)
        for i in range(0, len(starts), batch_size):
            rows = np.asarray(tokens[starts[i : i + batch_size, None] + np.arange(seq_len + 1)]).astype(np.int64)
            w = torch.from_numpy(rows)
            yield w[:, :-1].contiguous(), w[:, 1:].contiguous()  # (B, T) each


def spread_eval(model, data: TokenData, seq_len: int, windows: int, batch_size: int = 8):
    """``evaluate`` over ``windows`` windows of ``seq_len`` spread evenly over ``data`` (an EvalResult)."""
    spread = SpreadSlice(data, windows)
    return evaluate(model, spread, batch_size=batch_size, seq_len=seq_len, byte_lengths=spread.byte_lengths)


def unigram_loss(data_dir: str | Path, seq_len: int | None = None, windows: int | None = None) -> float:
    """Cross-entropy (nats/token) of the training split's token frequencies on the validation
    split (on the targets of ``windows`` spread windows of ``seq_len`` when given): the loss of a
    model that learned nothing but which tokens are common."""
    train, val = TokenData(data_dir, "train"), TokenData(data_dir, "val")
    vocab = max(train.meta.vocab_size, int(max(train.tokens.max(), val.tokens.max())) + 1)
    counts = np.bincount(np.asarray(train.tokens), minlength=vocab).astype(np.float64) + 1.0  # add-one smoothing
    logp = np.log(counts / counts.sum())
    targets = np.asarray(val.tokens)
    if windows and seq_len:
        starts = spread_starts(len(targets), seq_len, windows)
        targets = targets[starts[:, None] + 1 + np.arange(seq_len)].ravel()
    return float(-logp[targets].mean())


def run_status(final: float, reason: str, limits: dict[str, float], diverged_above: float | str) -> tuple[str, str]:
    """(status, why): diverged (non-finite, or above ``diverged_above`` / ln vocab), no better than unigram, or ok."""
    if reason:
        return "diverged", reason
    if final is None or not math.isfinite(final):
        return "diverged", "non-finite validation loss"
    cap = limits["init"] if diverged_above == "init" else float(diverged_above)
    if final > cap:
        what = f"ln(vocab) = {cap:.3f}, the untrained model's loss" if diverged_above == "init" else f"{cap:.3f}"
        return "diverged", f"final val loss {final:.3f} above {what}"
    if final >= limits["unigram"]:
        return "no better than unigram", f"final val loss {final:.3f} >= the unigram loss {limits['unigram']:.3f}"
    return "ok", ""
