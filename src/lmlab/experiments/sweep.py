"""Sweeps: train a list of variants of one run config on an equal budget and tabulate them.

    spec = load_spec("ablation.yaml")             # the whole spec is validated before any training
    rows = run_sweep(spec, "sweeps/ablation", jobs=2, threads=1)   # results.csv, summary.md, curves
    lmlab sweep ablation.yaml --out sweeps/ablation --seeds 3 --jobs 2 --threads 1

A spec is a base run config plus variants, each a name and dotted overrides::

    name: depth
    base:                     # a run config (model:, data:, train:), as for `lmlab train --config`
      model: {d_model: 64, n_layers: 4}
      train: {steps: 300}
    seeds: [0, 1, 2]          # or a count: 3. A seed sets model.init_seed AND train.seed (weights and
    seed_fields: [model.init_seed, train.seed]   #  data order); name one of them to vary only it
    quick: {train.steps: 5}   # overrides for every variant under --quick (tests, smoke runs)
    profiles:                 # other named sizes: --profile gpu
      gpu: {overrides: {model.d_model: 512}, seeds: [0, 1, 2]}
    variants:
      - {name: shallow, overrides: {model.n_layers: 2}}
      - {name: deep, overrides: {model.n_layers: 8}, profiles: {gpu: {model.n_layers: 24}}}
      - {name: deep-ft, init_from: deep, overrides: {train.steps: 50, train.lr: 3e-4}}
    grid:                     # optional: the product of these axes is appended to the variants
      - {axis: norm, levels: [{name: pre, overrides: {model.norm_position: pre}}, {name: post, overrides: {model.norm_position: post}}]}
      - {axis: depth, levels: [{name: L2, overrides: {model.n_layers: 2}}, {name: L8, overrides: {model.n_layers: 8}}]}
    tune: {field: train.lr, values: [1e-3, 3e-3, 1e-2], by: [norm], at: {depth: L8}, seeds: [1000]}
    match_active_params: {reference: shallow, tolerance: 0.05}   # optional equal-compute check
    corpus: {name: stdlib}    # optional: train on the deduplicated stdlib corpus (experiments.corpus)
    final_eval: {tokens: 65536}   # optional: the final loss over 65,536 tokens in windows spread over validation

Equal budget: every variant trains on the same tokens (train.steps x batch x seq_len from the
base) unless its overrides say otherwise, and the table reports total and active parameters and
training FLOPs per token for each, so a comparison at unequal compute is visible.

Out directory::

    corpus/                   the experiment corpus, when the spec names one
    data/                     prepared once, shared by every variant
    runs/<variant>/seed<s>/   each a normal run directory (config.yaml, metrics.jsonl, checkpoints/)
                   .../start.json    the config hash and git revision the run started from
                   .../result.json   written atomically when the run is finished: its row
    locks/                    one lock file per run: a run is trained by one process at a time
    tune.csv, tune.json       the tuning runs and the value chosen for each group (with tune:)
    results.csv               one row per variant x seed
    summary.md                mean ± std over seeds per variant
    loss_curves.png           validation loss against training tokens, mean and ±1 std band over seeds

Resuming and reuse: run the same command again. A finished run is reused only if its resolved
config (seed, data and the run it starts from included) hashes the same; a changed spec reruns
the runs it changed and says which field changed. A half-finished run continues from its latest
checkpoint. With ``jobs`` > 1, worker processes claim runs through lock files (``fcntl.flock``,
released if a worker dies), so two workers, or two invocations, never train the same run; each
run's numbers do not depend on which worker trained it.

Labels: a run *diverged* if its loss or gradient went non-finite or its final loss is above
``diverged_above`` (default: ln(vocab), the loss of the untrained uniform prediction); a run
whose final loss is at or above the unigram loss (predicting token frequencies only) is labelled
*no better than unigram*: it trained, but learned nothing about context.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import signal
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..run.checkpoint import local as ckpt
from ..run.checkpoint.atomic import atomic_write_text
from ..run.config import config_diff, load_config
from ..run.data.batches import TokenData
from ..run.data.meta import META, DataMeta
from ..run.data.prepare import prepare
from ..run.checkpoint.directory import CHECKPOINTS
from ..run.errors import one_line
from ..run.evaluate import evaluate
from ..run.metrics import jsonable
from ..run.provenance import code_revision
from ..run.trainer import Trainer, TrainingDiverged
from ..schema import read_yaml
from . import corpus as corpus_mod
from .report import band_plot, figure, fmt, markdown_table, mean_std, write_csv
from .spec import SweepSpec, Tune, Variant, check_active_params, model_accounting, parse_spec  # noqa: F401 (re-exported)

RESULT_FILE = "result.json"  # a finished run: its row of the table
START_FILE = "start.json"  # config hash, revision, and measurements taken at initialization
CURVE_FILE = "curve.jsonl"  # (step, tokens, wall_s, loss | val_loss) as the run goes
POLL_S = 2.0  # how often an idle worker looks for a run whose turn has come
INTERRUPTED = 130  # a worker's exit code after a signal stopped its run

# columns every sweep reports, in table order
COLUMNS = [
    "variant", "seed", "steps", "tokens", "final_val_loss", "best_val_loss", "final_train_loss", "status", "diverged",
    "status_reason", "wall_s", "tokens_per_s", "total_params", "active_params", "flops_per_token", "eval_tokens",
    "init_seed", "data_seed", "revision", "tree_clean", "config_hash",
]
SUMMARY_COLUMNS = ["final_val_loss", "best_val_loss", "wall_s", "tokens_per_s"]
STATUSES = ("ok", "no better than unigram", "diverged")


def load_spec(path: str | Path, *, quick: bool = False, seeds: int | None = None, profile: str | None = None) -> SweepSpec:
    """Read, parse and fully validate a spec file (every variant's config is built)."""
    if quick and profile not in (None, "quick"):
        raise ValueError(f"--quick and --profile {profile} exclude each other; --quick is --profile quick")
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"sweep spec {str(p)!r} does not exist")
    data = read_yaml(p, f"sweep spec {str(p)!r}")  # duplicate keys refused, naming key and lines
    spec = parse_spec(data, str(p))
    if seeds is not None:
        if seeds < 1:
            raise ValueError(f"--seeds={seeds} is not valid; give at least 1")
        spec.seeds = list(range(seeds))
        for prof in spec.profiles.values():
            prof.pop("seeds", None)
    return spec.resolve(quick=quick, profile=profile)


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


