"""What every writer of files shares: the mode a new file gets, and making a directory entry durable.

Below every layer, so that a Hugging Face export (``hf/export.py``) and a run's atomic writes
(``run/checkpoint/atomic.py``) give their files the same permissions: those of a plain ``open``.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_file_mode() -> int:
    """0666 less the process's umask: the mode ``open`` gives a new file (0644 under umask 022).
    Writers that create files another way (``mkstemp``: 0600; safetensors recreates the file it
    writes: 0600) set this mode afterwards."""
    try:  # Linux reports the umask without changing it (os.umask would, for every thread, briefly)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def fsync_dir(path: str | Path) -> None:
    """Make a rename or a new entry in ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
