"""The sweep engine: from a resolved spec to finished runs. Prepares what every run shares (the
corpus, the data, the loss limits), plans each run's config and hash, and trains or reuses one run.

    sw, corpus_meta = setup(spec, out, Hooks(), Trainer, quiet=True, log=print)
    key = sw.key(variant, seed)          # what decides the run's result; None while its init_from runs
    finished(sw, name, seed)             # True when result.json holds a result for exactly that key
    train_one(sw, variant, seed, key, "[1/4] deep seed 0", print)    # trains, resumes or reruns

A run is reused only if its resolved config (seed, data and the run it starts from included) hashes
the same; a fine-tune starts from its parent's final checkpoint through ``train.init_from``, as
``lmlab train`` does. Workers (``workers``) decide which process trains which run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from ...run.checkpoint import local as ckpt
from ...run.checkpoint.directory import CHECKPOINTS
from ...run.config import RunConfig, config_diff, load_config, one_section_dict
from ...run.data.meta import META, DataMeta
from ...run.data.prepare import prepare
from ...run.data.shards import verify_shards
from ...run.errors import one_line
from ...run.metrics import jsonable, read_metrics
from ...run.provenance import code_revision
from ...run.trainer import TrainingDiverged
from .. import corpus as corpus_mod
from ..report import fmt
from ..spec import SweepSpec, Variant
from . import layout
from .measure import run_status, spread_eval, unigram_loss

__all__ = ["Hooks", "Sweep", "SweepInterrupted", "data_identity", "finished", "setup", "train_one"]


class Hooks:
    """Extra measurements of an experiment. Each returns columns added to the run's row (JSON-able)."""

    def before_fit(self, trainer, variant: Variant, seed: int, run_dir: Path) -> dict[str, Any]:
        """Called once, at step 0, before training (e.g. gradient norms at initialization)."""
        return {}

    def callbacks(self, variant: Variant, seed: int, run_dir: Path) -> list[Callable]:
        """Trainer callbacks ``cb(trainer, record)`` for this run (given to the Trainer's constructor)."""
        return []

    def after_fit(self, trainer, variant: Variant, seed: int, run_dir: Path) -> dict[str, Any]:
        """Called after a run ends (also one that diverged: see ``trainer.model``'s weights), with the trained model."""
        return {}


class SweepInterrupted(Exception):
    """A run was stopped by a signal; its checkpoint is saved and the sweep resumes on the next call."""


# ============================================================== inputs shared by every run
def data_identity(data_dir: Path) -> str:
    """sha256 over the prepared data's files (shards and tokenizer; meta.json, which records versions, excluded)."""
    h = hashlib.sha256()
    for p in sorted(data_dir.iterdir()):
        if p.is_file() and p.name != META and not p.name.startswith("."):
            h.update(p.name.encode() + b"\0")
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return "sha256:" + h.hexdigest()


def _with_corpus(spec: SweepSpec, out: Path, log: Callable[[str], None]) -> tuple[SweepSpec, dict | None]:
    """Build the spec's corpus under out/corpus (once) and point every variant's data at it."""
    if not spec.corpus:
        return spec, None
    meta = corpus_mod.build_corpus(out / "corpus", max_bytes=spec.corpus.get("max_bytes"), log=log)
    source = str((out / "corpus" / corpus_mod.CORPUS_FILE).resolve())
    configs = {n: c.override({"data.source": source}) for n, c in spec.configs.items()}
    return dataclasses.replace(spec, configs=configs), meta


