"""Exploratory, after norm-depth's results: does the 48-layer gap between pre-norm and post-norm reflect the
rate grid? Writes report.md beside this file from run records only:

    python results/norm/depth-ladder/exploratory-L48-rates/analyse.py            # from the repository root

- ../run-records/: the registered ladder's runs (tuning at seed 2000, main runs at seeds 20-23), as committed;
- runs/<arm>-L48-lr<rate>/seed<seed>/: the runs this check added (config.yaml and metrics.jsonl of
  ``lmlab train``), each the registered run's config with only optim.lr changed (and, for the main runs,
  the seed), trained by the ladder's own revision.

The rule that picks a rate is the registered one (lowest final validation loss at tuning seed 2000 among
runs that learned), over the finer grid. Nothing here is a registered claim: the verdicts in
../report.md stand as registered.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import yaml

from lmlab.experiments.stats import paired_interval

HERE = Path(__file__).resolve().parent
REGISTERED = HERE.parent / "run-records"
ADDED = HERE / "runs"
ARMS = ("post", "pre")
SEEDS = (20, 21, 22, 23)
TUNE_SEED = 2000
STEPS = 600
UNIGRAM = json.loads((HERE / "unigram.json").read_text())["unigram_loss"]  # the ladder's "no better than unigram"
REGISTERED_RATE = 0.003  # both arms' chosen rate at 48 layers in the registered ladder


def final_loss(folder: Path) -> float:
    """The validation loss after the last step: curve.jsonl (a ladder record) or metrics.jsonl (lmlab train)."""
    name = "curve.jsonl" if (folder / "curve.jsonl").is_file() else "metrics.jsonl"
    rows = [json.loads(line) for line in (folder / name).read_text().splitlines() if line.strip()]
    last = [r for r in rows if "val_loss" in r][-1]
    if last["step"] != STEPS:
        raise SystemExit(f"{folder / name}: the last evaluation is at step {last['step']}, not {STEPS}: unfinished")
    return float(last["val_loss"])


def train_hours(folders: list[Path]) -> float:
    """Training time of the added runs, from each logged interval's tokens and tokens/s (evaluation excluded:
    ``lmlab train``'s metrics.jsonl records no wall clock)."""
    seconds = 0.0
    for folder in folders:
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
        logged = [r for r in rows if "tokens_per_s" in r]
        starts = [{"tokens": 0}, *logged]
        seconds += sum((b["tokens"] - a["tokens"]) / b["tokens_per_s"] for a, b in zip(starts, logged))
    return seconds / 3600


def machine(folders: list[Path]) -> list[str]:
    """The torch builds that trained ``folders`` (each run's config records its own in provenance)."""
    return sorted({yaml.safe_load((f / "config.yaml").read_text())["provenance"][-1]["torch"] for f in folders})


def rate_of(folder: Path) -> float:
    return float(yaml.safe_load((folder / "config.yaml").read_text())["optim"]["lr"])


def tuning(arm: str) -> dict[float, tuple[float, str]]:
    """rate -> (final loss at the tuning seed, 'registered' or 'added')."""
    out: dict[float, tuple[float, str]] = {}
    sources = (("registered", REGISTERED, f"tune-{arm}-L48-lr*"), ("added", ADDED, f"{arm}-L48-lr*"))
    for source, root, pattern in sources:
        for folder in sorted(root.glob(f"{pattern}/seed{TUNE_SEED}")):
            out[rate_of(folder)] = (final_loss(folder), source)
    return dict(sorted(out.items()))


def main_runs(arm: str, rate: float) -> list[float] | None:
    """The arm's final losses at SEEDS at ``rate`` (the registered runs at the registered rate), or None if
    not all were run."""
    if math.isclose(rate, REGISTERED_RATE):
        folders = [REGISTERED / f"{arm}-L48" / f"seed{s}" for s in SEEDS]
    else:
        folders = [ADDED / f"{arm}-L48-lr{rate:g}" / f"seed{s}" for s in SEEDS]
    if not all(f.is_dir() for f in folders):
        return None
    for f in folders:
        if not math.isclose(rate_of(f), rate):
            raise SystemExit(f"{f}: trained at lr {rate_of(f)}, expected {rate}")
    return [final_loss(f) for f in folders]


