"""Training step speed: lmlab against transformers' ``LlamaForCausalLM``, plus lmlab's MFU.

One step = forward, cross-entropy over every position, backward, AdamW step, zero_grad: what
``lmlab.run.trainer.Trainer`` does per micro-batch. Both models have the same config and the same weights
(a random HF Llama saved with ``save_pretrained`` and loaded with ``lmlab.from_hf``); the first
step's losses are checked equal before timing. Both get the same loss function (cross-entropy on
the logits, computed outside the model) and the same optimizer (fused AdamW, as ``lmlab.run.optim``
uses), so the model code is the only difference.

Rounds alternate between the libraries and the best of ``--repeats`` rounds is kept, so a busy
machine penalizes both alike. Two clocks: wall time, and on CPU process CPU time, which other
programs on a shared machine disturb less.

MFU: model FLOPs per token (6 N + 12 L H d_head T, PaLM appendix B; ``Transformer.flops_per_token``)
times tokens/s, over the fp32 matmul throughput measured in the same run (an n x n x n matmul).

    python benchmarks/bench_train_step.py                 # llama preset, d_model 256, 4 layers, 8 x 256, fp32 CPU
    python benchmarks/bench_train_step.py --threads 1
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import torch.nn.functional as F

import lmlab


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--repeats", type=int, default=3, help="rounds per library; the best is kept")
    p.add_argument("--matmul", type=int, default=2048, help="n of the n x n x n matmul that measures peak FLOP/s")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--compile", action="store_true", help="torch.compile both models (as train.compile does)")
    return p.parse_args()


def build_models(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    ref = lmlab.ModelConfig.from_preset("llama", d_model=args.d_model, n_layers=args.n_layers,
                                        vocab_size=args.vocab, max_seq_len=args.seq_len)
    hf_cfg = LlamaConfig(
        vocab_size=ref.vocab_size, hidden_size=ref.d_model, intermediate_size=ref.d_ff, num_hidden_layers=ref.n_layers,
        num_attention_heads=ref.n_heads, num_key_value_heads=ref.n_kv_heads, head_dim=ref.head_dim,
        max_position_embeddings=ref.max_seq_len, rms_norm_eps=ref.norm_eps, rope_theta=ref.rope.base,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_cfg)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = lmlab.from_hf(tmp)
    assert ours.config.d_model == ref.d_model and ours.config.n_kv_heads == ref.n_kv_heads
    return hf.train(), ours.train()


def step_fn(model, logits_of, x, y):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)  # as the trainer

    def step() -> float:
        logits = logits_of(model, x)  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def time_round(step, n: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        step()
    return (time.perf_counter() - wall) / n, (time.process_time() - cpu) / n


def matmul_flops(n: int, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def main() -> None:
    args = parse()
    if args.threads:
        torch.set_num_threads(args.threads)
    hf, ours = build_models(args)
    g = torch.Generator().manual_seed(1)
    w = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=g)
    x, y = w[:, :-1], w[:, 1:]  # (B, T) each

    with torch.no_grad():  # same config, same weights: same loss
        a = F.cross_entropy(ours(x).logits.flatten(0, 1), y.flatten())
        b = F.cross_entropy(hf(input_ids=x).logits.flatten(0, 1), y.flatten())
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

    run_ours, run_hf = (torch.compile(ours), torch.compile(hf)) if args.compile else (ours, hf)
    steps = {
        "lmlab": step_fn(ours, lambda m, x: run_ours(x).logits, x, y),
        "transformers": step_fn(hf, lambda m, x: run_hf(input_ids=x).logits, x, y),
    }
    for step in steps.values():  # warm up: allocator, optimizer state, kernels
        step(), step()
    best = {name: (float("inf"), float("inf")) for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            wall, cpu = time_round(step, args.steps)
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu))

    tokens = args.batch * args.seq_len
    peak = matmul_flops(args.matmul)
    flops_per_token = ours.flops_per_token(args.seq_len)
    print(f"training step, llama d_model {args.d_model}, {args.n_layers} layers, vocab {args.vocab}, batch "
          f"{args.batch} x {args.seq_len}, fp32 CPU, {torch.get_num_threads()} threads, torch {torch.__version__}"
          + (", torch.compile" if args.compile else ""))
    print(f"parameters: {ours.num_params()['total']:,}; model FLOPs per token: {flops_per_token / 1e6:.1f} M")
    for name, (wall, cpu) in best.items():
        print(f"  {name:13s} {wall * 1e3:8.1f} ms/step  {tokens / wall:9,.0f} tokens/s   (CPU time: {cpu * 1e3:8.1f} ms/step)")
    ratio, cpu_ratio = best["transformers"][0] / best["lmlab"][0], best["transformers"][1] / best["lmlab"][1]
    print(f"lmlab / transformers speed: {ratio:.2f}x wall, {cpu_ratio:.2f}x CPU time (target >= 1.1x)")
    achieved = flops_per_token * tokens / best["lmlab"][0]
    print(f"fp32 matmul ({args.matmul}^3): {peak / 1e9:.1f} GFLOP/s; lmlab model FLOP/s: {achieved / 1e9:.1f} G; "
          f"MFU {achieved / peak:.1%}")


if __name__ == "__main__":
    main()
