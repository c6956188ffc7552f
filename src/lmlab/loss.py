"""The language-model loss: next-token cross-entropy of the output head, with and without logits.

    hidden (N, C) ─ head W (V, C) ─ logits (N, V) ─ log-softmax ─ pick the target ─ mean

Two implementations compute the same loss and the same gradients:
  - ``plain``: the logits for all N positions, then ``F.cross_entropy``; the reference. In
    training it holds several (N, V) fp32 tensors at once (logits, log-probabilities, their
    gradient): at V = 128k and N = 8k tokens, over 4 GB each;
  - ``chunked``: N is cut into chunks of about ``CHUNK_ELEMENTS`` logits; each chunk's logits
    are made, turned into the loss and, when a gradient is wanted, straight into the gradients of
    the hidden states and the head, then freed. The full (N, V) logits never exist (the idea of
    Liger Kernel's fused linear cross-entropy, Hsu et al. 2024, arXiv:2410.10989, in plain torch).
    The backward only scales the stored gradients by the incoming one. When all N*V logits fit
    in one chunk it is the plain path, which holds no more memory then and runs fewer ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # targets equal to this are left out of the loss
# logits per chunk: 128 MB in fp32. Each chunk also reads and writes the head's whole (V, C) fp32
# gradient, so a chunk of n rows moves 2C/n times its own logits in gradient traffic: chunks of at
# least a few hundred rows keep that small (256 rows at V = 128k)
CHUNK_ELEMENTS = 1 << 25


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets`` over the non-ignored ones,
    with the (N, V) logits materialized; hidden (..., C), targets (...)."""
    logits = F.linear(hidden, weight)  # (..., V), in autocast's dtype
    # .long(): token shards are often int32/uint16, which cross_entropy refuses as targets
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten().long(), ignore_index=IGNORE_INDEX)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast would give a matmul on x's device (autograd Functions see no autocast)."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def chunk_rows(n: int, vocab: int) -> int:
    """Rows per chunk: ``CHUNK_ELEMENTS`` logits, at least one row, at most all of them."""
    return max(1, min(n, CHUNK_ELEMENTS // vocab))


class LinearCrossEntropy(torch.autograd.Function):
    """The chunked path: loss, d loss / d hidden and d loss / d weight computed in the forward, a
    chunk of logits at a time; hidden (N, C), weight (V, C), targets (N,) long."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype,
                grads: bool):
        h_NC, w_VC = hidden.to(dtype), weight.to(dtype)  # autocast's casts, done by hand
        valid_N = targets != IGNORE_INDEX
        n_valid = valid_N.sum()  # a tensor: no host sync
        scale_N = valid_N / n_valid  # 1/n for counted rows, 0 for ignored ones (nan when none count, as the reference)
        target_N = targets.clamp(min=0)  # ignored rows pick class 0, weighted 0
        g_h = torch.empty_like(h_NC) if grads and ctx.needs_input_grad[0] else None
        g_w = None  # (V, C) fp32, summed over chunks, as autograd's fp32 master gradient
        want_g_w = grads and ctx.needs_input_grad[1]
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        rows = chunk_rows(h_NC.shape[0], w_VC.shape[0])
        for s in range(0, h_NC.shape[0], rows):
            h, t, scale = h_NC[s : s + rows], target_N[s : s + rows], scale_N[s : s + rows]
            logp = torch.log_softmax((h @ w_VC.T).float(), dim=-1)  # (n, V) fp32
            loss -= (logp.gather(1, t[:, None])[:, 0] * scale).sum()
            if g_h is None and not want_g_w:
                continue
            g = logp.exp_()  # softmax, in place: d loss / d logits = (softmax - onehot) * scale
            g.scatter_add_(1, t[:, None], -torch.ones_like(g[:, :1]))
            g = g.mul_(scale[:, None]).to(dtype)
            if g_h is not None:
                torch.mm(g, w_VC, out=g_h[s : s + rows])
            if want_g_w and g_w is None:
                g_w = (g.T @ h).float()
            elif want_g_w and dtype == torch.float32:
                g_w.addmm_(g.T, h)
            elif want_g_w:
                g_w += (g.T @ h).float()
        ctx.save_for_backward(g_h, g_w)
        ctx.dtypes, ctx.spent = (hidden.dtype, weight.dtype), False
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.spent:
            raise RuntimeError(
                "the chunked loss's backward scales its stored gradients in place, so it runs once; to "
                "backpropagate through the loss twice (retain_graph=True), use model.set_loss_impl('plain')"
            )
        ctx.spent = True
        g_h, g_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        g_hidden = None if g_h is None else g_h.mul_(grad).to(h_dtype)
        g_weight = None if g_w is None else g_w.mul_(grad).to(w_dtype)
        return g_hidden, g_weight, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """:func:`linear_cross_entropy_reference`, a chunk of logits at a time; equal in value and gradients.
    Gradients are computed (in the forward) only when autograd will want them."""
    if targets.numel() * weight.shape[0] <= CHUNK_ELEMENTS:  # one chunk: the plain path is that chunk
        return linear_cross_entropy_reference(hidden, weight, targets)
    grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return LinearCrossEntropy.apply(
        hidden.flatten(0, -2), weight, targets.flatten().long(), compute_dtype(hidden), grads
    )


LOSSES = {"chunked": linear_cross_entropy, "plain": linear_cross_entropy_reference}
