"""Mixture-of-experts training speed: where an MoE step's time goes, and how it compares.

Four parts (``--part``, default all), each alternating its contenders in one process (harness.py)
and printing medians of wall and, on the CPU, process CPU time with the ratios:

  split  one MoE layer's forward and backward, phase by phase, at two shapes: the MoE experiment's
         (d_model 64, 64 experts of width 24, top-8, 16 x 128 tokens) and top-2 of 64 experts of
         width 256 (d_model 256, 8 x 256 tokens). Contenders, each a forward then its backward on fixed
         inputs: the layer; the layer's portable path (dispatch, ``lmlab::grouped_mm``, combine: what
         CUDA and torch.compile run, and what the CPU ran before ``moe.RoutedExperts``); the phases of the
         layer's own path one by one (routing with its balance loss, the plan, the gather, the up
         projection, the GLU, the gate weight, the down projection, the sum per token, the statistics);
         a straight-line floor (the same computation as one flat function of the weights, autograd
         differentiating it; checked equal to the layer first); and the matmuls alone (the path's
         grouped matmuls on fixed inputs).
  dense  the MoE experiment's models (src/lmlab/experiments/moe.yaml: vocab 2048, d_model 64, 4 layers,
         16 x 128 tokens): dense (GLU, d_ff 192) against fg-m4 (16 experts x granularity 4 = 64 of width
         24, top-8, expert balance loss 0.01) at equal active parameters, whole training steps
         (forward, loss, backward, fused AdamW).
  hf     one MoE block, forward and backward, lmlab against transformers' Mixtral, Qwen2-MoE and
         DeepSeek-V3 blocks (experts_implementation "grouped_mm", transformers' default) on the same
         weights (lmlab.hf's converters), at 8, 32 and 64 experts: top-2, d_model 256, experts of width
         256 (Qwen2-MoE and DeepSeek-V3: plus one shared expert; DeepSeek-V3: 4 groups, top-2 groups,
         sigmoid scores with a correction bias), 8 x 256 tokens, no balance loss on either side. Outputs,
         input gradients and every weight gradient (HF's mapped through the same converter) are checked
         equal before timing.
  model  a Qwen2-MoE-style model's training step (64 experts of width 128, top-6 + 1 shared, d_model
         256, 4 layers, 8 x 256 tokens) against transformers' Qwen2MoeForCausalLM and lmlab dense at
         equal active parameters.

    python benchmarks/bench_moe.py --threads 1                  # docs/speed.md's CPU rows (all parts)
    python benchmarks/bench_moe.py --threads 1 --part split     # one part
    python benchmarks/bench_moe.py --device cuda [--compile]    # bf16 autocast; GPU sizes
    python benchmarks/bench_moe.py --quick                      # seconds; numbers meaningless

``--device cuda`` runs every part at GPU sizes under bf16 autocast, where the layer takes the portable
path (torch's grouped_mm kernel in bf16); the split then times the portable path's phases.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from harness import Alternating, Setup, add_device_args, compile_blocks, mfu

import lmlab
from lmlab import ModelConfig, Transformer
from lmlab.feedforward import GLU
from lmlab.gradient_pool import MMAP_THRESHOLD_MAX, GradientPool
from lmlab.grouped_mm import grouped_matmul, grouped_mm, grouped_mm_weight_grad
from lmlab.hf import HFTensors, state_dict_from_hf
from lmlab.init import Init
from lmlab.loss import compute_dtype
from lmlab.moe import (
    MoE,
    combine,
    dispatch,
    down_input_grad,
    expert_hidden,
    expert_hidden_grad,
    moe_args,
    plan,
    sum_per_token,
    up_projection,
)
from lmlab.torch_private import grouped_mm_kernel

PARTS = ("split", "dense", "hf", "model")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(p)
    p.add_argument("--part", choices=PARTS, action="append", help="which parts (repeatable; default all)")
    p.add_argument("--size", choices=["cpu", "gpu"], default=None, help="default: the --device's")
    p.add_argument("--steps", type=int, default=None, help="timed rounds per part (default 15; quick 2)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--matmul", type=int, default=None, help="n of the n^3 reference matmul (2048 CPU, 8192 CUDA)")
    p.add_argument("--compile", action="store_true",
                   help="split: also the layer compiled whole; model part: lmlab per block (train.compile), HF whole")
    p.add_argument("--hf-experts", default=None, help="model part: transformers experts_implementation")
    args = p.parse_args()
    args.parts = args.part or list(PARTS)
    args.size = "quick" if args.quick else args.size or ("gpu" if args.device == "cuda" else "cpu")
    args.steps = args.steps or (2 if args.quick else 15)
    args.warmup = 1 if args.quick else args.warmup
    args.matmul = args.matmul or (256 if args.quick else 8192 if args.device == "cuda" else 2048)
    return args


# ============================================================== timing a forward and its backward
class SplitTimer:
    """Contenders are (forward, backward) pairs: each round calls every contender's forward, then its
    backward on what the forward returned, timing the two apart (wall and CPU). Medians per contender."""

    def __init__(self, setup: Setup, contenders: dict[str, tuple[Callable[[], object], Callable[[object], object]]]):
        self.setup, self.contenders = setup, contenders
        self.times = {name: {"fwd": [], "bwd": [], "fwd_cpu": [], "bwd_cpu": []} for name in contenders}

    def run(self, rounds: int, warmup: int) -> "SplitTimer":
        for i in range(warmup + rounds):
            for name, (fwd, bwd) in self.contenders.items():
                self.setup.sync()
                w0, c0 = time.perf_counter(), time.process_time()
                out = fwd()
                self.setup.sync()
                w1, c1 = time.perf_counter(), time.process_time()
                bwd(out)
                self.setup.sync()
                w2, c2 = time.perf_counter(), time.process_time()
                if i >= warmup:
                    t = self.times[name]
                    t["fwd"].append(w1 - w0), t["bwd"].append(w2 - w1)
                    t["fwd_cpu"].append(c1 - c0), t["bwd_cpu"].append(c2 - c1)
        return self

    def median(self, name: str, key: str) -> float:
        return statistics.median(self.times[name][key])

    def total(self, name: str, cpu: bool) -> float:
        """Median over rounds of forward + backward."""
        f, b = ("fwd_cpu", "bwd_cpu") if cpu else ("fwd", "bwd")
        return statistics.median(x + y for x, y in zip(self.times[name][f], self.times[name][b]))


def differs(err: float, what: str, setup: Setup) -> None:
    """Stop on the CPU (fp32) when two contenders do not compute the same thing; on CUDA, where bf16 autocast
    meets transformers' fp32 fallbacks, say so and go on."""
    if err < (3e-2 if setup.cuda else 1e-4):
        return
    message = f"{what} differ by {err:.1e} (outputs or gradients, relative): not the same computation"
    if not setup.cuda:
        raise SystemExit(message)
    print(f"WARNING: {message}; under bf16 autocast, timing anyway")


