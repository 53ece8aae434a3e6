"""Run-level inference (rpb.report.stats): the t-interval on per-run paired differences is
calibrated on synthetic data with a known effect, realistic seed-level and item-level variance; MDE,
seeds needed, Friedman power and the within-cluster correlation behave as stated in docs/claims.md;
one run's item interval; and the descriptive statistics (two-way bootstrap, paired bootstrap
differences and p-values, Spearman with a bootstrap CI, rank consistency) against scipy."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import special, stats

from rpb.report.stats import (
    bootstrap_p_value,
    friedman_power,
    item_interval,
    item_sd_of_difference,
    mde,
    paired_difference,
    paired_runs,
    rank_consistency,
    run_interval,
    seeds_needed,
    spearman_ci,
    t_interval,
    two_way_bootstrap_ci,
    within_cluster_spearman,
)

N_SIMS = 4000
N_ITEMS = 200


def _simulate_differences(n_runs: int, effect: float, rng: np.random.Generator) -> np.ndarray:
    """N_SIMS x n_runs per-run paired differences (percentage points) of two methods.

    Per run (seed): a shared seed effect and a method x seed effect of 9 points each (so the
    paired difference varies by about 13 points from seed to seed, as single tiny runs do), a
    method accuracy around 55%; binary items whose difficulty is shared by every run and method
    (a Gaussian copula with item correlation 0.5), so items are a second level of variance. The
    true difference is `effect` exactly (accuracies stay far from 0 and 1)."""
    shape = (N_SIMS, n_runs, 1)
    seed_effect = 0.09 * rng.standard_normal(shape)
    p_a = 0.55 + effect / 2 + seed_effect + 0.09 * rng.standard_normal(shape)
    p_b = 0.55 - effect / 2 + seed_effect + 0.09 * rng.standard_normal(shape)
    difficulty = rng.standard_normal((N_SIMS, 1, N_ITEMS))
    rho = 0.5

    def items(p: np.ndarray) -> np.ndarray:
        latent = rho * difficulty + math.sqrt(1 - rho**2) * rng.standard_normal(
            (N_SIMS, n_runs, N_ITEMS)
        )
        return special.ndtr(latent) < np.clip(p, 0.001, 0.999)

    return 100 * (items(p_a).mean(axis=2) - items(p_b).mean(axis=2))


@pytest.mark.parametrize("n_runs", [3, 10])
def test_t_interval_on_runs_is_calibrated(n_runs: int) -> None:
    rng = np.random.default_rng(n_runs)
    effect = 0.10  # 10 points, known
    d = _simulate_differences(n_runs, effect, rng)
    _, low, high, _ = t_interval(d, confidence=0.95)
    coverage = float(((low <= 100 * effect) & (100 * effect <= high)).mean())
    assert 0.93 <= coverage <= 0.97, coverage
    null = _simulate_differences(n_runs, 0.0, rng)
    _, low, high, _ = t_interval(null, confidence=0.95)
    false_supported = float((low > 0).mean())  # the direction rule's "supported"
    assert false_supported <= 0.05, false_supported
    null_coverage = float(((low <= 0) & (high >= 0)).mean())
    assert 0.93 <= null_coverage <= 0.97, null_coverage


def test_mde_is_the_effect_found_with_80_percent_power() -> None:
    """At a true effect equal to the MDE (from the true spread), the interval excludes 0 in
    about 80% of repetitions (the t-quantile formula approximates the noncentral t)."""
    rng = np.random.default_rng(7)
    n, sd = 10, 12.0
    effect = mde(sd, n)
    d = effect + sd * rng.standard_normal((N_SIMS, n))
    _, low, _, _ = t_interval(d)
    assert 0.74 <= float((low > 0).mean()) <= 0.86
    # More spread or fewer runs: a larger MDE; the equivalence resolution is larger still.
    assert mde(2 * sd, n) == pytest.approx(2 * effect)
    assert mde(sd, 3) > effect
    assert mde(sd, n, equivalence=True) > effect
    assert math.isnan(mde(sd, 1)) and math.isnan(mde(float("nan"), 5))


def test_seeds_needed_is_the_first_n_whose_mde_fits() -> None:
    n = seeds_needed(15.0, 5.0)
    assert mde(15.0, n) <= 5.0 < mde(15.0, n - 1)
    assert seeds_needed(0.0, 5.0) == 2
    assert seeds_needed(float("nan"), 5.0) == -1
    assert seeds_needed(1000.0, 0.1, cap=50) == 51
    assert seeds_needed(15.0, 5.0, equivalence=True) > n
    with pytest.raises(ValueError, match="margin"):
        seeds_needed(1.0, 0.0)


def test_paired_runs_is_the_one_sample_t_test_of_the_differences() -> None:
    a, b = np.array([80.0, 70.0, 90.0, 60.0]), np.array([60.0, 65.0, 62.0, 61.0])
    diff = paired_runs(a, b, n_items=200)
    ref = stats.ttest_rel(a, b)
    ci = ref.confidence_interval(0.95)
    assert diff.estimate == pytest.approx((a - b).mean())
    assert (diff.low, diff.high) == pytest.approx((ci.low, ci.high))
    assert diff.p_value == pytest.approx(ref.pvalue)
    assert diff.n_seeds == 4 and diff.n_items == 200
    assert diff.sd == pytest.approx(np.std(a - b, ddof=1))
    assert diff.as_dict()["mde"] == pytest.approx(mde(diff.sd, 4))
    with pytest.raises(ValueError, match="shape"):
        paired_runs(a, b[:3])


def test_identical_runs_give_exactly_no_difference() -> None:
    """A placebo built from runs identical to the reference: difference 0, interval [0, 0]."""
    runs = np.array([81.5, 62.0, 90.5])
    diff = paired_runs(runs, runs.copy())
    assert (diff.estimate, diff.low, diff.high, diff.sd, diff.mde) == (0, 0, 0, 0, 0)
    assert diff.p_value == 1.0


def test_one_run_has_no_interval_and_bad_input_is_named() -> None:
    one = run_interval([5.0])
    assert one.estimate == 5.0 and math.isnan(one.low) and math.isnan(one.mde)
    assert one.seeds_needed(5.0) == -1
    # With its items' noise known, one run gets the interval of that run (normal, items only).
    items = run_interval([5.0], min_sd=2.0)
    assert (items.low, items.high) == pytest.approx((5.0 - 1.959964 * 2, 5.0 + 1.959964 * 2))
    assert math.isnan(items.mde) and items.n_seeds == 1
    same = run_interval([0.0], min_sd=0.0)  # one run, no item differs
    assert (same.low, same.high, same.p_value) == (0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="finite"):
        run_interval([1.0, float("nan")])
    with pytest.raises(ValueError, match="confidence"):
        t_interval([1.0, 2.0], confidence=1.0)


def test_friedman_power_grows_with_blocks_and_effect() -> None:
    rng = np.random.default_rng(3)
    scores = 10.0 * rng.standard_normal((6, 4))
    weak = friedman_power(scores, 5.0, n_sims=1000)
    assert weak.power < 0.5 and weak.blocks_needed > 6 and weak.noise_sd > 0
    # Noise-free data with a spread of 30 points: the test cannot miss it.
    strong = friedman_power(np.tile([0.0, 10.0, 20.0, 30.0], (6, 1)), 30.0, n_sims=200)
    assert strong.power == 1.0 and strong.blocks_needed == 6
    big = friedman_power(scores, 40.0, n_sims=1000)
    assert big.power > weak.power
    assert math.isnan(friedman_power(scores[:, :2], 5.0).power)


def test_within_cluster_spearman_removes_cluster_effects() -> None:
    """Across clusters x and y are unrelated (each cluster shifted), within each they agree."""
    x = np.array([1.0, 2.0, 3.0, 4.0] * 3) + np.repeat([0.0, 10.0, 20.0], 4)
    y = np.array([1.0, 2.0, 3.0, 4.0] * 3) + np.repeat([20.0, 10.0, 0.0], 4)
    clusters = np.repeat([0, 1, 2], 4)
    within = within_cluster_spearman(x, y, clusters)
    assert within.estimate == pytest.approx(1.0) and within.n_seeds == 3
    assert within.low == within.high == pytest.approx(1.0)
    assert stats.spearmanr(x, y).statistic < 0  # the pooled rho reads the cluster shifts
    flat = within_cluster_spearman(x, np.ones_like(y), clusters)
    assert math.isnan(flat.estimate) and flat.n_seeds == 0


def test_item_noise_floors_the_spread_of_tied_runs() -> None:
    """Two runs whose differences tie exactly (discrete scores) still carry their items' noise:
    the interval is not zero-width, and identical runs (no item differences) stay exact."""
    rng = np.random.default_rng(0)
    a = [(rng.random(100) < 0.5).astype(float) for _ in range(2)]
    b = [x.copy() for x in a]
    b[0][:10] = 1 - b[0][:10]  # ten items flip in each run
    b[1][10:20] = 1 - b[1][10:20]
    item_sd = item_sd_of_difference([[(a[i], b[i])] for i in range(2)])
    expected = np.sqrt(np.mean([np.var(a[i] - b[i], ddof=1) / 100 for i in range(2)]))
    assert item_sd == pytest.approx(expected) and item_sd > 0
    scores_a, scores_b = [x.mean() for x in a], [x.mean() for x in b]
    tied = paired_runs(scores_a, scores_b)
    floored = paired_runs(scores_a, scores_b, item_sd=item_sd)
    assert floored.estimate == tied.estimate
    assert floored.sd == pytest.approx(item_sd) and floored.high - floored.low > 0
    assert floored.mde > 0 and 0 < floored.p_value < 1
    same = item_sd_of_difference([[(a[i], a[i])] for i in range(2)])
    assert same == 0.0 and paired_runs(scores_a, scores_a, item_sd=same).high == 0.0


def test_item_interval_is_the_normal_interval_of_the_mean_of_task_means() -> None:
    """One run (the base): its score weighs each task the same; the variance of that mean is the
    binomial variance of each task's mean, summed and divided by the number of tasks squared."""
    tasks = [np.array([1, 1, 0, 0]), np.array([1, 1, 1, 1, 1, 0, 0, 0])]
    score, low, high = item_interval(tasks, 0.9)
    assert score == pytest.approx(100 * (0.5 + 0.625) / 2)
    half = stats.norm.ppf(0.95) * math.sqrt(0.25 / 4 + 0.625 * 0.375 / 8) / 2
    assert (low, high) == pytest.approx((score - 100 * half, score + 100 * half))
    # Cut to [0, 100]: a perfect run has a zero-width interval at 100.
    assert item_interval([np.ones(5)], 0.95) == (100.0, 100.0, 100.0)


