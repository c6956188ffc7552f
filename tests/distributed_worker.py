"""Checks that need several processes, run by ``torchrun`` from test_distributed.py (one launch for
all of them: starting processes is the slow part). Rank 0 writes the measurements as JSON to the
file given; the test asserts on them.

    torchrun --standalone --nproc-per-node 2 tests/distributed_worker.py OUT.json [RUN_DIR SHARDED_RUN_DIR]
    torchrun --standalone --nproc-per-node 2 tests/distributed_worker.py OUT.json skewed

- expert parallelism (2 processes split 4 experts) under DDP and under FSDP, with the fast and the
  reference expert computation, capacity dropping and a shared expert: each process's logits and
  every gradient against the single-process layer on the same tokens;
- RUN_DIR: its single-process (safetensors) checkpoint loaded into an FSDP model and optimizer,
  gathered back whole, compared with the files bit for bit;
- SHARDED_RUN_DIR: its first (DCP) checkpoint loaded into a model with one more layer: every
  process must refuse it with the same message, and none may hang.
- skewed: a router forced to send every token to ep rank 0's experts (dropless), so rank 0 sends
  nothing and rank 1 receives nothing; outputs and gradients against the single-process layer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import lmlab
from lmlab.run.checkpoint import local as ckpt
from lmlab.run.checkpoint import sharded as dcp
from lmlab.run.config import ParallelConfig, load_config
from lmlab.run.parallel.group import Dist
from lmlab.run.optim import build_optimizer
from lmlab.run.parallel.plan import parallelize

CPU = torch.device("cpu")
MOE = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, ffn="glu",
           moe={"n_experts": 4, "top_k": 2, "n_shared": 1, "capacity_factor": 1.0, "load_balance_coef": 0.01})


def expert_parallel_errors(d: Dist, parallel: str, impl: str) -> dict[str, float]:
    """Max abs differences between expert parallelism and one process holding every expert."""
    cfg = lmlab.ModelConfig.from_preset("llama", **MOE)
    ref, model = lmlab.Transformer(cfg), lmlab.Transformer(cfg)
    for m in (ref, model):
        for layer in m.moe_layers:
            layer.set_impl(impl)
    plan = parallelize(model, ParallelConfig(strategy=parallel, experts=2), d, CPU)
    trained = plan.wrap(model)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(100 + d.rank))  # each its own tokens
    out, want = trained(x, x), ref(x, x)
    out.loss.backward()
    plan.sync_gradients()
    want.loss.backward()
    for p in ref.parameters():  # the data-parallel gradient: the mean over processes
        dist.all_reduce(p.grad)
        p.grad /= d.world
    grads = {"expert": 0.0, "other": 0.0}
    reference = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        expected = reference[name].grad
        if name in plan.expert_names:  # this process holds experts 2*rank, 2*rank+1
            expected = expected.narrow(0, 2 * d.rank, 2)
        kind = "expert" if name in plan.expert_names else "other"
        grads[kind] = max(grads[kind], float((g - expected).abs().max()))
    dropped = min(s["dropped"] for s in ref.moe_stats())
    return {"logits": float((out.logits - want.logits).abs().max()), "loss": abs(float(out.loss) - float(want.loss)),
            "expert_grad": grads["expert"], "other_grad": grads["other"], "dropped": dropped,
            "max_grad": max(float(p.grad.abs().max()) for p in ref.parameters())}


def expert_parallel_skewed_errors(d: Dist, impl: str) -> dict[str, float]:
    """Max abs differences between expert parallelism and one process when every token goes to
    experts 0 and 1 (ep rank 0's): the selection bias picks them, the gate weights are unchanged."""
    cfg = lmlab.ModelConfig.from_preset("llama", **{**MOE, "moe": {"n_experts": 4, "top_k": 2}})
    ref, model = lmlab.Transformer(cfg), lmlab.Transformer(cfg)
    for m in (ref, model):
        for layer in m.moe_layers:
            layer.set_impl(impl)
            layer.router.score_bias.copy_(torch.tensor([1e4, 1e4, 0.0, 0.0]))
    plan = parallelize(model, ParallelConfig(strategy="ddp", experts=2), d, CPU)
    trained = plan.wrap(model)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(100 + d.rank))
    out, want = trained(x, x), ref(x, x)
    out.loss.backward()
    plan.sync_gradients()
    want.loss.backward()
    for p in ref.parameters():
        dist.all_reduce(p.grad)
        p.grad /= d.world
    reference = dict(ref.named_parameters())
    grad = 0.0
    for name, p in model.named_parameters():
        expected = reference[name].grad
        if name in plan.expert_names:
            expected = expected.narrow(0, 2 * d.rank, 2)
        grad = max(grad, float((p.grad - expected).abs().max()))
    loads = [s["tokens_per_expert"] for s in ref.moe_stats()]
    return {"logits": float((out.logits - want.logits).abs().max()), "loss": abs(float(out.loss) - float(want.loss)),
            "grad": grad, "max_grad": max(float(p.grad.abs().max()) for p in ref.parameters()),
            "unchosen": sum(load[2] + load[3] for load in loads), "chosen": sum(load[0] + load[1] for load in loads)}


