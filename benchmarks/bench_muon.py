"""Steps to a loss: AdamW against Muon (``optim.name=muon``), each at its own tuned rate, on the
experiment corpus (the Python standard library, deduplicated: lmlab.experiments.corpus), byte tokens.

modded-nanogpt's optimizer track reports Muon reaching its target loss in 3,250 steps where Adam
needs 5,625 (a GPT-2 small on FineWeb); this measures the same kind of figure for lmlab's Muon on a
tiny llama-style model that a CPU trains in minutes. Protocol:

  1. AdamW: one run per rate of ``--adamw-lrs`` (optim.lr); the tuned rate is the one with the lowest
     final validation loss. The target loss is that run's final validation loss.
  2. Muon: one run per rate of ``--muon-lrs`` (optim.muon.lr), its AdamW part (embeddings, head,
     norms) at AdamW's tuned rate; the tuned rate is again the lowest final loss. The tuned AdamW run
     is repeated alongside (the same numbers: every run is deterministic) so that its step times are
     measured under the same load as Muon's.
  3. Steps to the target: the first evaluation (every ``--eval-every`` steps, on the same validation
     windows spread over the split) at or below it, for each tuned run; their ratio; and the time to
     it, steps x the median step time, in process CPU time and wall time.

Every run has the same data order (one seed), the same initial weights, the same warmup (a tenth of
the steps) and cosine decay to a tenth of the peak over ``--steps`` steps, and gradient clipping at 1.
Runs of a stage take turns, one step each, so load from other programs on a shared machine hits
them alike (a step's CPU time moves much less than its wall time). Muon reaches the target within its
own ``--steps``-step schedule, its rate still decaying: a schedule shortened to end there might reach
it sooner, so the step ratio is a lower bound on Muon's advantage at this size.

    python benchmarks/bench_muon.py --threads 1            # 4 layers, context 128, 600 steps: ~10 CPU minutes
    python benchmarks/bench_muon.py --quick --threads 1    # 2 layers, context 64, 300 steps: ~2 CPU minutes

Figures and their reading: docs/speed.md, "Muon against AdamW: steps to a loss".
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lmlab import ModelConfig, Transformer
from lmlab.experiments.corpus import CORPUS_FILE, build_corpus
from lmlab.run.config import OptimConfig
from lmlab.run.data.batches import TokenData
from lmlab.run.data.config import DataConfig
from lmlab.run.data.prepare import prepare
from lmlab.run.optim import build_optimizer, clip_gradients, learning_rate, set_learning_rate


@dataclasses.dataclass(frozen=True)
class Size:
    d_model: int = 64
    layers: int = 4
    heads: int = 4
    seq_len: int = 128
    batch: int = 16
    steps: int = 600
    eval_every: int = 20
    eval_batches: int = 16
    corpus_mb: float = 8.0

    def model(self) -> ModelConfig:
        return ModelConfig.from_preset("llama", vocab_size=256, d_model=self.d_model, n_layers=self.layers,
                                       n_heads=self.heads, max_seq_len=self.seq_len)


SIZES = {"full": Size(), "quick": Size(layers=2, seq_len=64, steps=300, eval_every=10, corpus_mb=2.0)}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 layers, context 64, 300 steps: a few minutes on one core")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--adamw-lrs", type=float, nargs="+", default=[1.5e-3, 3e-3, 6e-3, 1.2e-2],
                   help="AdamW's optim.lr grid")
    p.add_argument("--muon-lrs", type=float, nargs="+", default=[0.005, 0.01, 0.02, 0.04, 0.08],
                   help="Muon's optim.muon.lr grid")
    p.add_argument("--work", type=Path, default=None, help="where the corpus and prepared data go (default: a "
                   "temporary directory); reused when given again")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def data(work: Path, size: Size) -> tuple[TokenData, TokenData]:
    """The experiment corpus's first ``corpus_mb`` MB (before deduplication), prepared with byte tokens."""
    build_corpus(work / "corpus", max_bytes=int(size.corpus_mb * 1e6))
    out = work / f"data-{size.corpus_mb:g}mb"
    prepare(DataConfig(source=str(work / "corpus" / CORPUS_FILE), tokenizer="byte"), out, seq_len=size.seq_len)
    return TokenData(out, "train"), TokenData(out, "val")