def nothing(_: object) -> None:
    return None


def backward_of(*grads: torch.Tensor) -> Callable[[object], None]:
    """A backward for a forward returning a tensor or a tuple of them: fixed upstream gradients."""

    def run(out) -> None:
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(list(outs), [g.to(o.dtype) for o, g in zip(outs, grads)])  # bf16 under autocast

    return run


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


# ============================================================== part 1: the split
SPLIT_SHAPES = {  # name: (d_model, n_experts, top_k, expert width, batch, seq_len)
    "cpu": {"fine-grained (the MoE experiment)": (64, 64, 8, 24, 16, 128),
            "64 experts of 256, top-2": (256, 64, 2, 256, 8, 256)},
    "gpu": {"fine-grained, 64 experts of 128, top-8": (1024, 64, 8, 128, 8, 1024),
            "64 experts of 512, top-2": (1024, 64, 2, 512, 8, 1024)},
    "quick": {"fine-grained": (32, 16, 4, 24, 2, 32), "top-2": (32, 8, 2, 32, 2, 32)},
}


def moe_layer(d_model: int, n_experts: int, top_k: int, width: int, device: torch.device,
              balance: float = 0.01) -> MoE:
    cfg = ModelConfig(d_model=d_model, n_heads=4, d_ff=width, ffn="glu", activation="silu",
                      moe=dict(n_experts=n_experts, top_k=top_k, expert_balance_coef=balance))
    layer = MoE(moe_args(cfg)).train()
    layer.init_params(Init(torch.Generator().manual_seed(0), std=0.02, out_std=0.02))
    return layer.to(device)


