"""Claim 2, measured: rotary positions let context be extended by adjusting the rotation range.

Every trained model is evaluated at 1x, 2x, 4x, 8x and 16x its training length L, on validation
windows spread over the whole split, and each long evaluation is split by position: *in range*
(positions < L, which training covered) and *beyond range* (positions >= L). Learned positions
stop at their table ("n/a", never a crash). The trained rope model is also evaluated with linear
(PI), NTK-aware and YaRN scaling applied zero-shot at factor = length / L. The rope-ft-* variants
fine-tune rope's weights at 8L with no scaling, PI and YaRN, at a constant learning rate; the
same measurements are taken at 8 points of each fine-tune (SNAPSHOT_FRACTIONS and its end).

A retrieval probe sits beside the loss (an induction/copy probe in the manner of Olsson et al.
2022): a window of validation text carries a K-token segment at one place and again at its end,
the segment as rope-copy's ``train.repeats.source`` plants it (random token ids, which only copying
predicts, or the text's own); the probe is the mean log-probability and the argmax accuracy of the
repeat's tokens 2..K. "far" puts the first copy at position 0 (distance ~ the window length, beyond
L at 8x and 16x), "near" L/2 before the repeat (in range as a distance, at positions beyond L).
Models trained on plain text do not learn to copy at this size, so rope-copy and its fine-tunes
(rope-copy-ft-*) train with planted repeats (``train.repeats``); retrieval beyond range is judged
only once in-range accuracy reaches COPY_GATE.

A spec may add a planted-lookup arm (positions-retrieval.yaml): LOOKUP_ARM, rope trained with a passkey
in its text (``train.lookup``), and its fine-tunes. Every run that plants lookups is probed by
``retrieval.lookup_metrics`` instead of the loss-by-length and copy probes (its lookups at 1x, 2x, 4x and 8x,
its fine-tunes' snapshots at 1x and 8x), all with LOOKUP_ARM's lookup config and training length as L;
LOOKUP_ARM is also probed at 8x with PI and YaRN applied zero-shot. Its claims are gated by
``retrieval.lookup_gates``. The report shows an exploratory reading beside the registered ft-extension
verdicts: the extension effect at single snapshots, the last included (:func:`exploratory_extension`).

The claims, their arms, endpoints and margins are registered in positions.yaml; this module supplies
the endpoints they name (``ENDPOINTS``) and the copy gate (:func:`copy_gates`); ``decide.decide_claims``
applies the registered rules.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..model import Transformer
from ..run.checkpoint.atomic import atomic_write_text
from . import retrieval
from .decide import Endpoint, decide_claims, registration_text, write_decisions
from .registration import registration_record
from .report import band_plot, figure, markdown_table, read_csv, report_header, save
from .stats import Interval, label, mean_interval
from .sweep import Hooks as SweepHooks
from .sweep.measure import spread_eval, spread_starts
from .sweep.tables import eval_slice_text

MULTIPLES = (1, 2, 4, 8, 16)
LONG = (8, 16)  # lengths whose per-position curves and copy probes are kept
METHODS = {"pi": "linear", "ntk": "ntk", "yarn": "yarn"}  # report name -> rope.scaling
FT_METHODS = ("none", "pi", "yarn")
DISPLAY = {"none": "no scaling", "pi": "PI", "ntk": "NTK", "yarn": "YaRN"}
# of a fine-tune's steps: with its last, 8 points (12, 25, 50, 100, 150, 200, 300, 400 of 400), a curve
# rather than one endpoint, whose early points show an effect that a long fine-tune washes out (as YaRN's
# did in the first positions runs: extension_gap)
SNAPSHOT_FRACTIONS = (1 / 32, 1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 3 / 4)
COPY_K = 16  # copy-probe segment length: train.repeats.length of the rope-copy variants
# Probes per distance, from the spread of the per-probe mean log-prob (COPY_SD): the standard error is
# COPY_SD / sqrt(n). Measured on the pilot of rope-copy's setting (positions.yaml p4; 1x, 128 probes
# every 100 steps): sd 0.15, 0.20, 0.13 and 0.06 nats at steps 300-600, largest at the gate (acc 0.57
# at step 400), where a model half copies; 100 probes would give 0.02 there. COPY_N doubles the sd for
# the fine-tunes' 8x probes, which may spread more: 400 give 0.02 at sd 0.4 (0.01 at the measured 0.2),
# and COPY_N_CURVE (the 16x probes, the snapshots' 8x) 0.02 at the measured sd. The first text-repeat
# model, which did not copy, spread 0.85 and needed 1800; 400 probes at 8x are 0.2M tokens of forward
# passes (83 s on one thread of a loaded 2-core CPU).
COPY_SD = 0.2  # measured per-probe sd of copy_1x_logp at the gate (rope-copy's pilot)
COPY_N, COPY_N_CURVE = round((2 * COPY_SD / 0.02) ** 2), round((COPY_SD / 0.02) ** 2)  # 400, 100
COPY_N_QUICK = 32  # the quick profile's: a smoke test, seconds
COPY_BATCH = 8  # probe windows per forward pass
COPY_GATE = 0.5  # in-range copy accuracy (copy_1x_acc) a model must reach before its retrieval beyond range is judged
SNAPSHOTS = "snapshots.json"
LOOKUP_ARM = "rope-lookup"  # the run whose lookup config and training length every lookup probe uses
LOOKUP_MULTIPLES = (1, 2, 4, 8)  # a lookup run's probes at its end (the fine-tunes' snapshots: 1x and 8x)
LOOKUP_ZERO_SHOT = 8  # LOOKUP_ARM is probed with PI and YaRN at this factor, zero-shot (exploratory)
NA_LEARNED = "n/a — learned table ends at {L}"


# ============================================================== measurements
def eval_tokens(spec) -> int:
    return spec.final_eval["tokens"] if spec.final_eval else 16384


def length_metrics(model, data, L: int, multiples, tokens: int) -> dict[str, Any]:
    """loss_{m}x over ~``tokens`` validation tokens at length m L; for m > 1 also in_{m}x (positions
    < L) and beyond_{m}x (>= L); pp_{m}x, the loss at each position, for the LONG lengths."""
    out: dict[str, Any] = {}
    for m in multiples:
        T = m * L
        try:
            r = spread_eval(model, data, T, max(1, tokens // T), batch_size=max(1, min(8, 2048 // T)))
        except ValueError as e:
            if "learned" not in str(e):
                raise
            out[f"loss_{m}x"] = NA_LEARNED.format(L=model.config.max_seq_len)
            continue
        out[f"loss_{m}x"] = r.loss
        if m > 1:
            out[f"in_{m}x"] = statistics.fmean(r.per_position[:L])
            out[f"beyond_{m}x"] = statistics.fmean(r.per_position[L:])
        if m in LONG:
            out[f"pp_{m}x"] = [round(v, 4) for v in r.per_position]
    return out


@torch.no_grad()
def copy_probe(model, data, length: int, first_at: int, k: int = COPY_K, n: int = COPY_N,
               source: str = "text", alphabet: int | None = None) -> dict[str, float]:
    """How well ``model`` continues a repeat: ``n`` windows of ``length`` validation tokens, spread
    over the split (deterministic), each with a k-token segment at [first_at, first_at + k) written
    again at its end (the first copy ``length - k - first_at`` tokens back), as ``train.repeats``
    plants them in training. ``source`` as ``train.repeats.source``: ``text``, the window's own text
    at first_at is repeated; ``random``, k ids drawn uniformly from ``data.plantable_ids`` (by a
    generator seeded 0: the same probes at every call; the first ``alphabet`` of them when given, as
    ``train.repeats.alphabet``) are written at both places, so only copying predicts the repeat (a
    uniform guess over the V ids drawn from scores logp -ln V, acc ~1/V). Over the repeat's tokens 2..k
    (the first cues it): ``logp``, the mean log-probability per probe averaged over probes, a measure
    that moves before accuracy does, and ``acc``, argmax accuracy; each with its standard error over
    probes (``logp_se``, ``acc_se``)."""
    starts = spread_starts(len(data.tokens), length, n)
    x = np.stack([np.asarray(data.tokens[s : s + length]) for s in starts]).astype(np.int64)  # (n, length)
    if source == "random":
        ids = data.plantable_ids[:alphabet]
        x[:, first_at : first_at + k] = ids[torch.randint(len(ids), (n, k), generator=torch.Generator().manual_seed(0))]
    elif source != "text":
        raise ValueError(f"copy probe source={source!r} is not a valid choice; choose one of ['text', 'random']")
    x[:, length - k :] = x[:, first_at : first_at + k]
    target = torch.from_numpy(x[:, length - k + 1 :])  # (n, k-1): the repeat's tokens 2..k
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    logp, hit = [], []
    try:
        for i in range(0, len(x), COPY_BATCH):
            xb = torch.from_numpy(x[i : i + COPY_BATCH]).to(device)  # (b, length)
            logits = model(xb).logits[:, length - k : length - 1].float()  # (b, k-1): predicting tokens 2..k
            lp = torch.log_softmax(logits, -1).cpu()  # (b, k-1, V)
            t = target[i : i + COPY_BATCH, :, None]  # (b, k-1, 1)
            logp.append(lp.gather(-1, t)[..., 0].mean(-1))  # (b,)
            hit.append((lp.argmax(-1) == t[..., 0]).double().mean(-1))  # (b,)
    finally:
        model.train(was)
    out = {}
    for name, v in (("logp", torch.cat(logp).double()), ("acc", torch.cat(hit))):
        out[name] = float(v.mean())
        out[f"{name}_se"] = float(v.std() / math.sqrt(len(v))) if len(v) > 1 else float("nan")
    return out


def copy_metrics(model, data, L: int, probes: dict[int, int], source: str = "text",
                 alphabet: int | None = None) -> dict[str, float]:
    """For each multiple m of ``probes`` (m -> how many probes): copy_1x_* for m = 1 (first copy at
    0: in range), else copy_{m}x_far_* (first copy at 0, about the window length back) and
    copy_{m}x_near_* (L/2 back, at positions beyond L); each ``logp``, ``acc`` and their ``_se``
    (:func:`copy_probe`, segments of ``source`` and ``alphabet``: the same keys whichever they are)."""
    k = min(COPY_K, L // 4)
    where: dict[str, tuple[int, int, int]] = {}  # key -> (window, first copy at, probes)
    for m, n in probes.items():
        T = m * L
        if m == 1:
            where["copy_1x"] = (L, 0, n)
        elif model.config.positions != "learned" or T <= model.config.max_seq_len:
            where.update({f"copy_{m}x_far": (T, 0, n), f"copy_{m}x_near": (T, T - k - L // 2, n)})
    return {f"{key}_{name}": v for key, (T, first, n) in where.items()
            for name, v in copy_probe(model, data, T, first, k, n, source, alphabet).items()}


def rescaled(model, method: str, factor: float, original: int):
    """The same weights under another rope scaling (rotary has no parameters; only the angles change)."""
    cfg = model.config.override({"rope.scaling": method, "rope.factor": factor, "rope.original_max_seq_len": original})
    m = Transformer(cfg)
    m.load_state_dict(model.state_dict())
    return m.to(next(model.parameters()).device)


class Snapshots:
    """Trainer callback: at the given steps, measure the fine-tune and keep it in snapshots.json (resume-safe)."""

    def __init__(self, run_dir: Path, steps: set[int], measure):
        self.path, self.steps, self.measure = run_dir / SNAPSHOTS, steps, measure

    def read(self) -> dict[str, Any]:
        return json.loads(self.path.read_text()) if self.path.is_file() else {}

    def __call__(self, trainer, record: dict) -> None:
        done = self.read()
        if record["step"] in self.steps and str(record["step"]) not in done:
            done[str(record["step"])] = self.measure(trainer.model, trainer.val_data)
            atomic_write_text(self.path, json.dumps(done) + "\n")


def snapshot_steps(total: int) -> set[int]:
    """The steps of a ``total``-step fine-tune measured before its end (after_fit measures the end)."""
    return {max(1, round(total * f)) for f in SNAPSHOT_FRACTIONS} - {total}


def probe_counts(spec) -> tuple[int, int]:
    """(probes at a run's end and in range, probes of the snapshots' and 16x curves): COPY_N and COPY_N_CURVE, or
    the quick profile's COPY_N_QUICK for both."""
    return (COPY_N_QUICK, COPY_N_QUICK) if spec.is_quick else (COPY_N, COPY_N_CURVE)


