"""The two exception types for a failure of the machine rather than of the input, and one-line messages.

They live below every layer so that the model layer (``hf/`` reading a damaged checkpoint) can
raise them as well as ``run/``. What each means to a user, and the exit statuses, are in
``lmlab.run.errors``, which re-exports both.
"""

from __future__ import annotations


class EnvironmentFailure(RuntimeError):
    """The machine or a file on it failed, not the user's input (exit status 3). The message names
    the file or device and what to do."""


class CorruptFile(EnvironmentFailure):
    """A file that should hold lmlab data (a shard, a tokenizer, a checkpoint, a metrics log) cannot
    be read back: truncated, damaged or of another kind. The message names the file."""


def one_line(e: BaseException) -> str:
    """An exception's message on one line (whitespace collapsed), or its type's name when it has none."""
    return " ".join(str(e).split()) or type(e).__name__
