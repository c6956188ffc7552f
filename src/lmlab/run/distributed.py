"""Processes and devices: this process's place under ``torchrun``, the device to use, peak FLOP/s.

Without ``torchrun`` a run is rank 0 of 1 and nothing here talks to other processes. Under it,
:class:`Dist` joins the process group (NCCL on CUDA, gloo on CPU) and offers the few collectives
the trainer needs: a sum, a barrier, and "run this on rank 0 and give every rank the outcome".
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import torch

from .errors import EnvironmentFailure, one_line


@dataclasses.dataclass
class Dist:
    """This process's place under ``torchrun`` (rank 0 of 1 without it)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    owns_group: bool = False

    @classmethod
    def from_env(cls, device: torch.device) -> "Dist":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        import torch.distributed as dist

        owns = not dist.is_initialized()
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL object collectives use the current device
        if owns:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return cls(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), owns)

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

    def on_main(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on rank 0 only and give every rank its result, or its failure: rank 0 raises
        the exception itself, the others a ValueError / FileNotFoundError (bad input), an
        EnvironmentFailure (an OSError or EnvironmentFailure on rank 0) or a RuntimeError, with its
        message. So no rank is left waiting for a broadcast that rank 0 never reaches."""
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

            dist.broadcast_object_list(outcome, src=0)
        kind, value = outcome[0]
        if kind != "ok":
            if failure is not None:
                raise failure
            raise {"bad input": ValueError, "missing": FileNotFoundError, "environment": EnvironmentFailure}.get(
                kind, RuntimeError)(value)
        return value

    def close(self) -> None:
        if self.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()


DEVICE_CHOICES = "auto, cpu, cuda, cuda:N or mps"


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
    """The device ``name`` names (auto: cuda if available, else cpu), or a ValueError saying why it
    cannot be used here. A bare "cuda" under torchrun is this process's GPU (``local_rank``)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device {name!r} is not valid; use {DEVICE_CHOICES}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {name!r}: MPS is not available here; use cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"train.device={name!r} but CUDA is not available here; use train.device=cpu")
        if device.index is None:
            device = torch.device("cuda", local_rank)
        if device.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r} does not exist: this machine has {torch.cuda.device_count()} GPU(s)")
    return device


# peak dense bf16 tensor-core FLOP/s, for MFU on known accelerators (vendor data sheets)
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 70e12,
              "4090": 165e12, "3090": 71e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)
