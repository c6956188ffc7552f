"""Fitted loss-vs-compute laws over a ladder, and the compute multiplier of one arm over another (pure).

    law = fit_law(compute, loss, c0=1e13)      # L(C) = E + A (C/C0)^-alpha, least squares, E >= 0, A >= 0
    law.loss(3e13), law.compute_for(3.1)       # the law, and its inverse (inf: the loss lies at or below E)
    a = analyze(points, [("moe", "dense")])    # every figure below, each with a bootstrap interval over seeds
    a.arms["dense"].alpha.text()               # '0.302 [0.271, 0.333]'
    a.pairs[0].rungs[0].flops.text("x")        # '2.01x [1.87, 2.16]' (extrapolated / unreachable marked)
    a.pairs[0].trend.direction                 # "grows" | "shrinks" | "flat within its interval"
    a.pairs[0].difference_trend.slope.text()   # B - A per doubling of compute, with its held-out rung

The table is a list of :class:`Point`: one measured loss of one arm at one rung and seed, with the
training FLOPs and the wall time it took. Nothing here trains, reads files or knows what a rung is:
a ladder's rungs are its model sizes; moe's all-seeds multiplier (experiments/moe.py) feeds it the
points of dense's loss curves.

**The law.** Per arm, L(C) = E + A (C/C0)^-alpha over every point of every seed (Hoffmann et al.
2022, eq. 2, in compute alone; C0 a reference compute, so that A is the reducible loss at C0 and is
readable). E >= 0 and A >= 0. For fixed alpha the law is linear in (E, A), solved in closed form, so
the fit searches alpha alone over [1e-3, 3] (a log grid, refined twice around its best point: the
variable-projection least squares of Golub & Pereyra 1973). A search over one variable finds the
global minimum where a start-point fit (``curve_fit``) can stop in the long E-alpha valley; a law whose
alpha sits at an end of the range is flagged: the points do not identify it.

**The multiplier** of arm B over baseline A at B's rung r: C_A(L_B,r) / C_B,r, the compute A's
fitted law needs to reach B's mean measured loss at r, over the compute B spent there (> 1: B saves
compute). Every seed counts: the mean is over all of them, and a loss A's law reaches outside A's
measured compute is read on the law anyway and marked *extrapolated*; one at or below A's asymptote
E is *unreachable* (an infinite multiplier), never dropped. A baseline whose loss does not fall with
compute over its rungs (it rises, as a deeper model's can on a fixed token budget) has a *flat* law (A = 0)
that reaches no loss at any particular compute: its multipliers are *no law* (nan), not infinite. The
wall-clock multiplier is the same reading on laws fitted to wall time, on the machine that ran the points.

**The trend**: the least-squares slope of log(multiplier) against log(compute) over B's rungs (> 0:
B's advantage grows with compute). **The held-out check**: each arm's law fitted without its largest
rung predicts that rung's mean loss; the error is predicted - measured.

**The difference trend**, which needs no law: at each rung both arms have, B's mean loss minus A's (the
mean of the paired differences when every seed has both), and the least-squares line through them against
log2 of B's compute: its slope is nats per doubling of compute (< 0: B gains on A), and the line through
every rung but the largest predicts the largest (error = predicted - measured; with 4 or more rungs).

**Intervals**: 95% percentile intervals from ``scipy.stats.bootstrap`` over seeds: a resample draws
seeds with replacement and takes every point of a drawn seed, of every arm (paired: seed s of A and of
B share their initial weights and data order), and everything above is recomputed on it. Where some
resamples give a non-finite value (an unreachable multiplier), the interval is their quantiles with
infinity counted, and ``unreachable`` gives the share. With few seeds a percentile interval is
somewhat narrow (Efron & Tibshirani 1993, ch. 13); the synthetic test (tests/test_ladder.py) measures
its coverage.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import warnings
from typing import Any, Iterable, Sequence

import numpy as np

from .. import stats

__all__ = ["ALPHA_RANGE", "ArmFit", "DifferenceTrend", "Estimate", "HeldOut", "LadderAnalysis", "Law", "PairAnalysis",
           "Point", "RungMultiplier", "Trend", "analyze", "fit_law", "reference_compute", "trend_slope"]

ALPHA_RANGE = (1e-3, 3.0)  # exponents the fit searches: flatter than 1e-3 or steeper than 3 is not a compute law
_GRID, _REFINE = 121, 21  # log grid points over ALPHA_RANGE, then twice around the best point
N_RESAMPLES = 999
LEVEL = 0.95


# ============================================================== the law
@dataclasses.dataclass(frozen=True)
class Law:
    """L(C) = E + A (C / c0)^-alpha."""

    E: float
    A: float
    alpha: float
    c0: float
    at_bound: bool = False  # alpha sits at an end of ALPHA_RANGE: the points do not identify the law
    lo: float = math.nan  # the smallest and largest compute the law was fitted on
    hi: float = math.nan

    @property
    def E_at_bound(self) -> bool:
        """E sits at its bound 0: the points fall faster than a law with a floor E > 0 can follow, and the fit
        is a pure power law (E = 0 exactly, as the least squares clamp it; its bootstrap interval has no width
        when every resample clamps too)."""
        return self.E == 0.0 and self.A > 0

    @property
    def flat(self) -> bool:
        """A = 0: the loss does not fall with compute over the points (it rises or stays level), so the best
        non-increasing law is their mean, and it reaches no loss at any particular compute."""
        return self.A <= 0

    def loss(self, c: float | np.ndarray) -> float | np.ndarray:
        return self.E + self.A * np.power(np.asarray(c, dtype=float) / self.c0, -self.alpha)

    def compute_for(self, loss: float) -> float:
        """The compute at which the law reaches ``loss``: inf when ``loss`` is at or below E (never); nan for a
        flat law, which has no inverse."""
        if not math.isfinite(loss) or self.flat:
            return math.nan
        if loss <= self.E:
            return math.inf
        return self.c0 * ((loss - self.E) / self.A) ** (-1.0 / self.alpha)

    def text(self, unit: str = "C") -> str:
        return f"{self.E:.3f} + {self.A:.3f}·({unit}/{self.c0:.3g})^-{self.alpha:.3f}"


def _profile(alphas: np.ndarray, lx: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each alpha: the least-squares (E, A) with E >= 0, A >= 0 of y = E + A exp(-alpha lx), and its SSE
    (normal equations from four sums: the points are few and well scaled, C / C0 near 1)."""
    z = np.exp(-np.outer(alphas, lx))  # (G, n)
    n, sy, syy = len(y), y.sum(), y @ y
    sz, szz, szy = z.sum(axis=1), np.einsum("gn,gn->g", z, z), z @ y
    A = (szy - sz * sy / n) / np.maximum(szz - sz * sz / n, 1e-300)
    E = (sy - A * sz) / n
    neg = E < 0  # the asymptote at its bound: A alone, through the origin
    A, E = np.where(neg, szy / np.maximum(szz, 1e-300), A), np.where(neg, 0.0, E)
    flat = A < 0  # a loss that rises with compute: the best non-increasing law is flat
    A, E = np.where(flat, 0.0, A), np.where(flat, sy / n, E)
    sse = syy - 2 * E * sy - 2 * A * szy + n * E * E + 2 * E * A * sz + A * A * szz
    return sse, E, A


