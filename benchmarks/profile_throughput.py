"""Each experiment's and ladder's runs at one profile, measured on one device: training tokens/s and peak
memory of every distinct model it trains, and the time the whole profile would take there.

    python benchmarks/profile_throughput.py --device cuda                      # every one, its gpu profile
    python benchmarks/profile_throughput.py --device cuda --only norm-depth moe-compute
    python benchmarks/profile_throughput.py --device cpu --profile quick --steps 1   # the machinery, seconds

What a lent GPU is for (issue 40: "run one rung of each there and report its throughput") in a few
minutes: not the runs themselves, which take hours, but whether each profile fits the device, how fast
it trains there, and so how long the profile would take. For every distinct (model, batch, context) the
profile trains, tuning runs included, it times ``--steps`` training steps after 2 warm-up steps
(forward and loss under bf16 autocast on CUDA as the trainer runs them, backward, the run's own
optimizer), on random tokens: the speed of a step does not depend on the data. A ladder's configs are
many (arms x rungs x rates); it measures every arm at its largest rung and at its smallest, and reads
the others at the achieved FLOP rate of the same arm, interpolated in log FLOPs per token (said so
in the output). The estimate adds up each run's training tokens at its speed, plus its evaluation
tokens at 3x that speed (a forward is about a third of a training step), and no start-up cost; it
leaves out an experiment's own measurements (positions' long-context evaluations and fine-tune snapshots,
moe's load batches), which ``experiment_budget.py`` counts for the CPU sizes. On this 2-core CPU a
positions training run (learned positions, 819,200 tokens) is estimated at 83 s and took 89-101 s of wall
time with two jobs; its long-context evaluations about double a run.

On CUDA the time is wall time between synchronizations; on the CPU it is process CPU time (the machine
is shared), so the estimate there is core-hours.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import mfu  # noqa: E402

from lmlab.experiments import EXPERIMENTS, load_experiment_spec  # noqa: E402
from lmlab.experiments.ladder import resolve_spec, shipped_ladders  # noqa: E402
from lmlab.experiments.ladder.spec import accounting, load_ladder  # noqa: E402
from lmlab.model import Transformer  # noqa: E402
from lmlab.run.optim import build_optimizer  # noqa: E402
from lmlab.run.parallel.group import peak_flops  # noqa: E402

LADDERS = [name for name in shipped_ladders() if name != "example"]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--profile", default="gpu", help="the specs' profile to size the runs (default gpu; main: none)")
    p.add_argument("--only", nargs="+", metavar="NAME", help=f"some of {sorted(EXPERIMENTS) + LADDERS}")
    p.add_argument("--steps", type=int, default=5, help="timed training steps per model (after 2 warm-up)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (cpu only)")
    args = p.parse_args(argv)
    known = sorted(EXPERIMENTS) + LADDERS
    bad = [n for n in args.only or [] if n not in known]
    if bad:
        p.error(f"--only {' '.join(bad)}: not an experiment or shipped ladder; choose from {known}")
    return args


def sweeps(name: str, profile: str):
    """(the runs' sweep specs, tuning first; the ladder or None) of an experiment or a shipped ladder."""
    profile = None if profile == "main" else profile
    if name in EXPERIMENTS:
        spec, ladder = load_experiment_spec(name, profile=profile), None
    else:
        ladder = load_ladder(resolve_spec(name), profile=profile)
        spec = ladder.sweep
    return ([spec.tune_spec()] if spec.tune else []) + [spec], ladder


def runs_of(specs) -> list[tuple[str, object, int]]:
    """(variant, config, seeds) of every run group the specs train."""
    return [(v.name, s.configs[v.name], len(s.seeds_of(v))) for s in specs for v in s.variants]


def key(cfg) -> tuple:
    return repr(cfg.model), cfg.train.batch_size, cfg.seq_len, cfg.optim.name


def measure(cfg, device: torch.device, steps: int) -> dict[str, float]:
    """Training tokens/s (and FLOP/s, peak memory) of ``cfg``'s model, batch and context on ``device``."""
    model = Transformer(cfg.model).to(device)
    opt = build_optimizer(model, cfg.optim, device)
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.seq_len), generator=g).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    for i in range(steps + 2):
        if i == 2:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = clock()
        with autocast():
            loss = model(x, x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    tps = steps * x.numel() / (clock() - t0)
    flops = model.flops_per_token(cfg.seq_len)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else math.nan
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"tps": tps, "flops_per_token": flops, "flop_rate": tps * flops, "peak_gib": peak}


