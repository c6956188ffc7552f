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

import errno
import os
import re
from pathlib import Path

from ..errors import CorruptFile, EnvironmentFailure, one_line

__all__ = ["CorruptFile", "EnvironmentFailure", "EXIT_DIVERGED", "EXIT_ENVIRONMENT", "EXIT_USAGE",
           "describe_os_error", "one_line", "write_failure"]

EXIT_DIVERGED = 1
EXIT_USAGE = 2
EXIT_ENVIRONMENT = 3

# errno -> (what happened, what to do); the file is named in between
_OS_ERRORS = {
    errno.ENOSPC: ("no space left on the device holding",
                   "free some space (or write elsewhere) and run the command again"),
    errno.EDQUOT: ("disk quota exceeded writing", "free some space (or write elsewhere) and run the command again"),
    errno.EFBIG: ("file size limit reached writing", "raise the limit (ulimit -f) or write elsewhere"),
    errno.EACCES: ("permission denied for", "check its permissions or choose another directory"),
    errno.EPERM: ("operation not permitted on", "check its permissions or choose another directory"),
    errno.EROFS: ("read-only file system holds", "choose a directory on a writable file system"),
    errno.EIO: ("I/O error on", "the disk may be failing; check it (dmesg) and copy your data elsewhere"),
    errno.ENOMEM: ("out of memory while accessing", "free memory or use a smaller configuration"),
}


def describe_os_error(e: OSError) -> str:
    """One line for an operating-system failure: what happened, to which file, and what to do."""
    files = " -> ".join(repr(str(f)) for f in (e.filename, e.filename2) if f is not None) or "a file"
    if e.errno in _OS_ERRORS:
        what, fix = _OS_ERRORS[e.errno]
        return f"{what} {files}; {fix}"
    reason = e.strerror or one_line(e)
    return f"{reason}: {files}"


_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def write_failure(e: BaseException, path: str | Path) -> BaseException | None:
    """The environment failure behind an exception raised while writing ``path``, naming the file;
    None when ``e`` is not one (a bug, an interrupt), so the caller re-raises it unchanged.

    Python's ``OSError`` from ``write`` or ``fsync`` has no file name; safetensors reports the OS
    error only in its message ("(os error 28)"); torch's writer reports none at all
    ("PytorchStreamWriter failed writing file")."""
    if isinstance(e, OSError):
        if e.filename is None and e.errno is not None:
            e.filename = str(path)
        return e
    if type(e).__name__ == "SafetensorError" and (m := _RUST_OS_ERROR.search(str(e))):
        code = int(m.group(1))
        return OSError(code, os.strerror(code), str(path))
    if isinstance(e, RuntimeError) and not isinstance(e, EnvironmentFailure) and (
            "PytorchStreamWriter" in str(e) or "inline_container" in str(e)):
        return EnvironmentFailure(
            f"writing {str(path)!r} failed ({one_line(e)[:120]}); "
            "check that its file system has free space and is writable"
        )
    return None