_COARSE = np.linspace(*np.log(ALPHA_RANGE), _GRID)  # log alpha
_FINE = np.linspace(-1.0, 1.0, _REFINE)  # around the best point, in units of the previous step


def fit_law(compute: Sequence[float], loss: Sequence[float], c0: float) -> Law:
    """The least-squares law through the points (see the module's docstring). Needs 3 distinct computes."""
    x, y = np.asarray(compute, dtype=float), np.asarray(loss, dtype=float)
    keep = np.isfinite(x) & np.isfinite(y) & (x > 0)
    x, y = x[keep], y[keep]
    if len(np.unique(x)) < 3:
        raise ValueError(f"a law E + A C^-alpha needs points at 3 or more distinct computes; got {len(np.unique(x))}")
    lx = np.log(x / c0)
    sse, E, A = _profile(np.exp(_COARSE), lx, y)
    i = int(np.argmin(sse))
    at_bound, best, step = i in (0, _GRID - 1), _COARSE[i], _COARSE[1] - _COARSE[0]
    for _ in range(2):  # twice around the best point: ~1e-4 relative in alpha
        grid = np.clip(best + step * _FINE, _COARSE[0], _COARSE[-1])
        sse, E, A = _profile(np.exp(grid), lx, y)
        i = int(np.argmin(sse))
        best, step = grid[i], step * (_FINE[1] - _FINE[0])
    return Law(float(E[i]), float(A[i]), float(np.exp(best)), float(c0), at_bound, float(x.min()), float(x.max()))


