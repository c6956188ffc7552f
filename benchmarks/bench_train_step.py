"""Training step speed: lmlab against transformers' ``LlamaForCausalLM``, with MFU.

One step = forward, next-token cross-entropy over every position, backward, AdamW step,
zero_grad: what ``lmlab.run.trainer.Trainer`` does per micro-batch. Both models have the same
config and the same weights (a random HF Llama saved with ``save_pretrained`` and loaded with
``lmlab.from_hf``); the losses are checked equal before timing. lmlab computes its loss the way
the trainer does, ``model(x, targets=y).loss`` (the chunked head + cross-entropy, which never
holds the (B·T, V) logits); transformers gets ``F.cross_entropy`` on its logits. Both use fused
AdamW, as ``lmlab.run.optim`` does.

Sizes (``--size``): ``cpu``: llama preset, d_model 256, 4 layers, vocab 256, 8 x 256 tokens.
``gpu``: the 198M llama of docs/speed.md's GPU sizes (d_model 1024, 12 layers, vocab 32000), 8 x 1024.
``--compile``: lmlab compiles each block (``train.compile``, lmlab.run.parallel.compile), transformers
the whole model with ``torch.compile``. Timing, clocks and MFU: see harness.py.

    python benchmarks/bench_train_step.py --threads 2              # docs/speed.md's CPU row
    python benchmarks/bench_train_step.py --device cuda [--compile]
    python benchmarks/bench_train_step.py --quick                  # seconds; numbers meaningless
    python benchmarks/bench_train_step.py --threads 1 --profile 3  # and where each step's time goes, op by op
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.nn.functional as F
from harness import Alternating, Setup, add_device_args, compile_blocks, mfu

import lmlab

SIZES = {  # d_model, n_layers, vocab, batch, seq_len
    "cpu": (256, 4, 256, 8, 256),
    "gpu": (1024, 12, 32000, 8, 1024),
    "quick": (64, 2, 128, 2, 64),
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(p)
    p.add_argument("--size", choices=["cpu", "gpu"], default=None, help="default: the --device's")
    p.add_argument("--steps", type=int, default=None, help="timed steps per library (default 15; quick 2)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--matmul", type=int, default=None, help="n of the n^3 reference matmul (2048 CPU, 8192 CUDA)")
    p.add_argument("--compile", action="store_true", help="lmlab per block (train.compile), HF whole model")
    p.add_argument("--loss", choices=["chunked", "plain"], default="chunked", help="lmlab's loss implementation")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, profile N steps of each library and print their ops side by side")
    args = p.parse_args()
    args.size = "quick" if args.quick else args.size or ("gpu" if args.device == "cuda" else "cpu")
    args.steps = args.steps or (2 if args.quick else 15)
    args.warmup = 1 if args.quick else args.warmup
    args.matmul = args.matmul or (256 if args.quick else 8192 if args.device == "cuda" else 2048)
    return args


def build_models(size: str, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    d, n_layers, vocab, _, seq_len = SIZES[size]
    ref = lmlab.ModelConfig.from_preset("llama", d_model=d, n_layers=n_layers, vocab_size=vocab, max_seq_len=seq_len)
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
    return hf.to(device).train(), ours.to(device).train()


def make_step(model, loss_of, setup: Setup):
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True
    )  # as the trainer

    def step() -> None:
        with setup.autocast():
            loss = loss_of()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main() -> None:
    args = parse()
    setup = Setup(args)
    hf, ours = build_models(args.size, setup.device)
    ours.set_loss_impl(args.loss)
    d, n_layers, vocab, batch, seq_len = SIZES[args.size]
    w = torch.randint(0, vocab, (batch, seq_len + 1), generator=torch.Generator().manual_seed(1)).to(setup.device)
    x, y = w[:, :-1], w[:, 1:]  # (B, T) each

    def hf_loss(model):
        return F.cross_entropy(model(input_ids=x).logits.flatten(0, 1).float(), y.flatten())

    with torch.no_grad(), setup.autocast():  # same config, same weights: same loss
        a, b = ours(x, targets=y).loss, hf_loss(hf)
    tol = 2e-2 if setup.cuda else 1e-4
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)

    run_hf = hf
    if args.compile:
        compile_blocks(ours)
        run_hf = torch.compile(hf)
    timer = Alternating(setup, {
        "lmlab": make_step(ours, lambda: ours(x, targets=y).loss, setup),
        "transformers": make_step(hf, lambda: hf_loss(run_hf), setup),
    }).run(args.steps, args.warmup, matmul=args.matmul)

    tokens = batch * seq_len
    fpt = ours.flops_per_token(seq_len)
    print(f"training step, llama d_model {d}, {n_layers} layers, vocab {vocab}, batch {batch} x {seq_len}; "
          f"{setup.describe()}" + ("; torch.compile" if args.compile else "; eager") + f"; lmlab loss {args.loss}")
    print(f"parameters: {ours.num_params()['total']:,}; model FLOPs per token: {fpt / 1e6:.1f} M; "
          f"median of {args.steps} alternating steps")
    for name in timer.contenders:
        wall, cpu = timer.median(name)
        line = (f"  {name:13s} {wall * 1e3:9.1f} ms/step {tokens / wall:10,.0f} tokens/s   "
                f"MFU {mfu(fpt, tokens / wall, timer.peak):6.1%}")
        print(line + (f"   (CPU time {cpu * 1e3:8.1f} ms/step)" if not setup.cuda else ""))
    wall_ratio, cpu_ratio = timer.ratio("lmlab", "transformers")
    spread = sorted(timer.ratios_per_round("lmlab", "transformers"))
    print(f"lmlab / transformers: {wall_ratio:.2f}x wall" + (f", {cpu_ratio:.2f}x CPU time" if not setup.cuda else "")
          + f" (median of per-step ratios, range {spread[0]:.2f}..{spread[-1]:.2f}; target >= 1.1x)")
    print(
        f"reference matmul ({args.matmul}^3, {str(setup.dtype).replace('torch.', '')}): {timer.peak / 1e12:.3f} TFLOP/s"
    )
    if args.profile:
        profile_ops(timer.contenders, args.profile)


def profile_ops(contenders: dict, steps: int, rows: int = 14) -> None:
    """Where each library's step goes: self CPU ms per step of the ops that take the most, side by
    side (the GEMMs both run, and what is left around them), and each one's op count per step."""
    from torch.profiler import ProfilerActivity, profile

    per_op: dict[str, dict[str, tuple[float, float]]] = {}
    for name, step in contenders.items():
        step()  # warm
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
        per_op[name] = {e.key: (e.self_cpu_time_total / 1e3 / steps, e.count / steps) for e in prof.key_averages()}
    a, b = per_op
    keys = sorted(set(per_op[a]) | set(per_op[b]),
                  key=lambda k: -max(per_op[a].get(k, (0, 0))[0], per_op[b].get(k, (0, 0))[0]))
    print(f"profile, self CPU ms per step (ops per step), {steps} steps each:")
    print(f"  {'op':56s} {a:>18s} {b:>18s}")
    for k in keys[:rows]:
        cells = [f"{per_op[n].get(k, (0, 0))[0]:8.1f} ({per_op[n].get(k, (0, 0))[1]:5.0f})" for n in (a, b)]
        print(f"  {k[:56]:56s} {cells[0]:>18s} {cells[1]:>18s}")
    for n in (a, b):
        total = sum(ms for ms, _ in per_op[n].values())
        gemm = sum(ms for k, (ms, _) in per_op[n].items() if k in ("aten::mm", "aten::addmm", "aten::bmm"))
        ops = sum(c for k, (_, c) in per_op[n].items() if k.startswith("aten::"))
        print(f"  {n}: {total:.1f} ms per step profiled, GEMMs (mm, addmm, bmm) {gemm:.1f} ms, {ops:.0f} aten ops")


if __name__ == "__main__":
    main()