def straight_line(x_TD: torch.Tensor, w_router: torch.Tensor, w_in: torch.Tensor, w_down: torch.Tensor, k: int,
                  coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's computation as one flat function of its weights (softmax routing, top-k, dropless GLU
    experts, DeepSeekMoE's expert balance loss), autograd differentiating it: about the fewest operator
    calls an eager step of this layer makes. Returns (out_TD, aux loss)."""
    T, E = x_TD.shape[0], w_router.shape[0]
    with torch.autocast(x_TD.device.type, enabled=False):  # the router in fp32, as the layer's
        probs_TE = F.linear(x_TD.float(), w_router.float()).softmax(-1)
    weight_TK, expert_TK = probs_TE.topk(k, dim=-1)
    order_A = torch.sort(expert_TK.t().reshape(-1), stable=True).indices  # choice-major, as the layer's plan
    token_A = order_A % T
    count_E = torch.bincount(expert_TK.reshape(-1), minlength=E)
    offs_E = count_E.cumsum(0).to(torch.int32)
    dtype, kernel = compute_dtype(x_TD), grouped_mm_kernel()  # torch's kernel, differentiated by torch
    z_AI = kernel(x_TD[token_A].to(dtype), w_in.to(dtype).transpose(1, 2), offs=offs_E)
    gate_AF, up_AF = z_AI.chunk(2, dim=-1)
    h_AF = F.silu(gate_AF) * up_AF * weight_TK.t().reshape(-1)[order_A, None].to(dtype)
    y_AD = kernel(h_AF, w_down.to(dtype).transpose(1, 2), offs=offs_E)
    out_TD = torch.zeros_like(x_TD).index_add(0, token_A, y_AD.to(x_TD.dtype))
    aux = coef * (count_E.float() * E / (k * T) * probs_TE.mean(0)).sum()
    return out_TD, aux


def compiled_layer(twin: MoE, x_TD: torch.Tensor, g_TD: torch.Tensor) -> tuple:
    """``twin`` (a copy of the layer) compiled whole (fullgraph; the compiler traces the portable path), as a
    contender: its first call, in the untimed rounds, compiles."""
    T, D = x_TD.shape
    twin.compile(fullgraph=True)

    def fwd():
        return twin(leaf(x_TD).view(1, T, D)), twin.aux_loss

    return fwd, backward_of(g_TD.view(1, T, D), torch.ones((), device=x_TD.device))


def split_contenders(layer: MoE, x_TD: torch.Tensor, g_TD: torch.Tensor, cpu_path: bool, dtype: torch.dtype,
                     twin: MoE | None = None) -> dict:
    """The contenders of the split: forward/backward pairs on fixed inputs; last, the dense GLU at the layer's
    active parameters (d_ff = K x the expert width) and its three matmuls' forward and backward alone."""
    T, D = x_TD.shape
    ex, router = layer.experts, layer.router
    coef = layer.loss_terms["expert_balance"][0]
    one = torch.ones((), device=x_TD.device)

    supported, pool, no_pool = ex.fused, ex.grad_pool, GradientPool(min_bytes=2**62)
    pooled = ex.w_in_EID.numel() * ex.w_in_EID.element_size() >= MMAP_THRESHOLD_MAX  # does the pool serve it?

    def whole(fused: bool, grad_pool: GradientPool = pool):
        def fwd():
            ex.fused, ex.grad_pool = fused and supported, grad_pool
            return layer(leaf(x_TD).view(1, T, D)), layer.aux_loss

        return fwd, backward_of(g_TD.view(1, T, D), one)

    with torch.no_grad():  # fixed inputs of each phase: what the layer's own path computes on x_TD
        r = router(x_TD)
        p = plan(layer.assign(r))
        x_AD = x_TD.index_select(0, p.token_A)
        w_in, w_down, w_A = ex.gate_up.detach(), ex.down.detach(), p.weight_A.detach()
        hf = ex.hidden_first
        z_IA = up_projection(x_AD, w_in, p.offs_E, hf)
        h_FA, act_FA = expert_hidden(z_IA, "silu", True)
        s_FA = h_FA * w_A
        y_AD = grouped_matmul(s_FA.t(), w_down.transpose(1, 2), p.offs_E)
        g_AD = g_TD.index_select(0, p.token_A)
        g_s_FA = down_input_grad(g_AD, w_down, p.offs_E, hf)
        g_z_IA = expert_hidden_grad(g_s_FA * w_A, z_IA, act_FA, "silu", True)

    def route():
        rr = router(leaf(x_TD))
        return rr.weight_TK, coef * layer.loss_terms["expert_balance"][1](rr)

    def stats():  # what every forward does; the router entropy is computed when the statistics are read
        with torch.no_grad():
            return layer.load + r.chosen_E, [r.probs_TE.detach()]

    c = {
        "layer": whole(True),
        "layer, portable path": whole(False),
        **({"layer, no gradient pool": whole(True, no_pool)} if pooled and cpu_path else {}),
        **({"layer, torch.compile": compiled_layer(twin, x_TD, g_TD)} if twin is not None else {}),
        "straight-line floor": (
            lambda: straight_line(leaf(x_TD), router.weight, ex.gate_up, ex.down, layer.top_k, coef),
            backward_of(g_TD, one)),
    }
    c["  route + balance loss"] = (route, backward_of(torch.ones_like(r.weight_TK), one))
    c["  plan (sort by expert)"] = (lambda: plan(layer.assign(r)), nothing)
    if cpu_path:  # the phases of RoutedExperts, forward and backward as it runs them
        c["  gather rows"] = (lambda: x_TD.index_select(0, p.token_A), lambda _: sum_per_token(g_AD, p, T))
        c["  up projection"] = (lambda: up_projection(x_AD, w_in, p.offs_E, hf),
                                lambda _: (grouped_matmul(g_z_IA.t(), w_in, p.offs_E),
                                           grouped_matmul(g_z_IA, x_AD, p.offs_E)))
        c["  GLU"] = (lambda: expert_hidden(z_IA, "silu", True),
                      lambda _: expert_hidden_grad(g_s_FA * w_A, z_IA, act_FA, "silu", True))
        c["  gate weight"] = (lambda: h_FA * w_A, lambda _: ((g_s_FA * h_FA).sum(0), g_s_FA * w_A))
        c["  down projection"] = (lambda: grouped_matmul(s_FA.t(), w_down.transpose(1, 2), p.offs_E),
                                  lambda _: (down_input_grad(g_AD, w_down, p.offs_E, hf),
                                             grouped_matmul(g_AD.t(), s_FA.t(), p.offs_E)))
        c["  sum per token"] = (lambda: sum_per_token(y_AD, p, T), lambda _: g_TD.index_select(0, p.token_A))
        c["  statistics"] = (stats, nothing)
    # the portable path's phases: autograd through dispatch, lmlab::grouped_mm, the GLU Function and combine
    # (on the CPU, what the layer ran before RoutedExperts; routing and the plan are the same)
    with torch.no_grad():
        z_AI = grouped_mm(x_AD, w_in, p.offs_E)
        h_AF = ex.hidden(z_AI)
        s_AF = h_AF * w_A[:, None].to(h_AF.dtype)
        y2_AD = grouped_mm(s_AF, w_down, p.offs_E)
    port = "  portable: " if cpu_path else "  "
    c[port + "gather (dispatch)"] = (lambda: dispatch(leaf(x_TD), p), backward_of(torch.ones_like(x_AD)))
    c[port + "up (lmlab::grouped_mm)"] = (lambda: grouped_mm(leaf(x_AD), ex.gate_up, p.offs_E),
                                          backward_of(torch.ones_like(z_AI)))
    c[port + "GLU"] = (lambda: ex.hidden(leaf(z_AI)), backward_of(torch.ones_like(h_AF)))
    c[port + "gate weight"] = (lambda: leaf(h_AF) * leaf(w_A)[:, None], backward_of(torch.ones_like(h_AF)))
    c[port + "down (lmlab::grouped_mm)"] = (lambda: grouped_mm(leaf(s_AF), ex.down, p.offs_E),
                                            backward_of(torch.ones_like(y2_AD)))
    c[port + "sum per token (combine)"] = (lambda: combine(leaf(y2_AD), p, torch.zeros_like(x_TD)),
                                           backward_of(g_TD))
    if cpu_path:  # the layer's own matmuls, in the forms RoutedExperts calls
        c["matmuls alone"] = (
            lambda: (up_projection(x_AD, w_in, p.offs_E, hf),
                     grouped_matmul(s_FA.t(), w_down.transpose(1, 2), p.offs_E)),
            lambda _: (down_input_grad(g_AD, w_down, p.offs_E, hf), grouped_matmul(g_AD.t(), s_FA.t(), p.offs_E),
                       grouped_matmul(g_z_IA.t(), w_in, p.offs_E), grouped_matmul(g_z_IA, x_AD, p.offs_E)))
        c.update(matmul_alternatives(x_TD, x_AD, w_in, w_down, s_FA, g_AD, g_z_IA, p))
    else:  # the portable path's six grouped matmuls, in the dtype autocast gives them
        c["  statistics"] = (stats, nothing)
        x_, s_, g_, gz_ = (t.to(dtype) for t in (x_AD, s_AF, g_AD, torch.ones_like(z_AI)))
        w_in_, w_down_ = w_in.to(dtype), w_down.to(dtype)
        c["matmuls alone"] = (
            lambda: (grouped_mm(x_, w_in_, p.offs_E), grouped_mm(s_, w_down_, p.offs_E)),
            lambda _: (grouped_mm(g_, w_down_.transpose(1, 2), p.offs_E), grouped_mm_weight_grad(g_, s_, p.offs_E),
                       grouped_mm(gz_, w_in_.transpose(1, 2), p.offs_E), grouped_mm_weight_grad(gz_, x_, p.offs_E)))
    glu = GLU(ModelConfig(d_model=D, n_heads=4, d_ff=layer.top_k * ex.width)).to(x_TD.device)
    with torch.no_grad():
        z_TI = glu.gate_up(x_TD)
        h_TF = glu.glu(z_TI, glu.activation)
    w_gu, w_d = glu.gate_up.weight.detach().to(dtype), glu.down.weight.detach().to(dtype)
    dx, dz, dh, dg = (t.to(dtype) for t in (x_TD, z_TI, h_TF, g_TD))  # the dense layer's operands
    c["dense GLU, equal active parameters"] = (lambda: glu(leaf(x_TD)), backward_of(g_TD))
    c["dense GLU's matmuls alone"] = (
        lambda: (F.linear(dx, w_gu), F.linear(dh, w_d)),
        lambda _: (dg @ w_d, dg.t() @ dh, dz @ w_gu, dz.t() @ dx))  # dz stands in for its gradient, same shape
    layer.zero_grad(set_to_none=True)
    modules = [m for m in (layer, twin, glu) if m is not None]

    def freeing(bwd: Callable[[object], object]) -> Callable[[object], None]:
        """Each contender frees the parameter gradients it made, in its own timed backward as a training step's
        zero_grad does, so that what freeing them costs (unmapping memory, for big ones) is not charged to
        whichever contender runs next on the same parameters."""
        def run(out) -> None:
            bwd(out)
            for m in modules:
                m.zero_grad(set_to_none=True)

        return run

    return {name: (fwd, freeing(bwd)) for name, (fwd, bwd) in c.items()}


def matmul_alternatives(x_TD, x_AD, w_in, w_down, s_FA, g_AD, g_z_IA, p) -> dict:
    """The six matmuls of the layer's step computed other ways, forward then backward, on the same operands
    ("matmuls alone" is torch's grouped kernel in the layer's forms): a torch.mm per expert; one padded bmm
    over experts, each group padded to the largest (operands padded beforehand, so a lower bound: the
    layer would also have to pad and unpad); and the up projection of every expert on every token, as one
    dense matmul, then the rows each assignment needs (E/K times the FLOPs; against the layer's
    up projection phase; where E/K is at most 8)."""
    T, D = x_TD.shape
    E, rows, _ = w_in.shape  # rows: I, the input projection's
    sizes = torch.diff(p.offs_E, prepend=p.offs_E.new_zeros(1)).tolist()
    x_, s_, g_, gz_ = x_AD, s_FA.t().contiguous(), g_AD, g_z_IA.t().contiguous()  # rows first

    def loop(a, b, transpose_b=False):  # rows of a grouped, b (E, ., .) per expert -> (A, .)
        return torch.cat([a_e @ (b_e.t() if transpose_b else b_e) for a_e, b_e in zip(a.split(sizes), b.unbind(0))])

    def loop_weight(a, b):  # a (A, O), b (A, I) grouped -> (E, O, I)
        return torch.stack([a_e.t() @ b_e for a_e, b_e in zip(a.split(sizes), b.split(sizes))])

    C = max(sizes)
    pad = torch.zeros(E, C, dtype=torch.long)  # row of each slot (a zero row for padding)
    for e, (start, n) in enumerate(zip([0] + p.offs_E.tolist()[:-1], sizes)):
        pad[e, :n] = torch.arange(start, start + n) + 1

    def padded(t):  # (A, .) -> (E, C, .), padding rows zero
        return torch.cat([t.new_zeros(1, t.shape[1]), t]).index_select(0, pad.view(-1)).view(E, C, -1)

    xp, sp, gp, gzp = padded(x_), padded(s_), padded(g_), padded(gz_)
    expert_A = torch.repeat_interleave(torch.arange(E), torch.tensor(sizes))
    token_A = p.token_A
    w_all = w_in.reshape(E * rows, D)
    dense_masked = {} if E > 8 * p.row_KT.numel() // T else {  # only where E/K is small enough to be plausible
        "alt: up, every expert x every token": (
            lambda: (x_TD @ w_all.t()).view(T, E, rows)[token_A, expert_A],
            lambda _: (lambda g_all: (g_all @ w_all, g_all.t() @ x_TD))(
                torch.zeros(T, E, rows).index_put_((token_A, expert_A), gz_).view(T, E * rows)))}
    return dense_masked | {
        "alt: a torch.mm per expert (6 matmuls)": (
            lambda: (loop(x_, w_in, True), loop(s_, w_down, True)),
            lambda _: (loop(g_, w_down), loop_weight(g_, s_), loop(gz_, w_in), loop_weight(gz_, x_))),
        f"alt: padded bmm, C={C} (6 matmuls)": (
            lambda: (torch.bmm(xp, w_in.transpose(1, 2)), torch.bmm(sp, w_down.transpose(1, 2))),
            lambda _: (torch.bmm(gp, w_down), torch.bmm(gp.transpose(1, 2), sp), torch.bmm(gzp, w_in),
                       torch.bmm(gzp.transpose(1, 2), xp))),
    }


