"""The optimizer and the schedule: AdamW with decay on matrices only, or Muon for the hidden matrices
with AdamW for the rest (``optim.name``); warmup then cosine decay, one schedule for both.

On resume the optimizer's state (moments, step counts, Muon's momentum) comes from the checkpoint,
through its own ``load_state_dict``; its hyper-parameters come from the run's config. The config may
have changed since the checkpoint (a lower weight decay for the rest of a run, say): the config wins,
explicitly (:func:`apply_hyperparameters`), and each value that differed is named in a note. Refusing
the mismatch instead would make a deliberate change impossible without editing checkpoints.

Muon (``optim.name=muon``; Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/) is
momentum SGD whose update of a weight matrix is orthogonalized by a few Newton-Schulz iterations:
every direction of the step gets about the same size, whatever the gradient's spectrum. It is made
for the matrices that map hidden features to hidden features (:func:`optimizer_of`): modded-nanogpt
keeps the embeddings, the output head and every vector on Adam, and the Muon setups built on
torchtitan (facebookresearch/MuLoCo's, say) keep the MoE routers on AdamW too. lmlab uses
``torch.optim.Muon`` (:class:`MatrixMuon` adds the stacked experts of a MoE layer, one matrix at a
time) and AdamW with the ``optim`` fields for the rest, held together as one optimizer
(:class:`Optimizers`), so that checkpoints, DCP and the schedule see one.

Muon under μP (``model.parametrization=mup``): μP's per-parameter rates (``lmlab.mup``) are Adam's
rule. Muon's update of an out x in matrix has spectral norm lr * sqrt(max(1, out/in)) (its "original"
shape scaling), the same at every width for a matrix whose two sides grow together, which is the
spectral condition for feature learning (Yang, Simon & Bernstein 2023, arXiv:2310.17813; Bernstein &
Newhouse 2024, arXiv:2409.20325): so its matrices take no μP factor, and AdamW's parameters keep
theirs. Moonlight's ``match_rms_adamw`` scaling (0.2 sqrt(max(out, in))) grows with width and is
refused with μP (run/config.py)."""

from __future__ import annotations

import math
from typing import Any, Iterable, Literal, Sequence

import torch
from torch import nn

from ..config import ModelConfig
from ..mup import lr_multipliers
from ..torch_private import foreach_mul_, foreach_norm
from .config import OptimConfig

# ============================================================== which parameter goes where
# Matrices that read a few numbers out of the hidden state rather than transform it (μP's "output"
# role, lmlab.mup): an MoE router's scores, attention's output gates, a gated shared expert's gate,
# hyper-connections' mixing weights. Muon would give every direction of their update the same size
# whatever the gradient says (the top-k choice of a router moves on small differences of its scores);
# they stay on AdamW, as the output head does. Matched by the end of the parameter's name.
READOUTS = ("router.weight", "gate.proj.weight", "output_gate",
            "alpha_fn", "beta_fn", "attn_residual.fn", "ffn_residual.fn", "streams.fn")
HEADS = ("head.weight", "score.weight")  # the LM head (untied) and a classifier's

Choice = Literal["muon", "adamw"]


def optimizer_of(name: str, p: torch.Tensor, embedding: bool) -> Choice:
    """Which optimizer ``optim.name=muon`` gives parameter ``name``: Muon for a hidden matrix, 2-D
    (nn.Linear's (out, in)) or a stack of them (a MoE layer's experts, (E, out, in), one matrix per
    expert); AdamW for the rest: vectors (norm gains, biases, sinks), a token or position embedding
    (``embedding``: the model's ``embedding_parameters``), the output head, a readout (READOUTS), and
    a stack of biases (an expert bias, (E, out), is a vector per expert)."""
    parts = name.split(".")
    named = any(parts[-len(t.split(".")):] == t.split(".") for t in HEADS + READOUTS)
    if p.ndim not in (2, 3) or embedding or named or name.endswith("bias"):
        return "adamw"
    return "muon"


