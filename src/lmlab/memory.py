"""How much memory a model needs, estimated from its config before anything is allocated, and how
much the device has: an absurd size is refused in one line instead of dying in the allocator.

    need = training_memory(cfg, batch_size=16, seq_len=128)       # MemoryEstimate, bytes by part
    check_fits(need, cfg, torch.device("cpu"), what="training")   # ValueError naming the sizes if not

Parameters are counted twice over, cheaply first. :func:`parameter_floor` is arithmetic on the
config (the embedding and each layer's query and output projections: fewer than the model has),
so a config whose floor already does not fit is refused without building anything; a model that
large cannot even be described on PyTorch's ``meta`` device (its storage size overflows int64).
Otherwise :func:`parameter_count` builds the model on ``meta`` (shapes only: no storage and no
initialization) and counts exactly, with the model's own code.

Training holds, per parameter, fp32 weights, gradients and AdamW's two moments (16 bytes), plus
the activations kept for the backward pass (:func:`activation_bytes`: a deliberately low count,
so a refusal is never a false alarm; fused attention is assumed, no T x T scores).

Memory that grows with a length rather than with the parameters is counted too, or an absurd
length would get past the check and die in the allocator: rotary's cos/sin tables, built for at
least ``max_seq_len`` positions (:func:`rotary_table_bytes`), the KV cache of generated samples
(:func:`kv_cache_bytes`), and evaluation's logits and per-position sums.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from .attention_variants import variant_of
from .config import ModelConfig

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    parameters: int  # number of parameters (exact, or the floor)
    weights: int  # bytes, fp32
    gradients: int = 0
    optimizer: int = 0  # AdamW: two fp32 moments per parameter; Muon: one momentum per parameter it steps
    optimizer_name: str = "AdamW"
    activations: int = 0  # kept for the backward pass of one micro-batch (evaluation: one batch's logits)
    tables: int = 0  # rotary cos/sin tables, one row per position
    cache: int = 0  # the KV cache of a generated sample

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.tables + self.cache

    def describe(self) -> str:
        parts = [f"weights {gib(self.weights)}"]
        parts += [f"gradients {gib(self.gradients)}"] if self.gradients else []
        parts += [f"{self.optimizer_name} state {gib(self.optimizer)}"] if self.optimizer else []
        parts += [f"activations {gib(self.activations)}"] if self.activations else []
        parts += [f"rotary tables {gib(self.tables)}"] if self.tables else []
        parts += [f"KV cache {gib(self.cache)}"] if self.cache else []
        return f"{self.parameters:,} parameters: {', '.join(parts)}"


def gib(n: float) -> str:
    """A byte count in binary units: "1.5 GiB", "64.0 MiB", "4.0 EiB"."""
    units = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB"]
    k = 0
    while k + 1 < len(units) and n >= 2 ** (10 * (k + 2)):
        k += 1
    return f"{n / 2 ** (10 * (k + 1)):,.1f} {units[k]}"


# ============================================================== counting
def parameter_floor(cfg: ModelConfig) -> int:
    """Fewer parameters than ``cfg``'s model has, by arithmetic alone: the token embedding and every
    layer's attention floor (its variant's ``parameter_floor``: the query and output projections, or MLA's
    output and latent up-projections)."""
    return cfg.vocab_size * cfg.d_model + cfg.n_layers * variant_of(cfg).parameter_floor(cfg)


def meta_model(cfg: ModelConfig):
    """``Transformer(cfg)`` built on the meta device: its parameters' names and shapes, no values."""
    from .model import Transformer

    with torch.device("meta"), SkipRandomInit():
        return Transformer(cfg)


def parameter_count(cfg: ModelConfig) -> int:
    """Every parameter of ``Transformer(cfg)``, counted on a model built on the meta device."""
    return meta_model(cfg).num_params()["total"]


