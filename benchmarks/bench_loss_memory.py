"""Peak memory of the loss step: lmlab's chunked head + cross-entropy against the plain one.

The loss step is what the output head adds to training: hidden states (N, C) -> logits (N, V) ->
mean cross-entropy -> backward to the hidden states and the head's weight. ``plain`` materializes
the logits (``lmlab.loss.linear_cross_entropy_reference``: the head, then ``F.cross_entropy``, as
every library does); ``chunked`` never holds more than one chunk of them
(``lmlab.loss.linear_cross_entropy``, the default training loss). Default size: vocab 128k,
8 x 1024 tokens, d_model 256 (d_model changes both sides alike: hidden states and the head).

How memory is measured:
  - CUDA: ``torch.cuda.max_memory_allocated`` over the step, less what was allocated before it
    (inputs and weights), after ``reset_peak_memory_stats``;
  - CPU: each variant runs in a fresh subprocess; peak resident memory (``ru_maxrss``, the
    kernel's high-water mark) at the end of the step, less the resident memory just before it.
    A fresh process per variant, so one variant's freed memory cannot hide the other's peak.
Both count everything the step allocates beyond its inputs: logits, softmax, gradients (including
the weight's gradient, (V, C), which both variants make).

    python benchmarks/bench_loss_memory.py                  # CPU: needs ~14 GB free for the plain path
    python benchmarks/bench_loss_memory.py --device cuda
    python benchmarks/bench_loss_memory.py --quick
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from harness import Setup, add_device_args


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(p)
    p.add_argument("--vocab", type=int, default=None, help="default 131072 (quick: 8192)")
    p.add_argument("--tokens", type=int, default=None, help="B*T, default 8 x 1024 (quick: 512)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--child", choices=["plain", "chunked"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.vocab = args.vocab or (8192 if args.quick else 131072)
    args.tokens = args.tokens or (512 if args.quick else 8 * 1024)
    return args


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def loss_step(args: argparse.Namespace, impl: str) -> dict:
    """One forward + backward of the loss in this process; peak extra memory and time."""
    from lmlab.loss import LOSSES

    setup = Setup(args)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.d_model, generator=g).to(setup.device).requires_grad_()
    weight = (torch.randn(args.vocab, args.d_model, generator=g) * 0.02).to(setup.device).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(setup.device)
    setup.sync()
    if setup.cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = rss_bytes()
    start = time.perf_counter()
    with setup.autocast():
        loss = LOSSES[impl](hidden, weight, targets)
    loss.backward()
    setup.sync()
    seconds = time.perf_counter() - start
    if setup.cuda:
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before  # ru_maxrss is in KiB on Linux
    return {"impl": impl, "loss": float(loss), "peak_bytes": peak, "seconds": seconds,
            "grad_norm": float(weight.grad.float().norm())}


def main() -> None:
    args = parse()
    if args.child:
        print(json.dumps(loss_step(args, args.child)))
        return
    results = {}
    for impl in ("plain", "chunked"):
        if args.device == "cuda":  # one process: the allocator's peak counter is exact
            results[impl] = loss_step(args, impl)
            torch.cuda.empty_cache()
            continue
        cmd = [sys.executable, __file__, "--child", impl, "--device", args.device, "--vocab", str(args.vocab),
               "--tokens", str(args.tokens), "--d-model", str(args.d_model)]
        cmd += ["--threads", str(args.threads)] if args.threads else []
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[impl] = json.loads(out.strip().splitlines()[-1])
    plain, chunked = results["plain"], results["chunked"]
    logits_gb = args.tokens * args.vocab * 4 / 1e9
    print(
        f"loss step: {args.tokens} tokens x vocab {args.vocab:,} (fp32 logits alone: {logits_gb:.2f} GB), "
        f"d_model {args.d_model}; {args.device}; peak memory measured by "
        + ("torch.cuda.max_memory_allocated" if args.device == "cuda" else "ru_maxrss in a fresh process per variant")
    )
    for r in (plain, chunked):
        print(
            f"  {r['impl']:8s} peak {r['peak_bytes'] / 1e9:7.3f} GB   "
            f"{r['seconds'] * 1e3:8.0f} ms   loss {r['loss']:.6f}"
        )
    assert abs(plain["loss"] - chunked["loss"]) < 1e-3 * abs(plain["loss"]), (plain["loss"], chunked["loss"])
    assert abs(plain["grad_norm"] - chunked["grad_norm"]) < 1e-3 * plain["grad_norm"]
    ratio = chunked["peak_bytes"] / plain["peak_bytes"]
    print(f"chunked / plain peak memory: {ratio:.3f} (target <= 0.5); same loss and head-gradient norm")


if __name__ == "__main__":
    main()