def chosen(name: str, runs, ladder) -> list[tuple[str, object]]:
    """The (label, config) pairs to measure: every distinct one of an experiment; each ladder arm at its
    smallest and largest rung (the main run's, at the first rate)."""
    if ladder is None:
        seen: dict[tuple, tuple[str, object]] = {}
        for variant, cfg, _ in runs:
            seen.setdefault(key(cfg), (variant, cfg))
        return list(seen.values())
    picks = []
    for arm in ladder.arms:
        for rung in dict.fromkeys((ladder.rungs[0], ladder.rungs[-1])):
            variant = next(v for v, _, _ in runs if not v.startswith("tune-") and v.startswith(f"{arm}-{rung}"))
            picks.append((variant, next(c for v, c, _ in runs if v == variant)))
    return picks


def run_tokens(cfg) -> tuple[int, int]:
    """(training tokens, evaluation tokens) of one run of ``cfg`` (the final slice not included)."""
    t = cfg.train
    per_step = t.batch_size * t.grad_accum * cfg.seq_len
    evals = (t.steps // max(1, cfg.eval.every) + 1) * cfg.eval.batches * t.batch_size * cfg.seq_len
    return t.steps * per_step, evals


def estimate(name: str, runs, ladder, measured: dict[tuple, dict], final: int) -> tuple[float, bool]:
    """(seconds the profile's runs take at the measured speeds, whether some were read off an arm's rate)."""
    total, read = 0.0, False
    for variant, cfg, seeds in runs:
        m = measured.get(key(cfg))
        if m is None:  # a ladder config not measured: the arm's achieved FLOP rate at its FLOPs per token
            arm = variant.removeprefix("tune-").split("-", 1)[0]
            own = sorted((v["flops_per_token"], v["flop_rate"]) for v in measured.values() if v["arm"] == arm)
            f = accounting(cfg.model, cfg.seq_len)["flops_per_token"]
            rate = _interpolate(own, f)
            m, read = {"tps": rate / f}, True
        train, evals = run_tokens(cfg)
        total += seeds * (train / m["tps"] + (evals + final) / (3 * m["tps"]))
    return total, read


def _interpolate(points: list[tuple[float, float]], f: float) -> float:
    """The FLOP rate at ``f`` FLOPs per token, linear in log f between the measured points (held flat past them)."""
    if len(points) == 1 or f <= points[0][0]:
        return points[0][1]
    if f >= points[-1][0]:
        return points[-1][1]
    (f0, r0), (f1, r1) = points[0], points[-1]
    w = (math.log(f) - math.log(f0)) / (math.log(f1) - math.log(f0))
    return r0 + w * (r1 - r0)


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if seconds >= 360 else f"{seconds / 60:.1f} min"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("profile_throughput: --device cuda, but CUDA is not available here; use --device cpu", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    peak = peak_flops(device)
    unit = "wall" if device.type == "cuda" else "CPU"
    name_of = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name_of}; profile {args.profile}; {args.steps} timed steps per model; times are {unit} seconds")
    grand = 0.0
    for name in args.only or sorted(EXPERIMENTS) + LADDERS:
        specs, ladder = sweeps(name, args.profile)
        runs = runs_of(specs)
        final = (specs[-1].final_eval or {}).get("tokens", 0)
        print(f"\n## {name} ({'ladder' if ladder else 'experiment'}, profile {args.profile})\n")
        print("| run | params | batch x context | train tok/s | MFU | peak GiB |\n|---|---|---|---|---|---|")
        measured: dict[tuple, dict] = {}
        for variant, cfg in chosen(name, runs, ladder):
            m = measure(cfg, device, args.steps)
            m["arm"] = variant.removeprefix("tune-").split("-", 1)[0]
            measured[key(cfg)] = m
            n = accounting(cfg.model, cfg.seq_len)["total"]
            util = f"{mfu(m['flops_per_token'], m['tps'], peak):.1%}" if peak else "—"
            gib = f"{m['peak_gib']:.2f}" if math.isfinite(m["peak_gib"]) else "—"
            print(f"| {variant} | {n / 1e6:.1f}M | {cfg.train.batch_size} x {cfg.seq_len} | {m['tps']:,.0f} | "
                  f"{util} | {gib} |", flush=True)
        seconds, read = estimate(name, runs, ladder, measured, final)
        grand += seconds
        n_runs = sum(s for _, _, s in runs)
        how = "; configs not measured read at their arm's FLOP rate" if read else ""
        print(f"\n{name}: {n_runs} runs, about {hours(seconds)} of {unit} time at these speeds{how}", flush=True)
    print(f"\nall: about {hours(grand)} of {unit} time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
