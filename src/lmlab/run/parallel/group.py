"""Processes and devices: this process's place under ``torchrun``, the device to use, peak FLOP/s.

Without ``torchrun`` a run is rank 0 of 1 and nothing here talks to other processes. Under it,
:class:`Dist` joins the process group (NCCL on CUDA, gloo on CPU) and offers the few collectives
the trainer needs: a sum, a barrier, and "run this on rank 0 and give every rank the outcome".

No process waits forever. Every process group has a timeout: ``parallel.collective_timeout`` for
the default group and the groups built from it (DDP, FSDP, expert parallelism, checkpoints), and
``parallel.setup_timeout`` for the group that waits while rank 0 prepares the data. A process whose
peers died sees its next collective fail (at once when the connection drops, else after the
timeout), and :meth:`Dist.close` after a failure arms a watchdog that ends the process if its
shutdown hangs, as gloo's can when it tears down connections to dead peers.

No process outlives its launcher either: each rank started by ``torchrun`` watches its parent (the
elastic agent), and when the agent dies (kill -9 leaves the ranks to init) it sends itself SIGTERM, as
torchrun does to its workers when it stops cleanly: the trainer finishes its step, saves a checkpoint
with the other ranks and exits, releasing the run's lock; a rank still alive well after the collective
timeout (:func:`launcher_grace`) is ended (:func:`watch_launcher`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import os
import signal
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from ..errors import EnvironmentFailure, one_line


class PeersLost(EnvironmentFailure):
    """A collective failed: another process died, or did not answer within the timeout."""


SHUTDOWN_GRACE_S = 30.0  # a failed process still alive this long (or the timeout, if less) after close is ended

@dataclasses.dataclass
class Dist:
    """This process's place under ``torchrun`` (rank 0 of 1 without it)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    owns_group: bool = False
    timeout: float = 600.0  # seconds, the default group's and its subgroups'
    setup_group: Any = None  # a gloo group with the setup timeout, for on_main

    @classmethod
    def from_env(cls, device: torch.device, timeout: float = 600.0, setup_timeout: float = 3600.0) -> "Dist":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        import torch.distributed as dist

        owns = not dist.is_initialized()
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL object collectives use the current device
        if owns:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                    timeout=datetime.timedelta(seconds=timeout))
        setup = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=setup_timeout))
        # the collective timeout must end a wait on a dead or frozen peer first, so that the rank says why it
        # stops (PeersLost); the launcher watch's watchdog only ends a rank that is still alive after that
        watch_launcher(grace=launcher_grace(timeout))
        return cls(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), owns, timeout, setup)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def subgroups(self, ranks: Sequence[Sequence[int]]) -> Any:
        """Split the processes into the groups ``ranks`` (every rank in exactly one), with this
        Dist's timeout; returns the group holding this rank. Every rank must call it alike."""
        import torch.distributed as dist

        mine, _ = dist.new_subgroups_by_enumeration([list(r) for r in ranks],
                                                    timeout=datetime.timedelta(seconds=self.timeout))
        return mine

    def on_main(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on rank 0 only and give every rank its result, or its failure: rank 0 raises
        the exception itself, the others a ValueError / FileNotFoundError (bad input), an
        EnvironmentFailure (an OSError or EnvironmentFailure on rank 0) or a RuntimeError, with its
        message. So no rank is left waiting for a broadcast that rank 0 never reaches. The others
        wait up to the setup timeout (``fn`` may prepare a large corpus)."""
        outcome: list[Any] = [None]
        failure: Exception | None = None
        if self.main:
            try:
                outcome = [("ok", fn())]
            except Exception as e:
                if self.world == 1:
                    raise
                failure = e
                outcome = [(failure_kind(e), one_line(e))]
        if self.world > 1:
            import torch.distributed as dist

            dist.broadcast_object_list(outcome, src=0, group=self.setup_group)
        kind, value = outcome[0]
        if kind != "ok":
            if failure is not None:
                raise failure
            raise {"bad input": ValueError, "missing": FileNotFoundError, "environment": EnvironmentFailure}.get(
                kind, RuntimeError)(value)
        return value

    @contextlib.contextmanager
    def collectives(self) -> Iterator[None]:
        """Turn a failed collective (a peer died, or did not answer within the timeout) into
        :class:`PeersLost`, which says so."""
        try:
            yield
        except RuntimeError as e:
            if self.world == 1 or isinstance(e, EnvironmentFailure) or not is_collective_failure(e):
                raise
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise PeersLost(
                f"process {self.rank} of {self.world} lost contact with the others ({first}); a process died or did "
                f"not answer within parallel.collective_timeout={self.timeout:g}s. Continue from the last checkpoint "
                "with --resume"
            ) from e

    def close(self, peers_lost: bool = False) -> None:
        """Leave the process group. When ``peers_lost`` (see :func:`lost_peers`) the group may hold
        connections to dead processes, and tearing it down can block: then it is left to the exit,
        and a watchdog ends this process if it is still alive min(SHUTDOWN_GRACE_S, timeout) later."""
        if not self.owns_group:
            return
        if peers_lost and self.world > 1:
            exit_after(min(SHUTDOWN_GRACE_S, self.timeout))
            return
        import torch.distributed as dist

        dist.destroy_process_group()
        self.owns_group = False


LAUNCHER_POLL_S = 1.0  # how often a torchrun rank checks that its launcher is alive
_WATCHING: list[threading.Thread] = []


def launcher_grace(timeout: float) -> float:
    """How long a rank whose launcher died may go on before it is ended: a collective already waiting
    on a dead peer fails within ``timeout`` and then reports and closes within min(SHUTDOWN_GRACE_S,
    timeout); ending the rank at ``timeout`` itself raced that failure, and lost it silently."""
    return timeout + min(SHUTDOWN_GRACE_S, timeout)


def watch_launcher(grace: float, poll: float = LAUNCHER_POLL_S) -> None:
    """Under ``torchrun`` (TORCHELASTIC_RUN_ID set), watch the launcher from a daemon thread: once this
    process's parent is no longer the one that started it, the launcher died without stopping its
    workers (kill -9), so stop this rank the way torchrun would, with SIGTERM (the trainer saves a
    checkpoint with its peers and exits), and end it if it is still alive ``grace`` seconds later
    (a peer that died first leaves a collective waiting that long). Idempotent; not under torchrun,
    nothing (a process started some other way may outlive its parent on purpose)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or _WATCHING:
        return
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll)
        exit_after(grace)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="lmlab-launcher-watch", daemon=True)
    thread.start()
    _WATCHING.append(thread)


