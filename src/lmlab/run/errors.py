"""What a failure looks like to a user: one line that names the thing and the fix.

The library raises ``ValueError`` / ``FileNotFoundError`` for bad input; the command line turns
each into one line on stderr and an exit status (see ``lmlab --help``).
"""

from __future__ import annotations


def one_line(e: BaseException) -> str:
    """An exception's message on one line (whitespace collapsed), or its type's name when it has none."""
    return " ".join(str(e).split()) or type(e).__name__