def with_corpus(spec: SweepSpec, out: Path, log: Callable[[str], None]) -> tuple[SweepSpec, dict | None]:
    """Build the spec's corpus under out/corpus (once) and point every variant's data at it."""
    if not spec.corpus:
        return spec, None
    meta = corpus_mod.build_corpus(out / "corpus", max_bytes=spec.corpus.get("max_bytes"), log=log)
    source = str((out / "corpus" / corpus_mod.CORPUS_FILE).resolve())
    configs = {n: c.override({"data.source": source}) for n, c in spec.configs.items()}
    return dataclasses.replace(spec, configs=configs), meta


def prepare_shared_data(spec: SweepSpec, out: Path) -> dict[str, Path]:
    """Prepare each distinct data config once (normally one) under out/data; returns variant -> data dir."""
    dirs: dict[str, Path] = {}
    by_config: dict[str, Path] = {}
    for name, cfg in spec.configs.items():
        key = json.dumps({k: v for k, v in cfg.data.to_dict().items() if k != "dir"}, sort_keys=True)
        if key not in by_config:
            d = out / ("data" if not by_config else f"data{len(by_config)}")
            longest = max(c.seq_len for c in spec.configs.values() if c.data == cfg.data)
            prepare(cfg.data, d, seq_len=longest)
            by_config[key] = d
        dirs[name] = by_config[key]
    return dirs


