"""Buffers for big weight gradients on the CPU, reused from one backward to the next.

glibc's malloc serves every allocation of 32 MiB or more with a fresh ``mmap`` (its threshold adapts
to the sizes a program frees, up to DEFAULT_MMAP_THRESHOLD_MAX: 32 MiB on 64-bit) and hands the
pages back to the system on ``free``. A weight gradient that size is therefore page-faulted in anew
on every backward, since the optimizer's ``zero_grad(set_to_none=True)`` frees it each step: for the
(64, 512, 256) fp32 gradient of 64 GLU experts of width 256 (32 MiB), 12.7 ms of a 73 ms MoE layer
step on the 2-core CPU of docs/speed.md, for a matmul of 10 ms. A pool keeps such buffers and gives
one out again only when no tensor uses it any more; smaller tensors need none (malloc reuses them).

Whether a buffer is free is known exactly, without private torch APIs: each buffer is a numpy array,
and a tensor made by ``torch.from_numpy`` keeps one reference to its array for as long as its storage
lives (every view, ``param.grad``, a copy someone kept). An array referenced by the pool alone is
free. A buffer handed out as a gradient becomes ``param.grad`` itself (autograd adopts a gradient it
is the only holder of, in the parameter's layout), so a step allocates nothing that size.

    pool = GradientPool()
    out = pool.take(w)   # None for a small or non-CPU w: allocate as usual
"""

from __future__ import annotations

import sys

import numpy as np
import torch

MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's largest mmap threshold on 64-bit: allocations this size or more are mmapped


class GradientPool:
    """Up to ``buffers`` reusable buffers per (shape, dtype) for tensors of ``min_bytes`` or more.

    Two per shape cover gradient accumulation: while ``param.grad`` holds the first, the next micro-batch's
    gradient is written into the second and added to it. When every buffer is held (someone kept old
    gradients), :meth:`take` returns None and the caller allocates as usual. The buffers live as long as
    the pool (about the gradients' size again, the memory ``zero_grad(set_to_none=False)`` would keep);
    copies of the pool (``copy.deepcopy`` of a module) start empty."""

    def __init__(self, min_bytes: int = MMAP_THRESHOLD_MAX, buffers: int = 2):
        self.min_bytes, self.buffers = min_bytes, buffers
        self.arrays: dict[tuple, list[np.ndarray]] = {}

    def take(self, like: torch.Tensor) -> torch.Tensor | None:
        """An uninitialized contiguous tensor of ``like``'s shape and dtype that no other tensor uses, from the
        pool; None where the pool does not serve ``like`` (below ``min_bytes``, not on the CPU) or every
        buffer of its shape is held."""
        nbytes = like.numel() * like.element_size()
        if nbytes < self.min_bytes or like.device.type != "cpu":
            return None
        arrays = self.arrays.setdefault((tuple(like.shape), like.dtype), [])
        for i in range(len(arrays)):
            if sys.getrefcount(arrays[i]) == 2:  # the pool's reference and getrefcount's argument: no storage holds it
                return as_tensor(arrays[i], like)
        if len(arrays) == self.buffers:
            return None
        arrays.append(np.empty(nbytes, dtype=np.uint8))
        return as_tensor(arrays[-1], like)

    def __deepcopy__(self, memo: dict) -> "GradientPool":
        return GradientPool(self.min_bytes, self.buffers)

    def __getstate__(self) -> dict:
        return {"min_bytes": self.min_bytes, "buffers": self.buffers, "arrays": {}}


def as_tensor(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A tensor over ``array``'s bytes with ``like``'s dtype and shape (bytes, so any dtype: numpy has no bfloat16)."""
    return torch.from_numpy(array).view(like.dtype).view(like.shape)
