"""Where a decoding step's time goes: one token at batch 1, logits only, four contenders on the same weights.

    python benchmarks/bench_decode_step.py --threads 1        # docs/speed.md's CPU size
    python benchmarks/bench_decode_step.py --quick            # tiny, seconds (CI; numbers meaningless)

``bench_generate.py`` times whole generations; this script splits one step of them, to say what
is left between lmlab's default (eager) decoder and a target ratio against transformers:

  - transformers: ``LlamaForCausalLM`` forward of one token with its dynamic cache;
  - lmlab: ``model.head(model.hidden(tok, cache)[:, -1])`` with its ``KVCache``, what the eager
    decoder runs per token;
  - straight-line: the same computation written as one flat function over the same weight tensors
    (RMSNorm, fused q/k/v, rotary, GQA attention over a preallocated cache, SwiGLU, the head), with
    no modules, no configuration and no bookkeeping: about the fewest operator calls an eager step
    of this model can make. Its logits are checked equal to both others before timing;
  - matmuls: only the step's 17 ``F.linear`` calls on the same weights (fixed inputs).

Each round times one step of each (harness.Alternating), every cache growing by one token a round.
Sampling is not included (it is the same few ops for every decoder).
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_generate import build_models  # noqa: E402
from harness import Alternating, Setup, add_device_args  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(p)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=256, help="timed rounds (each cache grows one token a round)")
    p.add_argument("--warmup", type=int, default=16)
    args = p.parse_args()
    if args.device != "cpu":
        p.error("--device cuda: this split is of the CPU's eager step (on CUDA the default decoder is a CUDA graph)")
    args.size = "quick" if args.quick else "cpu"
    if args.quick:
        args.steps, args.warmup = 8, 2
    args.new_tokens = args.steps + args.warmup + 1  # bench_generate.build_models sizes the HF position table with it
    return args


class StraightLine:
    """One decoding step of a pre-norm llama (RMSNorm, rotary in the half layout, GQA, SwiGLU, untied
    head) as a flat function of its weights: the floor of an eager step's overhead."""

    def __init__(self, model, max_len: int):
        cfg = model.config
        self.H, self.KV, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.eps, self.d = cfg.norm_eps, cfg.d_model
        self.embed, self.final_norm, self.head = model.embed.weight, model.final_norm.weight, model.head.weight
        self.layers = [(b.norm1.weight, b.attn.qkv.weight, b.attn.out.weight, b.norm2.weight, b.ffn.gate_up.weight,
                        b.ffn.down.weight) for b in model.blocks]
        self.k = torch.zeros(len(self.layers), self.KV, max_len, self.hd)  # (L, KV, S, hd), batch 1
        self.v = torch.zeros_like(self.k)
        inv = cfg.rope.base ** (-torch.arange(0, self.hd, 2, dtype=torch.float64) / self.hd)  # (hd/2,)
        angle = torch.arange(max_len, dtype=torch.float64)[:, None] * inv  # (S, hd/2)
        self.cos = torch.cat([angle.cos(), angle.cos()], -1).float()[:, None]  # (S, 1, hd)
        # (S, 1, hd): a rotated x is x cos + roll(x, hd/2) sin_half
        self.sin_half = torch.cat([-angle.sin(), angle.sin()], -1).float()[:, None]
        self.pos = 0

    def __call__(self, tok: torch.Tensor) -> torch.Tensor:
        """tok (1, 1) -> logits (1, V); the token is written at position ``self.pos``, which then advances."""
        H, KV, hd, h, p = self.H, self.KV, self.hd, self.hd // 2, self.pos
        c, s = self.cos[p], self.sin_half[p]  # (1, hd)
        x = F.embedding(tok[0], self.embed)  # (1, C)
        for i, (n1, w_qkv, w_out, n2, w_gate_up, w_down) in enumerate(self.layers):
            qkv = F.linear(F.rms_norm(x, (self.d,), n1, self.eps), w_qkv).view(H + 2 * KV, hd)
            qk = qkv[: H + KV] * c  # (H + KV, hd) rotated queries and keys
            qk[:, :h].addcmul_(qkv[: H + KV, h:], s[:, :h])
            qk[:, h:].addcmul_(qkv[: H + KV, :h], s[:, h:])
            self.k[i, :, p] = qk[H:]
            self.v[i, :, p] = qkv[H + KV:]
            y = F.scaled_dot_product_attention(qk[:H].view(KV, H // KV, hd), self.k[i, :, : p + 1],
                                               self.v[i, :, : p + 1])  # (KV, H/KV, hd): each group reads its head
            x = x + F.linear(y.reshape(1, H * hd), w_out)
            gate, up = F.linear(F.rms_norm(x, (self.d,), n2, self.eps), w_gate_up).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, w_down)
        self.pos += 1
        return F.linear(F.rms_norm(x, (self.d,), self.final_norm, self.eps), self.head)


