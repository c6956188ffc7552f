"""Generation speed: lmlab ``generate`` against transformers' ``LlamaForCausalLM.generate``.

Same weights (a random HF Llama saved with save_pretrained, loaded into lmlab with
``lmlab.from_hf``), same sampling (temperature, top-k), exactly ``--new-tokens`` new tokens each
(HF gets ``min_new_tokens = max_new_tokens``), at batch 1 and 8. Runs alternate between the two
libraries and the best of ``--repeats`` is kept, so a busy machine penalizes both alike.

Two clocks: wall time (what a user waits) and, on CPU, process CPU time, which other programs on
a shared machine barely disturb; with ``--threads 1`` the two agree on an idle machine.

    python benchmarks/bench_generate.py                    # CPU, fp32
    python benchmarks/bench_generate.py --device cuda      # bf16 weights for both
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

import lmlab
from lmlab.generate import generate


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    # the flags every benchmark takes (benchmarks/run_all.sh): tiny for CI, or the README's 198M GPU model
    p.add_argument("--quick", action="store_true", help="tiny model, 8 new tokens (seconds; for CI)")
    p.add_argument("--size", choices=["cpu", "gpu"], default="cpu", help="gpu: d_model 1024, 12 layers, vocab 32000")
    args = p.parse_args()
    if args.size == "gpu":
        args.d_model, args.n_layers, args.vocab = 1024, 12, 32000
    if args.quick:
        args.d_model, args.n_layers, args.vocab, args.new_tokens, args.repeats = 64, 2, 256, 8, 1
    return args


def build_models(args, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    ref = lmlab.ModelConfig.from_preset("llama", d_model=args.d_model, n_layers=args.n_layers, vocab_size=args.vocab)
    hf_cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=ref.d_model, intermediate_size=ref.d_ff, num_hidden_layers=ref.n_layers,
        num_attention_heads=ref.n_heads, num_key_value_heads=ref.n_kv_heads, head_dim=ref.head_dim,
        max_position_embeddings=max(ref.max_seq_len, args.prompt_len + args.new_tokens), rms_norm_eps=ref.norm_eps,
        rope_theta=ref.rope.base, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_cfg).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = lmlab.from_hf(tmp)
    hf = hf.to(device=device, dtype=dtype)
    ours = ours.to(device=device, dtype=dtype).eval()
    return hf, ours


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device) -> tuple[float, float, torch.Tensor]:
    """(wall seconds, CPU seconds, output) of one call."""
    sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    sync(device)
    return time.perf_counter() - wall, time.process_time() - cpu, out


def run_lmlab(model, idx, args) -> torch.Tensor:
    steps = generate(model, idx, args.new_tokens, temperature=args.temperature, top_k=args.top_k, seed=0)
    return torch.stack(list(steps), dim=1)  # (B, new_tokens)


@torch.inference_mode()
def run_hf(model, idx, args) -> torch.Tensor:
    out = model.generate(
        idx, attention_mask=torch.ones_like(idx), do_sample=True, temperature=args.temperature, top_k=args.top_k,
        top_p=1.0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=0,
    )
    return out[:, idx.shape[1]:]


def main() -> None:
    args = parse()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf, ours = build_models(args, device, dtype)

    import transformers

    print(f"llama preset: d_model {args.d_model}, {args.n_layers} layers, vocab {args.vocab}, "
          f"{ours.num_params()['total'] / 1e6:.2f}M params; prompt {args.prompt_len}, {args.new_tokens} new tokens, "
          f"temperature {args.temperature}, top_k {args.top_k}")
    print(f"device {device} ({dtype}), torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"transformers {transformers.__version__}")
    with torch.inference_mode():  # same weights: the logits agree
        probe = torch.randint(0, args.vocab, (2, args.prompt_len), generator=torch.Generator().manual_seed(1)).to(device)
        diff = (ours(probe).logits.float() - hf(probe).logits.float()).abs().max().item()
    print(f"max |logits difference| on a probe batch: {diff:.2e}\n")

    cpu_clock = device.type == "cpu"
    print(f"tokens/s = batch x {args.new_tokens} / best of {args.repeats} runs" + (
        "; 'cpu' columns use process CPU time" if cpu_clock else ""))
    head = f"{'batch':>5} {'lmlab':>9} {'HF':>9} {'ratio':>7}"
    print(head + (f"   {'lmlab cpu':>9} {'HF cpu':>9} {'ratio':>7}" if cpu_clock else ""))
    for B in args.batch_sizes:
        idx = torch.randint(0, args.vocab, (B, args.prompt_len), generator=torch.Generator().manual_seed(B)).to(device)
        warm = argparse.Namespace(**{**vars(args), "new_tokens": 8})
        run_lmlab(ours, idx, warm), run_hf(hf, idx, warm)
        best = {"lmlab": [float("inf")] * 2, "hf": [float("inf")] * 2}  # [wall, cpu]
        for _ in range(args.repeats):  # alternate, so load on the machine hits both alike
            for name, fn in (("lmlab", lambda: run_lmlab(ours, idx, args)), ("hf", lambda: run_hf(hf, idx, args))):
                wall, cpu, out = timed(fn, device)
                assert out.shape == (B, args.new_tokens), (name, out.shape)
                best[name] = [min(best[name][0], wall), min(best[name][1], cpu)]
        n = B * args.new_tokens
        (ow, oc), (hw, hc) = best["lmlab"], best["hf"]
        line = f"{B:>5} {n / ow:>9.0f} {n / hw:>9.0f} {hw / ow:>6.2f}x"
        print(line + (f"   {n / oc:>9.0f} {n / hc:>9.0f} {hc / oc:>6.2f}x" if cpu_clock else ""), flush=True)


if __name__ == "__main__":
    main()
