"""What every benchmark shares: the device flags, autocast, clocks, the alternating timer and the
matmul that MFU is measured against.

    --device cpu|cuda   cuda: bf16 autocast over fp32 weights, as the trainer runs; cpu: fp32
    --threads N         torch CPU threads (the CPU numbers in docs/speed.md use 2)
    --quick             tiny sizes and few steps: seconds, for CI (numbers meaningless)

Timing: the contenders take turns, one step each, for ``--steps`` rounds after ``--warmup``; each
reports the median of its steps, and a ratio is the median over rounds of the ratio within the
round, so load from other programs on a shared machine hits both sides of it alike. Two clocks:
wall time, and on CPU the process CPU time.

MFU (model FLOPs utilization): model FLOPs per second over the throughput of one large matmul in
the same dtype on the same device, measured in the same run, between the timed steps (best of
its repeats). It is the fraction of what this machine's matmul reaches, not of a datasheet peak.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Callable

import torch


def add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: bf16 autocast over fp32 weights; cpu: fp32")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--quick", action="store_true", help="tiny sizes and few steps (seconds; for CI)")


class Setup:
    """The device, the autocast context and the matmul dtype a benchmark runs under."""

    def __init__(self, args: argparse.Namespace):
        if args.threads:
            torch.set_num_threads(args.threads)
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible to torch")
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32  # what the matmuls run in

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.cuda else contextlib.nullcontext()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def describe(self) -> str:
        what = "bf16 autocast" if self.cuda else f"fp32, {torch.get_num_threads()} threads"
        name = torch.cuda.get_device_name(self.device) if self.cuda else "CPU"
        return f"{name} ({what}), torch {torch.__version__}"

    def matmul_flops(self, n: int, repeats: int = 5) -> float:
        """FLOP/s of the best of ``repeats`` n x n x n matmuls in the benchmark's dtype."""
        a = torch.randn(n, n, device=self.device).to(self.dtype)
        b = torch.randn(n, n, device=self.device).to(self.dtype)
        a @ b  # warm up
        best = float("inf")
        for _ in range(repeats):
            self.sync()
            t = time.perf_counter()
            a @ b
            self.sync()
            best = min(best, time.perf_counter() - t)
        return 2 * n**3 / best


class Alternating:
    """Time contenders in turns, one call each per round; medians per contender."""

    def __init__(self, setup: Setup, contenders: dict[str, Callable[[], object]]):
        self.setup, self.contenders = setup, contenders
        self.wall: dict[str, list[float]] = {name: [] for name in contenders}
        self.cpu: dict[str, list[float]] = {name: [] for name in contenders}
        self.peak = 0.0

    def run(self, steps: int, warmup: int, matmul: int = 0) -> "Alternating":
        for i in range(warmup + steps):
            for name, fn in self.contenders.items():
                self.setup.sync()
                w, c = time.perf_counter(), time.process_time()
                fn()
                self.setup.sync()
                if i >= warmup:
                    self.wall[name].append(time.perf_counter() - w)
                    self.cpu[name].append(time.process_time() - c)
            if matmul and i >= warmup:  # the reference matmul, under the same load as the steps
                self.peak = max(self.peak, self.setup.matmul_flops(matmul, repeats=2))
        return self

    def median(self, name: str) -> tuple[float, float]:
        """(wall seconds, CPU seconds) per call."""
        return statistics.median(self.wall[name]), statistics.median(self.cpu[name])

    def ratio(self, fast: str, slow: str) -> tuple[float, float]:
        """How many times faster ``fast`` is than ``slow``: the median over rounds of the ratio within
        each round, (wall, CPU time). Within a round the two ran back to back under about the same
        load, so on a busy machine this paired estimate is steadier than a ratio of medians."""
        wall = statistics.median(s / f for f, s in zip(self.wall[fast], self.wall[slow]))
        cpu = statistics.median(s / f for f, s in zip(self.cpu[fast], self.cpu[slow]))
        return wall, cpu

    def ratios_per_round(self, fast: str, slow: str) -> list[float]:
        """slow / fast wall time of each round: the spread says how much to trust the median."""
        return [s / f for f, s in zip(self.wall[fast], self.wall[slow])]


def mfu(flops_per_token: float, tokens_per_s: float, peak: float) -> float:
    return flops_per_token * tokens_per_s / peak if peak else float("nan")


def compile_blocks(model) -> None:
    """lmlab's compile option, as ``train.compile`` applies it (lmlab.run.parallel.compile)."""
    from lmlab.run.parallel.compile import compile_blocks as apply

    apply(model)
