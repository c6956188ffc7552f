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
/dev/null (:func:`mute_stdout_if_closed`) and the run carries on. Every command of ``lmlab`` runs
inside :func:`readers_may_go`, which does the same for any write to stdout or stderr
(``lmlab eval RUN | head``, ``lmlab sweep spec.yaml | head``): the work goes on, the status is its own.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from ..config import ModelConfig
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
    """The lines a run starts with: what it trains (its attention, positions and experts), where, on what, and
    its data."""
    from ..moe import balancing_line  # imports torch: not for commands that only read files

    m, t = cfg.model, cfg.train
    start = f", starting from {t.init_from}" if t.init_from else ""
    p = cfg.parallel
    layout = ", ".join([p.strategy] + ([f"expert parallel {p.experts}"] if p.experts > 1 else []))
    return (
        f"training {noun} in {run_dir}: {parameters:,} parameters ({m.n_layers} layers, d_model {m.d_model}, "
        f"{attention_kind(m)}, {m.positions} positions{moe_kind(m)}), vocab {m.vocab_size}{start}; {t.steps} steps "
        f"of {tokens_per_step:,} tokens ({t.batch_size} x {cfg.seq_len} x {t.grad_accum} accum) on {device}"
        + (f" x {world} processes ({layout})" if world > 1 else "")
        + f"\ndata: {data}" + (f"\n{balancing_line(m.moe)}" if m.moe is not None else "")
        + (f"\nmtp: {m.mtp.depth} multi-token prediction module(s), loss weight {m.mtp.loss_weight:g}"
           if m.mtp is not None else "")
    )


VARIANT_LABELS = {"mla": "MLA"}  # attention.variant -> its name in the banner; others by their own name


def attention_kind(m: ModelConfig) -> str:
    """The banner's words for the attention: a variant by its name (``MLA attention, 8 heads``), standard
    attention by its key/value heads (MHA, GQA or MQA); and a sliding window where the layers have one."""
    variant = m.attention_variant
    if variant != "standard":
        kind = f"{VARIANT_LABELS.get(variant, variant)} attention, {m.n_heads} heads"
    elif m.n_kv_heads == m.n_heads:
        kind = f"MHA, {m.n_heads} heads"
    elif m.n_kv_heads == 1:
        kind = f"MQA, {m.n_heads} heads sharing 1 key/value head"
    else:
        kind = f"GQA, {m.n_heads} heads sharing {m.n_kv_heads} key/value heads"
    a = m.attention
    return kind + (f", window {a.window} on {'/'.join(a.pattern)} layers" if a.window is not None else "")


def moe_kind(m: ModelConfig) -> str:
    """The banner's words for a mixture of experts (``, MoE 8 experts top 2``), or nothing for a dense model."""
    moe = m.moe
    if moe is None:
        return ""
    shared = f" + {moe.n_shared} shared" if moe.n_shared else ""
    where = f" in {m.n_moe_layers} of {m.n_layers} layers" if m.n_moe_layers != m.n_layers else ""
    return f", MoE {moe.routed_experts} experts top {moe.active_experts}{shared}{where}"


def busy_note(load: float, cores: int, threads: int) -> str | None:
    """A note for the first lines of ``lmlab train`` when torch's ``threads`` and the machine's 1-minute
    ``load`` average (what other programs run) are more than its ``cores``: the threads then wait on each
    other, and one thread runs several times faster. None when they fit, or with one thread already."""
    if threads <= 1 or load + threads <= cores + 0.5:
        return None
    return (f"note: this machine is busy (load average {load:.1f} on {cores} cores) and torch computes with {threads} "
            "threads, which then wait on each other: add --threads 1 (on a busy 2-core machine a run went from "
            "300-600 to 2,300-5,400 tokens/s)")


def machine_busy_note() -> str | None:
    """:func:`busy_note` for this machine now: its load average, the cores this process may use, torch's threads
    (None where the system reports no load average)."""
    import torch

    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows has none
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return busy_note(load, cores, torch.get_num_threads())


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
    mute(stdout_fd())


def mute(fd: int | None) -> None:
    """Point file descriptor ``fd`` (None: nothing to do) at /dev/null."""
    if fd is None:
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def stdout_fd() -> int | None:
    """The file descriptor behind sys.stdout, or None where it has none (captured by a test, a notebook)."""
    return stream_fd(sys.stdout)


def stream_fd(stream: Any) -> int | None:
    """The file descriptor behind ``stream``, or None where it has none."""
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None


class ReaderGone:
    """A text stream (stdout or stderr) that never raises BrokenPipeError: once the reader of its pipe has
    gone (``lmlab eval RUN | head``, ``lmlab train | tee log`` stopped by Ctrl-C), its file descriptor is
    pointed at /dev/null and the write, and every later one, succeeds there. Everything else is the stream's."""

    def __init__(self, stream: Any):
        self._stream = stream
        self.gone = False  # the reader went away: what is written goes to /dev/null (a stream may stop early)

    def _closed_reader(self) -> None:
        self.gone = True
        mute(stream_fd(self._stream))
        with contextlib.suppress(BrokenPipeError):  # what was buffered now goes to /dev/null
            self._stream.flush()

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._closed_reader()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._closed_reader()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, buffer, ...
        return getattr(self._stream, name)


@contextlib.contextmanager
def readers_may_go() -> Iterator[None]:
    """For the duration, stdout and stderr (those with a file descriptor) are :class:`ReaderGone`: a reader of
    the output that goes away never stops the work, nor changes the exit status. What lmlab's commands run in."""
    saved = sys.stdout, sys.stderr
    if stream_fd(sys.stdout) is not None:
        sys.stdout = ReaderGone(sys.stdout)
    if stream_fd(sys.stderr) is not None:
        sys.stderr = ReaderGone(sys.stderr)
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()  # while still guarded: a closed pipe is muted, not raised at exit
        sys.stdout, sys.stderr = saved