def optimizer_split(model: nn.Module) -> dict[str, Choice]:
    """{parameter name: "muon" or "adamw"} for every trainable parameter of ``model`` (tied ones once)."""
    embeddings = {id(p) for p in model.embedding_parameters()}
    return {name: optimizer_of(name, p, id(p) in embeddings) for name, p in model.named_parameters()
            if p.requires_grad}


def muon_parameter_count(cfg: ModelConfig) -> int:
    """The parameters of ``Transformer(cfg)`` that optim.name=muon steps with Muon (:func:`optimizer_split`),
    counted on a model built on the meta device: what the memory check counts one momentum for, not two."""
    from ..memory import meta_model

    model = meta_model(cfg)
    params = dict(model.named_parameters())
    return sum(params[name].numel() for name, choice in optimizer_split(model).items() if choice == "muon")


def param_groups(model: nn.Module, weight_decay: float, skip: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """AdamW groups: weight matrices decay; norms, biases, token and position embeddings do not.
    Parameters named in ``skip`` (Muon's) are left out.

    Decaying a gain or bias pulls it to 0, which is not a simpler function; decaying an embedding
    shrinks rare tokens' vectors just for being rare. A tied output head is the embedding. What
    counts as an embedding is the model's answer (``embedding_parameters``), the same one its
    parameter accounting uses.

    Under μP (``lmlab.mup``) parameters whose learning rate is scaled form groups of their own, each
    with its factor as ``lr_scale``; the trainer sets each group's rate to the schedule's times it.
    Their weight decay is divided by the same factor, so that AdamW's decoupled shrink lr * wd is the
    same at every width (as ``mup.MuAdamW``). Under standard parametrization there are the two groups
    and no ``lr_scale``."""
    embeddings = {id(p) for p in model.embedding_parameters()}
    scales = lr_multipliers(model)
    groups: dict[tuple[bool, float], dict[str, nn.Parameter]] = {(True, 1.0): {}, (False, 1.0): {}}
    for name, p in model.named_parameters():  # tied parameters appear once
        if p.requires_grad and name not in skip:
            decays = p.ndim >= 2 and id(p) not in embeddings
            groups.setdefault((decays, scales.get(name, 1.0)), {})[name] = p
    return [{"params": list(params.values()), "names": list(params),
             "weight_decay": weight_decay / scale if decays else 0.0, **({"lr_scale": scale} if scale != 1.0 else {})}
            for (decays, scale), params in groups.items()]


def muon_groups(model: nn.Module, cfg: OptimConfig) -> list[dict[str, Any]]:
    """Muon's groups: the 2-D matrices, then the stacks (3-D), each group's ``lr_scale`` optim.muon.lr
    / optim.lr, so that the one schedule (:func:`learning_rate`, scaled by :func:`set_learning_rate`)
    drives Muon's rate in proportion to AdamW's. No μP factor: see the module's docstring."""
    params = dict(model.named_parameters())
    taken = [name for name, choice in optimizer_split(model).items() if choice == "muon"]
    m = cfg.muon
    groups = []
    for ndim in (2, 3):
        names = [n for n in taken if params[n].ndim == ndim]
        if names:
            groups.append({"params": [params[n] for n in names], "names": names, "lr_scale": m.lr / cfg.lr,
                           "weight_decay": m.weight_decay})
    return groups


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """``cfg.name``'s optimizer over ``model``: AdamW (:func:`param_groups`), or Muon over the hidden
    matrices (:func:`muon_groups`) and AdamW over the rest, as one :class:`Optimizers`."""
    def adamw(skip: frozenset[str] = frozenset()) -> torch.optim.AdamW:
        # the fused kernel (CUDA, and CPU since torch 2.4) is one pass over each tensor: ~6x faster
        # than the foreach path on CPU for a few-million-parameter model
        return torch.optim.AdamW(
            split_by_layout(param_groups(model, cfg.weight_decay, skip)), lr=cfg.lr, betas=tuple(cfg.betas),
            eps=cfg.eps, fused=True if device.type in ("cpu", "cuda") else None,
        )

    if cfg.name == "adamw":
        return adamw()
    matrices, m = muon_groups(model, cfg), cfg.muon
    muon = MatrixMuon(matrices, lr=m.lr, weight_decay=m.weight_decay, momentum=m.momentum, nesterov=m.nesterov,
                      ns_steps=m.ns_steps, adjust_lr_fn=m.adjust_lr)
    return Optimizers(muon, adamw(frozenset(n for g in matrices for n in g["names"])))


class MatrixMuon(torch.optim.Muon):
    """``torch.optim.Muon``, also over stacks of matrices: a (E, out, in) parameter, a MoE layer's
    experts, is E matrices, each orthogonalized on its own, as Moonlight trains DeepSeek-V3's experts
    (Liu et al. 2025, arXiv:2502.16982); one (E*out, in) matrix would couple experts that see
    different tokens. torch's Muon takes 2-D parameters only: the stacks' groups join after its check,
    and each step hands torch's step the E matrices of each stack (views of the parameter, its
    gradient and its momentum buffer, which stays one tensor of the parameter's shape, as checkpoints
    expect). A stack that FSDP shards over the expert dimension is stepped on this process's experts,
    each of them whole, with no communication; a 2-D DTensor goes to torch's step as it is (its
    Newton-Schulz products are DTensor ops, which gather what they need)."""

    def __init__(self, groups: list[dict[str, Any]], **settings: Any):
        super().__init__([g for g in groups if all(p.ndim == 2 for p in g["params"])], **settings)
        for group in groups:
            if any(p.ndim != 2 for p in group["params"]):
                self.add_param_group(group)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        groups, views = self.param_groups, []
        self.param_groups = [self.as_matrices(g, views) for g in groups]
        try:
            return super().step(closure)
        finally:
            self.param_groups = groups
            for v in views:
                del self.state[v]

    def as_matrices(self, group: dict[str, Any], views: list[torch.Tensor]) -> dict[str, Any]:
        """``group`` with each stack (with a gradient) replaced by its matrices, appended to ``views``:
        each carries its slice of the gradient and, as its state, its slice of the momentum buffer."""
        if all(p.ndim == 2 for p in group["params"]):
            return group
        params = []
        for p in group["params"]:
            if p.ndim == 2 or p.grad is None:
                params.append(p)
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            # this process's experts: a DTensor's local shard (FSDP splits the expert dimension)
            whole = (p.detach(), p.grad, state["momentum_buffer"])
            local = [t.to_local() if hasattr(t, "to_local") else t for t in whole]
            for w, g, buf in zip(*(t.unbind(0) for t in local)):
                w.grad = g
                self.state[w] = {"momentum_buffer": buf}
                views.append(w)
                params.append(w)
        return {**group, "params": params}


class Optimizers(torch.optim.Optimizer):
    """Optimizers over disjoint parameters, as one: their groups, in order, are its ``param_groups``
    (the same dicts, so the schedule and a resumed config reach every group), and one state dict
    holds all their state, so its ``state_dict`` is torch's format over both and loads back into
    both, for the local checkpoints and for DCP alike. (torchtitan's OptimizersContainer keeps a
    list instead, which every caller then loops over.)"""

    def __init__(self, *optimizers: torch.optim.Optimizer):
        self.optimizers = optimizers
        super().__init__([g for o in optimizers for g in o.param_groups], {})
        self.share()

    def share(self) -> None:
        """Point each optimizer at its part of this one's groups, and at this one's state."""
        start = 0
        for o in self.optimizers:
            n = len(o.param_groups)
            o.param_groups, o.state = self.param_groups[start:start + n], self.state
            start += n

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.optimizers:
            o.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # new group dicts and a new state: the optimizers follow
        self.share()


# the config's (μP's lr_scale is the model config's; Muon's momentum, nesterov, Newton-Schulz steps and
# shape scaling are optim.muon's); lr is set from the schedule at every step
HYPERPARAMETERS = ("betas", "eps", "weight_decay", "lr_scale", "momentum", "nesterov", "ns_steps", "adjust_lr_fn")


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's config-given hyper-parameters, as :func:`build_optimizer` set them."""
    return [{k: group[k] for k in HYPERPARAMETERS if k in group} for group in optimizer.param_groups]


def apply_hyperparameters(optimizer: torch.optim.Optimizer, values: Sequence[dict[str, Any]]) -> list[str]:
    """Set each group's hyper-parameters to ``values`` (:func:`hyperparameters` of the optimizer as
    built from the config, taken before a saved state was loaded into it: loading replaces them with
    the saved ones). Returns one line per field whose saved value differed, naming both values."""
    def plain(v: Any) -> Any:  # a state dict may hold betas as a list
        return tuple(v) if isinstance(v, (list, tuple)) else v

    notes = []
    for group, config in zip(optimizer.param_groups, values, strict=True):
        for key, value in config.items():
            saved = group.get(key)
            if plain(saved) != plain(value):
                line = f"optimizer {key} is {plain(saved)!r} in the checkpoint; using the config's {plain(value)!r}"
                notes += [line] if line not in notes else []
            group[key] = value
    return notes


def split_by_layout(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Groups that mix FSDP's sharded parameters (DTensors) with plain ones (expert-parallel
    shards), split in two: the fused kernel steps a group at once and takes one kind or the other."""
    out = []
    for group in groups:
        kinds: dict[bool, dict[str, Any]] = {}
        for name, p in zip(group["names"], group["params"]):
            part = kinds.setdefault(hasattr(p, "to_local"), {**group, "params": [], "names": []})
            part["params"].append(p)
            part["names"].append(name)
        out += list(kinds.values()) or [group]
    return out


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's rate to ``lr``, times the group's ``lr_scale`` where μP gave it one
    (:func:`param_groups`), or Muon's ratio optim.muon.lr / optim.lr (:func:`muon_groups`)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def learning_rate(step: int, cfg: OptimConfig, steps: int) -> float:
    """lr for 0-based ``step`` of a run of ``steps``: linear warmup to ``lr`` over ``warmup_steps``
    (reaching it at step warmup_steps - 1), then cosine decay reaching ``min_lr`` at the last step, steps - 1."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = steps - 1 - cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps) if decay_steps > 0 else 1.0
    min_lr = cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def schedule_warning(cfg: OptimConfig, steps: int) -> str | None:
    """A warning when the schedule never leaves its warmup (warmup_steps >= steps), else None."""
    if cfg.warmup_steps < steps:
        return None
    return (f"warning: optim.warmup_steps={cfg.warmup_steps} >= train.steps={steps}: "
            "the learning rate never leaves its warmup and never decays")


def clip_gradients(parameters: Iterable[torch.Tensor], max_norm: float) -> float:
    """Scale gradients to global L2 norm <= ``max_norm`` (0 = leave them); return the norm before
    clipping, which is non-finite when any gradient is. Plain tensors on one device in one dtype take
    ``clip_grad_norm_``'s foreach ops directly, without its per-call grouping of tensors (about half
    a millisecond a step on a 2-core CPU); the numbers are the same. Anything else (DTensors, mixed
    devices or dtypes) goes through ``clip_grad_norm_`` itself."""
    params = list(parameters)
    max_norm = max_norm if max_norm > 0 else float("inf")
    grads = [p.grad for p in params if p.grad is not None]
    plain = all(type(g) is torch.Tensor for g in grads) and len({(g.device, g.dtype) for g in grads}) == 1
    if not plain:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    norm = torch.linalg.vector_norm(torch.stack(foreach_norm(grads)))  # as clip_grad_norm_ computes it
    foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return float(norm)