def _prepare_shared_data(spec: SweepSpec, out: Path) -> dict[str, Path]:
    """Prepare each distinct data config once (normally one) under out/data; returns variant -> data dir.
    Prepared data (``data: DIR``) is read where it is, once its shards hash to what its meta.json
    recorded (data the sweep prepared earlier is checked so by ``prepare`` as it reuses it): before the
    data's identity decides which finished runs are stale, and before any run trains on it."""
    dirs: dict[str, Path] = {}
    by_config: dict[str, Path] = {}
    checked: set[Path] = set()
    for name, cfg in spec.configs.items():
        if cfg.data.prepared is not None:
            dirs[name] = Path(cfg.data.prepared).expanduser().resolve()
            if dirs[name] not in checked:
                verify_shards(dirs[name], DataMeta.open(dirs[name]).shard_hashes)
                checked.add(dirs[name])
            continue
        key = json.dumps({k: v for k, v in cfg.data.to_dict().items() if k != "dir"}, sort_keys=True)
        if key not in by_config:
            d = out / ("data" if not by_config else f"data{len(by_config)}")
            longest = max(c.seq_len for c in spec.configs.values() if c.data == cfg.data)
            prepare(cfg.data, d, seq_len=longest)
            by_config[key] = d
        dirs[name] = by_config[key]
    return dirs


@contextlib.contextmanager
def _setup_lock(out: Path) -> Iterator[None]:
    """A blocking exclusive lock on out/locks/setup.lock: two invocations on one out dir build the
    corpus and prepare the data one after the other, never into the same files at once."""
    import fcntl

    path = out / "locks" / "setup.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ============================================================== planning runs
@dataclasses.dataclass
class Sweep:
    """Everything a worker needs to train or reuse any run of a resolved spec (picklable)."""

    spec: SweepSpec
    out: Path
    hooks: Hooks
    trainer_cls: Any
    quiet: bool
    data_dirs: dict[str, Path]  # variant -> prepared data
    data_ids: dict[str, str]  # data dir -> identity
    limits: dict[str, dict[str, float]]  # data dir -> {"unigram", "init"}
    vocab: dict[str, int]  # data dir -> the tokenizer's vocabulary (the model's, whatever the spec says)

    def _planned(self, variant: Variant, seed: int) -> RunConfig:
        """The run's config on the shared data, before its starting weights are known: what its hash covers."""
        d = self.data_dirs[variant.name]
        cfg = self.spec.seed_config(variant.name, seed)
        where = "data.dir" if cfg.data.prepared is None else "data.prepared"
        return cfg.override({where: str(d.resolve()), "model.vocab_size": self.vocab[str(d)]})

    def config(self, variant: Variant, seed: int) -> RunConfig:
        """The config the run trains with: it reads the data the sweep prepared as it is (``data.prepared``),
        and a fine-tune's ``train.init_from`` is its parent run's final checkpoint, which the trainer loads
        as it does for ``lmlab train``. Call it once the parent has finished."""
        changes = {"data.prepared": str(self.data_dirs[variant.name].resolve())}
        if variant.init_from:
            parent = layout.run_dir_of(self.out, variant.init_from, seed).resolve() / CHECKPOINTS
            changes["train.init_from"] = str(ckpt.resolve(parent, "latest"))
        return self._planned(variant, seed).override(changes)

    def key(self, variant: Variant, seed: int) -> str | None:
        """Hash of what decides the run's result, or None while its init_from run is unfinished."""
        parent = None
        if variant.init_from:
            done = layout.read_result(layout.run_dir_of(self.out, variant.init_from, seed))
            if done is None or done.get("config_hash") != self.key(self.spec.variant(variant.init_from), seed):
                return None
            parent = done["config_hash"]  # the parent's weights: its hash stands for them
        # the one-section layout results were first keyed by; fields added since (schema.added) count once set
        cfg = one_section_dict(self._planned(variant, seed).identity_dict())
        # where the data lives is not what it is (its identity is hashed below)
        cfg["data"] = {k: (None if k == "prepared" else v) for k, v in cfg["data"].items()
                       if k not in ("source", "dir")}
        data = self.data_ids[str(self.data_dirs[variant.name])]
        blob = json.dumps(jsonable({"config": cfg, "data": data, "init_from": parent,
                                    "final_eval": self.spec.final_eval}), sort_keys=True)
        return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()[:32]

    def lock(self, variant: Variant, seed: int) -> Path:
        return layout.lock_file(self.out, variant.name, seed)


