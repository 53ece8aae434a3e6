"""Statistics for the tables and the claims audit: bootstrap CIs over seeds and items, paired
differences with a bootstrap p-value, Spearman correlation with a bootstrap CI, and a check of
whether a ranking of methods is consistent across blocks (Friedman / Kendall's W).

Seeds (training noise) and evaluation items (test-set noise) are both random draws, so the
intervals resample both axes; a single seed degenerates to the usual item bootstrap.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy import stats

DEFAULT_RESAMPLES = 2000

__all__ = [
    "DEFAULT_RESAMPLES",
    "Correlation",
    "Difference",
    "RankConsistency",
    "block_ranks",
    "bootstrap_p_value",
    "paired_difference",
    "rank_consistency",
    "spearman_ci",
    "two_way_bootstrap_ci",
    "two_way_bootstrap_means",
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
    """Mean of a - b over paired seeds x items cells, its bootstrap CI and two-sided p-value."""

    estimate: float
    low: float
    high: float
    p_value: float
    n_seeds: int
    n_items: int

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
        }


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
