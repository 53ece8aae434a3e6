"""Statistics for the tables and the claims audit.

Run-level inference (what the tables and the claims audit decide on): the unit of replication is
the run (model, corpus, method, seed); a run's score is a mean over its evaluation items, and
methods are compared by paired per-run differences with a t-interval (`t_interval`,
`paired_runs`), its minimum detectable effect (`mde`) and the seeds an MDE under a margin needs
(`seeds_needed`); the Friedman test's power by simulation (`friedman_power`); Spearman's rho
within clusters (`within_cluster_spearman`). docs/claims.md states the rules and
tests/test_stats.py checks the intervals' coverage on synthetic data.

Older two-way (seeds x items) bootstrap intervals, Spearman with a bootstrap CI and a rank
consistency check stay for descriptive use: with 3 seeds the two-way bootstrap covers the truth
far less often than its nominal level, so no verdict uses it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy import stats

DEFAULT_RESAMPLES = 2000

DEFAULT_POWER = 0.8
MAX_SEEDS = 1000

# The kinds of interval the tables and verdicts compute: `t_interval` (and `run_interval` built on
# it) over runs, and `item_interval`, a single run's normal interval of its item sampling. Every
# caption names them through `describe_interval` (rpb.report.tables' notes, rpb.report.report_html),
# so a caption cannot name another interval than the one computed (tests/test_report_html.py).
RUN_INTERVAL = "t-interval"
ITEM_INTERVAL = "normal interval"

__all__ = [
    "DEFAULT_POWER",
    "DEFAULT_RESAMPLES",
    "ITEM_INTERVAL",
    "MAX_SEEDS",
    "RUN_INTERVAL",
    "Correlation",
    "Difference",
    "FriedmanPower",
    "RankConsistency",
    "block_ranks",
    "bootstrap_p_value",
    "describe_interval",
    "friedman_power",
    "item_interval",
    "item_sd_of_difference",
    "mde",
    "paired_difference",
    "paired_runs",
    "rank_consistency",
    "run_interval",
    "seeds_needed",
    "spearman_ci",
    "t_interval",
    "two_way_bootstrap_ci",
    "two_way_bootstrap_means",
    "within_cluster_spearman",
]


def _matrix(scores: Any, name: str = "scores") -> np.ndarray:
    scores = np.asarray(scores, dtype=float)
    if scores.ndim != 2 or scores.size == 0:
        raise ValueError(
            f"{name}: expected a non-empty seeds x items matrix, got shape {scores.shape}"
        )
    if not np.isfinite(scores).all():
        raise ValueError(f"{name}: the seeds x items matrix has NaN or infinite entries")
    return scores


def two_way_bootstrap_means(
    scores: np.ndarray, *, n_resamples: int = DEFAULT_RESAMPLES, seed: int = 0
) -> np.ndarray:
    """Bootstrap distribution of the mean of a seeds x items matrix, resampling both axes.

    Each replicate draws seeds and items independently with replacement and averages the selected
    cells. Returns the `n_resamples` replicate means.
    """
    scores = _matrix(scores)
    n_seeds, n_items = scores.shape
    rng = np.random.default_rng(seed)
    means = np.empty(n_resamples)
    for r in range(n_resamples):
        rows = rng.integers(0, n_seeds, n_seeds)
        cols = rng.integers(0, n_items, n_items)
        means[r] = scores[np.ix_(rows, cols)].mean()
    return means


def two_way_bootstrap_ci(
    scores: np.ndarray,
    *,
    confidence: float = 0.95,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float, float]:
    """Mean of a seeds x items score matrix and its percentile CI, resampling both axes.

    Seeds and evaluation items are both random draws (training noise and test-set noise), so each
    replicate resamples seeds and items independently with replacement and averages the selected
    cells; a single seed degenerates to the usual item bootstrap. Returns (mean, low, high).
    """
    scores = _matrix(scores)
    means = two_way_bootstrap_means(scores, n_resamples=n_resamples, seed=seed)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return float(scores.mean()), float(low), float(high)


def bootstrap_p_value(replicates: np.ndarray, null: float = 0.0) -> float:
    """Two-sided p-value of `null` from a bootstrap distribution: the inverted percentile CI.

    p = 2 min(#{T* <= null} + 1, #{T* >= null} + 1) / (B + 1), capped at 1; so p < 1 - c exactly
    when `null` lies outside the level-c percentile interval (up to the +1 that keeps p > 0).
    """
    t = np.asarray(replicates, dtype=float)
    if t.ndim != 1 or t.size == 0 or not np.isfinite(t).all():
        raise ValueError("replicates must be a non-empty 1-D array of finite values")
    below = int((t <= null).sum()) + 1
    above = int((t >= null).sum()) + 1
    return float(min(1.0, 2.0 * min(below, above) / (t.size + 1)))


@dataclass(frozen=True)
class Difference:
    """Mean of a - b, its CI and two-sided p-value; from `paired_runs` also the per-run spread
    `sd`, the minimum detectable effect `mde` (direction and exceeds rules) and `mde_equivalence`
    (the equivalence rule's resolution) at the interval's level and `power`."""

    estimate: float
    low: float
    high: float
    p_value: float
    n_seeds: int
    n_items: int
    sd: float = float("nan")
    mde: float = float("nan")
    mde_equivalence: float = float("nan")
    confidence: float = 0.95
    power: float = DEFAULT_POWER

    def as_dict(self, prefix: str = "diff") -> dict[str, float | int]:
        """Flat columns for a table: `{prefix}`, `{prefix}_ci_low`, ... ."""
        d = asdict(self)
        return {
            prefix: d["estimate"],
            f"{prefix}_ci_low": d["low"],
            f"{prefix}_ci_high": d["high"],
            "p_value": d["p_value"],
            "n_seeds": d["n_seeds"],
            "n_items": d["n_items"],
            f"{prefix}_sd": d["sd"],
            "mde": d["mde"],
            "mde_equivalence": d["mde_equivalence"],
        }

    def seeds_needed(self, margin: float, equivalence: bool = False) -> int:
        """Seeds that would bring this comparison's MDE under `margin` (see `seeds_needed`)."""
        return seeds_needed(
            self.sd, margin, confidence=self.confidence, power=self.power, equivalence=equivalence
        )


# --- run-level inference ------------------------------------------------------------------------


def _check_level(confidence: float, power: float = DEFAULT_POWER) -> None:
    if not 0.5 <= confidence < 1:
        raise ValueError(f"confidence must be in [0.5, 1), got {confidence}")
    if not 0 < power < 1:
        raise ValueError(f"power must be in (0, 1), got {power}")


def describe_interval(confidence: float, over: str = "runs", kind: str = RUN_INTERVAL) -> str:
    """A caption's name of the interval computed at `confidence`: `kind` (RUN_INTERVAL for
    `t_interval` / `run_interval`, ITEM_INTERVAL for `item_interval`) over `over`, e.g.
    "95% t-interval over runs"."""
    _check_level(confidence)
    if kind not in (RUN_INTERVAL, ITEM_INTERVAL):
        raise ValueError(f"unknown interval kind {kind!r} ({RUN_INTERVAL}, {ITEM_INTERVAL})")
    return f"{100 * confidence:g}% {kind} over {over}"


def t_interval(
    values: Any, *, confidence: float = 0.95, axis: int = -1
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Mean of `values` along `axis` and its t-interval: (mean, low, high, sd).

    mean ± t_{(1+c)/2, n-1} · sd/√n, sd the sample standard deviation (ddof 1). Vectorised over
    the other axes (for simulations). Fewer than 2 values: NaN interval and sd."""
    _check_level(confidence)
    x = np.asarray(values, dtype=float)
    n = x.shape[axis]
    mean = x.mean(axis=axis)
    if n < 2:
        nan = np.full_like(mean, np.nan)
        return mean, nan, nan.copy(), nan.copy()
    sd = x.std(axis=axis, ddof=1)
    half = stats.t.ppf((1 + confidence) / 2, n - 1) * sd / np.sqrt(n)
    return mean, mean - half, mean + half, sd


def mde(
    sd: float,
    n: int,
    *,
    confidence: float = 0.95,
    power: float = DEFAULT_POWER,
    equivalence: bool = False,
) -> float:
    """Minimum detectable effect of a t-interval over n runs with per-run spread sd.

    (t_{(1+c)/2, n-1} + t_{power, n-1}) · sd/√n: the true difference whose interval excludes 0
    with probability `power`. With `equivalence`, (t_{(1+c)/2, n-1} + t_{(1+power)/2, n-1}) ·
    sd/√n: the smallest margin within which equivalence is shown with probability `power` when
    the true difference is 0. NaN for n < 2 or an undefined sd."""
    _check_level(confidence, power)
    if n < 2 or not math.isfinite(sd):
        return float("nan")
    beta = (1 + power) / 2 if equivalence else power
    df = n - 1
    return float(
        (stats.t.ppf((1 + confidence) / 2, df) + stats.t.ppf(beta, df)) * sd / math.sqrt(n)
    )


def seeds_needed(
    sd: float,
    margin: float,
    *,
    confidence: float = 0.95,
    power: float = DEFAULT_POWER,
    equivalence: bool = False,
    cap: int = MAX_SEEDS,
) -> int:
    """The smallest n >= 2 whose MDE at this sd is at most `margin` (`cap` + 1 when even `cap`
    seeds would not do; 2 when sd is 0). An undefined sd (one seed) gives -1: unknown."""
    if margin <= 0:
        raise ValueError(f"margin must be > 0, got {margin}")
    if not math.isfinite(sd):
        return -1
    if sd == 0:
        return 2
    ns = np.arange(2, cap + 1)
    beta = (1 + power) / 2 if equivalence else power
    dfs = ns - 1
    mdes = (stats.t.ppf((1 + confidence) / 2, dfs) + stats.t.ppf(beta, dfs)) * sd / np.sqrt(ns)
    ok = np.flatnonzero(mdes <= margin)
    return int(ns[ok[0]]) if ok.size else cap + 1


def run_interval(
    scores: Any,
    *,
    confidence: float = 0.95,
    power: float = DEFAULT_POWER,
    n_items: int = 0,
    min_sd: float | None = None,
) -> Difference:
    """Mean of per-run values (scores or paired differences), its t-interval, the one-sample
    t-test's p-value of 0 and the MDEs. sd 0 (identical runs) gives [d, d] and p 1 or 0.

    `min_sd` floors the per-run spread: a run's score carries at least its items' sampling
    noise, so a few runs whose scores happen to tie do not give a zero-width interval; with one
    run it gives that run's item interval (None: unknown, a NaN interval)."""
    x = np.asarray(scores, dtype=float)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"expected a non-empty 1-D array of per-run values, got {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("per-run values must be finite (a NaN score or metric in a run?)")
    mean, low, high, sd = (float(v) for v in t_interval(x, confidence=confidence))
    n = x.size
    if n >= 2 and sd <= 1e-12 * (1.0 + abs(mean)):
        # Runs equal up to float rounding: the spread is 0, not a t-test's catastrophic
        # cancellation.
        low = high = mean
        sd = 0.0
    if n >= 2 and min_sd is not None and min_sd > sd:
        sd = float(min_sd)
        half = stats.t.ppf((1 + confidence) / 2, n - 1) * sd / math.sqrt(n)
        low, high = mean - half, mean + half
    if n < 2:
        p = float("nan")
        if min_sd is not None:
            # One run: only its items' noise is known. The interval describes this run, not the
            # population of runs (n_seeds 1 says so; no verdict is drawn from it).
            half = stats.norm.ppf((1 + confidence) / 2) * min_sd
            low, high = mean - half, mean + half
            if min_sd > 0:
                p = float(2 * stats.norm.sf(abs(mean) / min_sd))
            else:
                p = 1.0 if mean == 0 else 0.0
    elif sd == 0:
        p = 1.0 if mean == 0 else 0.0
    else:
        p = float(2 * stats.t.sf(abs(mean) / (sd / math.sqrt(n)), n - 1))
    return Difference(
        estimate=mean,
        low=low,
        high=high,
        p_value=p,
        n_seeds=n,
        n_items=n_items,
        sd=sd,
        mde=mde(sd, n, confidence=confidence, power=power),
        mde_equivalence=mde(sd, n, confidence=confidence, power=power, equivalence=True),
        confidence=confidence,
        power=power,
    )


def paired_runs(
    a: Any,
    b: Any,
    *,
    confidence: float = 0.95,
    power: float = DEFAULT_POWER,
    n_items: int = 0,
    item_sd: float = 0.0,
) -> Difference:
    """Paired comparison of two methods' per-run scores (entry s of each: the same seed, so the
    same initial model and data order): the t-interval of the mean per-run difference a - b.
    `item_sd`: the standard error of one run's paired difference from its items alone (see
    `item_sd_of_difference`), the floor of the per-run spread."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired runs differ in shape: {a.shape} vs {b.shape}")
    return run_interval(a - b, confidence=confidence, power=power, n_items=n_items, min_sd=item_sd)


def item_interval(per_task: Sequence[np.ndarray], confidence: float) -> tuple[float, float, float]:
    """Score (%) of ONE run (the mean of its task means) and the normal interval of its item
    sampling: the only variance a single run (the base) has. Items are fractions in [0, 1]:
    0/1 exact match (their variance is the binomial m (1 - m)) or a probability (p(target))."""
    means = [float(np.mean(v)) for v in per_task]
    # np.var (ddof 0) of 0/1 items is m (1 - m) up to rounding: exact match keeps its interval.
    var = sum(float(np.var(v)) / max(len(v), 1) for v in per_task)
    half = stats.norm.ppf((1 + confidence) / 2) * math.sqrt(var) / len(means)
    mean = float(np.mean(means))
    return 100 * mean, 100 * max(0.0, mean - half), 100 * min(1.0, mean + half)


def item_sd_of_difference(runs: Sequence[Sequence[tuple[Any, Any]]]) -> float:
    """Item-level standard error of one run's paired difference, averaged over runs (as a
    variance). `runs`: per run, per task, the two methods' item scores (same items in order); a
    run's score is the mean of its task means, so its item variance is the sum over tasks of
    var(a - b) / n_t, divided by the number of tasks squared."""
    variances = []
    for tasks in runs:
        total = 0.0
        for a, b in tasks:
            d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
            total += float(d.var(ddof=1)) / d.size if d.size > 1 else 0.0
        variances.append(total / max(len(tasks), 1) ** 2)
    return float(math.sqrt(np.mean(variances))) if variances else 0.0


def paired_difference(
    a: np.ndarray,
    b: np.ndarray,
    *,
    confidence: float = 0.95,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> Difference:
    """Paired comparison of two seeds x items score matrices (same seed, same item per cell).

    The cell differences a - b are resampled over seeds and items together (the pairing is kept:
    a replicate picks the same cells of both), giving the percentile CI of the mean difference and
    the bootstrap p-value of "no difference" from the same replicates, so p < 1 - confidence
    exactly when the CI excludes zero. A single cell gives NaN for the interval and p-value.
    """
    a, b = _matrix(a, "a"), _matrix(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"paired matrices differ in shape: {a.shape} vs {b.shape}")
    diff = a - b
    if diff.size == 1:
        # One observation has no sampling distribution: the interval is undefined, not [d, d].
        nan = float("nan")
        return Difference(float(diff.mean()), nan, nan, nan, 1, 1)
    means = two_way_bootstrap_means(diff, n_resamples=n_resamples, seed=seed)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return Difference(
        estimate=float(diff.mean()),
        low=float(low),
        high=float(high),
        p_value=bootstrap_p_value(means),
        n_seeds=diff.shape[0],
        n_items=diff.shape[1],
    )


def _spearman_rows(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
    """Spearman's rho along `axis` (Pearson on average ranks, as scipy.stats.spearmanr computes
    it), vectorised over bootstrap replicates; NaN where a replicate is constant."""
    rx, ry = stats.rankdata(x, axis=axis), stats.rankdata(y, axis=axis)
    rx = rx - rx.mean(axis=axis, keepdims=True)
    ry = ry - ry.mean(axis=axis, keepdims=True)
    den = np.sqrt((rx * rx).sum(axis=axis) * (ry * ry).sum(axis=axis))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (rx * ry).sum(axis=axis) / den, np.nan)


@dataclass(frozen=True)
class Correlation:
    """Spearman rank correlation, its bootstrap CI over units, and scipy's p-value."""

    rho: float
    low: float
    high: float
    p_value: float
    n: int


def spearman_ci(
    x: Any,
    y: Any,
    *,
    confidence: float = 0.95,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
) -> Correlation:
    """Spearman's rho of paired samples x, y with a percentile bootstrap CI (units resampled in
    pairs); rho and p-value are scipy's. Replicates with a constant resample (rho undefined) are
    left out of the interval. NaN throughout when rho itself is undefined (n < 3 or a constant)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"x and y must be 1-D of equal length, got {x.shape} and {y.shape}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("x and y must be finite")
    n = x.size
    nan = float("nan")
    if n < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return Correlation(nan, nan, nan, nan, n)
    result = stats.spearmanr(x, y)
    with warnings.catch_warnings():
        # Constant replicates give NaN and scipy's own interval then warns; the interval below
        # is taken over the finite replicates instead.
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)
        boot = stats.bootstrap(
            (x, y),
            _spearman_rows,
            paired=True,
            vectorized=True,
            n_resamples=n_resamples,
            method="percentile",
            confidence_level=confidence,
            rng=np.random.default_rng(seed),
        )
    dist = np.asarray(boot.bootstrap_distribution, dtype=float)
    dist = dist[np.isfinite(dist)]
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(dist, [alpha, 1.0 - alpha]) if dist.size else (nan, nan)
    return Correlation(float(result.statistic), float(low), float(high), float(result.pvalue), n)


@dataclass(frozen=True)
class RankConsistency:
    """Is one ordering of methods consistent across blocks (e.g. corpus x seed)?

    `kendall_w` (0: no agreement, 1: identical rankings in every block) and `friedman_p` (the
    Friedman test of "no method ranks systematically higher"; NaN with < 3 methods or no
    variation), `identical_ranking` (the same strict order in every block), `same_best` (the same
    single method ranked first in every block; None otherwise), and the mean rank per method
    (1 = best).
    """

    kendall_w: float
    friedman_p: float
    identical_ranking: bool
    same_best: str | None
    mean_rank: dict[str, float]
    n_blocks: int


def block_ranks(scores: np.ndarray) -> np.ndarray:
    """Ranks within each row of a blocks x methods matrix, 1 = highest score, ties averaged."""
    return stats.rankdata(-np.asarray(scores, dtype=float), axis=1)


def rank_consistency(scores: Any, methods: list[str]) -> RankConsistency:
    """Ranking consistency of a blocks x methods score matrix (higher score = better)."""
    s = np.asarray(scores, dtype=float)
    if s.ndim != 2 or s.shape[1] != len(methods) or s.shape[0] < 1 or len(methods) < 2:
        raise ValueError(
            f"scores must be blocks x methods with >= 2 methods ({len(methods)} named), "
            f"got shape {s.shape}"
        )
    if not np.isfinite(s).all():
        raise ValueError("scores must be finite")
    ranks = block_ranks(s)
    n, k = s.shape
    nan = float("nan")
    friedman_p, w = nan, nan
    if k >= 3 and n >= 2 and not all(np.ptp(row) == 0 for row in s):
        chi2, friedman_p = stats.friedmanchisquare(*s.T)
        # Kendall's W from the tie-corrected Friedman statistic.
        w = float(chi2 / (n * (k - 1)))
        friedman_p = float(friedman_p)
    strict = all(len(set(row)) == k for row in ranks)
    identical = n >= 2 and strict and bool((ranks == ranks[0]).all())
    best = {tuple(np.flatnonzero(row == row.min())) for row in ranks}
    same_best = None
    if len(best) == 1:
        (winners,) = best
        same_best = methods[winners[0]] if len(winners) == 1 and n >= 2 else None
    mean_rank = {m: float(r) for m, r in zip(methods, ranks.mean(axis=0), strict=True)}
    return RankConsistency(w, friedman_p, identical, same_best, mean_rank, n)


# --- power of the Friedman test and within-cluster correlation ----------------------------------


def _friedman_p(scores: np.ndarray) -> np.ndarray:
    """Friedman p-values of sims x blocks x methods scores (continuous: no ties), vectorised."""
    _, n, k = scores.shape
    ranks = scores.argsort(axis=2).argsort(axis=2) + 1.0
    rank_sums = ranks.sum(axis=1)
    chi2 = 12.0 / (n * k * (k + 1)) * (rank_sums**2).sum(axis=1) - 3.0 * n * (k + 1)
    return stats.chi2.sf(chi2, k - 1)


@dataclass(frozen=True)
class FriedmanPower:
    """Power of the Friedman test at level alpha against an ordering of methods spanning `span`
    (true means equally spaced from 0 to span) with block-level noise `noise_sd`, at this design's
    blocks (`power`), and the blocks needed for `target` power (`blocks_needed`, -1: unknown)."""

    power: float
    blocks_needed: int
    noise_sd: float
    span: float
    n_blocks: int


def friedman_power(
    scores: Any,
    span: float,
    *,
    alpha: float = 0.05,
    target: float = DEFAULT_POWER,
    n_sims: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    max_blocks: int = 200,
) -> FriedmanPower:
    """Simulated power of the Friedman test for a blocks x methods score matrix.

    The noise is the residual spread of the additive model score = block + method + error,
    sqrt(MS_error); simulated data sets draw normal errors around methods equally spaced from 0
    to `span`. NaN power with fewer than 3 methods or 2 blocks."""
    s = np.asarray(scores, dtype=float)
    n, k = s.shape
    nan = float("nan")
    if k < 3 or n < 2:
        return FriedmanPower(nan, -1, nan, span, n)
    resid = s - s.mean(axis=1, keepdims=True) - s.mean(axis=0, keepdims=True) + s.mean()
    noise = float(np.sqrt((resid**2).sum() / ((n - 1) * (k - 1))))
    rng = np.random.default_rng(seed)
    effects = np.linspace(0.0, span, k)

    def power_at(blocks: int) -> float:
        if noise == 0:
            return 1.0 if span > 0 else 0.0
        sims = effects + noise * rng.standard_normal((n_sims, blocks, k))
        return float((_friedman_p(sims) < alpha).mean())

    observed = power_at(n)
    needed = n if observed >= target else -1
    if needed < 0:
        # Doubling then bisection over the number of blocks.
        lo, hi = n, 2 * n
        while hi <= max_blocks and power_at(hi) < target:
            lo, hi = hi, 2 * hi
        if hi <= max_blocks:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if power_at(mid) >= target else (mid, hi)
            needed = hi
        else:
            needed = max_blocks + 1
    return FriedmanPower(observed, needed, noise, span, n)


def within_cluster_spearman(
    x: Any,
    y: Any,
    clusters: Any,
    *,
    confidence: float = 0.95,
    power: float = DEFAULT_POWER,
) -> Difference:
    """Spearman's rho of x and y within each cluster (e.g. across methods within a seed), the
    mean over clusters and its t-interval over the per-cluster rhos (clusters are the
    independent replicates), as a `Difference` (estimate = mean rho, n_seeds = clusters with a
    defined rho, n_items = points per cluster at most). A cluster with < 3 points or a constant
    is left out; fewer than 2 defined clusters give a NaN interval."""
    x, y, c = np.asarray(x, dtype=float), np.asarray(y, dtype=float), np.asarray(clusters)
    if not (x.shape == y.shape == c.shape) or x.ndim != 1:
        raise ValueError("x, y and clusters must be 1-D of equal length")
    rhos, size = [], 0
    for key in dict.fromkeys(c.tolist()):
        sel = c == key
        xs, ys = x[sel], y[sel]
        size = max(size, int(sel.sum()))
        if xs.size >= 3 and np.ptp(xs) > 0 and np.ptp(ys) > 0:
            rhos.append(float(_spearman_rows(xs, ys)))
    if not rhos:
        nan = float("nan")
        return Difference(nan, nan, nan, nan, 0, size, confidence=confidence, power=power)
    result = run_interval(np.array(rhos), confidence=confidence, power=power, n_items=size)
    # A correlation cannot leave [-1, 1]; the t-interval can.
    low = max(-1.0, result.low) if math.isfinite(result.low) else result.low
    high = min(1.0, result.high) if math.isfinite(result.high) else result.high
    return Difference(**{**asdict(result), "low": low, "high": high})
