"""What a failure looks like to a user: one line that names the thing and the fix, and an exit status.

    0    done
    1    training diverged (train.max_bad_steps consecutive non-finite steps)
    2    bad input: a config, a path, an argument the user gave; nothing was written
    3    the environment: a full disk, no permission, a read-only file system, a corrupt or
         foreign file, a device that cannot be used; nothing half-written is left behind

The library raises ``ValueError`` / ``FileNotFoundError`` for bad input and
:class:`EnvironmentFailure` (or lets an ``OSError`` through) for the environment; the command
line turns each into one line on stderr and its exit status, and nowhere else.
"""

from __future__ import annotations

EXIT_DIVERGED = 1
EXIT_USAGE = 2
EXIT_ENVIRONMENT = 3


class EnvironmentFailure(RuntimeError):
    """The machine or a file on it failed, not the user's input (exit status 3). The message names
    the file or device and what to do."""


class CorruptFile(EnvironmentFailure):
    """A file that should hold lmlab data (a shard, a tokenizer, a checkpoint, a metrics log) cannot
    be read back: truncated, damaged or of another kind. The message names the file."""


def one_line(e: BaseException) -> str:
    """An exception's message on one line (whitespace collapsed), or its type's name when it has none."""
    return " ".join(str(e).split()) or type(e).__name__
