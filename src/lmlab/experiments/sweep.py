"""Sweeps: train a list of variants of one run config on an equal budget and tabulate them.

    spec = load_spec("ablation.yaml")             # the whole spec is validated before any training
    rows = run_sweep(spec, "sweeps/ablation")      # results.csv, summary.md, loss curves
    lmlab sweep ablation.yaml --out sweeps/ablation --seeds 3

A spec is a base run config plus variants, each a name and dotted overrides::

    name: depth
    base:                     # a run config (model:, data:, train:), as for `lmlab train --config`
      model: {d_model: 64, n_layers: 4}
      train: {steps: 300}
    seeds: [0, 1]             # or a count: 2
    quick: {train.steps: 5}   # overrides for every variant under --quick (tests, smoke runs)
    variants:
      - {name: shallow, overrides: {model.n_layers: 2}}
      - {name: deep, overrides: {model.n_layers: 8}}
      - {name: deep-ft, init_from: deep, overrides: {train.steps: 50, train.lr: 3e-4}}
    grid:                     # optional: the product of these axes is appended to the variants
      - [{name: pre, overrides: {model.norm_position: pre}}, {name: post, overrides: {model.norm_position: post}}]
      - [{name: L2, overrides: {model.n_layers: 2}}, {name: L8, overrides: {model.n_layers: 8}}]
    match_active_params: {reference: shallow, tolerance: 0.05}   # optional equal-compute check

Equal budget: every variant trains on the same tokens (train.steps x batch x seq_len from the
base) unless its overrides say otherwise, and the table reports total and active parameters and
training FLOPs per token for each, so a comparison at unequal compute is visible.

Out directory::

    data/                     prepared once, shared by every variant (byte tokenizer, builtin corpus by default)
    runs/<variant>/seed<s>/   each a normal run directory (config.yaml, metrics.jsonl, checkpoints/)
                   .../result.json   written atomically when the run is finished: the resume marker
    results.csv               one row per variant x seed
    summary.md                mean ± std over seeds per variant
    loss_curves.png           validation loss against training tokens

An interrupted sweep (Ctrl-C, a crash, a killed machine) resumes by running the same command:
finished runs (those with result.json) are read back, a half-finished run continues from its
latest checkpoint, and the rest start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..model import Transformer
from ..run import checkpoint as ckpt
from ..run.atomic import atomic_write_text
from ..run.config import RunConfig
from ..run.data import TokenData, prepare
from ..run.directory import CHECKPOINTS
from ..run.errors import one_line
from ..run.metrics import jsonable
from ..run.trainer import Trainer, TrainingDiverged
from ..schema import read_yaml, suggest
from .report import figure, fmt, markdown_table, mean_std, write_csv

RESULT_FILE = "result.json"  # a finished run: its row of the table
START_FILE = "start.json"  # measurements taken at initialization, kept across resumes
CURVE_FILE = "curve.jsonl"  # (step, tokens, wall_s, loss | val_loss) as the run goes

# columns every sweep reports, in table order
COLUMNS = [
    "variant", "seed", "steps", "tokens", "final_val_loss", "best_val_loss", "final_train_loss", "diverged",
    "diverge_reason", "wall_s", "tokens_per_s", "total_params", "active_params", "flops_per_token",
]
SUMMARY_COLUMNS = ["final_val_loss", "best_val_loss", "wall_s", "tokens_per_s"]


# ============================================================== the spec
@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    overrides: dict[str, Any]  # dotted RunConfig fields, applied to the base
    init_from: str | None = None  # start from this earlier variant's final weights (same seed)
    quick: dict[str, Any] = dataclasses.field(default_factory=dict)  # extra overrides under --quick
    labels: dict[str, str] = dataclasses.field(default_factory=dict)  # grid axis -> level, for analysis


@dataclasses.dataclass
class SweepSpec:
    name: str
    base: dict[str, Any]  # flattened dotted base config
    variants: list[Variant]
    seeds: list[int]
    quick: dict[str, Any]
    diverged_above: float | str = "unigram"  # a final val loss above this counts as diverged
    match_active_params: dict[str, Any] | None = None
    description: str = ""
    source: str = "<spec>"
    configs: dict[str, Any] = dataclasses.field(default_factory=dict)  # variant -> RunConfig, filled by resolve()
    is_quick: bool = False

    def variant(self, name: str) -> Variant:
        return next(v for v in self.variants if v.name == name)

    def resolve(self, *, quick: bool = False) -> "SweepSpec":
        """Build and validate every variant's RunConfig (and the equal-compute check) before any
        training. A bad override raises one line naming the spec, the variant and the field."""
        self.is_quick = quick
        self.configs = {}
        try:
            base = RunConfig().override({**self.base, **(self.quick if quick else {})})
        except ValueError as e:
            raise ValueError(f"{self.source}: base config: {one_line(e)}") from None
        for v in self.variants:
            try:
                self.configs[v.name] = base.override({**v.overrides, **(v.quick if quick else {})})
            except ValueError as e:
                raise ValueError(f"{self.source}: variant {v.name!r}: {one_line(e)}") from None
        if self.match_active_params:
            check_active_params(self)
        return self


def _flat_overrides(data: Any, where: str) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a mapping of dotted fields to values, e.g. {{model.n_layers: 6}}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value and not str(key).endswith("moe"):
            out.update({f"{key}.{k}": v for k, v in _flat_overrides(value, where).items()})
        else:
            out[str(key)] = value
    return out


SPEC_KEYS = ("name", "description", "base", "variants", "grid", "seeds", "quick", "diverged_above", "match_active_params")
VARIANT_KEYS = ("name", "overrides", "init_from", "quick")


def _variant(raw: Any, where: str, labels: dict[str, str] | None = None) -> Variant:
    if not isinstance(raw, Mapping) or "name" not in raw:
        raise ValueError(f"{where} must be a mapping with a name, e.g. {{name: deep, overrides: {{model.n_layers: 8}}}}")
    unknown = [k for k in raw if k not in VARIANT_KEYS]
    if unknown:
        raise ValueError(f"{where} ({raw['name']!r}) has unknown key {unknown[0]!r}{suggest(unknown[0], VARIANT_KEYS)}; "
                         f"valid keys: {', '.join(VARIANT_KEYS)}")
    name = str(raw["name"])
    if not name or any(c in name for c in "/\\ ") or name.startswith("."):
        raise ValueError(f"{where}: variant name {name!r} must be non-empty, without spaces or slashes (it names a directory)")
    return Variant(name, _flat_overrides(raw.get("overrides"), f"variant {name!r} overrides"), raw.get("init_from"),
                   _flat_overrides(raw.get("quick"), f"variant {name!r} quick"), dict(labels or {}))


def parse_spec(data: Any, source: str = "<spec>") -> SweepSpec:
    """A spec from its parsed YAML (see the module docstring); raises a one-line ValueError."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: a sweep spec is a mapping with base: and variants: (or grid:)")
    unknown = [k for k in data if k not in SPEC_KEYS]
    if unknown:
        raise ValueError(f"{source}: unknown key {unknown[0]!r}{suggest(str(unknown[0]), SPEC_KEYS)}; valid keys: {', '.join(SPEC_KEYS)}")
    base = data.get("base") or {}
    if not isinstance(base, Mapping):
        raise ValueError(f"{source}: base must be a run config mapping with model:, data:, train: sections")
    variants = [_variant(v, f"{source}: variants[{i}]") for i, v in enumerate(data.get("variants") or [])]
    grid = data.get("grid") or []
    if grid:
        if not isinstance(grid, list) or not all(isinstance(axis, Mapping) and "levels" in axis for axis in grid):
            raise ValueError(f"{source}: grid must be a list of axes, each {{axis: NAME, levels: [{{name:, overrides:}}, ...]}}")
        axes = [(str(a.get("axis", f"axis{i}")), [_variant(v, f"{source}: grid[{i}].levels[{j}]") for j, v in enumerate(a["levels"])])
                for i, a in enumerate(grid)]
        for combo in itertools.product(*(levels for _, levels in axes)):
            overrides: dict[str, Any] = {}
            quick: dict[str, Any] = {}
            for level in combo:
                overrides.update(level.overrides)
                quick.update(level.quick)
            labels = {axis: level.name for (axis, _), level in zip(axes, combo)}
            variants.append(Variant("-".join(level.name for level in combo), overrides, None, quick, labels))
    if not variants:
        raise ValueError(f"{source}: no variants; list some under variants: or grid:")
    names = [v.name for v in variants]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise ValueError(f"{source}: variant name {dup!r} appears twice; names must be unique")
    for i, v in enumerate(variants):
        if v.init_from is not None and v.init_from not in names[:i]:
            raise ValueError(f"{source}: variant {v.name!r}: init_from={v.init_from!r} is not an earlier variant; "
                             f"choose one of {names[:i]}")
    seeds = data.get("seeds", [0])
    if isinstance(seeds, int) and not isinstance(seeds, bool):
        seeds = list(range(seeds))
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise ValueError(f"{source}: seeds={seeds!r} is not valid; give a count (3) or a list of integers ([0, 1, 2])")
    diverged_above = data.get("diverged_above", "unigram")
    if diverged_above != "unigram" and not isinstance(diverged_above, (int, float)):
        raise ValueError(f"{source}: diverged_above={diverged_above!r} is not valid; give a loss in nats or 'unigram'")
    match = data.get("match_active_params")
    if match is not None and (not isinstance(match, Mapping) or match.get("reference") not in names):
        raise ValueError(f"{source}: match_active_params needs reference: <a variant name> (and tolerance: 0.05); "
                         f"variants: {names}")
    return SweepSpec(
        name=str(data.get("name") or Path(source).stem), base=_flat_overrides(base, "base"), variants=variants,
        seeds=seeds, quick=_flat_overrides(data.get("quick"), "quick"), diverged_above=diverged_above,
        match_active_params=dict(match) if match else None, description=str(data.get("description") or ""), source=source,
    )


