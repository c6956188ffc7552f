"""The CPU budget of the three experiments, measured: runs x tokens / this machine's single-thread speed.

For every distinct model config of an experiment's full-size spec (tuning runs included), times a
few training steps (forward, loss, backward, fused AdamW, as the trainer does) and a few forward
passes (evaluation) with ``torch.set_num_threads(threads)``, then adds up, run by run:

    training   steps x batch x seq_len / training tokens/s
    evaluation (in-training evaluations + the final evaluation slice + the experiment's own
               measurements: positions' 1x-16x evaluations, zero-shot scalings and fine-tune
               snapshots; moe's expert-load batches) / forward tokens/s
    overhead   OVERHEAD_S per run (setup, checkpoints, result files), measured on this machine's quick runs

Speeds are measured in *process CPU time* (``time.process_time``), which other programs on a
shared machine disturb much less than wall time: the result is core-hours, the machine-independent
cost. Wall time = core-hours / processes, when each process has a core to itself; on a machine busy
with other work, divide by the share of a core each process gets. The wall-clock speed of the same
steps is printed beside it, as a check of how busy the machine was.

    python benchmarks/experiment_budget.py                      # all three, 1 thread
    python benchmarks/experiment_budget.py --experiments moe --steps 8
"""

from __future__ import annotations

import argparse
import math
import time
from collections import defaultdict

import torch

from lmlab.experiments import load_experiment_spec, positions
from lmlab.model import Transformer
from lmlab.run.optim import build_optimizer

OVERHEAD_S = 3.0


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experiments", nargs="+", default=["norm", "positions", "moe"])
    p.add_argument("--steps", type=int, default=4, help="timed training steps per config (after 2 warm-up steps)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--jobs", type=int, default=2, help="worker processes the wall-time estimate assumes")
    return p.parse_args()


def speeds(cfg, batch: int, seq_len: int, steps: int, eval_len: int | None = None) -> tuple[float, float, float]:
    """(training tokens per CPU second, forward tokens per CPU second at ``eval_len`` or seq_len,
    training tokens per wall second) of ``cfg.model``."""
    model = Transformer(cfg.model)
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size, (batch, seq_len), generator=g)
    for i in range(steps + 2):
        if i == 2:
            c0, w0 = time.process_time(), time.perf_counter()
        model(x, x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    tokens = steps * batch * seq_len
    train, wall = tokens / (time.process_time() - c0), tokens / (time.perf_counter() - w0)
    T = eval_len or seq_len
    xe = torch.randint(0, cfg.model.vocab_size, (max(1, 4096 // T), T), generator=g)
    with torch.no_grad():
        model(xe)
        c0 = time.process_time()
        for _ in range(3):
            model(xe)
    return train, 3 * xe.numel() / (time.process_time() - c0), wall


def hook_tokens(name: str, spec, variant) -> tuple[float, float]:
    """(evaluation tokens at the training length, at long lengths) of the experiment's own measurements."""
    tokens = spec.final_eval["tokens"] if spec.final_eval else 0
    if name == "positions" and not variant.name.startswith("tune-"):
        copy = positions.COPY_N * sum(m * 64 * 2 for m in positions.LONG)
        if variant.init_from:  # three snapshots: 1x, 8x, 16x and the copy probes
            return 3 * tokens, 3 * (2 * tokens + copy)
        long = (len(positions.MULTIPLES) - 1) * tokens + copy
        if variant.name == "rope":
            long += len(positions.METHODS) * (len(positions.MULTIPLES) - 1) * tokens
        return tokens, long
    if name == "moe":
        return 8 * spec.configs[spec.variants[0].name].train.batch_size * 128, 0
    return 0, 0


def budget(name: str, steps: int) -> list[dict]:
    spec = load_experiment_spec(name)
    specs = ([spec.tune_spec()] if spec.tune else []) + [spec]
    measured: dict[str, tuple[float, float, float, float]] = {}
    rows = []
    for s in specs:
        for v in s.variants:
            cfg, n = s.configs[v.name], len(s.seeds_of(v))
            key = repr(cfg.model)
            if key not in measured:
                train, fwd, wall = speeds(cfg, cfg.train.batch_size, cfg.seq_len, steps)
                extrapolates = cfg.model.positions != "learned" and not v.init_from
                long = (
                    speeds(cfg, 1, cfg.seq_len, 1, eval_len=16 * 64)[1] if name == "positions" and extrapolates else fwd
                )
                measured[key] = (train, fwd, long, wall)
            train, fwd, long, wall = measured[key]
            t = cfg.train
            tokens = t.steps * t.batch_size * cfg.seq_len
            evals = (t.steps // cfg.eval.every + 1) * cfg.eval.batches * t.batch_size * cfg.seq_len
            short_tok, long_tok = hook_tokens(name, s, v)
            final = s.final_eval["tokens"] if s.final_eval else 0
            per_run = tokens / train + (evals + final + short_tok) / fwd + long_tok / long + OVERHEAD_S
            rows.append(
                {
                    "run": v.name,
                    "runs": n,
                    "tokens": tokens,
                    "train_tps": train,
                    "wall_tps": wall,
                    "s_per_run": per_run,
                    "total_s": n * per_run,
                }
            )
    return rows


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    grand = 0.0
    for name in args.experiments:
        rows = budget(name, args.steps)
        groups: dict[str, list[dict]] = defaultdict(list)
        for r in rows:
            group = "tuning runs" if r["run"].startswith("tune-") else r["run"]
            if name == "norm" and group != "tuning runs":  # warmup does not change the speed
                group = group.rsplit("-", 1)[0] + " (warmup, nowarmup)"
            groups[group].append(r)
        print(
            f"\n## {name}\n\n| runs of | runs | tokens/run | train tok/CPU-s | (tok/wall-s now) | "
            "CPU-min/run | core-h |\n"
            "|---|---|---|---|---|---|---|"
        )
        for g, rs in groups.items():
            n = sum(r["runs"] for r in rs)
            print(f"| {g} | {n} | {rs[0]['tokens']:,} | {sum(r['train_tps'] for r in rs) / len(rs):,.0f} | "
                  f"{sum(r['wall_tps'] for r in rs) / len(rs):,.0f} | {sum(r['total_s'] for r in rs) / n / 60:.1f} | "
                  f"{sum(r['total_s'] for r in rs) / 3600:.2f} |")
        total = sum(r["total_s"] for r in rows)
        grand += total
        print(f"\n{name}: {sum(r['runs'] for r in rows)} runs, {total / 3600:.2f} core-hours; "
              f"~{total / 3600 / args.jobs:.2f} h wall with {args.jobs} processes")
    print(
        f"\nall: {grand / 3600:.2f} core-hours; ~{math.ceil(grand / 360 / args.jobs) / 10:.1f} h wall "
        f"with {args.jobs} processes "
        f"x {args.threads} thread(s), at the speeds measured now"
    )


if __name__ == "__main__":
    main()
