"""The grouped matmul of the mixture-of-experts layer, registered as torch ops.

    grouped_mm(x_AI, w_EOI, offs_E) -> y_AO     rows offs[e-1]:offs[e] of x times w[e]^T, for every expert e

The layer (``moe.py``) sorts its token rows by expert, so each expert's rows are one contiguous group
and one call computes every expert. Two ops are registered with ``torch.library`` so that
torch.compile sees one opaque node each (it cannot trace torch's kernel outside bf16, nor the
per-group fallback at all): ``lmlab::grouped_mm`` (the forward and the input gradient) and
``lmlab::grouped_mm_weight_grad``, with fake (shape-only) versions and the autograd formula.
Each runs torch's grouped kernel where it exists for the device, dtype and alignment (probed once
per device and dtype, and checked against plain matmuls), else :func:`grouped_mm_split`, a matmul
per group. Shape suffixes as in ``moe.py``: A rows, E experts (groups), I input width, O output width.

:func:`grouped_matmul` is the same kernel called directly, in torch's convention and in the three forms
the CPU path of the routed experts uses inside its own autograd Function (``moe.RoutedExperts``).
"""

from __future__ import annotations

import functools

import torch

from .loss import compute_dtype  # grouped_mm is not autocast-aware
from .torch_private import grouped_mm_kernel

KERNEL = grouped_mm_kernel()  # torch's grouped matmul, (mat_a, mat_b, *, offs); None where torch has none


