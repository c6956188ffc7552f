"""Pilot of the retrieval task (train.lookup), exploratory: one seed, one thread.

    python pilot.py NAME --data DIR --out DIR [--set train.lookup.pairs=2 ...] [--stop-at 0.9] [--minutes 10]

Trains the positions experiment's rope model at d_model 64 (positions.yaml's base, resized: 4 layers,
context 128) with key-value lookups planted in its training windows, and probes in-range retrieval
(experiments/retrieval.py) every --every steps on validation text. The Trainer of this revision does not
pass train.lookup to its batches (run/trainer.py passes train.repeats only), so this script hands it
training data that plants them: TokenData.batch(..., lookup=cfg.train.lookup), the same function.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
import yaml

from lmlab.experiments import retrieval
from lmlab.run.config import RunConfig
from lmlab.run.trainer import Trainer

BASE = {
    "model.vocab_size": 2048, "model.d_model": 64, "model.n_heads": 4, "model.n_layers": 4, "model.ffn": "glu",
    "model.activation": "silu", "model.max_seq_len": 128, "model.positions": "rope",
    "train.steps": 3000, "train.batch_size": 16, "train.device": "cpu",
    "optim.lr": 2.0e-3, "optim.min_lr": 2.0e-4, "optim.warmup_steps": 50,
    "eval.every": 500, "eval.batches": 4, "checkpoint.every": 100000, "checkpoint.keep_last": 1,
    "log.every": 10, "log.sample_tokens": 0, "log.tensorboard": False,
    "train.lookup.fraction": 1.0,
}


class Planting:
    """The training split, with train.lookup planted in every batch it draws. ``filler`` (lo, hi), a
    diagnostic: the text of every window replaced by uniform ids in [lo, hi) first (no text at all)."""

    def __init__(self, data, lookup, filler=None):
        self.data, self.lookup, self.filler = data, lookup, filler

    def batch(self, batch_size, seq_len, generator, repeats=None):
        if self.filler is None:
            return self.data.batch(batch_size, seq_len, generator, repeats, lookup=self.lookup)
        from lmlab.run.data.lookup import plant_lookups

        window = torch.randint(*self.filler, (batch_size, seq_len + 1), generator=generator)
        window = plant_lookups(window, self.lookup, generator, self.data.plantable_ids)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def __getattr__(self, name):
        return getattr(self.data, name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", nargs="*", default=[], help="dotted overrides key=value (YAML values)")
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--probes", type=int, default=128)
    ap.add_argument("--stop-at", type=float, default=None, help="stop once in-range exact match reaches this")
    ap.add_argument("--curriculum", default=None, metavar="STEPS:MAX",
                    help="plant lookups with max_distance MAX until step STEPS, then as configured")
    ap.add_argument("--filler", default=None, metavar="LO:HI", help="diagnostic: no text, uniform ids in [LO, HI)")
    ap.add_argument("--minutes", type=float, default=10.0,
                    help="stop after this much CPU time of this process (one thread: its compute, whatever else runs)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    changes = {**BASE, "data.prepared": a.data,
               **{k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in a.set)}}
    cfg = RunConfig().override(changes)
    run_dir = Path(a.out) / a.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "overrides.json").write_text(json.dumps(changes, indent=1) + "\n")
    lk, L = cfg.train.lookup, cfg.seq_len
    ds = retrieval.in_range_distances(lk, L)
    curve: list[dict] = []
    t0, c0 = time.perf_counter(), time.process_time()

    first = None
    if a.curriculum:
        until, near = map(int, a.curriculum.split(":"))
        first = dataclasses.replace(lk, max_distance=near)

    def probe(trainer, record):
        step = record["step"]
        if first is not None and step == until:
            trainer.train_data.lookup = lk  # from the next step on: every distance
        last = step == cfg.train.steps
        if step % a.every and not last:
            return
        p = retrieval.lookup_probe(trainer.model, trainer.val_data, lk, L, ds, a.probes)
        row = {"step": step, "cpu_minutes": round((time.process_time() - c0) / 60, 2),
               "wall_minutes": round((time.perf_counter() - t0) / 60, 2), "loss": record.get("loss"),
               **{k: round(v, 4) for k, v in p.items()}}
        curve.append(row)
        print(json.dumps(row), flush=True)
        done = a.stop_at is not None and p["exact"] >= a.stop_at
        if done or row["cpu_minutes"] >= a.minutes:
            trainer.request_stop()

    with Trainer(cfg, run_dir, quiet=True, overwrite=True, callbacks=[probe]) as trainer:
        filler = tuple(map(int, a.filler.split(":"))) if a.filler else None
        trainer.train_data = Planting(trainer.train_data, first or lk, filler)
        result = trainer.fit()
        cpu, wall = (time.process_time() - c0) / 60, (time.perf_counter() - t0) / 60
        final = retrieval.lookup_metrics(trainer.model, trainer.val_data, lk, L, (1, 2, 4, 8), n=256)
    summary = {"name": a.name, "curriculum": a.curriculum, "filler": a.filler, "steps": result.step,
               "cpu_minutes": round(cpu, 2), "wall_minutes": round(wall, 2),
               "val_loss": result.val_loss, "lookup": lk.to_dict(), "distances_1x": ds, "curve": curve,
               "final": {k: round(v, 4) for k, v in final.items()}}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "curve"}))


if __name__ == "__main__":
    main()
