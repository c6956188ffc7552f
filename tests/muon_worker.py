"""Run under torchrun with 2 processes by test_muon.py: optim.name=muon under FSDP (2-D matrices as
DTensors, expert stacks sharded over the expert dimension), FSDP with expert parallelism, and DDP with
expert parallelism, against one process, with Newton-Schulz in float32.

torch's Muon orthogonalizes in bf16, where a gradient summed in another order can round differently
and the difference grows from step to step; in float32 the layouts must agree with one process to
float32's precision, which checks the sharded step itself. Every process trains on the same batch,
so the mean of the gradients over processes is the one process's gradient. Writes {layout: largest
relative difference of any parameter after 3 steps} to argv[1] (rank 0)."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.optim._muon as torch_muon
from helpers import tiny_config

import lmlab
from lmlab.run.config import OptimConfig, ParallelConfig
from lmlab.run.optim import build_optimizer
from lmlab.run.parallel.group import Dist
from lmlab.run.parallel.plan import parallelize


def newton_schulz_fp32(grad, coefficients, steps, eps):
    """torch's _zeropower_via_newtonschulz, in float32 instead of bf16."""
    a, b, c = coefficients
    X = grad.float()
    tall = grad.size(0) > grad.size(1)
    X = X.T if tall else X
    X = X / X.norm().clamp(min=eps)
    for _ in range(steps):
        A = X @ X.T
        X = torch.addmm(X, torch.addmm(A, A, A, beta=b, alpha=c), X, beta=a)
    return X.T if tall else X


def trained(model: torch.nn.Module, step: callable, x: torch.Tensor, steps: int = 3) -> None:
    opt = build_optimizer(model, OptimConfig(name="muon"), torch.device("cpu"))
    for _ in range(steps):
        step(model, x)
        opt.step()
        opt.zero_grad(set_to_none=True)


def main(out: str) -> None:
    torch_muon._zeropower_via_newtonschulz = newton_schulz_fp32
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = tiny_config(ffn="glu", moe={"n_experts": 4, "top_k": 2, "n_shared": 1})
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))

    def plain_step(model, x):
        model(x, targets=x).loss.backward()

    reference = lmlab.Transformer(cfg)
    trained(reference, plain_step, x)
    want = dict(reference.named_parameters())
    results = {}
    for name, strategy, experts in (("fsdp", "fsdp", 1), ("fsdp+ep", "fsdp", 2), ("ddp+ep", "ddp", 2)):
        model = lmlab.Transformer(cfg)
        plan = parallelize(model, ParallelConfig(strategy=strategy, experts=experts), Dist(rank=rank, world=2),
                           torch.device("cpu"))
        wrapped = plan.wrap(model)

        def step(model, x, wrapped=wrapped, plan=plan):
            wrapped(x, targets=x).loss.backward()
            plan.sync_gradients()

        trained(model, step, x)
        state = plan.global_state(dict(model.named_parameters()))  # expert shards as DTensors of the whole
        worst = 0.0
        for n, p in state.items():
            p = p.detach()
            p = p.full_tensor() if hasattr(p, "full_tensor") else p
            worst = max(worst, float((p - want[n].detach()).abs().max() / want[n].detach().abs().max()))
        results[name] = worst
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
