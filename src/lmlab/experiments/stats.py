"""Statistics for comparisons over seeds: Student's t, paired tests, equivalence, Holm, power, and verdicts.

    iv = paired_interval(loss_a, loss_b)             # per-seed differences a - b: mean, 95% CI (t, n-1 df)
    d = [a - b for a, b in zip(loss_a, loss_b)]      # the same differences, for the tests below
    paired_t_test(d, "less")                         # one-sided p of "mean difference < 0"
    tost(d, margin)                                  # equivalence p within ±margin (two one-sided tests)
    sign_flip_test(d, "less")                        # exact paired permutation p (all 2^n sign patterns, n <= 16)
    ps = {cid: claim_pvalue(d_c, margin_c, claimed_c) for ...}; adj = holm(ps)   # within one experiment
    c = compare(d, margin, "lower", p_adjusted=adj[cid], power_effect=margin)    # everything a report needs
    c.decision.verdict, c.decision.negligible        # "reproduced" | "opposite" | "tie" | "inconclusive"
    describe(c)  # '-0.031 [-0.052, -0.010] nats; p=0.004 (Holm 0.012); sign-flip p=0.031; n=10; power 0.83 for 0.020'
    seeds_for_power(effect=0.02, sd=0.015)          # seeds a paired one-sided t test needs for 80% power
    compute_multiplier(dense_curves, moe_final, moe_tokens)  # tokens dense needs / MoE tokens, geometric mean + CI
    extend_grid(rates, losses_by_rate)              # the next rate beyond an edge that won, else None

The registered rule (:func:`decide_registered`), used by every experiment and quoted by every report:
  - A comparison is *paired*: seed s of arm A against seed s of arm B. d_s = A_s - B_s; the tests are
    Student's t tests on the d_s (n - 1 degrees of freedom); the margin m > 0 is fixed before the runs,
    from outside the data (the claim's smallest effect of interest, e.g. the paper's reported effect).
  - For a directional claim ("lower": A < B, "higher": A > B), at level alpha (default 0.05):
      * difference: the one-sided t test in the claimed direction rejects "no difference" (p <= alpha,
        using the Holm-adjusted p when one is given: Holm runs over the claims of one experiment);
      * opposite: the one-sided t test in the other direction rejects (unadjusted p <= alpha);
      * equivalence: both one-sided tests of TOST reject at alpha, i.e. the (1 - 2 alpha) = 90% t interval
        lies inside (-m, +m).
    Verdict: "tie" when equivalence holds; else "reproduced" on a difference in the claimed direction;
    else "opposite" on a difference the other way; else "inconclusive".
  - When equivalence AND a difference both hold (a real difference, confidently smaller than m), the
    verdict is "tie" with ``negligible=True``. Why not "reproduced": m is by registration the smallest
    effect that matters, so an effect shown to lie inside ±m is, by the rule stated before the runs, no
    effect of interest; calling it "reproduced" would let the number of seeds, not the size of the effect,
    decide the verdict (any nonzero effect becomes significant with enough seeds). The flag and the
    interval keep the direction visible in the report.
  - For a non-inferiority claim ("not_higher": A is no worse than B by m or more): "reproduced" when the
    one-sided t test of d < +m rejects "d >= m" (Holm-adjusted when given; equivalently the upper
    one-sided (1 - alpha) bound, the 90% interval's upper end, lies below +m), with ``negligible=True``
    when A is also significantly higher than B (a real but sub-margin loss); else "opposite" when the
    one-sided test of d > 0 rejects; else "inconclusive". It has no "tie".
  - Fewer than two seeds, a non-finite difference or margin: "inconclusive".
  - The sign-flip permutation test and the power are reported beside the verdict; they do not change it.

The older :func:`decide` (95% interval excludes zero; "tie" when it lies inside a margin from
:func:`tie_margin`) is kept for the reports written before the registered rule.

The t and noncentral t distributions are scipy.stats' (``pip install 'lmlab[experiments]'``), imported on
first use by :func:`scipy_module`, so ``import lmlab`` and ``lmlab train`` never need scipy.
"""