def reference_compute(values: Iterable[float]) -> float:
    """C0: the power of ten nearest the geometric mean of ``values`` (a readable reference for A)."""
    v = [math.log10(c) for c in values if c > 0 and math.isfinite(c)]
    return 10.0 ** round(statistics.fmean(v)) if v else 1.0


def line_through(compute: Sequence[float], values: Sequence[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line of ``values`` on log2(compute); nan without 2 distinct
    computes and finite values."""
    c, v = np.asarray(compute, dtype=float), np.asarray(values, dtype=float)
    if len(c) < 2 or not np.all(np.isfinite(v)) or np.ptp(np.log2(c)) == 0:
        return math.nan, math.nan
    slope, intercept = np.polyfit(np.log2(c), v, 1)
    return float(slope), float(intercept)


def trend_slope(compute: Sequence[float], multiplier: Sequence[float]) -> float:
    """Least-squares slope of log(multiplier) on log(compute); nan unless 2+ points, all finite and positive."""
    c, m = np.asarray(compute, dtype=float), np.asarray(multiplier, dtype=float)
    if len(c) < 2 or not (np.all(np.isfinite(m)) and np.all(m > 0)) or np.ptp(np.log(c)) == 0:
        return math.nan
    return float(np.polyfit(np.log(c), np.log(m), 1)[0])


# ============================================================== the table and what is read from it
@dataclasses.dataclass(frozen=True)
class Point:
    """One measured loss: arm, rung and seed, the training FLOPs and wall time (s) it took."""

    arm: str
    rung: str
    seed: int
    compute: float
    loss: float
    wall_s: float = math.nan


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A value from all the seeds, with its bootstrap interval over seeds."""

    value: float
    lo: float = math.nan
    hi: float = math.nan
    unreachable: float = 0.0  # share of resamples in which the value was infinite

    def covers(self, x: float) -> bool:
        return self.lo <= x <= self.hi

    def text(self, suffix: str = "", digits: int = 3, signed: bool = False) -> str:
        def f(v: float) -> str:
            return "∞" if v == math.inf else f"{v:{'+' if signed else ''}.{digits}f}"

        if not math.isfinite(self.lo) and not math.isfinite(self.hi) and self.lo != self.hi:
            return f"{f(self.value)}{suffix} (no interval)"
        more = f"; {self.unreachable:.0%} of resamples unreachable" if self.unreachable else ""
        return f"{f(self.value)}{suffix} [{f(self.lo)}, {f(self.hi)}]{more}"


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """The law fitted without the largest rung, predicting it."""

    rung: str
    compute: float
    predicted: Estimate
    measured: Estimate  # the rung's mean measured loss
    error: Estimate  # predicted - measured


@dataclasses.dataclass(frozen=True)
class ArmFit:
    arm: str
    law: Law  # on FLOPs
    E: Estimate
    A: Estimate
    alpha: Estimate
    points: int
    seeds: int
    heldout: HeldOut | None  # None: fewer than 4 rungs (3 must remain to fit)
    wall_law: Law | None  # on wall time; None when the points carry none


@dataclasses.dataclass(frozen=True)
class RungMultiplier:
    """Arm B over baseline A at one of B's rungs."""

    rung: str
    compute: float  # B's FLOPs there
    loss: float  # B's mean loss there, over every seed
    flops: Estimate  # C_A(loss) / compute
    status: str  # interpolated | extrapolated (beyond A's measured compute) | unreachable (at or below E_A)
    #              | no law (A's law is flat: its loss does not fall with compute)
    wall: Estimate | None  # the same on wall time
    wall_status: str = ""
    difference: Any = None  # stats.Interval of B - A by seed, where A has the same rung: paired, as the experiments


@dataclasses.dataclass(frozen=True)
class Trend:
    slope: Estimate  # d log(multiplier) / d log(compute) over B's rungs
    direction: str  # grows | shrinks | flat within its interval | not measured
    rungs: int


@dataclasses.dataclass(frozen=True)
class DifferenceTrend:
    """B - A across the rungs both arms have: the line through the mean differences against log2 compute."""

    slope: Estimate  # nats per doubling of B's compute (< 0: B gains on A as compute grows)
    intercept: float  # the line's value at log2(C) = 0, so that the plot draws the line the table reports
    direction: str  # falls | rises | flat within its interval | not measured
    rungs: int
    heldout: HeldOut | None  # the line without the largest rung, predicting its difference; None below 4 rungs


@dataclasses.dataclass(frozen=True)
class PairAnalysis:
    arm: str
    baseline: str
    rungs: list[RungMultiplier]
    trend: Trend
    difference_trend: DifferenceTrend | None = None  # None: fewer than 2 rungs in common


@dataclasses.dataclass(frozen=True)
class LadderAnalysis:
    arms: dict[str, ArmFit]  # the arms measured at 3 or more computes
    pairs: list[PairAnalysis]
    c0: float
    seeds: list[int]
    n_resamples: int
    level: float

    def to_json(self) -> dict[str, Any]:
        return _jsonable(dataclasses.asdict(self))


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def wall_law(d: dict[str, np.ndarray]) -> Law | None:
    """Loss against wall seconds, the law's other reading; None below 3 distinct wall times (runs of a
    second or less, timed to the recorded precision, can tie), so a wall figure is missing, never an error."""
    if len(np.unique(d["w"])) < 3:
        return None
    return fit_law(d["w"], d["y"], reference_compute(d["w"]))


# ============================================================== one pass over a set of seeds
class _Ladder:
    """The points grouped for fast resampling, and every figure computed from one multiset of seeds."""

    def __init__(self, points: Sequence[Point], pairs: Sequence[tuple[str, str]], c0: float, wall: bool):
        self.pairs, self.c0, self.wall = list(pairs), c0, wall
        self.arms = list(dict.fromkeys(p.arm for p in points))
        self.seeds = sorted({p.seed for p in points})
        col = {s: i for i, s in enumerate(self.seeds)}
        self.by_arm: dict[str, dict[str, np.ndarray]] = {}
        for arm in self.arms:
            pts = [p for p in points if p.arm == arm]
            rungs = sorted(dict.fromkeys(p.rung for p in pts),
                           key=lambda r: statistics.fmean(p.compute for p in pts if p.rung == r))
            self.by_arm[arm] = {
                "seed": np.array([col[p.seed] for p in pts]), "c": np.array([p.compute for p in pts], dtype=float),
                "y": np.array([p.loss for p in pts], dtype=float), "w": np.array([p.wall_s for p in pts], dtype=float),
                "rung": np.array([rungs.index(p.rung) for p in pts]), "rungs": rungs,
            }
        # an arm measured at fewer than 3 computes has no law; it can still be read against a baseline's
        self.fitted = [a for a in self.arms if len(np.unique(self.by_arm[a]["c"])) >= 3]
        for b, a in self.pairs:
            if a not in self.by_arm or b not in self.by_arm:
                raise ValueError(f"compare {b!r} with {a!r}: no points of {b if b not in self.by_arm else a!r}; "
                                 f"arms with points: {self.arms}")
            if a not in self.fitted:
                raise ValueError(f"baseline {a!r} has points at {len(np.unique(self.by_arm[a]['c']))} distinct "
                                 "computes; its law E + A C^-alpha needs 3 or more")

    def _select(self, arm: str, counts: np.ndarray) -> dict[str, np.ndarray]:
        """The arm's points, each repeated as often as its seed was drawn (weights would do; repeats are simpler)."""
        d = self.by_arm[arm]
        reps = counts[d["seed"]]
        return {k: (np.repeat(v, reps) if isinstance(v, np.ndarray) else v) for k, v in d.items()}

    def values(self, counts: np.ndarray) -> dict[str, float]:
        """Every figure, for seeds drawn ``counts[i]`` times each (all ones: the data as measured)."""
        out: dict[str, float] = {}
        laws, walls, sel = {}, {}, {}
        for arm in self.arms:
            d = sel[arm] = self._select(arm, counts)
            if arm not in self.fitted:
                continue
            laws[arm] = law = fit_law(d["c"], d["y"], self.c0)
            out |= {f"{arm}/E": law.E, f"{arm}/A": law.A, f"{arm}/alpha": law.alpha}
            if self.wall:
                walls[arm] = wall_law(d)
            top = len(d["rungs"]) - 1
            if top >= 3:  # 3 rungs remain to fit
                held = d["rung"] < top
                pred = fit_law(d["c"][held], d["y"][held], self.c0)
                c_top = float(d["c"][~held].mean())
                out[f"{arm}/heldout/predicted"] = p = float(pred.loss(c_top))
                out[f"{arm}/heldout/measured"] = m = float(d["y"][~held].mean())
                out[f"{arm}/heldout/error"] = p - m
        for b, a in self.pairs:
            d, logs = sel[b], []
            for r, name in enumerate(d["rungs"]):
                here = d["rung"] == r
                c, loss = float(d["c"][here].mean()), float(d["y"][here].mean())
                out[f"{b}/{a}/{name}/flops"] = m = laws[a].compute_for(loss) / c
                logs.append((c, m))
                if self.wall:
                    w = walls[a]
                    out[f"{b}/{a}/{name}/wall"] = (w.compute_for(loss) / float(d["w"][here].mean())
                                                   if w else math.nan)
            out[f"{b}/{a}/slope"] = trend_slope([c for c, _ in logs], [m for _, m in logs])
            out |= self._difference_values(b, a, sel)
        return out

    def common_rungs(self, b: str, a: str) -> list[str]:
        """The rungs both arms have, in B's order of compute."""
        return [r for r in self.by_arm[b]["rungs"] if r in self.by_arm[a]["rungs"]]

    def _difference_values(self, b: str, a: str, sel: dict[str, dict[str, np.ndarray]]) -> dict[str, float]:
        """B - A at each common rung (means over the drawn seeds), its line on log2 compute, and the line
        without the largest rung predicting it."""
        rungs = self.common_rungs(b, a)
        if len(rungs) < 2:
            return {}

        def mean_at(d: dict[str, np.ndarray], rung: str, key: str) -> float:
            return float(d[key][d["rung"] == d["rungs"].index(rung)].mean())

        c = [mean_at(sel[b], r, "c") for r in rungs]
        diff = [mean_at(sel[b], r, "y") - mean_at(sel[a], r, "y") for r in rungs]
        slope, intercept = line_through(c, diff)
        out = {f"{b}/{a}/diff/slope": slope, f"{b}/{a}/diff/intercept": intercept}
        if len(rungs) >= 4:  # 3 remain to fit the line
            slope, intercept = line_through(c[:-1], diff[:-1])
            out[f"{b}/{a}/diff/heldout/predicted"] = p = intercept + slope * math.log2(c[-1])
            out[f"{b}/{a}/diff/heldout/measured"] = diff[-1]
            out[f"{b}/{a}/diff/heldout/error"] = p - diff[-1]
        return out


def _interval(dist: np.ndarray, level: float) -> tuple[float, float, float]:
    """(lo, hi, share infinite) of a bootstrap distribution; infinities count, nan resamples are left out."""
    ok = dist[~np.isnan(dist)]
    if len(ok) == 0:
        return math.nan, math.nan, 0.0
    q = np.quantile(ok, [(1 - level) / 2, (1 + level) / 2], method="inverted_cdf")
    return float(q[0]), float(q[1]), float(np.mean(np.isinf(dist)))


def _bootstrap(lad: _Ladder, names: list[str], n_resamples: int, level: float, seed: int) -> dict[str, tuple]:
    """name -> (lo, hi, share infinite) over seed resamples (scipy.stats.bootstrap, percentile)."""
    n = len(lad.seeds)
    if n < 2 or n_resamples < 1:
        return {k: (math.nan, math.nan, 0.0) for k in names}

    def statistic(idx: np.ndarray) -> np.ndarray:
        v = lad.values(np.bincount(idx.astype(int), minlength=n))
        return np.array([v[k] for k in names], dtype=float)

    sp = stats.scipy_module("stats")
    kw = {"rng": np.random.default_rng(seed)}
    with warnings.catch_warnings():  # infinite resamples (unreachable multipliers) warn inside scipy's summaries
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            res = sp.bootstrap((np.arange(n),), statistic, n_resamples=n_resamples, vectorized=False,
                               method="percentile", confidence_level=level, **kw)
        except TypeError:  # scipy < 1.15 names it random_state
            res = sp.bootstrap((np.arange(n),), statistic, n_resamples=n_resamples, vectorized=False,
                               method="percentile", confidence_level=level, random_state=kw["rng"])
    dist = np.atleast_2d(res.bootstrap_distribution)
    out = {}
    for i, k in enumerate(names):
        ci = res.confidence_interval
        lo, hi = float(np.atleast_1d(ci.low)[i]), float(np.atleast_1d(ci.high)[i])
        share = float(np.mean(np.isinf(dist[i])))
        if not (math.isfinite(lo) and math.isfinite(hi)):  # scipy's interpolation across infinities gives nan
            lo, hi, share = _interval(dist[i], level)
        out[k] = (lo, hi, share)
    return out


def _status(law: Law, c: float) -> str:
    if law.flat:
        return "no law"
    if c == math.inf:
        return "unreachable"
    return "interpolated" if law.lo <= c <= law.hi else "extrapolated"


def _direction(slope: Estimate, up: str = "grows", down: str = "shrinks") -> str:
    if not math.isfinite(slope.value):
        return "not measured"
    if slope.lo > 0:
        return up
    if slope.hi < 0:
        return down
    return "flat within its interval"


def analyze(points: Sequence[Point], pairs: Sequence[tuple[str, str]], *, c0: float | None = None,
            n_resamples: int = N_RESAMPLES, level: float = LEVEL, seed: int = 0) -> LadderAnalysis:
    """Each arm's law with intervals, its held-out check, and for each (arm, baseline) in ``pairs`` the
    multiplier of arm over baseline at each of arm's rungs with the trend (see the module's docstring).
    Deterministic for a given ``seed``."""
    if not points:
        raise ValueError("no points to fit: every run of the ladder is missing")
    c0 = c0 or reference_compute(p.compute for p in points)
    wall = all(math.isfinite(p.wall_s) and p.wall_s > 0 for p in points)
    lad = _Ladder(points, pairs, c0, wall)
    ones = np.ones(len(lad.seeds), dtype=int)
    point = lad.values(ones)
    names = list(point)
    iv = _bootstrap(lad, names, n_resamples, level, seed)

    def est(k: str) -> Estimate:
        lo, hi, share = iv[k]
        return Estimate(point[k], lo, hi, share)

    arms = {}
    for arm in lad.fitted:
        d = lad._select(arm, ones)
        law = fit_law(d["c"], d["y"], c0)
        held = None
        if f"{arm}/heldout/error" in point:
            top = d["rungs"][-1]
            held = HeldOut(top, float(d["c"][d["rung"] == len(d["rungs"]) - 1].mean()),
                           est(f"{arm}/heldout/predicted"), est(f"{arm}/heldout/measured"), est(f"{arm}/heldout/error"))
        arms[arm] = ArmFit(arm, law, est(f"{arm}/E"), est(f"{arm}/A"), est(f"{arm}/alpha"), len(d["y"]),
                           len({int(s) for s in d["seed"]}), held,
                           wall_law(d) if wall else None)
    out_pairs = []
    for b, a in pairs:
        d, rungs = lad._select(b, ones), []
        for r, name in enumerate(d["rungs"]):
            here = d["rung"] == r
            c, loss = float(d["c"][here].mean()), float(d["y"][here].mean())
            flops = est(f"{b}/{a}/{name}/flops")
            timed = arms[a].wall_law  # None: no wall times, or too few distinct ones for a law
            wall_est = est(f"{b}/{a}/{name}/wall") if timed else None
            rungs.append(RungMultiplier(
                name, c, loss, flops, _status(arms[a].law, arms[a].law.compute_for(loss)), wall_est,
                _status(timed, timed.compute_for(loss)) if timed else "", _difference(lad, b, a, name)))
        slope = est(f"{b}/{a}/slope")
        out_pairs.append(PairAnalysis(b, a, rungs, Trend(slope, _direction(slope), len(rungs)),
                                      _difference_trend(lad, b, a, est, point)))
    return LadderAnalysis(arms, out_pairs, c0, lad.seeds, n_resamples if len(lad.seeds) > 1 else 0, level)


def _difference_trend(lad: _Ladder, b: str, a: str, est, point: dict[str, float]) -> DifferenceTrend | None:
    key = f"{b}/{a}/diff"
    if f"{key}/slope" not in point:
        return None
    common = lad.common_rungs(b, a)
    held = None
    if f"{key}/heldout/error" in point:
        d = lad.by_arm[b]
        top = d["rungs"].index(common[-1])
        held = HeldOut(common[-1], float(d["c"][d["rung"] == top].mean()), est(f"{key}/heldout/predicted"),
                       est(f"{key}/heldout/measured"), est(f"{key}/heldout/error"))
    slope = est(f"{key}/slope")
    return DifferenceTrend(slope, point[f"{key}/intercept"], _direction(slope, "rises", "falls"), len(common), held)


def _difference(lad: _Ladder, b: str, a: str, rung: str) -> Any:
    """B - A at ``rung`` paired by seed (stats.paired_interval), where both arms have that rung; else None."""
    db, da = lad.by_arm[b], lad.by_arm[a]
    if rung not in da["rungs"]:
        return None

    def by_seed(d: dict) -> dict[int, float]:
        r = d["rungs"].index(rung)
        return {int(s): float(y) for s, y, k in zip(d["seed"], d["y"], d["rung"]) if k == r}

    yb, ya = by_seed(db), by_seed(da)
    common = sorted(set(yb) & set(ya))
    if len(common) < 2:
        return None
    return stats.paired_interval([yb[s] for s in common], [ya[s] for s in common])