def setup(spec: SweepSpec, out: Path, hooks: Hooks, trainer_cls, quiet: bool, log) -> tuple[Sweep, dict | None]:
    """Corpus, shared data, data identities and loss limits: everything before the first run."""
    with _setup_lock(out):
        spec, corpus_meta = _with_corpus(spec, out, log)
        data_dirs = _prepare_shared_data(spec, out)
    limits, ids, vocabs = {}, {}, {}
    fe = spec.final_eval
    for d in set(data_dirs.values()):
        seq = max(c.seq_len for n, c in spec.configs.items() if data_dirs[n] == d)
        vocabs[str(d)] = vocab = DataMeta.open(d).vocab_size
        limits[str(d)] = {"unigram": unigram_loss(d, seq, max(1, fe["tokens"] // seq)) if fe else unigram_loss(d),
                          "init": math.log(vocab)}
        ids[str(d)] = data_identity(d)
    return Sweep(spec, out, hooks, trainer_cls, quiet, data_dirs, ids, limits, vocabs), corpus_meta


def finished(sw: Sweep, name: str, seed: int) -> bool:
    """Whether the run has a result for exactly its current config."""
    key, done = sw.key(sw.spec.variant(name), seed), layout.read_result(layout.run_dir_of(sw.out, name, seed))
    return key is not None and done is not None and done.get("config_hash") == key


def _stale_reason(sw: Sweep, variant: Variant, seed: int, run_dir: Path) -> str:
    """Which field changed since a run in ``run_dir`` started (for the log)."""
    with contextlib.suppress(ValueError, FileNotFoundError, OSError):
        saved = load_config(run_dir / "config.yaml")
        now = sw.config(variant, seed)
        where = ("data.dir", "data.source", "data.prepared", "train.init_from")  # paths: the hash covers what they hold
        diff = [d for d in config_diff(saved, now) if not d.startswith(where)]
        if diff:
            return diff[0] + " (then vs now)" + (f" and {len(diff) - 1} more" if len(diff) > 1 else "")
    return "its data, its evaluation slice or the run it starts from changed"


# ============================================================== one run
def train_one(sw: Sweep, variant: Variant, seed: int, key: str, tag: str, log: Callable[[str], None]) -> dict[str, Any]:
    """Train (or continue) one run in its directory and return its row; writes result.json last."""
    run_dir = layout.run_dir_of(sw.out, variant.name, seed)
    start = layout.read_start(run_dir)
    if layout.read_result(run_dir) is not None or (start is not None and start.get("config_hash") != key):
        log(f"{tag}: config changed since it ran: {_stale_reason(sw, variant, seed, run_dir)}; rerunning")
        layout.clear_run(run_dir)
        start = None
    elif start is None and run_dir.exists():  # stopped before it recorded its config hash: nothing says it is this run
        layout.clear_run(run_dir)
    cfg = sw.config(variant, seed)
    t0 = time.perf_counter()
    curve = layout.CurveLogger(run_dir)
    callbacks = [curve, *sw.hooks.callbacks(variant, seed, run_dir)]
    resume = (run_dir / "config.yaml").is_file()
    trainer = sw.trainer_cls(cfg, run_dir, resume=resume, quiet=sw.quiet, callbacks=callbacks)
    with contextlib.closing(trainer) if hasattr(trainer, "close") else contextlib.nullcontext():
        start = start or _start(sw, trainer, variant, seed, run_dir, key)
        curve.begin(trainer.step)
        reason, result = "", None
        try:
            result = trainer.fit()
        except TrainingDiverged as e:
            reason = f"non-finite loss/gradient: {one_line(e)[:120]}"
        if result is not None and result.stopped_by is not None:
            raise SweepInterrupted(f"{tag} stopped at step {trainer.step}; rerun the same command to resume")
        row = _row(sw, variant, seed, cfg, trainer, result, reason, curve, start)
        row.update(start.get("measurements", {}))
        row.update(sw.hooks.after_fit(trainer, variant, seed, run_dir))
    layout.write_result(run_dir, row)
    log(f"{tag}: val loss {fmt(row['final_val_loss'])}{'' if row['status'] == 'ok' else ' ' + row['status'].upper()} "
        f"({time.perf_counter() - t0:.0f} s)")
    return row


def _start(sw: Sweep, trainer, variant: Variant, seed: int, run_dir: Path, key: str) -> dict[str, Any]:
    """What is recorded when a run first starts: its config hash, the revision and whether the
    tree was clean, and the hooks' measurements at initialization. Kept across resumes."""
    import torch

    rev, clean = code_revision()
    start = {"config_hash": key, "revision": rev, "tree_clean": clean,
             "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "threads": torch.get_num_threads(), "measurements": {}}
    if getattr(trainer, "step", 0) == 0:
        start["measurements"] = jsonable(sw.hooks.before_fit(trainer, variant, seed, run_dir))
    layout.write_start(run_dir, start)
    return start


def _final_loss(sw: Sweep, trainer, result) -> tuple[float, int, float | None]:
    """(loss, tokens, bits per byte) every table and report uses: over the spec's spread slice, or
    the trainer's last evaluation."""
    fe = sw.spec.final_eval
    if fe and result is not None and all(bool(p.isfinite().all()) for p in trainer.model.parameters()):
        T = trainer.cfg.seq_len
        r = spread_eval(trainer.model, trainer.val_data, T, max(1, fe["tokens"] // T), fe.get("batch_size", 8))
        return r.loss, r.tokens, r.bits_per_byte
    if result is None or result.val_loss is None:
        return float("nan"), 0, None
    cfg, last = trainer.cfg, getattr(trainer, "last_eval", None)
    bpb = last.metrics.get("bits_per_byte") if last is not None else None
    return float(result.val_loss), cfg.eval.batches * cfg.train.batch_size * cfg.seq_len, bpb


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics.jsonl records (none when it has no such file, e.g. a fake trainer's)."""
    with contextlib.suppress(FileNotFoundError):
        return read_metrics(run_dir)
    return []


def _row(sw, variant, seed, cfg, trainer, result, reason, curve, start) -> dict[str, Any]:
    records = layout.read_curve(trainer.run_dir)
    vals = [r["val_loss"] for r in records if r.get("val_loss") is not None and math.isfinite(r["val_loss"])]
    train_losses = [r["loss"] for r in records if "loss" in r]
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    final_val, eval_tokens, final_bpb = _final_loss(sw, trainer, result)
    best_bpb = [r["val_bits_per_byte"] for r in _metrics(trainer.run_dir) if r.get("val_bits_per_byte") is not None]
    status, why = run_status(final_val, reason, sw.limits[str(sw.data_dirs[variant.name])], sw.spec.diverged_above)
    n = trainer.model.num_params()
    return {
        "variant": variant.name, **variant.labels, "seed": seed, "steps": trainer.step, "tokens": trainer.tokens,
        "final_val_loss": final_val, "best_val_loss": min(vals) if vals else float("nan"),
        "final_val_bpb": float("nan") if final_bpb is None else final_bpb,
        "best_val_bpb": min(best_bpb) if best_bpb else float("nan"),
        "final_train_loss": train_losses[-1] if train_losses else float("nan"), "status": status,
        "diverged": status == "diverged", "status_reason": why, "wall_s": round(curve.wall_s, 2),
        "cpu_s": round(curve.cpu_s, 2),
        "tokens_per_s": round(statistics.median(speeds), 1) if speeds else float("nan"),
        "total_params": n["total"], "active_params": n["active"],
        "flops_per_token": trainer.model.flops_per_token(cfg.seq_len),
        "eval_tokens": eval_tokens, "init_seed": cfg.model.init_seed, "data_seed": cfg.train.seed,
        "revision": start["revision"], "tree_clean": start["tree_clean"], "revision_end": code_revision()[0],
        "config_hash": start["config_hash"], "threads": start.get("threads"),
    }