# --- two_way_bootstrap_ci ---------------------------------------------------------------------


def test_mean_is_exact_and_ci_brackets_it() -> None:
    scores = np.random.default_rng(0).random((3, 40))
    mean, low, high = two_way_bootstrap_ci(scores, n_resamples=500)
    assert mean == scores.mean()
    assert low < mean < high


def test_one_seed_is_the_item_bootstrap_of_scipy() -> None:
    items = np.random.default_rng(1).normal(0.6, 0.2, size=300)
    _, low, high = two_way_bootstrap_ci(items[None, :], n_resamples=4000, seed=3)
    ref = stats.bootstrap(
        (items,),
        np.mean,
        confidence_level=0.95,
        n_resamples=4000,
        method="percentile",
        random_state=np.random.default_rng(4),
    ).confidence_interval
    width = ref.high - ref.low
    # Different random draws: agreement to a few percent of the width is what Monte Carlo allows.
    assert low == pytest.approx(ref.low, abs=0.06 * width)
    assert high == pytest.approx(ref.high, abs=0.06 * width)


def test_ci_narrows_with_more_items() -> None:
    rng = np.random.default_rng(2)
    few = two_way_bootstrap_ci(rng.random((2, 50)), n_resamples=1000)
    many = two_way_bootstrap_ci(rng.random((2, 800)), n_resamples=1000)
    # Width scales as 1/sqrt(items): 16x the items, about 1/4 the width.
    assert (many[2] - many[1]) < 0.4 * (few[2] - few[1])


