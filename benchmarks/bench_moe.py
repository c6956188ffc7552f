"""Training-step throughput of lmlab's MoE against transformers' Qwen2-MoE and lmlab's dense model.

One process, one run, three models on the same data:
  - lmlab MoE: top-6 of 64 routed experts plus 1 sigmoid-gated shared expert (Qwen2-MoE's design);
  - transformers Qwen2-MoE with the same configuration and the same weights (copied into lmlab
    with lmlab.hf; the script checks that both give the same logits before timing);
  - lmlab dense with the same active parameter count (d_ff chosen to match).
Each step is a full training step: forward, loss (cross-entropy plus a load-balancing loss on
both MoE sides: HF's router_aux_loss_coef, lmlab's expert_balance_coef), backward, AdamW, zero_grad.
Models take turns step by step (see harness.py); medians, tokens/s and MFU.

Sizes (``--size``): ``cpu``: d_model 256, 4 layers, experts of width 128, 8 x 256 tokens, vocab
256. ``gpu``: d_model 1024, 8 layers, experts of width 256, 8 x 1024 tokens, vocab 32000.
``--compile``: lmlab compiles each block (``train.compile``; the MoE layer is one graph), HF the
whole model.

    python benchmarks/bench_moe.py --threads 2                 # docs/speed.md's CPU rows
    python benchmarks/bench_moe.py --device cuda [--compile]
    python benchmarks/bench_moe.py --quick
"""

from __future__ import annotations

import argparse

import torch

import lmlab
from harness import Alternating, Setup, add_device_args, compile_blocks, mfu
from lmlab import ModelConfig, Transformer
from lmlab.hf import state_dict_from_hf

E, K, SHARED = 64, 6, 1
AUX_COEF = 0.001  # HF Qwen2-MoE's default router_aux_loss_coef
SIZES = {  # d_model, n_layers, heads, expert width, batch, seq_len, vocab
    "cpu": (256, 4, 8, 128, 8, 256, 256),
    "gpu": (1024, 8, 16, 256, 8, 1024, 32000),
    "quick": (64, 2, 4, 32, 2, 64, 128),
}


def hf_qwen2_moe(size: str, experts_impl: str | None):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    D, L, heads, F_expert, _, S, V = SIZES[size]
    cfg = Qwen2MoeConfig(
        vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=heads, num_key_value_heads=heads,
        intermediate_size=4 * D, moe_intermediate_size=F_expert, shared_expert_intermediate_size=SHARED * F_expert,
        num_experts=E, num_experts_per_tok=K, norm_topk_prob=False, qkv_bias=False, max_position_embeddings=S,
        output_router_logits=True, router_aux_loss_coef=AUX_COEF, tie_word_embeddings=False,
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
    cfg = cfg.override({"max_seq_len": seq_len, "moe.expert_balance_coef": AUX_COEF * K / n_layers})
    model = Transformer(cfg)
    model.load_state_dict(state_dict_from_hf(cfg, hf_model.state_dict(), "qwen2_moe"))
    return model


def dense_twin(size: str, active: int) -> Transformer:
    """lmlab's dense model with d_ff (a multiple of 8) giving the closest parameter count to ``active``."""
    D, L, heads, _, _, S, V = SIZES[size]
    base = dict(vocab_size=V, d_model=D, n_layers=L, n_heads=heads, max_seq_len=S, ffn="glu", activation="silu",
                norm_eps=1e-6)
    with torch.device("meta"):
        def count(d_ff: int) -> int:
            return Transformer(ModelConfig(**base, d_ff=d_ff)).num_params()["total"]

        per_unit = (count(16) - count(8)) / 8
        d_ff = 8 * round((active - count(8)) / per_unit / 8) + 8
    return Transformer(ModelConfig(**base, d_ff=d_ff))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(ap)
    ap.add_argument("--size", choices=["cpu", "gpu"], default=None, help="default: the --device's")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per model (default 12; quick 2)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per model first")
    ap.add_argument("--matmul", type=int, default=None, help="n of the n^3 reference matmul (2048 CPU, 8192 CUDA)")
    ap.add_argument("--compile", action="store_true", help="lmlab per block (train.compile), HF whole model")
    ap.add_argument("--hf-experts", default=None, help="transformers experts_implementation (default: its own)")
    args = ap.parse_args()
    size = "quick" if args.quick else args.size or ("gpu" if args.device == "cuda" else "cpu")
    steps = args.steps or (2 if args.quick else 12)
    warmup = 1 if args.quick else args.warmup
    matmul = args.matmul or (256 if args.quick else 8192 if args.device == "cuda" else 2048)
    setup = Setup(args)
    D, L, heads, F_expert, B, S, V = SIZES[size]

    hf = hf_qwen2_moe(size, args.hf_experts)
    moe = lmlab_twin(hf, S)
    dense = dense_twin(size, moe.num_params()["active"])
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

    def step(model, loss_of):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def run() -> None:
            with setup.autocast():
                loss = loss_of()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if isinstance(model, Transformer):
                model.update_router_biases()  # a no-op here (bias_update_rate 0), part of lmlab's step

        return run

    timer = Alternating(setup, {
        "lmlab MoE": step(moe, lambda: moe(idx, targets=tgt).loss),
        "HF Qwen2-MoE": step(hf, lambda: run_hf(input_ids=idx, labels=tgt).loss),  # HF shifts labels: S-1 positions
        "lmlab dense": step(dense, lambda: dense(idx, targets=tgt).loss),
    }).run(steps, warmup, matmul=matmul)

    print(f"MoE training step: d_model {D}, {L} layers, {E} experts of width {F_expert}, top-{K} + {SHARED} shared, "
          f"batch {B} x {S}, vocab {V}; {setup.describe()}" + ("; torch.compile" if args.compile else "; eager"))
    print(
        f"HF experts_implementation={hf.config._experts_implementation!r}, "
        f"attention={hf.config._attn_implementation!r}; "
        f"same weights: max |logits(lmlab) - logits(HF)| = {gap:.2e}; median of {steps} alternating steps"
    )
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
        r, rc = timer.ratio("lmlab MoE", other)
        spread = sorted(timer.ratios_per_round("lmlab MoE", other))
        print(f"lmlab MoE / {other}: {r:.2f}x wall" + ("" if setup.cuda else f", {rc:.2f}x CPU time")
              + f" (median of per-step ratios, range {spread[0]:.2f}..{spread[-1]:.2f}; CPU target >= {target}x)")
    print(f"reference matmul ({matmul}^3, {str(setup.dtype).replace('torch.', '')}): {timer.peak / 1e12:.3f} TFLOP/s")


if __name__ == "__main__":
    main()
