"""Mixture-of-experts feed-forward: router, stacked experts, balancing and load statistics.

    x ─┬─ router: fp32 logits ─ scores ─ top-K experts and gate weights ─┐
       │                                                                 ▼
       ├─ sort assignments by expert ─ grouped FFN ─ × gate ─ scatter-add ─(+)─▶
       └─ shared experts, always applied ────────────────────────────────────┘

Papers: sparsely-gated MoE (Shazeer et al. 2017, arXiv:1701.06538); GShard (Lepikhin et al.
2021, arXiv:2006.16668); Switch (Fedus et al. 2022, arXiv:2101.03961); ST-MoE z-loss (Zoph et
al. 2022, arXiv:2202.08906); DeepSeekMoE (Dai et al. 2024, arXiv:2401.06066); DeepSeek-V2
(arXiv:2405.04434) and V3 (arXiv:2412.19437); loss-free balancing (Wang et al. 2024,
arXiv:2408.15664).

The configuration, :class:`~lmlab.config.MoEConfig`, and the mixture-of-experts presets live in
``config.py`` beside the other configs.

Shape suffixes (torchtitan style) used for every tensor below:
    B batch, S sequence, D d_model
    T tokens, flattened B*S
    E routed experts, K experts chosen per token, G expert groups (devices)
    F expert hidden width; I rows of an expert's input projection (2F for GLU, F for MLP)
    A rows the experts compute, grouped by expert: the T*K assignments when dropless; E*C slots,
      C per expert, when capacity-limited
    C capacity: rows per expert

Nothing in the layer's forward waits for the device: every shape is known from T, K, E and C
(dropless groups are ragged, but their sizes stay on the device and go to the grouped matmul,
``grouped_mm.py``, as offsets), so the layer runs under ``torch.compile`` as one graph and never
stalls a CUDA stream.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, MoEConfig
from .feedforward import ACTIVATION_GRADS, ACTIVATIONS, SWIGLU_LIMIT, FeedForwardArgs, feedforward_args, gated_unit
from .gradient_pool import GradientPool
from .grouped_mm import grouped_matmul, grouped_matmul_split, grouped_mm
from .init import Init, init_module
from .schema import check_choice


# ============================================================== router
@dataclasses.dataclass
class Routing:
    """The router's decision for T tokens."""

    logits_TE: torch.Tensor  # fp32 x·centroids
    probs_TE: torch.Tensor  # affinities as a distribution over experts (softmax, or sigmoid / sum)
    expert_TK: torch.Tensor  # chosen experts, best first
    weight_TK: torch.Tensor  # gate weights of the chosen experts
    send_TK: torch.Tensor  # bool: dispatched (False only for GShard's randomly skipped second expert)
    chosen_E: torch.Tensor  # how many tokens chose each expert (all K choices)