def report() -> str:
    grids = {arm: tuning(arm) for arm in ARMS}
    chosen = {arm: min((r for r, (loss, _) in g.items() if loss < UNIGRAM), key=lambda r: g[r][0])
              for arm, g in grids.items()}
    rates = sorted({r for g in grids.values() for r in g})
    added = sorted(ADDED.glob("*/seed*"))
    tuned = sum(f.name == f"seed{TUNE_SEED}" for f in added)
    lines = [
        "# Exploratory: a finer rate grid at 48 layers (norm-depth, after its results)",
        "",
        "Not a registered claim. The ladder's verdicts in ../report.md stand as registered; this asks, after seeing",
        "them, whether the 48-layer gap between pre-norm and post-norm reflects the rate grid: at 48 layers both arms",
        f"chose {REGISTERED_RATE:g}, a 3.3x step below 0.01, where pre-norm's loss had risen and post-norm's run had",
        "not learned. The added runs are the registered runs' configs with only optim.lr changed (and the seed, for",
        "the main runs), trained by the ladder's own revision 10873bf with one thread each; a run of the registered",
        "config by the same command reproduced the registered record's losses exactly (steps 10, 20 and 75).",
        "0.002 was not run: both arms' losses fall from 0.003 to 0.005.",
        "",
        "Made by: `python results/norm/depth-ladder/exploratory-L48-rates/analyse.py` from the run records in",
        "../run-records (registered) and runs/ (added).",
        "",
        f"Added: {len(added)} runs ({tuned} tuning, {len(added) - tuned} main) of 1,228,800 tokens each,"
        f" {train_hours(added):.2f} h of training (evaluation excluded), two runs at a time on a 2-core x86_64 CPU"
        f" with torch {', '.join(machine(added))}, the machine that ran the ladder.",
        "",
        f"## Tuning at seed {TUNE_SEED}, 48 layers (final validation loss)",
        "",
        "| optim.lr | " + " | ".join(ARMS) + " |",
        "|---|" + "---|" * len(ARMS),
    ]
    for r in rates:
        cells = []
        for arm in ARMS:
            if r not in grids[arm]:
                cells.append("—")
                continue
            loss, source = grids[arm][r]
            mark = (" (no better than unigram)" if loss >= UNIGRAM else "") + (" (added)" if source == "added" else "")
            cells.append(f"**{loss:.3f}**{mark}" if r == chosen[arm] else f"{loss:.3f}{mark}")
        lines.append(f"| {r:g} | " + " | ".join(cells) + " |")
    lines += ["", f"Bold: each arm's lowest loss among runs that learned (the unigram loss is {UNIGRAM:.3f}). "
              "Chosen over the finer grid: " + ", ".join(f"{arm} {chosen[arm]:g}" for arm in ARMS) + "; registered: "
              + ", ".join(f"{arm} {REGISTERED_RATE:g}" for arm in ARMS) + ".", ""]
    def loss(arm: str, rate: float) -> float:
        return grids[arm][rate][0]

    common = {r: loss("pre", r) - loss("post", r) for r in rates
              if all(r in grids[a] and loss(a, r) < UNIGRAM for a in ARMS)}
    lines += ["At the tuning seed, pre − post at a common rate: "
              + ", ".join(f"{g:+.3f} at {r:g}" for r, g in common.items())
              + f"; at each arm's own best rate: {loss('pre', chosen['pre']) - loss('post', chosen['post']):+.3f}"
              + f" (registered grid: {common[REGISTERED_RATE]:+.3f}).", ""]
    lines += [f"## Main seeds {', '.join(map(str, SEEDS))} at 48 layers", ""]
    registered = {arm: main_runs(arm, REGISTERED_RATE) for arm in ARMS}
    finer = {arm: main_runs(arm, chosen[arm]) for arm in ARMS}
    lines += ["| arm | optim.lr | " + " | ".join(f"seed {s}" for s in SEEDS) + " | mean |",
              "|---|---|" + "---|" * (len(SEEDS) + 1)]
    for label, runs, rates_used in (("registered", registered, dict.fromkeys(ARMS, REGISTERED_RATE)),
                                    ("finer grid", finer, chosen)):
        for arm in ARMS:
            values = runs[arm]
            cells = ["not run"] * len(SEEDS) + ["—"] if values is None else \
                [f"{v:.4f}" + (" (no better than unigram)" if v >= UNIGRAM else "") for v in values] \
                + [f"{sum(values) / len(values):.3f}"]
            lines.append(f"| {arm} ({label}) | {rates_used[arm]:g} | " + " | ".join(cells) + " |")
    lines.append("")
    reg = paired_interval(registered["pre"], registered["post"])
    lines.append(f"pre − post, paired by seed (95% t interval): registered rates {reg.text()}")
    if finer["pre"] is not None and finer["post"] is not None:
        new = paired_interval(finer["pre"], finer["post"])
        moved = paired_interval(finer["pre"], registered["pre"])
        lines[-1] += f"; finer-grid rates {new.text()}."
        lines += ["", f"The finer grid moves pre-norm by {moved.text()} and post-norm by "
                  f"{paired_interval(finer['post'], registered['post']).text()} nats at the main seeds.",
                  "", "## Reading", "",
                  f"At 48 layers the rate grid accounts for {reg.mean - new.mean:+.3f} of the registered gap "
                  f"{reg.mean:+.3f}; pre-norm stays behind post-norm by {new.text()} nats"
                  + (" (the interval excludes zero)." if new.excludes_zero() else " (the interval includes zero).")
                  + " One depth, one tuning seed, chosen after the results: a description, not a verdict. The"
                  " other depths kept the registered grid (3.3x steps), so the gap at 48 layers here is not comparable"
                  " with theirs in ../report.md: a finer grid may move them too."]
    else:
        lines[-1] += "; finer-grid rates: not all main runs have finished."
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    text = report()
    out = HERE / "report.md"
    tmp = out.with_suffix(".md.tmp")
    tmp.write_text(text)
    tmp.replace(out)
    sys.stdout.write(text)
