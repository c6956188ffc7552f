"""Messages to the user's terminal, or to the pipe in ``lmlab train ... | tee log``.

Ctrl-C reaches every process of the terminal's foreground group, so it stops ``tee`` as well: from
then on each write to stdout fails with BrokenPipeError (EPIPE), and a buffered one fails at exit,
which turns the exit status into 120. A message must never cost the checkpoint that a stop saves,
so once stdout's reader is gone it is pointed at /dev/null and the run carries on.
"""

from __future__ import annotations

import os
import select
import sys


def say(message: str) -> None:
    """Write one message line to stdout through tqdm (above a progress bar), flushed; nothing at all
    once stdout's reader is gone."""
    from tqdm.auto import tqdm

    try:
        tqdm.write(message)
        sys.stdout.flush()  # a pipe is block-buffered: reach `tee` now, and meet a closed pipe here
    except BrokenPipeError:
        mute_stdout()


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
