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
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from ...files import default_file_mode, fsync_dir
from ..errors import write_failure

__all__ = ["atomic_write", "atomic_write_text", "clean_temporaries", "default_file_mode", "fsync_dir",
           "install_directory", "is_temporary_of", "temporaries", "write_atomic"]


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
def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (this process's own PID counts as dead: nothing is staged yet
    when the leftovers are cleaned, so a name with it is a predecessor's whose PID was reused)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def temporaries(out: str | Path, kind: str) -> list[tuple[Path, int, bool]]:
    """The hidden siblings :func:`install_directory` makes for ``out`` with ``kind``: (path, PID, whether
    it holds an old ``out`` moved aside), in name order."""
    out = Path(out)
    prefix = f".{out.name}.{kind}-"
    try:
        names = sorted(e.name for e in os.scandir(out.parent) if e.name.startswith(prefix))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        rest = name[len(prefix):]
        old = rest.startswith("old-")
        pid = rest[4 if old else 0:].split("-")[0]
        if pid.isdigit():
            found.append((out.parent / name, int(pid), old))
    return found


def clean_temporaries(out: str | Path, kind: str) -> list[Path]:
    """Remove what a killed writer of ``kind`` left beside ``out`` (its PID gone): a half-written new
    directory is deleted; an old ``out`` moved aside is put back if nothing took its place, else
    deleted (the new one was installed). Returns the paths removed or restored."""
    out = Path(out)
    done = []
    for path, pid, old in temporaries(out, kind):
        if _alive(pid):
            continue
        if old and not out.exists() and (path / out.name).is_dir():
            os.replace(path / out.name, out)  # the kill came between moving the old one aside and installing
            fsync_dir(out.parent)
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() and not path.is_symlink() else path.unlink()
        done.append(path)
    return done


def install_directory(out: str | Path, kind: str, write: Callable[[Path], None],
                      may_replace: Callable[[Path], None] | None = None) -> None:
    """Make directory ``out`` appear whole or not at all: ``write(tmp)`` fills a hidden sibling, which
    is fsynced and renamed to ``out``. An empty ``out`` is replaced; a full one only where
    ``may_replace(out)`` returns (it raises to refuse: called again just before the swap, since
    ``out`` may have changed meanwhile), moved aside first and deleted once the new one is in place.
    Leftovers of a killed writer of the same ``kind`` are cleaned first (:func:`clean_temporaries`).
    On any failure nothing new remains and an old ``out`` is back in place."""
    out = Path(out)
    parent = out.parent
    parent.mkdir(parents=True, exist_ok=True)
    clean_temporaries(out, kind)
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    tmp = parent / f".{out.name}.{kind}-{tag}"
    tmp.mkdir()  # with the umask's permissions, unlike tempfile.mkdtemp's 0700
    old = None
    try:
        write(tmp)
        for p in [tmp, *(q for q in tmp.rglob("*") if q.is_dir())]:
            fsync_dir(p)
        if out.is_dir() and any(out.iterdir()):
            if may_replace is None:
                raise ValueError(f"{str(out)!r} is not empty; choose another directory")
            may_replace(out)
            old = parent / f".{out.name}.{kind}-old-{tag}"
            old.mkdir()
            os.replace(out, old / out.name)
        os.replace(tmp, out)  # atomic; an empty directory in the way is replaced
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out.exists() and (old / out.name).is_dir():
            os.replace(old / out.name, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        if isinstance(e, OSError) and isinstance(e.filename, str) and e.filename.startswith(str(tmp)):
            e.filename = str(out) + e.filename[len(str(tmp)):]  # our temporary directory: name the one the user knows
        failure = write_failure(e, out)
        if failure is None or failure is e:
            raise
        raise failure from e
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(parent)