def check_straight_line(layer: MoE, x_TD: torch.Tensor, g_TD: torch.Tensor, setup: Setup) -> float:
    """The largest difference between the layer and the straight line, outputs and gradients (relative to
    each tensor's largest value): they must compute the same thing for the floor to mean anything."""
    T, D = x_TD.shape
    results = []
    for run in ("layer", "straight"):
        layer.zero_grad(set_to_none=True)
        x = leaf(x_TD)
        with setup.autocast():
            if run == "layer":
                y, aux = layer(x.view(1, T, D)).view(T, D), layer.aux_loss
            else:
                ex = layer.experts
                y, aux = straight_line(x, layer.router.weight, ex.gate_up, ex.down, layer.top_k,
                                       layer.loss_terms["expert_balance"][0])
        torch.autograd.backward([y, aux], [g_TD, torch.ones_like(aux)])
        results.append([y.detach(), x.grad] + [p.grad for p in (layer.router.weight, layer.experts.gate_up,
                                                                 layer.experts.down)])
    return max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(*results))


def part_split(args: argparse.Namespace, setup: Setup) -> None:
    for name, (D, E, K, width, B, S) in SPLIT_SHAPES[args.size].items():
        layer = moe_layer(D, E, K, width, setup.device)
        twin = copy.deepcopy(layer) if args.compile else None  # before any forward leaves tensors on the layer
        g = torch.Generator().manual_seed(1)
        x_TD = torch.randn(B * S, D, generator=g).to(setup.device)
        g_TD = torch.randn(B * S, D, generator=g).to(setup.device)
        cpu_path = layer.experts.fused and layer.experts.fused_path_fits(x_TD) and not setup.cuda
        err = check_straight_line(layer, x_TD, g_TD, setup)
        differs(err, f"split {name}: the straight line and the layer", setup)
        with setup.autocast():
            contenders = split_contenders(layer, x_TD, g_TD, cpu_path, setup.dtype, twin)
            timer = SplitTimer(setup, contenders).run(args.steps, args.warmup)
        layout = ("hidden units first" if layer.experts.hidden_first else "rows first") if cpu_path else "portable"
        print(f"\nsplit: {name}: d_model {D}, {E} experts of width {width}, top-{K}, {B} x {S} tokens; the layer's "
              f"path: {layout}; {setup.describe()}; median of {args.steps} rounds")
        print(f"layer and straight line equal to {err:.1e} (largest relative difference, outputs and gradients)")
        cpu = not setup.cuda
        unit = "CPU ms" if cpu else "ms"
        total = timer.total("layer", cpu)
        print(f"  {'contender':40s} {'forward':>9s} {'backward':>9s} {'step':>9s} {'of layer':>9s}   ({unit})")
        for c in timer.contenders:
            f = timer.median(c, "fwd_cpu" if cpu else "fwd")
            b = timer.median(c, "bwd_cpu" if cpu else "bwd")
            step = timer.total(c, cpu)
            print(f"  {c:40s} {1e3 * f:9.3f} {1e3 * b:9.3f} {1e3 * step:9.3f} {100 * step / total:8.1f}%")
        shared = ("  route + balance loss", "  plan (sort by expert)", "  statistics")
        own = [c for c in timer.contenders if c.startswith("  ") and not c.startswith("  portable: ")]
        phases = sum(timer.total(c, cpu) for c in own)
        print(f"  the layer's phases together: {1e3 * phases:.3f} ms ({100 * phases / total:.0f}% of the layer; the "
              "rest is its bookkeeping and what timing phases apart does not see: caches, allocation)")
        if cpu_path:
            portable = sum(timer.total(c, cpu) for c in timer.contenders if c.startswith("  portable: ") or c in shared)
            print(f"  the portable path's phases together (with routing, plan, statistics): {1e3 * portable:.3f} ms "
                  f"({100 * portable / timer.total('layer, portable path', cpu):.0f}% of it)")
        compiled = [("layer, torch.compile", "compiling the layer whole")] if args.compile else []
        if "layer, no gradient pool" in timer.contenders:
            compiled.append(("layer, no gradient pool", "the weight gradients' buffers reused (gradient_pool.py)"))
        for other, what in (("layer, portable path", "the layer's speed against its portable path"), *compiled,
                            ("straight-line floor", "against the floor"),
                            ("matmuls alone", "against its matmuls alone: the most the rest could give"),
                            ("dense GLU, equal active parameters", "the MoE layer's speed against dense")):
            print(f"  {other} / layer, step time: {timer.total(other, cpu) / total:.2f}x ({what})")
        for alt in [c for c in timer.contenders if c.startswith("alt: ")]:
            base = "  up projection" if "every expert" in alt else "matmuls alone"
            print(f"  {alt} / {base.strip()}, step time: {timer.total(alt, cpu) / timer.total(base, cpu):.2f}x")
        mm, dense_mm = timer.total("matmuls alone", cpu), timer.total("dense GLU's matmuls alone", cpu)
        print(f"  the layer's grouped matmuls take {1e3 * (mm - dense_mm):.3f} ms more than the dense GLU's for the "
              f"same FLOPs ({mm / dense_mm:.2f}x)")


