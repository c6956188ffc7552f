"""What a run shows as it trains: the banner, notes, a progress bar and the throughput of each logged step.

Rank 0 shows them (unless quiet); other ranks keep the same counts silently, so that every process
computes the same records. On a terminal, notes go through ``tqdm.write``, which never breaks the bar.
Anywhere else (``| tee log``, a batch job's log file) there is no bar: each logged step is one plain
line (``step 20/200: loss 3.1416, lr 3.0e-04, 12,345 tok/s``), so that no ``\r`` redraw lands in the
log and ``grep ^step`` finds every step's line.

Under ``lmlab train ... | tee log``, Ctrl-C reaches every process of the terminal's foreground
group and stops ``tee`` as well: from then on each write to stdout fails with BrokenPipeError
(EPIPE), and a buffered one fails at exit, which turns the exit status into 120. A message must
never cost the checkpoint that a stop saves, so once stdout's reader is gone it is pointed at
/dev/null (:func:`mute_stdout_if_closed`) and the run carries on.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from ..config import MoEConfig
from .config import RunConfig


class Progress:
    """The console of one run (``show``: rank 0, not quiet) and its throughput window."""

    def __init__(self, show: bool, terminal: bool | None = None):
        self.show = show
        self.terminal = on_terminal() if terminal is None else terminal  # a bar, or one plain line per logged step
        self.bar: Any = None  # tqdm's, while :meth:`running` on a terminal
        self.total = 0
        self.window_start, self.window_tokens = time.perf_counter(), 0  # the throughput window

    def print(self, message: str) -> None:
        """One note on stdout (above the bar), flushed; nothing once stdout's reader is gone."""
        if self.show:
            try:
                if self.bar is not None:
                    from tqdm.auto import tqdm

                    tqdm.write(message)
                else:
                    print(message)
                sys.stdout.flush()  # a pipe is block-buffered: reach `tee` now, and meet a closed pipe here
            except BrokenPipeError:
                mute_stdout()

    @contextlib.contextmanager
    def running(self, total: int, initial: int) -> Iterator[None]:
        """A progress bar of ``total`` steps, ``initial`` done, for the duration (where shown); the
        throughput window starts now."""
        self.window_start, self.window_tokens, self.total = time.perf_counter(), 0, total
        if not (self.show and self.terminal):
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
        """Move the bar one step; a logged step's ``record`` shows its loss, lr and throughput (on the bar, or
        off a terminal as one line of its own)."""
        if self.bar is None:
            if self.show and "tokens_per_s" in record:
                mtp = record.get("aux_losses", {}).get("mtp")  # multi-token prediction's weighted loss, apart
                self.print(f"step {record['step']}/{self.total}: loss {record['loss']:.4f}, "
                           + ("" if mtp is None else f"mtp {mtp:.4f}, ")
                           + f"lr {record['lr']:.1e}, {record['tokens_per_s']:,.0f} tok/s")
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
    p = cfg.parallel
    layout = ", ".join([p.strategy] + ([f"expert parallel {p.experts}"] if p.experts > 1 else []))
    return (
        f"training {noun} in {run_dir}: {parameters:,} parameters ({m.n_layers} layers, d_model {m.d_model}, "
        f"{m.positions} positions), vocab {m.vocab_size}{start}; {t.steps} steps of {tokens_per_step:,} tokens "
        f"({t.batch_size} x {cfg.seq_len} x {t.grad_accum} accum) on {device}"
        + (f" x {world} processes ({layout})" if world > 1 else "")
        + f"\ndata: {data}" + (f"\n{moe_balancing(m.moe)}" if m.moe is not None else "")
        + (f"\nmtp: {m.mtp.depth} multi-token prediction module(s), loss weight {m.mtp.loss_weight:g}"
           if m.mtp is not None else "")
    )


def moe_balancing(moe: MoEConfig) -> str:
    """The banner's line on how a mixture of experts is balanced, saying so loudly when it is not."""
    if moe.balancing:
        return f"moe: {moe.routed_experts} experts, top {moe.active_experts}; balancing: {', '.join(moe.balancing)}"
    return (f"moe: {moe.routed_experts} experts, top {moe.active_experts}; balancing: OFF (every balancing coefficient "
            "and moe.bias_update_rate set to 0): experts may go unused; leave moe.expert_balance_coef unset to balance")


def on_terminal() -> bool:
    """Whether stdout and stderr (where tqdm draws) are both terminals: only then is a redrawn bar shown."""
    try:
        return sys.stdout.isatty() and sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


def mute_stdout_if_closed() -> None:
    """Point stdout at /dev/null if it is a pipe whose reader has gone (poll reports POLLERR), so that
    later writes, and the flush at exit, succeed. Call it before work that output must not stop."""
    fd = stdout_fd()
    if fd is None or not hasattr(select, "poll"):
        return
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    if any(events & select.POLLERR for _, events in poll.poll(0)):
        mute_stdout()


def mute_stdout() -> None:
    """Send everything written to stdout from now on (what Python still buffers too) to /dev/null."""
    fd = stdout_fd()
    if fd is None:
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def stdout_fd() -> int | None:
    """The file descriptor behind sys.stdout, or None where it has none (captured by a test, a notebook)."""
    try:
        return sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return None