def load_spec(path: str | Path, *, quick: bool = False, seeds: int | None = None) -> SweepSpec:
    """Read, parse and fully validate a spec file (every variant's config is built)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"sweep spec {str(p)!r} does not exist")
    data = read_yaml(p, f"sweep spec {str(p)!r}")  # duplicate keys refused, naming key and lines
    spec = parse_spec(data, str(p))
    if seeds is not None:
        if seeds < 1:
            raise ValueError(f"--seeds={seeds} is not valid; give at least 1")
        spec.seeds = list(range(seeds))
    return spec.resolve(quick=quick)


# ============================================================== accounting
def model_accounting(model_cfg, seq_len: int) -> dict[str, float]:
    """Total and active parameters and training FLOPs per token of a model config (built on the CPU)."""
    model = Transformer(model_cfg)
    n = model.num_params()
    return {"total_params": n["total"], "active_params": n["active"], "flops_per_token": model.flops_per_token(seq_len)}


def check_active_params(spec: SweepSpec) -> dict[str, dict[str, float]]:
    """Equal compute: every variant's active parameters per token within ``tolerance`` of the reference's."""
    ref_name = spec.match_active_params["reference"]
    tol = float(spec.match_active_params.get("tolerance", 0.05))
    counts = {name: model_accounting(cfg.model, cfg.seq_len) for name, cfg in spec.configs.items()}
    ref = counts[ref_name]["active_params"]
    for name, c in counts.items():
        rel = c["active_params"] / ref - 1
        if abs(rel) > tol:
            raise ValueError(
                f"{spec.source}: variant {name!r} has {c['active_params']:,} active parameters, {rel:+.1%} from the "
                f"reference {ref_name!r} ({ref:,}); match_active_params allows ±{tol:.0%}: adjust its expert widths"
            )
    return counts


def unigram_loss(data_dir: str | Path) -> float:
    """Cross-entropy (nats/token) of the training split's token frequencies on the validation split:
    the loss of a model that learned nothing but which tokens are common."""
    train, val = TokenData(data_dir, "train"), TokenData(data_dir, "val")
    vocab = max(int(train.meta["vocab_size"]), int(max(train.tokens.max(), val.tokens.max())) + 1)
    counts = np.bincount(np.asarray(train.tokens), minlength=vocab).astype(np.float64) + 1.0  # add-one smoothing
    logp = np.log(counts / counts.sum())
    return float(-logp[np.asarray(val.tokens)].mean())


# ============================================================== hooks
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


# ============================================================== running
def run_dir_of(out: Path, variant: str, seed: int) -> Path:
    return out / "runs" / variant / f"seed{seed}"


class SweepInterrupted(Exception):
    """A run was stopped by a signal; its checkpoint is saved and the sweep resumes on the next call."""


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


def run_sweep(
    spec: SweepSpec, out: str | Path, *, hooks: Hooks | None = None, quiet: bool = True,
    trainer_cls: Any = None, log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Train every variant x seed of a resolved ``spec`` in ``out`` (resuming what is there), then
    write results.csv, summary.md and loss_curves.png. Returns the rows."""
    if not spec.configs:
        spec.resolve(quick=spec.is_quick)
    trainer_cls = trainer_cls or Trainer
    hooks = hooks or Hooks()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data_dirs = prepare_shared_data(spec, out)
    threshold = {d: (unigram_loss(d) if spec.diverged_above == "unigram" else float(spec.diverged_above))
                 for d in set(data_dirs.values())}
    rows: list[dict[str, Any]] = []
    total = len(spec.variants) * len(spec.seeds)
    for i, (variant, seed) in enumerate(((v, s) for v in spec.variants for s in spec.seeds), 1):
        run_dir = run_dir_of(out, variant.name, seed)
        done = run_dir / RESULT_FILE
        tag = f"[{i}/{total}] {variant.name} seed {seed}"
        if done.is_file():
            rows.append(json.loads(done.read_text()))
            log(f"{tag}: done earlier (val loss {fmt(rows[-1]['final_val_loss'])})")
            continue
        cfg = spec.configs[variant.name].override({"train.seed": seed, "data.dir": str(data_dirs[variant.name])})
        resume = (run_dir / "config.yaml").is_file()
        t0 = time.perf_counter()
        trainer = trainer_cls(cfg, run_dir, resume=resume, quiet=quiet)
        with contextlib.closing(trainer) if hasattr(trainer, "close") else contextlib.nullcontext():
            start = _start_measurements(trainer, hooks, variant, seed, run_dir)
            curve = CurveLogger(run_dir, trainer.step)
            trainer.callbacks = [*getattr(trainer, "callbacks", []), curve, *hooks.callbacks(variant, seed, run_dir)]
            if variant.init_from and trainer.step == 0:
                source = run_dir_of(out, variant.init_from, seed) / CHECKPOINTS
                ckpt.load_weights(trainer.model, ckpt.resolve(source, "latest") / ckpt.WEIGHTS)
            reason, result = "", None
            try:
                result = trainer.fit()
            except TrainingDiverged as e:
                reason = f"non-finite loss/gradient: {one_line(e)[:120]}"
            if result is not None and result.stopped_by is not None:
                raise SweepInterrupted(f"{tag} stopped at step {trainer.step}; rerun the same command to resume")
            row = _row(spec, variant, seed, cfg, trainer, result, reason, curve, threshold[data_dirs[variant.name]])
            row.update(start)
            row.update(hooks.after_fit(trainer, variant, seed, run_dir))
        atomic_write_text(done, json.dumps(jsonable(row), indent=1) + "\n")
        rows.append(row)
        log(f"{tag}: val loss {fmt(row['final_val_loss'])}{' DIVERGED' if row['diverged'] else ''} "
            f"({time.perf_counter() - t0:.0f} s)")
    write_tables(spec, rows, out)
    with contextlib.suppress(ImportError):
        plot_loss_curves(spec, out, out / "loss_curves.png")
    return rows


