"""Memory, measured: what FSDP saves per process against DDP, and what activation checkpointing
saves against keeping every activation, for one fixed model.

    python benchmarks/bench_memory.py                       # both parts (part 1 starts 2 gloo processes)
    python benchmarks/bench_memory.py --part static         # DDP vs FSDP only
    python benchmarks/bench_memory.py --part activations    # checkpointing only

The model: llama-style (RMSNorm, rotary, SwiGLU, grouped-query attention), d_model 256, 12 layers,
4 heads (2 key/value), byte vocabulary, 9.0M parameters; fp32 on the CPU, one torch thread per process.

Part 1, static memory (2 processes, gloo): one training step (forward, backward, clip, AdamW) under
parallel.strategy=ddp and under parallel.strategy=fsdp, on 4 x 256 tokens per process; then, per process,
the bytes of the distinct tensor storages it holds for the parameters, their gradients and the
AdamW state (exp_avg, exp_avg_sq, step), a DTensor counted by its local shard. This is tensor
accounting, exact, not RSS: allocator slack, the CUDA/CPU runtime and DDP's gradient buckets (one
more gradient-sized buffer per process) are left out. Also the peak of live tensor memory during
forward and backward (activations, gathered parameters, gradients as they appear), from the
tracker below. Target: FSDP's parameter + gradient + optimizer memory <= 0.6x DDP's.

Part 2, activation memory (1 process): forward and backward on 8 x 256 tokens with
activation_checkpointing none, blocks (every block), and blocks every 2nd. Measured with
:class:`LiveTensors`, a TorchDispatchMode that counts every tensor storage an operation creates
(outputs that are views of an input are not new) and subtracts it when a weakref finalizer sees it
freed, so it knows the bytes alive at any moment: "held" is what is alive at the end of forward
(what autograd keeps for backward, plus the logits and loss), "peak" the maximum over forward and
backward (with the recomputation and the gradients). Then the time of a full training step, the
variants taking turns. Target: block checkpointing cuts activation memory >= 3x on 12 layers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import lmlab
from lmlab.run.config import OptimConfig, ParallelConfig

V, D, L, HEADS, KV = 256, 256, 12, 4, 2
MB = 2**20


def model_config() -> lmlab.ModelConfig:
    return lmlab.ModelConfig.from_preset("llama", vocab_size=V, d_model=D, n_layers=L, n_heads=HEADS, n_kv_heads=KV,
                                         max_seq_len=256)


# ============================================================== measuring
def storage_key(t) -> int | None:
    """The data pointer of a plain tensor's storage (None for DTensors and non-tensors)."""
    if not isinstance(t, torch.Tensor) or hasattr(t, "to_local"):
        return None
    return t.untyped_storage().data_ptr()


