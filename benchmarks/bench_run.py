"""Whole training runs: lmlab's trainer against a plain PyTorch loop, with where lmlab's time goes.

The recipe is nanoGPT's CPU one: a gpt2-like model of 4 layers, 4 heads, d_model 128, context 64,
batch 12, 2000 iterations, lr 1e-3 with 100 warmup steps and a cosine to 1e-4, betas (0.9, 0.99),
gradient clipping at 1, evaluation every 250 steps over 20 batches. Both sides train the same
``lmlab.Transformer`` on the same byte-level corpus (lmlab's built-in one, prepared once into a
temporary directory), one thread each, taking turns run by run (``--rounds``), so that load from
other programs hits both alike.

- **lmlab**: ``Trainer(cfg, run_dir).fit()`` as ``lmlab train`` runs it, everything on: metrics.jsonl
  every 10 steps, TensorBoard when installed, checkpoints every 500 steps and at every new best, each
  with its finite checks, and the 200-token sample at the end.
- **plain**: :func:`plain_run`, the loop a minimal script writes (nanoGPT's shape): random windows
  from a memmap, AdamW with nanoGPT's two weight-decay groups, a cosine schedule, ``estimate_loss``
  over 20 random validation batches every 250 steps, no checkpoints, no records, no sample.
  (nanoGPT's own ``estimate_loss`` also evaluates 20 training batches; this loop does not.)

Reported per side: wall time (set-up to last evaluation; imports are timed apart, in a fresh
interpreter), tokens/s and time-to-loss: the wall seconds until an evaluation reaches the plain
loop's final validation loss of the same round. Then lmlab's time per phase: set-up, the steps,
evaluation, saving (finite checks included), logging and metrics, the final sample, the rest.

    python benchmarks/bench_run.py                  # the recipe, 2 rounds (~17 min on an idle 2-core CPU)
    python benchmarks/bench_run.py --quick          # seconds; numbers meaningless (run_all.sh --quick)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

import lmlab
from lmlab.run import Trainer
from lmlab.run.config import build_config
from lmlab.run.data.config import DataConfig
from lmlab.run.data.prepare import prepare


@dataclasses.dataclass(frozen=True)
class Recipe:
    steps: int = 2000
    batch: int = 12
    block: int = 64
    d_model: int = 128
    layers: int = 4
    heads: int = 4
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 100
    eval_every: int = 250
    eval_batches: int = 20

    def model(self, vocab: int) -> lmlab.ModelConfig:
        return lmlab.ModelConfig.from_preset("gpt2", d_model=self.d_model, n_layers=self.layers, n_heads=self.heads,
                                             max_seq_len=self.block, vocab_size=vocab)


RECIPES = {"cpu": Recipe(), "quick": Recipe(steps=24, batch=4, block=32, d_model=32, layers=2, heads=2,
                                            warmup=4, eval_every=8, eval_batches=2)}


@dataclasses.dataclass
class RunTimes:
    wall: float  # seconds, set-up to the end
    cpu: float  # process CPU seconds over the same span: what other programs on a shared machine barely move
    evals: list[tuple[float, float]]  # (seconds since the start, validation loss) at each evaluation
    phases: dict[str, float]  # seconds per phase (lmlab only)

    def time_to(self, target: float) -> float | None:
        return next((t for t, loss in self.evals if loss <= target), None)


# ============================================================== the plain loop
def plain_run(data_dir: Path, r: Recipe, vocab: int, seed: int = 0) -> RunTimes:
    """nanoGPT's loop over lmlab's model: what a minimal training script pays for."""
    start, cpu = time.perf_counter(), time.process_time()
    train = np.memmap(data_dir / "train.bin", dtype=np.uint16, mode="r")
    val = np.memmap(data_dir / "val.bin", dtype=np.uint16, mode="r")

    def get_batch(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - r.block, (r.batch,))
        x = torch.stack([torch.from_numpy(data[i:i + r.block].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + r.block].astype(np.int64)) for i in ix])
        return x, y  # (B, T) each

    def lr_at(it: int) -> float:
        if it < r.warmup:
            return r.lr * (it + 1) / (r.warmup + 1)
        ratio = (it - r.warmup) / (r.steps - r.warmup)
        return r.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (r.lr - r.min_lr)

    @torch.no_grad()
    def estimate_loss() -> float:
        model.eval()
        losses = torch.zeros(r.eval_batches)
        for k in range(r.eval_batches):
            x, y = get_batch(val)
            losses[k] = model(x, targets=y).loss.item()
        model.train()
        return losses.mean().item()

    torch.manual_seed(seed)
    model = lmlab.Transformer(r.model(vocab))
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=r.lr, betas=(0.9, 0.99))
    evals, step_s, eval_s = [], 0.0, 0.0
    for it in range(r.steps):
        t = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(it)
        x, y = get_batch(train)
        loss = model(x, targets=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_s += time.perf_counter() - t
        if (it + 1) % r.eval_every == 0 or it + 1 == r.steps:
            t = time.perf_counter()
            val_loss = estimate_loss()
            eval_s += time.perf_counter() - t
            evals.append((time.perf_counter() - start, val_loss))
    wall = time.perf_counter() - start
    return RunTimes(wall, time.process_time() - cpu, evals, {"step": step_s, "eval": eval_s,
                                                              "other": wall - step_s - eval_s})


# ============================================================== lmlab
def lmlab_run(data_dir: Path, r: Recipe, run_dir: Path, seed: int = 0) -> RunTimes:
    """``lmlab train`` on the recipe, everything on; the phases from ``TrainResult.phases``."""
    start, cpu = time.perf_counter(), time.process_time()
    evals: list[tuple[float, float]] = []

    def at_eval(trainer: Trainer, record: dict) -> None:
        if record.get("val_loss") is not None:
            evals.append((time.perf_counter() - start, record["val_loss"]))

    cfg = build_config({
        "model.preset": "gpt2", "model.d_model": r.d_model, "model.n_layers": r.layers, "model.n_heads": r.heads,
        "model.max_seq_len": r.block, "data.prepared": str(data_dir), "train.steps": r.steps,
        "train.batch_size": r.batch, "train.seed": seed, "train.device": "cpu", "optim.lr": r.lr,
        "optim.min_lr": r.min_lr, "optim.warmup_steps": r.warmup, "optim.betas": (0.9, 0.99),
        "eval.every": r.eval_every, "eval.batches": r.eval_batches,
    })
    with Trainer(cfg, run_dir, quiet=True, callbacks=[at_eval]) as trainer:
        result = trainer.fit()
    wall = time.perf_counter() - start
    phases = dict(result.phases)
    phases["other"] = wall - sum(phases.values())
    return RunTimes(wall, time.process_time() - cpu, evals, phases)


def start_seconds(*argv: str, repeats: int = 3) -> float:
    """Wall seconds of ``python ARGV`` in a fresh interpreter (the best of ``repeats``)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run([sys.executable, *argv], check=True, capture_output=True)
        best = min(best, time.perf_counter() - t)
    return best


