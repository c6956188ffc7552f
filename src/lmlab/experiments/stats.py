"""Statistics for comparisons over seeds: Student's t, paired intervals, and what counts as a result.

    iv = paired_interval(loss_a, loss_b)        # per-seed differences a - b: mean, 95% CI (t, n-1 df)
    margin = tie_margin(seed_groups)            # derived from the measured seed spread
    decide(iv, margin, claimed="lower")         # "reproduced" | "opposite" | "tie" | "inconclusive"

The rules, used by every experiment and stated in every report:
  - A comparison is *paired*: seed s of arm A against seed s of arm B (the same init seed and data
    order, where the arms allow). The interval is the t interval of the per-seed differences.
  - A difference counts only when its 95% interval excludes zero: "reproduced" when it lies on
    the claimed side, "opposite" when on the other.
  - "tie" when the interval contains zero *and* lies inside (-margin, +margin).
  - Otherwise "inconclusive": the data cannot tell a difference from no difference.
  - The tie margin is :func:`tie_margin`: TIE_SPREADS times the median, over the arms compared,
    of one arm's standard deviation across seeds. A difference smaller than what reseeding a
    single run moves it by (two standard deviations cover ~95% of reseeds) is not one a user
    could see from one run.

scipy is not required: the t quantile is computed here from the regularized incomplete beta
function (Numerical Recipes' continued fraction) and checked against tabulated values in tests.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Iterable, Literal, Sequence

LEVEL = 0.95
TIE_SPREADS = 2.0
Verdict = Literal["reproduced", "opposite", "tie", "inconclusive"]


# ============================================================== Student's t
def _beta_cf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 3e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta function I_x(a, b)."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x={x} must be in [0, 1]")
    if x in (0.0, 1.0):
        return x
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_cf(a, b, x) / a
    return 1.0 - front * _beta_cf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"df={df} must be positive")
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p (bisection on the CDF, to ~1e-12)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p={p} must be in (0, 1)")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


# ============================================================== intervals
@dataclasses.dataclass(frozen=True)
class Interval:
    """Mean of n values with a two-sided t confidence interval (infinite for n < 2)."""

    mean: float
    lo: float
    hi: float
    n: int
    std: float  # sample standard deviation of the values (nan for n < 2)

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
        return Interval(float("nan"), float("nan"), float("nan"), n, float("nan"))
    m = statistics.fmean(v)
    if n < 2:
        return Interval(m, -math.inf, math.inf, n, float("nan"))
    s = statistics.stdev(v)
    half = t_quantile(0.5 + level / 2.0, n - 1) * s / math.sqrt(n)
    return Interval(m, m - half, m + half, n, s)


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
