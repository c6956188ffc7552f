"""Parallelism, applied to a plain :class:`~lmlab.model.Transformer` from outside (as torchtitan's
``parallelize.py`` does): the model code never branches on it.

    parallel.strategy=ddp     every process holds the whole model; gradients are all-reduced
                              (DistributedDataParallel)
    parallel.strategy=fsdp    fully_shard each block, then the root, over a 1-D mesh of all W processes:
                              each holds 1/W of the parameters, gradients and AdamW state, and a block's
                              parameters are all-gathered only for its forward and backward (FSDP2;
                              Zhao et al. 2023, arXiv:2304.11277)
    parallel.experts=N        each MoE layer's E routed experts are split over groups of N processes,
                              E/N each; tokens travel to their experts' process with all_to_all and
                              back (GShard, Lepikhin et al. 2021, sec. 3.2)
    activation_checkpointing  blocks: every k-th block keeps only its input for backward and
                              recomputes the rest (Chen et al. 2016, arXiv:1604.06174)

With expert parallelism the W processes form a 2-D mesh (W/N replicas x N expert shards)::

    rank            0   1 | 2   3 | ...     "ep" groups: N consecutive ranks split the experts
    experts         a   b | a   b | ...     "replica" groups: the ranks holding the same experts
    non-experts     DDP or FSDP over all W ranks

The expert parameters are plain tensors holding this rank's experts; DDP and FSDP ignore them, and
:meth:`Parallel.sync_gradients` sums their gradients over the replica group instead. For distributed
checkpoints they are presented as DTensors sharded over the mesh (:meth:`Parallel.global_state`), so
a checkpoint saved with one layout loads into any other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn

from ...config import ModelConfig
from ...model import Transformer
from ...moe import Assignment, Experts, combine, dispatch, plan
from ...torch_private import all_to_all_single_autograd, ddp_ignore
from ..config import ParallelConfig
from ..optim import clip_gradients
from .group import Dist


# ============================================================== expert parallelism
@dataclasses.dataclass
class ExpertGroups:
    """This process's place in expert parallelism: N processes per ep group split the experts."""

    size: int  # N, processes that split one layer's experts
    rank: int  # this process's index in its ep group: it holds experts rank*E/N .. (rank+1)*E/N - 1
    group: Any  # the ep group (all_to_all)
    replicas: int  # W / N groups hold the same experts
    replica_group: Any  # the processes holding the same experts as this one (gradient sums)
    mesh: Any  # 2-D DeviceMesh (replica, ep), for checkpoints

    @classmethod
    def build(cls, n: int, dist: Dist, device: torch.device) -> "ExpertGroups":
        from torch.distributed.device_mesh import DeviceMesh

        W = dist.world
        layout = torch.arange(W).view(W // n, n)  # row: one ep group; column: one replica group
        ep = dist.subgroups(layout.tolist())
        replica = dist.subgroups(layout.t().tolist())
        mesh = DeviceMesh.from_group([replica, ep], device.type, mesh=layout, mesh_dim_names=("replica", "ep"))
        return cls(n, dist.rank % n, ep, W // n, replica, mesh)


class ShardedExperts(Experts):
    """This process's E/N of a MoE layer's routed experts. ``loop`` and ``grouped`` (the two
    implementations ``MoE.set_impl`` chooses) run on the owners of the experts::

        plan: rows grouped by expert ─ all_to_all ─▶ rows for my experts ─ loop / grouped ─┐
        combine: out_TD += gated rows ◀── all_to_all ─────── gated rows ◀────────────────┘

    Routing, capacity and gate weights are decided where the tokens are, as without expert
    parallelism, so a process's outputs equal the single-process layer's on its own tokens.
    Expert e lives on ep rank e // (E/N) (DeepSeekMoE's "device" groups are contiguous too).
    """

    def __init__(self, cfg: ModelConfig, groups: ExpertGroups):
        moe = cfg.moe
        self.n_total = moe.routed_experts
        super().__init__(self.n_total // groups.size, cfg.d_model, moe.expert_width(cfg.d_ff), cfg.ffn,
                         cfg.activation, cfg.bias, cfg.glu_variant, cfg.glu_limit)
        self.groups = groups
        self.first = groups.rank * self.n  # the global index of this process's first expert

    @torch.no_grad()
    def take(self, full: Experts) -> "ShardedExperts":
        """Copy this process's experts from the full layer."""
        for name, p in self.named_parameters():
            p.copy_(getattr(full, name).narrow(0, self.first, self.n))
        return self

    def loop(self, x_TD: torch.Tensor, a: Assignment, out_TD: torch.Tensor) -> torch.Tensor:
        return self.exchange(Experts.loop, x_TD, a, out_TD)

    def grouped(self, x_TD: torch.Tensor, a: Assignment, out_TD: torch.Tensor) -> torch.Tensor:
        return self.exchange(Experts.grouped, x_TD, a, out_TD)

    def exchange(self, compute: Callable, x_TD: torch.Tensor, a: Assignment, out_TD: torch.Tensor) -> torch.Tensor:
        """Send the plan's rows (grouped by expert) to their experts' processes, run ``compute`` there
        on this process's experts, bring the gated rows back and add them to their tokens as the
        single-process fast path does (``combine``), so the sums are the same."""
        import torch.distributed as dist

        N, n = self.groups.size, self.n
        p = plan(a)  # dropless: every assignment; capacity: C slots per expert, the empty ones weighted 0
        send_E = torch.diff(p.offs_E, prepend=p.offs_E.new_zeros(1)).long()  # (E,) rows for each expert
        recv_E = torch.empty_like(send_E)  # (N*n,) rows from each source process for each of my experts
        dist.all_to_all_single(recv_E, send_E, group=self.groups.group)
        send_N = send_E.view(N, n).sum(1).tolist()  # one host sync: all_to_all needs the split sizes
        recv_N = recv_E.view(N, n).sum(1).tolist()
        x_RD = all_to_all(dispatch(x_TD, p), send_N, recv_N, self.groups.group)
        weight_R = all_to_all(p.weight_A, send_N, recv_N, self.groups.group)
        # rows arrive grouped by source, each source's by expert: my expert j, recv_E[i*n + j] times
        local_R = torch.arange(n, device=recv_E.device).repeat(N).repeat_interleave(recv_E)
        R = local_R.numel()
        mine = Assignment(
            torch.arange(R, device=recv_E.device),
            local_R,
            weight_R,
            torch.ones(R, dtype=torch.bool, device=recv_E.device),
            recv_E.view(N, n).sum(0),
            torch.tensor(R),
        )
        y_RD = compute(self, x_RD, mine, x_RD.new_zeros(x_RD.shape))  # one row per received row, gated
        y_AD = all_to_all(y_RD, recv_N, send_N, self.groups.group)
        return combine(y_AD, p, out_TD)


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    """Rows send[j] of ``x`` (in order) go to process j; returns the rows received, by source.
    Differentiable: the backward sends the gradients the reverse way."""
    return all_to_all_single_autograd(x.contiguous(), recv, send, group)


def shard_experts(model: Transformer, groups: ExpertGroups) -> list[ShardedExperts]:
    """Replace each MoE layer's routed experts with this process's share of them."""
    sharded = []
    for moe in model.moe_layers:
        local = ShardedExperts(model.config, groups).to(moe.experts.w_in_EID.device).take(moe.experts)
        moe.experts = local
        sharded.append(local)
    return sharded


# ============================================================== activation checkpointing
def checkpoint_blocks(model: Transformer, every: int) -> int:
    """Recompute every ``every``-th block (0, k, 2k, ...) in backward instead of keeping its
    activations; returns how many. Dropout masks and GShard's random routing repeat exactly
    (``preserve_rng_state``). A recomputed MoE layer adds its load to the balancing count again,
    which doubles every count alike and leaves the sign-based bias update unchanged."""
    n = 0
    for i, block in enumerate(model.blocks):
        if i % every == 0:
            block.forward = recomputed(block.forward)
            n += 1
    return n


def recomputed(forward: Callable) -> Callable:
    """``forward`` under ``torch.utils.checkpoint`` when gradients are on (plain when evaluating)."""
    from torch.utils.checkpoint import checkpoint

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


# ============================================================== the plan
@dataclasses.dataclass
class Parallel:
    """How this process's model is spread over the processes; see :func:`parallelize`."""

    world: int = 1
    device: torch.device = torch.device("cpu")
    fsdp: bool = False
    root: nn.Module | None = None  # the fully_shard-ed model under FSDP
    experts: ExpertGroups | None = None
    expert_params: list[nn.Parameter] = dataclasses.field(default_factory=list)  # this rank's expert shards
    expert_names: dict[str, int] = dataclasses.field(default_factory=dict)  # their names -> global dim 0

    @property
    def sharded(self) -> bool:
        """Part of the model lives only on other processes (FSDP or expert parallel): every process
        evaluates, samples and saves, and checkpoints are distributed (DCP)."""
        return self.fsdp or self.experts is not None

    def wrap(self, module: nn.Module) -> nn.Module:
        """``module`` as trained: DistributedDataParallel over it under ddp with several processes."""
        if self.world == 1 or self.fsdp:
            return module
        from torch.nn.parallel import DistributedDataParallel as DDP

        ignore = {id(p) for p in self.expert_params}
        if ignore:  # expert gradients are summed over replicas by sync_gradients, not averaged by DDP
            names = [name for name, p in module.named_parameters() if id(p) in ignore]
            ddp_ignore(module, names)
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DDP(module, device_ids=ids, **no_buffer_broadcasts())

    def no_sync(self, trained: nn.Module) -> Callable[[], ContextManager]:
        """A context for the micro-batches before a step's last (``trained``: the module called):
        gradients accumulate locally. Under FSDP the parameters also stay gathered between them,
        saving an all-gather per micro-batch at the cost of holding them whole meanwhile."""
        if self.fsdp:
            return functools.partial(fsdp_no_sync, self.root)
        return getattr(trained, "no_sync", contextlib.nullcontext)

    def sync_gradients(self) -> None:
        """After a step's last backward: expert gradients hold the sum over this ep group's tokens;
        sum them over the replicas and divide by W, the mean DDP and FSDP take of the others."""
        if self.experts is None:
            return
        import torch.distributed as dist

        for p in self.expert_params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.experts.replicas > 1:
                dist.all_reduce(p.grad, group=self.experts.replica_group)
            p.grad.div_(self.world)

    def clip_gradients(self, model: nn.Module, max_norm: float) -> float:
        """Scale all gradients to global L2 norm <= ``max_norm`` (0 = leave them); return the norm
        before clipping. FSDP's sharded gradients are DTensors whose norm torch reduces over the
        shards; expert shards are summed over the ep group here."""
        if not self.expert_params:
            return clip_gradients(model.parameters(), max_norm)
        import torch.distributed as dist

        experts = {id(p) for p in self.expert_params}
        grads = [p.grad for p in model.parameters() if p.grad is not None and id(p) not in experts]
        dense = torch.nn.utils.get_total_norm(grads).float() if grads else torch.zeros(())
        dense = dense.full_tensor() if hasattr(dense, "full_tensor") else dense
        sq = sum((p.grad.float().square().sum() for p in self.expert_params), torch.zeros((), device=dense.device))
        dist.all_reduce(sq, group=self.experts.group)  # the shards of one replica make up all experts
        norm = float(torch.sqrt(dense.square() + sq))
        if max_norm > 0:
            coef = min(1.0, max_norm / (norm + 1e-6)) if math.isfinite(norm) else float("nan")
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm

    @contextlib.contextmanager
    def whole_root(self) -> Iterator[None]:
        """The root's own parameters (embeddings, final norm, head) gathered for the duration: code
        that calls the model's parts rather than the model (generation) bypasses FSDP's root hooks.
        The blocks still gather and free theirs as they are called."""
        if not self.fsdp:
            yield
            return
        self.root.unshard()
        try:
            yield
        finally:
            self.root.reshard()

    def all_finite(self, params: Iterator[torch.Tensor], dist: Dist) -> bool:
        """Are all parameters finite, on every process? (Each checks its own shards.)"""
        local = all(bool(torch.isfinite(local_tensor(p)).all()) for p in params)
        if not self.sharded:
            return local
        bad = torch.tensor([0.0 if local else 1.0], device=self.device)
        return float(dist.all_reduce_sum(bad)[0]) == 0.0

    # ---- checkpoints
    def global_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A model or optimizer state dict (from ``get_state_dict``) with this rank's expert shards
        presented as DTensors of the whole layer (replicated over replicas, sharded over ep), so
        that DCP writes and reads each expert once and can reshard. The DTensors share storage
        with the tensors given: loading into them loads into those."""
        return self.map_experts(state, self.to_dtensor)

    def local_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The inverse of :meth:`global_state`: expert DTensors back to this rank's local tensors."""
        return self.map_experts(state, lambda t: t.to_local() if hasattr(t, "to_local") else t)

    def slice_full_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A full (unsharded) state dict with each expert tensor cut to this rank's experts."""
        if self.experts is None:
            return state
        n = next(iter(self.expert_names.values())) // self.experts.size if self.expert_names else 0
        return self.map_experts(state, lambda t: t.narrow(0, self.experts.rank * n, n))

    def to_dtensor(self, t: torch.Tensor) -> Any:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        shape = (t.shape[0] * self.experts.size, *t.shape[1:])
        return DTensor.from_local(t, self.experts.mesh, [Replicate(), Shard(0)], run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())

    def map_experts(self, state: dict[str, Any], fn: Callable[[torch.Tensor], Any]) -> dict[str, Any]:
        """``state`` (a model state dict, or an optimizer one with "state") with ``fn`` applied to
        each expert parameter and to its optimizer moments; other entries as they are."""
        if self.experts is None:
            return state

        def per_param(name: str, value: Any) -> Any:
            if name not in self.expert_names:
                return value
            if isinstance(value, dict):  # optimizer state: the moments have the parameter's shape
                return {k: fn(v) if torch.is_tensor(v) and v.ndim > 0 else v for k, v in value.items()}
            return fn(value)

        if "state" in state and "param_groups" in state:
            return {**state, "state": {k: per_param(k, v) for k, v in state["state"].items()}}
        return {k: per_param(k, v) for k, v in state.items()}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This process's part of ``t``: the local shard of a DTensor, else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def global_moe_stats(stats: list[dict], all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
                     device: torch.device) -> list[dict]:
    """Each MoE layer's load statistics (``MoE.stats``) over the tokens of every process: counts
    summed, kept share recomputed from the sums, entropy averaged. Every process must call it."""
    if not stats or not stats[0]:
        return stats
    E = len(stats[0]["tokens_per_expert"])
    rows = [[*s["tokens_per_expert"], sum(s["tokens_per_expert"]) * (1.0 - s["dropped"]), s["router_entropy"], 1.0]
            for s in stats]
    summed = all_reduce_sum(torch.tensor(rows, dtype=torch.float64, device=device)).cpu()
    out = []
    for row in summed:
        load_E, (kept, entropy, n) = row[:E], row[E:].tolist()
        total, mean = float(load_E.sum()), float(load_E.mean().clamp_min(1e-9))
        out.append({
            "tokens_per_expert": [round(v) for v in load_E.tolist()],
            "dropped": 1.0 - kept / total if total else 0.0,
            "router_entropy": entropy / n,
            "max_load": float(load_E.max()) / mean,
            "cv_load": float(load_E.std(unbiased=False)) / mean,
        })
    return out


@contextlib.contextmanager
def fsdp_no_sync(model: nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)


def no_buffer_broadcasts() -> dict[str, bool]:
    """DistributedDataParallel's argument that turns off its broadcast of the buffers at every forward: the
    buffers stay in sync without it (constants, and MoE router biases that every rank updates identically
    from all-reduced loads). torch 2.13 names it ``forward_sync_buffers`` and deprecates ``broadcast_buffers``
    with a FutureWarning on every process; the older torch that lmlab supports knows only ``broadcast_buffers``.
    The new flag still broadcasts the buffers once, when DDP starts: they are equal then anyway."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    new = "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
    return {"forward_sync_buffers" if new else "broadcast_buffers": False}


# ============================================================== applying it
def parallelize(model: Transformer, t: ParallelConfig, dist: Dist, device: torch.device) -> Parallel:
    """Apply ``t``'s expert parallelism, activation checkpointing and FSDP to ``model``, in place,
    in that order; return the plan (DDP, which wraps rather than changes, is :meth:`Parallel.wrap`).
    Raises ValueError, alike on every process, for a layout the processes cannot form."""
    check_layout(t, dist.world)
    plan = Parallel(world=dist.world, device=device, fsdp=t.strategy == "fsdp")
    if t.experts > 1:
        plan.experts = ExpertGroups.build(t.experts, dist, device)
        for local in shard_experts(model, plan.experts):
            plan.expert_params += list(local.parameters())
        mine = {id(p) for p in plan.expert_params}
        plan.expert_names = {name: model.config.moe.routed_experts for name, p in model.named_parameters()
                             if id(p) in mine}
    if t.activation_checkpointing == "blocks":
        checkpoint_blocks(model, t.activation_checkpoint_every)
    if plan.fsdp:
        shard_model(model, device, set(plan.expert_params))
        plan.root = model
    return plan


def check_layout(t: ParallelConfig, world: int) -> None:
    if t.strategy == "fsdp" and world == 1:
        raise ValueError("parallel.strategy=fsdp shards the model over several processes, and this is one; start "
                         "them with torchrun --nproc-per-node N (N >= 2), or use parallel.strategy=ddp")
    n = t.experts
    if n > 1 and world % n:
        hint = "start N processes with torchrun --nproc-per-node N" if world == 1 else f"use a divisor of {world}"
        raise ValueError(f"parallel.experts={n} does not divide the {world} process{'es' * (world > 1)}; "
                         f"each group of {n} processes splits the experts: {hint}, or set parallel.experts=1")


def shard_model(model: Transformer, device: torch.device, ignored: set[nn.Parameter]) -> None:
    """fully_shard each block, then the root (embeddings, final norm, head), over all processes.
    On CUDA parameters are gathered in bf16 and gradients reduced in fp32 (MixedPrecisionPolicy);
    on CPU everything stays fp32. Expert-parallel parameters (``ignored``) are left to the plan."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" \
        else MixedPrecisionPolicy()
    ignored_ids = {id(p) for p in ignored}
    for block in model.blocks:
        mine = {p for p in block.parameters() if id(p) in ignored_ids}
        fully_shard(block, mesh=mesh, mp_policy=mp, ignored_params=mine or None)
    fully_shard(model, mesh=mesh, mp_policy=mp, ignored_params=set(ignored) or None)
