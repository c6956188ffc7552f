"""Every private torch API lmlab uses, in one place: what it is, what lmlab uses it for, and the
public alternative where there is one.

A name that starts with ``_`` is private to torch and may change or vanish in any release without
notice. So call sites reach each one through a function or constant here, never by its private name,
and ``tests/test_torch_private.py`` checks that each still exists and takes what lmlab passes it, on
whatever torch is installed. :data:`CHECKED_WITH` lists the torch releases that test passed on; after
a torch upgrade, run it and add the new release.

Not listed: torch's public APIs in private-looking places (``torch.ops.aten.gelu_backward`` and the
other ATen backward ops in ``feedforward.py`` are operators of torch's native schema, not underscore
names), and names used only by the tests and benchmarks (``torch._dynamo.reset``, ...).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable

import torch

CHECKED_WITH = ("2.13.0",)  # torch releases tests/test_torch_private.py passed on, oldest first


@dataclasses.dataclass(frozen=True)
class PrivateAPI:
    """One private torch name lmlab depends on."""

    name: str  # where torch defines it: the module's dotted path, then the attribute(s)
    use: str  # what lmlab uses it for, and where
    public: str  # the public alternative, or why lmlab does not use one
    parameters: tuple[str, ...] = ()  # the parameters lmlab passes, by name, for a Python function


PRIVATE_APIS = (
    PrivateAPI(
        "torch._grouped_mm",
        "grouped_mm.py: one matmul per expert over rows sorted by expert, in one kernel (MoE forward and backward), "
        "where torch.nn.functional has no grouped_mm",
        "torch.nn.functional.grouped_mm, used first where torch has it (torch 2.13 does); the private one "
        "serves older releases without it",
    ),
    PrivateAPI(
        "torch._foreach_norm",
        "run/optim.py clip_gradients: the L2 norm of every gradient in one call, as clip_grad_norm_ computes it "
        "(run/optim.py still calls torch._foreach_norm by name: to convert to foreach_norm here)",
        "torch.nn.utils.get_total_norm (torch >= 2.6), which groups tensors by device and dtype on every call: "
        "the half millisecond a step on a 2-core CPU that clip_gradients saves",
    ),
    PrivateAPI(
        "torch._foreach_mul_",
        "run/optim.py clip_gradients: scale every gradient by the clipping factor in one call "
        "(run/optim.py still calls torch._foreach_mul_ by name: to convert to foreach_mul_ here)",
        "torch.nn.utils.clip_grads_with_norm_ (torch >= 2.6), with the same per-call grouping",
    ),
    PrivateAPI(
        "torch.distributed._functional_collectives.all_to_all_single_autograd",
        "run/parallel/plan.py all_to_all: expert parallelism sends each token row to the process holding its "
        "expert and the outputs back, differentiably",
        "torch.distributed.nn.functional.all_to_all_single, deprecated in favour of this one",
        ("self", "output_split_sizes", "input_split_sizes", "group"),
    ),
    PrivateAPI(
        "torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model",
        "run/parallel/plan.py Parallel.wrap: DDP leaves expert-parallel parameters alone (their gradients are "
        "summed over replicas by sync_gradients, not averaged by DDP)",
        "none: DDP's constructor takes no list of parameters to ignore",
        ("module", "params_and_buffers_to_ignore"),
    ),
    PrivateAPI(
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "run/checkpoint/dcp_index.py: the class DCP's index pickles for where each item is stored; the safe "
        "reader builds and checks it",
        "none: DCP's index format names it",
    ),
    PrivateAPI(
        "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
        "run/checkpoint/dcp_index.py: the memory-format enum in a pickled TensorProperties' state",
        "none: DCP's index format names it",
    ),
    PrivateAPI(
        "torch.serialization._get_layout",
        "run/checkpoint/dcp_index.py: the function DCP's pickled index calls to rebuild a torch layout; lmlab never "
        "calls it (dcp_index.layout_named stands in) but must know its name (PICKLED_LAYOUT)",
        "none: the pickle format names it",
        ("name",),
    ),
    PrivateAPI(
        "torch._dynamo",
        "run/parallel/compile.py eager: whether the compiler was ever loaded (if not, nothing is compiled and "
        "setting a stance would only cost its import, seconds)",
        "none that answers without loading it: torch.compiler.set_stance imports it",
    ),
)


def resolve(name: str) -> Any:
    """The object at dotted ``name``: the longest importable module prefix, then attributes."""
    import importlib

    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module in {name!r}")


# ============================================================== kernels
def grouped_mm_kernel() -> Callable[..., torch.Tensor] | None:
    """torch's grouped matmul, ``(mat_a, mat_b, *, offs)``: the public one where torch has it, else
    ``torch._grouped_mm``, else None (torch has neither)."""
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def foreach_norm(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norm of each tensor, in one call (``torch._foreach_norm``)."""
    return torch._foreach_norm(tensors)


def foreach_mul_(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply each tensor in place by ``factor``, a one-element tensor, in one call (``torch._foreach_mul_``)."""
    torch._foreach_mul_(tensors, factor)


# ============================================================== distributed
def all_to_all_single_autograd(x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
                               group: Any) -> torch.Tensor:
    """Rows ``input_split_sizes[j]`` of ``x`` to process j, ``output_split_sizes[j]`` rows back from
    it; differentiable (the backward sends the gradients the reverse way)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd as exchange

    return exchange(x, output_split_sizes, input_split_sizes, group)


def ddp_ignore(module: torch.nn.Module, names: list[str]) -> None:
    """Make the DistributedDataParallel built next over ``module`` leave the named parameters and
    buffers alone: no gradient averaging, no broadcast."""
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)


# ============================================================== DCP's index format
PICKLED_LAYOUT = ("torch.serialization", "_get_layout")  # (module, name) a pickled torch.layout calls


def dcp_storage_info() -> type:
    """DCP's record of where one item is stored (a dataclass: relative_path, offset, length, ...)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo


def dcp_memory_format_encoding() -> type:
    """The enum DCP's TensorProperties stores a memory format as."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    return _MEM_FORMAT_ENCODING


# ============================================================== the compiler
def compiler_loaded() -> bool:
    """Has anything in this process imported torch's compiler (``torch._dynamo``)? Asks without importing it."""
    return "torch._dynamo" in sys.modules
