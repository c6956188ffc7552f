"""The optimizer and the schedule: AdamW with decay on matrices only, warmup then cosine decay.

On resume the optimizer's state (moments, step counts) comes from the checkpoint, through its own
``load_state_dict``; its hyper-parameters come from the run's config. The config may have changed
since the checkpoint (a lower weight decay for the rest of a run, say): the config wins, explicitly
(:func:`apply_hyperparameters`), and each value that differed is named in a note. Refusing the
mismatch instead would make a deliberate change impossible without editing checkpoints."""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from ..mup import lr_multipliers
from ..torch_private import foreach_mul_, foreach_norm
from .config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: weight matrices decay; norms, biases, token and position embeddings do not.

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
        if p.requires_grad:
            decays = p.ndim >= 2 and id(p) not in embeddings
            groups.setdefault((decays, scales.get(name, 1.0)), {})[name] = p
    return [{"params": list(params.values()), "names": list(params),
             "weight_decay": weight_decay / scale if decays else 0.0, **({"lr_scale": scale} if scale != 1.0 else {})}
            for (decays, scale), params in groups.items()]


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    # the fused kernel (CUDA, and CPU since torch 2.4) is one pass over each tensor: ~6x faster
    # than the foreach path on CPU for a few-million-parameter model
    return torch.optim.AdamW(
        split_by_layout(param_groups(model, cfg.weight_decay)), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
        fused=True if device.type in ("cpu", "cuda") else None,
    )


# the config's (μP's lr_scale is the model config's); lr is set from the schedule at every step
HYPERPARAMETERS = ("betas", "eps", "weight_decay", "lr_scale")


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
    """Set every group's rate to ``lr``, times the group's ``lr_scale`` where μP gave it one (:func:`param_groups`)."""
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
