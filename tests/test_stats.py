"""Run-level inference (rpb.stats): the t-interval on per-run paired differences is calibrated on
synthetic data with a known effect, realistic seed-level and item-level variance; MDE, seeds
needed, Friedman power and the within-cluster correlation behave as stated in docs/claims.md."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import special, stats

from rpb.stats import (
    friedman_power,
    item_sd_of_difference,
    mde,
    paired_runs,
    run_interval,
    seeds_needed,
    t_interval,
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