@dataclasses.dataclass
class Run:
    """One training run, stepped from outside, as lmlab's trainer steps it (schedule, clipping, optimizer)."""

    name: str
    optim: OptimConfig
    size: Size
    seed: int
    train: TokenData
    val: TokenData

    def __post_init__(self):
        self.model = Transformer(self.size.model())  # the same initial weights for every run (model.init_seed)
        self.optimizer = build_optimizer(self.model, self.optim, torch.device("cpu"))
        self.step_no = 0
        self.evals: list[tuple[int, float]] = []  # (steps done, validation loss)
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def step(self) -> None:
        w, c = time.perf_counter(), time.process_time()
        set_learning_rate(self.optimizer, learning_rate(self.step_no, self.optim, self.size.steps))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.step_no)  # the batch: a function of the step
        x, y = self.train.batch(self.size.batch, self.size.seq_len, g)
        self.model(x, targets=y).loss.backward()
        clip_gradients(self.model.parameters(), self.optim.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.wall.append(time.perf_counter() - w)
        self.cpu.append(time.process_time() - c)
        self.step_no += 1
        if self.step_no % self.size.eval_every == 0 or self.step_no == self.size.steps:
            self.evals.append((self.step_no, self.evaluate()))

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        batches = self.val.iter_eval(self.size.batch, self.size.seq_len, self.size.eval_batches, spread=True)
        losses = [self.model(x, targets=y).loss.item() for x, y in batches]
        self.model.train()
        return sum(losses) / len(losses)

    @property
    def final(self) -> float:
        return self.evals[-1][1] if math.isfinite(self.evals[-1][1]) else float("inf")

    def steps_to(self, target: float) -> int | None:
        return next((s for s, loss in self.evals if loss <= target), None)

    def per_step(self) -> tuple[float, float]:
        """Median (CPU, wall) seconds per step, evaluations excluded."""
        return statistics.median(self.cpu), statistics.median(self.wall)


def in_turns(runs: list[Run]) -> list[Run]:
    for _ in range(runs[0].size.steps):
        for r in runs:
            r.step()
    return runs


def optim(size: Size, **fields) -> OptimConfig:
    return OptimConfig(warmup_steps=size.steps // 10, **fields)


def show_grid(title: str, runs: list[Run], rates: list[float]) -> Run:
    best = min(runs, key=lambda r: r.final)
    print(f"\n{title}")
    for r, rate in zip(runs, rates):
        print(f"  rate {rate:<8g} final val loss {r.final:.4f}{'   <- tuned' if r is best else ''}")
    if best in (runs[0], runs[-1]) and len(runs) > 1:
        print("  note: the tuned rate is at the edge of the grid; a wider grid may find a better one")
    return best


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    size = SIZES["quick" if args.quick else "full"]
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        train, val = data(work, size)
        print(f"{'quick' if args.quick else 'full'} size: llama d_model {size.d_model}, {size.layers} layers, "
              f"{size.heads} heads, context {size.seq_len}, batch {size.batch}, {size.steps} steps, byte tokens, "
              f"{Transformer(size.model()).num_params()['total']:,} parameters; {len(train.tokens):,} training "
              f"tokens; torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
        make = lambda name, o: Run(name, o, size, args.seed, train, val)  # noqa: E731
        adamw = in_turns([make(f"adamw {lr:g}", optim(size, lr=lr)) for lr in args.adamw_lrs])
        tuned_adamw = show_grid("AdamW, optim.lr:", adamw, args.adamw_lrs)
        rate = tuned_adamw.optim.lr
        stage = [make(f"muon {lr:g}", optim(size, name="muon", lr=rate, muon={"lr": lr})) for lr in args.muon_lrs]
        again = make(tuned_adamw.name, tuned_adamw.optim)
        in_turns([*stage, again])
        assert again.evals == tuned_adamw.evals, "a rerun of the same run gave other losses"
        tuned_muon = show_grid(f"Muon, optim.muon.lr (its AdamW part at optim.lr={rate:g}):", stage, args.muon_lrs)
    target = tuned_adamw.final
    print(f"\ntarget: AdamW's final validation loss at its tuned rate, {target:.4f}")
    rows = []
    for label, r in (("AdamW", again), ("Muon", tuned_muon)):
        steps = r.steps_to(target)
        cpu, wall = r.per_step()
        rows.append((label, r, steps, cpu, wall))
        reached = f"{steps:>5}" if steps is not None else f">{size.steps}"
        time_to = f"{steps * cpu:7.1f} s CPU, {steps * wall:7.1f} s wall" if steps is not None else "not reached"
        print(f"  {label:<6} lr {r.name.split()[-1]:<7} steps to target {reached}   step {cpu * 1e3:6.1f} ms CPU, "
              f"{wall * 1e3:6.1f} ms wall   time to target {time_to}   final {r.final:.4f}")
    (_, _, a_steps, a_cpu, a_wall), (_, _, m_steps, m_cpu, m_wall) = rows
    if a_steps and m_steps:
        print(f"  Muon / AdamW: {m_steps / a_steps:.2f}x the steps ({a_steps / m_steps:.2f}x fewer), "
              f"{m_cpu / a_cpu:.2f}x the CPU time per step, {m_wall / a_wall:.2f}x the wall time per step; "
              f"time to target {m_steps * m_cpu / (a_steps * a_cpu):.2f}x (CPU), "
              f"{m_steps * m_wall / (a_steps * a_wall):.2f}x (wall)")


if __name__ == "__main__":
    main()
