"""lmlab.experiments.stats: Student's t and the noncentral t (scipy.stats), paired tests, TOST, Holm, sign-flip,
power, the compute multiplier, grid extension and verdicts. Expected values come from closed forms, tables, hand
enumeration or seeded simulation, never from the function under test."""

from __future__ import annotations

import itertools
import math
import statistics
import sys

import numpy as np
import pytest

from lmlab.experiments.stats import (
    Interval,
    claim_pvalue,
    compare,
    compute_multiplier,
    decide,
    decide_registered,
    describe,
    equivalent,
    extend_grid,
    holm,
    mean_interval,
    nct_cdf,
    paired_interval,
    paired_t_test,
    power_paired,
    scipy_module,
    seeds_for_power,
    sign_flip_test,
    t_cdf,
    t_quantile,
    tie_margin,
    tokens_to_reach,
    tost,
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


def test_t_quantile_to_the_tables_last_digit():
    # t_{0.975, 9} = 2.262157 and t_{0.995, 29} = 2.756386 to 6 decimals (R: qt(0.975, 9), qt(0.995, 29))
    assert t_quantile(0.975, 9) == pytest.approx(2.262157, abs=5e-7)
    assert t_quantile(0.995, 29) == pytest.approx(2.756386, abs=5e-7)
    for p in (0.6, 0.9, 0.975, 0.999):  # the quantile inverts the CDF, and the CDF the quantile
        assert t_cdf(t_quantile(p, 4), 4) == pytest.approx(p, rel=1e-12)


def test_t_cdf_closed_forms():
    assert t_cdf(0.0, 3) == 0.5
    assert t_cdf(-2.0, 4) == pytest.approx(0.0580583, abs=1e-7)
    assert t_cdf(1.0, 1) == pytest.approx(0.75)  # Cauchy
    for t in (-4.0, -0.5, 0.3, 2.5):
        assert t_cdf(t, 1) == pytest.approx(_t1_cdf(t), rel=1e-12)
        assert t_cdf(t, 2) == pytest.approx(_t2_cdf(t), rel=1e-12)
    with pytest.raises(ValueError, match="df=0"):
        t_cdf(1.0, 0)


def test_without_scipy_the_statistics_name_the_extra_in_one_line(monkeypatch):
    from lmlab.cli import exit_status

    for name in ["scipy", "scipy.stats", "scipy.optimize", *(m for m in sys.modules if m.startswith("scipy."))]:
        monkeypatch.setitem(sys.modules, name, None)  # what a package that is not installed looks like to import
    with pytest.raises(ValueError) as e:
        paired_t_test([0.1, 0.2, 0.4], "greater")
    assert "pip install 'lmlab[experiments]'" in str(e.value) and "\n" not in str(e.value)
    assert exit_status(e.value) == (2, str(e.value))  # the command line prints it as its one-line error
    with pytest.raises(ValueError, match=r"lmlab\[experiments\]"):
        scipy_module("optimize")
    # nothing needs scipy before a statistic is computed
    assert math.isnan(paired_t_test([1.0], "greater"))  # one value: no test
    assert holm({"a": 0.01, "b": 0.04}) == pytest.approx({"a": 0.02, "b": 0.04})


def test_importing_lmlab_does_not_import_scipy():
    import subprocess

    code = ("import sys, lmlab, lmlab.cli, lmlab.experiments, lmlab.run.trainer; "
            "sys.exit('scipy' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


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


# ============================================================== closed forms the tests below check against
def _t2_cdf(t):
    """Student's t CDF with 2 df in closed form."""
    return 0.5 + t / (2 * math.sqrt(2 + t * t))


def _t1_cdf(t):
    """Student's t CDF with 1 df (Cauchy)."""
    return 0.5 + math.atan(t) / math.pi


def _phi(x):
    return 0.5 * math.erfc(-x / math.sqrt(2))


# one-sided 95% critical values t_{0.95, df} (NIST/SEMATECH e-Handbook 1.3.6.7.2)
T95 = {2: 2.920, 4: 2.132, 5: 2.015, 9: 1.833, 19: 1.729}


# ============================================================== p-values
def test_paired_t_test_against_closed_forms():
    t = 2 * math.sqrt(3)  # [1, 2, 3]: mean 2, sd 1, se 1/sqrt(3), df 2
    assert paired_t_test([1.0, 2.0, 3.0], "greater") == pytest.approx(1 - _t2_cdf(t), rel=1e-9)
    assert paired_t_test([1.0, 2.0, 3.0], "less") == pytest.approx(_t2_cdf(t), rel=1e-9)
    assert paired_t_test([1.0, 2.0, 3.0]) == pytest.approx(2 * (1 - _t2_cdf(t)), rel=1e-9)  # 0.0742
    assert paired_t_test([1.0, 3.0], "greater") == pytest.approx(1 - _t1_cdf(2.0), rel=1e-9)  # mean 2, se 1, df 1
    assert paired_t_test([-3.0, -1.0], "less") == pytest.approx(1 - _t1_cdf(2.0), rel=1e-9)
    assert paired_t_test([1.0, 2.0, 3.0], null=2.0) == pytest.approx(1.0)
    assert paired_t_test([1.0, 2.0, 3.0], "less", null=2.0) == pytest.approx(0.5)
    # no spread: certain when the difference lies in the tested direction, no evidence otherwise
    assert paired_t_test([0.1, 0.1, 0.1], "greater") == 0.0 and paired_t_test([0.1, 0.1, 0.1], "less") == 1.0
    assert paired_t_test([0.0, 0.0]) == 1.0
    assert math.isnan(paired_t_test([1.0])) and math.isnan(paired_t_test([1.0, math.inf]))
    with pytest.raises(ValueError, match="alternative"):
        paired_t_test([1.0, 2.0], "bigger")


def test_tost_against_closed_forms():
    se = 0.01 / math.sqrt(3)
    # symmetric about 0: both one-sided tests give the same p
    assert tost([-0.01, 0.0, 0.01], 0.05) == pytest.approx(1 - _t2_cdf(0.05 / se), rel=1e-9)
    # mean 0.02: the upper bound binds, t = (0.02 - 0.05) / se
    assert tost([0.01, 0.02, 0.03], 0.05) == pytest.approx(_t2_cdf(-0.03 / se), rel=1e-9)  # 0.0175
    assert tost([0.01, 0.02, 0.03], 0.02) == pytest.approx(0.5)  # the mean sits on the margin: t = 0
    assert math.isnan(tost([0.0, 0.1], math.nan)) and math.isnan(tost([0.0, 0.1], 0.0))


ROWS = [[0.01, -0.02, 0.005], [0.03, 0.01, 0.02, 0.025, 0.015], [-0.004, -0.01, 0.002, -0.006, 0.0, -0.003],
        [0.1, -0.05, 0.02, 0.04, -0.01, 0.0, 0.03, -0.02, 0.05, 0.01]]


@pytest.mark.parametrize("d", ROWS)
@pytest.mark.parametrize("margin", [0.005, 0.01, 0.02, 0.03, 0.05, 0.08])
def test_tost_at_alpha_is_the_90_percent_interval_inside_the_margin(d, margin):
    n, m, s = len(d), statistics.fmean(d), statistics.stdev(d)
    half = T95[n - 1] * s / math.sqrt(n)  # the 90% two-sided interval from the tabulated t_{0.95}
    inside = -margin < m - half and m + half < margin
    if min(abs(m - half + margin), abs(m + half - margin)) < 2e-3 * s:
        pytest.skip("on the boundary to the table's precision")
    assert (tost(d, margin) <= 0.05) == inside == equivalent(d, margin)


def test_claim_pvalue_directions_and_non_inferiority():
    t = 2 * math.sqrt(3)
    assert claim_pvalue([-1.0, -2.0, -3.0], 0.5, "lower") == pytest.approx(1 - _t2_cdf(t), rel=1e-9)
    assert claim_pvalue([-1.0, -2.0, -3.0], 0.5, "higher") == pytest.approx(_t2_cdf(t), rel=1e-9)
    # not_higher: the test of mean < +margin; mean 2, margin 4 -> t = -2 sqrt(3)
    assert claim_pvalue([1.0, 2.0, 3.0], 4.0, "not_higher") == pytest.approx(_t2_cdf(-t), rel=1e-9)
    assert math.isnan(claim_pvalue([1.0, 2.0, 3.0], math.nan, "not_higher"))


# ============================================================== Holm
def test_holm_textbook_examples():
    # Holm (1979) as on Wikipedia's "Holm-Bonferroni method": m = 4, sorted 0.005, 0.01, 0.03, 0.04
    # -> 4*0.005, 3*0.01, 2*0.03, max(1*0.04, 0.06): H1 and H4 rejected at 0.05, H2 and H3 not
    adj = holm({"h1": 0.01, "h2": 0.04, "h3": 0.03, "h4": 0.005})
    assert adj == pytest.approx({"h1": 0.03, "h2": 0.06, "h3": 0.06, "h4": 0.02})
    # R: p.adjust(c(0.01, 0.02, 0.03, 0.04, 0.05), "holm") = 0.05 0.08 0.09 0.09 0.09 (monotone step-down)
    adj = holm({c: p for c, p in zip("abcde", [0.01, 0.02, 0.03, 0.04, 0.05])})
    assert list(adj.values()) == pytest.approx([0.05, 0.08, 0.09, 0.09, 0.09])
    assert holm({"a": 0.6, "b": 0.9}) == {"a": 1.0, "b": 1.0}  # capped at 1
    assert holm({"only": 0.03}) == {"only": 0.03}
    adj = holm({"a": 0.02, "b": math.nan, "c": 0.04})  # an unmeasured claim is not part of the family
    assert adj["a"] == pytest.approx(0.04) and adj["c"] == pytest.approx(0.04) and math.isnan(adj["b"])
    assert holm({}) == {}
    with pytest.raises(ValueError, match="p-value of 'x'"):
        holm({"x": 1.5})


# ============================================================== sign-flip
def _enumerate_sign_flips(d, alternative):
    """Independent reference: every sign pattern by itertools.product."""
    obs, hits = sum(d), 0
    for signs in itertools.product((1, -1), repeat=len(d)):
        s = sum(x * g for x, g in zip(d, signs))
        hits += {"greater": s >= obs - 1e-12, "less": s <= obs + 1e-12,
                 "two-sided": abs(s) >= abs(obs) - 1e-12}[alternative]
    return hits / 2 ** len(d)


def test_sign_flip_by_hand():
    assert sign_flip_test([1.0, 2.0, 3.0], "greater") == 1 / 8  # only the observed pattern reaches 6
    assert sign_flip_test([1.0, 2.0, 3.0]) == 2 / 8  # and its mirror image
    assert sign_flip_test([1.0, 2.0, 3.0], "less") == 1.0
    # +-1 +-2 +-4 give the 8 distinct sums 7, 5, ..., -7; the observed 1 - 2 + 4 = 3
    assert sign_flip_test([1.0, -2.0, 4.0], "greater") == 3 / 8  # 7, 5, 3
    assert sign_flip_test([1.0, -2.0, 4.0], "less") == 6 / 8
    assert sign_flip_test([1.0, -2.0, 4.0]) == 6 / 8  # |s| >= 3
    # ties count: +-1 +-1 +-2 give 4, 2, 2, 0, 0, -2, -2, -4
    assert sign_flip_test([1.0, -1.0, 2.0], "greater") == 3 / 8
    assert math.isnan(sign_flip_test([])) and math.isnan(sign_flip_test([1.0, math.nan]))


@pytest.mark.parametrize("alternative", ["greater", "less", "two-sided"])
def test_sign_flip_exact_matches_enumeration(alternative):
    d = [0.031, -0.012, 0.044, 0.008, -0.027, 0.019, 0.052, -0.003, 0.015, 0.022]
    assert sign_flip_test(d, alternative) == pytest.approx(_enumerate_sign_flips(d, alternative), abs=1e-12)


def test_sign_flip_monte_carlo_above_16_matches_the_binomial():
    d = [1.0] * 14 + [-1.0] * 6  # n = 20: the flipped sum is 2K - 20 with K ~ Binomial(20, 1/2)
    exact = sum(math.comb(20, k) for k in range(14, 21)) / 2 ** 20  # P(K >= 14) = 0.0577
    p = sign_flip_test(d, "greater")
    assert p == pytest.approx(exact, abs=0.006)  # 20,000 draws: standard error 0.0017
    assert p == sign_flip_test(d, "greater")  # seeded: the same rows give the same p
    assert sign_flip_test([1.0] * 20, "greater") == pytest.approx(1 / 20_001)  # never 0
    assert sign_flip_test(d, "greater", max_exact=20) == pytest.approx(exact, abs=1e-12)  # exact when asked


# ============================================================== the registered decision
DEC = [
    ([-0.10, -0.12, -0.08, -0.11, -0.09], 0.02, "lower", None, "reproduced", False),
    ([0.10, 0.12, 0.08, 0.11, 0.09], 0.02, "lower", None, "opposite", False),
    ([0.10, 0.12, 0.08, 0.11, 0.09], 0.02, "higher", None, "reproduced", False),
    ([0.001, -0.002, 0.0015, -0.001, 0.0005], 0.02, "lower", None, "tie", False),
    # a real difference of -0.010, but its 90% interval lies well inside +-0.05: negligible, so a tie
    ([-0.010, -0.011, -0.009, -0.0105, -0.0095], 0.05, "lower", None, "tie", True),
    ([0.010, 0.011, 0.009, 0.0105, 0.0095], 0.05, "lower", None, "tie", True),
    ([0.1, -0.1, 0.05, -0.08, 0.02], 0.02, "lower", None, "inconclusive", False),
    # one-sided p = F2(-2 sqrt(3)) = 0.037: reproduced alone, not after Holm doubles it
    ([-0.5, -1.5, -1.0], 0.1, "lower", None, "reproduced", False),
    ([-0.5, -1.5, -1.0], 0.1, "lower", 0.074, "inconclusive", False),
    # non-inferiority: the test of mean < +margin
    ([0.001, -0.001, 0.0, 0.0005, -0.0005], 0.02, "not_higher", None, "reproduced", False),
    ([0.010, 0.011, 0.009, 0.0105, 0.0095], 0.05, "not_higher", None, "reproduced", True),  # worse, by < margin
    ([0.10, 0.12, 0.08, 0.11, 0.09], 0.02, "not_higher", None, "opposite", False),
    ([0.1, -0.1, 0.05, -0.08, 0.02], 0.02, "not_higher", None, "inconclusive", False),
    ([-0.1], 0.02, "lower", None, "inconclusive", False),  # one seed
    ([-0.10, -0.12, -0.08], math.nan, "lower", None, "inconclusive", False),  # no registered margin
    ([-0.10, math.nan, -0.08], 0.02, "lower", None, "inconclusive", False),
]


@pytest.mark.parametrize("d, margin, claimed, p_adj, verdict, negligible", DEC)
def test_decide_registered(d, margin, claimed, p_adj, verdict, negligible):
    dec = decide_registered(d, margin, claimed, p_adjusted=p_adj)
    assert (dec.verdict, dec.negligible) == (verdict, negligible)


def test_decision_records_its_numbers():
    dec = decide_registered([-0.5, -1.5, -1.0], 0.1, "lower", p_adjusted=0.074)
    assert dec.p == pytest.approx(_t2_cdf(-2 * math.sqrt(3)), rel=1e-9) and dec.p_adjusted == 0.074
    assert dec.p_opposite == pytest.approx(1 - dec.p, rel=1e-9)
    half95, half90 = 4.302653 * 0.5 / math.sqrt(3), T95[2] * 0.5 / math.sqrt(3)
    assert (dec.interval.lo, dec.interval.hi) == pytest.approx((-1 - half95, -1 + half95), abs=1e-5)
    assert (dec.interval90.lo, dec.interval90.hi) == pytest.approx((-1 - half90, -1 + half90), abs=1e-3)
    assert dec.interval90.level == pytest.approx(0.90) and dec.interval.level == 0.95
    with pytest.raises(ValueError, match="alpha"):
        decide_registered([1.0, 2.0], 0.1, alpha=0.6)


# ============================================================== power
def test_noncentral_t_closed_forms():
    for df in (1, 2, 5, 30):
        for t in (-2.5, -0.3, 0.7, 3.0):
            assert nct_cdf(t, df, 0.0) == pytest.approx(t_cdf(t, df), abs=1e-9)  # central: Student's t
    for df, nc in ((1, 0.5), (4, 1.3), (9, 2.2), (200, -0.7)):
        assert nct_cdf(0.0, df, nc) == pytest.approx(_phi(-nc), abs=1e-9)  # P(Z + nc <= 0), whatever S is
    assert nct_cdf(math.inf, 3, 1.0) == 1.0 and nct_cdf(-math.inf, 3, 1.0) == 0.0
    assert nct_cdf(1.96, 1e6, 1.0) == pytest.approx(_phi(0.96), abs=1e-5)  # df -> inf: normal shifted by nc


def _simulated_power(effect, sd, n, crit, two_sided, reps=200_000, seed=0):
    """Share of seeded simulated paired experiments whose t statistic passes the tabulated critical value."""
    rng = np.random.default_rng(seed)
    d = rng.normal(effect, sd, size=(reps, n))
    t = d.mean(axis=1) / (d.std(axis=1, ddof=1) / math.sqrt(n))
    return float(np.mean(np.abs(t) > crit) if two_sided else np.mean(t > crit))


@pytest.mark.parametrize("effect, sd, n, alternative, crit", [
    (0.5, 1.0, 10, "one-sided", T95[9]),
    (1.0, 0.5, 6, "two-sided", 2.571),  # t_{0.975, 5} (T975 table above)
    (0.015, 0.05, 20, "one-sided", T95[19]),
    (-0.02, 0.02, 5, "one-sided", T95[4]),  # the direction of the effect does not matter
])
def test_power_matches_simulation(effect, sd, n, alternative, crit):
    sim = _simulated_power(abs(effect), sd, n, crit, alternative == "two-sided")
    assert power_paired(effect, sd, n, alternative=alternative) == pytest.approx(sim, abs=0.005)  # MC se <= 0.0012


def test_power_is_below_the_known_sd_z_test_and_meets_it_for_many_seeds():
    for n in (3, 5, 10, 40):
        z = _phi(0.5 * math.sqrt(n) - 1.644854)  # the z test that knows sd: an upper bound on the t test's power
        assert power_paired(0.5, 1.0, n) < z
    assert power_paired(0.1, 1.0, 800) == pytest.approx(_phi(0.1 * math.sqrt(800) - 1.644854), abs=0.002)
    assert power_paired(0.0, 1.0, 10) == pytest.approx(0.05, abs=1e-6)  # no effect: power is alpha
    with pytest.raises(ValueError, match="sd > 0"):
        power_paired(0.1, 0.0, 10)


@pytest.mark.parametrize("d", [0.5, 0.8, 0.2])
def test_seeds_for_power_agrees_with_guenthers_formula(d):
    # Guenther (1981): n ~ (z_{1-alpha} + z_{power})^2 / d^2 + z_{1-alpha}^2 / 2 for the one-sample t test, within
    # one seed of the exact answer (d = 0.5: 26.1 -> 27, as pwr.t.test(d=0.5, power=0.8, type="one.sample",
    # alternative="greater") gives n = 26.14)
    approx = (1.644854 + 0.841621) ** 2 / d ** 2 + 1.644854 ** 2 / 2
    n = seeds_for_power(d * 0.04, 0.04)
    assert abs(n - math.ceil(approx)) <= 1
    assert power_paired(d * 0.04, 0.04, n) >= 0.8 > power_paired(d * 0.04, 0.04, n - 1)


def test_seeds_for_power_limits():
    assert seeds_for_power(20.0, 1.0) == 2  # a huge effect: the fewest seeds a t test can use
    assert seeds_for_power(5.0, 1.0) == 3  # at n = 2 the test has 1 df and critical value 6.31: power < 0.8
    with pytest.raises(ValueError, match="more than max_n=50 seeds"):
        seeds_for_power(0.01, 1.0, max_n=50)


# ============================================================== compute multiplier
CURVE = [(100, 4.0), (200, 3.5), (400, 3.0), (800, 2.8)]


def test_tokens_to_reach_interpolates_in_log_tokens():
    r = tokens_to_reach(CURVE, 3.2)  # between (200, 3.5) and (400, 3.0): 0.3 / 0.5 = 0.6 of a doubling
    assert (r.tokens, r.status) == (pytest.approx(200 * 2 ** 0.6), "crossed")  # 303.1
    assert tokens_to_reach(CURVE, 3.0).tokens == 400.0  # exactly on a point
    assert tokens_to_reach(list(reversed(CURVE)), 3.2).tokens == pytest.approx(200 * 2 ** 0.6)  # order-free
    assert (tokens_to_reach(CURVE, 4.5).tokens, tokens_to_reach(CURVE, 4.5).status) == (100.0, "before_first")
    assert (tokens_to_reach(CURVE, 2.0).tokens, tokens_to_reach(CURVE, 2.0).status) == (math.inf, "never")
    noisy = [(100, 4.0), (200, 3.0), (400, 3.3), (800, 2.5)]  # the first crossing counts, not the noise after it
    assert tokens_to_reach(noisy, 3.1).tokens == pytest.approx(100 * 2 ** 0.9)
    assert tokens_to_reach([(100, math.inf), (200, 3.0)], 3.5).tokens == 200.0  # diverged at first: no interpolation
    assert tokens_to_reach([(100, 4.0), (200, math.nan), (400, 3.0)], 3.5).tokens == pytest.approx(200.0)  # skips nan
    with pytest.raises(ValueError, match="positive"):
        tokens_to_reach([(0, 4.0), (100, 3.0)], 3.5)


def test_compute_multiplier_geometric_mean_and_interval():
    # dense reaches the MoE's loss 3.0 at 150, 200 and 300 tokens; the MoE trained 100: ratios 1.5, 2, 3
    curves = [[(50, 4.0), (150, 3.0), (600, 2.0)], [(50, 4.0), (200, 3.0), (600, 2.0)],
              [(50, 4.0), (300, 3.0), (600, 2.0)], [(50, 2.5), (600, 2.0)], [(50, 4.0), (600, 3.5)]]
    m = compute_multiplier(curves, [3.0] * 5, 100)
    logs = [math.log(1.5), math.log(2.0), math.log(3.0)]
    half = 4.302653 * statistics.stdev(logs) / math.sqrt(3)  # t_{0.975, 2}
    assert m.mean == pytest.approx(9 ** (1 / 3))  # (1.5 * 2 * 3)^(1/3) = 2.080
    assert m.lo == pytest.approx(math.exp(statistics.fmean(logs) - half), rel=1e-5)
    assert m.hi == pytest.approx(math.exp(statistics.fmean(logs) + half), rel=1e-5)
    assert (m.log.n, m.before_first, m.never) == (3, 1, 1)
    assert m.ratios[3] == 0.5 and m.ratios[4] == math.inf
    assert m.status == ("crossed", "crossed", "crossed", "before_first", "never")
    assert m.text() == "2.08x [0.88, 4.94] (n=3 seeds; 1 below dense's first point; 1 never reached)"
    per_seed = compute_multiplier(curves[:2], [3.0, 3.0], [150, 100])  # MoE tokens given per seed: 1 and 2
    assert per_seed.ratios == pytest.approx((1.0, 2.0))
    with pytest.raises(ValueError, match="one dense curve per MoE seed"):
        compute_multiplier(curves, [3.0], 100)


# ============================================================== grid-edge extension
def test_extend_grid_follows_a_winning_edge():
    rates = [1e-3, 2e-3, 4e-3]  # uniform in log: ratio 2
    assert extend_grid(rates, {1e-3: [3.2, 3.3], 2e-3: [3.1, 3.0], 4e-3: [2.9, 2.95]}) == pytest.approx(8e-3)
    assert extend_grid(rates, {1e-3: [2.9, 2.95], 2e-3: [3.1, 3.0], 4e-3: [3.2, 3.3]}) == pytest.approx(5e-4)
    assert extend_grid(rates, {1e-3: [3.2], 2e-3: [2.9], 4e-3: [3.1]}) is None  # interior: done
    # a diverged seed makes its value's mean +inf: 2e-3 loses, and 1e-3 wins at the edge
    assert extend_grid(rates, {1e-3: [3.0, 3.0], 2e-3: [2.9, math.inf], 4e-3: [3.1, 3.2]}) == pytest.approx(5e-4)
    assert extend_grid([1.0, 3.0, 9.0], {1.0: [5.0], 3.0: [4.0], 9.0: [3.0]}) == pytest.approx(27.0)  # its own step
    # not uniform in log (3, then 3.33): the factor
    assert extend_grid([1e-3, 3e-3, 1e-2], {1e-3: [5.0], 3e-3: [4.0], 1e-2: [3.0]}, factor=2.0) == pytest.approx(2e-2)
    assert extend_grid([4e-3, 1e-3, 2e-3], {1e-3: [5.0], 2e-3: [4.0], 4e-3: [3.0]}) == pytest.approx(8e-3)  # unsorted
    assert extend_grid([1e-3, 2e-3], {1e-3: [math.nan], 2e-3: [math.inf]}) is None  # nothing learned anywhere
    assert extend_grid([1e-3, 2e-3], {1e-3: [3.0], 2e-3: [3.0]}) == pytest.approx(5e-4)  # a tie goes to the smaller
    with pytest.raises(ValueError, match="at least two distinct positive"):
        extend_grid([1e-3], {1e-3: [3.0]})
    with pytest.raises(ValueError, match="no losses for grid values"):
        extend_grid([1e-3, 2e-3], {1e-3: [3.0]})


# ============================================================== one line for the report
def test_compare_and_describe():
    d = [-0.5, -1.5, -1.0]  # one-sided p = F2(-2 sqrt(3)) = 0.037; all three negative: sign-flip p = 1/8
    c = compare(d, 0.1, "lower", p_adjusted=0.074, power_effect=0.5)
    assert c.verdict == "inconclusive" and c.sign_flip_p == 1 / 8
    assert c.power == pytest.approx(_simulated_power(0.5, 0.5, 3, T95[2], False), abs=0.005)
    half, tost_p = 4.302653 * 0.5 / math.sqrt(3), _t2_cdf(0.9 / (0.5 / math.sqrt(3)))  # mean -1 vs -0.1: 0.955
    assert describe(c) == (f"-1.000 [{-1 - half:+.3f}, {-1 + half:+.3f}] nats; p=0.037 (Holm 0.074); "
                           f"TOST p={tost_p:.3f} (±0.100); sign-flip p=0.125; n=3; power {c.power:.2f} for 0.500")
    assert describe(compare(d, 0.1, "lower")).startswith("-1.000 [-2.242, +0.242] nats; p=0.037; TOST")
    ni = describe(compare([0.001, -0.001, 0.0, 0.0005, -0.0005], 0.02, "not_higher"))
    assert "p<0.001 for d < +0.020; sign-flip p=0.031; n=5" in ni  # d - 0.02 all negative: 1/32
    assert "TOST" not in ni and "power" not in ni
    j = c.to_json()
    assert (j["verdict"], j["p_holm"], j["n"], j["sign_flip_p"]) == ("inconclusive", 0.074, 3, 0.125)