def test_seed_to_seed_variation_widens_the_ci() -> None:
    """Resampling seeds, not only items: rows that disagree must widen the interval."""
    items = np.random.default_rng(5).random(200)
    same = np.stack([items] * 4)
    spread = same + np.array([-0.2, -0.1, 0.1, 0.2])[:, None]
    _, low_same, high_same = two_way_bootstrap_ci(same, n_resamples=1000)
    mean, low_spread, high_spread = two_way_bootstrap_ci(spread, n_resamples=1000)
    assert mean == pytest.approx(same.mean())
    assert (high_spread - low_spread) > 2 * (high_same - low_same)


def test_bootstrap_is_deterministic_per_seed() -> None:
    scores = np.random.default_rng(6).random((3, 30))
    assert two_way_bootstrap_ci(scores, seed=7) == two_way_bootstrap_ci(scores, seed=7)
    assert two_way_bootstrap_ci(scores, seed=7) != two_way_bootstrap_ci(scores, seed=8)


@pytest.mark.parametrize("bad", [np.zeros(5), np.zeros((0, 4)), np.zeros((2, 3, 4))])
def test_bootstrap_rejects_non_matrices(bad: np.ndarray) -> None:
    with pytest.raises(ValueError, match="seeds x items"):
        two_way_bootstrap_ci(bad)