class Hooks(SweepHooks):
    def __init__(self, spec):
        self.L = spec.configs["rope"].seq_len  # the training length of every scheme
        self.tokens = eval_tokens(spec)
        self.steps = {name: cfg.train.steps for name, cfg in spec.configs.items()}
        n, curve = probe_counts(spec)
        self.copy_end = {1: n, 8: n, 16: curve}  # at a run's end: the claim's lengths at COPY_N
        self.copy_snapshot = {1: n, 8: curve}  # at a fine-tune's snapshots
        # what every run's probes plant: rope-copy's train.repeats.source and alphabet, so the probe asks what it was
        # trained on; the same for every scheme, so their copy figures compare
        repeats = spec.configs["rope-copy"].train.repeats if "rope-copy" in spec.configs else None
        self.copy_source = repeats.source if repeats is not None else "text"
        self.copy_alphabet = repeats.alphabet if repeats is not None else None
        # the runs that plant lookups take lookup probes, at the counts the copy probes take at the same points
        self.lookup_runs = lookup_arms(spec)
        self.lookup, self.lookup_L = lookup_setting(spec)
        self.lookup_end = {m: n for m in LOOKUP_MULTIPLES}
        self.lookup_snapshot = dict(self.copy_snapshot)

    def lookup_measure(self, model, data, probes: dict[int, int]) -> dict[str, Any]:
        return retrieval.lookup_metrics(model, data, self.lookup, self.lookup_L, probes)

    def snapshot_measure(self, name: str) -> Callable:
        """What a fine-tune's snapshots measure: lookups for a run that plants them, else :meth:`ft_measure`."""
        if name in self.lookup_runs:
            return lambda model, data: self.lookup_measure(model, data, self.lookup_snapshot)
        return self.ft_measure

    def ft_measure(self, model, data) -> dict[str, Any]:
        m = {
            k: v
            for k, v in length_metrics(model, data, self.L, (1, *LONG), self.tokens).items()
            if not k.startswith("pp_")
        }
        return {**m, **copy_metrics(model, data, self.L, self.copy_snapshot, self.copy_source, self.copy_alphabet)}

    def callbacks(self, variant, seed, run_dir):
        steps = snapshot_steps(self.steps[variant.name])
        return [Snapshots(run_dir, steps, self.snapshot_measure(variant.name))] if variant.init_from else []

    def after_fit(self, trainer, variant, seed, run_dir) -> dict[str, Any]:
        model, data, L = trainer.model, trainer.val_data, self.L
        if variant.name in self.lookup_runs:
            out = self.lookup_measure(model, data, self.lookup_end)
        else:
            out = {**length_metrics(model, data, L, MULTIPLES, self.tokens),
                   **copy_metrics(model, data, L, self.copy_end, self.copy_source, self.copy_alphabet)}
        if variant.init_from:
            snaps = Snapshots(run_dir, set(), self.snapshot_measure(variant.name)).read()
            out["snapshots"] = {**snaps, str(trainer.step): {k: v for k, v in out.items() if not k.startswith("pp_")}}
        if variant.name == "rope":  # zero-shot context extension of the trained model
            for name, method in METHODS.items():
                for m in MULTIPLES[1:]:
                    r = length_metrics(rescaled(model, method, float(m), L), data, L, (m,), self.tokens)
                    out.update({f"zs_{name}_{k}": v for k, v in r.items() if not k.startswith("pp_") or m == 16})
                for m in LONG:
                    probe = copy_probe(rescaled(model, method, float(m), L), data, m * L, 0, min(COPY_K, L // 4),
                                       self.copy_end[m], self.copy_source, self.copy_alphabet)
                    out.update({f"zs_{name}_copy_{m}x_far_{k}": v for k, v in probe.items()})
        if variant.name == LOOKUP_ARM:  # exploratory: retrieval at 8x with the rotation range adjusted, no training
            m, Lk = LOOKUP_ZERO_SHOT, self.lookup_L
            for name in ("pi", "yarn"):
                probe = self.lookup_measure(rescaled(model, METHODS[name], float(m), Lk), data, {m: self.lookup_end[m]})
                out.update({f"zs_{name}_{k}": v for k, v in probe.items() if not k.startswith("chance_")})
        return out


def lookup_arms(spec) -> list[str]:
    """The variants whose training plants lookups (``train.lookup``): rope-lookup and its fine-tunes."""
    return [v.name for v in spec.variants if spec.configs[v.name].train.lookup is not None]


def lookup_setting(spec):
    """(LOOKUP_ARM's lookup config, its training length): what every lookup probe plants, and its L; (None, None)
    for a spec without lookups."""
    if not lookup_arms(spec):
        return None, None
    if LOOKUP_ARM not in spec.configs or spec.configs[LOOKUP_ARM].train.lookup is None:
        raise ValueError(f"variants {lookup_arms(spec)} plant lookups (train.lookup), but the spec has no "
                         f"{LOOKUP_ARM!r} variant with train.lookup to take the probes' lookup config and length "
                         "from; add it")
    cfg = spec.configs[LOOKUP_ARM]
    return cfg.train.lookup, cfg.seq_len


# ============================================================== reading the rows
def num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else float("nan")


def seeds_of(rows: list[dict], variant: str) -> dict[int, dict]:
    return {r["seed"]: r for r in rows if r["variant"] == variant}


def ft_value(r: dict, step: str | None, key: str) -> float:
    """A fine-tune's measurement at snapshot ``step`` (None: its last)."""
    snaps = r.get("snapshots") or {}
    if step is None:
        step = max(snaps, key=int) if snaps else None
    return num((snaps.get(step) or {}).get(key)) if step else num(r.get(key))


def extension_effect(r: dict, base: dict, step: str | None, m: int = 8) -> float:
    """(scaled - unscaled fine-tune) beyond range minus the same in range, at m x: < 0 means the
    scaling helps specifically where the positions are new, an extension effect."""
    return ((ft_value(r, step, f"beyond_{m}x") - ft_value(base, step, f"beyond_{m}x"))
            - (ft_value(r, step, f"in_{m}x") - ft_value(base, step, f"in_{m}x")))


def _m(v: list[float]) -> str:
    v = [x for x in v if math.isfinite(x)]
    return f"{statistics.fmean(v):.3f}" if v else "—"


# ============================================================== endpoints of the registered claims
def per_seed(value: Callable[[dict], float]) -> Endpoint:
    """An endpoint (``decide.Endpoint``) from one number per run: seed -> value, where the run measured it."""
    def endpoint(rows: list[dict], init_loss: float) -> dict[int, float]:
        values = {r["seed"]: value(r) for r in rows}
        return {s: v for s, v in values.items() if math.isfinite(v)}

    return endpoint


def zero_shot_gain(m: int) -> Endpoint:
    """rope with YaRN at factor m minus unscaled rope, beyond range at m x: the same trained weights."""
    return per_seed(lambda r: num(r.get(f"zs_yarn_beyond_{m}x")) - num(r.get(f"beyond_{m}x")))


def extension_gap(r: dict) -> float:
    """Beyond-range minus in-range loss at 8x, averaged over every measured point of a fine-tune (its
    snapshots and its end; NaN unless all were measured). A scaled fine-tune's gap minus the unscaled
    one's is the extension effect over the whole fine-tune, not at one endpoint: in the first run,
    YaRN's effect was -0.05 nats after 25 steps and gone by 400 (found by the review that led to the
    registered rerun)."""
    snaps = list((r.get("snapshots") or {}).values())
    gaps = [num(s.get("beyond_8x")) - num(s.get("in_8x")) for s in snaps]
    return statistics.fmean(gaps) if gaps and all(math.isfinite(g) for g in gaps) else float("nan")


ENDPOINTS: dict[str, Endpoint] = {
    "zs_yarn_gain_8x": zero_shot_gain(8),
    "zs_yarn_gain_16x": zero_shot_gain(16),
    "growth_8x": per_seed(lambda r: num(r.get("beyond_8x")) - num(r.get("loss_1x"))),  # loss growth past range
    "extension_gap": per_seed(extension_gap),
    "copy_8x_far_logp": per_seed(lambda r: ft_value(r, None, "copy_8x_far_logp")),  # at the fine-tune's end
    **retrieval.ENDPOINTS,  # lookup_8x_far_logp and _exact, at the fine-tune's end
}


def copy_claims(spec) -> list:
    """The claims a copy gate may apply to: all but the lookup claims (``retrieval.lookup_gates`` gates those)."""
    return [c for c in spec.claims if c.endpoint not in retrieval.ENDPOINTS]


def gates(spec, rows: list[dict]) -> dict[str, str]:
    """claim id -> why its registered gate failed: a copy claim's (:func:`copy_gates`) or a lookup claim's
    (``retrieval.lookup_gates``)."""
    return {**copy_gates(spec, rows), **retrieval.lookup_gates(spec, rows)}


def copy_accuracy(rows: list[dict], arm: str) -> list[float]:
    """An arm's in-range copy accuracy (copy_1x_acc) per seed that measured it."""
    acc = [num(r.get("copy_1x_acc")) for r in seeds_of(rows, arm).values()]
    return [a for a in acc if math.isfinite(a)]


def copy_gates(spec, rows: list[dict]) -> dict[str, str]:
    """claim id -> why its gate failed. A claim with a gate (retrieval) is tested only once the model its
    fine-tunes start from copies in range: that parent's mean copy_1x_acc at least COPY_GATE; a model that
    does not copy a repeated segment even within its training length has no retrieval to extend."""
    out = {}
    for c in copy_claims(spec):
        arm = c.compare[0]
        parent = spec.variant(arm).init_from if c.gate and isinstance(arm, str) and arm in spec.configs else None
        if parent is None:
            continue
        acc = copy_accuracy(rows, parent)
        if not acc:
            out[c.id] = f"untestable: {parent} has no in-range copy accuracy (copy_1x_acc)"
        elif statistics.fmean(acc) < COPY_GATE:
            out[c.id] = (f"untestable: {parent}'s in-range copy accuracy is {statistics.fmean(acc):.3f}, "
                         f"below the gate {COPY_GATE:g}: the model does not copy within its training length")
    return out


def lost_copying(spec, rows: list[dict]) -> dict[str, str]:
    """claim id -> why the amendment of 2 December 2026 (positions.yaml) leaves it untestable: a gated claim's
    compared arms must copy in range too (mean copy_1x_acc at least COPY_GATE), not only the model they were
    fine-tuned from. Every text-only fine-tune of rope-copy forgot how to copy, so their difference at 8x far
    compared two models that copy at no distance. Decided after the results, so it leaves the claim in the
    Holm family as registered (``decide_claims``'s ``amended``)."""
    out = {}
    for c in copy_claims(spec):
        for arm in (a for a in c.compare if c.gate and isinstance(a, str) and a in spec.configs):
            acc = copy_accuracy(rows, arm)
            if acc and statistics.fmean(acc) < COPY_GATE:
                out[c.id] = (f"untestable by the amendment after the results: {arm}'s in-range copy accuracy is "
                             f"{statistics.fmean(acc):.3f}, below the gate {COPY_GATE:g}; it forgot how to copy in "
                             f"its fine-tune from {spec.variant(arm).init_from}")
                break
    return out


# ============================================================== tables
def _ms(values: list[float], digits: int = 3) -> str:
    v = [x for x in values if math.isfinite(x)]
    if not v:
        return "—"
    return (
        f"{statistics.fmean(v):.{digits}f} ± {statistics.stdev(v):.{digits}f}" if len(v) > 1 else f"{v[0]:.{digits}f}"
    )


def scheme_table(rows: list[dict], names: list[str]) -> list[dict]:
    out = []
    for n in names:
        runs = list(seeds_of(rows, n).values())
        na = runs and isinstance(runs[0].get("loss_8x"), str)
        row = {"scheme": n, "1× loss": _ms([num(r.get("loss_1x")) for r in runs]),
               "final val bpb": _ms([num(r.get("final_val_bpb")) for r in runs])}
        for m in LONG:
            for part in ("in", "beyond"):
                row[f"{m}× {part}"] = "n/a" if na else _ms([num(r.get(f"{part}_{m}x")) for r in runs])
        row["copy 1× acc"] = _ms([num(r.get("copy_1x_acc")) for r in runs], 2)
        for m in LONG:
            row[f"copy {m}× far logp"] = "n/a" if na else _ms([num(r.get(f"copy_{m}x_far_logp")) for r in runs], 2)
        out.append(row)
    return out


def zero_shot_table(rows: list[dict]) -> list[dict]:
    runs = list(seeds_of(rows, "rope").values())
    out = [
        {
            "rope": "no scaling",
            **{f"{m}× {p}": _ms([num(r.get(f"{p}_{m}x")) for r in runs]) for m in LONG for p in ("in", "beyond")},
            "copy 8× far logp": _ms([num(r.get("copy_8x_far_logp")) for r in runs], 2),
        }
    ]
    for name in METHODS:
        out.append({"rope": f"{name}, zero-shot", **{f"{m}× {p}": _ms([num(r.get(f"zs_{name}_{p}_{m}x")) for r in runs])
                                                   for m in LONG for p in ("in", "beyond")},
                    "copy 8× far logp": _ms([num(r.get(f"zs_{name}_copy_8x_far_logp")) for r in runs], 2)})
    return out


def finetune_table(rows: list[dict]) -> list[dict]:
    """Per method and snapshot: losses, copy, and the extension effect's interval against the unscaled fine-tune."""
    base = seeds_of(rows, "rope-ft-none")
    steps = sorted({s for r in rows if r["variant"].startswith("rope-ft") for s in (r.get("snapshots") or {})}, key=int)
    out = []
    for method in FT_METHODS:
        runs = seeds_of(rows, f"rope-ft-{method}")
        for step in steps:
            effect = [extension_effect(runs[s], base[s], step) for s in runs if s in base] if method != "none" else []
            out.append(
                {
                    "fine-tune": method,
                    "steps": int(step),
                    **{f"8× {p}": _ms([ft_value(r, step, f"{p}_8x") for r in runs.values()]) for p in ("in", "beyond")},
                    "16× beyond": _ms([ft_value(r, step, "beyond_16x") for r in runs.values()]),
                    "copy 8× far logp": _ms([ft_value(r, step, "copy_8x_far_logp") for r in runs.values()], 2),
                    "extension effect vs none [95% CI]": mean_interval(effect).text() if effect else "—",
                }
            )
    return out


LOOKUP_PROBES = (("1× in range", "lookup_1x"), ("1× farthest", "lookup_1x_far"),
                 *((f"{m}× {d}", f"lookup_{m}x_{d}") for m in LOOKUP_MULTIPLES[1:] for d in ("far", "near")))


def lookup_table(rows: list[dict], arms: list[str]) -> list[dict]:
    """Per lookup arm (each at its end): exact match at every probe and the log-prob at 8x far, mean ± std over
    seeds; LOOKUP_ARM's zero-shot PI and YaRN readings at LOOKUP_ZERO_SHOT x after it."""
    out = []
    zero_shot = [(LOOKUP_ARM, f"zs_{m}_", f"{LOOKUP_ARM}, {DISPLAY[m]} zero-shot ×{LOOKUP_ZERO_SHOT}")
                 for m in ("pi", "yarn")]
    for arm, prefix, name in [(a, "", a) for a in arms] + zero_shot:
        runs = list(seeds_of(rows, arm).values())
        if arm not in arms or not any(f"{prefix}lookup_{LOOKUP_ZERO_SHOT}x_far_exact" in r for r in runs):
            continue
        row = {"variant": name, **{col: _ms([num(r.get(f"{prefix}{key}_exact")) for r in runs], 2)
                                   for col, key in LOOKUP_PROBES}}
        row["8× far logp"] = _ms([num(r.get(f"{prefix}lookup_8x_far_logp")) for r in runs], 2)
        out.append(row)
    return out


def lookup_snapshot_table(rows: list[dict], arms: list[str]) -> list[dict]:
    """Per lookup fine-tune and snapshot: exact match in range and at 8x far and near, and the 8x far log-prob."""
    steps = sorted({s for r in rows if r["variant"] in arms for s in (r.get("snapshots") or {})}, key=int)
    probes = (("1× in range", "lookup_1x"), ("8× far", "lookup_8x_far"), ("8× near", "lookup_8x_near"))
    out = []
    for arm in arms:
        runs = seeds_of(rows, arm).values()
        for step in steps if any(r.get("snapshots") for r in runs) else []:
            out.append({"fine-tune": arm, "steps": int(step),
                        **{name: _ms([ft_value(r, step, f"{key}_exact") for r in runs], 2) for name, key in probes},
                        "8× far logp": _ms([ft_value(r, step, "lookup_8x_far_logp") for r in runs], 2)})
    return out


# ============================================================== exploratory: the extension effect at single snapshots
def snapshot_effects(rows: list[dict], arm: str, base: str, step: str | None) -> dict[int, float]:
    """seed -> :func:`extension_effect` of fine-tune ``arm`` against ``base`` at snapshot ``step`` (None: each
    run's last), over the seeds both measured."""
    a, b = seeds_of(rows, arm), seeds_of(rows, base)
    values = {s: extension_effect(a[s], b[s], step) for s in sorted(a) if s in b}
    return {s: v for s, v in values.items() if math.isfinite(v)}


def margin_reading(iv: Interval, margin: float) -> str:
    """Where a 95% interval lies against ± ``margin``: inside it, wholly below or above it, or across an edge."""
    if not (math.isfinite(iv.lo) and math.isfinite(iv.hi)):
        return "no interval"
    if -margin < iv.lo and iv.hi < margin:
        return f"inside ±{margin:g}"
    if iv.hi < -margin:
        return f"below −{margin:g}"
    if iv.lo > margin:
        return f"above +{margin:g}"
    return f"across ±{margin:g}"


def exploratory_extension(decisions, rows: list[dict]) -> list[dict]:
    """For each registered claim on extension_gap, the extension effect at every single snapshot of its
    fine-tunes, the last included: per seed, its paired 95% interval and where that lies against the claim's
    margin. Exploratory: read after earlier runs, so not tested and outside the Holm family."""
    out = []
    for d in decisions:
        c = d.spec
        if c.endpoint != "extension_gap" or len(c.compare) != 2:
            continue
        arm, base = c.compare
        steps = sorted({s for r in rows if r["variant"] in (arm, base) for s in (r.get("snapshots") or {})}, key=int)
        for step in steps:
            effects = snapshot_effects(rows, arm, base, step)
            iv = mean_interval(list(effects.values()))
            out.append({"claim": c.id, "step": f"{step} (last)" if step == steps[-1] else step, "seeds": len(effects),
                        "per seed": ", ".join(f"{v:+.3f}" for v in effects.values()) or "—",
                        "effect [95% CI]": iv.text() if effects else "—",
                        "95% CI against the margin": margin_reading(iv, c.margin) if effects else "—"})
    return out


def exploratory_text(decisions, rows: list[dict]) -> str:
    """The report's exploratory section: the registered ft-extension verdicts, then the single-snapshot readings."""
    registered = [d for d in decisions if d.spec.endpoint == "extension_gap"]
    if not registered:
        return ""
    lines = [f"{d.spec.id}, registered (extension_gap, the mean over every measured point): {label(d.verdict)}, "
             f"{d.comparison.decision.interval.text() + ' ' + d.spec.unit if d.comparison else 'not measured'}"
             f"{' (' + d.untestable + ')' if d.untestable else ''}." for d in registered]
    table = exploratory_extension(decisions, rows)
    return ("### Exploratory: the extension effect at single fine-tune snapshots\n\n"
            "Exploratory, not tested, outside the Holm family: no verdict. A single snapshot, the last included, was "
            "read after the first runs (the registered endpoint, extension_gap, averages every measured point), so "
            "these readings stand beside the registered verdicts, not in place of them. Per seed: (scaled − unscaled "
            "fine-tune) beyond range minus the same in range at 8×, in nats (below 0: the scaling helps where the "
            "positions are new); the paired 95% t interval over seeds, and where it lies against the claim's "
            "registered margin (inside it: no effect as large as the margin).\n\n"
            + "\n\n".join(lines) + "\n\n"
            + (markdown_table(table) if table else "No fine-tune snapshot was measured.\n") + "\n")


# ============================================================== plots
def plot_lengths(rows: list[dict], out: Path, names: list[str], L: int, seeds: list[int]) -> str:
    plt = figure()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for n in names:
        runs = seeds_of(rows, n)
        curves = [[(m * L, num(r.get("loss_1x") if m == 1 else r.get(f"beyond_{m}x"))) for m in MULTIPLES
                   if math.isfinite(num(r.get("loss_1x") if m == 1 else r.get(f"beyond_{m}x")))] for r in runs.values()]
        band_plot(ax, curves, label=n, linestyle="--" if n.startswith("rope-ft") else "-", marker="o")
    ax.axvline(L, color="gray", linestyle=":", label=f"training length {L}")
    ax.set_xscale("log", base=2)
    ax.set_xticks([m * L for m in MULTIPLES], [str(m * L) for m in MULTIPLES])
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("loss at 1x; beyond-range loss at longer lengths")
    ax.set_title(f"Loss beyond the training length ({L}), mean ± 1 std over seeds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return save(fig, out / "loss_by_length.png")


def _smooth(v: list[float], w: int) -> list[float]:
    c = np.cumsum(np.insert(np.asarray(v, dtype=float), 0, 0.0))
    return [(c[i + 1] - c[max(0, i + 1 - w)]) / min(i + 1, w) for i in range(len(v))]


def plot_per_position(rows: list[dict], out: Path, names: list[str], L: int, key: str, fname: str, title: str) -> str:
    plt = figure()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    w = max(1, L // 4)
    for n in names:
        curves = [[(i, y) for i, y in enumerate(_smooth(r[key], w))] for r in seeds_of(rows, n).values() if r.get(key)]
        band_plot(ax, curves, label=n, marker=None)
    ax.axvline(L, color="gray", linestyle=":", label=f"training length {L}")
    ax.set_xlabel("position in the window (tokens)")
    ax.set_ylabel(f"loss at position (nats/token, running mean of {w})")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save(fig, out / fname)


def plot_finetune(rows: list[dict], out: Path, lookup: bool = False) -> str:
    """The fine-tunes' snapshots: the extension claims' (beyond-range loss) and the retrieval claims' (the copy
    log-prob of rope-copy-ft-*, or with ``lookup`` the lookup log-prob of rope-lookup-ft-*), at 8x."""
    plt = figure()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    retrieval_arm, key = (f"{LOOKUP_ARM}-ft", "lookup_8x_far_logp") if lookup else ("rope-copy-ft", "copy_8x_far_logp")
    for method in FT_METHODS:
        for ax, arm, k in zip(axes, ("rope-ft", retrieval_arm), ("beyond_8x", key)):
            runs = seeds_of(rows, f"{arm}-{method}").values()
            points = [((r.get("snapshots") or {}).items()) for r in runs]
            curves = [sorted((int(s), y) for s, v in p if math.isfinite(y := num(v.get(k)))) for p in points]
            band_plot(ax, curves, label=method, marker="o")
    for ax, what in zip(axes, ("rope-ft-*: beyond-range loss at 8x",
                               f"{LOOKUP_ARM}-ft-*: lookup log-prob, pair at the start, 8x" if lookup else
                               "rope-copy-ft-*: copy log-prob, first copy at 0, 8x")):
        if ax.has_data():  # a panel whose fine-tunes measured nothing stays empty (log scale needs a point)
            ax.set_xscale("log")
            ax.legend(fontsize=8)
        ax.set_xlabel("fine-tune steps at 8x")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    return save(fig, out / "finetune_steps.png")


# ============================================================== markdown and analysis
def lookup_text(spec, rows: list[dict], arms: list[str]) -> str:
    """The report's retrieval section for a spec with lookup arms: what was planted and probed, and the tables."""
    cfg, (lk, L) = spec.configs[LOOKUP_ARM], lookup_setting(spec)
    fts = [a for a in arms if spec.variant(a).init_from]
    ft = spec.configs[fts[0]] if fts else None
    c = retrieval.chance(lk)
    snaps = lookup_snapshot_table(rows, fts)
    n, near, lengths = probe_counts(spec)[0], retrieval.near_distance(lk, L), ", ".join(
        f"{m}×" for m in LOOKUP_MULTIPLES[1:])
    return (
        "### Retrieval: the planted lookup (exact match, mean ± std over seeds)\n\n"
        f"{LOOKUP_ARM} is rope at d_model {cfg.model.d_model} trained at context {L} for {cfg.train.steps} steps with "
        f"{lk.pairs} key-value pair{'s' * (lk.pairs > 1)} (a key of {lk.keys} ids, a value of {lk.value_length} of "
        f"{lk.values} ids) planted in every training window and asked {lk.queries} times"
        + (f"; {', '.join(fts)} fine-tune it at {ft.seq_len} tokens ({ft.train.steps} steps), the lookups still "
           f"planted at distances up to {ft.train.lookup.max_distance}" if ft else "")
        + f". Every lookup run is probed with {LOOKUP_ARM}'s lookup config and L = {L}: in range (1×, distances "
        f"spread over the trained range; 1× farthest, the pair at the window's start), and in windows of "
        f"{lengths} L with the pair at the start (far: beyond L) or {near} tokens back of the query (near: a "
        f"trained distance at positions beyond L); {n} probes per distance at "
        f"a run's end. Exact match = the value's every id is the argmax. Chance: exact {c['exact']:.4f} (guessing "
        + (f"a value), {c['exact_copy']:.2f} (copying a planted value without matching its key)" if lk.pairs > 1 else
           "a value; with one pair, copying its value is the lookup)")
        + f"; log-prob {c['logp']:.2f} nats per value id. The retrieval claims are tested only when every arm they "
        f"compare and {LOOKUP_ARM} reach {retrieval.LOOKUP_GATE:g} exact match in range "
        "(``retrieval.lookup_gates``).\n\n"
        + markdown_table(lookup_table(rows, arms))
        + ("\nAt the fine-tunes' snapshots (exact match; log-prob at 8× far):\n\n" + markdown_table(snaps)
           if snaps else "")
        + "\n")


def markdown(spec, rows, decisions, *, command, wall_s, data, L, previous) -> str:
    lookups = lookup_arms(spec)
    schemes = [v.name for v in spec.variants if v.init_from is None and v.name not in lookups]
    cfg, ft = spec.configs["rope"], spec.configs["rope-ft-none"]
    t = cfg.train
    text = report_header(
        "Claim 2: rotary positions let context be extended by adjusting the rotation range",
        command,
        spec,
        wall_s,
        rows,
        data,
    )
    text += (
        "## What was measured\n\n"
        f"Schemes {', '.join(schemes)}, each a {cfg.model.n_layers}-layer, d_model {cfg.model.d_model} {cfg.model.ffn}/"
        f"{cfg.model.activation} model (vocab {cfg.model.vocab_size}) trained at context {L} for {t.steps} steps of "
        f"{t.batch_size}×{L} tokens ({t.steps * t.batch_size * L:,} tokens). Each is evaluated on "
        f"~{eval_tokens(spec):,} validation tokens at every length {', '.join(str(m * L) for m in MULTIPLES)}, "
        "in windows spread over the split; "
        f"in range = positions < {L}, beyond range = positions >= {L}. Rope is then fine-tuned at {ft.seq_len} tokens "
        f"({ft.train.steps} steps of {ft.train.batch_size}×{ft.seq_len}, constant lr {ft.optim.lr:g} after "
        f"{ft.optim.warmup_steps} warmup steps) with no scaling, PI (linear) and YaRN at factor {ft.seq_len // L}; the "
        f"snapshots after fewer steps are the fine-tune-steps sweep. {eval_slice_text(spec)}.\n\n"
        "## Criteria (registered before the runs)\n\n" + registration_text(spec.registration)
        + "\n".join(f"- **{d.spec.id}** — {d.spec.claim}. {d.spec.criterion()}" for d in decisions) + "\n"
        + "\n## Results\n\n### Without any adjustment (mean ± std over seeds)\n\n"
        + markdown_table(scheme_table(rows, schemes))
        + "\n![loss by length](loss_by_length.png)\n\n![per-position loss at 16x](per_position.png)\n\n"
        "### Rope zero-shot (factor = length / training length)\n\n" + markdown_table(zero_shot_table(rows))
        + "\n### Rope fine-tuned at 8×: the steps sweep\n\n" + markdown_table(finetune_table(rows))
        + "\n![fine-tune steps](finetune_steps.png)\n\n"
          "![rope extension per position](rope_extension_per_position.png)\n\n"
        + (lookup_text(spec, rows, lookups) if lookups else "")
        + "## Verdicts\n\n" + "\n".join(d.line() for d in decisions) + "\n\n"
        + exploratory_text(decisions, rows)
        + (f"The re-analysed claims read the {len(previous)} runs in [previous/](previous/README.md), made before "
           "the registration, under the rules registered here.\n\n" if previous else "")
        + paper_note(decisions, cfg, rows)
    )
    return text


def yarn_bands(head_dim: int, L: int, base: float, beta_fast: float, beta_slow: float) -> tuple[int, int, int]:
    """How many rotary frequency pairs YaRN interpolates fully (fewer than beta_slow rotations over the
    training length L), on its ramp, and leaves unchanged (more than beta_fast rotations)."""
    rotations = [L * base ** (-2 * i / head_dim) / (2 * math.pi) for i in range(head_dim // 2)]
    full = sum(r < beta_slow for r in rotations)
    kept = sum(r > beta_fast for r in rotations)
    return full, head_dim // 2 - full - kept, kept


def _mean_loss(rows: list[dict], variant: str) -> float:
    runs = seeds_of(rows, variant)
    return statistics.fmean(num(r["final_val_loss"]) for r in runs.values()) if runs else float("nan")


def paper_note(decisions, cfg, rows: list[dict]) -> str:
    """Where a result disagrees with the papers, the setup difference that plausibly explains it."""
    v = {d.spec.id: d.verdict for d in decisions}
    notes = []
    if v.get("shaw-flat-from-clip") == "reproduced":
        notes.append(
            "Shaw's relative positions degrade beyond the training length once their clip covers it: the flat curve of "
            "the first version came from clip 16 < 64, where every offset past 16 shares one trained embedding. The "
            "clip-16 arm is that setup, shown."
        )
    sin, scaled = _mean_loss(rows, "sinusoidal"), _mean_loss(rows, "sinusoidal-scaled")
    if sin - scaled > 0.05:  # False when either is missing (nan)
        notes.append(
            f"Sinusoidal positions added to unscaled N(0, 0.02) embeddings trained to {sin:.3f}, "
            f"{sin - scaled:.2f} nats worse than with Vaswani et al.'s sqrt(d_model) embedding scale ({scaled:.3f}): "
            "the unit-amplitude encoding swamps the token embeddings unless they are scaled up. The scale also "
            f"makes the residual stream {math.sqrt(cfg.model.d_model):.0f}x larger for every later layer, and the "
            "other schemes train unscaled, so the scaled arm's gap to them mixes a positions effect with an "
            "embedding-scale effect."
        )
        rs = _mean_loss(rows, "rope-scaled")
        if math.isfinite(rs):
            notes.append(
                f"With the same scale, rope trained to {rs:.3f} (unscaled {_mean_loss(rows, 'rope'):.3f}), against "
                f"{scaled:.3f} for scaled sinusoidal: at equal embedding scale the two schemes differ by "
                f"{scaled - rs:+.3f} nats."
            )
    if v.get("zero-shot-yarn-8x") != "reproduced" or v.get("zero-shot-yarn-16x") != "reproduced":
        r = cfg.model.rope
        full, ramp, kept = yarn_bands(cfg.model.head_dim, cfg.seq_len, r.base, r.beta_fast, r.beta_slow)
        notes.append(
            f"Where YaRN does not extend the model zero-shot, note the scale: Peng et al. extend Llama 2 "
            f"(4,096 training positions, head_dim 128), where many frequency pairs complete more than "
            f"{r.beta_fast:g} rotations in training and YaRN leaves them unchanged. At head_dim {cfg.model.head_dim} "
            f"and {cfg.seq_len} training positions, {full} of {cfg.model.head_dim // 2} pairs complete less than "
            f"{r.beta_slow:g} rotation (YaRN interpolates them fully), {ramp} are on its ramp and {kept} are left "
            "unchanged: YaRN acts close to plain interpolation here."
        )
    if any(v.get(f"ft-extension-{m}") not in ("reproduced", None) for m in ("yarn", "pi")):
        notes.append(
            "A fine-tune whose gain is as large in range as beyond it is a general gain from more training at a new "
            "length, not an extension effect: the in-range positions are the control that separates the two."
        )
    copying = next((d for d in decisions
                    if d.spec.id == "retrieval-yarn" and d.spec.endpoint not in retrieval.ENDPOINTS), None)
    lookup = next((d for d in decisions if d.spec.endpoint in retrieval.ENDPOINTS
                   and d.untestable.startswith("untestable:")), None)
    if lookup is not None:
        notes.append(
            "Peng et al. show passkey retrieval on 7B models that already retrieve within their training length. "
            f"Here the registered gate left {lookup.spec.id} untestable "
            f"({lookup.untestable.removeprefix('untestable: ')}), so there was no in-range retrieval for an extension "
            "to carry further."
        )
    elif copying is not None and copying.untestable:
        t = cfg.train
        notes.append(
            f"Peng et al. show passkey retrieval on 7B models that already retrieve within their training length. "
            f"These models ({cfg.model.n_layers} layers, d_model {cfg.model.d_model}, "
            f"{t.steps * t.batch_size * cfg.seq_len / 1e6:.1f}M training tokens) do not copy a repeated segment "
            "even in range, so the probe has nothing for an extension to "
            "carry further. Olsson et al. (2022) saw induction heads appear in a phase change well into training; "
            "at the default size the pilot of rope-copy's planting (positions.yaml) copied in range by step 400 of "
            "800, and planting at uniform distances (which needs an induction circuit) had not by step 600."
        )
    return ("### Disagreements with the papers\n\n" + "\n\n".join(notes) + "\n") if notes else ""


def per_position_csv(rows: list[dict], out: Path, names: list[str], L: int) -> None:
    lines = ["variant,eval_len,position,mean_loss,seeds"]
    for n in names:
        runs = [r for r in seeds_of(rows, n).values() if r.get("pp_16x")]
        if runs:
            for i, vals in enumerate(zip(*(r["pp_16x"] for r in runs))):
                lines.append(f"{n},{16 * L},{i},{statistics.fmean(vals):.5f},{len(runs)}")
    atomic_write_text(out / "per_position.csv", "\n".join(lines) + "\n")


def analyze(spec, out: Path, rows: list[dict], *, command: str, wall_s: float, data: dict | None = None,
            limits: dict | None = None, tune: dict | None = None) -> Path:
    L = spec.configs["rope"].seq_len
    lookups = lookup_arms(spec)  # they have their own table: no loss by length, no copy probes
    schemes = [v.name for v in spec.variants if v.init_from is None and v.name not in lookups]
    fts = [v.name for v in spec.variants if v.init_from is not None and v.name not in lookups]
    previous = read_csv(out / "previous" / "results.csv")
    init_loss = (limits or {}).get("init", math.log(spec.configs["rope"].model.vocab_size))
    decisions = decide_claims(spec.claims, rows, previous, ENDPOINTS, init_loss=init_loss,
                              alpha=(spec.registration or {}).get("alpha", 0.05), untestable=gates(spec, rows),
                              amended=lost_copying(spec, rows))
    zs = [{**r, "variant": "rope-zs-yarn", "pp_16x": r.get("zs_yarn_pp_16x")} for r in rows if r["variant"] == "rope"]
    plots = [
        plot_lengths(rows, out, schemes + fts, L, spec.seeds),
        plot_per_position(rows, out, schemes, L, "pp_16x", "per_position.png", f"Per-position loss at {16 * L} tokens"),
        plot_per_position(
            rows + zs,
            out,
            ["rope", "rope-zs-yarn", *fts],
            L,
            "pp_16x",
            "rope_extension_per_position.png",
            f"Rope extended to {16 * L} tokens: per-position loss",
        ),
        plot_finetune(rows, out, lookup=bool(lookups)),
    ]
    per_position_csv(rows, out, schemes + fts, L)
    atomic_write_text(out / "report.md", markdown(spec, rows, decisions, command=command, wall_s=wall_s, data=data, L=L,
                                                  previous=previous))
    write_decisions(out, "positions", decisions, {"plots": plots, "data": data, "seeds": spec.seeds,
                                                  "registration": registration_record(spec)})
    return out / "report.md"
