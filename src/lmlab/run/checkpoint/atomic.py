"""Atomic file writes: a crash leaves either the old file or the new one, never a mix.

The new content goes to a temporary file in the same directory, which is fsynced, renamed over
the target with ``os.replace`` (atomic on POSIX), and then the directory itself is fsynced so the
rename survives a power cut. Every file lmlab writes (checkpoints, configs, token shards,
tokenizers, sweep results) goes through here.

A failure to write (a full disk, no permission, a read-only file system) removes the temporary
file and raises an ``OSError`` that names the target, or an ``EnvironmentFailure`` where the
writer (torch's) does not say which OS error it met. The new file gets the permissions a plain
``open`` would give it (0644 under the usual umask 022), or the old file's: ``mkstemp`` creates
0600 files and safetensors recreates the file it writes, so the mode is set after writing.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

from ..errors import write_failure


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


def default_file_mode() -> int:
    """0666 less the process's umask: the mode ``open`` gives a new file (0644 under umask 022)."""
    try:  # Linux reports the umask without changing it (os.umask would, for every thread, briefly)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Write ``path`` through ``write(tmp_path)``, then fsync, rename into place, fsync the directory."""
    path = Path(path)
    tmp: Path | None = None
    try:
        mode = path.stat().st_mode & 0o777 if path.is_file() else default_file_mode()
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        tmp = Path(name)
        write(tmp)
        os.chmod(tmp, mode)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno is not None and str(e.filename or "").startswith(str(path.parent / f".{path.name}.")):
            e.filename = str(path)  # our temporary file: name the file the user knows instead
        failure = write_failure(e, path)
        if failure is None or failure is e:
            raise
        raise failure from e
    fsync_dir(path.parent)


def write_atomic(path: str | Path, data: bytes | memoryview | str) -> None:
    """``atomic_write`` of bytes or text (UTF-8)."""
    payload = data.encode() if isinstance(data, str) else data
    atomic_write(path, lambda tmp: tmp.write_bytes(payload))


def atomic_write_text(path: str | Path, text: str) -> None:
    write_atomic(path, text)
