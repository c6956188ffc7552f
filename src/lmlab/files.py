"""What every writer of files shares: the mode a new file gets, making a directory entry durable, and a
directory that appears whole or not at all (written beside it and renamed, what a killed writer left
cleaned by the next).

Below every layer, so that a Hugging Face export (``hf/export.py``) and a run's atomic writes
(``run/checkpoint/atomic.py``) give their files the same permissions, those of a plain ``open``, and
install their directories the same way.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path
from typing import Callable


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


def pid_alive(pid: int) -> bool:
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
        if pid_alive(pid):
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
    On any failure nothing new remains and an old ``out`` is back in place, and an OSError about the hidden
    sibling names ``out`` instead."""
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
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(parent)
