"""Generation speed: lmlab ``generate`` against transformers' ``LlamaForCausalLM.generate``.

Same weights (a random HF Llama saved with save_pretrained, loaded into lmlab with
``lmlab.from_hf``; logits checked equal first), same sampling (temperature, top-k), exactly
``--new-tokens`` new tokens each (HF gets ``min_new_tokens = max_new_tokens``), at batch 1 and 8.

Contenders, in one process, taking turns (one whole generation each per round), so load from
other programs on a shared machine hits all alike; each reports the median of its rounds:
  - lmlab, with each decoder of ``--decoders`` (``lmlab.generate``: eager, static, compiled,
    graph; auto = the default). The share of each decoder's tokens equal to the first's is
    printed (same seed: 100% in fp32 on CPU; in bf16 a compiled kernel's rounding may move a
    near-tie, after which a sampled run diverges).
  - transformers with its default dynamic cache;
  - transformers with ``cache_implementation="static"`` and its automatic ``torch.compile``
    (``mode="reduce-overhead"``, CUDA graphs on CUDA), its fastest path, where it runs.
Compilation and capture happen in an untimed warm-up generation of the full length; its time
is printed. Ratios are against transformers' dynamic cache (``HF``) and static + compile
(``HF static``).

Two clocks: wall time (what a user waits) and, on CPU, process CPU time, which other programs on
a shared machine barely disturb; with ``--threads 1`` the two agree on an idle machine.

    python benchmarks/bench_generate.py --threads 2               # CPU, fp32, docs/speed.md's size
    python benchmarks/bench_generate.py --device cuda --size gpu  # 198M llama, bf16
    python benchmarks/bench_generate.py --quick                   # seconds: checks the machinery

For ``benchmarks/run_all.sh``: every benchmark takes ``--device {cpu,cuda}`` and ``--quick``;
on a GPU, ``--device cuda --size gpu --rounds 3`` times the 198M model at batch 1 and 8.

Where the time goes (2-core CPU, one thread, docs/speed.md): the eager loop spends a third of
each token in the weight-reading matmuls and the rest in ~140 small operator calls, which the
compiled step fuses away; at batch 8 the compiled step is ~60% matmuls, the rest attention over
the whole static cache and top-k.

Sizes: ``cpu`` is the llama preset at d_model 256, 4 layers, vocab 4096 (4.9M parameters);
``gpu`` is the 198M llama of issue 14's table (d_model 1024, 12 layers, 8 heads, 2 KV heads,
d_ff 2752, vocab 32000, untied). On CUDA both libraries run bf16 weights (lmlab's ``generate``
also enters bf16 autocast, a no-op on bf16 weights); on CPU fp32.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import lmlab
from lmlab.generate import generate

SIZES = {  # llama preset overrides
    "cpu": dict(d_model=256, n_layers=4, vocab_size=4096),
    "gpu": dict(d_model=1024, n_layers=12, vocab_size=32000),
    "quick": dict(d_model=64, n_layers=2, vocab_size=256),
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: bf16 weights; cpu: fp32")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--quick", action="store_true", help="tiny model, few tokens and rounds (seconds; numbers meaningless)"
    )
    p.add_argument("--size", choices=["cpu", "gpu"], default=None, help="model size (default: gpu on cuda, else cpu)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--rounds", type=int, default=5, help="timed generations per contender; medians are reported")
    p.add_argument("--decoders", nargs="+", default=None,
                   help="lmlab decoders to time (default: eager static compiled on cpu, compiled graph static on cuda)")
    p.add_argument("--hf-static", choices=["on", "off"], default=None,
                   help="also time transformers' static cache + compile (default: on, off with --quick)")
    args = p.parse_args()
    if args.quick:
        args.size, args.new_tokens, args.rounds, args.batch_sizes = "quick", 16, 2, [1, 2]
    args.size = args.size or ("gpu" if args.device == "cuda" else "cpu")
    cuda = args.device == "cuda"
    args.decoders = args.decoders or (["auto"] if args.quick else
                                      ["compiled", "graph", "static"] if cuda else ["eager", "static", "compiled"])
    args.hf_static = (args.hf_static or ("off" if args.quick else "on")) == "on"
    return args


def build_models(args, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    ref = lmlab.ModelConfig.from_preset("llama", **SIZES[args.size])
    hf_cfg = LlamaConfig(
        vocab_size=ref.vocab_size, hidden_size=ref.d_model, intermediate_size=ref.d_ff, num_hidden_layers=ref.n_layers,
        num_attention_heads=ref.n_heads, num_key_value_heads=ref.n_kv_heads, head_dim=ref.head_dim,
        max_position_embeddings=max(ref.max_seq_len, args.prompt_len + args.new_tokens), rms_norm_eps=ref.norm_eps,
        rope_theta=ref.rope.base, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_cfg).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = lmlab.from_hf(tmp)
    return hf.to(device=device, dtype=dtype), ours.to(device=device, dtype=dtype).eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def lmlab_run(model, idx, args, decoder: str, n: int) -> torch.Tensor:
    steps = generate(model, idx, n, temperature=args.temperature, top_k=args.top_k, seed=0, decoder=decoder)
    return torch.stack(list(steps), dim=1)  # (B, n)


def hf_run(model, idx, args, n: int, static: bool) -> torch.Tensor:
    from transformers import CompileConfig

    extra = {}
    if static:  # transformers compiles the static-cache forward itself (mode="reduce-overhead")
        compile_config = CompileConfig()
        compile_config._compile_all_devices = True  # its switch for compiling on CPU too
        extra = dict(cache_implementation="static", compile_config=compile_config)
    with torch.inference_mode():
        out = model.generate(
            idx, attention_mask=torch.ones_like(idx), do_sample=True, temperature=args.temperature, top_k=args.top_k,
            top_p=1.0, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, **extra,
        )
    return out[:, idx.shape[1]:]


def check_same_model(hf, ours, args, device) -> None:
    with torch.inference_mode():
        probe = torch.randint(0, hf.config.vocab_size, (2, args.prompt_len), generator=torch.Generator().manual_seed(1))
        probe = probe.to(device)
        diff = (ours(probe).logits.float() - hf(probe).logits.float()).abs().max().item()
        want = hf.generate(probe, attention_mask=torch.ones_like(probe), do_sample=False, max_new_tokens=16,
                           min_new_tokens=16, pad_token_id=0)[:, probe.shape[1]:]
    got = torch.stack(list(generate(ours, probe, 16, temperature=0, decoder="eager")), dim=1)
    same = (got == want).float().mean().item()
    print(f"max |logits difference| on a probe batch: {diff:.2e}; greedy tokens equal to transformers': {same:.0%}\n")


def measure(contenders: dict, rounds: int, device: torch.device) -> dict[str, tuple[float, float]]:
    """name -> (median wall s, median CPU s) over ``rounds`` turns."""
    wall: dict[str, list[float]] = {k: [] for k in contenders}
    cpu: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            sync(device)
            w, c = time.perf_counter(), time.process_time()
            fn()
            sync(device)
            wall[name].append(time.perf_counter() - w)
            cpu[name].append(time.process_time() - c)
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in contenders}


def bench_batch(B: int, hf, ours, args, device) -> None:
    n = args.new_tokens
    idx = torch.randint(0, hf.config.vocab_size, (B, args.prompt_len), generator=torch.Generator().manual_seed(B)).to(
        device
    )
    contenders = {f"lmlab {d}": (lambda d=d: lmlab_run(ours, idx, args, d, n)) for d in args.decoders}
    contenders["HF"] = lambda: hf_run(hf, idx, args, n, static=False)
    if args.hf_static:
        contenders["HF static"] = lambda: hf_run(hf, idx, args, n, static=True)
    warm, agree, first = {}, {}, None
    for name, fn in list(contenders.items()):  # warm-up at full length: compiles, captures
        sync(device)
        t = time.perf_counter()
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001  (a reference that does not run here is reported, not fatal)
            if not name.startswith("HF"):
                raise
            print(f"  {name}: did not run ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
            del contenders[name]
            continue
        sync(device)
        warm[name] = time.perf_counter() - t
        assert out.shape == (B, n), (name, out.shape)
        if name.startswith("lmlab"):
            first = out if first is None else first
            agree[name] = f"{(out == first).float().mean().item():.0%}"
    times = measure(contenders, args.rounds, device)
    cpu_clock = device.type == "cpu"
    print(f"batch {B}: tokens/s = {B} x {n} / median of {args.rounds} generations"
          + ("; 'cpu' columns use process CPU time" if cpu_clock else ""))
    refs = [r for r in ("HF", "HF static") if r in times]
    head = f"  {'':<16} {'tok/s':>8} " + " ".join(f"{'vs ' + r:>12}" for r in refs) + f" {'warm-up s':>10} {'same':>5}"
    print(head + (f"   {'cpu tok/s':>9} " + " ".join(f"{'vs ' + r:>12}" for r in refs) if cpu_clock else ""))
    for name, (w, c) in times.items():
        line = f"  {name:<16} {B * n / w:>8.0f} " + " ".join(f"{times[r][0] / w:>11.2f}x" for r in refs)
        line += f" {warm[name]:>10.1f} {agree.get(name, ''):>5}"
        if cpu_clock:
            line += f"   {B * n / c:>9.0f} " + " ".join(f"{times[r][1] / c:>11.2f}x" for r in refs)
        print(line, flush=True)
    print()


def main() -> None:
    args = parse()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible to torch")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf, ours = build_models(args, device, dtype)

    import transformers

    print(f"llama preset, size {args.size}: d_model {ours.config.d_model}, {ours.config.n_layers} layers, vocab "
          f"{ours.config.vocab_size}, {ours.num_params()['total'] / 1e6:.1f}M params; prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, temperature {args.temperature}, top_k {args.top_k}")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{where} ({dtype}), torch {torch.__version__}, transformers {transformers.__version__}")
    check_same_model(hf, ours, args, device)
    for B in args.batch_sizes:
        bench_batch(B, hf, ours, args, device)


if __name__ == "__main__":
    main()