class LiveTensors(TorchDispatchMode):
    """Bytes of the tensor storages created while active that are still alive: ``live`` now, ``peak`` the most."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {storage_key(t) for t in tree_leaves((args, kwargs))}
        for t in tree_leaves(out):
            key = storage_key(t)
            if key is None or key in inputs or key in self.sizes:
                continue  # not a tensor, a view of an input, or already counted
            storage = t.untyped_storage()
            if storage.nbytes():
                self.sizes[key] = storage.nbytes()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self.free, key)
        return out

    def free(self, key: int) -> None:
        self.live -= self.sizes.pop(key, 0)


def distinct_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor by its local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


# ============================================================== part 1: DDP vs FSDP, 2 processes
def static_worker() -> None:
    from lmlab.run.optim import build_optimizer
    from lmlab.run.parallel.group import Dist
    from lmlab.run.parallel.plan import parallelize
    from lmlab.run.trainer import forward_backward

    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    dist = Dist.from_env(cpu)
    g = torch.Generator().manual_seed(dist.rank)
    x = torch.randint(0, V, (4, 256), generator=g)
    setups = {}
    for layout in ("ddp", "fsdp"):
        model = lmlab.Transformer(model_config())
        plan = parallelize(model, ParallelConfig(strategy=layout), dist, cpu)
        setups[layout] = (model, plan, plan.wrap(model), build_optimizer(model, OptimConfig(), cpu))
    report, times = {}, {k: [] for k in setups}
    for rep in range(3):  # the layouts take turns; the first step of each is the one measured
        for layout, (model, plan, trained, optimizer) in setups.items():
            start = time.perf_counter()
            with LiveTensors() as live:
                forward_backward(trained, [(x, x)], 1, device=cpu, no_sync=plan.no_sync(trained))
            plan.clip_gradients(model, 1.0)
            optimizer.step()
            if rep == 0:
                report[layout] = {
                    "params": distinct_bytes(model.parameters()),
                    "grads": distinct_bytes(p.grad for p in model.parameters() if p.grad is not None),
                    "optimizer": distinct_bytes(v for s in optimizer.state.values() for v in s.values()
                                                if torch.is_tensor(v)),
                    "peak": live.peak,
                }
            optimizer.zero_grad(set_to_none=True)
            times[layout].append(time.perf_counter() - start)
    if dist.main:
        n = sum(p.numel() for p in lmlab.Transformer(model_config()).parameters())
        print(f"part 1: per-process memory, {n / 1e6:.1f}M parameters, fp32 + AdamW, 2 processes (gloo), "
              "4 x 256 tokens per process, 1 thread each")
        print(f"{'':>6} {'params':>9} {'grads':>9} {'AdamW':>9} {'static':>9} {'fwd+bwd peak':>13} {'step s':>8}")
        static = {}
        for layout, r in report.items():
            static[layout] = r["params"] + r["grads"] + r["optimizer"]
            print(f"{layout:>6} {r['params'] / MB:8.1f}M {r['grads'] / MB:8.1f}M {r['optimizer'] / MB:8.1f}M "
                  f"{static[layout] / MB:8.1f}M {r['peak'] / MB:12.1f}M {statistics.median(times[layout][1:]):8.3f}")
        ratio = static["fsdp"] / static["ddp"]
        print(f"FSDP / DDP, params + grads + AdamW per process: {ratio:.3f}x (target <= 0.6x: "
              f"{'met' if ratio <= 0.6 else 'NOT met'}); fwd+bwd peak: "
              f"{report['fsdp']['peak'] / report['ddp']['peak']:.3f}x")
    dist.close()


def static_part() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           "--worker"]
    subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)


# ============================================================== part 2: activation checkpointing
def activation_part(steps: int) -> None:
    from lmlab.run.parallel.plan import checkpoint_blocks

    torch.set_num_threads(1)
    x = torch.randint(0, V, (8, 256), generator=torch.Generator().manual_seed(0))
    variants = {"none": 0, "blocks": 1, "blocks/2": 2}  # activation_checkpointing (and _every)
    models = {}
    for name, every in variants.items():
        models[name] = lmlab.Transformer(model_config())
        if every:
            checkpoint_blocks(models[name], every)
    memory, times = {}, {k: [] for k in variants}
    for step in range(steps + 1):  # step 0 measures memory (and warms up); the rest are timed, taking turns
        for name, model in models.items():
            start = time.perf_counter()
            if step == 0:
                with LiveTensors() as live:
                    out = model(x, x)
                    held = live.live
                    out.loss.backward()
                    del out
                memory[name] = (held, live.peak)
            else:
                model(x, x).loss.backward()
                times[name].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    print(f"\npart 2: activation memory, {L} layers, 8 x 256 tokens, forward + backward, 1 process, 1 thread; "
          f"time: median of {steps} steps, variants taking turns")
    print(f"{'checkpointing':>14} {'held after fwd':>15} {'fwd+bwd peak':>13} {'step s':>8} {'vs none':>8}")
    base_time = statistics.median(times["none"])
    for name in variants:
        held, peak = memory[name]
        t = statistics.median(times[name])
        print(f"{name:>14} {held / MB:14.1f}M {peak / MB:12.1f}M {t:8.3f} {t / base_time:7.2f}x")
    cut = memory["none"][0] / memory["blocks"][0]
    print(f"blocks: activation memory held for backward cut {cut:.1f}x "
          f"(target >= 3x: {'met' if cut >= 3 else 'NOT met'}); "
          f"peak over forward + backward cut {memory['none'][1] / memory['blocks'][1]:.1f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("both", "static", "activations"), default="both")
    p.add_argument("--steps", type=int, default=5, help="timed steps per checkpointing variant")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        static_worker()
        return
    if args.part in ("both", "static"):
        static_part()
    if args.part in ("both", "activations"):
        activation_part(args.steps)


if __name__ == "__main__":
    main()
