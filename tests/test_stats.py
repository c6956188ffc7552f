"""lmlab.experiments.stats: Student's t without scipy, paired intervals, tie margins and verdicts."""

from __future__ import annotations

import math
import statistics

import pytest

from lmlab.experiments.stats import (
    Interval,
    betainc,
    decide,
    mean_interval,
    paired_interval,
    t_cdf,
    t_quantile,
    tie_margin,
)

# two-sided 95% critical values t_{0.975, df} from standard tables (e.g. NIST/SEMATECH e-Handbook 1.3.6.7.2)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        15: 2.131, 20: 2.086, 25: 2.060, 29: 2.045, 30: 2.042, 60: 2.000, 100: 1.984}


@pytest.mark.parametrize("df, expected", sorted(T975.items()))
def test_t_quantile_matches_tables(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=6e-4)


def test_t_quantile_other_levels_and_limits():
    assert t_quantile(0.95, 7) == pytest.approx(1.8946, abs=1e-4)  # one-sided 95%, df 7
    assert t_quantile(0.995, 4) == pytest.approx(4.6041, abs=1e-4)
    assert t_quantile(0.975, 1e7) == pytest.approx(1.959964, abs=1e-5)  # the normal limit
    assert t_quantile(0.025, 5) == pytest.approx(-t_quantile(0.975, 5))
    # df = 1 is Cauchy and df = 2 has a closed form: exact checks of the whole chain
    for p in (0.6, 0.9, 0.99):
        assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)
        a = 4 * p * (1 - p)
        assert t_quantile(p, 2) == pytest.approx((2 * p - 1) * math.sqrt(2 / a), rel=1e-9)
    with pytest.raises(ValueError):
        t_quantile(1.0, 3)


def test_t_cdf_and_incomplete_beta_closed_forms():
    assert t_cdf(0.0, 3) == 0.5
    assert t_cdf(-2.0, 4) == pytest.approx(0.0580583, abs=1e-7)
    assert t_cdf(1.0, 1) == pytest.approx(0.75)  # Cauchy
    assert betainc(1, 1, 0.3) == pytest.approx(0.3)  # uniform
    assert betainc(2, 3, 0.5) == pytest.approx(0.6875)  # 1 - sum_{j<2} C(4,j) 0.5^4
    assert betainc(0.5, 0.5, 0.25) == pytest.approx(2 / math.pi * math.asin(0.5))  # arcsine law


def test_mean_and_paired_intervals():
    iv = mean_interval([1.0, 2.0, 3.0])
    half = 4.302653 * 1.0 / math.sqrt(3)
    assert (iv.mean, iv.n, iv.std) == (2.0, 3, 1.0)
    assert iv.lo == pytest.approx(2 - half, abs=1e-5) and iv.hi == pytest.approx(2 + half, abs=1e-5)
    # paired: the per-seed differences, not the two means' spreads
    a, b = [3.10, 3.30, 3.20], [3.00, 3.21, 3.12]  # each arm varies by ±0.1 over seeds; the gap is ~0.09 in each seed
    p = paired_interval(a, b)
    assert p.mean == pytest.approx(statistics.fmean([0.10, 0.09, 0.08]))
    assert p.lo > 0  # the pairing removes the seed spread that would swamp an unpaired comparison
    assert mean_interval([5.0]).n == 1 and math.isinf(mean_interval([5.0]).hi)
    assert math.isnan(mean_interval([1.0, float("nan")]).mean)
    with pytest.raises(ValueError, match="one value per seed"):
        paired_interval([1.0], [1.0, 2.0])


def test_tie_margin_is_two_median_seed_spreads():
    groups = [[1.0, 1.1, 1.2], [2.0, 2.0, 2.0], [3.0, 3.3, 3.6], [4.0]]  # stds 0.1, 0, 0.3; a single seed ignored
    assert tie_margin(groups) == pytest.approx(2 * 0.1)
    assert math.isnan(tie_margin([[1.0]]))


def _iv(mean, half, n=5):
    return Interval(mean, mean - half, mean + half, n, 1.0)


@pytest.mark.parametrize("iv, margin, claimed, expected", [
    (_iv(-0.10, 0.03), 0.05, "lower", "reproduced"),     # a clear win
    (_iv(+0.10, 0.03), 0.05, "lower", "opposite"),       # a clear loss
    (_iv(+0.00, 0.03), 0.05, "lower", "tie"),            # contains 0, inside ±margin
    (_iv(+0.01, 0.08), 0.05, "lower", "inconclusive"),   # contains 0, wider than the margin
    (_iv(+0.10, 0.03), 0.05, "higher", "reproduced"),
    (_iv(-0.10, 0.03), 0.05, "higher", "opposite"),
    (_iv(-0.01, 0.02), 0.05, "not_higher", "reproduced"),  # no worse: the whole interval below +margin
    (_iv(+0.02, 0.01), 0.05, "not_higher", "opposite"),    # significantly worse, even if by little
    (_iv(+0.02, 0.04), 0.05, "not_higher", "inconclusive"),
    (Interval(-0.1, -math.inf, math.inf, 1, math.nan), 0.05, "lower", "inconclusive"),  # one seed
    (_iv(math.nan, math.nan), 0.05, "lower", "inconclusive"),
    (_iv(+0.00, 0.03), math.nan, "lower", "inconclusive"),  # no margin measured: no tie
])
def test_decide(iv, margin, claimed, expected):
    assert decide(iv, margin, claimed) == expected
