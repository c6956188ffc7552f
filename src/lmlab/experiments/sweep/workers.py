"""Who trains which run: one process, or ``jobs`` worker processes that claim runs through lock files.

    execute(sw, jobs=2, threads=1, log=print)    # every variant x seed of ``sw``; rows in spec order

Each run is claimed with an exclusive, non-blocking ``fcntl.flock`` on its lock file, released by the
kernel however its holder exits, so two workers, or two invocations, never train the same run; a
run's numbers do not depend on which worker trained it. The main process forwards Ctrl-C / SIGTERM:
the first asks each worker to checkpoint and stop, a second stops them at once.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from ...run.parallel.group import threads_refusal
from ..report import fmt
from . import layout
from .engine import Sweep, SweepInterrupted, finished, train_one

__all__ = ["SweepFailed", "check_parallel", "claim", "execute", "worker_count"]

_POLL_S = 2.0  # how often an idle worker looks for a run whose turn has come
_INTERRUPTED = 130  # a worker's exit code after a signal stopped its run


class SweepFailed(RuntimeError):
    """A worker process failed; its traceback is above. Rerunning the same command resumes."""


def check_parallel(jobs: int, threads: int | None) -> None:
    """One-line errors for a bad ``--jobs`` / ``--threads``."""
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"--jobs={jobs} is not valid; give the number of worker processes, at least 1")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"--threads={threads} is not valid; give torch threads per process, at least 1")
    if threads is not None and (why := threads_refusal(threads)) is not None:
        raise ValueError(why)


def worker_count(jobs: int, runs: int) -> int:
    """How many worker processes ``--jobs jobs`` starts for ``runs`` runs: never more than the runs (a worker
    without a run only waits), nor than four per CPU core (each process holds a copy of torch)."""
    return max(1, min(jobs, runs, 4 * (os.cpu_count() or 1)))


@contextlib.contextmanager
def claim(lock: Path) -> Iterator[bool]:
    """Hold an exclusive, non-blocking ``flock`` on ``lock`` for the duration: True if this
    process got it. The kernel releases it when the holder exits, however it exits."""
    import fcntl

    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _work(sw: Sweep, tasks: Sequence[tuple[int, str, int]], log: Callable[[str], None], announce: bool = True) -> None:
    """Train every task (index, variant, seed) not yet done, claiming each; returns when all are done.
    A task whose init_from run is unfinished waits; a task another process holds is skipped until free."""
    total, parent = len(tasks), os.getppid()
    pending = []
    for task in tasks:
        i, name, seed = task
        if not finished(sw, name, seed):
            pending.append(task)
        elif announce:
            done = layout.read_result(layout.run_dir_of(sw.out, name, seed))
            log(f"[{i}/{total}] {name} seed {seed}: done earlier (val loss {fmt(done['final_val_loss'])})")
    while pending:
        if os.getppid() != parent:  # orphaned: whoever started us is gone
            raise SweepInterrupted("the sweep's main process exited; stopping")
        progressed = False
        for task in list(pending):
            i, name, seed = task
            variant = sw.spec.variant(name)
            key = sw.key(variant, seed)
            if key is None:
                continue  # its init_from run is not finished yet
            if finished(sw, name, seed):  # another process finished it
                pending.remove(task)
                continue
            with claim(sw.lock(variant, seed)) as mine:
                if mine and not finished(sw, name, seed):
                    train_one(sw, variant, seed, key, f"[{i}/{total}] {name} seed {seed}", log)
                if mine:
                    pending.remove(task)
                    progressed = True
        if pending and not progressed:
            time.sleep(_POLL_S)


def _worker(sw: Sweep, tasks: list, number: int, threads: int | None) -> None:
    """A worker process: its own process group (the main process forwards signals), one thread count, and
    output that a reader going away (``lmlab sweep ... | head``) never stops, as in the main process."""
    import torch

    from ...run.progress import readers_may_go

    os.setpgid(0, 0)
    if threads:
        torch.set_num_threads(threads)
    with readers_may_go():
        try:
            _work(sw, tasks, lambda m: print(f"[worker {number}] {m}", flush=True), announce=number == 1)
        except SweepInterrupted as e:
            print(f"[worker {number}] {e}", flush=True)
            os._exit(_INTERRUPTED)


def execute(sw: Sweep, jobs: int, threads: int | None, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Run every variant x seed of ``sw`` (in ``jobs`` processes), then read the rows back in spec order."""
    tasks = [(i, name, s) for i, (name, s) in enumerate(sw.spec.tasks(), 1)]
    if worker_count(jobs, len(tasks)) < jobs:
        log(f"note: --jobs {jobs} is more than needed for {len(tasks)} runs on {os.cpu_count()} cores; starting "
            f"{worker_count(jobs, len(tasks))} worker processes")
        jobs = worker_count(jobs, len(tasks))
    if jobs <= 1:
        _work(sw, tasks, log)
    else:
        ctx = multiprocessing.get_context("spawn")
        threads = threads or max(1, (os.cpu_count() or 1) // jobs)  # never more threads than cores in all
        procs = [ctx.Process(target=_worker, args=(sw, tasks, n, threads), daemon=False) for n in range(1, jobs + 1)]
        for p in procs:
            p.start()
        _join(procs)
        codes = [p.exitcode for p in procs]
        missing = [f"{name} seed {seed}" for _, name, seed in tasks if not finished(sw, name, seed)]
        if missing and any(c == _INTERRUPTED for c in codes):
            raise SweepInterrupted(f"sweep {sw.spec.name} stopped by a signal; rerun the same command to resume")
        if missing:
            raise SweepFailed(f"a worker of sweep {sw.spec.name} failed (exit codes {codes}; its error is above) and "
                              f"{len(missing)} runs are unfinished ({missing[0]}, ...); rerun the same command to "
                              "resume")
        if any(c != 0 for c in codes):  # another worker finished what the failed one left
            log(f"a worker exited with code {[c for c in codes if c != 0][0]}, but every run finished")
    return [layout.read_result(layout.run_dir_of(sw.out, name, seed)) for _, name, seed in tasks]


def _join(procs: list) -> None:
    """Wait for the workers; the first Ctrl-C / SIGTERM asks each to checkpoint and stop, a second Ctrl-C
    stops them at once."""
    asked = []

    def forward(signum, frame):
        stop = signal.SIGINT if asked and signum == signal.SIGINT else signal.SIGTERM
        asked.append(signum)
        for p in procs:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, stop)

    handlers = {}
    with contextlib.suppress(ValueError):  # not the main thread: no handlers, plain joins
        handlers = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for p in procs:
            p.join()
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