# ============================================================== the report
PHASES = ("setup", "step", "eval", "save", "finite checks", "log", "sample", "other")


def report(r: Recipe, runs: dict[str, list[RunTimes]], imports: dict[str, float]) -> None:
    tokens = r.steps * r.batch * r.block
    rounds = len(runs["plain"])
    print(f"median of {rounds} alternating round(s); {tokens:,} training tokens per run")
    for name, times in runs.items():
        wall = statistics.median(t.wall for t in times)
        print(f"  {name:6s} {wall:8.1f} s  {tokens / wall:9,.0f} tokens/s  final val loss "
              f"{statistics.median(t.evals[-1][1] for t in times):.4f}   (each: "
              + ", ".join(f"{t.wall:.1f} s" for t in times) + ")")
    ratios = [p.wall / ours.wall for ours, p in zip(runs["lmlab"], runs["plain"])]
    cpu = [p.cpu / ours.cpu for ours, p in zip(runs["lmlab"], runs["plain"])]
    print(f"lmlab / plain loop, whole run: {statistics.median(ratios):.2f}x wall, {statistics.median(cpu):.2f}x CPU "
          "time (per round: " + ", ".join(f"{x:.2f}/{y:.2f}" for x, y in zip(ratios, cpu))
          + "; > 1: lmlab faster; target >= 1.0, aim 1.2)")
    for ours, plain in zip(runs["lmlab"], runs["plain"]):
        target = plain.evals[-1][1]
        a, b = ours.time_to(target), plain.time_to(target)
        shown = f"{a:.1f} s" if a is not None else "not reached"
        print(f"time to the plain loop's final val loss {target:.4f}: lmlab {shown}, plain {b:.1f} s")
    print("where the time goes (median seconds per run; per step in ms):")
    steps = {name: statistics.median(t.phases["step"] for t in times) for name, times in runs.items()}
    for phase in PHASES:
        row = [statistics.median(t.phases.get(phase, 0.0) for t in times) for times in runs.values()]
        cells = "  ".join(f"{name} {s:7.2f} s ({s / r.steps * 1e3:6.2f} ms/step)" for name, s in zip(runs, row))
        print(f"  {phase:13s} {cells}")
    print(f"  step ratio (plain / lmlab): {steps['plain'] / steps['lmlab']:.2f}x")
    print(f"start-up, fresh interpreter: import torch {imports['torch']:.2f} s, import lmlab "
          f"{imports['lmlab']:.2f} s, import lmlab.cli {imports['cli']:.2f} s, `lmlab --help` {imports['help']:.2f} s")
    print(f"  import torch and build an optimizer {imports['optimizer']:.2f} s: its first call imports torch._dynamo, "
          "which both sides pay in a fresh process, neither in the rounds above")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny recipe (seconds; for CI)")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 2; quick 1)")
    p.add_argument("--steps", type=int, default=None, help="fewer iterations than the recipe's 2000 (schedule and "
                   "evaluations every 250 steps as given; for a loaded machine)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads, for both sides")
    p.add_argument("--device", choices=["cpu"], default="cpu", help="the recipe is a CPU one")
    args = p.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 2)
    return args


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # its first call imports torch._dynamo: timed apart
    r = RECIPES["quick" if args.quick else "cpu"]
    if args.steps:
        r = dataclasses.replace(r, steps=args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        meta = prepare(DataConfig(source="builtin", tokenizer="byte"), data)
        print(f"whole run, nanoGPT's CPU recipe: gpt2-like, {r.layers} layers, {r.heads} heads, d_model {r.d_model}, "
              f"context {r.block}, batch {r.batch}, {r.steps} steps, eval every {r.eval_every} x {r.eval_batches} "
              f"batches; built-in corpus, bytes ({meta.train_tokens:,} train tokens); "
              f"{torch.get_num_threads()} thread(s), torch {torch.__version__}")
        runs: dict[str, list[RunTimes]] = defaultdict(list)
        for i in range(args.rounds):  # the order swaps every round, so a load that drifts hits both alike
            for side in (("lmlab", "plain") if i % 2 == 0 else ("plain", "lmlab")):
                runs[side].append(lmlab_run(data, r, Path(tmp) / f"run{i}", seed=i) if side == "lmlab"
                                  else plain_run(data, r, meta.vocab_size, seed=i))
            for name, times in runs.items():  # as it goes: a long benchmark on a loaded machine keeps what it has
                t = times[-1]
                print(f"  round {i + 1}: {name} {t.wall:.1f} s ({t.cpu:.1f} CPU s), val loss {t.evals[-1][1]:.4f}; "
                      + ", ".join(f"{k} {v:.2f} s" for k, v in t.phases.items()), flush=True)
    n = 1 if args.quick else 3
    imports = {"torch": start_seconds("-c", "import torch", repeats=n),
               "lmlab": start_seconds("-c", "import lmlab", repeats=n),
               "cli": start_seconds("-c", "import lmlab.cli", repeats=n),
               "help": start_seconds("-m", "lmlab", "--help", repeats=n),
               "optimizer": start_seconds("-c", "import torch; torch.optim.AdamW([torch.ones(1, requires_grad=True)])",
                                          repeats=n)}
    report(r, dict(runs), imports)


if __name__ == "__main__":
    main()