def spread_starts(n_tokens: int, seq_len: int, windows: int) -> np.ndarray:
    """``windows`` start offsets spread evenly over a split of ``n_tokens`` (each window has seq_len + 1 tokens)."""
    last = n_tokens - seq_len - 1
    if last < 0:
        raise ValueError(f"the validation split holds {n_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    return np.unique(np.linspace(0, last, min(windows, last + 1)).round().astype(np.int64))


class SpreadSlice:
    """Evaluation windows spread over a split, in the shape ``evaluate`` reads (``iter_eval``)."""

    def __init__(self, data: TokenData, windows: int):
        self.data, self.windows = data, windows

    def iter_eval(self, batch_size: int, seq_len: int, max_batches: int | None = None) -> Iterator[tuple[Any, Any]]:
        import torch

        tokens = self.data.tokens
        starts = spread_starts(len(tokens), seq_len, self.windows)
        for i in range(0, len(starts), batch_size):
            rows = np.asarray(tokens[starts[i : i + batch_size, None] + np.arange(seq_len + 1)]).astype(np.int64)
            w = torch.from_numpy(rows)
            yield w[:, :-1].contiguous(), w[:, 1:].contiguous()  # (B, T) each


def spread_eval(model, data: TokenData, seq_len: int, windows: int, batch_size: int = 8):
    """``evaluate`` over ``windows`` windows of ``seq_len`` spread evenly over ``data`` (an EvalResult)."""
    return evaluate(model, SpreadSlice(data, windows), batch_size=batch_size, seq_len=seq_len)


def unigram_loss(data_dir: str | Path, seq_len: int | None = None, windows: int | None = None) -> float:
    """Cross-entropy (nats/token) of the training split's token frequencies on the validation
    split (on the targets of ``windows`` spread windows of ``seq_len`` when given): the loss of a
    model that learned nothing but which tokens are common."""
    train, val = TokenData(data_dir, "train"), TokenData(data_dir, "val")
    vocab = max(train.meta.vocab_size, int(max(train.tokens.max(), val.tokens.max())) + 1)
    counts = np.bincount(np.asarray(train.tokens), minlength=vocab).astype(np.float64) + 1.0  # add-one smoothing
    logp = np.log(counts / counts.sum())
    targets = np.asarray(val.tokens)
    if windows and seq_len:
        starts = spread_starts(len(targets), seq_len, windows)
        targets = targets[starts[:, None] + 1 + np.arange(seq_len)].ravel()
    return float(-logp[targets].mean())


# ============================================================== hooks and curves
class Hooks:
    """Extra measurements of an experiment. Each returns columns added to the run's row (JSON-able)."""

    def before_fit(self, trainer, variant: Variant, seed: int, run_dir: Path) -> dict[str, Any]:
        """Called once, at step 0, before training (e.g. gradient norms at initialization)."""
        return {}

    def callbacks(self, variant: Variant, seed: int, run_dir: Path) -> list[Callable]:
        """Trainer callbacks ``cb(trainer, record)`` for this run."""
        return []

    def after_fit(self, trainer, variant: Variant, seed: int, run_dir: Path) -> dict[str, Any]:
        """Called after a run ends (also one that diverged: see ``trainer.model``'s weights), with the trained model."""
        return {}


class CurveLogger:
    """Appends (step, tokens, cumulative wall time, loss / val_loss) to curve.jsonl, continuing after a resume."""

    def __init__(self, run_dir: Path, resumed_step: int):
        self.path = run_dir / CURVE_FILE
        kept = []
        if self.path.is_file():
            kept = [json.loads(ln) for ln in self.path.read_text().splitlines() if ln.strip()]
            kept = [r for r in kept if r["step"] <= resumed_step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self.offset = kept[-1]["wall_s"] if kept else 0.0
        self.start = time.perf_counter()
        self.wall_s = self.offset

    def __call__(self, trainer, record: dict) -> None:
        self.wall_s = self.offset + time.perf_counter() - self.start
        if "loss" in record or "val_loss" in record:
            row = {"step": record["step"], "tokens": trainer.tokens, "wall_s": round(self.wall_s, 3)}
            for key in ("loss", "val_loss", "grad_norm", "tokens_per_s"):
                if key in record:
                    row[key] = record[key]
            if "moe" in record:
                row["max_load"] = [layer.get("max_load") for layer in record["moe"]]
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


def read_curve(run_dir: str | Path) -> list[dict[str, Any]]:
    p = Path(run_dir) / CURVE_FILE
    return [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()] if p.is_file() else []


def run_dir_of(out: Path, variant: str, seed: int) -> Path:
    return Path(out) / "runs" / variant / f"seed{seed}"


class SweepInterrupted(Exception):
    """A run was stopped by a signal; its checkpoint is saved and the sweep resumes on the next call."""


class SweepFailed(RuntimeError):
    """A worker process failed; its traceback is above. Rerunning the same command resumes."""


# ============================================================== one run
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

    def config(self, variant: Variant, seed: int):
        d = self.data_dirs[variant.name]
        return self.spec.seed_config(variant.name, seed).override({"data.dir": str(d.resolve()), "model.vocab_size": self.vocab[str(d)]})

    def key(self, variant: Variant, seed: int) -> str | None:
        """Hash of what decides the run's result, or None while its init_from run is unfinished."""
        parent = None
        if variant.init_from:
            done = read_result(run_dir_of(self.out, variant.init_from, seed))
            if done is None or done.get("config_hash") != self.key(self.spec.variant(variant.init_from), seed):
                return None
            parent = done["config_hash"]
        cfg = self.config(variant, seed).to_dict()
        cfg["data"] = {k: v for k, v in cfg["data"].items() if k not in ("source", "dir")}  # where it lives is not what it is
        blob = json.dumps(jsonable({"config": cfg, "data": self.data_ids[str(self.data_dirs[variant.name])], "init_from": parent,
                                    "final_eval": self.spec.final_eval}), sort_keys=True)
        return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()[:32]

    def lock(self, variant: Variant, seed: int) -> Path:
        return self.out / "locks" / f"{variant.name}.seed{seed}.lock"



def finished(sw: "Sweep", name: str, seed: int) -> bool:
    """Whether the run has a result for exactly its current config."""
    key, done = sw.key(sw.spec.variant(name), seed), read_result(run_dir_of(sw.out, name, seed))
    return key is not None and done is not None and done.get("config_hash") == key


def read_result(run_dir: Path) -> dict | None:
    p = run_dir / RESULT_FILE
    return json.loads(p.read_text()) if p.is_file() else None


def _stale_reason(sw: Sweep, variant: Variant, seed: int, run_dir: Path) -> str:
    """Which field changed since a run in ``run_dir`` started (for the log)."""
    with contextlib.suppress(ValueError, FileNotFoundError, OSError):
        saved = load_config(run_dir / "config.yaml")
        now = sw.config(variant, seed)
        diff = [d for d in config_diff(saved, now) if not d.startswith(("data.dir", "data.source"))]
        if diff:
            return diff[0] + " (then vs now)" + (f" and {len(diff) - 1} more" if len(diff) > 1 else "")
    return "its data, its evaluation slice or the run it starts from changed"


def clear_run(run_dir: Path) -> None:
    """Remove a run's files so it starts again (its lock lives elsewhere and stays held)."""
    if run_dir.is_dir():
        shutil.rmtree(run_dir)


def train_one(sw: Sweep, variant: Variant, seed: int, key: str, tag: str, log: Callable[[str], None]) -> dict[str, Any]:
    """Train (or continue) one run in its directory and return its row; writes result.json last."""
    run_dir = run_dir_of(sw.out, variant.name, seed)
    start = json.loads((run_dir / START_FILE).read_text()) if (run_dir / START_FILE).is_file() else None
    if read_result(run_dir) is not None or (start is not None and start.get("config_hash") != key):
        log(f"{tag}: config changed since it ran: {_stale_reason(sw, variant, seed, run_dir)}; rerunning")
        clear_run(run_dir)
        start = None
    elif start is None and run_dir.exists():  # stopped before it recorded its config hash: nothing says it is this run
        clear_run(run_dir)
    cfg = sw.config(variant, seed)
    t0 = time.perf_counter()
    trainer = sw.trainer_cls(cfg, run_dir, resume=(run_dir / "config.yaml").is_file(), quiet=sw.quiet)
    with contextlib.closing(trainer) if hasattr(trainer, "close") else contextlib.nullcontext():
        start = start or _start(sw, trainer, variant, seed, run_dir, key)
        curve = CurveLogger(run_dir, trainer.step)
        trainer.callbacks = [*getattr(trainer, "callbacks", []), curve, *sw.hooks.callbacks(variant, seed, run_dir)]
        if variant.init_from and trainer.step == 0:
            source = run_dir_of(sw.out, variant.init_from, seed) / CHECKPOINTS
            ckpt.load_weights(trainer.model, ckpt.resolve(source, "latest") / ckpt.WEIGHTS)
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
    atomic_write_text(run_dir / RESULT_FILE, json.dumps(jsonable(row), indent=1) + "\n")
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
    atomic_write_text(run_dir / START_FILE, json.dumps(start) + "\n")
    return start


def run_status(final: float, reason: str, limits: dict[str, float], diverged_above: float | str) -> tuple[str, str]:
    """(status, why): diverged (non-finite, or above ``diverged_above`` / ln vocab), no better than unigram, or ok."""
    if reason:
        return "diverged", reason
    if final is None or not math.isfinite(final):
        return "diverged", "non-finite validation loss"
    cap = limits["init"] if diverged_above == "init" else float(diverged_above)
    if final > cap:
        what = f"ln(vocab) = {cap:.3f}, the untrained model's loss" if diverged_above == "init" else f"{cap:.3f}"
        return "diverged", f"final val loss {final:.3f} above {what}"
    if final >= limits["unigram"]:
        return "no better than unigram", f"final val loss {final:.3f} >= the unigram loss {limits['unigram']:.3f}"
    return "ok", ""


def _final_loss(sw: Sweep, trainer, result) -> tuple[float, int]:
    """The loss every table and report uses: over the spec's spread slice, or the trainer's last evaluation."""
    fe = sw.spec.final_eval
    if fe and result is not None and all(bool(p.isfinite().all()) for p in trainer.model.parameters()):
        T = trainer.cfg.seq_len
        r = spread_eval(trainer.model, trainer.val_data, T, max(1, fe["tokens"] // T), fe.get("batch_size", 8))
        return r.loss, r.tokens
    if result is None or result.val_loss is None:
        return float("nan"), 0
    t = trainer.cfg.train
    return float(result.val_loss), t.eval_batches * t.batch_size * trainer.cfg.seq_len


def _row(sw, variant, seed, cfg, trainer, result, reason, curve, start) -> dict[str, Any]:
    records = read_curve(trainer.run_dir)
    vals = [r["val_loss"] for r in records if r.get("val_loss") is not None and math.isfinite(r["val_loss"])]
    train_losses = [r["loss"] for r in records if "loss" in r]
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    final_val, eval_tokens = _final_loss(sw, trainer, result)
    status, why = run_status(final_val, reason, sw.limits[str(sw.data_dirs[variant.name])], sw.spec.diverged_above)
    n = trainer.model.num_params()
    return {
        "variant": variant.name, **variant.labels, "seed": seed, "steps": trainer.step, "tokens": trainer.tokens,
        "final_val_loss": final_val, "best_val_loss": min(vals) if vals else float("nan"),
        "final_train_loss": train_losses[-1] if train_losses else float("nan"), "status": status,
        "diverged": status == "diverged", "status_reason": why, "wall_s": round(curve.wall_s, 2),
        "tokens_per_s": round(statistics.median(speeds), 1) if speeds else float("nan"),
        "total_params": n["total"], "active_params": n["active"], "flops_per_token": trainer.model.flops_per_token(cfg.seq_len),
        "eval_tokens": eval_tokens, "init_seed": cfg.model.init_seed, "data_seed": cfg.train.seed,
        "revision": start["revision"], "tree_clean": start["tree_clean"], "revision_end": code_revision()[0],
        "config_hash": start["config_hash"], "threads": start.get("threads"),
    }


# ============================================================== claiming runs, workers
@contextlib.contextmanager
def claim(lock: Path) -> Iterator[bool]:
    """Hold an exclusive, non-blocking ``flock`` on ``lock`` for the duration: True if this
    process got it. The kernel releases it when the holder exits, however it exits."""
    import fcntl

    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def work(sw: Sweep, tasks: Sequence[tuple[int, str, int]], log: Callable[[str], None], announce: bool = True) -> None:
    """Train every task (index, variant, seed) not yet done, claiming each; returns when all are done.
    A task whose init_from run is unfinished waits; a task another process holds is skipped until free."""
    total, parent = len(tasks), os.getppid()
    pending = []
    for task in tasks:
        i, name, seed = task
        if not finished(sw, name, seed):
            pending.append(task)
        elif announce:
            done = read_result(run_dir_of(sw.out, name, seed))
            log(f"[{i}/{total}] {name} seed {seed}: done earlier (val loss {fmt(done['final_val_loss'])})")
    while pending:
        if os.getppid() != parent:  # orphaned: whoever started us is gone
            raise SweepInterrupted("the sweep's main process exited; stopping")
        progressed = False
        for task in list(pending):
            i, name, seed = task
            variant = sw.spec.variant(name)
            key = sw.key(variant, seed)
            if key is None:
                continue  # its init_from run is not finished yet
            if finished(sw, name, seed):  # another process finished it
                pending.remove(task)
                continue
            with claim(sw.lock(variant, seed)) as mine:
                if mine and not finished(sw, name, seed):
                    train_one(sw, variant, seed, key, f"[{i}/{total}] {name} seed {seed}", log)
                if mine:
                    pending.remove(task)
                    progressed = True
        if pending and not progressed:
            time.sleep(POLL_S)


def _worker(sw: Sweep, tasks: list, number: int, threads: int | None) -> None:
    """A worker process: its own process group (the main process forwards signals), one thread count."""
    import torch

    os.setpgid(0, 0)
    if threads:
        torch.set_num_threads(threads)
    try:
        work(sw, tasks, lambda m: print(f"[worker {number}] {m}", flush=True), announce=number == 1)
    except SweepInterrupted as e:
        print(f"[worker {number}] {e}", flush=True)
        os._exit(INTERRUPTED)


def execute(sw: Sweep, jobs: int, threads: int | None, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Run every variant x seed of ``sw`` (in ``jobs`` processes), then read the rows back in spec order."""
    tasks = [(i, name, s) for i, (name, s) in enumerate(sw.spec.tasks(), 1)]
    if jobs <= 1:
        work(sw, tasks, log)
    else:
        ctx = multiprocessing.get_context("spawn")
        threads = threads or max(1, (os.cpu_count() or 1) // jobs)  # never more threads than cores in all
        procs = [ctx.Process(target=_worker, args=(sw, tasks, n, threads), daemon=False) for n in range(1, jobs + 1)]
        for p in procs:
            p.start()
        _join(procs)
        codes = [p.exitcode for p in procs]
        missing = [f"{name} seed {seed}" for _, name, seed in tasks if not finished(sw, name, seed)]
        if missing and any(c == INTERRUPTED for c in codes):
            raise SweepInterrupted(f"sweep {sw.spec.name} stopped by a signal; rerun the same command to resume")
        if missing:
            raise SweepFailed(f"a worker of sweep {sw.spec.name} failed (exit codes {codes}; its error is above) and "
                              f"{len(missing)} runs are unfinished ({missing[0]}, ...); rerun the same command to resume")
        if any(c != 0 for c in codes):  # another worker finished what the failed one left
            log(f"a worker exited with code {[c for c in codes if c != 0][0]}, but every run finished")
    return [read_result(run_dir_of(sw.out, name, seed)) for _, name, seed in tasks]


def _join(procs: list) -> None:
    """Wait for the workers; the first Ctrl-C / SIGTERM asks each to checkpoint and stop, a second Ctrl-C stops them at once."""
    asked = []

    def forward(signum, frame):
        stop = signal.SIGINT if asked and signum == signal.SIGINT else signal.SIGTERM
        asked.append(signum)
        for p in procs:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, stop)

    handlers = {}
    with contextlib.suppress(ValueError):  # not the main thread: no handlers, plain joins
        handlers = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for p in procs:
            p.join()
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


# ============================================================== the sweep
@contextlib.contextmanager
def setup_lock(out: Path) -> Iterator[None]:
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


def setup(spec: SweepSpec, out: Path, hooks: Hooks, trainer_cls, quiet: bool, log) -> tuple[Sweep, dict | None]:
    """Corpus, shared data, data identities and loss limits: everything before the first run."""
    with setup_lock(out):
        spec, corpus_meta = with_corpus(spec, out, log)
        data_dirs = prepare_shared_data(spec, out)
    limits, ids, vocabs = {}, {}, {}
    fe = spec.final_eval
    for d in set(data_dirs.values()):
        seq = max(c.seq_len for n, c in spec.configs.items() if data_dirs[n] == d)
        vocabs[str(d)] = vocab = DataMeta.open(d).vocab_size
        limits[str(d)] = {"unigram": unigram_loss(d, seq, max(1, fe["tokens"] // seq)) if fe else unigram_loss(d),
                          "init": math.log(vocab)}
        ids[str(d)] = data_identity(d)
    return Sweep(spec, out, hooks, trainer_cls, quiet, data_dirs, ids, limits, vocabs), corpus_meta


def check_parallel(jobs: int, threads: int | None) -> None:
    """One-line errors for a bad ``--jobs`` / ``--threads``."""
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"--jobs={jobs} is not valid; give the number of worker processes, at least 1")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"--threads={threads} is not valid; give torch threads per process, at least 1")


@dataclasses.dataclass
class Outcome:
    """What a finished sweep hands to an experiment's analysis."""

    spec: SweepSpec  # resolved, with tuned values applied and the corpus as data source
    rows: list[dict[str, Any]]
    limits: dict[str, float]  # the first data dir's {"unigram", "init"}
    data_dir: Path
    corpus: dict | None  # corpus.json, when the spec names a corpus
    tune: dict | None  # tune.json, when the spec tunes


def run_sweep(
    spec: SweepSpec, out: str | Path, *, hooks: Hooks | None = None, quiet: bool = True,
    trainer_cls: Any = None, log: Callable[[str], None] = print, jobs: int = 1, threads: int | None = None,
) -> list[dict[str, Any]]:
    """Train every variant x seed of a resolved ``spec`` in ``out`` (resuming and reusing what is
    there; after a tuning sweep when the spec has ``tune``), then write results.csv, summary.md and
    loss_curves.png. Returns the rows. ``jobs`` worker processes with ``threads`` torch threads each."""
    return sweep_outcome(spec, out, hooks=hooks, quiet=quiet, trainer_cls=trainer_cls, log=log, jobs=jobs, threads=threads).rows


def sweep_outcome(
    spec: SweepSpec, out: str | Path, *, hooks: Hooks | None = None, quiet: bool = True,
    trainer_cls: Any = None, log: Callable[[str], None] = print, jobs: int = 1, threads: int | None = None,
) -> Outcome:
    """:func:`run_sweep`, returning everything the analysis needs (see :class:`Outcome`)."""
    check_parallel(jobs, threads)
    if not spec.configs:
        spec = spec.resolve(profile=spec.profile)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    trainer_cls, hooks = trainer_cls or Trainer, hooks or Hooks()
    tune = None
    if spec.tune is not None:
        spec, tune = tune_and_apply(spec, out, trainer_cls, quiet, log, jobs, threads)
    sw, corpus_meta = setup(spec, out, hooks, trainer_cls, quiet, log)
    rows = execute(sw, jobs, threads, log)
    write_tables(sw.spec, rows, out)
    with contextlib.suppress(ImportError):
        plot_loss_curves(sw.spec, out, out / "loss_curves.png")
    first = sw.data_dirs[sw.spec.variants[0].name]
    return Outcome(sw.spec, rows, sw.limits[str(first)], first, corpus_meta, tune)


def tune_and_apply(spec: SweepSpec, out: Path, trainer_cls, quiet: bool, log, jobs: int, threads) -> tuple[SweepSpec, dict]:
    """Run the tuning sweep (its runs live beside the others, named tune-*), choose each group's
    value, write tune.csv and tune.json, and return the spec with the choices applied."""
    tspec = spec.tune_spec()
    log(f"tuning {spec.tune.field} over {spec.tune.values}: {len(tspec.variants)} runs x {len(tspec.seeds)} seeds")
    sw, _ = setup(tspec, out, Hooks(), trainer_cls, quiet, log)
    rows = execute(sw, jobs, threads, log)
    choices, table = choose(spec.tune, rows)
    write_csv(rows, out / "tune.csv", scalar_columns(rows))
    info = jsonable({"field": spec.tune.field, "values": spec.tune.values, "by": spec.tune.by, "at": spec.tune.at,
                     "seeds": spec.tune.seeds, "chosen": choices, "table": table})
    atomic_write_text(out / "tune.json", json.dumps(info, indent=1) + "\n")
    log("chosen " + ", ".join(f"{g}: {v}" for g, v in choices.items()))
    if edges := grid_edge_text(info):
        log("note: " + edges.strip())
    return spec.with_tuned(choices), info


def choose(tune: Tune, rows: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Each group's value with the lowest mean final validation loss over seeds (a diverged seed
    counts as +inf; ties keep the first value). Pure: rows in, choice out."""
    table, choices = [], {}
    for group in dict.fromkeys(r["tune_group"] for r in rows):
        best, best_loss = None, math.inf
        for value in tune.values:
            losses = [r["final_val_loss"] if r["status"] != "diverged" else math.inf
                      for r in rows if r["tune_group"] == group and r["tune_value"] == str(value)]
            loss = statistics.fmean(losses) if losses else math.inf
            table.append({"group": group, "value": value, "mean_final_val_loss": loss if math.isfinite(loss) else None,
                          "runs": len(losses)})
            if loss < best_loss:
                best, best_loss = value, loss
        choices[group] = best if best is not None else tune.values[0]
    return choices, table


def grid_edges(tune: dict | None) -> dict[str, Any]:
    """Groups whose chosen value is the smallest or largest of a numeric grid: their best value may
    lie beyond the grid, so a comparison against them may be against an under-tuned arm."""
    values = (tune or {}).get("values") or []
    if len(values) < 2 or not all(isinstance(v, (int, float)) for v in values):
        return {}
    return {g: v for g, v in tune["chosen"].items() if v in (min(values), max(values))}


def grid_edge_text(tune: dict | None) -> str:
    """One sentence naming the groups tuned to an edge of the grid ("" when none is)."""
    edges = grid_edges(tune)
    if not edges:
        return ""
    return ("Chosen at an edge of the grid, so the best value may lie beyond it: "
            + ", ".join(f"{g} {v:g}" for g, v in edges.items()) + ". ")


# ============================================================== tables and plots
def scalar_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The standard columns, then any label and scalar extra columns the rows carry (lists go elsewhere)."""
    extra = []
    for r in rows:
        for k, v in r.items():
            if k not in COLUMNS and k not in extra and not isinstance(v, (list, dict)):
                extra.append(k)
    labels = [k for k in extra if all(isinstance(r.get(k), str) for r in rows)]
    return COLUMNS[:1] + labels + COLUMNS[1:] + [k for k in extra if k not in labels]


def summarize(rows: list[dict[str, Any]], columns: Sequence[str] = SUMMARY_COLUMNS) -> list[dict[str, Any]]:
    """One row per variant (in first-seen order): mean ± std over seeds of ``columns``, statuses counted."""
    out = []
    for name in dict.fromkeys(r["variant"] for r in rows):
        group = [r for r in rows if r["variant"] == name]
        first = group[0]
        out.append({
            "variant": name, "seeds": len(group),
            "diverged": f"{sum(r.get('status') == 'diverged' for r in group)}/{len(group)}",
            "no better than unigram": f"{sum(r.get('status') == 'no better than unigram' for r in group)}/{len(group)}",
            **{c: mean_std([r.get(c, float("nan")) for r in group]) for c in columns},
            "total_params": first["total_params"], "active_params": first["active_params"],
            "flops_per_token": f"{first['flops_per_token'] / 1e6:.2f}M",
        })
    return out


def eval_slice_text(spec: SweepSpec) -> str:
    """How final_val_loss was measured, for summary.md and every report (the same slice for both)."""
    if spec.final_eval:
        return (f"final_val_loss: mean next-token loss over {spec.final_eval['tokens']:,} validation tokens, in windows of "
                "the run's seq_len spread evenly over the whole validation split, after the last step")
    t = spec.configs[spec.variants[0].name].train
    return f"final_val_loss: the trainer's last evaluation, over the first {t.eval_batches} x {t.batch_size} windows of the validation split"


def write_tables(spec: SweepSpec, rows: list[dict[str, Any]], out: Path) -> None:
    write_csv(rows, out / "results.csv", scalar_columns(rows))
    text = (f"# Sweep {spec.name}\n\n{spec.description}\n\nMean ± std over seeds {spec.seeds} (each seed sets "
            f"{' and '.join(spec.seed_fields)}). {eval_slice_text(spec)}. diverged: the loss went non-finite or ended above "
            f"{'ln(vocab)' if spec.diverged_above == 'init' else spec.diverged_above}; no better than unigram: ended at or "
            "above the loss of predicting token frequencies only.\n\n" + markdown_table(summarize(rows)))
    atomic_write_text(out / "summary.md", text)


def seed_curves(out: Path, name: str, seeds: Sequence[int], key: str = "val_loss", x: str = "tokens") -> list[list[tuple[float, float]]]:
    """Per seed, the (x, key) points of a variant's curve where ``key`` was logged."""
    return [[(r[x], r[key]) for r in read_curve(run_dir_of(out, name, s)) if r.get(key) is not None] for s in seeds]


def plot_loss_curves(spec: SweepSpec, out: Path, path: Path, variants: Sequence[str] | None = None,
                     x: str = "tokens", title: str | None = None) -> None:
    """Validation loss against training tokens (or wall_s) for every variant: mean over seeds, ±1 std band."""
    plt = figure()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in variants or [v.name for v in spec.variants]:
        band_plot(ax, seed_curves(out, name, spec.seeds_of(spec.variant(name)), x=x), label=name)
    ax.set_xlabel("training tokens" if x == "tokens" else "wall time (s)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(title or f"{spec.name}: validation loss (mean ± 1 std over {len(spec.seeds)} seeds)")
    ax.grid(alpha=0.3)
    if len(ax.lines) <= 16:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
