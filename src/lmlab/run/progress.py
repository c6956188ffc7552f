"""What a run shows as it trains: the banner, notes, a progress bar and the throughput of each logged step.

Rank 0 shows them (unless quiet); other ranks keep the same counts silently, so that every process
computes the same records. Notes go through ``tqdm.write``, which never breaks the bar.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Iterator

from .config import RunConfig


class Progress:
    """The console of one run (``show``: rank 0, not quiet) and its throughput window."""

    def __init__(self, show: bool):
        self.show = show
        self.bar: Any = None  # tqdm's, while :meth:`running`
        self.window_start, self.window_tokens = time.perf_counter(), 0  # the throughput window

    def print(self, message: str) -> None:
        if self.show:
            from tqdm.auto import tqdm

            tqdm.write(message)

    @contextlib.contextmanager
    def running(self, total: int, initial: int) -> Iterator[None]:
        """A progress bar of ``total`` steps, ``initial`` done, for the duration (where shown); the
        throughput window starts now."""
        self.window_start, self.window_tokens = time.perf_counter(), 0
        if not self.show:
            yield
            return
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=True)
        try:
            yield
        finally:
            self.bar.close()
            self.bar = None

    def throughput(self, tokens: int, logged: bool) -> float | None:
        """Count a step's ``tokens``; at a ``logged`` step, the tokens per second since the last one
        (which starts a new window), else None."""
        self.window_tokens += tokens
        if not logged:
            return None
        now = time.perf_counter()
        tokens_per_s = self.window_tokens / max(now - self.window_start, 1e-9)
        self.window_start, self.window_tokens = now, 0
        return tokens_per_s

    def advance(self, record: dict[str, Any]) -> None:
        """Move the bar one step; a logged step's ``record`` shows its loss, lr and throughput."""
        if self.bar is None:
            return
        if "tokens_per_s" in record:
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.1e}",
                                 tok_s=f"{record['tokens_per_s']:,.0f}", refresh=False)
        self.bar.update(1)


def banner(cfg: RunConfig, *, noun: str, run_dir: Path, parameters: int, tokens_per_step: int, device: Any,
           world: int, data: str) -> str:
    """The lines a run starts with: what it trains, where, on what, and its data."""
    m, t = cfg.model, cfg.train
    start = f", starting from {t.init_from}" if t.init_from else ""
    layout = ", ".join([t.parallel] + ([f"expert parallel {t.expert_parallel}"] if t.expert_parallel > 1 else []))
    return (
        f"training {noun} in {run_dir}: {parameters:,} parameters ({m.n_layers} layers, d_model {m.d_model}, "
        f"{m.positions} positions), vocab {m.vocab_size}{start}; {t.steps} steps of {tokens_per_step:,} tokens "
        f"({t.batch_size} x {cfg.seq_len} x {t.grad_accum} accum) on {device}"
        + (f" x {world} processes ({layout})" if world > 1 else "")
        + f"\ndata: {data}"
    )