def load_single_process_checkpoint(d: Dist, run_dir: Path) -> dict[str, int]:
    """Load the run's latest checkpoint (safetensors) into FSDP; count mismatches with the files."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    cfg = load_config(run_dir / "config.yaml")
    model = lmlab.Transformer(cfg.model)
    plan = parallelize(model, cfg.parallel.replace(strategy="fsdp"), d, CPU)
    optimizer = build_optimizer(model, cfg.optim, CPU)
    _, path = ckpt.list_checkpoints(run_dir / "checkpoints")[-1]
    counters = dcp.load_into(path, model, optimizer, plan)
    model_state, optim_state = get_state_dict(model, optimizer,
                                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not d.main:
        return {}
    weights = dcp.read_full_weights(path / ckpt.WEIGHTS)
    saved = dcp.by_name(ckpt.load_state(path)["optimizer"])["state"]
    bad = [k for k, v in weights.items() if not torch.equal(model_state[k], v)]
    bad += [f"{k}.{m}" for k, s in saved.items() for m, v in s.items()
            if not torch.equal(optim_state["state"][k][m], v)]
    return {"tensors": len(weights), "moments": sum(len(s) for s in saved.values()), "mismatches": len(bad),
            "step": counters["step"], "shards": int(sum(hasattr(p, "to_local") for p in model.parameters()))}


def refuse_another_model(d: Dist, run_dir: Path) -> list[str]:
    """Every process's error on loading the run's first checkpoint into a deeper model."""
    cfg = load_config(run_dir / "config.yaml", {"model.n_layers": 3})
    model = lmlab.Transformer(cfg.model)
    plan = parallelize(model, cfg.parallel, d, CPU)
    optimizer = build_optimizer(model, cfg.optim, CPU)
    _, path = ckpt.list_checkpoints(run_dir / "checkpoints")[0]
    try:
        dcp.load_into(path, model, optimizer, plan)
        error = "loaded"
    except ValueError as e:
        error = str(e)
    errors: list = [None] * d.world
    dist.all_gather_object(errors, error)  # reached by every process: none is left waiting
    return errors


def main() -> None:
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    d = Dist.from_env(CPU, timeout=120)
    if sys.argv[2:] == ["skewed"]:
        results = {impl: expert_parallel_skewed_errors(d, impl) for impl in ("fast", "reference")}
        if d.main:
            out.write_text(json.dumps(results, indent=1))
        d.close()
        return
    results = {f"{parallel}/{impl}": expert_parallel_errors(d, parallel, impl)
               for parallel in ("ddp", "fsdp") for impl in ("fast", "reference")}
    if len(sys.argv) > 3:
        results["load"] = load_single_process_checkpoint(d, Path(sys.argv[2]))
        results["refused"] = refuse_another_model(d, Path(sys.argv[3]))
    if d.main:
        out.write_text(json.dumps(results, indent=1))
    d.close()


if __name__ == "__main__":
    main()