# ============================================================== part 2: dense against fine-grained MoE
EXPERIMENT = {  # src/lmlab/experiments/moe.yaml's base model and its fg-m4 arm
    "cpu": (dict(vocab_size=2048, d_model=64, n_heads=4, n_layers=4, ffn="glu", activation="silu", max_seq_len=128),
            16, 128),
    "gpu": (dict(vocab_size=32000, d_model=1024, n_heads=16, n_layers=8, ffn="glu", activation="silu",
                 max_seq_len=1024), 8, 1024),
    "quick": (dict(vocab_size=256, d_model=32, n_heads=4, n_layers=2, ffn="glu", activation="silu", max_seq_len=32),
              2, 32),
}
FG_M4 = dict(n_experts=16, top_k=2, granularity=4, expert_balance_coef=0.01)  # d_expert: the dense d_ff / 2


def training_step(model: Transformer, idx: torch.Tensor, tgt: torch.Tensor, setup: Setup) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def run() -> None:
        with setup.autocast():
            loss = model(idx, targets=tgt).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.update_router_biases()  # a no-op here, part of the trainer's step

    return run


def print_ratio(timer: Alternating, fast: str, slow: str, cpu: bool, target: str = "") -> None:
    wall, cpu_ratio = timer.ratio(fast, slow)
    spread = sorted(timer.ratios_per_round(fast, slow))
    print(f"{fast} / {slow}: {wall:.2f}x wall" + (f", {cpu_ratio:.2f}x CPU time" if cpu else "")
          + f" (median of per-round ratios, wall range {spread[0]:.2f}..{spread[-1]:.2f})" + target)