def _start_measurements(trainer, hooks: Hooks, variant: Variant, seed: int, run_dir: Path) -> dict[str, Any]:
    path = run_dir / START_FILE
    if path.is_file():
        return json.loads(path.read_text())
    if getattr(trainer, "step", 0) != 0:  # resumed without measurements: they cannot be taken any more
        return {}
    start = jsonable(hooks.before_fit(trainer, variant, seed, run_dir))
    atomic_write_text(path, json.dumps(start) + "\n")
    return start


def _row(spec, variant, seed, cfg, trainer, result, reason, curve, threshold) -> dict[str, Any]:
    records = read_curve(trainer.run_dir)
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    train_losses = [r["loss"] for r in records if "loss" in r]
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    final_val = result.val_loss if result is not None else float("nan")
    finite_vals = [v for v in vals if v is not None and math.isfinite(v)]
    best_val = min(finite_vals) if finite_vals else float("nan")
    if not reason:
        if final_val is None or not math.isfinite(final_val):
            reason = "non-finite validation loss"
        elif final_val > threshold:
            reason = f"final val loss {final_val:.3f} above {threshold:.3f}" + (
                " (the unigram loss: learned nothing beyond token frequencies)" if spec.diverged_above == "unigram" else "")
    row = {
        "variant": variant.name, **variant.labels, "seed": seed, "steps": trainer.step, "tokens": trainer.tokens,
        "final_val_loss": final_val if final_val is not None else float("nan"), "best_val_loss": best_val,
        "final_train_loss": train_losses[-1] if train_losses else float("nan"),
        "diverged": bool(reason), "diverge_reason": reason, "wall_s": round(curve.wall_s, 2),
        "tokens_per_s": round(statistics.median(speeds), 1) if speeds else float("nan"),
        "total_params": 0, "active_params": 0, "flops_per_token": 0.0,
    }
    n = trainer.model.num_params()
    row.update(total_params=n["total"], active_params=n["active"],
               flops_per_token=trainer.model.flops_per_token(cfg.seq_len))
    return row



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
    """One row per variant (in first-seen order): mean ± std over seeds of ``columns``, divergences counted."""
    out = []
    for name in dict.fromkeys(r["variant"] for r in rows):
        group = [r for r in rows if r["variant"] == name]
        first = group[0]
        out.append({
            "variant": name, "seeds": len(group), "diverged": f"{sum(bool(r['diverged']) for r in group)}/{len(group)}",
            **{c: mean_std([r.get(c, float("nan")) for r in group]) for c in columns},
            "total_params": first["total_params"], "active_params": first["active_params"],
            "flops_per_token": f"{first['flops_per_token'] / 1e6:.2f}M",
        })
    return out


def write_tables(spec: SweepSpec, rows: list[dict[str, Any]], out: Path) -> None:
    write_csv(rows, out / "results.csv", scalar_columns(rows))
    summary = summarize(rows)
    text = (f"# Sweep {spec.name}\n\n{spec.description}\n\nMean ± std over seeds {spec.seeds}. "
            f"diverged: runs whose loss went non-finite or ended above {spec.diverged_above}.\n\n" + markdown_table(summary))
    atomic_write_text(out / "summary.md", text)


def plot_loss_curves(spec: SweepSpec, out: Path, path: Path, variants: Sequence[str] | None = None,
                     x: str = "tokens", title: str | None = None) -> None:
    """Validation loss against training tokens (or wall_s) for every variant (first seed)."""
    plt = figure()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in variants or [v.name for v in spec.variants]:
        curve = [r for r in read_curve(run_dir_of(out, name, spec.seeds[0])) if r.get("val_loss") is not None]
        if curve:
            ax.plot([r[x] for r in curve], [r["val_loss"] for r in curve], marker=".", label=name)
    ax.set_xlabel("training tokens" if x == "tokens" else "wall time (s)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(title or f"{spec.name}: validation loss")
    ax.grid(alpha=0.3)
    if len(ax.lines) <= 16:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