from __future__ import annotations

import bisect
import dataclasses
import importlib
import math
import random
import statistics
from typing import Iterable, Literal, Mapping, Sequence

from ..errors import one_line

LEVEL = 0.95
TIE_SPREADS = 2.0
Verdict = Literal["reproduced", "opposite", "tie", "inconclusive"]


# ============================================================== Student's t (scipy.stats)
def scipy_module(name: str = "stats"):
    """``scipy.<name>`` (stats, optimize, ...), imported on first use. Without scipy, a one-line ValueError
    naming the extra that installs it, which the command line prints as its error (exit 2)."""
    try:
        return importlib.import_module(f"scipy.{name}")
    except ImportError as e:
        raise ValueError(f"the experiment statistics need scipy, which cannot be imported ({one_line(e)}); "
                         "pip install 'lmlab[experiments]'") from None


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"df={df} must be positive")
    return float(scipy_module().t.cdf(t, df))


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p={p} must be in (0, 1)")
    return float(scipy_module().t.ppf(p, df))


# ============================================================== intervals
@dataclasses.dataclass(frozen=True)
class Interval:
    """Mean of n values with a two-sided t confidence interval (infinite for n < 2)."""

    mean: float
    lo: float
    hi: float
    n: int
    std: float  # sample standard deviation of the values (nan for n < 2)
    level: float = LEVEL  # the confidence level of [lo, hi]

    def excludes_zero(self) -> bool:
        return self.lo > 0 or self.hi < 0

    def text(self, digits: int = 3) -> str:
        """'-0.031 [-0.052, -0.010]' (the interval, or 'n=1' without one)."""
        if self.n < 2 or not math.isfinite(self.lo):
            return f"{self.mean:+.{digits}f} (n={self.n}, no interval)"
        return f"{self.mean:+.{digits}f} [{self.lo:+.{digits}f}, {self.hi:+.{digits}f}]"


def mean_interval(values: Sequence[float], level: float = LEVEL) -> Interval:
    """t interval of the mean of ``values`` (non-finite values make the result nan)."""
    v = [float(x) for x in values]
    n = len(v)
    if n == 0 or not all(math.isfinite(x) for x in v):
        return Interval(float("nan"), float("nan"), float("nan"), n, float("nan"), level)
    m = statistics.fmean(v)
    if n < 2:
        return Interval(m, -math.inf, math.inf, n, float("nan"), level)
    s = statistics.stdev(v)
    half = t_quantile(0.5 + level / 2.0, n - 1) * s / math.sqrt(n)
    return Interval(m, m - half, m + half, n, s, level)