# --- descriptive statistics: paired bootstrap differences, p-values, Spearman, rank consistency


def test_paired_difference_matches_scipy_paired_bootstrap_for_one_seed() -> None:
    rng = np.random.default_rng(10)
    a = rng.normal(0.5, 0.3, 300)
    b = a - 0.05 + rng.normal(0, 0.2, 300)
    diff = paired_difference(a[None], b[None], n_resamples=4000, seed=1)
    ref = stats.bootstrap(
        (a, b),
        lambda x, y: np.mean(x - y),
        paired=True,
        vectorized=False,
        n_resamples=4000,
        method="percentile",
        rng=np.random.default_rng(2),
    ).confidence_interval
    width = ref.high - ref.low
    assert diff.estimate == pytest.approx(np.mean(a - b))
    assert diff.low == pytest.approx(ref.low, abs=0.06 * width)
    assert diff.high == pytest.approx(ref.high, abs=0.06 * width)
    assert (diff.n_seeds, diff.n_items) == (1, 300)


def test_paired_difference_keeps_the_pairing() -> None:
    """Items vary a lot but both methods move together: the paired CI must be narrow."""
    base = np.random.default_rng(11).random((2, 200)) * 100
    diff = paired_difference(base + 1.0, base)
    assert diff.estimate == pytest.approx(1.0)
    assert diff.low == pytest.approx(1.0) and diff.high == pytest.approx(1.0)
    assert diff.p_value < 0.01


@pytest.mark.parametrize("shift", [0.0, 0.04, 0.08])
def test_bootstrap_p_value_agrees_with_the_paired_t_test(shift: float) -> None:
    rng = np.random.default_rng(12)
    a = rng.normal(0.0, 0.3, 400)
    b = a - shift + rng.normal(0, 0.3, 400)
    diff = paired_difference(a[None], b[None], n_resamples=4000, seed=3)
    ref = stats.ttest_rel(a, b).pvalue
    # Large n: the bootstrap and t reference distributions agree; the rest is Monte Carlo error.
    assert diff.p_value == pytest.approx(ref, abs=0.03 + 0.15 * ref)
    # p < 0.05 exactly when the 95% CI excludes zero: both come from the same replicates.
    assert (diff.p_value < 0.05) == (diff.low > 0 or diff.high < 0)


def test_bootstrap_p_value_edges() -> None:
    assert bootstrap_p_value(np.zeros(99)) == 1.0
    assert bootstrap_p_value(np.ones(99)) == pytest.approx(2 / 100)
    assert bootstrap_p_value(np.r_[-np.ones(10), np.ones(89)]) == pytest.approx(2 * 11 / 100)
    with pytest.raises(ValueError, match="finite"):
        bootstrap_p_value(np.array([np.nan, 1.0]))