def softmax_scores(logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    probs_TE = logits_TE.softmax(dim=-1)
    return probs_TE, probs_TE


def sigmoid_scores(logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scores_TE = logits_TE.sigmoid()
    return scores_TE, scores_TE / scores_TE.sum(dim=-1, keepdim=True)


def sqrtsoftplus_scores(logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sqrt(softplus(logit)): DeepSeek-V4's affinities (transformers' ``sqrtsoftplus``), positive as sigmoid's, not
    bounded by 1."""
    scores_TE = F.softplus(logits_TE).sqrt()
    return scores_TE, scores_TE / scores_TE.sum(dim=-1, keepdim=True)


SCORINGS = {"softmax": softmax_scores, "sigmoid": sigmoid_scores, "sqrtsoftplus": sqrtsoftplus_scores}

GROUP_SCORES = {
    "max": lambda s_TGe: s_TGe.amax(dim=-1),  # DeepSeek-V2
    "top2": lambda s_TGe: s_TGe.topk(2, dim=-1).values.sum(dim=-1),  # DeepSeek-V3
}


class Router(nn.Module):
    """Scores every expert by x·centroid in fp32 and picks K of them per token.

    The selection bias (DeepSeek-V3's e_score_correction_bias) shifts which experts are chosen,
    never the gate weights; it is zero unless loss-free balancing updates it or a checkpoint sets it.
    ``moe.router_bias`` adds a learned bias to the logits themselves (gpt-oss), which shifts both.
    """

    def __init__(self, moe: MoEConfig, d_model: int):
        super().__init__()
        E = moe.routed_experts
        self.n_experts, self.top_k = E, moe.active_experts
        self.weight = nn.Parameter(torch.empty(E, d_model))  # one centroid per expert
        self.bias = nn.Parameter(torch.zeros(E)) if moe.router_bias else None  # on the logits (gpt-oss)
        self.register_buffer("score_bias", torch.zeros(E))
        self.score = SCORINGS[moe.scoring]
        self.routed_scale = moe.routed_scale
        self.select = self.select_in_groups if moe.group_limited else self.select_top_k
        self.n_groups, self.topk_groups = moe.n_groups, moe.topk_groups
        self.group_score = GROUP_SCORES[moe.group_score]
        self.normalize = normalize_weights if moe.normalize_top_k else (lambda w_TK: w_TK)
        self.send = self.send_second_at_random if moe.second_expert == "random" else self.send_all

    def init_params(self, init: Init) -> None:
        """Centroids ~ N(0, std), never Xavier (DeepNorm scales the experts, not the router);
        the logits' bias and the selection bias 0."""
        init.normal(self.weight, init.std)
        init.zeros(self.bias, self.score_bias)

    def forward(self, x_TD: torch.Tensor) -> Routing:
        with torch.autocast(device_type=x_TD.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            logits_TE = F.linear(x_TD.float(), self.weight.float(), bias)  # fp32 even under autocast
        scores_TE, probs_TE = self.score(logits_TE)
        expert_TK = self.select(scores_TE.detach() + self.score_bias)  # the bias picks, it does not weigh
        weight_TK = self.normalize(scores_TE.gather(1, expert_TK)) * self.routed_scale
        chosen_E = count_per_expert(expert_TK, self.n_experts)
        return Routing(logits_TE, probs_TE, expert_TK, weight_TK, self.send(weight_TK), chosen_E)

    def select_top_k(self, choice_TE: torch.Tensor) -> torch.Tensor:
        return choice_TE.topk(self.top_k, dim=-1).indices  # (T, K), best first

    def select_in_groups(self, choice_TE: torch.Tensor) -> torch.Tensor:
        """Group-limited routing: only experts in the topk_groups best groups compete."""
        T, E = choice_TE.shape
        G = self.n_groups
        group_TG = self.group_score(choice_TE.view(T, G, E // G))
        best_TJ = group_TG.topk(self.topk_groups, dim=-1).indices
        keep_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(1, best_TJ, True)
        keep_TE = keep_TG.repeat_interleave(E // G, dim=1)
        return self.select_top_k(choice_TE.masked_fill(~keep_TE, float("-inf")))

    def send_all(self, weight_TK: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(weight_TK, dtype=torch.bool)

    def send_second_at_random(self, weight_TK: torch.Tensor) -> torch.Tensor:
        """GShard Algorithm 1: the second expert gets the token with probability min(1, 2 g2),
        g2 its share of the two gates. Only while training; evaluation sends both."""
        send_TK = self.send_all(weight_TK)
        if self.training:
            share_T = weight_TK[:, 1] / weight_TK.sum(dim=-1)
            send_TK[:, 1] = torch.rand_like(share_T) < 2 * share_T
        return send_TK


class HashRouter(nn.Module):
    """Hash routing (DeepSeek-V4 sec. 2.1; transformers' ``DeepseekV4HashRouter``), for the first ``moe.hash_layers``
    layers: token id t goes to the K experts a fixed table names, ``table[t]`` (V, K), a buffer (``tid2eid``)
    saved and loaded with the weights; the learned centroids still weigh them, as the top-k router's chosen scores
    are weighed (normalized where ``moe.normalize_top_k``, times ``moe.routed_scale``). No selection bias: nothing
    is chosen by score. The model hands it each forward's token ids (``tokens``, T) before its blocks run."""

    def __init__(self, moe: MoEConfig, d_model: int, vocab_size: int):
        super().__init__()
        E = moe.routed_experts
        self.n_experts, self.top_k = E, moe.active_experts
        self.weight = nn.Parameter(torch.empty(E, d_model))  # one centroid per expert
        self.register_buffer("table", torch.zeros(vocab_size, self.top_k, dtype=torch.long))  # token id -> experts
        self.score = SCORINGS[moe.scoring]
        self.routed_scale = moe.routed_scale
        self.normalize = normalize_weights if moe.normalize_top_k else (lambda w_TK: w_TK)
        self.tokens: torch.Tensor | None = None  # (T,) the ids of the tokens routed next

    def init_params(self, init: Init) -> None:
        """Centroids ~ N(0, std); each token id's K experts distinct and drawn uniformly from the init generator (a
        random hash; a checkpoint brings its own table)."""
        init.normal(self.weight, init.std)
        if not self.table.is_meta:
            V, E = self.table.shape[0], self.n_experts
            self.table.copy_(torch.rand(V, E, generator=init.generator).argsort(dim=-1)[:, : self.top_k])

    def forward(self, x_TD: torch.Tensor) -> Routing:
        if self.tokens is None or self.tokens.numel() != x_TD.shape[0]:
            raise ValueError("a hash-routed MoE layer routes by token id and was given none for these tokens; run it "
                             "inside the model (Transformer.forward hands it the ids)")
        with torch.autocast(device_type=x_TD.device.type, enabled=False):
            logits_TE = F.linear(x_TD.float(), self.weight.float())  # fp32 even under autocast
        scores_TE, probs_TE = self.score(logits_TE)
        expert_TK = self.table[self.tokens.reshape(-1)]  # (T, K): the table's experts, whatever the scores
        weight_TK = self.normalize(scores_TE.gather(1, expert_TK)) * self.routed_scale
        send_TK = torch.ones_like(expert_TK, dtype=torch.bool)
        return Routing(logits_TE, probs_TE, expert_TK, weight_TK, send_TK, count_per_expert(expert_TK, self.n_experts))


def count_per_expert(expert_X: torch.Tensor, n: int) -> torch.Tensor:
    """How many entries of ``expert_X`` (any shape, values in [0, n)) name each of the n experts.
    ``torch.bincount`` would do, but its output size depends on the data, which breaks a compiled graph."""
    expert_N = expert_X.flatten()
    return expert_N.new_zeros(n).index_add_(0, expert_N, torch.ones_like(expert_N))


def normalize_weights(weight_TK: torch.Tensor) -> torch.Tensor:
    return weight_TK / (weight_TK.sum(dim=-1, keepdim=True) + 1e-20)  # DeepSeek-V3's epsilon


def router_entropy(probs_TE: torch.Tensor) -> torch.Tensor:
    """The entropy of each token's distribution over experts (nats), averaged over tokens: ln(E) when uniform."""
    with torch.no_grad():
        return -(probs_TE * probs_TE.clamp_min(1e-20).log()).sum(dim=-1).mean()


# ============================================================== balancing losses
class UnbalancedExperts(UserWarning):
    """A mixture of experts trains with every balancing term off (an explicit choice, see ``MoEConfig``): experts
    may go unused. ``Transformer`` warns once, at its first training forward; ``lmlab train`` says it in its
    first lines instead."""


def balancing_line(moe: MoEConfig) -> str:
    """How a mixture of experts is balanced, in one line, saying so loudly when it is not (the text of
    :class:`UnbalancedExperts`, and of a run's first lines)."""
    experts = f"moe: {moe.routed_experts} experts, top {moe.active_experts}; balancing: "
    if moe.balancing:
        return experts + ", ".join(moe.balancing)
    return experts + ("OFF (every balancing coefficient and moe.bias_update_rate set to 0): experts may go unused; "
                      "leave moe.expert_balance_coef unset to balance")


# Each takes the routing and returns an unweighted scalar; with uniform router probabilities every
# balance loss equals 1 whatever the assignment, and the z-loss equals ln(E)^2.
def load_balance_loss(r: Routing) -> torch.Tensor:
    """Switch eq. 4, GShard: E * sum_e f_e P_e, f_e = share of tokens whose first choice is e."""
    T, E = r.probs_TE.shape
    first_E = count_per_expert(r.expert_TK[:, 0], E).float() / T
    return E * (first_E * r.probs_TE.mean(dim=0)).sum()


def z_loss(r: Routing) -> torch.Tensor:
    """ST-MoE eq. 5: keeps router logits small."""
    return torch.logsumexp(r.logits_TE, dim=-1).square().mean()


def _expert_fractions(r: Routing) -> torch.Tensor:
    T, E = r.probs_TE.shape
    K = r.expert_TK.shape[1]
    return r.chosen_E.float() * E / (K * T)  # f_e = E/(K T) * count_e, 1 when balanced


def expert_balance_loss(r: Routing) -> torch.Tensor:
    """DeepSeekMoE eq. 12-14: sum_e f_e P_e over all K choices."""
    return (_expert_fractions(r) * r.probs_TE.mean(dim=0)).sum()


def device_balance_loss(r: Routing, n_groups: int) -> torch.Tensor:
    """DeepSeekMoE eq. 15-17: sum_d f'_d P'_d, f'_d the mean f_e and P'_d the summed P_e of device d."""
    f_G = _expert_fractions(r).view(n_groups, -1).mean(dim=1)
    p_G = r.probs_TE.mean(dim=0).view(n_groups, -1).sum(dim=1)
    return (f_G * p_G).sum()


# ============================================================== experts
class Experts(nn.Module):
    """n FFNs stored as stacked tensors, in nn.Linear's (out, in) layout per expert:
    ``gate_up`` (n, 2F, D) = [gate; up] rows for GLU, or ``up`` (n, F, D) for MLP; ``down`` (n, D, F).

    ``forward(x_AD, offs_E, scale_A)`` applies expert e to its group of rows (rows grouped by
    expert, group e ending at offs_E[e]) and scales each row's output: the whole routed compute,
    with no knowledge of tokens. Expert parallelism can wrap this module (send the groups to
    the devices that hold their experts, call it there, send the results back)."""

    def __init__(self, n: int, d_model: int, width: int, ffn: str, activation: str, bias: bool,
                 glu_variant: str = "plain", glu_limit: float = SWIGLU_LIMIT):
        super().__init__()
        self.n, self.width = n, width
        self.in_name = "gate_up" if ffn == "glu" else "up"
        rows = 2 * width if ffn == "glu" else width
        self.register_parameter(self.in_name, nn.Parameter(torch.empty(n, rows, d_model)))
        self.down = nn.Parameter(torch.empty(n, d_model, width))
        self.in_bias = nn.Parameter(torch.zeros(n, rows)) if bias else None
        self.down_bias = nn.Parameter(torch.zeros(n, d_model)) if bias else None
        self.activation = activation
        self.glu = gated_unit(glu_variant, glu_limit)  # ModelConfig.glu_variant and its clamp
        self.hidden = self.glu_hidden if ffn == "glu" else ACTIVATIONS[activation]
        self.weighted_down = self.gate_then_down if self.down_bias is None else self.down_then_gate
        # the CPU path (RoutedExperts) covers experts without biases whose activation has a written-out gradient
        self.fused = bias is False and glu_variant == "plain" and activation in ACTIVATION_GRADS
        self.hidden_first = hidden_units_first(width)
        self.grad_pool = GradientPool()  # the CPU path's weight gradients of 32 MiB or more, reused (gradient_pool.py)

    @property
    def w_in_EID(self) -> torch.Tensor:
        return getattr(self, self.in_name)

    def glu_hidden(self, z_NI: torch.Tensor) -> torch.Tensor:
        return self.glu(z_NI, self.activation)

    def init_params(self, init: Init) -> None:
        """Each expert as a dense FFN: input projections ~ N(0, std); down projections, which write
        into the residual stream, ~ N(0, out_std); biases 0. DeepNorm: Xavier-normal with gain β for
        each expert's matrices, [gate; up] as two (Wang et al. 2022)."""
        rows = (self.width, self.width) if self.in_name == "gate_up" else None
        init.weight(self.w_in_EID, init.std, deepnorm_gain=init.beta, rows=rows)
        init.weight(self.down, init.out_std, deepnorm_gain=init.beta)
        init.zeros(self.in_bias, self.down_bias)

    def params_per_expert(self) -> int:
        return sum(p[0].numel() for p in self.parameters())

    def one(self, x_ND: torch.Tensor, e: int) -> torch.Tensor:
        """Expert e applied to some rows: the plain definition, used by the reference path."""
        b_in = None if self.in_bias is None else self.in_bias[e]
        b_down = None if self.down_bias is None else self.down_bias[e]
        h_NF = self.hidden(F.linear(x_ND, self.w_in_EID[e], b_in))
        return F.linear(h_NF, self.down[e], b_down)

    # ---- the two implementations (MoE.set_impl): same arguments, same result
    def loop(self, x_TD: torch.Tensor, a: Assignment, out_TD: torch.Tensor) -> torch.Tensor:
        """Reference: for each expert, gather its kept assignments' tokens, apply it, add the gated
        result back. Boolean indexing waits for the device; this path is for reading and testing."""
        for e in range(self.n):
            mine_A = (a.expert_A == e) & a.keep_A
            token_N = a.token_A[mine_A]
            y_ND = self.one(x_TD[token_N], e) * a.weight_A[mine_A, None]
            out_TD = out_TD.index_add(0, token_N, y_ND.to(out_TD.dtype))
        return out_TD

    def grouped(self, x_TD: torch.Tensor, a: Assignment, out_TD: torch.Tensor) -> torch.Tensor:
        """Fast path: rows grouped by expert (``plan``), two grouped matmuls, one sum per token. On the
        CPU, one autograd Function from tokens to tokens (:class:`RoutedExperts`); elsewhere, and under
        torch.compile, ``dispatch``, :meth:`forward` and ``combine`` (the portable path): the same sums."""
        p = plan(a)
        if self.fused and self.fused_path_fits(x_TD):
            return RoutedExperts.apply(x_TD, self.w_in_EID, self.down, p.weight_A, out_TD, p, self.activation,
                                       self.in_name == "gate_up", self.hidden_first, self.grad_pool)
        y_AD = self(dispatch(x_TD, p), p.offs_E, p.weight_A)
        return combine(y_AD, p, out_TD)

    def fused_path_fits(self, x_TD: torch.Tensor) -> bool:
        """Can this call take :class:`RoutedExperts`? A CPU tensor in the weights' dtype, no autocast (the
        portable path casts for it) and no compiler (which traces the portable path); the experts' kind is
        checked once, in ``__init__``."""
        return (x_TD.device.type == "cpu" and x_TD.dtype == self.down.dtype and not torch.is_autocast_enabled("cpu")
                and not torch.compiler.is_compiling())

    def forward(self, x_AD: torch.Tensor, offs_E: torch.Tensor, scale_A: torch.Tensor) -> torch.Tensor:
        """Rows grouped by expert -> scale_A * expert(row), two grouped matmuls over the groups."""
        z_AI = grouped_mm(x_AD, self.w_in_EID, offs_E)
        if self.in_bias is not None:
            z_AI = z_AI + self.in_bias[expert_of_rows(offs_E, x_AD.shape[0])]
        return self.weighted_down(self.hidden(z_AI), offs_E, scale_A)

    def gate_then_down(self, h_AF, offs_E, scale_A) -> torch.Tensor:
        """w * down(h) = down(w * h) without a bias; F < D, so weighting h is the cheaper side."""
        return grouped_mm(h_AF * scale_A[:, None].to(h_AF.dtype), self.down, offs_E)

    def down_then_gate(self, h_AF, offs_E, scale_A) -> torch.Tensor:
        y_AD = grouped_mm(h_AF, self.down, offs_E) + self.down_bias[expert_of_rows(offs_E, h_AF.shape[0])]
        return y_AD * scale_A[:, None]


def expert_of_rows(offs_E: torch.Tensor, n_rows: int) -> torch.Tensor:
    """(A,) expert of each row from the group ends; rows past the last group get expert E - 1."""
    rows_A = torch.arange(n_rows, device=offs_E.device, dtype=offs_E.dtype)
    return torch.searchsorted(offs_E, rows_A, right=True).clamp_(max=offs_E.shape[0] - 1)


# ============================================================== routing plans
@dataclasses.dataclass
class Assignment:
    """Every token-expert choice, in routing order (choice-major: every token's first choice,
    then every second choice, ...), with the gate weight and whether it is computed."""

    token_A: torch.Tensor  # (K*T,)
    expert_A: torch.Tensor  # (K*T,)
    weight_A: torch.Tensor  # (K*T,) gate weight; 0 where not kept
    keep_A: torch.Tensor  # (K*T,) bool: sent, and within its expert's capacity
    sent_E: torch.Tensor  # (E,) assignments sent to each expert, before capacity
    kept: torch.Tensor  # () how many are kept
    capacity: int | None = None  # C, rows per expert; None when dropless
    slot_A: torch.Tensor | None = None  # (K*T,) slot expert * C + place in its queue if kept, else E * C


@dataclasses.dataclass
class Plan:
    """The rows the experts compute, grouped by expert: which token each row reads and is added
    back to, its gate weight, where each expert's group ends, and the way back: the row of each
    assignment."""

    token_A: torch.Tensor  # (A,)
    weight_A: torch.Tensor  # (A,) 0 for padding rows
    offs_E: torch.Tensor  # (E,) int32 group ends
    row_KT: torch.Tensor  # (K*T,) the row computing each assignment (routing order); A if it is dropped
    padded: bool  # may row_KT hold A (capacity), or is it a permutation of the rows (dropless)?


def plan(a: Assignment) -> Plan:
    """The rows the experts compute for ``a``: every assignment when dropless, C slots per expert
    when capacity-limited."""
    return sorted_plan(a) if a.slot_A is None else capacity_plan(a)


def sorted_plan(a: Assignment) -> Plan:
    """Dropless: all T*K assignments, stably sorted by expert; ragged groups of sizes sent_E."""
    order_A = torch.sort(a.expert_A, stable=True).indices
    offs_E = a.sent_E.cumsum(0).to(torch.int32)
    row_KT = torch.empty_like(order_A).scatter_(0, order_A, torch.arange(order_A.numel(), device=order_A.device))
    return Plan(a.token_A.index_select(0, order_A), a.weight_A.index_select(0, order_A), offs_E, row_KT, padded=False)


def capacity_plan(a: Assignment) -> Plan:
    """Capacity-limited: C slots per expert, filled by the kept assignments (``slot_A``). Empty
    slots read token 0 with weight 0, so they add exactly nothing (GShard's dispatch tensor, as an
    index). E*C rows, whatever the routing."""
    E, C = a.sent_E.shape[0], a.capacity
    trash = E * C  # dropped assignments all land here, and it is cut off
    token_S = a.token_A.new_zeros(E * C + 1).scatter_(0, a.slot_A, a.token_A)[:trash]
    weight_S = a.weight_A.new_zeros(E * C + 1).scatter(0, a.slot_A, a.weight_A)[:trash]
    offs_E = torch.arange(1, E + 1, device=token_S.device, dtype=torch.int32) * C
    return Plan(token_S, weight_S, offs_E, a.slot_A, padded=True)


def sum_per_token(y_AD: torch.Tensor, plan: Plan, T: int) -> torch.Tensor:
    """(T, D): the sum of each token's K rows of y_AD (dropped assignments add nothing), as one
    ``embedding_bag``, a bag of K rows per token: a single pass, ten times faster on CPU than a
    gather of the (K*T, D) rows and a sum over K, and than autograd's scatter-add. With no tokens
    (an expert-parallel rank that received no rows) K cannot be read from the plan: (0, D)."""
    if T == 0:
        return y_AD.new_zeros(0, y_AD.shape[1])
    row_TK = plan.row_KT.view(-1, T).t()
    if not plan.padded:
        return F.embedding_bag(row_TK, y_AD, mode="sum")
    kept_TK = row_TK < y_AD.shape[0]  # dropped assignments point past the last row
    return F.embedding_bag(torch.where(kept_TK, row_TK, 0), y_AD, mode="sum", per_sample_weights=kept_TK.to(y_AD.dtype))


class Dispatch(torch.autograd.Function):
    """x_TD (T, D) -> x_AD (A, D), rows = tokens in the plan's order. Its backward sums each
    token's K gradient rows (:func:`sum_per_token`): autograd's backward of the gather is a
    scatter-add (index_add), which on CPU runs element by element over (A, D)."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, plan: Plan) -> torch.Tensor:
        ctx.plan, ctx.T = plan, x_TD.shape[0]
        return x_TD.index_select(0, plan.token_A)

    @staticmethod
    def backward(ctx, g_AD: torch.Tensor):
        return sum_per_token(g_AD, ctx.plan, ctx.T), None


class Combine(torch.autograd.Function):
    """out_TD + the sum of each token's K expert rows of y_AD -> (T, D) (:func:`sum_per_token`, not
    a scatter-add); its backward is a gather."""

    @staticmethod
    def forward(ctx, y_AD: torch.Tensor, out_TD: torch.Tensor, plan: Plan) -> torch.Tensor:
        ctx.plan = plan
        return sum_per_token(y_AD, plan, out_TD.shape[0]).add_(out_TD)

    @staticmethod
    def backward(ctx, g_TD: torch.Tensor):
        return g_TD.index_select(0, ctx.plan.token_A), g_TD, None


def dispatch(x_TD: torch.Tensor, plan: Plan) -> torch.Tensor:
    """Token rows in the plan's order: x_AD (A, D), row r = x_TD[plan.token_A[r]]."""
    return Dispatch.apply(x_TD, plan)


def combine(y_AD: torch.Tensor, plan: Plan, out_TD: torch.Tensor) -> torch.Tensor:
    """out_TD (T, D) plus each row's (already weighted) output added back to its token."""
    return Combine.apply(y_AD.to(out_TD.dtype), out_TD, plan)


# ============================================================== the routed experts on the CPU
# On the CPU, Experts.grouped runs dispatch, Experts.forward and combine as one autograd Function, token
# rows in, token rows out (the same sums; Experts.loop is the readable reference of both, and
# tests/test_moe.py checks all three equal, outputs and gradients):
#
#     x_TD ─ gather ─ x_AD ─ up ─ z_IA ─ act(gate)·up ─ h_FA ─ × gate weight ─ s_FA ─ down ─ y_AD ─ sum per token ─(+)─▶
#                                                                                                    out_TD (shared) ─┘
#
# What it saves, measured at the MoE experiment's shape (64 experts of width F = 24, top-8; docs/speed.md):
# - Narrow hidden rows. ATen's element-wise loops run each innermost row two vector registers at a time
#   (2 x 16 floats with AVX-512) and the rest of the row scalar: a row of F = 24 hidden units is all rest,
#   so the activation, the product with up and their backward, on the halves of (A, 2F) rows, ran 3-6x
#   slower per element than on contiguous memory. With ``hidden_first`` the hidden activations are held
#   unit by unit, (I, A), rows of A elements: the grouped matmul writes them so directly
#   (w (E, I, D) x x^T (D, A), one kernel call), and the matmuls that read them take transposed views.
#   Wide experts keep rows first, whose matmuls run faster.
# - One backward, written out: the gate weights' gradient is one reduction over the hidden units, the gate
#   weight is applied to the gradient in place, the activation's gradient lands in the halves of one tensor,
#   and the routing plan (the sort by expert, the group ends, each assignment's row), computed once per
#   step, serves the forward and the backward; autograd's graph of the portable path has a dozen nodes.
# _IA and _FA tensors are hidden activations indexed (hidden unit, row): contiguous when hidden-first,
# else the transposed view of an (A, I) tensor. Element-wise ops keep their input's layout, so the same
# code serves both.
def hidden_units_first(width: int) -> bool:
    """Does the CPU path hold this expert width's hidden activations unit by unit, (F, A)? When a row of F
    floats leaves a remainder that ATen's element-wise loops (32 floats a turn with AVX-512) run scalar, and
    F is narrow enough that the transposed matmuls' extra cost is smaller: per layer step, hidden-first is
    1.13x rows-first at F = 24 (the MoE experiment), about equal at 32 and 64, 0.96x at 128."""
    return width < 128 and width % 32 != 0


def up_projection(x_AD: torch.Tensor, w_in_EID: torch.Tensor, offs_E: torch.Tensor,
                  hidden_first: bool) -> torch.Tensor:
    """z_IA: each row's expert's input projection, stored (I, A) when ``hidden_first``, else as (A, I)."""
    if hidden_first:
        return grouped_matmul(w_in_EID, x_AD.t(), offs_E)
    return grouped_matmul(x_AD, w_in_EID.transpose(1, 2), offs_E).t()


def down_input_grad(g_AD: torch.Tensor, w_down_EDF: torch.Tensor, offs_E: torch.Tensor,
                    hidden_first: bool) -> torch.Tensor:
    """g_s_FA: the gradient reaching the down projection's input, in the forward's layout."""
    if hidden_first:
        return grouped_matmul(w_down_EDF.transpose(1, 2), g_AD.t(), offs_E)
    return grouped_matmul(g_AD, w_down_EDF, offs_E).t()


def expert_hidden(z_IA: torch.Tensor, activation: str, gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(h_FA, act_FA): act(gate) * up and act(gate) for GLU experts (z = [gate; up]), act(z) twice for MLP ones."""
    if not gated:
        h_FA = ACTIVATIONS[activation](z_IA)
        return h_FA, h_FA
    n = z_IA.shape[0] // 2
    act_FA = ACTIVATIONS[activation](z_IA[:n])
    return act_FA * z_IA[n:], act_FA


def expert_hidden_grad(g_h_FA: torch.Tensor, z_IA: torch.Tensor, act_FA: torch.Tensor, activation: str,
                       gated: bool) -> torch.Tensor:
    """g_z_IA in z's layout; for GLU experts the gate's and up's gradients land in its two halves."""
    g_z_IA = torch.empty_like(z_IA)
    if not gated:
        return ACTIVATION_GRADS[activation](g_h_FA, z_IA, g_z_IA)
    n = z_IA.shape[0] // 2
    g_gate_FA, g_up_FA = g_z_IA[:n], g_z_IA[n:]
    torch.mul(g_h_FA, act_FA, out=g_up_FA)
    torch.mul(g_h_FA, z_IA[n:], out=g_gate_FA)
    ACTIVATION_GRADS[activation](g_gate_FA, z_IA[:n], g_gate_FA)
    return g_z_IA


def weight_grad(a_OA: torch.Tensor, b_AI: torch.Tensor, offs_E: torch.Tensor, w_EOI: torch.Tensor,
                pool: GradientPool) -> torch.Tensor:
    """d loss / d w_EOI: a_OA x b_AI with the groups splitting A; written into a buffer of ``pool`` where it serves
    ``w_EOI`` (32 MiB or more: malloc would map, and page-fault in, a fresh one every step), else by torch's kernel."""
    out_EOI = pool.take(w_EOI)
    return grouped_matmul(a_OA, b_AI, offs_E) if out_EOI is None else grouped_matmul_split(a_OA, b_AI, offs_E, out_EOI)


class RoutedExperts(torch.autograd.Function):
    """out_TD + the sum over each token's rows of weight_A * expert(x_TD[token]) -> (T, D), for a plan's rows."""

    @staticmethod
    def forward(ctx, x_TD, w_in_EID, w_down_EDF, weight_A, out_TD, plan, activation, gated, hidden_first, pool):
        x_AD = x_TD.index_select(0, plan.token_A)
        z_IA = up_projection(x_AD, w_in_EID, plan.offs_E, hidden_first)
        h_FA, act_FA = expert_hidden(z_IA, activation, gated)
        # the gate weight (fp32, from the router) scales the hidden units: F < D, the cheaper side of down
        s_FA = h_FA * weight_A.to(h_FA.dtype)
        y_AD = grouped_matmul(s_FA.t(), w_down_EDF.transpose(1, 2), plan.offs_E)
        ctx.save_for_backward(x_AD, z_IA, act_FA, h_FA, s_FA, w_in_EID, w_down_EDF, weight_A)
        ctx.plan, ctx.T, ctx.how, ctx.pool = plan, x_TD.shape[0], (activation, gated, hidden_first), pool
        return sum_per_token(y_AD, plan, x_TD.shape[0]).add_(out_TD)

    @staticmethod
    def backward(ctx, g_TD):
        x_AD, z_IA, act_FA, h_FA, s_FA, w_in_EID, w_down_EDF, weight_A = ctx.saved_tensors
        p, (activation, gated, hidden_first) = ctx.plan, ctx.how
        g_AD = g_TD.index_select(0, p.token_A)  # the sum per token's backward: a gather
        g_s_FA = down_input_grad(g_AD, w_down_EDF, p.offs_E, hidden_first)
        needs = ctx.needs_input_grad  # frozen experts or inputs skip their matmuls
        g_w_down = weight_grad(g_AD.t(), s_FA.t(), p.offs_E, w_down_EDF, ctx.pool) if needs[2] else None
        g_weight_A = (g_s_FA * h_FA).sum(0).to(weight_A.dtype)
        g_z_IA = expert_hidden_grad(g_s_FA.mul_(weight_A.to(g_s_FA.dtype)), z_IA, act_FA, activation, gated)
        g_w_in = weight_grad(g_z_IA, x_AD, p.offs_E, w_in_EID, ctx.pool) if needs[1] else None
        g_x_TD = sum_per_token(grouped_matmul(g_z_IA.t(), w_in_EID, p.offs_E), p, ctx.T) if needs[0] else None
        return g_x_TD, g_w_in, g_w_down, g_weight_A, g_TD, None, None, None, None, None


# ============================================================== shared experts
class SharedExperts(Experts):
    """n_shared experts fused into one FFN of width n_shared * width, applied to every token; ``width``
    is ``MoEConfig.shared_width``: the routed F, or a checkpoint's own shared width."""

    def __init__(self, n_shared: int, d_model: int, width: int, ffn: str, activation: str, bias: bool,
                 glu_variant: str = "plain", glu_limit: float = SWIGLU_LIMIT):
        super().__init__(1, d_model, n_shared * width, ffn, activation, bias, glu_variant, glu_limit)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        """:meth:`Experts.one` of the one fused expert, reading its weights through views (the backward of
        ``w[0]`` would build each gradient in a zero-filled copy)."""
        b_in = None if self.in_bias is None else self.in_bias.view(-1)
        b_down = None if self.down_bias is None else self.down_bias.view(-1)
        h_NF = self.hidden(F.linear(x_TD, self.w_in_EID.view(self.w_in_EID.shape[1:]), b_in))
        return F.linear(h_NF, self.down.view(self.down.shape[1:]), b_down)


class GatedSharedExperts(SharedExperts):
    """Qwen2-MoE: the shared output is scaled per token by sigmoid(x·g)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.output_gate = nn.Parameter(torch.empty(1, args[1]))  # (1, D)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x_TD, self.output_gate)) * super().forward(x_TD)

    def init_params(self, init: Init) -> None:
        """The shared experts as :meth:`Experts.init_params`; the gate ~ N(0, std), never Xavier."""
        super().init_params(init)
        init.normal(self.output_gate, init.std)


class NoSharedExperts(nn.Module):
    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x_TD)


# the two implementations, by Experts method name: a module that stands in for Experts (expert
# parallelism, lmlab.run.parallel.plan.ShardedExperts) provides both, and MoE.routed_experts calls the one chosen
IMPLS = {"reference": "loop", "fast": "grouped"}


# ============================================================== the layer
@dataclasses.dataclass(frozen=True)
class MoEArgs:
    """An MoE layer's own config, resolved from the model's by :func:`moe_args`: its section, the kind of
    feed-forward each expert is, and the dense feed-forward's sizes, activation and bias (the experts' widths
    come from the section: ``MoEConfig.expert_width``)."""

    moe: MoEConfig
    unit: str  # "mlp" | "glu": what each expert computes (ModelConfig.ffn)
    ffn: FeedForwardArgs
    hash_vocab: int | None = None  # routed by a token-id table of this many ids (moe.hash_layers); None: top-k


def moe_args(cfg: ModelConfig, layer: int | None = None) -> MoEArgs:
    """What the MoE layer ``layer`` of ``cfg`` is built from (None: any learned-routing layer), and nothing else of
    the model config."""
    hashed = layer is not None and cfg.moe.hashes(layer)
    return MoEArgs(moe=cfg.moe, unit=cfg.ffn, ffn=feedforward_args(cfg), hash_vocab=cfg.vocab_size if hashed else None)


class MoE(nn.Module):
    """The mixture-of-experts feed-forward sublayer: ``forward(x (B, S, D)) -> (B, S, D)``.

        route ─ assign (capacity) ─ plan: rows grouped by expert ─ dispatch ─ experts ─ combine

    After each forward: ``aux_losses`` (each enabled balancing loss times its coefficient),
    ``aux_loss`` (their sum) and ``stats`` (load statistics, ready to log). The model adds the
    auxiliary losses to its training loss. ``set_impl`` switches between the grouped-matmul fast
    path (``dispatch``, ``self.experts``, ``combine``) and the reference loop over experts.
    """

    def __init__(self, args: MoEArgs):
        super().__init__()
        moe, ffn = args.moe, args.ffn
        self.n_experts, self.top_k = moe.routed_experts, moe.active_experts
        unit = (args.unit, ffn.activation, ffn.bias, ffn.glu_variant, ffn.glu_limit)  # what every expert computes
        hashed = args.hash_vocab is not None
        self.router = HashRouter(moe, ffn.d_model, args.hash_vocab) if hashed else Router(moe, ffn.d_model)
        self.experts = Experts(self.n_experts, ffn.d_model, moe.expert_width(ffn.d_ff), *unit)
        if moe.n_shared == 0:
            self.shared = NoSharedExperts()
        else:
            shared = GatedSharedExperts if moe.shared_gate == "sigmoid" else SharedExperts
            self.shared = shared(moe.n_shared, ffn.d_model, moe.shared_width(ffn.d_ff), *unit)
        self.capacity_factor = moe.capacity_factor
        limited = moe.capacity_factor is not None or moe.second_expert == "random"
        self.assign = self.assign_limited if limited else self.assign_all
        terms = {
            "load_balance": (moe.load_balance_coef, load_balance_loss),
            "z_loss": (moe.z_loss_coef, z_loss),
            "expert_balance": (moe.expert_balance_coef, expert_balance_loss),
            "device_balance": (moe.device_balance_coef, functools.partial(device_balance_loss, n_groups=moe.n_groups)),
        }
        self.loss_terms = {name: (coef, fn) for name, (coef, fn) in terms.items() if coef > 0}
        self.bias_update_rate = 0.0 if hashed else moe.bias_update_rate  # a hash layer chooses by its table
        self.register_buffer("load", torch.zeros(self.n_experts), persistent=False)  # sent since update_bias
        self.aux_losses: dict[str, torch.Tensor] = {}
        # (sent_E, kept, the router's probabilities, forwards) of the last forward, or summed (the probabilities
        # listed) over forwards while ``summing``; the entropy is computed when :attr:`stats` is read, not every step
        self._last: tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], int] | None = None
        self.summing = False  # see sum_stats (a training step's micro-batches)
        self.set_impl("fast")

    def set_impl(self, impl: str) -> None:
        check_choice("impl", impl, IMPLS)
        self.impl = impl

    def routed_experts(self, x_TD: torch.Tensor, a: Assignment, out_TD: torch.Tensor) -> torch.Tensor:
        """``out_TD`` plus each kept assignment's expert output times its gate weight, by ``impl``.

        The seam for expert parallelism: ``lmlab.run.parallel.plan`` replaces ``self.experts`` with a
        module holding this process's share of the experts, whose ``loop`` and ``grouped`` send
        each row to the process that holds its expert and bring the result back."""
        return getattr(self.experts, IMPLS[self.impl])(x_TD, a, out_TD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        x_TD = x.reshape(B * S, D)
        r = self.router(x_TD)
        a = self.assign(r)
        shared_TD = self.shared(x_TD).to(x.dtype)  # the sum is kept in x's dtype (fp32 under autocast)
        out_TD = self.routed_experts(x_TD, a, shared_TD)  # shared + routed
        self.aux_losses = {name: coef * fn(r) for name, (coef, fn) in self.loss_terms.items()}
        if self.training:
            self.load += a.sent_E
        sent_E, probs_TE = a.sent_E.detach(), r.probs_TE.detach()
        last = self._last if self.summing else None
        self._last = ((sent_E, a.kept, [probs_TE], 1) if last is None else
                      (last[0] + sent_E, last[1] + a.kept, last[2] + [probs_TE], last[3] + 1))
        return out_TD.view(B, S, D)

    # ---- which token goes to which expert, in routing order
    def assign_all(self, r: Routing) -> Assignment:
        """Dropless: every choice is computed."""
        T, K = r.expert_TK.shape
        token_A = torch.arange(T, device=r.expert_TK.device).repeat(K)  # choice-major: t0k0, t1k0, ...
        keep_A = torch.ones(T * K, dtype=torch.bool, device=token_A.device)
        kept = torch.full((), T * K, device=token_A.device)
        return Assignment(token_A, r.expert_TK.t().reshape(-1), r.weight_TK.t().reshape(-1), keep_A, r.chosen_E, kept)

    def assign_limited(self, r: Routing) -> Assignment:
        """Capacity (and GShard's random second expert): each expert takes at most C =
        ceil(capacity_factor * T * K / E) assignments, in routing order: every token's first choice,
        then every second choice, each in token order (GShard Algorithm 1; Switch sec. 2.1). An
        overflowing assignment contributes nothing; the residual carries the token on unchanged."""
        T, K = r.expert_TK.shape
        E = self.n_experts
        expert_A = r.expert_TK.t().reshape(-1)  # (K*T,) choice-major: the routing order
        send_A = r.send_TK.t().reshape(-1)
        queue_A = torch.where(send_A, expert_A, E)  # unsent ones queue at a phantom expert E
        sent_E = count_per_expert(queue_A, E + 1)[:E]
        capacity = math.ceil(self.capacity_factor * T * K / E) if self.capacity_factor else T * K
        position_A = queue_position(queue_A, E + 1)
        keep_A = send_A & (position_A < capacity)
        weight_A = torch.where(keep_A, r.weight_TK.t().reshape(-1), 0.0)
        token_A = torch.arange(T, device=expert_A.device).repeat(K)
        slot_A = torch.where(keep_A, expert_A * capacity + position_A, E * capacity)
        return Assignment(token_A, expert_A, weight_A, keep_A, sent_E, keep_A.sum(), capacity, slot_A)

    # ---- outputs read by the model
    @property
    def aux_loss(self) -> torch.Tensor:
        return sum(self.aux_losses.values(), torch.zeros((), device=self.router.weight.device))

    @property
    def stats(self) -> dict:
        """Load statistics of the last forward, or of every forward while summing (python numbers; converting
        syncs with the device once)."""
        if self._last is None:
            return {}
        sent_E, kept, probs, forwards = self._last
        entropy = sum(router_entropy(p_TE) for p_TE in probs) / forwards  # the mean over forwards of equal size
        load_E = sent_E.float()
        mean = load_E.mean().clamp_min(1e-9)
        total = float(load_E.sum())
        return {
            "tokens_per_expert": sent_E.tolist(),  # assignments sent to each expert, before capacity
            "dropped": 1.0 - float(kept) / total if total else 0.0,  # share of sent assignments over capacity
            "router_entropy": float(entropy),  # nats, mean over tokens; ln(E) is uniform
            "max_load": float(load_E.max() / mean),  # 1 is perfectly balanced
            "cv_load": float(load_E.std(unbiased=False) / mean),  # coefficient of variation
        }

    # ---- hooks used by the model
    def sum_stats(self, on: bool) -> None:
        """From now on, :attr:`stats` sums every forward (``on``, starting from none) or shows the last one."""
        if on:
            self._last = None
        self.summing = on

    @torch.no_grad()
    def update_bias(self, all_reduce: Callable[[torch.Tensor], object] | None = None) -> None:
        """DeepSeek-V3 loss-free balancing: bias_e += gamma * sign(mean load - load_e), from the
        load accumulated since the previous call. Called after each optimizer step; with several
        processes, ``all_reduce`` sums the load over them first so every rank's biases agree."""
        if all_reduce is not None:
            all_reduce(self.load)
        if self.bias_update_rate > 0:
            self.router.score_bias += self.bias_update_rate * torch.sign(self.load.mean() - self.load)
        self.load.zero_()

    def inactive_params(self) -> int:
        """Routed-expert parameters a token does not use."""
        return (self.n_experts - self.top_k) * self.experts.params_per_expert()

    def init_params(self, init: Init) -> None:
        """The router, the routed experts and the shared experts, each by its own hook; the load 0."""
        for part in (self.router, self.experts, self.shared):
            init_module(part, init)
        init.zeros(self.load)


def queue_position(queue_A: torch.Tensor, n_queues: int) -> torch.Tensor:
    """For each assignment, how many earlier assignments joined the same queue."""
    order_A = torch.argsort(queue_A, stable=True)
    count_Q = count_per_expert(queue_A, n_queues)
    start_Q = count_Q.cumsum(0) - count_Q
    position_A = torch.empty_like(queue_A)
    position_A[order_A] = torch.arange(queue_A.numel(), device=queue_A.device) - start_Q[queue_A[order_A]]
    return position_A
