"""Training-step throughput of lmlab's MoE against transformers' Qwen2-MoE and lmlab's dense model.

    python benchmarks/bench_moe.py [--steps 12] [--warmup 2] [--threads N] [--hf-experts grouped_mm]

One process, one run, three models on the same data:
  - lmlab MoE: d_model 256, 4 layers, 64 experts of width 128, top-6, 1 sigmoid-gated shared expert;
  - transformers Qwen2-MoE with the same configuration and the same weights (copied into lmlab
    with lmlab.hf; the script checks that both give the same logits before timing);
  - lmlab dense with the same active parameter count (d_ff chosen to match).
Each step is a full training step: forward, loss (cross-entropy plus a load-balancing loss on
both MoE sides: HF's router_aux_loss_coef, lmlab's expert_balance_coef), backward, AdamW, zero_grad.
Models take turns step by step, so load from other processes hits all of them alike; the median
over the timed steps is reported, as wall-clock tokens/s and as tokens per CPU-second.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import lmlab
from lmlab import ModelConfig, Transformer
from lmlab.hf import state_dict_from_hf

B, S, V = 8, 256, 256  # batch x tokens; byte-level vocabulary on every side
D, L, HEADS = 256, 4, 8
E, K, F_EXPERT, SHARED = 64, 6, 128, 1
AUX_COEF = 0.001  # HF Qwen2-MoE's default router_aux_loss_coef


def hf_qwen2_moe(experts_impl: str | None):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        intermediate_size=4 * D, moe_intermediate_size=F_EXPERT, shared_expert_intermediate_size=SHARED * F_EXPERT,
        num_experts=E, num_experts_per_tok=K, norm_topk_prob=False, qkv_bias=False, max_position_embeddings=S,
        output_router_logits=True, router_aux_loss_coef=AUX_COEF, tie_word_embeddings=False,
        **({"experts_implementation": experts_impl} if experts_impl else {}),
    )
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(cfg)
    if experts_impl:
        model.set_experts_implementation(experts_impl)
    return model


def lmlab_twin(hf_model) -> Transformer:
    """lmlab's config for the same architecture, with the HF weights."""
    cfg = lmlab.hf.config_from_hf(hf_model.config.to_dict())
    # HF's loss: coef * E * sum_e f_e P_e with f_e over all K choices and all layers at once; lmlab's
    # expert_balance is that divided by K, per layer, summed over layers
    cfg = cfg.override({"max_seq_len": S, "moe.expert_balance_coef": AUX_COEF * K / L})
    model = Transformer(cfg)
    model.load_state_dict(state_dict_from_hf(cfg, hf_model.state_dict(), "qwen2_moe"))
    return model


def dense_twin(active: int) -> Transformer:
    """lmlab's dense model with d_ff (a multiple of 8) giving the closest parameter count to ``active``."""
    base = dict(vocab_size=V, d_model=D, n_layers=L, n_heads=HEADS, max_seq_len=S, ffn="glu", activation="silu",
                norm_eps=1e-6)
    count = lambda d_ff: Transformer(ModelConfig(**base, d_ff=d_ff)).num_params()["total"]
    per_unit = (count(16) - count(8)) / 8
    d_ff = 8 * round((active - count(8)) / per_unit / 8) + 8
    return Transformer(ModelConfig(**base, d_ff=d_ff))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="timed steps per model")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per model first")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--hf-experts", default=None, help="transformers experts_implementation (default: its own)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    hf = hf_qwen2_moe(args.hf_experts)
    moe = lmlab_twin(hf)
    dense = dense_twin(moe.num_params()["active"])
    g = torch.Generator().manual_seed(0)
    idx, tgt = torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)

    hf.eval(), moe.eval()
    with torch.no_grad():
        gap = (hf(input_ids=idx).logits - moe(idx).logits).abs().max().item()
    hf.train(), moe.train(), dense.train()

    def lmlab_step(model):
        return model(idx, targets=tgt).loss

    def hf_step(model):
        return model(input_ids=idx, labels=tgt).loss  # HF shifts labels: loss over S-1 positions

    runs = {"lmlab MoE": (moe, lmlab_step), "HF Qwen2-MoE": (hf, hf_step), "lmlab dense": (dense, lmlab_step)}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4, **_fused()) for name, (m, _) in runs.items()}
    wall = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    for step in range(args.warmup + args.steps):
        for name, (model, loss_of) in runs.items():
            t0, c0 = time.perf_counter(), time.process_time()
            loss_of(model).backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            if model is moe:
                model.update_router_biases()  # a no-op here (bias_update_rate 0), part of lmlab's step
            if step >= args.warmup:
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; batch {B} x {S} tokens, fp32, CPU")
    print(f"HF experts_implementation={hf.config._experts_implementation!r}, attention={hf.config._attn_implementation!r}")
    print(f"same weights: max |logits(lmlab) - logits(HF)| = {gap:.2e}")
    print(f"{'model':14s} {'total params':>13s} {'active':>11s} {'step (ms)':>10s} {'tokens/s':>10s} {'tokens/cpu-s':>13s}")
    tps, tpc = {}, {}
    for name, (model, _) in runs.items():
        total = sum(p.numel() for p in model.parameters())
        active = model.num_params()["active"] if isinstance(model, Transformer) else _hf_active(model)
        step_s = statistics.median(wall[name])
        tps[name], tpc[name] = B * S / step_s, B * S / statistics.median(cpu[name])
        print(f"{name:14s} {total:13,d} {active:11,d} {step_s * 1e3:10.0f} {tps[name]:10.0f} {tpc[name]:13.0f}")
    for other, target in (("HF Qwen2-MoE", 1.3), ("lmlab dense", 0.9)):
        r, rc = tps["lmlab MoE"] / tps[other], tpc["lmlab MoE"] / tpc[other]
        print(f"lmlab MoE / {other}: {r:.2f}x wall, {rc:.2f}x CPU time (target >= {target}x)")


def _fused() -> dict:
    return {"fused": True} if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 4) else {}


def _hf_active(model) -> int:
    cfg = model.config
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return sum(p.numel() for p in model.parameters()) - cfg.num_hidden_layers * (E - K) * per_expert


if __name__ == "__main__":
    main()
