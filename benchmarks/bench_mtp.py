"""Self-speculative decoding with multi-token prediction (DeepSeek-V3 sec. 5.4.3) against plain decoding,
greedy and sampling, on a model trained with MTP through ``lmlab train``.

The model: ``--run DIR`` (any run trained with ``--model.mtp.depth D``), or one trained here first into
``--train-dir`` (default a temporary folder) on the built-in corpus: d_model 128, 4 layers, 4 heads,
context 128, ``mtp.depth`` ``--depth``, ``--train-steps`` steps of 16 x 128 tokens, one thread.

Prompts: the first ``--prompt-len`` tokens of validation windows of the run's own data (text the model
was not trained on). At ``--temperature 0`` both decoders are greedy and must give the same tokens; the
share of equal tokens is printed (100% expected; a floating-point near-tie may move one). At a temperature
above 0 (with ``--top-k``) both sample, the speculative decoder by the rejection rule of Leviathan et al.
2023 / Chen et al. 2023, which keeps plain sampling's distribution (tested in tests/test_speculative.py),
not its tokens; each timed generation gets its own seed, the same for both contenders.

Contenders take turns in one process, one whole generation each per round (``eager``, then
``speculative``), so load from other programs on a shared machine hits both alike; each reports
the median of its rounds, as wall and process-CPU tokens/s, and the ratio. Acceptance rate: the
share of drafted tokens that the main model confirmed (before a row's first miss; greedy: equal to its
argmax; sampling: accepted by the rejection rule);
tokens per round: tokens committed per verifying forward of the main model (1 + accepted drafts; a
batch advances by its least-accepting row).

    python benchmarks/bench_mtp.py --threads 1                  # trains the d128 model (minutes), then times
    python benchmarks/bench_mtp.py --run runs/mtp --threads 1   # an existing MTP run
    python benchmarks/bench_mtp.py --temperature 0 1 --top-k 0  # greedy, then sampling at 1 over the whole vocab
    python benchmarks/bench_mtp.py --quick                      # seconds: checks the machinery

Results and their reading: docs/speed.md, "Multi-token prediction as a draft".
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lmlab.generate import generate
from lmlab.run.data.batches import TokenData
from lmlab.run.load import load_run
from lmlab.sampling import make_probabilities
from lmlab.speculative import SpeculationStats, speculate

MODEL = ["--model.d_model", "128", "--model.n_layers", "4", "--model.n_heads", "4", "--model.max_seq_len", "128"]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, default=None, help="a run trained with --model.mtp.depth (default: train one)")
    p.add_argument("--train-dir", type=Path, default=None, help="where to train the model (default: a temporary dir)")
    p.add_argument("--train-steps", type=int, default=400)
    p.add_argument("--depth", type=int, default=1, help="mtp.depth of the model trained here")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads, for training and timing")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=5, help="timed generations per contender; medians are reported")
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0],
                   help="one block per temperature; 0 is greedy (default: greedy, then sampling at 1)")
    p.add_argument("--top-k", type=int, default=0, help="top-k when sampling (0: the whole vocabulary)")
    p.add_argument("--quick", action="store_true", help="a tiny model, 20 steps, few tokens (numbers meaningless)")
    args = p.parse_args()
    if args.quick:
        args.train_steps, args.new_tokens, args.rounds, args.batch_sizes, args.prompt_len = 20, 16, 2, [1, 2], 8
    return args


def train(args, run_dir: Path) -> None:
    """The model, trained through the command line as a user would."""
    model = ["--model.d_model", "32", "--model.n_layers", "2", "--model.max_seq_len", "64"] if args.quick else MODEL
    cmd = [sys.executable, "-m", "lmlab", "train", "--run-dir", str(run_dir), "--overwrite", "--data.source", "builtin",
           *model, "--model.mtp.depth", str(args.depth), "--train.steps", str(args.train_steps),
           "--train.batch_size", "16", "--train.device", args.device, "--threads", str(args.threads),
           "--log.every", "50", "--eval.every", str(args.train_steps), "--log.sample_tokens", "0",
           "--log.tensorboard", "false"]
    print("training:", " ".join(cmd[2:]), flush=True)
    t = time.perf_counter()
    subprocess.run(cmd, check=True)
    print(f"trained in {time.perf_counter() - t:.0f} s\n", flush=True)


def prompts(run, B: int, length: int, device) -> torch.Tensor:
    """(B, length) ids: the starts of B validation windows, spread over the split."""
    data = TokenData(run.data_dir, "val")
    x, _ = next(iter(data.iter_eval(B, length, max_batches=1, spread=True)))
    return x.to(device)


def decode(model, idx, n: int, decoder: str, temperature: float, top_k: int | None, seed: int) -> torch.Tensor:
    """(B, n) ids from ``generate`` (``seed`` is ignored when greedy)."""
    steps = generate(model, idx, n, temperature=temperature, top_k=top_k, seed=seed, decoder=decoder)
    return torch.stack(list(steps), dim=1)


def acceptance(model, idx, n: int, temperature: float, top_k: int | None, seed: int,
               stats: SpeculationStats | None = None) -> SpeculationStats:
    """Drafts and acceptances of one speculative generation (greedy, or sampling with ``seed``), added to
    ``stats`` (default: new counts)."""
    stats = SpeculationStats() if stats is None else stats
    probs = None if temperature == 0 else make_probabilities(temperature, top_k, None, model.config.vocab_size)
    generator = torch.Generator(idx.device).manual_seed(seed)
    for _ in speculate(model, idx, None, n, stats=stats, probs=probs, generator=generator):
        pass
    return stats


def measure(contenders: dict, rounds: int, device) -> dict[str, tuple[float, float]]:
    """name -> (median wall s, median CPU s) over ``rounds`` turns, each contender once per turn."""
    wall: dict[str, list[float]] = {k: [] for k in contenders}
    cpu: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            w, c = time.perf_counter(), time.process_time()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall[name].append(time.perf_counter() - w)
            cpu[name].append(time.process_time() - c)
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in contenders}


def bench_batch(model, idx, args, device, temperature: float) -> None:
    B, n, k = idx.shape[0], args.new_tokens, args.top_k or None
    seeds = iter(range(10**6))  # each call its own seed: rounds differ, the contenders of one round draw alike

    def run(decoder: str) -> torch.Tensor:
        return decode(model, idx, n, decoder, temperature, k, next(seeds) // 2)

    plain, spec = run("eager"), run("speculative")  # also the warm-up
    stats = acceptance(model, idx, n, temperature, k, seed=0)
    times = measure({"eager": lambda: run("eager"), "speculative": lambda: run("speculative")}, args.rounds, device)
    (we, ce), (ws, cs) = times["eager"], times["speculative"]
    how = "greedy" if temperature == 0 else f"sampled (temperature {temperature:g}, top-k {k or 'off'})"
    print(f"batch {B}: {n} {how} tokens after {idx.shape[1]}-token prompts, median of {args.rounds} rounds")
    print(f"  eager        {B * n / we:>8.0f} tok/s   cpu {B * n / ce:>8.0f} tok/s")
    print(f"  speculative  {B * n / ws:>8.0f} tok/s   cpu {B * n / cs:>8.0f} tok/s")
    same = f"tokens equal to eager: {(plain == spec).float().mean().item():.1%}" if temperature == 0 else \
        "tokens differ from eager's by design (same distribution)"
    print(f"  speed-up {we / ws:.2f}x (wall), {ce / cs:.2f}x (cpu); acceptance rate {stats.acceptance_rate:.1%} "
          f"({stats.accepted}/{stats.drafted} drafts); {stats.tokens_per_round:.2f} tokens per verifying forward; "
          f"{same}", flush=True)
    if B > 1:  # each prompt alone: what a row accepts when no other row holds it back
        alone = SpeculationStats()
        for i, row in enumerate(idx):
            acceptance(model, row[None], n, temperature, k, seed=i, stats=alone)
        print(f"  the same {B} prompts one at a time: acceptance rate {alone.acceptance_rate:.1%} "
              f"({alone.accepted}/{alone.drafted}), {alone.tokens_per_round:.2f} tokens per verifying forward",
              flush=True)
    print(flush=True)


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run
        if run_dir is None:
            run_dir = args.train_dir or Path(tmp) / "mtp"
            train(args, run_dir)
        run = load_run(run_dir, checkpoint="latest", device=device)
        cfg = run.model.config
        if cfg.mtp is None:
            raise SystemExit(f"{run_dir} was trained without multi-token prediction; train with --model.mtp.depth 1")
        print(f"model: {run_dir} @ step {run.step}: d_model {cfg.d_model}, {cfg.n_layers} layers, mtp.depth "
              f"{cfg.mtp.depth}; {torch.get_num_threads()} thread(s), {device}\n", flush=True)
        for temperature in args.temperature:
            for B in args.batch_sizes:
                with torch.inference_mode():
                    idx = prompts(run, B, args.prompt_len, device)
                bench_batch(run.model, idx, args, device, temperature)


if __name__ == "__main__":
    main()