def grouped_mm(x_AI: torch.Tensor, w_EOI: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Rows offs[e-1]:offs[e] of x times w[e]^T (nn.Linear layout), for every group e -> (A, O),
    in the dtype autocast would use. One opaque op (``lmlab::grouped_mm``) for torch.compile:
    the compiler cannot trace torch's kernel outside bf16, nor the per-group fallback at all."""
    dtype = compute_dtype(x_AI)
    return grouped_mm_op(x_AI.to(dtype), w_EOI.to(dtype), offs_E)


@torch.library.custom_op("lmlab::grouped_mm", mutates_args=())
def grouped_mm_op(x_AI: torch.Tensor, w_EOI: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    if grouped_mm_kernel_ok(x_AI, w_EOI):
        return KERNEL(x_AI, w_EOI.transpose(-2, -1), offs=offs_E)
    return grouped_mm_split(x_AI, w_EOI, offs_E)


@torch.library.custom_op("lmlab::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(g_AO: torch.Tensor, x_AI: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """d loss / d w (E, O, I) of :func:`grouped_mm`: g[rows of e]^T @ x[rows of e] for each group e."""
    if grouped_mm_kernel_ok(g_AO, x_AI):
        return KERNEL(g_AO.transpose(0, 1), x_AI, offs=offs_E)  # 2D x 2D: groups split the shared axis
    sizes = torch.diff(offs_E, prepend=offs_E.new_zeros(1)).tolist()
    return torch.stack([g.T @ x for g, x in zip(torch.split(g_AO, sizes), torch.split(x_AI, sizes))])


@grouped_mm_op.register_fake
def _(x_AI, w_EOI, offs_E):
    return x_AI.new_empty(x_AI.shape[0], w_EOI.shape[1])


@grouped_mm_weight_grad.register_fake
def _(g_AO, x_AI, offs_E):
    return g_AO.new_empty(offs_E.shape[0], g_AO.shape[1], x_AI.shape[1])


def _grouped_mm_setup(ctx, inputs, output) -> None:
    x_AI, w_EOI, offs_E = inputs
    ctx.save_for_backward(x_AI, w_EOI, offs_E)


def _grouped_mm_backward(ctx, g_AO: torch.Tensor):
    x_AI, w_EOI, offs_E = ctx.saved_tensors
    g_x = grouped_mm_op(g_AO, w_EOI.transpose(1, 2), offs_E) if ctx.needs_input_grad[0] else None
    g_w = grouped_mm_weight_grad(g_AO, x_AI, offs_E) if ctx.needs_input_grad[1] else None
    return g_x, g_w, None


grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def grouped_mm_split(x_AI: torch.Tensor, w_EOI: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """The fallback, where torch has no grouped kernel for this device and dtype: split the sorted
    rows into groups and run a matmul per group. Reading the group sizes waits for the device.
    split and unbind, not indexing, keep the backward to one cat and one stack."""
    sizes = torch.diff(offs_E, prepend=offs_E.new_zeros(1)).tolist()
    return torch.cat([x_NI @ w_OI.T for x_NI, w_OI in zip(torch.split(x_AI, sizes), w_EOI.unbind(0))])


def grouped_matmul(a: torch.Tensor, b: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """torch's grouped matmul in torch's own convention (each group's ``a @ b``), in the three forms the
    CPU path of the routed experts (``moe.RoutedExperts``) uses, on operands of one dtype, not differentiable:

        a (A, I) 2D x b (E, I, O) 3D -> (A, O)    rows offs[e-1]:offs[e] of a times b[e]
        a (E, O, I) 3D x b (I, A) 2D -> (O, A)    a[e] times columns offs[e-1]:offs[e] of b
        a (O, A) 2D x b (A, I) 2D -> (E, O, I)    the groups split the shared axis: a weight gradient

    Either operand may be a transposed view. The kernel where it takes the operands (and its forms were
    probed on this device and dtype), else :func:`grouped_matmul_split`."""
    takes = a.numel() and b.numel() and _aligned16(a) and _aligned16(b)
    if takes and probe_grouped_matmul_forms(str(a.device), a.dtype):
        return KERNEL(a, b, offs=offs_E)
    return grouped_matmul_split(a, b, offs_E)


def grouped_matmul_split(a: torch.Tensor, b: torch.Tensor, offs_E: torch.Tensor,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`grouped_matmul` as a matmul per group: the reference, and the fallback (it reads the group sizes,
    which waits for the device). With ``out`` (the 2D x 2D form only), each group's product is written into
    ``out[e]`` (an empty group's zeros too), which torch's kernel cannot do: a weight gradient into a buffer
    of ``gradient_pool.GradientPool``."""
    sizes = torch.diff(offs_E, prepend=offs_E.new_zeros(1)).tolist()
    if out is not None:
        if a.dim() != 2 or b.dim() != 2:
            raise ValueError(f"grouped_matmul_split: out= takes the 2D x 2D form, not {a.dim()}D x {b.dim()}D")
        for a_e, b_e, out_e in zip(torch.split(a, sizes, dim=1), torch.split(b, sizes), out.unbind(0)):
            torch.mm(a_e, b_e, out=out_e)  # a shared axis of length 0 writes zeros
        return out
    if a.dim() == 2 and b.dim() == 3:
        return torch.cat([a_e @ b_e for a_e, b_e in zip(torch.split(a, sizes), b.unbind(0))])
    if a.dim() == 3:
        return torch.cat([a_e @ b_e for a_e, b_e in zip(a.unbind(0), torch.split(b, sizes, dim=1))], dim=1)
    return torch.stack([a_e @ b_e for a_e, b_e in zip(torch.split(a, sizes, dim=1), torch.split(b, sizes))])


@functools.lru_cache(maxsize=None)
def probe_grouped_matmul_forms(device: str, dtype: torch.dtype) -> bool:
    """Does torch's grouped matmul also take the 3D x 2D form and transposed operands here, equal to
    :func:`grouped_matmul_split`? (``probe_grouped_mm`` checks the two forms ``grouped_mm`` uses.)"""
    if not probe_grouped_mm(device, dtype):
        return False
    try:
        with torch.no_grad(), torch.autocast(torch.device(device).type, enabled=False):
            g = torch.Generator().manual_seed(1)
            x_AD = torch.randn(24, 16, generator=g).to(device, dtype)  # A = 24 rows of D = 16
            g_AI = torch.randn(24, 8, generator=g).to(device, dtype)
            w_EID = torch.randn(3, 8, 16, generator=g).to(device, dtype)
            offs = torch.tensor([8, 8, 24], dtype=torch.int32, device=device)  # includes an empty group
            g_IA = g_AI.T.contiguous()
            cases = [  # each operand as the CPU path passes it: contiguous, or a transposed view
                (w_EID, x_AD.T), (w_EID.transpose(1, 2), g_AI.T), (w_EID, x_AD.T.contiguous()),  # 3D x 2D
                (x_AD, w_EID.transpose(1, 2)), (x_AD.T.contiguous().T, w_EID.transpose(1, 2)),  # 2D x 3D
                (g_AI, w_EID), (g_IA.T, w_EID),
                (g_IA, x_AD), (g_AI.T, x_AD), (x_AD.T, g_AI), (x_AD.T, g_IA.T),  # 2D x 2D
            ]
            for a, b in cases:
                got, want = KERNEL(a, b, offs=offs).float(), grouped_matmul_split(a.float(), b.float(), offs)
                if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())):
                    return False
            return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def grouped_mm_kernel_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Can torch's grouped-matmul kernel take these operands? The kernels want 16-byte aligned data
    and strides (so D and F multiples of 4 in fp32); which devices and dtypes have one varies (CPU
    from torch 2.9, CUDA sm80+), so each (device, dtype) is probed once."""
    return _aligned16(x) and _aligned16(w) and probe_grouped_mm(str(x.device), x.dtype)


def _aligned16(t: torch.Tensor) -> bool:
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s, n in zip(t.stride(), t.shape) if s != 1 and n > 1)


@functools.lru_cache(maxsize=None)
def probe_grouped_mm(device: str, dtype: torch.dtype) -> bool:
    """Does torch's grouped matmul run here, in both forms the layer uses (3D weights for the
    forward and the input gradient, 2D x 2D for the weight gradient), and agree with plain matmuls?"""
    if KERNEL is None:
        return False
    try:
        with torch.no_grad(), torch.autocast(torch.device(device).type, enabled=False):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(24, 16, generator=g).to(device, dtype)
            w = torch.randn(3, 32, 16, generator=g).to(device, dtype)
            offs = torch.tensor([8, 8, 24], dtype=torch.int32, device=device)  # includes an empty group
            y = KERNEL(x, w.transpose(-2, -1), offs=offs)  # (24, 32)
            g_w = KERNEL(y.transpose(0, 1), x, offs=offs)  # (3, 32, 16)
            x32, y32 = x.float(), grouped_mm_split(x.float(), w.float(), offs)
            g_w_ref = torch.stack([y32[:8].T @ x32[:8], torch.zeros(32, 16, device=device), y32[8:].T @ x32[8:]])
            def close(a: torch.Tensor, b: torch.Tensor) -> bool:
                return bool(torch.allclose(a.float(), b, rtol=2e-2, atol=2e-2 * float(b.abs().max())))

            return close(y, y32) and close(g_w, g_w_ref)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