def matmuls_of(model):
    """The step's linear layers with one fixed input each: only the weight streaming and the GEMVs."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(1, m.in_features) for m in linears]
    return lambda: [F.linear(x, m.weight) for x, m in zip(inputs, linears)]


def check_steps(*steps, when: str) -> float:
    """One more step of each (their caches grow alike); the largest |logit difference| from the first's."""
    first, *rest = [step() for step in steps]
    err = max((got - first).abs().max().item() for got in rest)
    if not err < 1e-3:
        raise SystemExit(f"at {when}, a decoding step's logits differ from transformers' by {err:.2e}")
    return err


def main() -> None:
    args = parse()
    setup = Setup(args)
    hf, ours = build_models(args, setup.device, torch.float32)
    from transformers import DynamicCache

    cfg = ours.config
    # transformers 5.x names the cache argument ``cache`` (``past_key_values`` is deprecated); 4.x knows the old name
    key = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    max_len = args.prompt_len + args.steps + args.warmup + 8
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    flat = StraightLine(ours, max_len)
    with torch.inference_mode():
        hf_cache = DynamicCache(config=hf.config)
        hf_logits = hf(prompt, use_cache=True, **{key: hf_cache}).logits[:, -1]
        cache = ours.new_cache(1, max_len)
        ours_logits = ours.head(ours.hidden(prompt, cache)[:, -1])
        for t in prompt[0]:  # the straight line has no prefill: it reads the prompt a token at a time
            flat_logits = flat(t.view(1, 1))
        tok = torch.tensor([[int(hf_logits.argmax())]])
        for name, got in (("lmlab", ours_logits), ("straight-line", flat_logits)):
            err = (got - hf_logits).abs().max().item()
            if not err < 1e-3:
                raise SystemExit(f"{name}'s logits differ from transformers' by {err:.2e} after the prompt: not the "
                                 "same model, so the split below would compare different work")
        step_hf = lambda: hf(tok, use_cache=True, **{key: hf_cache}).logits[:, -1]  # noqa: E731
        step_ours = lambda: ours.head(ours.hidden(tok, cache)[:, -1])  # noqa: E731
        step_flat = lambda: flat(tok)  # noqa: E731
        err = check_steps(step_hf, step_ours, step_flat, when="the first step")
        timer = Alternating(setup, {"transformers": step_hf, "lmlab": step_ours, "straight-line": step_flat,
                                    "matmuls": matmuls_of(ours)}).run(args.steps, args.warmup)
        err = max(err, check_steps(step_hf, step_ours, step_flat, when="the step after the timed rounds"))

    print(f"llama preset, size {args.size}: d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, "
          f"{cfg.n_kv_heads} kv heads, vocab {cfg.vocab_size}; one token at batch 1 after a {args.prompt_len}-token "
          f"prompt, {args.steps} rounds; {setup.describe()}")
    print(f"logits of the three equal to within {err:.1e} (largest |difference|, first step and last)")
    hf_wall, hf_cpu = timer.median("transformers")
    for name in ("transformers", "lmlab", "straight-line", "matmuls"):
        wall, cpu = timer.median(name)
        print(f"  {name:14s} {1e3 * wall:7.3f} ms/step (CPU {1e3 * cpu:7.3f} ms); transformers' step / this: "
              f"{hf_wall / wall:5.2f}x (CPU {hf_cpu / cpu:5.2f}x)")
    wall, cpu = timer.ratio("lmlab", "transformers")
    print(f"lmlab / transformers, per step: {wall:.2f}x (CPU time {cpu:.2f}x), median of per-round ratios")
    wall, cpu = timer.ratio("straight-line", "transformers")
    print(f"straight-line / transformers, per step: {wall:.2f}x (CPU time {cpu:.2f}x): the most an eager step of "
          "this model can be, short of faster matmuls")
    wall, cpu = timer.ratio("straight-line", "lmlab")
    print(f"straight-line / lmlab, per step: {wall:.2f}x (CPU time {cpu:.2f}x): lmlab's overhead above the floor")
    mm, step = timer.median("matmuls")[1], timer.median("lmlab")[1]
    weights = sum(m.weight.numel() * m.weight.element_size() for m in ours.modules() if isinstance(m, torch.nn.Linear))
    print(f"matmuls: {100 * mm / step:.0f}% of lmlab's step (CPU time): {weights / 1e6:.1f} MB of weights read per "
          f"token, at {weights / mm / 1e9:.1f} GB/s")

if __name__ == "__main__":
    main()