class SkipRandomInit(TorchFunctionMode):
    """Leave ``normal_`` (``Tensor.normal_``, ``nn.init.normal_``) undone on meta tensors: there are no
    values to fill, and there it runs through torch._refs, whose first call imports torch._dynamo
    (2-10 s on a 2-core CPU)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = args[0] if args else kwargs.get("tensor")
        if getattr(func, "__name__", None) == "normal_" and isinstance(tensor, torch.Tensor) and tensor.is_meta:
            return tensor
        return func(*args, **kwargs)


def activation_bytes(cfg: ModelConfig, batch_size: int, seq_len: int, bytes_per_value: int = 4) -> int:
    """A low estimate of the activations one micro-batch keeps for backward: per token and layer
    the residual stream, norms, q, k, v and attention output (about 8 d_model values) and the
    feed-forward's hidden units (2 or 3 per unit, by ``ffn``), plus the logits and their softmax.
    Hyper-connections' n streams (``cfg.n_streams``) add the n - 1 more vectors each of a layer's two
    connections keeps (its input streams, which its mix's backward reads)."""
    hidden = cfg.d_ff
    if cfg.moe is not None:
        d_expert = cfg.moe.d_expert or cfg.d_ff
        hidden = max(hidden, (cfg.moe.top_k + cfg.moe.n_shared) * d_expert)
    per_layer = 8 * cfg.d_model + (3 if cfg.ffn == "glu" else 2) * hidden + 2 * (cfg.n_streams - 1) * cfg.d_model
    tokens = batch_size * seq_len
    return tokens * (cfg.n_layers * per_layer + 2 * cfg.vocab_size) * bytes_per_value


def rotary_table_bytes(cfg: ModelConfig, positions: int) -> int:
    """Rotary's fp32 [cos, sin, sin_half] rows (3 x head_dim values each) for ``positions``
    positions, or ``max_seq_len`` if more: the first forward builds at least that many
    (``positions.Rotary.table``). Dynamic NTK computes its angles per forward and keeps no table;
    the other schemes' tables are parameters, counted as such."""
    if cfg.positions != "rope" or cfg.rope.scaling == "dynamic":
        return 0
    return max(positions, cfg.max_seq_len) * 3 * cfg.rotary_dim * 4


def kv_cache_bytes(cfg: ModelConfig, batch_size: int, length: int, bytes_per_value: int = 4) -> int:
    """Keys and values of every layer for ``batch_size`` rows of ``length`` tokens (``attention.KVCache``), as
    the attention variant lays them out (``cache_values_for``): under MLA the compressed latent and the shared rotary
    key instead; under DeepSeek-V4's compressed attention a window of keys and one entry per m tokens."""
    return batch_size * variant_of(cfg).cache_values_for(cfg, length) * bytes_per_value


def kv_cache_bytes_per_token(cfg: ModelConfig, length: int, bytes_per_value: int = 2) -> float:
    """The cache of one row of ``length`` tokens per token: for a cache that grows with every token its bytes per
    token at any length; for one that holds a fixed window and one entry per m tokens (compressed attention),
    the window's share falls with the length."""
    return kv_cache_bytes(cfg, 1, length, bytes_per_value) / length


def training_memory(cfg: ModelConfig, *, batch_size: int, seq_len: int, parameters: int | None = None,
                    bytes_per_activation: int = 4, sample_tokens: int = 0, muon_parameters: int = 0) -> MemoryEstimate:
    """What training ``cfg`` in fp32 needs (``parameters``: a count already made), and writing a sample of
    ``sample_tokens`` tokens with the training state still held (log.sample_tokens). The optimizer is AdamW,
    two moments per parameter, except for the ``muon_parameters`` that Muon steps (optim.name=muon: the
    hidden matrices, ``run.optim.muon_parameter_count``), which keep one momentum each. Counted against a
    parameter floor, at most the floor of them are Muon's, so the estimate stays a lower bound."""
    n = parameter_count(cfg) if parameters is None else parameters
    muon = min(muon_parameters, n)
    return MemoryEstimate(n, weights=4 * n, gradients=4 * n, optimizer=8 * n - 4 * muon,
                          optimizer_name="AdamW + Muon" if muon else "AdamW",
                          activations=activation_bytes(cfg, batch_size, seq_len, bytes_per_activation),
                          tables=rotary_table_bytes(cfg, max(seq_len, sample_tokens)),
                          cache=kv_cache_bytes(cfg, 1, sample_tokens, bytes_per_activation))


def loading_memory(cfg: ModelConfig, *, parameters: int | None = None) -> MemoryEstimate:
    """What holding ``cfg``'s model in fp32 and running it needs (generation, conversion): the
    weights and the rotary tables its first forward builds."""
    n = parameter_count(cfg) if parameters is None else parameters
    return MemoryEstimate(n, weights=4 * n, tables=rotary_table_bytes(cfg, cfg.max_seq_len))


def evaluation_memory(cfg: ModelConfig, *, batch_size: int, seq_len: int,
                      parameters: int | None = None) -> MemoryEstimate:
    """What evaluating ``batch_size`` windows of ``seq_len`` tokens needs (``run.evaluate``): the
    weights, rotary tables for ``seq_len`` positions, and per batch the fp32 logits and token ids,
    plus an fp64 loss sum per position."""
    n = parameter_count(cfg) if parameters is None else parameters
    tokens = batch_size * seq_len
    return MemoryEstimate(n, weights=4 * n, tables=rotary_table_bytes(cfg, seq_len),
                          activations=tokens * (4 * cfg.vocab_size + 2 * 8) + 8 * seq_len)


def check_generation_fits(cfg: ModelConfig, batch_size: int, length: int, device: torch.device,
                          bytes_per_value: int) -> None:
    """Refuse, before the cache is allocated, a generation whose KV cache and rotary tables for
    ``length`` positions (prompt + new tokens) exceed the device's memory (the weights are already held)."""
    limit, where = device_memory(device)
    cache, tables = kv_cache_bytes(cfg, batch_size, length, bytes_per_value), rotary_table_bytes(cfg, length)
    if limit is not None and cache + tables > limit:
        raise ValueError(f"generating up to {length:,} positions for {batch_size} prompt(s) needs at least "
                         f"{gib(cache + tables)} (KV cache {gib(cache)}, rotary tables {gib(tables)}), more than "
                         f"{where}; ask for fewer new tokens")


# ============================================================== the device
def device_memory(device: torch.device) -> tuple[int | None, str]:
    """(bytes, description) of ``device``'s memory: a GPU's total, or for the CPU (and MPS, whose
    memory is the system's) the physical RAM or the container's memory limit, whichever is lower.
    (None, ...) where it cannot be told."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return total, f"the {gib(total)} of {device} ({torch.cuda.get_device_name(device)})"
    if device.type not in ("cpu", "mps"):
        return None, str(device)
    ram = system_memory()
    return ram, (f"the {gib(ram)} of memory of this machine" if ram else "this machine's memory")


def system_memory() -> int | None:
    """Physical RAM, or a lower cgroup (container) limit; None where neither can be read."""
    sizes = []
    try:
        sizes.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            sizes.append(int(text))
    return min(sizes) if sizes else None


# ============================================================== the check
def check_fits(
    estimate: Callable[[int], MemoryEstimate], cfg: ModelConfig, device: torch.device, *, what: str,
    limit_bytes: int | None = None, fix: str = "make the model smaller",
) -> MemoryEstimate | None:
    """Raise a one-line ValueError if ``estimate(parameters)`` exceeds ``limit_bytes`` (default: the
    device's memory). The parameter floor is tried first, the exact count only when the floor fits.
    Returns the exact estimate, or None when there is no limit to check against."""
    if limit_bytes is not None:
        limit, where = limit_bytes, f"the limit of {gib(limit_bytes)}"
    else:
        limit, where = device_memory(device)
    if limit is None:
        return None
    need = None
    for count, about in ((parameter_floor, "at least"), (parameter_count, "about")):
        need = estimate(count(cfg))
        if need.total > limit:
            raise ValueError(
                f"{what} needs {about} {gib(need.total)} ({need.describe()}), more than {where}; {fix}"
            )
    return need


def max_memory_bytes(gib_limit: float | None) -> int | None:
    """``train.max_memory_gib`` in bytes (None stays None)."""
    return None if gib_limit is None else int(math.floor(gib_limit * GIB))
