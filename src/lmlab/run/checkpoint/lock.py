"""One process per directory: an advisory lock on ``<directory>/.lock`` that dies with its process.

    with locked("sweeps/depth", "sweep directory"):        # a second process: DirectoryInUse (exit 2)
        ...
    with locked("data/mine", "data directory", wait=True, say=print):   # or wait for the holder
        ...

Two processes writing one run directory destroy each other's work: one sweeps away the other's
checkpoint in progress, the other appends to a metrics file that was replaced. So every writer
(a training run's rank 0, ``prepare``, a sweep) holds its directory's lock while it writes.

The lock is ``flock(LOCK_EX)`` on a file inside the directory, holding the owner's PID. The
operating system drops it when the process dies, however it dies, so a crash never leaves a
stale lock behind. The file is removed on release while still locked; a process that opened it
meanwhile finds that the path no longer names the file it locked, and starts over, so two
processes never both believe they hold the lock. Within one process, a second non-blocking
acquire is refused like another process's; a blocking one (``prepare`` into the directory of
the run that called it, data.dir=".") proceeds, since it would otherwise wait for itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

LOCK_FILE = ".lock"

_held: dict[Path, int] = {}  # lock files this process holds -> how many times


class DirectoryInUse(ValueError):
    """Another live process holds the directory's lock (bad input, exit status 2: run one at a time)."""


class DirLock:
    """The lock of one directory. ``acquire`` creates the directory if needed (remembering what it
    created, so that a start that fails can remove it again) and raises :class:`DirectoryInUse`
    naming the holder, or with ``wait=True`` waits for it."""

    def __init__(self, directory: str | Path, what: str = "run directory"):
        self.dir, self.what = Path(directory), what
        self.fd: int | None = None
        self.key: Path | None = None
        self.created: list[Path] = []  # directories acquire() created, deepest first

    @property
    def path(self) -> Path:
        return self.dir / LOCK_FILE

    def acquire(self, *, wait: bool = False, say: Callable[[str], None] | None = None) -> "DirLock":
        if self.dir.exists() and not self.dir.is_dir():
            raise ValueError(f"{self.what} {str(self.dir)!r} is a file; choose a directory")
        missing = [p for p in (self.dir, *self.dir.parents) if not p.exists()]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.created = missing
        try:
            return self._lock(wait, say)
        except BaseException:
            for p in missing:  # refused: leave no empty directory behind
                with contextlib.suppress(OSError):
                    p.rmdir()
            raise

    def _lock(self, wait: bool, say: Callable[[str], None] | None) -> "DirLock":
        self.key = self.path.resolve()
        if self.key in _held:  # this process holds it: waiting would be for ever, so a waiter proceeds
            if not wait:
                raise self._in_use(f"process {os.getpid()} (this one)")
            _held[self.key] += 1
            return self
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                self._flock(fd, wait, say)
            except BaseException:
                os.close(fd)
                raise
            if self._names(fd):
                break
            os.close(fd)  # released and removed between our open and flock: lock the new file
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        _held[self.key] = 1
        return self

    def _flock(self, fd: int, wait: bool, say: Callable[[str], None] | None) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        who = f"process {holder}" if holder.isdigit() else "another process"
        if not wait:
            raise self._in_use(who)
        if say is not None:
            say(f"waiting for {who}, which is writing {self.what} {str(self.dir)!r}")
        fcntl.flock(fd, fcntl.LOCK_EX)

    def _in_use(self, who: str) -> DirectoryInUse:
        return DirectoryInUse(f"{self.what} {str(self.dir)!r} is in use by {who} (it holds {str(self.path)!r}); wait "
                              "for it to finish or stop it, or choose another directory")

    def _names(self, fd: int) -> bool:
        try:
            return os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def release(self, *, remove_created: bool = False, with_contents: bool = False) -> None:
        """Unlock. ``remove_created``: also remove the directories ``acquire`` created, while empty;
        ``with_contents``: the locked directory even with files in it (a run that failed before it
        started: only this process wrote there, under the lock). Parents go only while empty."""
        if self.key is None or self.key not in _held:
            return
        _held[self.key] -= 1
        if _held[self.key] == 0:
            del _held[self.key]
            if self.fd is not None:
                try:
                    self.path.unlink(missing_ok=True)
                finally:
                    os.close(self.fd)
                    self.fd = None
        if remove_created and self.created:
            if with_contents:
                shutil.rmtree(self.created[0], ignore_errors=True)
            for parent in self.created:  # another process may have started using a parent meanwhile
                with contextlib.suppress(OSError):
                    parent.rmdir()
        self.key = None


@contextlib.contextmanager
def locked(directory: str | Path, what: str, *, wait: bool = False,
           say: Callable[[str], None] | None = None) -> Iterator[DirLock]:
    """Hold ``directory``'s lock for the ``with`` block. If the block fails, a directory created
    here is removed again if it is empty (work done inside it is never deleted)."""
    lock = DirLock(directory, what).acquire(wait=wait, say=say)
    try:
        yield lock
    except BaseException:
        lock.release(remove_created=True)
        raise
    lock.release()