def part_dense(args: argparse.Namespace, setup: Setup) -> None:
    base, B, S = EXPERIMENT[args.size]
    dense_cfg = ModelConfig(**base)
    moe_cfg = ModelConfig(**base, moe=dict(FG_M4, d_expert=dense_cfg.d_ff // 2))
    torch.manual_seed(0)
    dense, moe = Transformer(dense_cfg).to(setup.device).train(), Transformer(moe_cfg).to(setup.device).train()
    portable = portable_twin(moe)
    g = torch.Generator().manual_seed(0)
    idx, tgt = (torch.randint(0, base["vocab_size"], (B, S), generator=g).to(setup.device) for _ in range(2))
    timer = Alternating(setup, {"lmlab MoE": training_step(moe, idx, tgt, setup),
                                "lmlab dense": training_step(dense, idx, tgt, setup),
                                "MoE, portable path": training_step(portable, idx, tgt, setup)},
                        ).run(args.steps, args.warmup)
    width = moe_cfg.moe.expert_width(moe_cfg.d_ff)
    print(f"\ndense: the MoE experiment's models, d_model {base['d_model']}, {base['n_layers']} layers, vocab "
          f"{base['vocab_size']}, {B} x {S} tokens; dense GLU d_ff {dense_cfg.d_ff} against "
          f"{moe_cfg.moe.routed_experts} experts of width {width}, top-{moe_cfg.moe.active_experts}; training steps; "
          f"{setup.describe()}; median of {args.steps} alternating steps")
    for name, model in (("lmlab MoE", moe), ("lmlab dense", dense), ("MoE, portable path", portable)):
        wall, cpu = timer.median(name)
        n = model.num_params()
        print(f"  {name:18s} {n['total']:>10,d} params, {n['active']:>9,d} active, "
              f"{model.flops_per_token(S) / 1e6:5.2f} MFLOP/token: {1e3 * wall:7.1f} ms, {B * S / wall:8,.0f} tokens/s"
              + ("" if setup.cuda else f"; CPU {1e3 * cpu:7.1f} ms, {B * S / cpu:8,.0f} tokens/CPU-s"))
    print_ratio(timer, "lmlab MoE", "lmlab dense", not setup.cuda, "; CPU target >= 0.9x")
    print_ratio(timer, "MoE, portable path", "lmlab dense", not setup.cuda, " (the CPU's path before RoutedExperts)")


def portable_twin(model):
    """A copy of ``model`` (an MoE layer or a Transformer) whose MoE layers take the portable path: on the
    CPU, what lmlab ran before ``moe.RoutedExperts``."""
    twin = copy.deepcopy(model)
    for layer in [twin] if isinstance(twin, MoE) else twin.moe_layers:
        layer.experts.fused = False
    return twin


# ============================================================== part 3: MoE blocks against transformers'
HF_BLOCK = {"cpu": (256, 256, 2, 8, 256), "gpu": (1024, 512, 2, 8, 1024), "quick": (32, 32, 2, 2, 32)}  # D, F, K, B, S


def hf_block(family: str, n_experts: int, size: str):
    """(transformers block, its config dict, lmlab's ModelConfig, converter of the block's tensors to lmlab's)."""
    D, F_, K, _, _ = HF_BLOCK[size]
    from lmlab.hf import moe as hf_moe

    prefix = "model.layers.1.mlp."
    if family == "Mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        hc = MixtralConfig(hidden_size=D, intermediate_size=F_, num_local_experts=n_experts, num_experts_per_tok=K,
                           num_attention_heads=4, num_key_value_heads=4, experts_implementation="grouped_mm")
        block, cfg = MixtralSparseMoeBlock(hc), hf_moe.mixtral_config(hc.to_dict())
        convert = lambda t: hf_moe.mixtral_ffn(cfg, t, prefix, "")  # noqa: E731
    elif family == "Qwen2-MoE":
        from transformers import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

        hc = Qwen2MoeConfig(hidden_size=D, moe_intermediate_size=F_, shared_expert_intermediate_size=F_,
                            num_experts=n_experts, num_experts_per_tok=K, norm_topk_prob=False, num_attention_heads=4,
                            num_key_value_heads=4, num_hidden_layers=2, experts_implementation="grouped_mm")
        block, cfg = Qwen2MoeSparseMoeBlock(hc), hf_moe.qwen2_moe_config(hc.to_dict())
        convert = lambda t: {k.removeprefix("blocks.1.ffn."): v  # noqa: E731
                             for k, v in hf_moe.qwen2_moe_ffn(cfg, t, prefix, "blocks.1.ffn.").items()}
    else:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

        hc = DeepseekV3Config(hidden_size=D, moe_intermediate_size=F_, n_routed_experts=n_experts,
                              num_experts_per_tok=K, n_group=4, topk_group=2, n_shared_experts=1,
                              routed_scaling_factor=2.5, norm_topk_prob=True, experts_implementation="grouped_mm")
        block = DeepseekV3MoE(hc)
        cfg = ModelConfig(d_model=D, n_heads=4, d_ff=F_, moe=hf_moe.deepseek_v3_moe(hc.to_dict()))
        convert = lambda t: hf_moe.deepseek_v3_moe_weights(cfg, t, prefix, "")  # noqa: E731
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        for name, b in block.named_buffers():
            if "bias" in name:  # DeepSeek-V3's correction bias, large enough to change choices
                b.copy_(torch.randn(b.shape, generator=g) * 0.01)
    cfg = cfg.override({"moe.expert_balance_coef": 0.0})  # the blocks compute no balance loss

    def to_lmlab(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return convert(HFTensors({prefix + k: v for k, v in tensors.items()}))

    return block, cfg, to_lmlab


def block_step(block, x: torch.Tensor, g: torch.Tensor, setup: Setup) -> Callable[[], tuple]:
    def run() -> tuple:
        block.zero_grad(set_to_none=True)
        xi = leaf(x)
        with setup.autocast():
            y = block(xi)
        y.backward(g)
        return y.detach(), xi.grad

    return run


def part_hf(args: argparse.Namespace, setup: Setup) -> None:
    D, F_, K, B, S = HF_BLOCK[args.size]
    sizes = (8, 16) if args.quick else (8, 32, 64)
    print(f"\nhf: one MoE block, forward + backward, lmlab against transformers on the same weights: d_model {D}, "
          f"experts of width {F_}, top-{K}, {B} x {S} tokens; {setup.describe()}; median of {args.steps} "
          "alternating steps")
    cpu = not setup.cuda
    unit = "CPU ms" if cpu else "ms"
    print(f"  {'block':12s} {'experts':>7s} {'lmlab':>9s} {'portable':>9s} {'HF':>9s} {'HF / lmlab':>8s} "
          f"{'/ portable':>8s} {'(wall)':>8s}   equal to   ({unit})")
    for family in ("Mixtral", "Qwen2-MoE", "DeepSeek-V3"):
        for E in sizes:
            hf, cfg, to_lmlab = hf_block(family, E, args.size)
            ours = MoE(moe_args(cfg))
            ours.load_state_dict(to_lmlab(hf.state_dict()))
            hf, ours = hf.to(setup.device).train(), ours.to(setup.device).train()
            g = torch.Generator().manual_seed(1)
            x, grad = (torch.randn(B, S, D, generator=g).to(setup.device) for _ in range(2))
            run_ours, run_hf = block_step(ours, x, grad, setup), block_step(hf, x, grad, setup)
            run_portable = block_step(portable_twin(ours), x, grad, setup)
            (y_o, gx_o), (y_h, gx_h) = run_ours(), run_hf()
            hf_grads = {n: p.grad for n, p in hf.named_parameters()}
            hf_grads.update({n: torch.zeros_like(b) for n, b in hf.named_buffers()})  # buffers have no gradient
            mapped = to_lmlab(hf_grads)
            pairs = [(y_o, y_h), (gx_o, gx_h)] + [(p.grad, mapped[n]) for n, p in ours.named_parameters()]
            err = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                      for a, b in pairs)
            differs(err, f"{family} with {E} experts: lmlab and transformers", setup)
            timer = Alternating(setup, {"lmlab": run_ours, "HF": run_hf, "portable": run_portable}).run(
                args.steps, args.warmup)
            k = 1 if cpu else 0  # CPU time on the CPU, wall time on CUDA
            times = [1e3 * timer.median(name)[k] for name in ("lmlab", "portable", "HF")]
            ratio, portable = timer.ratio("lmlab", "HF")[k], timer.ratio("portable", "HF")[k]
            print(f"  {family:12s} {E:7d} {times[0]:9.1f} {times[1]:9.1f} {times[2]:9.1f} {ratio:7.2f}x "
                  f"{portable:7.2f}x {timer.ratio('lmlab', 'HF')[0]:7.2f}x   {err:.1e}")
    print("  HF / lmlab: the median over rounds of the per-round ratio (CPU time on the CPU), and of wall time; "
          "portable: lmlab's portable path (the CPU's before RoutedExperts). CPU target >= 1.2x at 32 and 64 "
          "experts (Mixtral, DeepSeek-V3). equal to: the largest difference of outputs, input and weight gradients, "
          "relative to each tensor's largest value")


# ============================================================== part 4: a Qwen2-MoE model's training step
E_MODEL, K_MODEL, SHARED = 64, 6, 1
AUX_COEF = 0.001  # HF Qwen2-MoE's default router_aux_loss_coef
MODEL_SIZES = {  # d_model, n_layers, heads, expert width, batch, seq_len, vocab
    "cpu": (256, 4, 8, 128, 8, 256, 256),
    "gpu": (1024, 8, 16, 256, 8, 1024, 32000),
    "quick": (64, 2, 4, 32, 2, 64, 128),
}


def hf_qwen2_moe(size: str, experts_impl: str | None):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    D, L, heads, F_expert, _, S, V = MODEL_SIZES[size]
    cfg = Qwen2MoeConfig(
        vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=heads, num_key_value_heads=heads,
        intermediate_size=4 * D, moe_intermediate_size=F_expert, shared_expert_intermediate_size=SHARED * F_expert,
        num_experts=E_MODEL, num_experts_per_tok=K_MODEL, norm_topk_prob=False, qkv_bias=False,
        max_position_embeddings=S, output_router_logits=True, router_aux_loss_coef=AUX_COEF, tie_word_embeddings=False,
        **({"experts_implementation": experts_impl} if experts_impl else {}),
    )
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(cfg)
    if experts_impl:
        model.set_experts_implementation(experts_impl)
    return model


def lmlab_twin(hf_model, seq_len: int) -> Transformer:
    """lmlab's config for the same architecture, with the HF weights."""
    cfg = lmlab.hf.config_from_hf(hf_model.config.to_dict())
    n_layers = hf_model.config.num_hidden_layers
    # HF's loss: coef * E * sum_e f_e P_e with f_e over all K choices and all layers at once; lmlab's
    # expert_balance is that divided by K, per layer, summed over layers
    cfg = cfg.override({"max_seq_len": seq_len, "moe.expert_balance_coef": AUX_COEF * K_MODEL / n_layers})
    model = Transformer(cfg)
    model.load_state_dict(state_dict_from_hf(cfg, hf_model.state_dict(), "qwen2_moe"))
    return model


def dense_twin(size: str, active: int) -> Transformer:
    """lmlab's dense model with d_ff (a multiple of 8) giving the closest parameter count to ``active``."""
    D, L, heads, _, _, S, V = MODEL_SIZES[size]
    base = dict(vocab_size=V, d_model=D, n_layers=L, n_heads=heads, max_seq_len=S, ffn="glu", activation="silu",
                norm_eps=1e-6)
    with torch.device("meta"):
        def count(d_ff: int) -> int:
            return Transformer(ModelConfig(**base, d_ff=d_ff)).num_params()["total"]

        per_unit = (count(16) - count(8)) / 8
        d_ff = 8 * round((active - count(8)) / per_unit / 8) + 8
    return Transformer(ModelConfig(**base, d_ff=d_ff))


def part_model(args: argparse.Namespace, setup: Setup) -> None:
    D, L, heads, F_expert, B, S, V = MODEL_SIZES[args.size]
    hf = hf_qwen2_moe(args.size, args.hf_experts)
    moe = lmlab_twin(hf, S)
    dense = dense_twin(args.size, moe.num_params()["active"])
    hf, moe, dense = hf.to(setup.device), moe.to(setup.device), dense.to(setup.device)
    g = torch.Generator().manual_seed(0)
    idx, tgt = (torch.randint(0, V, (B, S), generator=g).to(setup.device) for _ in range(2))

    hf.eval(), moe.eval()
    with torch.no_grad(), setup.autocast():
        gap = (hf(input_ids=idx).logits.float() - moe(idx).logits.float()).abs().max().item()
    hf.train(), moe.train(), dense.train()
    run_hf = hf
    if args.compile:
        compile_blocks(moe), compile_blocks(dense)
        run_hf = torch.compile(hf)
    opt_hf = torch.optim.AdamW(hf.parameters(), lr=1e-4, fused=True)

    def step_hf() -> None:
        with setup.autocast():
            loss = run_hf(input_ids=idx, labels=tgt).loss  # HF shifts labels: S-1 positions
        loss.backward()
        opt_hf.step()
        opt_hf.zero_grad(set_to_none=True)

    timer = Alternating(setup, {
        "lmlab MoE": training_step(moe, idx, tgt, setup),
        "HF Qwen2-MoE": step_hf,
        "lmlab dense": training_step(dense, idx, tgt, setup),
    }).run(args.steps, args.warmup, matmul=args.matmul)

    print(f"\nmodel: MoE training step, d_model {D}, {L} layers, {E_MODEL} experts of width {F_expert}, "
          f"top-{K_MODEL} + {SHARED} shared, batch {B} x {S}, vocab {V}; {setup.describe()}"
          + ("; torch.compile" if args.compile else "; eager"))
    print(f"HF experts_implementation={hf.config._experts_implementation!r}, "
          f"attention={hf.config._attn_implementation!r}; "
          f"same weights: max |logits(lmlab) - logits(HF)| = {gap:.2e}; median of {args.steps} alternating steps")
    print(f"{'model':14s} {'total params':>13s} {'active':>11s} {'step (ms)':>10s} {'tokens/s':>10s} {'MFU':>6s}"
          + ("" if setup.cuda else f" {'tokens/cpu-s':>13s}"))
    fpt = moe.flops_per_token(S)  # the HF twin has the same architecture; the dense twin its own count
    for name, model in (("lmlab MoE", moe), ("HF Qwen2-MoE", hf), ("lmlab dense", dense)):
        total = sum(p.numel() for p in model.parameters())
        active = model.num_params()["active"] if isinstance(model, Transformer) else moe.num_params()["active"]
        wall, cpu = timer.median(name)
        flops = model.flops_per_token(S) if model is dense else fpt
        line = (f"{name:14s} {total:13,d} {active:11,d} {wall * 1e3:10.1f} {B * S / wall:10,.0f} "
                f"{mfu(flops, B * S / wall, timer.peak):6.1%}")
        print(line + ("" if setup.cuda else f" {B * S / cpu:13,.0f}"))
    for other, target in (("HF Qwen2-MoE", 1.3), ("lmlab dense", 0.9)):
        print_ratio(timer, "lmlab MoE", other, not setup.cuda, f"; CPU target >= {target}x")
    print(f"reference matmul ({args.matmul}^3, {str(setup.dtype).replace('torch.', '')}): "
          f"{timer.peak / 1e12:.3f} TFLOP/s")


def main() -> None:
    args = parse()
    setup = Setup(args)
    for part in args.parts:
        {"split": part_split, "dense": part_dense, "hf": part_hf, "model": part_model}[part](args, setup)


if __name__ == "__main__":
    main()
