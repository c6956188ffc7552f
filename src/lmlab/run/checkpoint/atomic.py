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

A whole directory (a comparison, rebuilt TensorBoard events) appears the same way through
:func:`install_directory`: written into a hidden sibling ``.<name>.<kind>-<pid>-<hex>``, fsynced
and renamed into place; an old directory it replaces is moved aside first (``.<name>.<kind>-old-
<pid>-<hex>``) and deleted last. A writer killed half way leaves only such siblings, named by its
PID: the next writer of the same kind removes those of dead processes, and puts an old directory
moved aside back where a kill left nothing in its place.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

from ...files import default_file_mode, fsync_dir
from ...files import install_directory as install
from ..errors import write_failure

__all__ = ["atomic_write", "atomic_write_text", "default_file_mode", "fsync_dir", "install_directory",
           "is_temporary_of", "write_atomic"]


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
        if isinstance(e, OSError) and e.errno is not None and is_temporary_of(e.filename, path):
            e.filename = str(path)  # our temporary file: name the file the user knows instead
        failure = write_failure(e, path)
        if failure is None or failure is e:
            raise
        raise failure from e
    fsync_dir(path.parent)


def is_temporary_of(name: object, path: Path) -> bool:
    """Whether ``name`` (an OSError's file name) is one of atomic_write's temporary files for ``path``.
    By directory and name, not by string prefix: ``mkstemp`` reports an absolute name when ``path``
    is relative (a relative --run-dir)."""
    if not isinstance(name, (str, os.PathLike)):
        return False
    name = Path(os.fsdecode(name))
    return name.name.startswith(f".{path.name}.") and os.path.abspath(name.parent) == os.path.abspath(path.parent)


def write_atomic(path: str | Path, data: bytes | memoryview | str) -> None:
    """``atomic_write`` of bytes or text (UTF-8)."""
    payload = data.encode() if isinstance(data, str) else data
    atomic_write(path, lambda tmp: tmp.write_bytes(payload))


def atomic_write_text(path: str | Path, text: str) -> None:
    write_atomic(path, text)


# ============================================================== whole directories
def install_directory(out: str | Path, kind: str, write: Callable[[Path], None],
                      may_replace: Callable[[Path], None] | None = None) -> None:
    """:func:`lmlab.files.install_directory`, with an environment's failure (a full disk, a read-only
    file system) turned into the one-line error that names ``out`` (``write_failure``)."""
    try:
        install(out, kind, write, may_replace)
    except BaseException as e:
        failure = write_failure(e, Path(out))
        if failure is None or failure is e:
            raise
        raise failure from e