_WATCHDOG_SINK: list[Any] = []  # keeps the watchdog's output file open for the life of the process


def exit_after(seconds: float) -> None:
    """End this process (status 1) if it is still running ``seconds`` from now. faulthandler's
    watchdog is a C thread that needs no GIL, so it fires even inside a hung interpreter shutdown,
    where Python threads and signal handlers no longer run."""
    if not _WATCHDOG_SINK:
        _WATCHDOG_SINK.append(open(os.devnull, "w"))
    faulthandler.dump_traceback_later(seconds, exit=True, file=_WATCHDOG_SINK[0])


def lost_peers(e: BaseException | None) -> bool:
    """Did ``e`` end a run because other processes are gone (rather than bad input or a bug)?"""
    return e is not None and (isinstance(e, PeersLost) or (isinstance(e, RuntimeError) and is_collective_failure(e)))


def is_collective_failure(e: BaseException) -> bool:
    """Is ``e`` a collective that failed (gloo, NCCL) rather than a bug in the computation?"""
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return any(s in text for s in ("gloo", "NCCL", "Connection reset", "Connection closed", "Timed out"))


DEVICE_CHOICES = "auto, cpu, cuda, cuda:N or mps"
# --threads above this many per CPU core only oversubscribes (10,000 ran for minutes, 100,000 crashed torch)
THREADS_PER_CORE = 4


def threads_refusal(n: int) -> str | None:
    """Why ``--threads n`` is too many for this machine (more than THREADS_PER_CORE per core), or None."""
    cores = os.cpu_count() or 1
    limit = THREADS_PER_CORE * cores
    if n <= limit:
        return None
    return (f"--threads {n:,} is more than {THREADS_PER_CORE} per CPU core ({cores} core(s) here: at most {limit}); "
            "threads beyond the cores only slow torch down")


def failure_kind(e: Exception) -> str:
    """How another rank should re-raise ``e``: see ``Dist.on_main``."""
    if isinstance(e, FileNotFoundError):
        return "missing"
    if isinstance(e, ValueError):
        return "bad input"
    if isinstance(e, (OSError, EnvironmentFailure)):
        return "environment"
    return "error"


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The device ``name`` names (auto: cuda if available, else cpu). A name that is no device is a
    ValueError (bad input); a device this machine lacks is an EnvironmentFailure (exit status 3).
    A bare "cuda" under torchrun is this process's GPU (``local_rank``)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device {name!r} is not valid; use {DEVICE_CHOICES}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise EnvironmentFailure(f"device {name!r}: MPS is not available here; use cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise EnvironmentFailure(f"device {name!r}: CUDA is not available here; use cpu (train.device=cpu, or "
                                     "--device cpu)")
        if device.index is None:
            device = torch.device("cuda", local_rank)
        if device.index >= torch.cuda.device_count():
            gpus = torch.cuda.device_count()
            raise EnvironmentFailure(f"device {str(device)!r} does not exist: this machine has {gpus} GPU(s)")
    return device


# peak dense bf16 tensor-core FLOP/s, for MFU on known accelerators (vendor data sheets)
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 70e12,
              "4090": 165e12, "3090": 71e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)