def paired_interval(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> Interval:
    """Interval of the mean per-seed difference a[i] - b[i] (the i-th seed of each arm)."""
    if len(a) != len(b):
        raise ValueError(f"paired comparison needs one value per seed in each arm; got {len(a)} and {len(b)}")
    return mean_interval([x - y for x, y in zip(a, b)], level)


def tie_margin(groups: Iterable[Sequence[float]], spreads: float = TIE_SPREADS) -> float:
    """``spreads`` x the median over groups (arms) of their seed standard deviation; nan when no
    group has two finite values."""
    stds = [statistics.stdev(g) for g in (list(map(float, g)) for g in groups)
            if len(g) >= 2 and all(math.isfinite(x) for x in g)]
    return spreads * statistics.median(stds) if stds else float("nan")


Claimed = Literal["lower", "higher", "not_higher"]


def decide(iv: Interval, margin: float, claimed: Claimed = "lower") -> Verdict:
    """What a paired difference (A - B) says about the claim "A is ``claimed`` than B".

    ``not_higher`` is a non-inferiority claim ("A is no worse than B"): reproduced when the whole
    interval lies below +margin, opposite when it lies above zero."""
    if not math.isfinite(iv.mean):
        return "inconclusive"
    if claimed == "not_higher":
        if iv.lo > 0:
            return "opposite"
        return "reproduced" if math.isfinite(margin) and iv.hi < margin else "inconclusive"
    if iv.excludes_zero():
        lower = iv.hi < 0
        return "reproduced" if lower == (claimed == "lower") else "opposite"
    if math.isfinite(margin) and -margin < iv.lo and iv.hi < margin:
        return "tie"
    return "inconclusive"


VERDICT_TEXT = {"reproduced": "REPRODUCED", "opposite": "OPPOSITE", "tie": "TIE", "inconclusive": "INCONCLUSIVE"}


def label(v: Verdict | None) -> str:
    """The verdict as the reports print it: **REPRODUCED** etc."""
    return f"**{VERDICT_TEXT.get(v, 'NOT MEASURED') if v else 'NOT MEASURED'}**"


# ============================================================== p-values
Alternative = Literal["two-sided", "less", "greater"]
ALPHA = 0.05


def _finite(values: Iterable[float]) -> list[float] | None:
    """``values`` as floats, or None when any is not finite."""
    v = [float(x) for x in values]
    return v if all(math.isfinite(x) for x in v) else None


def paired_t_test(diffs: Sequence[float], alternative: Alternative = "two-sided", null: float = 0.0) -> float:
    """p-value of Student's one-sample t test of the per-seed differences against mean ``null``.

    ``alternative`` is the hypothesis the small p supports: "less" (mean < null), "greater" (mean > null)
    or "two-sided". nan for fewer than two values or a non-finite one. Differences that are all equal have
    no spread: p is 0 when they differ from ``null`` in the tested direction and 1 otherwise."""
    v = _finite(diffs)
    if v is None or len(v) < 2:
        return float("nan")
    n, m, s = len(v), statistics.fmean(v), statistics.stdev(v)
    if s == 0.0:
        side = {"less": m < null, "greater": m > null, "two-sided": m != null}[alternative]
        return 0.0 if side else 1.0
    t = (m - null) / (s / math.sqrt(n))
    if alternative == "less":
        return t_cdf(t, n - 1)
    if alternative == "greater":
        return t_cdf(-t, n - 1)
    if alternative == "two-sided":
        return min(1.0, 2.0 * t_cdf(-abs(t), n - 1))
    raise ValueError(f"alternative={alternative!r}; choose 'two-sided', 'less' or 'greater'")


def tost(diffs: Sequence[float], margin: float) -> float:
    """Equivalence p-value within (-margin, +margin): two one-sided t tests (Schuirmann 1987), the larger
    of the p of "mean > -margin" and of "mean < +margin". p <= alpha is the same as the (1 - 2 alpha)
    t interval lying inside (-margin, +margin) (see :func:`equivalent`). nan without a finite margin > 0."""
    if not (math.isfinite(margin) and margin > 0):
        return float("nan")
    return max(paired_t_test(diffs, "greater", -margin), paired_t_test(diffs, "less", margin))


def equivalent(diffs: Sequence[float], margin: float, alpha: float = ALPHA) -> bool:
    """The interval rule of equivalence: the (1 - 2 alpha) t interval (90% at alpha 0.05) lies inside
    (-margin, +margin). False for fewer than two values or without a finite margin > 0."""
    iv = mean_interval(diffs, 1.0 - 2.0 * alpha)
    return bool(math.isfinite(margin) and margin > 0 and iv.n >= 2 and -margin < iv.lo and iv.hi < margin)


def claim_pvalue(diffs: Sequence[float], margin: float, claimed: Claimed) -> float:
    """The p-value a claim is decided on, the one :func:`holm` adjusts within an experiment: the one-sided t
    test in the claimed direction ("lower": mean < 0, "higher": mean > 0), or for "not_higher" the
    non-inferiority test of mean < +margin (nan without a finite margin > 0)."""
    if claimed == "lower":
        return paired_t_test(diffs, "less")
    if claimed == "higher":
        return paired_t_test(diffs, "greater")
    if claimed == "not_higher":
        return paired_t_test(diffs, "less", margin) if math.isfinite(margin) and margin > 0 else float("nan")
    raise ValueError(f"claimed={claimed!r}; choose 'lower', 'higher' or 'not_higher'")


def holm(pvalues: Mapping[str, float]) -> dict[str, float]:
    """Holm's (1979) step-down adjusted p-values, keyed as given: sorted ascending, the i-th of m (from 1)
    becomes max over j <= i of min(1, (m - j + 1) p_(j)). Rejecting where the adjusted p <= alpha controls
    the family-wise error at alpha. A nan p (a claim not measured) stays nan and does not count in m."""
    for k, p in pvalues.items():
        if not (math.isnan(p) or 0.0 <= p <= 1.0):
            raise ValueError(f"p-value of {k!r} is {p}; p-values lie in [0, 1]")
    ranked = sorted((p, k) for k, p in pvalues.items() if not math.isnan(p))
    m, running = len(ranked), 0.0
    out = {k: float("nan") for k in pvalues}
    for i, (p, k) in enumerate(ranked):
        running = max(running, min(1.0, (m - i) * p))
        out[k] = running
    return out


# ============================================================== sign-flip permutation test
EXACT_SIGN_FLIP_MAX_N = 16  # 2^16 = 65,536 sign patterns: exact; above, Monte Carlo
SIGN_FLIP_SAMPLES = 20_000  # Monte Carlo draws above EXACT_SIGN_FLIP_MAX_N (p's standard error <= 0.0036)
SIGN_FLIP_SEED = 0  # fixed, so the same rows always give the same p


def _tail_count(sums: Iterable[float], observed: float, alternative: Alternative, tol: float) -> int:
    """How many sign-flipped sums are at least as extreme as ``observed`` (ties, within ``tol``, count)."""
    if alternative == "greater":
        return sum(1 for s in sums if s >= observed - tol)
    if alternative == "less":
        return sum(1 for s in sums if s <= observed + tol)
    if alternative == "two-sided":
        return sum(1 for s in sums if abs(s) >= abs(observed) - tol)
    raise ValueError(f"alternative={alternative!r}; choose 'two-sided', 'less' or 'greater'")


def sign_flip_test(diffs: Sequence[float], alternative: Alternative = "two-sided", *,
                   max_exact: int = EXACT_SIGN_FLIP_MAX_N, samples: int = SIGN_FLIP_SAMPLES,
                   seed: int = SIGN_FLIP_SEED) -> float:
    """Paired sign-flip permutation p-value of the sum (equivalently the mean) of the differences.

    Under "no difference" each seed's difference is as likely to have either sign, so the observed sum is
    compared with the sums of every sign pattern: for n <= ``max_exact``, all 2^n of them, observed one
    included (the exact p, a multiple of 2^-n: n = 3 differences all positive give one-sided p = 1/8).
    Above, ``samples`` random patterns from ``random.Random(seed)``, and p = (1 + hits) / (1 + samples),
    which is never 0. Assumes only that the differences are symmetric about 0 under the null, not normal.
    nan for no values or a non-finite one."""
    v = _finite(diffs)
    if not v:
        return float("nan")
    observed, tol = sum(v), 1e-12 * sum(abs(x) for x in v)
    if len(v) <= max_exact:
        sums = [0.0]
        for x in v:
            sums = [s + x for s in sums] + [s - x for s in sums]
        return _tail_count(sums, observed, alternative, tol) / len(sums)
    rng = random.Random(seed)
    draws = (sum(x if rng.random() < 0.5 else -x for x in v) for _ in range(samples))
    return (1 + _tail_count(draws, observed, alternative, tol)) / (1 + samples)


# ============================================================== the registered decision
@dataclasses.dataclass(frozen=True)
class Decision:
    """A verdict under the registered rule (module docstring) with the numbers that decided it."""

    verdict: Verdict
    negligible: bool  # a significant difference that is also shown to lie inside ±margin
    claimed: Claimed
    margin: float
    alpha: float
    p: float  # the claim's p (claim_pvalue): one-sided in the claimed direction, or non-inferiority
    p_adjusted: float  # Holm-adjusted p when given, else p
    p_opposite: float  # one-sided p the other way ("not_higher": of mean > 0)
    p_tost: float  # equivalence p within ±margin (nan for "not_higher")
    interval: Interval  # 95% t interval of the differences
    interval90: Interval  # the (1 - 2 alpha) interval the equivalence rule reads


def decide_registered(diffs: Sequence[float], margin: float, claimed: Claimed = "lower", alpha: float = ALPHA,
                      p_adjusted: float | None = None) -> Decision:
    """The registered rule (module docstring) applied to per-seed differences A - B of the claim
    "A is ``claimed`` than B", with a ``margin`` fixed before the runs and, when the claim belongs to a
    family, its Holm-adjusted p (:func:`holm` of :func:`claim_pvalue` over the experiment's claims)."""
    if not 0.0 < alpha < 0.5:
        raise ValueError(f"alpha={alpha} must lie in (0, 0.5)")
    p = claim_pvalue(diffs, margin, claimed)
    p_adj = p if p_adjusted is None else p_adjusted
    other = {"lower": "greater", "higher": "less", "not_higher": "greater"}[claimed]
    p_opp = paired_t_test(diffs, other)  # type: ignore[arg-type]
    p_eq = float("nan") if claimed == "not_higher" else tost(diffs, margin)
    ivs = mean_interval(diffs), mean_interval(diffs, 1.0 - 2.0 * alpha)
    hit, against = p_adj <= alpha, p_opp <= alpha  # False when nan
    verdict: Verdict = "inconclusive"
    negligible = False
    if ivs[0].n < 2 or not (math.isfinite(ivs[0].mean) and math.isfinite(margin)):
        pass  # too few seeds, a diverged difference, or no registered margin
    elif claimed == "not_higher":  # non-inferiority: shown below +margin, perhaps significantly above 0
        verdict, negligible = ("reproduced", against) if hit else ("opposite" if against else "inconclusive", False)
    elif p_eq <= alpha:  # equivalence wins over a significant difference: it is smaller than the margin
        verdict, negligible = "tie", hit or against
    elif hit or against:
        verdict = "reproduced" if hit else "opposite"
    return Decision(verdict, negligible, claimed, margin, alpha, p, p_adj, p_opp, p_eq, *ivs)


# ============================================================== power (noncentral t)
def nct_cdf(t: float, df: float, nc: float) -> float:
    """P(T <= t) for the noncentral t with ``df`` degrees of freedom and noncentrality ``nc``:
    T = (Z + nc) / sqrt(V / df), V ~ chi-squared(df). nc = 0 gives Student's t."""
    if df <= 0:
        raise ValueError(f"df={df} must be positive")
    return float(scipy_module().nct.cdf(t, df, nc))


Sides = Literal["one-sided", "two-sided"]


def power_paired(effect: float, sd: float, n: int, alpha: float = ALPHA, alternative: Sides = "one-sided") -> float:
    """Power of the paired t test on ``n`` seeds to detect a true mean difference ``effect`` when the
    per-seed differences have standard deviation ``sd`` (of the differences, not of one arm).

    One-sided (in the effect's direction): P(T' > t_{1-alpha, n-1}); two-sided: P(|T'| > t_{1-alpha/2, n-1});
    T' is noncentral t with n - 1 df and noncentrality |effect| sqrt(n) / sd (:func:`nct_cdf`)."""
    if not (sd > 0 and math.isfinite(sd)) or n < 2:
        raise ValueError(f"power needs sd > 0 (got {sd}) and n >= 2 seeds (got {n})")
    df, nc = n - 1, abs(effect) * math.sqrt(n) / sd
    if alternative == "one-sided":
        return 1.0 - nct_cdf(t_quantile(1.0 - alpha, df), df, nc)
    if alternative == "two-sided":
        crit = t_quantile(1.0 - alpha / 2.0, df)
        return 1.0 - nct_cdf(crit, df, nc) + nct_cdf(-crit, df, nc)
    raise ValueError(f"alternative={alternative!r}; choose 'one-sided' or 'two-sided'")


def seeds_for_power(effect: float, sd: float, target: float = 0.8, alpha: float = ALPHA,
                    alternative: Sides = "one-sided", max_n: int = 1000) -> int:
    """The fewest seeds (>= 2) whose paired t test reaches power ``target`` for ``effect`` at ``sd`` (the
    standard deviation of the per-seed differences, e.g. from a pilot). Power grows with n, so this
    bisects the seed counts 2..max_n. ValueError when even ``max_n`` seeds fall short."""
    if not 0.0 < target < 1.0:
        raise ValueError(f"target power {target} must lie in (0, 1)")
    if power_paired(effect, sd, max_n, alpha, alternative) < target:
        raise ValueError(f"effect {effect} at seed sd {sd} needs more than max_n={max_n} seeds for power {target}; "
                         f"register a larger effect or raise max_n")
    counts = range(2, max_n + 1)
    return counts[bisect.bisect_left(counts, target, key=lambda n: power_paired(effect, sd, n, alpha, alternative))]


# ============================================================== compute multiplier (capacity)
Curve = Sequence[tuple[float, float]]  # [(tokens, loss), ...] of one run, evaluated at several points
ReachStatus = Literal["crossed", "before_first", "never"]


@dataclasses.dataclass(frozen=True)
class Reach:
    """Where a loss curve first reaches a loss: ``tokens`` is the interpolated crossing ("crossed"), the
    curve's first point, an upper bound, when it starts at or below the loss ("before_first"), or inf
    when it never gets there ("never")."""

    tokens: float
    status: ReachStatus


def tokens_to_reach(curve: Curve, loss: float) -> Reach:
    """The tokens at which ``curve`` first reaches ``loss`` (its first crossing, so later noise cannot
    move it), interpolated linearly in log(tokens) between the two points that bracket it. Points with a
    nan loss are skipped; a previous point at +inf loss (diverged) gives the crossing point's tokens.

        tokens_to_reach([(100, 4.0), (200, 3.5), (400, 3.0)], 3.2)   # Reach(200 * 2**0.6, "crossed")
    """
    pts = sorted((float(t), float(v)) for t, v in curve if not math.isnan(v))
    if any(t <= 0 for t, _ in pts):
        raise ValueError("token counts of a curve must be positive (the interpolation is in log tokens)")
    if not pts or math.isnan(loss):
        return Reach(math.inf, "never")
    for i, (t, v) in enumerate(pts):
        if v <= loss:
            if i == 0:
                return Reach(t, "before_first")
            t0, v0 = pts[i - 1]
            if v == loss or not math.isfinite(v0):
                return Reach(t, "crossed")
            frac = (v0 - loss) / (v0 - v)
            return Reach(math.exp(math.log(t0) + frac * (math.log(t) - math.log(t0))), "crossed")
    return Reach(math.inf, "never")


@dataclasses.dataclass(frozen=True)
class Multiplier:
    """The compute multiplier: per seed, tokens dense needs to match the MoE's final loss / the MoE's
    tokens; summarized as the geometric mean over the seeds whose dense curve crossed it, with the t
    interval of log(ratio) transformed back. Seeds out of range are counted, not summarized: the
    "never" ones needed more than dense's last point (the summary then understates the multiplier)."""

    mean: float  # geometric mean of the in-range ratios
    lo: float
    hi: float
    log: Interval  # t interval of log(ratio) over the in-range seeds
    ratios: tuple[float, ...]  # per seed (inf when never reached; an upper bound when before_first)
    status: tuple[ReachStatus, ...]
    before_first: int
    never: int

    def text(self, digits: int = 2) -> str:
        """'1.62x [1.41, 1.86] (n=10 seeds; 1 never reached)'."""
        out = [f"{n} {what}" for n, what in ((self.before_first, "below dense's first point"),
                                              (self.never, "never reached"))
               if n]
        core = (f"{self.mean:.{digits}f}x [{self.lo:.{digits}f}, {self.hi:.{digits}f}]" if self.log.n >= 2
                else f"{self.mean:.{digits}f}x (no interval)")
        return f"{core} (n={self.log.n} seeds" + "".join(f"; {s}" for s in out) + ")"


def compute_multiplier(dense_curves: Sequence[Curve], moe_final: Sequence[float], moe_tokens: float | Sequence[float],
                       level: float = LEVEL) -> Multiplier:
    """Per seed s: tokens_to_reach(dense_curves[s], moe_final[s]) / moe_tokens (one number for all seeds,
    or one per seed), summarized as a :class:`Multiplier`. Multiply by FLOPs per token for FLOPs."""
    if len(dense_curves) != len(moe_final):
        raise ValueError(f"one dense curve per MoE seed; got {len(dense_curves)} curves and {len(moe_final)} losses")
    tokens = [float(moe_tokens)] * len(moe_final) if isinstance(moe_tokens, (int, float)) else list(moe_tokens)
    if len(tokens) != len(moe_final) or not all(t > 0 for t in tokens):
        raise ValueError("moe_tokens: one positive count, or one per seed")
    reaches = [tokens_to_reach(c, loss) for c, loss in zip(dense_curves, moe_final)]
    ratios = tuple(r.tokens / t for r, t in zip(reaches, tokens))
    status = tuple(r.status for r in reaches)
    log = mean_interval([math.log(x) for x, s in zip(ratios, status) if s == "crossed"], level)
    return Multiplier(math.exp(log.mean), math.exp(log.lo), math.exp(log.hi), log, ratios, status,
                      status.count("before_first"), status.count("never"))


# ============================================================== grid-edge extension
def _mean_loss(losses: Sequence[float]) -> float:
    """Mean over seeds; a diverged (non-finite) seed makes it +inf."""
    v = _finite(losses)
    return math.inf if v is None or not v else statistics.fmean(v)


def extend_grid(values: Sequence[float], losses_by_value: Mapping[float, Sequence[float]],
                factor: float = 2.0) -> float | None:
    """The next grid value beyond the edge when the best value (lowest mean loss over seeds, a diverged
    seed counting as +inf, ties to the smaller value) is the grid's smallest or largest, else None.

    The step is the grid's own ratio when it is uniform in log (e.g. 1e-3, 2e-3, 4e-3 -> 8e-3), else
    ``factor``. None also when every value diverged (nothing to follow). Limiting how often a grid is
    extended (max_extensions) is the caller's."""
    grid = sorted(float(v) for v in values)
    if len(grid) < 2 or grid[0] <= 0 or len(set(grid)) != len(grid):
        raise ValueError(f"a grid to extend needs at least two distinct positive values; got {values}")
    missing = [v for v in values if v not in losses_by_value]
    if missing:
        raise ValueError(f"no losses for grid values {missing}")
    means = [(_mean_loss(losses_by_value[v]), v) for v in grid]
    best_loss, best = min(means)
    if math.isinf(best_loss) or grid[0] < best < grid[-1]:
        return None
    steps = [b / a for a, b in zip(grid, grid[1:])]
    step = steps[0] if all(math.isclose(s, steps[0], rel_tol=1e-6) for s in steps) else factor
    return best / step if best == grid[0] else best * step


# ============================================================== one comparison, as the reports print it
@dataclasses.dataclass(frozen=True)
class Comparison:
    """Everything a report states about one paired comparison: the decision, the sign-flip p beside it
    (the same hypothesis as the claim's p: d < 0, d > 0, or for "not_higher" d - margin < 0), and the
    power for ``power_effect``."""

    decision: Decision
    sign_flip_p: float
    power_effect: float | None  # the effect the power is for (e.g. the margin), or None
    power: float  # at the measured sd of the differences and n, one-sided at alpha; nan when not computable
    unit: str = "nats"

    @property
    def verdict(self) -> Verdict:
        return self.decision.verdict

    def to_json(self) -> dict[str, object]:
        """The fields verdict.json records per claim (floats may be nan: write them through jsonable)."""
        d = self.decision
        return {"verdict": d.verdict, "negligible": d.negligible, "claimed": d.claimed, "margin": d.margin,
                "alpha": d.alpha, "difference": d.interval.mean, "ci95": [d.interval.lo, d.interval.hi],
                "ci90": [d.interval90.lo, d.interval90.hi], "n": d.interval.n, "sd": d.interval.std,
                "p": d.p, "p_holm": d.p_adjusted, "p_opposite": d.p_opposite, "p_tost": d.p_tost,
                "sign_flip_p": self.sign_flip_p, "power": self.power, "power_effect": self.power_effect,
                "unit": self.unit}


def compare(diffs: Sequence[float], margin: float, claimed: Claimed = "lower", alpha: float = ALPHA,
            p_adjusted: float | None = None, power_effect: float | None = None, unit: str = "nats") -> Comparison:
    """:func:`decide_registered`, plus the sign-flip test and the power to detect ``power_effect`` with the
    seeds measured (one-sided, at the sample sd of ``diffs``)."""
    d = decide_registered(diffs, margin, claimed, alpha, p_adjusted)
    if claimed == "not_higher":
        flip = sign_flip_test([x - margin for x in diffs], "less") if math.isfinite(margin) else float("nan")
    else:
        flip = sign_flip_test(diffs, "less" if claimed == "lower" else "greater")
    sd, n = d.interval.std, d.interval.n
    power = float("nan")
    if power_effect is not None and n >= 2 and math.isfinite(sd) and sd > 0:
        power = power_paired(power_effect, sd, n, alpha)
    return Comparison(d, flip, power_effect, power, unit)


def p_text(p: float) -> str:
    """A p-value as the reports print it: 'p=0.004', 'p<0.001', 'p=n/a'."""
    if math.isnan(p):
        return "p=n/a"
    return "p<0.001" if p < 0.001 else f"p={p:.3f}"


def describe(c: Comparison, digits: int = 3) -> str:
    """One line for a report, e.g. '-0.031 [-0.052, -0.010] nats; p=0.004 (Holm 0.012); TOST p=0.210
    (±0.020); sign-flip p=0.031; n=10; power 0.83 for 0.020'. The interval is the 95% t interval; p is the
    claim's (:func:`claim_pvalue`), with its Holm adjustment when one was given."""
    d = c.decision
    parts = [f"{d.interval.text(digits)} {c.unit}", p_text(d.p)]
    if d.p_adjusted != d.p and not (math.isnan(d.p) and math.isnan(d.p_adjusted)):
        parts[-1] += f" (Holm {p_text(d.p_adjusted)[2:]})"
    if d.claimed == "not_higher":
        parts[-1] += f" for d < +{d.margin:.{digits}f}"
    elif math.isfinite(d.margin):
        parts.append(f"TOST {p_text(d.p_tost)} (±{d.margin:.{digits}f})")
    parts.append(f"sign-flip {p_text(c.sign_flip_p)}")
    parts.append(f"n={d.interval.n}")
    if c.power_effect is not None:
        power = "n/a" if math.isnan(c.power) else f"{c.power:.2f}"
        parts.append(f"power {power} for {abs(c.power_effect):.{digits}f}")
    return "; ".join(parts)
