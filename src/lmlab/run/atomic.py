"""Atomic file writes: a crash leaves either the old file or the new one, never a mix.

The new content goes to a temporary file in the same directory, which is fsynced, renamed over
the target with ``os.replace`` (atomic on POSIX), and then the directory itself is fsynced so the
rename survives a power cut. Every file lmlab writes (checkpoints, configs, token shards,
tokenizers, sweep results) goes through here.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


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


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Write ``path`` through ``write(tmp_path)``, then fsync, rename into place, fsync the directory."""
    path = Path(path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        # mkstemp creates 0600; give the file the usual permissions (or keep the old file's)
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_atomic(path: str | Path, data: bytes | memoryview | str) -> None:
    """``atomic_write`` of bytes or text (UTF-8)."""
    payload = data.encode() if isinstance(data, str) else data
    atomic_write(path, lambda tmp: tmp.write_bytes(payload))


def atomic_write_text(path: str | Path, text: str) -> None:
    write_atomic(path, text)
