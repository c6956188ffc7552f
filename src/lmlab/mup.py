"""The maximal-update parametrization (μP): widths that train alike at one learning rate.

Yang et al. 2021, "Tensor Programs V" (arXiv:2203.03466), Table 3 for Adam, with the ``mup``
package's MuReadout for the output. Each parameter is compared with the same parameter of the
base model (``ModelConfig.mup``'s shape, built on the meta device), as ``mup.set_base_shapes``
does; a dimension that differs is one that grows with width, and r = base fan-in / fan-in:

    role     which parameters                                   init std     Adam lr
    hidden   both dimensions grow: attention, feed-forward,     x sqrt(r)    x r
             experts, MTP projections
    output   fan-in grows, fan-out fixed: routers, per-head     x r          x r
             or shared-expert gates (Table 3's output row)
    input    the rest: embeddings, position tables, norms,      x 1          x 1
             biases, sinks, anything of fixed size
    head     the LM head: its logits are multiplied by base_d_model / d_model (MuReadout) instead

The attention scores' 1/head_dim is ``ModelConfig.attention_scale``. At the base shape every r
is 1 and the readout multiplier 1, so a μP model there is the standard model, weight for weight.
The learning-rate multipliers reach the optimizer through ``run.optim.build_optimizer``; the
forward never sees them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch
from torch import nn

from .config import ModelConfig

Role = Literal["hidden", "output", "input", "head"]


@dataclasses.dataclass(frozen=True)
class Scaling:
    """How μP treats one parameter: its role and r = base fan-in / fan-in (1 for input and head)."""

    role: Role
    ratio: float = 1.0

    @property
    def init(self) -> float:
        """The factor on the standard init's std."""
        return {"hidden": self.ratio**0.5, "output": self.ratio}.get(self.role, 1.0)

    @property
    def lr(self) -> float:
        """The factor on the learning rate (Adam)."""
        return self.ratio if self.role in ("hidden", "output") else 1.0


def base_config(cfg: ModelConfig) -> ModelConfig:
    """The base model's config: ``cfg`` with every width scaled by base_d_model / d_model, heads of
    base_head_dim, and standard parametrization. Widths left to follow d_model follow it; those set
    explicitly (d_ff, moe.d_expert, moe.shared_d_ff) are scaled, as are the head counts when
    head_dim is held fixed."""
    base = cfg.mup
    r = base.base_d_model / cfg.d_model
    q_width = cfg.n_heads * cfg.head_dim * r
    n_heads = q_width / base.base_head_dim
    n_kv = cfg.n_kv_heads * n_heads / cfg.n_heads
    if not (n_heads.is_integer() and n_kv.is_integer() and n_kv >= 1):
        raise ValueError(
            f"mup.base_head_dim={base.base_head_dim} with base_d_model={base.base_d_model} gives the base "
            f"{n_heads:g} query heads and {n_kv:g} key/value heads for this model's {cfg.n_heads} and "
            f"{cfg.n_kv_heads}; choose a base whose head counts are whole numbers"
        )
    editable = cfg._editable_dict()
    changes: dict[str, Any] = {"d_model": base.base_d_model, "head_dim": base.base_head_dim,
                               "n_heads": int(n_heads), "n_kv_heads": int(n_kv),
                               "parametrization": "standard", "mup": None}
    if editable["d_ff"] is not None:  # set explicitly: it does not follow d_model by itself
        changes["d_ff"] = round(cfg.d_ff * r)
    for name in ("d_expert", "shared_d_ff"):
        if cfg.moe is not None and getattr(cfg.moe, name) is not None:
            changes[f"moe.{name}"] = round(getattr(cfg.moe, name) * r)
    try:
        return cfg.override(changes)
    except ValueError as e:
        raise ValueError(f"μP's base model (mup.base_d_model={base.base_d_model}) is not a valid model: {e}") from e


def role_of(name: str, shape: torch.Size, base_shape: torch.Size, embeddings: set[str]) -> Scaling:
    """The μP treatment of parameter ``name`` of ``shape`` whose base model's twin has ``base_shape``.
    Matrices are in nn.Linear's (..., out, in) layout (experts stack them), so fan-in is the last dimension."""
    if name == "head.weight":
        return Scaling("head")
    grown = [i for i, (n, b) in enumerate(zip(shape, base_shape)) if n != b]
    if name in embeddings or len(shape) < 2 or not grown:
        return Scaling("input")
    ratio = base_shape[-1] / shape[-1]
    if len(grown) >= 2:
        return Scaling("hidden", ratio)
    return Scaling("output", ratio) if grown == [len(shape) - 1] else Scaling("input")


def scalings(model: nn.Module) -> dict[str, Scaling]:
    """Each parameter's :class:`Scaling`, by name, for a ``Transformer`` under ``parametrization="mup"``."""
    cfg = model.config
    with torch.device("meta"):
        base = type(model)(base_config(cfg))
    base_shapes = {n: p.shape for n, p in base.named_parameters()}
    embeddings = {n for n, p in model.named_parameters() if any(p is e for e in model.embedding_parameters())}
    return {n: role_of(n, p.shape, base_shapes[n], embeddings) for n, p in model.named_parameters()}


@torch.no_grad()
def rescale_init(model: nn.Module) -> None:
    """Turn a standard init into μP's: each drawn weight times its role's factor (the same draws, so the
    weights stay a pure function of the config and ``init_seed``)."""
    params = dict(model.named_parameters())
    for name, scaling in scalings(model).items():
        if scaling.init != 1.0 and not params[name].is_meta:
            params[name].mul_(scaling.init)


def lr_multipliers(model: nn.Module) -> dict[str, float]:
    """{parameter name: learning-rate factor} for the parameters μP does not leave at 1 (empty under
    standard parametrization). A model with a ``body`` (a classifier) is read through it; its own head
    keeps the given rate."""
    body, prefix = (model.body, "body.") if hasattr(model, "body") else (model, "")
    if getattr(body, "config", None) is None or body.config.parametrization != "mup":
        return {}
    return {prefix + n: s.lr for n, s in scalings(body).items() if s.lr != 1.0}


class Multiplier(nn.Module):
    """x -> x * factor, a fixed factor (no parameter): μP's readout multiplier on the head's input."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor

    def extra_repr(self) -> str:
        return f"factor={self.factor:g}"


def build_readout(cfg: ModelConfig) -> nn.Module:
    """What the head's input passes through: nothing under standard; times base_d_model / d_model under μP."""
    if cfg.parametrization == "mup" and cfg.mup.base_d_model != cfg.d_model:
        return Multiplier(cfg.mup.base_d_model / cfg.d_model)
    return nn.Identity()