def test_paired_difference_of_one_cell_has_no_interval() -> None:
    diff = paired_difference(np.array([[0.9]]), np.array([[0.4]]))
    assert diff.estimate == pytest.approx(0.5)
    assert math.isnan(diff.low) and math.isnan(diff.high) and math.isnan(diff.p_value)


def test_paired_difference_rejects_unpaired_shapes() -> None:
    with pytest.raises(ValueError, match="differ in shape"):
        paired_difference(np.zeros((2, 5)), np.zeros((2, 6)))
    with pytest.raises(ValueError, match="NaN"):
        paired_difference(np.full((1, 3), np.nan), np.zeros((1, 3)))


def test_spearman_matches_scipy_and_its_ci_brackets_rho() -> None:
    rng = np.random.default_rng(13)
    x = rng.random(30)
    y = x + rng.normal(0, 0.3, 30)
    corr = spearman_ci(x, y, n_resamples=1000)
    ref = stats.spearmanr(x, y)
    assert corr.rho == pytest.approx(ref.statistic)
    assert corr.p_value == pytest.approx(ref.pvalue)
    assert corr.low < corr.rho < corr.high and corr.n == 30
    boot = stats.bootstrap(
        (x, y),
        lambda u, v: stats.spearmanr(u, v).statistic,
        paired=True,
        vectorized=False,
        n_resamples=1000,
        method="percentile",
        rng=np.random.default_rng(4),
    ).confidence_interval
    assert corr.low == pytest.approx(boot.low, abs=0.08)
    assert corr.high == pytest.approx(boot.high, abs=0.08)


def test_spearman_monotone_and_degenerate() -> None:
    x = np.arange(8.0)
    perfect = spearman_ci(x, x**3, n_resamples=200)
    assert (perfect.rho, perfect.low, perfect.high) == pytest.approx((1.0, 1.0, 1.0))
    flat = spearman_ci(x, np.ones(8))
    assert math.isnan(flat.rho) and math.isnan(flat.low)
    assert math.isnan(spearman_ci([1.0, 2.0], [2.0, 1.0]).rho)


def test_spearman_ci_survives_constant_resamples() -> None:
    """Four of five units share x: many replicates are constant and have no rho."""
    x, y = np.array([0.0, 0.0, 0.0, 0.0, 1.0]), np.array([0.1, 0.3, 0.2, 0.4, 0.9])
    corr = spearman_ci(x, y, n_resamples=500)
    assert corr.rho == pytest.approx(stats.spearmanr(x, y).statistic)
    assert -1.0 <= corr.low <= corr.high <= 1.0


def test_rank_consistency_identical_vs_shuffled_orderings() -> None:
    methods = ["a", "b", "c", "d"]
    same = np.tile([4.0, 3.0, 2.0, 1.0], (6, 1))
    check = rank_consistency(same, methods)
    assert check.identical_ranking and check.same_best == "a"
    assert check.kendall_w == pytest.approx(1.0)
    # scipy's Friedman test on the same blocks.
    assert check.friedman_p == pytest.approx(stats.friedmanchisquare(*same.T).pvalue)
    assert check.friedman_p < 0.01 and check.mean_rank == {"a": 1, "b": 2, "c": 3, "d": 4}
    # Every method wins some blocks: no ordering.
    latin = np.array([np.roll([4.0, 3.0, 2.0, 1.0], i) for i in range(4)])
    check = rank_consistency(latin, methods)
    assert not check.identical_ranking and check.same_best is None
    assert check.kendall_w == pytest.approx(0.0) and check.friedman_p == pytest.approx(1.0)
    ties = rank_consistency(np.ones((3, 4)), methods)
    assert math.isnan(ties.friedman_p) and ties.same_best is None
    with pytest.raises(ValueError, match="blocks x methods"):
        rank_consistency(np.ones((3, 4)), methods[:3])
